"""Uneven tensor parallelism: heads in whole KV-head groups (or one group's heads with its KV head
replicated), MLP columns by weight; the accounting, the simulator and the runtime follow the shards,
and the runtime's tokens equal the single-process reference."""

from __future__ import annotations

import json
import time

import pytest

from models.accounting import (kv_cache_bytes_per_token, layer_block_weight_bytes, layer_op_costs, parameter_count,
                               rank_parameter_count, rank_weight_bytes)
from models.catalog import get_model
from models.errors import ConfigError
from models.ops import OpKind
from models.shards import apportion, tensor_shards
from sim.parallel import ParallelPlan
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import ROOT, cluster, scenario_dict, tiny_model_config

QWEN_7B = get_model("qwen2.5-7b")  # 28 query heads, 4 KV heads (groups of 7), 18944 MLP columns


def test_qwen_7b_on_six_devices_is_refused_evenly_and_accepted_with_shares():
    with pytest.raises(ConfigError, match="does not divide 28 attention heads; set parallel.shares"):
        ParallelPlan(QWEN_7B, tuple(f"d{i}" for i in range(6)), tensor=6)
    shards = ParallelPlan(QWEN_7B, tuple(f"d{i}" for i in range(6)), tensor=6, shares=(1.0,) * 6).shards
    # Six ranks over four groups: the first two groups take two ranks each, every rank one KV head.
    assert [len(s.query_heads) for s in shards] == [4, 3, 4, 3, 7, 7]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2), range(2, 3),
                                            range(3, 4)]
    assert sum(len(s.mlp_columns) for s in shards) == 18944
    assert [h for s in shards for h in s.query_heads] == list(range(28))


def test_a_weak_device_shares_its_group_with_a_strong_one():
    rtx_4090, rtx_3060 = 165.2, 25.5
    shards = tensor_shards(QWEN_7B, 6, (rtx_4090, rtx_4090, rtx_3060, rtx_3060, rtx_4090, rtx_4090))
    # Groups of 1, 2, 2, 1 ranks: each RTX 3060 pairs with an RTX 4090, which takes most heads.
    assert [len(s.query_heads) for s in shards] == [7, 6, 1, 1, 6, 7]
    assert [len(s.mlp_columns) for s in shards][1:3] == [4397, 678]


def test_fewer_ranks_than_kv_heads_take_whole_groups_by_weight():
    shards = tensor_shards(QWEN_7B, 3, (2.0, 1.0, 1.0))
    assert [s.kv_heads for s in shards] == [range(0, 2), range(2, 3), range(3, 4)]
    assert [s.query_heads for s in shards] == [range(0, 14), range(14, 21), range(21, 28)]
    assert [len(s.mlp_columns) for s in shards] == [9472, 4736, 4736]


def test_the_even_split_is_todays_split():
    spec = get_model("llama-3.1-8b")
    for tp in (1, 2, 4, 8, 16):
        for rank, shard in enumerate(tensor_shards(spec, tp)):
            width = 32 // tp
            assert shard.query_heads == range(rank * width, (rank + 1) * width)
            assert len(shard.kv_heads) == max(1, 8 // tp)
            assert shard.mlp_columns == range(rank * 14336 // tp, (rank + 1) * 14336 // tp)
        assert tensor_shards(spec, tp) == tensor_shards(spec, tp, (3.0,) * tp)


@pytest.mark.parametrize("units, weights, counts", [
    (10, (1, 1, 1), (4, 3, 3)),
    (7, (100, 1, 1), (5, 1, 1)),  # at least one each, taken from the most over-served
    (4, (1, 1, 1, 1), (1, 1, 1, 1)),
    (28, (165.2, 25.5), (24, 4)),
])
def test_apportion_by_largest_remainder(units, weights, counts):
    assert apportion(units, weights) == counts


@pytest.mark.parametrize("tp, weights, field, needle", [
    (3, (1.0, 1.0), "parallel.shares", "one weight per tensor-parallel rank, 3 (got 2)"),
    (2, (1.0, 0.0), "parallel.shares", "positive finite"),
    (2, (1.0, float("nan")), "parallel.shares", "positive finite"),
    (29, (1.0,) * 29, "parallel.tensor", "29 ranks but only 28 attention heads"),
])
def test_shares_that_do_not_fit_are_refused(tp, weights, field, needle):
    with pytest.raises(ConfigError) as error:
        tensor_shards(QWEN_7B, tp, weights)
    assert error.value.field == field and needle in error.value.message


def test_per_rank_accounting_follows_the_shards():
    shards = tensor_shards(QWEN_7B, 6, (2.0, 1.0, 1.0, 1.0, 1.0, 1.0))
    params = [rank_parameter_count(QWEN_7B, 6, is_master=False, shard=s) for s in shards]
    # The ranks together hold the model once, plus the replicated norms, row biases and KV heads.
    kv_weights = 2 * QWEN_7B.hidden_size * QWEN_7B.head_dim + 2 * QWEN_7B.head_dim  # k, v and their biases
    replicated = QWEN_7B.num_layers * (5 * 2 * QWEN_7B.hidden_size + 2 * kv_weights)  # 2 norms x 6 ranks - 2
    master_only = rank_parameter_count(QWEN_7B, 6, is_master=True, shard=shards[0]) - params[0]
    assert sum(params) + master_only == parameter_count(QWEN_7B) + replicated
    costs = [layer_op_costs(QWEN_7B, tp_degree=6, batch_size=1, new_tokens=8, context_tokens=8, shard=s)
             for s in shards]
    mlp_flops = [c[OpKind.MLP_DOWN].flops for c in costs]
    assert mlp_flops[0] == pytest.approx(2 * mlp_flops[1], rel=1e-3)
    assert kv_cache_bytes_per_token(QWEN_7B, 6, shard=shards[0]) == kv_cache_bytes_per_token(QWEN_7B, 4)


def _scenario(**parallel):
    devices = {"type": "rtx_4090", "count": 3}
    host = {"name": "h0", "interconnect": {"bandwidth": "32GB/s", "latency": "2us"}, "devices": devices}
    return scenario_from_dict(scenario_dict(model="qwen2.5-0.5b", cluster={"hosts": [host]}, parallel=parallel,
                                            workload={"batch_size": 1, "prompt_tokens": 64, "output_tokens": 4}),
                              base_dir=ROOT)


def test_the_simulator_prices_each_rank_by_its_shard_and_keeps_the_collectives_full_size():
    result = simulate(_scenario(tensor=3, shares=[1, 3, 1]))
    ops = result.variants[0].trace.ops
    prefill = ops[(ops["step"] == 0) & (ops["layer"] == 0)]
    mlp = prefill[prefill["name"] == "mlp_up"].set_index("rank")
    assert mlp.loc[1, "flops"] > 2.5 * mlp.loc[0, "flops"]
    assert mlp.loc[0, "flops"] == mlp.loc[2, "flops"]
    assert mlp.loc[1, "end_s"] - mlp.loc[1, "start_s"] > 1.5 * (mlp.loc[2, "end_s"] - mlp.loc[2, "start_s"])
    comm = prefill[prefill["stream"] == "comm"]
    assert comm["bytes"].nunique() == 1  # [batch, tokens, hidden] on every rank, whatever the shard
    peaks = result.results.query("metric == 'peak_memory_bytes' and variant == 'rlb'").set_index("device")["value"]
    assert peaks["h0/dev1"] > peaks["h0/dev2"]


def test_shares_from_compute_or_memory_follow_the_devices():
    host = {"name": "h0", "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
            "devices": {"type": "rtx_4090", "count": 2, "memory": "12GiB"}}
    data = scenario_dict(model="qwen2.5-0.5b", cluster={"hosts": [host]}, parallel={"shares": "memory"})
    from sim.topology import build_topology
    scenario = scenario_from_dict(data, base_dir=ROOT)
    plan = ParallelPlan.of(scenario, build_topology(scenario.config.cluster))
    assert plan.shares == (12 * 2**30, 12 * 2**30)
    for bad, needle in (("speed", "unknown basis; known: compute, memory"), ([1, -2], "every weight"),
                        ([True, 1], "every weight")):
        data["parallel"] = {"shares": bad}
        with pytest.raises(ConfigError, match=needle) as error:
            scenario_from_dict(data, base_dir=ROOT)
        assert error.value.field == "parallel.shares"


def _tiny_uneven_scenario(tmp_path, shares):
    config = tmp_path / "llama.config.json"
    config.write_text(json.dumps(tiny_model_config("llama", num_layers=2)))  # 8 heads, 2 KV heads, MLP 128
    return scenario_from_dict(scenario_dict(model=str(config), dtype="fp32", cluster=cluster(1, 3, device="cpu"),
                                            parallel={"shares": shares},
                                            workload={"batch_size": 2, "prompt_tokens": 5, "output_tokens": 4}),
                              base_dir=ROOT)


def test_three_uneven_gloo_ranks_generate_the_reference_tokens(tmp_path):
    torch = pytest.importorskip("torch")
    from runtime.comm import Communicator
    from runtime.executor import Executor
    from runtime.launch import launch
    from runtime.model import RankModel, reference_generate
    from runtime.weights import prompt_tokens
    from sim.plan import Plan, StrategyChoice
    from sim.topology import build_topology

    scenario = _tiny_uneven_scenario(tmp_path, [3, 1, 2])
    spec, work = scenario.model, scenario.config.workload
    topology = build_topology(scenario.config.cluster)
    parallel = ParallelPlan.of(scenario, topology)
    # Rank 0 holds group 0; ranks 1 and 2 split group 1 (1 + 3 heads) and share its KV head.
    assert [len(s.query_heads) for s in parallel.shards] == [4, 1, 3]
    assert [s.kv_heads for s in parallel.shards] == [range(0, 1), range(1, 2), range(1, 2)]
    prompt = prompt_tokens(spec, work.batch_size, work.prompt_tokens, seed=7)
    choices = (StrategyChoice("allreduce_ln", allreduce="ring", broadcast="binomial"),
               StrategyChoice("reduce_ln_bcast", reduce="binomial", broadcast="binomial"))

    def body(rank, heartbeat):
        model = RankModel(spec, 3, rank, seed=7, batch_size=work.batch_size,
                          max_tokens=work.prompt_tokens + work.output_tokens, shard=parallel.shards[rank])
        out = []
        for choice in choices:
            plan = Plan(spec, parallel.tensor_ranks, work.batch_size, work.prompt_tokens, work.output_tokens, choice,
                        shards=parallel.shards)
            generation = Executor(plan, model, Communicator(rank, topology.host_groups), rank).generate(
                prompt, time.perf_counter())
            out.append(torch.stack(generation.tokens, 1) if rank == 0 else None)
        return out

    tokens, _ = reference_generate(spec, seed=7, prompt=prompt, output_tokens=work.output_tokens)
    for got in launch(body, 3, hang_timeout_s=60)[0]:
        assert torch.equal(got, tokens)


def test_hetsim_measure_runs_an_uneven_split_with_each_rank_holding_its_shard(tmp_path):
    pytest.importorskip("torch")
    from runtime.measure import measure_scenario

    scenario = _tiny_uneven_scenario(tmp_path, [1, 1, 6])
    measured = measure_scenario(scenario, repeats=1, warmup=0, hang_timeout_s=60).results
    simulated = simulate(scenario).results
    joined = simulated.merge(measured, on=["variant", "metric", "device"], suffixes=("_sim", "_meas"))
    assert set(joined["metric"]) >= {"ttft_s", "tpot_s", "peak_memory_bytes"}
    assert (measured.loc[measured["metric"] == "ttft_s", "value"] > 0).all()


@pytest.mark.parametrize("model_type, weights", [("llama", (1, 2, 3, 1)), ("llama", (5, 1)), ("gpt2", (3, 1)),
                                                 ("gpt2", (1, 1, 2))])
def test_uneven_shards_in_one_process_hold_what_the_accounting_counts_and_match_the_reference(
        tmp_path, model_type, weights):
    torch = pytest.importorskip("torch")
    from models.catalog import load_hf_config
    from runtime.model import RankModel, reference_generate, tensor_parallel_generate
    from runtime.weights import prompt_tokens

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_model_config(model_type, num_layers=2)))
    spec = load_hf_config(path)
    shards = tensor_shards(spec, len(weights), weights)
    for index, shard in enumerate(shards):
        model = RankModel(spec, len(weights), index, seed=3, batch_size=1, max_tokens=4, shard=shard)
        assert model.weight_bytes == rank_weight_bytes(spec, len(weights), is_master=index == 0, shard=shard)
    prompt = prompt_tokens(spec, 2, 5, seed=3)
    tokens, _ = reference_generate(spec, seed=3, prompt=prompt, output_tokens=3)
    got, _ = tensor_parallel_generate(spec, len(weights), seed=3, prompt=prompt, output_tokens=3, shards=shards)
    assert torch.equal(got, tokens)


def test_streamed_weights_follow_each_ranks_shard():
    host = {"name": "h0", "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
            "storage": {"bandwidth": "2GB/s", "latency": "100us"}, "devices": {"type": "rtx_4090", "count": 3}}
    data = scenario_dict(model="qwen2.5-0.5b", cluster={"hosts": [host]}, parallel={"shares": [1, 3, 1]},
                         memory={"policy": "sliding_window", "window": 1},
                         workload={"batch_size": 1, "prompt_tokens": 16, "output_tokens": 2})
    result = simulate(scenario_from_dict(data, base_dir=ROOT))
    ops = result.variants[0].trace.ops
    loaded = ops[ops["kind"] == "weight_load"].groupby("rank")["bytes"].sum()
    # Every pass streams each rank's blocks once: the bytes follow each rank's shard of a layer.
    shards = ParallelPlan.of(result.scenario, result.topology).shards
    per_layer = [sum(layer_block_weight_bytes(result.scenario.model, 3, shard=s).values()) for s in shards]
    assert len(set(per_layer)) == 3
    assert [loaded[r] / per_layer[r] for r in range(3)] == pytest.approx([loaded[0] / per_layer[0]] * 3)


MIXED_HOST = {"name": "h0", "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
              "devices": [{"type": "rtx_4090", "count": 3}, {"type": "rtx_3060_12gb", "count": 3}]}
DECODE_HEAVY = {"batch_size": 1, "prompt_tokens": 512, "output_tokens": 128}
PREFILL_HEAVY = {"batch_size": 16, "prompt_tokens": 4000, "output_tokens": 2}


def _mixed_plan(workload: dict, **parallel) -> ParallelPlan:
    """Qwen2.5-7B (28 heads, 4 KV heads) on 3 RTX 4090 + 3 RTX 3060 12GB: TP 6 splits unevenly."""
    from sim.topology import build_topology
    scenario = scenario_from_dict(scenario_dict(model="qwen2.5-7b", dtype="bf16", cluster={"hosts": [MIXED_HOST]},
                                                workload=workload, parallel=parallel), base_dir=ROOT)
    return ParallelPlan.of(scenario, build_topology(scenario.config.cluster))


def test_without_shares_an_uneven_degree_splits_by_compute_for_prefill_and_by_memory_for_decode():
    decode, prefill = _mixed_plan(DECODE_HEAVY), _mixed_plan(PREFILL_HEAVY)
    assert decode.shares_note.startswith("uneven shares by memory (default: decode-heavy workload, prefill ")
    assert prefill.shares_note.startswith("uneven shares by compute (default: prefill-heavy workload, prefill ")
    assert decode.label == prefill.label == "TP=6 uneven"
    # An RTX 4090 has 2x an RTX 3060's memory but 6.5x its compute: the 3060s hold more of the MLP
    # by memory than by compute (their query heads are one group's 7 either way, 3, 2 and 2).
    columns = {name: [len(s.mlp_columns) for s in plan.shards] for name, plan in (("memory", decode),
                                                                                  ("compute", prefill))}
    assert columns == {"memory": [4210, 4210, 4209, 2105, 2105, 2105], "compute": [5470, 5470, 5470, 845, 845, 844]}
    # What the scenario wins over the default: shares written, a basis or weights.
    written = _mixed_plan(PREFILL_HEAVY, shares="memory")
    assert written.shards == decode.shards and written.shares_note == "uneven shares by memory (parallel.shares)"
    assert _mixed_plan(DECODE_HEAVY, shares=[1] * 6).shards == tensor_shards(QWEN_7B, 6, (1.0,) * 6)


def test_mixed_devices_whose_degree_divides_the_heads_keep_the_even_split():
    host = MIXED_HOST | {"devices": [{"type": "rtx_4090", "count": 2}, {"type": "rtx_3060_12gb", "count": 2}]}
    from sim.topology import build_topology
    scenario = scenario_from_dict(scenario_dict(model="qwen2.5-7b", dtype="bf16", cluster={"hosts": [host]},
                                                workload=DECODE_HEAVY), base_dir=ROOT)
    plan = ParallelPlan.of(scenario, build_topology(scenario.config.cluster))
    assert plan.shares is None and plan.shards is None and plan.shares_note is None and plan.label == "TP=4"


def test_a_serving_workload_weighs_its_mean_request_alone():
    from sim.parallel import ShareBasis, workload_share_basis
    from sim.serving.config import ServingWorkload
    from sim.topology import build_topology
    devices = build_topology(scenario_from_dict(scenario_dict(cluster={"hosts": [MIXED_HOST]}),
                                                base_dir=ROOT).config.cluster).devices
    for prompt, output, basis in ((512, 128, ShareBasis.MEMORY), (16_000, 8, ShareBasis.COMPUTE)):
        workload = ServingWorkload(kind="serving", rate_per_s=1.0, prompt_tokens=prompt, output_tokens=output)
        assert workload_share_basis(workload, QWEN_7B, devices)[0] == basis


def test_a_scenario_on_six_devices_of_a_28_head_model_simulates_by_the_default_and_says_so(tmp_path, capsys):
    import yaml

    from tests.test_cli import _run
    host = {"name": "h0", "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
            "devices": {"type": "rtx_4090", "count": 6}}
    data = scenario_dict(model="qwen2.5-7b", dtype="bf16", cluster={"hosts": [host]},
                         workload={"batch_size": 1, "prompt_tokens": 16, "output_tokens": 4},
                         variants=[{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])
    path = tmp_path / "six.yaml"
    path.write_text(yaml.safe_dump(data))
    code, stdout, stderr = _run(["simulate", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, stderr
    text = " ".join(stdout.split())  # the terminal wraps long lines
    assert "uneven shares by memory (default: decode-heavy workload, prefill" in text
    # Six equal devices: the first two groups of 7 heads shared by two devices each.
    assert "h0/dev0: q 0-3 kv 0-0" in text and "h0/dev5: q 21-27 kv 3-3" in text
