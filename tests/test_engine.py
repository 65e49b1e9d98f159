"""Engine and run invariants: closed forms where nothing contends, exact decode interpolation,
the memory ledger, out-of-memory verdicts, determinism and the order of strategies."""

import math

import numpy as np
import pytest

from models.accounting import kv_cache_bytes_per_token
from sim.plan import MemoryCategory
from sim.simulate import simulate
from sim.timeline import _Runner
from tests.conftest import cluster, make_scenario


def _engine_parts(result):
    """Rebuild the engine of a simulated scenario's first variant (same topology and models; the
    network model simulate priced with, the uncalibrated transport defaults included)."""
    from sim.cost import RooflineCompute
    from sim.engine import Engine
    from sim.network import NETWORK_MODELS, CollectivePricer

    config = result.scenario.config
    compute = RooflineCompute(result.scenario.model.dtype, config.compute.flops_efficiency,
                              config.compute.memory_efficiency, config.compute.op_overhead_s)
    network = (result.network.network if result.network is not None else NETWORK_MODELS[config.network_model](
        result.topology, {d.rank: compute.reduce_s_per_byte(d) for d in result.topology.devices}))
    pricer = CollectivePricer(network, result.topology)
    return compute, pricer, Engine(result.topology, compute, pricer)


def _op_seconds(op, rank, compute, pricer, topology):
    if op.collective is None:
        return compute.duration_s(op, topology.devices[rank])
    c = op.collective
    return pricer.price(c.kind, c.algorithm, c.group, c.size_bytes, c.root)[1].duration_s


def test_single_device_time_is_the_sum_of_its_ops():
    scenario = make_scenario(cluster=cluster(1, 1), variants=[{"name": "ar", "strategy": "allreduce_ln",
                                                              "allreduce": "ring"}])
    result = simulate(scenario)
    compute, pricer, _ = _engine_parts(result)
    run = result.variants[0].run
    for step in (0, 1):
        phase = run.simulated[step].phase
        expected = sum(seg.repeat * _op_seconds(op, 0, compute, pricer, result.topology)
                       for seg in phase.segments for op in seg.programs[0])
        assert run.step_end_s[step] - run.step_start_s[step] == pytest.approx(expected, rel=1e-12)


def test_allreduce_layer_time_is_compute_plus_two_collectives_without_contention():
    # four one-device hosts behind one switch: every allreduce runs alone on its links
    scenario = make_scenario(cluster=cluster(4, 1), network_model="alpha_beta",
                             variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}])
    result = simulate(scenario)
    compute, pricer, engine = _engine_parts(result)
    phase = result.variants[0].run.simulated[0].phase
    layer = phase.segments[1]
    expected = sum(_op_seconds(op, 1, compute, pricer, result.topology) for op in layer.programs[1])
    assert engine.run_segment(layer).duration_s == pytest.approx(expected, rel=1e-12)
    assert sum(op.collective is not None for op in layer.programs[1]) == 2


def test_decode_interpolation_equals_simulating_every_step():
    for strategy in ({"name": "x", "strategy": "reduce_ln_bcast"},
                     {"name": "x", "strategy": "allreduce_ln", "allreduce": "recursive_doubling"}):
        scenario = make_scenario(workload={"batch_size": 16, "prompt_tokens": 8, "output_tokens": 40},
                                 variants=[strategy])
        result = simulate(scenario)
        run = result.variants[0].run
        assert len(run.simulated) < run.plan.num_phases  # it did interpolate
        compute, pricer, engine = _engine_parts(result)
        runner = _Runner(run.plan, engine, result.topology)
        start = {r: dict.fromkeys(MemoryCategory, 0) for r in run.plan.ranks}
        brute = np.array([runner.run_phase(s, start, 0.0).duration_s for s in range(run.plan.num_phases)])
        np.testing.assert_allclose(run.step_end_s - run.step_start_s, brute, rtol=1e-9)


def test_ttft_and_tpot_come_from_the_step_times():
    result = simulate(make_scenario())
    for vr in result.variants:
        steps = vr.trace.steps
        assert vr.timing["ttft_s"] == steps["end_s"][0]
        decode = steps["end_s"].to_numpy()[1:] - steps["start_s"].to_numpy()[1:]
        assert vr.timing["tpot_s"] == pytest.approx(decode.mean(), rel=1e-12)
        assert vr.timing["decode_tokens_per_s"] == pytest.approx(1 / vr.timing["tpot_s"])


def test_memory_peak_is_weights_plus_full_kv_cache_plus_transients():
    scenario = make_scenario(variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}])
    result = simulate(scenario)
    run = result.variants[0].run
    spec, tp = scenario.model, len(result.ranks)
    workload = scenario.config.workload
    tokens = workload.prompt_tokens + workload.output_tokens - 1
    for rank in result.ranks:
        at_peak = run.peak_by_category[rank]
        assert at_peak[MemoryCategory.WEIGHTS] == run.plan.initial_memory_bytes[rank][MemoryCategory.WEIGHTS]
        assert sum(at_peak.values()) == run.peak_bytes[rank]
        kv_final = kv_cache_bytes_per_token(spec, tp) * workload.batch_size * tokens
        assert at_peak[MemoryCategory.KV_CACHE] <= kv_final
        assert run.peak_bytes[rank] >= run.plan.initial_memory_bytes[rank][MemoryCategory.WEIGHTS] + kv_final \
            - kv_cache_bytes_per_token(spec, tp) // spec.num_layers * workload.batch_size


def test_memory_ledger_never_negative_and_ends_with_weights_and_kv():
    result = simulate(make_scenario())
    for vr in result.variants:
        assert (vr.trace.memory["bytes"] >= 0).all()
        for rank in result.ranks:
            prefill = vr.run.simulated[0].memory[rank]
            assert prefill.end_by_category[MemoryCategory.ACTIVATIONS] == 0
            assert prefill.end_by_category[MemoryCategory.WORKSPACE] == 0
            assert prefill.end_by_category[MemoryCategory.COMM_BUFFERS] == 0


def test_weights_that_do_not_fit_are_the_first_overflow():
    scenario = make_scenario(model="llama-2-70b", cluster=cluster(4, 2, memory="8GiB"),
                             workload={"batch_size": 1, "prompt_tokens": 16, "output_tokens": 4})
    result = simulate(scenario)
    for vr in result.variants:
        assert vr.overflow is not None and vr.overflow.op_name.startswith("weights")
        assert vr.overflow.needed_bytes > 8 * 2**30


def test_kv_cache_growth_overflows_at_the_right_decode_step():
    base = make_scenario(workload={"batch_size": 64, "prompt_tokens": 64, "output_tokens": 200},
                         variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}])
    result = simulate(base)
    run = result.variants[0].run
    # Capacity: between the peak after step 100 and the run's peak, so a decode step overflows.
    low = run.step_base_bytes[0][100]
    capacity = int((low + run.peak_bytes[0]) / 2)
    tight = make_scenario(workload={"batch_size": 64, "prompt_tokens": 64, "output_tokens": 200},
                          cluster=cluster(memory=f"{capacity}B"),
                          variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}])
    overflow = simulate(tight).variants[0].overflow
    assert overflow is not None and overflow.phase == "decode"
    # that step's peak exceeds the capacity, the previous step's does not (brute force)
    compute, pricer, engine = _engine_parts(result)
    runner = _Runner(run.plan, engine, result.topology)
    per_step = {r: run.step_base_bytes[r][2] - run.step_base_bytes[r][1] for r in result.ranks}

    def peak(step):
        start = {r: {**{c: 0 for c in MemoryCategory}, MemoryCategory.WEIGHTS: int(run.step_base_bytes[r][step])}
                 for r in result.ranks}
        return max(m.peak_bytes for m in runner.run_phase(step, start, 0.0).memory.values())

    assert peak(overflow.step) > capacity >= peak(overflow.step - 1)
    assert per_step[0] > 0


def test_same_scenario_same_results():
    a = simulate(make_scenario()).results
    b = simulate(make_scenario()).results
    assert a.equals(b)


def test_log_depth_allreduce_beats_reduce_bcast_when_latency_bound():
    # 8 one-device hosts, 5 ms links: decode messages of a few KiB are latency-bound
    scenario = make_scenario(model="llama-2-7b", cluster=cluster(8, 1, nic="1Gbit/s", nic_latency="5ms"),
                             variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"},
                                       {"name": "rd", "strategy": "allreduce_ln", "allreduce": "recursive_doubling"},
                                       {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])
    result = simulate(scenario)
    tpot = {v.variant.name: v.timing["tpot_s"] for v in result.variants}
    assert tpot["rd"] < tpot["rlb"]
    assert tpot["rd"] < tpot["ring"]
    assert all(math.isfinite(t) for t in tpot.values())


def test_plan_without_decode_steps():
    scenario = make_scenario(workload={"batch_size": 1, "prompt_tokens": 4, "output_tokens": 1})
    result = simulate(scenario)
    assert all(math.isnan(v.timing["tpot_s"]) for v in result.variants)
    assert all(v.timing["ttft_s"] > 0 for v in result.variants)
