"""A training step's compute as it runs: ranks that outnumber their cores share them with their
comm threads (overlap costs the backward time, every bucket's messages pay the per-message
contention floor), a calibrated whole pass scales its ops' per-call time (a calibration of another
model against that model's ops), and one definition of ``backward_s``."""

import dataclasses
from types import SimpleNamespace

import pytest

from models.catalog import get_model
from models.ops import OpKind
from models.spec import ModelSpec
from sim.transport import GLOO_CONTENTION_PER_TURN_S
from sim.context import Verdict, compare, context_rows, profile_context, recorded_model, scenario_context
from sim.profile import MeasurementKind, Profile, profile_frame
from sim.topology import build_topology
from sim.training.simulate import simulate_training
from sim.training.step_compute import pass_costs
from sim.vocabulary import Metric
from tests.test_training_calibrated import _profile
from tests.test_training_sim import _scenario

_OP_S = 2e-3  # every op of the test profile: a backward long enough for buckets to overlap it


def _cpu_scenario(variants, hosts=4, bandwidth="10Gbit/s", **training):
    return _scenario(variants, hosts=hosts, bandwidth=bandwidth, latency="0us", global_batch=4, micro=1,
                     training={"optimizer": "adamw", "precision": "fp32", "allreduce": "ring", **training})


def _with(profile: Profile, scenario, cores: int | None = None, passes: dict | None = None,
          model: ModelSpec | None = None, flops_of: ModelSpec | None = None) -> Profile:
    """``profile`` with the context of ``scenario``'s ranks on ``cores`` cores (recording that the
    calibration trained ``model``, None: a profile written before it did), and whole passes
    (``{"forward": s, "backward": s}`` at the scenario's micro batch; their FLOPs ``flops_of``
    that model's, None: not recorded)."""
    topology = build_topology(scenario.config.cluster)
    rows = context_rows(scenario_context(scenario.name, topology, tuple(range(topology.num_ranks)), "fp32",
                                         cores=cores, backend="gloo/tcp", model=model))
    workload = scenario.config.workload
    flops = {} if flops_of is None else pass_costs(flops_of.with_dtype("fp32"), scenario.training_settings(
        scenario.config.variants[0]), workload.micro_batch_size, workload.sequence_length)
    for op, seconds in (passes or {}).items():
        rows.append({"measurement": MeasurementKind.TRAINING_PASS, "device_class": "cpu", "op": op, "group_size": 1,
                     "batch_size": workload.micro_batch_size, "new_tokens": workload.sequence_length,
                     "context_tokens": workload.sequence_length, "dtype": "fp32", "median": seconds,
                     "p10": seconds, "p90": seconds, "mean": seconds, "unit": "s", "repeats": 3, "method": "test",
                     **({"flops": flops[OpKind(op)][0]} if flops else {})})
    return Profile(profile_frame(profile.rows.drop(columns="version").to_dict("records") + rows))


def _run(variants, cores, **training):
    scenario = _cpu_scenario(variants, **training)
    return simulate_training(scenario, _with(_profile(scenario, _OP_S), scenario, cores))


def test_ranks_on_cores_of_their_own_or_sharing_them_compute_at_the_calibrated_rate():
    """The calibration timed each op with every rank computing at once: four ranks sharing two
    cores (one simulated for all four, its replicas identical) compute as calibrated."""
    own = _run([{"name": "no_sync", "training": {"averaging": "parameters", "averaging_period": 2}}], None)
    shared = _run([{"name": "no_sync", "training": {"averaging": "parameters", "averaging_period": 2}}], 2)
    assert shared.variants[0].steps[0].mirrors  # one replica simulated for the four
    for metric in (Metric.FORWARD_TIME, Metric.OPTIMIZER_TIME):
        assert shared.variants[0].metrics[metric] == pytest.approx(own.variants[0].metrics[metric], rel=1e-9)


def test_on_four_ranks_and_two_cores_overlap_costs_backward_time():
    variants = [{"name": "overlap", "training": {"bucket_cap_mb": 1}},
                {"name": "after", "training": {"bucket_cap_mb": 1, "overlap": False}}]
    shared, own = _run(variants, 2), _run(variants, 4)
    assert own.variant("overlap").metrics[Metric.BACKWARD_TIME] == pytest.approx(
        own.variant("after").metrics[Metric.BACKWARD_TIME], rel=1e-9)
    # the comm threads' work on the cores the backward needs
    assert shared.variant("overlap").metrics[Metric.BACKWARD_TIME] > 1.05 * shared.variant("after").metrics[
        Metric.BACKWARD_TIME]
    assert any("comm threads: 4 ranks on 2 cores" in line for line in shared.sources)
    assert not any("comm threads" in line for line in own.sources)


def test_a_small_buckets_messages_pay_the_contention_floor_while_the_backward_computes_only():
    """Each bucket's ring (6 steps over 4 ranks, 3 core turns each: enter, send, receive) costs
    its comm thread at least the gloo/tcp point-to-point floor per turn (2 ranks beyond 2 cores)
    while the backward holds the cores, and nothing once every rank waits on the wire (overlap
    off: the cores are free)."""
    variants = [{"name": "overlap", "training": {"bucket_cap_mb": 1}},
                {"name": "after", "training": {"bucket_cap_mb": 1, "overlap": False}}]
    result = _run(variants, 2)
    floor_s = GLOO_CONTENTION_PER_TURN_S[False]
    for name in ("overlap", "after"):
        ops = result.variant(name).trace.ops
        ops = ops[ops["rank"] == 0]
        threads = ops[ops["kind"] == OpKind.COMM_THREAD.value]
        assert len(threads) == (ops["kind"] == OpKind.ALLREDUCE.value).sum() > 3
        compute_end = ops[(ops["stream"] == "compute") & (ops["phase"] == "backward")]["end_s"].max()
        during = threads[threads["start_s"] < compute_end - 1e-9]
        waits = during["end_s"] - during["start_s"]
        if name == "overlap":
            assert len(during) >= 2 and waits.min() >= 6 * 3 * floor_s * (1 - 1e-9)
        else:
            assert during.empty and ((threads["end_s"] - threads["start_s"]) == 0).all()


def test_a_calibrated_whole_pass_scales_its_ops_per_call_time_to_the_pass():
    scenario = _cpu_scenario([{"name": "ddp"}])
    base = _with(_profile(scenario, _OP_S), scenario)
    plain = simulate_training(scenario, base).variants[0].metrics
    forward, backward = plain[Metric.FORWARD_TIME], plain[Metric.BACKWARD_TIME]
    passes = _with(_profile(scenario, _OP_S), scenario, passes={"forward": 3 * forward, "backward": 1.5 * backward})
    result = simulate_training(scenario, passes)
    assert result.variants[0].metrics[Metric.FORWARD_TIME] == pytest.approx(3 * forward, rel=1e-6)
    assert result.variants[0].metrics[Metric.BACKWARD_TIME] == pytest.approx(1.5 * backward, rel=1e-6)
    assert any("in-step forward pass on cpu fp32 at micro batch 1: x " in line and "per-call time" in line
               for line in result.sources)
    assert any("in-step passes on cpu fp32: not calibrated" in line
               for line in simulate_training(scenario, base).sources)


def _timed_on(model: ModelSpec | None, flops_of: ModelSpec | None):
    """gpt2's step from a calibration whose passes took twice gpt2's ops, recording ``model`` and
    the passes' FLOPs of ``flops_of``."""
    scenario = _cpu_scenario([{"name": "ddp"}])
    plain = simulate_training(scenario, _with(_profile(scenario, _OP_S), scenario)).variants[0].metrics
    passes = {"forward": 2 * plain[Metric.FORWARD_TIME], "backward": 2 * plain[Metric.BACKWARD_TIME]}
    return simulate_training(scenario, _with(_profile(scenario, _OP_S), scenario, passes=passes, model=model,
                                             flops_of=flops_of))


def test_the_model_a_calibration_records_is_the_one_its_passes_are_set_against():
    """The context's model decides, whatever the rows' FLOPs say; a profile written before it was
    recorded is matched on its passes' FLOPs, and with neither the scenario's model is taken."""
    qwen, gpt2 = get_model("qwen2.5-0.5b"), get_model("gpt2")
    recorded = _timed_on(qwen, None)
    assert any("timed on qwen2.5-0.5b" in line for line in recorded.sources)
    for other in (_timed_on(qwen, gpt2), _timed_on(None, qwen)):  # recorded over the FLOPs; the FLOPs alone
        assert other.variants[0].metrics == recorded.variants[0].metrics
    own = _timed_on(None, None)
    assert not any("timed on" in line for line in own.sources)
    assert own.variants[0].metrics[Metric.FORWARD_TIME] != pytest.approx(
        recorded.variants[0].metrics[Metric.FORWARD_TIME], rel=1e-3)
    # the scenario's own model under another name is the scenario's
    renamed = _timed_on(dataclasses.replace(gpt2, name="my-gpt2", dtype="bf16"), None)
    assert renamed.variants[0].metrics == own.variants[0].metrics


def test_a_recorded_model_outside_the_catalog_prices_the_passes_and_the_context_says_another_model():
    half = dataclasses.replace(get_model("gpt2"), name="gpt2-6-layers", num_layers=6)
    recorded = _timed_on(half, None)
    assert any("in-step forward pass on cpu fp32 at micro batch 1: x " in line and "timed on gpt2-6-layers" in line
               for line in recorded.sources)
    (term,) = [t for t in recorded.network.terms if t.term == "model gpt2"]
    assert term.verdict is Verdict.RESCALED and "another model, gpt2-6-layers" in term.detail
    # the same cluster's collectives are replayed; only the model is outside the profile's context
    assert profile_context(recorded).startswith("replay; outside: ") and "model gpt2" in profile_context(recorded)
    # before models were recorded, its passes' FLOPs match no model hetsim knows: factor 1, said
    unknown = _timed_on(None, half)
    assert any("not priced, x 1" in line and "does not record the model" in line for line in unknown.sources)
    same = _timed_on(get_model("gpt2"), None)
    assert [t.verdict for t in same.network.terms if t.term == "model gpt2"] == [Verdict.SAME]


def test_a_pool_of_calibrations_of_two_models_says_so_and_falls_back_on_the_passes_flops():
    scenario = _cpu_scenario([{"name": "ddp"}])
    target = scenario_context("t", build_topology(scenario.config.cluster), (0, 1), "fp32", model=get_model("gpt2"))
    one, other = (dataclasses.replace(target, name=name, model=get_model(model))
                  for name, model in (("a", "gpt2"), ("b", "qwen2.5-0.5b")))
    assert recorded_model((one, other)) is None and recorded_model((one, one)) == get_model("gpt2")
    (term,) = [t for t in compare((one, other), target) if t.term == "model gpt2"]
    assert term.verdict is Verdict.RESCALED and "several models (gpt2, qwen2.5-0.5b)" in term.detail
    assert not [t for t in compare((dataclasses.replace(one, model=None),), target) if t.term.startswith("model")]


def test_backward_time_counts_recomputation_and_not_the_wait_for_the_buckets():
    result = simulate_training(_cpu_scenario([{"name": "off"}, {"name": "ckpt", "training": {
        "activation_checkpointing": 1}}]))
    off, ckpt = result.variant("off").metrics, result.variant("ckpt").metrics
    assert ckpt[Metric.RECOMPUTE_TIME] > 0
    assert ckpt[Metric.BACKWARD_TIME] == pytest.approx(off[Metric.BACKWARD_TIME] + ckpt[Metric.RECOMPUTE_TIME],
                                                       rel=1e-6)
    assert off[Metric.STEP_TIME] == pytest.approx(off[Metric.FORWARD_TIME] + off[Metric.BACKWARD_TIME]
                                                  + off[Metric.EXPOSED_COMMUNICATION] + off[Metric.OPTIMIZER_TIME],
                                                  rel=1e-6)


def test_the_runtime_ends_a_synchronising_backward_at_its_last_buckets_ready_time():
    from runtime.training.measure import step_metrics

    bucket = lambda ready, start, end: SimpleNamespace(ready_s=ready, start_s=start, end_s=end)  # noqa: E731
    step = SimpleNamespace(start_s=0.0, end_s=5.0, forward=[(0.0, 1.0), (1.0, 2.0)], backward=[(1.0, 1.5), (2.0, 4.5)],
                           optimizer=(4.5, 5.0), averaging=None,
                           buckets=[bucket(2.5, 2.5, 3.0), bucket(3.0, 3.0, 4.4)])
    metrics = step_metrics([step], 4, 8)
    assert metrics[Metric.BACKWARD_TIME] == pytest.approx(0.5 + 1.0)  # no_sync pass whole; the other to 3.0
    assert metrics[Metric.EXPOSED_COMMUNICATION] == pytest.approx(1.4)


def test_a_prediction_from_another_clusters_profile_computes_as_its_replay():
    """Compute does not depend on the links: a profile of a cluster with other links (prediction)
    prices the forward and optimizer as the cluster's own (replay), the four ranks on two cores
    simulated as one replica either way."""
    variants = [{"name": "ddp", "training": {"bucket_cap_mb": 25}}]
    scenario, other = _cpu_scenario(variants), _cpu_scenario(variants, bandwidth="1Gbit/s")
    replay = simulate_training(scenario, _with(_profile(scenario, _OP_S), scenario, 2))
    prediction = simulate_training(scenario, _with(_profile(scenario, _OP_S), other, 2))
    assert replay.network.same_cluster and not prediction.network.same_cluster
    assert prediction.variants[0].steps[0].mirrors
    for metric in (Metric.FORWARD_TIME, Metric.OPTIMIZER_TIME):
        assert prediction.variants[0].metrics[metric] == pytest.approx(replay.variants[0].metrics[metric], rel=1e-9)


def test_a_rings_comm_thread_takes_three_turns_a_step_and_reduces_three_quarters_of_the_bucket_on_four_ranks():
    """Of a ring allreduce of n bytes over 4 ranks a rank's comm thread takes 3 core turns in each
    of its 6 steps (enter, send, receive) and sums the (p - 1) / p n bytes of its reduce-scatter
    half, each at the device's reduction cost."""
    from sim.collectives.registry import build_schedule
    from sim.plan import Op, Stream
    from sim.training.comm_thread import schedule_work
    from sim.training.step_compute import StepCompute
    from models.accounting import OpCost

    size = 4 * 2**20
    schedule = build_schedule(OpKind.ALLREDUCE, "ring", (0, 1, 2, 3), size)
    assert schedule_work(schedule, 2) == (18, 3 * size // 4)
    gamma_s = 1e-9
    compute = StepCompute(SimpleNamespace(reduce_s_per_byte=lambda device, dtype=None: gamma_s), message_work_s=1e-3,
                          work=lambda size_bytes, rank: schedule_work(schedule, rank))
    op = Op(OpKind.COMM_THREAD, "bucket0_comm_thread", Stream.COMM,
            cost=OpCost(flops=0, bytes_read=size, bytes_written=0, weight_bytes=0, workspace_bytes=0))
    device = SimpleNamespace(rank=2)
    assert compute.duration_s(op, device) == pytest.approx(18 * 1e-3 + 3 * size // 4 * gamma_s, rel=1e-12)
