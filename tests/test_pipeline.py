"""Pipeline parallelism: the parallel plan's stages, and the simulator's GPipe schedule."""

import pytest
import yaml

from models.accounting import kv_cache_bytes_per_token, stage_weight_bytes
from models.catalog import get_model
from models.errors import ConfigError
from sim.parallel import ParallelPlan
from sim.plan import MemoryCategory
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from sim.topology import build_topology
from tests.conftest import ROOT, cluster, make_scenario

DEVICES = tuple(f"h{h}/dev{d}" for h in range(2) for d in range(2))


def _scenario(parallel: dict, batch_size: int = 2, output_tokens: int = 4, **overrides):
    workload = {"batch_size": batch_size, "prompt_tokens": 32, "output_tokens": output_tokens}
    return make_scenario(parallel=parallel, workload=workload, **overrides)


def _pipeline(parallel: dict, **overrides) -> ParallelPlan:
    scenario = make_scenario(parallel=parallel, **overrides)
    return ParallelPlan.of(scenario, build_topology(scenario.config.cluster))


def test_layers_split_evenly_into_stages_with_tensor_parallel_groups():
    plan = _pipeline({"tensor": 2, "pipeline": 2})
    assert plan.stages == (6, 6) and plan.stage_first_layers == (0, 6)
    assert plan.stage_ranks == ((0, 1), (2, 3))
    assert _pipeline({"tensor": 1, "pipeline": 4, "stages": [2, 4, 4, 2]}).stages == (2, 4, 4, 2)
    assert ParallelPlan(get_model("gpt2"), DEVICES, tensor=1, pipeline=4).stages == (3, 3, 3, 3)
    assert ParallelPlan(get_model("llama-2-7b"), DEVICES, tensor=1, pipeline=3).stages == (11, 11, 10)


def test_stages_given_as_device_lists_place_the_ranks():
    plan = _pipeline({"stages": [["h1/dev0", "h1/dev1"], ["h0/dev1", "h0/dev0"]]})
    assert (plan.tensor, plan.pipeline) == (2, 2)
    assert plan.stage_ranks == ((2, 3), (1, 0))


def test_balanced_stages_give_the_faster_devices_more_layers():
    mixed = {"switches": [{"name": "sw"}], "hosts": [
        {"name": "fast", "parent": "sw", "nic": {"bandwidth": "10Gbit/s", "latency": "10us"},
         "devices": {"type": "rtx_4090", "count": 1}},
        {"name": "slow", "parent": "sw", "nic": {"bandwidth": "10Gbit/s", "latency": "10us"},
         "devices": {"type": "rtx_3060_12gb", "count": 1}}]}
    plan = _pipeline({"tensor": 1, "pipeline": 2, "stages": "balanced"}, cluster=mixed, model="llama-2-7b")
    assert sum(plan.stages) == 32 and plan.stages[0] > plan.stages[1] >= 1


@pytest.mark.parametrize("parallel,field,needles", [
    ({"tensor": 1, "pipeline": 13}, "parallel.pipeline", ["13 stages", "12 decoder layers"]),
    ({"tensor": 2, "pipeline": 3}, "parallel.pipeline", ["6 ranks", "4 devices"]),
    ({"tensor": 1, "pipeline": 2, "stages": [6, 5]}, "parallel.stages", ["[6, 5]", "sum 11", "12 layers"]),
    ({"tensor": 1, "pipeline": 2, "stages": [12, 0]}, "parallel.stages", ["[12, 0]"]),
    ({"tensor": 2, "pipeline": 2, "stages": [0, 12]}, "parallel.stages", ["[0, 12]", "tensor 2"]),
    ({"tensor": 1, "pipeline": 2, "stages": [4, 4, 4]}, "parallel.stages", ["2 stages"]),
    ({"stages": [["h0/dev0"], ["h9/dev0"]]}, "parallel.stages[1]", ["'h9/dev0'", "h0/dev0"]),
    ({"stages": [["h0/dev0"], ["h1/dev0", "h1/dev1"]]}, "parallel.stages", ["[1, 2]"]),
    ({"stages": [["h0/dev0"], ["h0/dev0"]]}, "parallel.stages[1]", ["h0/dev0", "two stages"]),
    ({"stages": "even"}, "parallel.stages", ["balanced", "'even'"]),
    ({"stages": [[], []]}, "parallel.stages", ["device lists"]),
])
def test_pipeline_errors_name_the_field_and_value(parallel, field, needles):
    with pytest.raises(ConfigError) as error:
        _pipeline(parallel)
    assert error.value.field == field
    assert all(needle in error.value.message for needle in needles), error.value.message


def test_micro_batches_beyond_the_batch_or_without_a_pipeline_are_refused():
    with pytest.raises(ConfigError, match="more micro-batches than the 2 sequences of the batch"):
        simulate(_scenario({"tensor": 1, "pipeline": 2, "micro_batches": 3}))
    with pytest.raises(ConfigError) as error:
        simulate(_scenario({"tensor": 2, "micro_batches": 2}))
    assert error.value.field == "parallel.micro_batches"


def _two_stages(batch_size: int, **overrides):
    """GPT-2 over 2 stages of one device each (two hosts), every variant."""
    return simulate(_scenario({"tensor": 1, "pipeline": 2}, batch_size=batch_size,
                              cluster=cluster(2, 1), **overrides))


def _hops(trace, phase: str, name: str) -> list[float]:
    ops = trace.ops
    rows = ops[(ops["phase"] == phase) & (ops["name"] == name) & (ops["rank"] == 0 if name == "send_hidden"
                                                                   else ops["rank"] == 1)]
    return list(rows["end_s"] - rows["start_s"])


def test_prefill_follows_the_gpipe_schedule():
    """m = 2 micro-batches over P = 2 stages: stage 1 starts micro-batch j once stage 0 has run it
    and sent it (hop h), so TTFT = max(d0 + h + m d1, m d0 + h + d1): (m + P - 1) stage times plus
    the hop for equal stages (GPipe, arXiv 1811.06965)."""
    result = _two_stages(batch_size=2)
    for variant in result.variants:
        prefill = variant.run.simulated[0]
        d0, d1 = prefill.passes[0, 1, 1].duration_s, prefill.passes[1, 1, 1].duration_s
        (h, _) = _hops(variant.trace, "prefill", "send_hidden")
        ttft = variant.timing["ttft_s"]
        assert ttft == pytest.approx(max(d0 + h + 2 * d1, 2 * d0 + h + d1), rel=1e-12)
        # The bubble: stage 1 idles until the first micro-batch has arrived.
        ops = variant.trace.ops
        stage1 = ops[(ops["rank"] == 1) & (ops["phase"] == "prefill") & (ops["kind"] != "send")]
        assert stage1["start_s"].min() == pytest.approx(d0 + h, rel=1e-12)


def _first_step_s(variant) -> float:
    """The first decode step's duration (s)."""
    return float(variant.run.step_end_s[1] - variant.run.step_start_s[1])


def test_batch_one_decode_is_a_relay_through_every_stage_and_back():
    result = _two_stages(batch_size=1, output_tokens=6)
    for variant in result.variants:
        step = variant.run.simulated[1]
        d0, d1 = step.passes[0, 1, 1].duration_s, step.passes[1, 1, 1].duration_s
        (forward,), (back,) = _hops(variant.trace, "decode", "send_hidden"), _hops(variant.trace, "decode", "send_tokens")
        assert _first_step_s(variant) == pytest.approx(d0 + forward + d1 + back, rel=1e-12)
        assert back > 0


def test_decode_micro_batches_keep_every_stage_busy():
    """Two micro-batches over two stages: a step takes the slowest of one micro-batch's trip around
    the ring and each stage's work, less than two trips one after the other."""
    result = _two_stages(batch_size=2, output_tokens=6)
    for variant in result.variants:
        step = variant.run.simulated[1]
        d0, d1 = step.passes[0, 1, 1].duration_s, step.passes[1, 1, 1].duration_s
        forward = _hops(variant.trace, "decode", "send_hidden")[0]
        back = _hops(variant.trace, "decode", "send_tokens")[0]
        trip = d0 + forward + d1 + back
        assert _first_step_s(variant) == pytest.approx(max(trip, 2 * d0, 2 * d1), rel=1e-12)
        assert _first_step_s(variant) < 2 * trip


def test_each_stage_holds_only_its_layers():
    scenario = _scenario({"tensor": 2, "pipeline": 2, "stages": [8, 24]}, model="llama-2-7b",
                         cluster=cluster(2, 2, device="a100_80gb"))
    spec = scenario.model
    variant = simulate(scenario).variants[0]
    peaks = variant.run.peak_by_category
    for rank, layers, embeds, heads in ((0, 8, True, False), (1, 8, False, False), (2, 24, False, True),
                                        (3, 24, False, False)):
        assert peaks[rank][MemoryCategory.WEIGHTS] == stage_weight_bytes(spec, 2, layers, embeds=embeds, heads=heads)
        # The peak is the prefill's (its activations dwarf a decode step's): the prompts' KV cache.
        assert peaks[rank][MemoryCategory.KV_CACHE] == kv_cache_bytes_per_token(spec, 2) // spec.num_layers * layers * 64


def test_a_first_stage_without_layers_only_embeds_and_sends_the_embeddings_on():
    """llama.cpp's RPC client: it keeps the token embeddings and sends them to the servers, which
    hold every layer and the LM head; its ops are the embeddings alone and each decode step pays
    the hop from it and back, where the server alone would not."""
    scenario = _scenario({"tensor": 1, "pipeline": 2, "stages": [0, 32]}, batch_size=1, model="llama-2-7b",
                         cluster=cluster(2, 1, device="a100_80gb", nic="1Gbit/s", nic_latency="1ms"))
    spec = scenario.model
    variant = simulate(scenario).variants[0]
    peaks = variant.run.peak_by_category
    assert peaks[0][MemoryCategory.WEIGHTS] == stage_weight_bytes(spec, 1, 0, embeds=True, heads=False)
    assert peaks[0].get(MemoryCategory.KV_CACHE, 0) == 0
    assert peaks[1][MemoryCategory.WEIGHTS] == stage_weight_bytes(spec, 1, 32, embeds=False, heads=True)
    client = variant.trace.ops[variant.trace.ops["rank"] == 0]
    assert set(client.loc[client["stream"] == "compute", "name"]) == {"embedding"}
    # each decode step relays through the 1 ms link twice (the embedding out, the token back)
    alone = simulate(_scenario({"tensor": 1}, batch_size=1, model="llama-2-7b",
                               cluster=cluster(1, 1, device="a100_80gb")))
    assert variant.timing["tpot_s"] > alone.variants[0].timing["tpot_s"] + 2e-3


def test_a_pipeline_beats_tensor_parallelism_over_a_slow_link():
    """Over 1 ms between hosts, TP pays two collectives per layer per token, a pipeline one hop
    per stage boundary: its decode is faster."""
    slow = cluster(2, 1, nic="1Gbit/s", nic_latency="1ms")
    tp = simulate(_scenario({"tensor": 2}, batch_size=1, cluster=slow))
    pp = simulate(_scenario({"tensor": 1, "pipeline": 2}, batch_size=1, cluster=slow))
    for name in ("rlb", "ring", "rd"):
        assert pp.variant(name).timing["tpot_s"] < tp.variant(name).timing["tpot_s"] / 3


def test_a_single_stage_simulates_as_before():
    assert simulate(_scenario({"tensor": 4, "pipeline": 1})).results.equals(simulate(_scenario({"tensor": 4})).results)


def test_stages_laid_out_alike_share_their_pricing_bit_for_bit(monkeypatch):
    """Four stages on alike hosts: the middle stages' passes and every stage's collectives are
    priced once (sim.alike.group_shape); the results and trace are those of pricing each."""
    import sim.pipeline_run

    scenario = _scenario({"tensor": 2, "pipeline": 4}, batch_size=3, cluster=cluster(4, 2))
    shared = simulate(scenario)
    monkeypatch.setattr(sim.pipeline_run, "group_shape", lambda topology, links, ranks: ranks)
    alone = simulate(scenario)
    assert shared.results.equals(alone.results)
    for a, b in zip(shared.variants, alone.variants):
        assert a.trace.ops.equals(b.trace.ops) and a.trace.memory.equals(b.trace.memory)


def test_variants_compare_layouts_each_as_if_the_scenario_set_it():
    ring = {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}
    layouts = {"tp2_pp2": {"tensor": 2, "pipeline": 2}, "pp4": {"tensor": 1, "pipeline": 4}, "tp2": {"tensor": 2}}
    compared = simulate(_scenario({}, variants=[ring | {"name": name, "parallel": layout}
                                               for name, layout in layouts.items()]))
    rows = compared.results.set_index(["variant", "metric", "device"])["value"]
    for name, layout in layouts.items():
        alone = simulate(_scenario(layout, variants=[ring | {"name": name}])).results
        assert rows.loc[name].equals(alone.set_index(["metric", "device"])["value"]), name
    assert len(compared.ranks) == 4  # every device some variant runs on


def test_a_variant_layout_error_names_the_variant():
    variants = [{"name": "a", "strategy": "reduce_ln_bcast"},
                {"name": "b", "strategy": "reduce_ln_bcast", "parallel": {"tensor": 1, "pipeline": 13}}]
    with pytest.raises(ConfigError) as error:
        simulate(_scenario({"tensor": 2}, variants=variants))
    assert error.value.field == "variants[1].parallel.pipeline"


def test_the_runtime_refuses_to_measure_a_pipeline_it_cannot_yet():
    scenario = _scenario({"tensor": 1, "pipeline": 2})
    with pytest.raises(ConfigError) as error:
        ParallelPlan.of(scenario, build_topology(scenario.config.cluster)).tensor_ranks
    assert error.value.field == "parallel.pipeline"


def test_a_sweep_refuses_variants_with_their_own_layout():
    variants = [{"name": "a", "strategy": "reduce_ln_bcast", "parallel": {"tensor": 1, "pipeline": 2}}]
    with pytest.raises(ConfigError) as error:
        make_scenario(variants=variants, sweep={"devices": [2, 4]})
    assert error.value.field == "variants[0].parallel"


def test_balanced_stages_move_layers_off_a_device_they_would_overflow():
    """An H100 with 8 GiB next to an RTX 3060 12GB: by compute it would take 31 of Llama-2-7B's 32
    layers (13 GB); balanced keeps what fits on it and hands the rest to the slower device."""
    host = {"parent": "sw", "nic": {"bandwidth": "10Gbit/s", "latency": "10us"}}
    mixed = {"switches": [{"name": "sw"}], "hosts": [
        host | {"name": "fast", "devices": {"type": "h100_sxm", "count": 1, "memory": "8GiB"}},
        host | {"name": "slow", "devices": {"type": "rtx_3060_12gb", "count": 1}}]}
    plan = _pipeline({"tensor": 1, "pipeline": 2, "stages": "balanced"}, cluster=mixed, model="llama-2-7b")
    spec = get_model("llama-2-7b")
    assert stage_weight_bytes(spec, 1, plan.stages[0], embeds=True, heads=False) <= 8 * 2**30
    assert stage_weight_bytes(spec, 1, plan.stages[0] + 1, embeds=True, heads=False) > 8 * 2**30
    assert plan.stages[0] > plan.stages[1]


def _cpu_pipeline(batch_size: int, cores: int):
    """GPT-2 over 2 one-rank stages whose CPU ranks run on one machine of ``cores`` cores (the
    emulated cluster; 2 cores: a core each, nothing shared)."""
    data = yaml.safe_load((ROOT / "validation/plan-check-report/replicas/scenarios/c161.yaml").read_text())
    data["cluster"]["hosts"][0]["devices"]["count"] = 2
    data["cluster"]["cores"] = cores
    data["workload"]["batch_size"] = batch_size
    data["parallel"] = {"tensor": 1, "pipeline": 2}
    return simulate(scenario_from_dict(data, base_dir=ROOT)).variants[0]


def test_stages_computing_at_once_on_one_machine_share_its_cores():
    # a batch-1 relay: one stage computes at a time, each pass as priced alone
    relay = _cpu_pipeline(1, 1)
    passes = relay.run.simulated[1].passes
    (forward,), (back,) = _hops(relay.trace, "decode", "send_hidden"), _hops(relay.trace, "decode", "send_tokens")
    assert _first_step_s(relay) == pytest.approx(passes[0, 1, 1].duration_s + forward + passes[1, 1, 1].duration_s
                                                 + back, rel=1e-12)
    assert passes[0, 1, 2].duration_s > passes[0, 1, 1].duration_s
    shared, own = _cpu_pipeline(2, 1), _cpu_pipeline(2, 2)
    step = shared.run.simulated[1]
    # two stages computing on one core: each pass at half of it (processor sharing)
    for s in range(2):
        assert step.passes[s, 1, 2].duration_s == pytest.approx(2 * step.passes[s, 1, 1].duration_s, rel=0.01)
    # two micro-batches keep both stages busy part of the step: slower than a core each, faster than in turns
    assert own.timing["tpot_s"] * 1.2 < shared.timing["tpot_s"] < 2 * own.timing["tpot_s"]
    assert own.timing["ttft_s"] < shared.timing["ttft_s"]
