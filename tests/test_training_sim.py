"""Data-parallel training in the simulator (sim/training/): DDP's buckets, overlap, accumulation,
checkpointing, averaging, compression, ZeRO-1, as a user comparing variants relies on them."""

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from models.accounting import layer_op_costs
from models.catalog import get_model, load_hf_config
from models.ops import OpKind
from sim.scenario import scenario_from_dict
from sim.training.buckets import bucket_assignment
from sim.training.metrics import STEP_TERMS, bottleneck
from sim.training.lower import StepShape, _Lowering
from sim.training.simulate import simulate_training
from sim.training_config import MIB, TrainingSettings
from sim.vocabulary import Metric, TrainingPhase
from validation.cli import main


def _scenario(variants, *, hosts=4, bandwidth="1Gbit/s", latency="100us", training=None, parallel=None,
              devices_per_host=1, device="cpu", sequence_length=64, global_batch=4, micro=1, network="flow",
              nic_per_device=False):
    return scenario_from_dict({
        "name": "train_test", "model": "gpt2",
        "cluster": {"switches": [{"name": "sw"}],
                    "hosts": [{"name": "h{i}", "count": hosts, "parent": "sw",
                               "nic": {"bandwidth": bandwidth, "latency": latency}, "nic_per_device": nic_per_device,
                               "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
                               "devices": {"type": device, "count": devices_per_host, "memory": "16GiB"}}]},
        "parallel": parallel or {},
        "workload": {"kind": "training", "global_batch_size": global_batch, "micro_batch_size": micro,
                     "sequence_length": sequence_length},
        "training": training or {"optimizer": "adamw"},
        "network_model": network,
        "variants": variants,
    })


def _metric(result, variant, metric):
    return result.variant(variant).metrics[metric]


def _collectives(vr, name_prefix="", step=-1):
    """(count, bytes) of the collective calls of a variant's simulated step ``step`` (the last:
    the averaging one) as rank 0 makes them, segment repeats included."""
    step = vr.steps[step].step
    count = size = 0
    for part in step.segments:
        for op in part.segment.programs[0]:
            if op.collective is not None and op.name.startswith(name_prefix):
                count += part.segment.repeat
                size += part.segment.repeat * op.collective.size_bytes
    return count, size


def test_buckets_equal_ddps_assignment_for_gpt2s_parameters():
    """The reducer's own function (torch's C++ compute_bucket_assignment_by_size), on the parameter
    list in gradient-ready order, with DDP's limits: first bucket 1 MiB, then 25 MiB."""
    shape = StepShape(get_model("gpt2").with_dtype("fp32"), TrainingSettings(), 1, 64, 1, ((0,), (1,)))
    ready = _Lowering(shape).ready_parameters()
    tensors = [torch.empty(param.numel, device="meta") for param, _ in ready]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, [MIB, 25 * MIB], [False] * len(tensors))
    ours = bucket_assignment([param.numel * 4 for param, _ in ready], [MIB, 25 * MIB])
    assert ours == [list(b) for b in expected]
    assert len(ours) > 5 and ready[0][0].name == "final_norm.weight"  # reverse order: the head's first


@pytest.mark.parametrize("tied", [True, False])
def test_buckets_are_those_ddp_forms_over_the_order_autograd_readies_the_gradients(tied):
    """DDP rebuilds its buckets over the order the gradients became ready in the first backward;
    that order, recorded on the runtime's model (biases before weights, the position table before
    the token table), gives the simulator's buckets at every cap (the shipped training report
    measured these sizes: 1, 5 and 25 MiB on the tiny GPT-2)."""
    from runtime.training.model import DecoderLM, next_token_loss

    spec = load_hf_config(Path(__file__).resolve().parent.parent / "scenarios/validation/models/tiny_gpt2.json")
    spec = dataclasses.replace(spec, tied_embeddings=tied)
    model, ready = DecoderLM(spec, 0), []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready.append(p.numel() * 4))
    tokens = torch.zeros((1, 9), dtype=torch.long)
    next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    shape = StepShape(spec, TrainingSettings(), 1, 8, 1, ((0,), (1,)))
    ours = [param.numel * 4 for param, _ in _Lowering(shape).ready_parameters()]
    for cap in (1, 5, 25):
        limits = [MIB, cap * MIB]
        assert ([sum(ours[i] for i in b) for b in bucket_assignment(ours, limits)]
                == [sum(ready[i] for i in b) for b in bucket_assignment(ready, limits)])


def test_a_bucket_closes_at_its_limit_the_crossing_parameter_included():
    assert bucket_assignment([MIB // 2, MIB // 2, 10, 25 * MIB, 3], [MIB, 25 * MIB]) == [[0, 1], [2, 3], [4]]


def test_overlap_beats_no_overlap_and_the_gain_vanishes_on_infinitely_fast_links():
    variants = [{"name": "on"}, {"name": "off", "training": {"overlap": False}}]
    slow = simulate_training(_scenario(variants, bandwidth="10Gbit/s", sequence_length=512))
    gain = _metric(slow, "off", Metric.STEP_TIME) / _metric(slow, "on", Metric.STEP_TIME)
    assert _metric(slow, "on", Metric.COMMUNICATION_TIME) > _metric(slow, "on", Metric.BACKWARD_TIME) / 2
    assert gain > 1.2
    assert _metric(slow, "on", Metric.OVERLAP_RATIO) > _metric(slow, "off", Metric.OVERLAP_RATIO)
    # What stays on infinitely fast links is the reductions' memory traffic (gamma), no link time.
    fast = simulate_training(_scenario(variants, bandwidth="8000000Tbit/s", latency="0s", network="alpha_beta",
                                       sequence_length=512))
    fast_gain = _metric(fast, "off", Metric.STEP_TIME) / _metric(fast, "on", Metric.STEP_TIME)
    assert fast_gain - 1 < (gain - 1) / 4


def test_an_intermediate_bucket_size_wins_on_a_latency_bound_link():
    variants = [{"name": f"b{cap}", "training": {"bucket_cap_mb": cap, "first_bucket_mb": cap}}
                for cap in (0.25, 100, 1000)]
    result = simulate_training(_scenario(variants, bandwidth="10Gbit/s", latency="1ms", sequence_length=512))
    tiny, middle, huge = (_metric(result, v["name"], Metric.STEP_TIME) for v in variants)
    assert middle < tiny and middle < huge
    assert _collectives(result.variant("b0.25"))[0] > 10 * _collectives(result.variant("b100"))[0] > 0
    assert _collectives(result.variant("b1000"))[0] == 1


@pytest.mark.parametrize("no_sync, calls_per_bucket", [(True, 1), (False, 4)])
def test_no_sync_allreduces_once_per_step_and_naive_accumulation_every_micro_batch(no_sync, calls_per_bucket):
    variants = [{"name": "k1", "training": {"gradient_accumulation": 1}},
                {"name": "k4", "training": {"gradient_accumulation": 4, "no_sync": no_sync}}]
    result = simulate_training(_scenario(variants, global_batch=16))  # 4 ranks: k1 takes micro-batches of 4
    k1, k4 = result.variant("k1"), result.variant("k4")
    assert (k4.accumulation, k4.micro_batch_size) == (4, 1) and k1.micro_batch_size == 4
    buckets, _ = _collectives(k1, "bucket")
    assert _collectives(k4, "bucket")[0] == calls_per_bucket * buckets


def test_checkpointing_adds_the_recomputed_forward_and_lowers_activation_memory():
    result = simulate_training(_scenario([{"name": "off"}, {"name": "every2", "training": {
        "activation_checkpointing": 2}}]))
    off, on = result.variant("off"), result.variant("every2")
    spec = get_model("gpt2").with_dtype("fp32")
    layer = layer_op_costs(spec, tp_degree=1, batch_size=1, new_tokens=64, context_tokens=64)
    forward_layer = sum(c.flops for c in layer.values()) + layer[OpKind.LAYERNORM].flops  # two norms a layer
    ops_off, ops_on = (v.trace.ops[v.trace.ops["rank"] == 0] for v in (off, on))
    extra = ops_on["flops"].sum() - ops_off["flops"].sum()
    assert extra == pytest.approx(spec.num_layers * forward_layer, rel=1e-12)
    assert ops_on.loc[ops_on["phase"] == TrainingPhase.RECOMPUTE, "flops"].sum() == pytest.approx(extra, rel=1e-12)
    assert on.memory[0].activations < 0.6 * off.memory[0].activations  # the logits stay
    assert _metric(result, "every2", Metric.RECOMPUTE_TIME) > 0 == _metric(result, "off", Metric.RECOMPUTE_TIME)


def test_parameter_averaging_with_period_h_communicates_one_step_in_h():
    variants = [{"name": "h1", "training": {"averaging": "parameters", "averaging_period": 1}},
                {"name": "h4", "training": {"averaging": "parameters", "averaging_period": 4}},
                {"name": "ddp"}]
    result = simulate_training(_scenario(variants))
    h4 = result.variant("h4")
    assert len(h4.steps) == 2 and _collectives(h4)[0] == 1  # local steps, then the averaging one
    assert _collectives(h4, step=0) == (0, 0)
    assert _metric(result, "h4", Metric.COMMUNICATION_TIME) == pytest.approx(
        _metric(result, "h1", Metric.COMMUNICATION_TIME) / 4, rel=1e-9)
    assert _metric(result, "h4", Metric.STEP_TIME) < _metric(result, "h1", Metric.STEP_TIME)
    assert _collectives(result.variant("ddp"), "bucket")[0] > 1


def test_fp16_compression_halves_the_allreduce_bytes_and_adds_casts():
    result = simulate_training(_scenario([{"name": "none"}, {"name": "fp16", "training": {
        "gradient_compression": "fp16"}}]))
    none, fp16 = result.variant("none"), result.variant("fp16")
    assert _collectives(fp16, "bucket")[1] * 2 == _collectives(none, "bucket")[1]
    kinds = set(fp16.trace.ops["kind"])
    assert OpKind.GRADIENT_CAST in kinds and OpKind.GRADIENT_CAST not in set(none.trace.ops["kind"])
    assert _metric(result, "fp16", Metric.STEP_TIME) < _metric(result, "none", Metric.STEP_TIME)


def test_zero1_shards_optimizer_states_by_the_data_degree_and_broadcasts_parameters():
    result = simulate_training(_scenario([{"name": "ddp"}, {"name": "zero1", "training": {"zero": 1}}]))
    ddp, zero = result.variant("ddp"), result.variant("zero1")
    assert zero.memory[1].optimizer_states * 4 == pytest.approx(ddp.memory[1].optimizer_states)
    assert zero.memory[1].weights == ddp.memory[1].weights
    assert _collectives(zero, "zero_broadcast")[0] == 4 and _collectives(ddp, "zero_broadcast")[0] == 0


def test_trace_shows_backward_compute_and_bucket_allreduces_overlapping():
    result = simulate_training(_scenario([{"name": "on"}], bandwidth="10Gbit/s"))
    ops = result.variants[0].trace.ops
    rank = ops[ops["rank"] == 1]
    buckets = rank[(rank["kind"] == OpKind.ALLREDUCE) & (rank["stream"] == "comm")]
    backward = rank[(rank["phase"] == TrainingPhase.BACKWARD) & (rank["stream"] == "compute")]
    overlapping = [b for b in buckets.itertuples() if ((backward["start_s"] < b.end_s)
                                                       & (backward["end_s"] > b.start_s)).any()]
    assert len(overlapping) >= 2


def test_tensor_inside_hosts_and_data_across_them_share_the_nics():
    """TP 2 inside each of 2 hosts, DP 2 across: two DP groups' buckets cross one NIC per host."""
    base = _scenario([{"name": "tp2dp2", "allreduce": "ring"}], hosts=2, devices_per_host=2,
                     parallel={"tensor": 2, "data": 2}, bandwidth="10Gbit/s", global_batch=2)
    result = simulate_training(base)
    vr = result.variants[0]
    assert result.plan.replica_ranks == ((0, 1), (2, 3))
    ops = vr.trace.ops
    assert set(ops.loc[ops["name"] == "bucket0_allreduce", "rank"]) == {0, 1, 2, 3}
    assert (ops["name"] == "mlp_grad_allreduce").sum() == 4 * 12
    assert vr.metrics[Metric.STEP_TIME] > 0 and len(vr.steps[-1].step.buckets) == 2


def test_outputs_are_deterministic_and_tidy(tmp_path, capsys):
    scenario = _scenario([{"name": "a"}, {"name": "b", "training": {"bucket_cap_mb": 5}}])
    first, second = simulate_training(scenario), simulate_training(scenario)
    pd.testing.assert_frame_equal(first.results, second.results)
    pd.testing.assert_frame_equal(first.variants[1].trace.ops, second.variants[1].trace.ops)
    metrics = set(first.results["metric"])
    assert {Metric.STEP_TIME, Metric.SAMPLES_PER_S, Metric.TOKENS_PER_S, Metric.EXPOSED_COMMUNICATION,
            Metric.OVERLAP_RATIO, Metric.PEAK_MEMORY_OPTIMIZER_STATES, Metric.PEAK_MEMORY_ACTIVATIONS} <= metrics
    units = dict(zip(first.results["metric"], first.results["unit"]))
    assert units[Metric.SAMPLES_PER_S] == "samples/s" and units[Metric.OVERLAP_RATIO] == "ratio"


def test_hetsim_simulate_writes_the_training_report(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text((__import__("pathlib").Path(__file__).parent / "data" / "training_small.yaml").read_text())
    out = tmp_path / "out"
    main(["simulate", str(path), "--out", str(out)])
    stdout = capsys.readouterr().out
    assert "step s" in stdout and "b1" in stdout and "Use base: the shortest optimizer step of the 3" in stdout
    results = pd.read_csv(out / "results.csv")
    assert (results["source"] == "simulated").all() and set(results["variant"]) == {"base", "b1", "acc"}
    assert (results["calibration"] == "uncalibrated").all()
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("cat") == "allreduce" and e["tid"] == 2 for e in trace["traceEvents"])
    page = (out / "report.html").read_text()
    assert "Step time per variant" in page and "<p class='answer'>Use base: " in page


def test_the_engine_runs_a_training_step_without_simpy_to_the_same_bits():
    """A backward segment with bucket allreduces on a second stream (``Op.after``), run by the
    dependency walk and by simpy: the same times, bit for bit."""
    import numpy as np

    from sim.cost import RooflineCompute
    from sim.engine import Engine
    from sim.network import CollectivePricer
    from sim.simulate import uncalibrated_network
    from sim.topology import build_topology
    from sim.training.lower import lower_step

    scenario = _scenario([{"name": "tp2", "allreduce": "ring"}], hosts=2, devices_per_host=2,
                         parallel={"tensor": 2, "data": 2}, global_batch=2)
    topology = build_topology(scenario.config.cluster)
    compute = RooflineCompute("fp32", 0.6, 0.8, 5e-6)
    engine = Engine(topology, compute, CollectivePricer(uncalibrated_network("flow", topology, compute), topology))
    settings = scenario.training_settings(scenario.config.variants[0])
    shape = StepShape(scenario.model.with_dtype("fp32"), settings, 1, 64, 1, ((0, 1), (2, 3)))
    segment = lower_step(shape, sync_gradients=True, average_parameters=False).segments[3].segment
    assert any(op.after is not None for op in segment.programs[0])
    walked, simulated = ({r: (np.zeros(len(p)), np.zeros(len(p))) for r, p in segment.programs.items()}
                         for _ in range(2))
    engine._run_dag(segment, {r: v[0] for r, v in walked.items()}, {r: v[1] for r, v in walked.items()}, {},
                    engine._bucket_clock())
    engine._run_events(segment, frozenset(), {r: v[0] for r, v in simulated.items()},
                       {r: v[1] for r, v in simulated.items()}, {}, engine._bucket_clock())
    for rank in segment.programs:
        assert np.array_equal(walked[rank][0], simulated[rank][0]) and np.array_equal(walked[rank][1], simulated[rank][1])
    assert max(v[1].max() for v in walked.values()) > 0


@pytest.mark.parametrize("training", [{}, {"averaging": "parameters", "averaging_period": 2}])
def test_identical_replicas_simulated_once_give_the_whole_runs_results_exactly(monkeypatch, training):
    """TP 2 inside each of 3 hosts whose devices have their own NICs, DP 3 across: replica 0
    alone stands for all three, and the metrics and every rank's trace equal the full run's."""
    import sim.training.simulate as simulate_module

    variants = [{"name": "tp2", "allreduce": "ring", "training": training}]
    scenario = _scenario(variants, hosts=3, devices_per_host=2, parallel={"tensor": 2, "data": 3},
                         bandwidth="10Gbit/s", global_batch=3, nic_per_device=True)
    reduced = simulate_training(scenario).variants[0]
    assert reduced.steps[-1].mirrors == {2: 0, 3: 1, 4: 0, 5: 1}
    monkeypatch.setattr(simulate_module, "replicas_identical", lambda *args: False)
    full = simulate_training(scenario).variants[0]
    assert not full.steps[-1].mirrors
    assert reduced.metrics == full.metrics
    pd.testing.assert_frame_equal(reduced.trace.ops, full.trace.ops)


@pytest.mark.parametrize("overlap", [False, True])
def test_replicas_whose_rings_cross_the_tensor_groups_ports_give_the_whole_runs_results_exactly(monkeypatch,
                                                                                                overlap):
    """TP 2 x DP 4 on 2 hosts of 4 devices with a NIC each, as fast as the host's links (so a
    ring releases its ranks together): two tensor-parallel groups a host, and each
    data-parallel ring's hop inside a host crosses the ports they use. Without overlap
    the rings reduce after the backward, when no tensor-parallel allreduce is in flight: replica
    0 alone stands for all four. With overlap the buckets' allreduces may meet them (every
    replica is simulated, on the fabric where they would). Either way the metrics and every
    rank's trace equal the whole run's, bit for bit."""
    import sim.training.simulate as simulate_module
    from sim.topology import build_topology

    variants = [{"name": "tp2", "allreduce": "ring"}]
    scenario = _scenario(variants, hosts=2, devices_per_host=4, parallel={"tensor": 2, "data": 4},
                         bandwidth="256Gbit/s", latency="2us", global_batch=4, nic_per_device=True,
                         training={"optimizer": "adamw", "overlap": overlap})
    topology = build_topology(scenario.config.cluster)
    # rank 0's hop to rank 1 (its tensor group) and to rank 2 (its data-parallel ring) share a port
    assert set(topology.path(0, 1)) & set(topology.path(0, 2))
    reduced_run = simulate_training(scenario)
    reduced = reduced_run.variants[0]
    if overlap:  # a bucket's ring meets a tensor-parallel allreduce on a port: nothing mirrored
        assert not reduced.steps[-1].mirrors
    else:
        assert reduced.steps[-1].mirrors == {2: 0, 3: 1, 4: 0, 5: 1, 6: 0, 7: 1}
    monkeypatch.setattr(simulate_module, "replicas_identical", lambda *args: False)
    full_run = simulate_training(scenario)
    full = full_run.variants[0]
    assert not full.steps[-1].mirrors
    assert reduced.metrics == full.metrics
    pd.testing.assert_frame_equal(reduced_run.results, full_run.results)
    for table in ("ops", "steps", "memory"):
        pd.testing.assert_frame_equal(getattr(reduced.trace, table), getattr(full.trace, table))


def test_replicas_behind_one_nic_are_all_simulated():
    """Two data-parallel groups share each host's NIC: they contend, so nothing is mirrored."""
    scenario = _scenario([{"name": "tp2", "allreduce": "ring"}], hosts=2, devices_per_host=2,
                         parallel={"tensor": 2, "data": 2}, global_batch=2)
    assert not simulate_training(scenario).variants[0].steps[-1].mirrors


def test_jobs_past_the_training_work_bound_are_refused_naming_the_field():
    from models.errors import ConfigError

    with pytest.raises(ConfigError) as caught:  # pricing a ring over 1000 ranks for every bucket size
        simulate_training(_scenario([{"name": "a"}], hosts=1000))
    assert caught.value.field == "cluster" and "30000" in caught.value.message
    with pytest.raises(ConfigError) as caught:
        simulate_training(_scenario([{"name": f"v{i}"} for i in range(40)], hosts=64, global_batch=64))
    assert caught.value.field == "variants"
    with pytest.raises(ConfigError) as caught:
        simulate_training(_scenario([{"name": "a"}], global_batch=1 << 20))
    assert caught.value.field == "workload.global_batch_size" and "micro-batches" in caught.value.message


def test_buckets_of_less_than_a_byte_are_refused_naming_the_field_written():
    from models.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        simulate_training(_scenario([{"name": "a"}], training={"bucket_cap_mb": 1e-300}))
    assert caught.value.field == "training.bucket_cap_mb"
    with pytest.raises(ConfigError) as caught:
        simulate_training(_scenario([{"name": "a"}, {"name": "b", "training": {"first_bucket_mb": 1e-9}}]))
    assert caught.value.field == "variants[1].training.first_bucket_mb"


def test_every_tensor_parallel_rank_holds_and_computes_the_head_as_the_runtime_trains():
    """runtime/training/model.py replicates the embeddings, final norm and LM head in the TP group:
    each TP rank holds them (memory, DDP buckets) and computes them; nothing is broadcast."""
    from models.accounting import rank_parameter_count

    result = simulate_training(_scenario([{"name": "tp"}], hosts=2, devices_per_host=2,
                                         parallel={"tensor": 2, "data": 2}, global_batch=2))
    vr = result.variant("tp")
    spec = get_model("gpt2").with_dtype("fp32")
    full = rank_parameter_count(spec, 2, is_master=True)
    assert vr.memory[0].weights == vr.memory[1].weights == pytest.approx(full * 4)
    step = vr.steps[-1].step
    names = {rank: {op.name for part in step.segments for op in part.segment.programs[rank]} for rank in (0, 1)}
    for rank in (0, 1):
        assert {"embedding", "lm_head", "lm_head_grad_weight", "embedding_grad_weight"} <= names[rank]
        assert not any("broadcast" in name for name in names[rank])
    buckets = sum(op.collective.size_bytes for part in step.segments for op in part.segment.programs[1]
                  if op.name.startswith("bucket") and op.collective is not None)
    assert buckets == full * 4  # rank 1's buckets carry its whole shard, the head's gradients included


def _tp_algorithms(result) -> dict[str, set[str]]:
    """The algorithms of the tensor-parallel allreduces of each variant's lowered step."""
    return {variant.variant.name: {op.collective.algorithm for part in variant.steps[-1].step.segments
                                   for program in part.segment.programs.values() for op in program
                                   if op.name in ("mlp_grad_allreduce", "attn_grad_allreduce")}
            for variant in result.variants}


def test_tensor_parallel_allreduces_default_to_the_backends_own_on_cpu_ranks_and_ring_on_gpus():
    """The runtime's f and g call dist.all_reduce: on CPU ranks gloo's own allreduce (priced as
    ``library``); GPU ranks keep ring; a variant's named algorithm is kept on either."""
    variants = [{"name": "default"}, {"name": "named", "allreduce": "ring"}]
    shape = {"hosts": 2, "devices_per_host": 2, "parallel": {"tensor": 2, "data": 2}, "global_batch": 2}
    cpu = _tp_algorithms(simulate_training(_scenario(variants, **shape)))
    gpu = _tp_algorithms(simulate_training(_scenario(variants, device="rtx_3060_12gb", **shape)))
    assert cpu == {"default": {"library"}, "named": {"ring"}}
    assert gpu == {"default": {"ring"}, "named": {"ring"}}


@pytest.mark.parametrize("device, expected", [("cpu", 268_000_000), ("h100_sxm", (500 + 32 + 128) * 2**20)])
def test_without_a_profile_each_rank_holds_the_framework_baseline_the_planner_charges(device, expected):
    """One definition (sim.framework.framework_memory): simulate_training and the training plan's
    memory stage charge a rank the same framework bytes, gloo's on a CPU, the CUDA context, cuBLAS
    workspace and NCCL buffers on a GPU of a group of several ranks."""
    from sim.framework import framework_memory
    from sim.topology import build_topology

    scenario = _scenario([{"name": "ddp"}], hosts=2, device=device)
    devices = build_topology(scenario.config.cluster).devices
    charged = framework_memory({rank: devices[rank].spec for rank in range(2)})
    result = simulate_training(scenario).results
    framework = result[result["metric"] == str(Metric.PEAK_MEMORY_FRAMEWORK)]["value"]
    assert list(framework) == [expected, expected] == list(charged.values())


def test_the_exposed_communication_term_holds_the_tensor_parallel_allreduces_not_only_gradients():
    """TP 2 on one host, DP 1: no gradient is allreduced, yet the activations' allreduces leave
    communication no compute hides, so reports name that term for communication, not gradients."""
    result = simulate_training(_scenario([{"name": "tp2", "allreduce": "ring"}], hosts=1, devices_per_host=2,
                                         parallel={"tensor": 2, "data": 1}, global_batch=2))
    vr = result.variants[0]
    assert _collectives(vr, "bucket")[0] == 0
    assert vr.metrics[Metric.EXPOSED_COMMUNICATION] > 0
    assert "gradient" not in STEP_TERMS[Metric.EXPOSED_COMMUNICATION]
    assert bottleneck({**vr.metrics, Metric.EXPOSED_COMMUNICATION: 10 * vr.metrics[Metric.STEP_TIME],
                       Metric.STEP_TIME: 11 * vr.metrics[Metric.STEP_TIME]}).startswith("exposed communication (")
