"""Core contention as a resource of the simulated segment (sim.cores): ranks that outnumber a
machine's cores share them, ranks with cores enough are left exactly as they were."""

from functools import partial

import pytest
import simpy

from sim.cores import TICK_S, CorePool, CoreScheduling, ProcessorSharing, TakingTurns
from sim.simulate import simulate
from tests.conftest import cluster, four_rank_layer, make_scenario


def _finish_times(cores: float, jobs: list[tuple[float, float | list[float]]], background: float = 0.0,
                  server_class=ProcessorSharing) -> list[float]:
    """(start s, work s) jobs on one pool, one rank each (a list of works: ops one after the other);
    each rank's finish time."""
    env = simpy.Environment()
    server = server_class(env, CorePool(frozenset(range(len(jobs))), cores, background))
    finished = [0.0] * len(jobs)

    def job(index, start_s, work_s):
        yield env.timeout(start_s)
        for op_s in work_s if isinstance(work_s, list) else [work_s]:
            yield server.run(op_s, index)
        finished[index] = env.now

    for index, (start_s, work_s) in enumerate(jobs):
        env.process(job(index, start_s, work_s))
    env.run()
    return finished


def test_four_busy_ranks_on_two_cores_take_twice_as_long_as_on_four():
    jobs = [(0.0, 1.0)] * 4
    assert _finish_times(4, jobs) == pytest.approx([1.0] * 4)
    assert _finish_times(2, jobs) == pytest.approx([2.0] * 4)


def test_a_rank_computing_alone_gets_a_whole_core():
    # three ranks share 2 cores until 1.5 s (each 2/3 of a core), then the fourth's op runs alone
    assert _finish_times(2, [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (1.5, 1.0)]) == pytest.approx([1.5, 1.5, 1.5, 2.5])


def test_other_processes_take_their_share_of_the_cores():
    # a background load of half a core leaves 1.5 cores to 3 ranks
    assert _finish_times(2, [(0.0, 1.0)] * 3, background=0.5) == pytest.approx([2.0] * 3)


def test_ranks_taking_turns_finish_equal_work_apart():
    # two run, two wait: the ranks that waited arrive at the next collective one op later
    assert _finish_times(2, [(0.0, 1e-3)] * 4, server_class=TakingTurns) == pytest.approx([1e-3, 1e-3, 2e-3, 2e-3])
    # ...also op after op: a rank going on computing keeps its core, it does not queue again
    assert _finish_times(2, [(0.0, [0.25e-3] * 4)] * 4, server_class=TakingTurns) == pytest.approx(
        [1e-3, 1e-3, 2e-3, 2e-3])


def test_ranks_taking_turns_hand_over_at_the_first_tick_after_their_slice():
    # 10 ms each: ranks 0 and 1 run to the 4 ms tick, 2 and 3 to 8 ms, ... the cores' total work
    # is as processor sharing's, only who finishes when differs
    work_s = 2.5 * TICK_S
    turns = _finish_times(2, [(0.0, work_s)] * 4, server_class=TakingTurns)
    assert turns == pytest.approx([4.5 * TICK_S, 4.5 * TICK_S, 5 * TICK_S, 5 * TICK_S])
    assert max(turns) == pytest.approx(max(_finish_times(2, [(0.0, work_s)] * 4)))
    # no slice: a turn runs to the next tick, one that starts on a tick to the one after
    no_slice = _finish_times(2, [(0.0, 2.5e-3)] * 4, server_class=partial(TakingTurns, tick_s=1e-3, slice_s=0.0))
    assert no_slice == pytest.approx([4.5e-3, 4.5e-3, 5e-3, 5e-3])


def test_a_rank_waking_while_the_cores_are_taken_waits_for_one():
    # ranks 0 and 1 compute 1 ms; rank 2 wakes at 0.5 ms and waits for the first to finish
    assert _finish_times(2, [(0.0, 1e-3), (0.0, 1e-3), (0.5e-3, 1e-3)], server_class=TakingTurns) == pytest.approx(
        [1e-3, 1e-3, 2e-3])
    # three ranks on two cores share the turns fairly: the one waiting goes first at each tick
    assert _finish_times(2, [(0.0, 1.0)] * 3, server_class=TakingTurns) == pytest.approx([1.5] * 3, abs=1.01 * TICK_S)


def test_turns_spread_the_other_processes_share_over_the_running_ranks():
    # 1.5 free cores: two ranks run at 0.75 of a core each, the third alone after them at a whole one
    assert _finish_times(2, [(0.0, 1e-3)] * 3, background=0.5, server_class=TakingTurns) == pytest.approx(
        [1e-3 / 0.75, 1e-3 / 0.75, 1e-3 / 0.75 + 1e-3])


@pytest.mark.parametrize("cores, ranks, background", [(0, 2, 0.0), (2, 0, 0.0), (2, 2, 2.0)])
def test_a_pool_without_free_cores_or_ranks_is_refused(cores, ranks, background):
    with pytest.raises(ValueError, match="core pool"):
        CorePool(frozenset(range(ranks)), cores, background)


def _layer_on(cores: int | None):
    """The first decoder layer segment of a 4-rank tensor-parallel prefill, run by an engine
    whose 4 ranks share ``cores`` cores (None: a core each), rank 0's compute time in it and its ops."""
    pools = () if cores is None else (CorePool(frozenset(range(4)), cores),)
    result, compute, engine = four_rank_layer(pools)
    layer = result.variants[0].run.simulated[0].phase.segments[1]
    ops = layer.programs[0]
    compute_s = sum(compute.duration_s(op, result.topology.devices[0]) for op in ops if op.collective is None)
    return engine.run_segment(layer), compute_s, ops


def test_engine_stretches_compute_where_ranks_outnumber_cores():
    alone, compute_s, _ = _layer_on(None)
    shared, _, _ = _layer_on(2)
    # every rank computes the same ops at once: each at half a core, the collectives as before
    assert shared.duration_s == pytest.approx(alone.duration_s + compute_s, rel=1e-9)


def test_engine_with_ranks_taking_turns_staggers_their_arrivals(monkeypatch):
    from sim import cores

    shared, _, _ = _layer_on(2)
    monkeypatch.setattr(cores, "SCHEDULING", CoreScheduling.TURNS)
    turns, _, ops = _layer_on(2)
    # the layer's first op, computed by every rank: shared, the 4 ranks end it together; in
    # turns, ranks 0 and 1 compute their block to the first collective on the 2 cores, and only
    # then do ranks 2 and 3 get them
    assert len({float(ends[0]) for ends in shared.ends.values()}) == 1
    first = [float(turns.ends[rank][0]) for rank in sorted(turns.ends)]
    assert first[0] == first[1] < first[2] == first[3]
    block = next(i for i, op in enumerate(ops) if op.collective is not None)
    assert first[2] == pytest.approx(float(turns.ends[0][block - 1]) + first[0], rel=1e-9)


def test_engine_with_cores_enough_is_bit_for_bit_unchanged():
    alone, _, _ = _layer_on(None)
    enough, _, _ = _layer_on(4)
    assert enough.duration_s == alone.duration_s
    for rank in alone.ends:
        assert (enough.ends[rank] == alone.ends[rank]).all()


def test_transfer_shares_the_target_cores_and_leaves_the_masters_own_ops_on_a_core_of_their_own(root):
    from sim.calibrated import CalibratedCompute
    from sim.cost import RooflineCompute
    from sim.profile import load_profile
    from sim.scenario import load_scenario

    # calibrated with 4 ranks on 2 cores, predicting 3 ranks on those 2 cores
    profile = load_profile(root / "validation" / "report" / "profiles" / "v2x2_bandwidth.csv")
    scenario = load_scenario(root / "scenarios" / "transfer" / "t3x1_bandwidth.yaml")
    result = simulate(scenario, profile=profile)
    variant = result.variants[0]
    config = scenario.config
    as_calibrated = CalibratedCompute(profile, RooflineCompute(scenario.model.dtype, config.compute.flops_efficiency,
                                                               config.compute.memory_efficiency,
                                                               config.compute.op_overhead_s))
    ops = {op.name: op for segment in variant.run.plan.phase(1).segments for op in segment.programs[0]}
    trace = variant.trace.ops
    decode = trace[(trace["rank"] == 0) & (trace["step"] == 1)].drop_duplicates("name").set_index("name")
    took = (decode["end_s"] - decode["start_s"]).to_dict()
    device = result.topology.devices[0]
    # the LM head, the master's alone, was timed while the others slept: as calibrated
    assert took["lm_head"] == pytest.approx(as_calibrated.duration_s(ops["lm_head"], device), rel=1e-9)
    # an op every rank computes: half its calibrated time on a core of its own, at most 1.5 times
    # that while all 3 ranks compute at once (they do not always: a broadcast frees its root first)
    for name in ("mlp_up", "qkv_proj", "attention"):
        alone_s = as_calibrated.duration_s(ops[name], device) * 0.5
        assert alone_s * (1 - 1e-9) <= took[name] <= alone_s * 1.5 * (1 + 1e-9)
    assert sum(took[n] for n in ("mlp_up", "qkv_proj", "attention")) > 1.01 * sum(
        as_calibrated.duration_s(ops[n], device) * 0.5 for n in ("mlp_up", "qkv_proj", "attention"))


def test_a_messages_software_overhead_stretches_with_the_busy_ranks_beyond_the_cores():
    from sim.cluster_config import ClusterConfig
    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import TransportTerms, price

    topology = build_topology(ClusterConfig.model_validate(cluster(2, 2)))
    group = (0, 1, 2, 3)
    terms = TransportTerms(1e-3, 1.0, 1.0, "test")

    def extra_s(algorithm: str) -> float:
        schedule = build_schedule("allreduce", algorithm, group, 1024, host_groups=topology.host_groups(group))
        return price(schedule, topology, terms, cores=2).duration_s - price(schedule, topology, terms).duration_s

    # recursive doubling: 2 steps, each keeping all 4 ranks busy on 2 cores: 1 ms more per step
    assert extra_s("recursive_doubling") == pytest.approx(2e-3, rel=1e-9)
    # a two-level tree's middle steps keep only the 2 hosts' leaders busy: those do not stretch
    assert extra_s("two_level_tree") == pytest.approx(2e-3, rel=1e-9)
    assert price(build_schedule("allreduce", "ring", group, 1024, host_groups=topology.host_groups(group)),
                 topology, terms, cores=4).duration_s == price(
        build_schedule("allreduce", "ring", group, 1024, host_groups=topology.host_groups(group)), topology,
        terms).duration_s  # cores enough: unchanged


def _decode_step_s(cores: int, parallel: dict) -> float:
    """TPOT (s) of GPT-2 on 2 hosts x 2 CPU ranks sharing ``cores`` cores, in ``parallel``'s layout."""
    scenario = make_scenario(cluster={**cluster(2, 2, device="cpu", nic="100Mbit/s", nic_latency="50us", memory="4GiB"),
                                      "cores": cores},
                             dtype="fp32", parallel=parallel,
                             variants=[{"name": "b", "strategy": "reduce_ln_bcast", "reduce": "library",
                                        "broadcast": "library"}])
    results = simulate(scenario).results
    return float(results[(results["metric"] == "tpot_s") & (results["device"].fillna("") == "")]["value"].iloc[0])


def test_a_pipeline_stage_waiting_for_its_input_leaves_its_cores_to_the_stage_computing():
    # Measured: ranks waiting in gloo's recv or in a collective for a peer take 0.5% of a core
    # (benchmarks/bench_gloo_waiting.py; gloo's UnboundBuffer::waitRecv sleeps on a condition
    # variable), so TP 2 x PP 2's computing stage has the 2 cores to itself, while TP 4's 4 ranks
    # compute together and share them.
    pipelined = {"tensor": 2, "pipeline": 2}
    assert _decode_step_s(2, pipelined) == pytest.approx(_decode_step_s(4, pipelined))
    assert _decode_step_s(2, {"tensor": 4}) > 1.3 * _decode_step_s(4, {"tensor": 4})


# The quiet testbed's stream bandwidth (benchmarks/bench_machine_sharing.py): 1, 2 and 4 processes.
_TESTBED_MEMORY = ((1, 23.66e9), (2, 33.71e9), (4, 40.62e9))


def _streaming_finish(ranks: int, memory_s: float, stream_bytes_per_s=_TESTBED_MEMORY) -> list[float]:
    """``ranks`` ranks on 2 cores each running one 1 s op whose memory part alone is ``memory_s``."""
    env = simpy.Environment()
    server = ProcessorSharing(env, CorePool(frozenset(range(ranks)), 2.0, stream_bytes_per_s=stream_bytes_per_s))
    finished = []

    def job(index):
        yield server.run(1.0, index, memory_s)
        finished.append(env.now)

    for index in range(ranks):
        env.process(job(index))
    env.run()
    return finished


def test_ranks_streaming_at_once_share_the_machines_memory_bandwidth():
    # alone: its time; two on two cores: a core each, but the memory part at 33.71 / 2 GB/s a stream
    assert _streaming_finish(1, 1.0) == pytest.approx([1.0])
    assert _streaming_finish(2, 1.0) == pytest.approx([2 * 23.66 / 33.71] * 2)
    # only the memory part stretches: half the op at 1.40 times as long
    assert _streaming_finish(2, 0.5) == pytest.approx([0.5 + 0.5 * 2 * 23.66 / 33.71] * 2)
    # four on two cores: the longer of the cores' share (2 s) and the memory's (4 x 23.66 / 40.62 s)
    assert _streaming_finish(4, 1.0) == pytest.approx([4 * 23.66 / 40.62] * 4)
    assert _streaming_finish(4, 0.5) == pytest.approx([2.0] * 4)


def test_a_pool_without_a_bandwidth_shares_the_cores_only():
    assert _streaming_finish(2, 1.0, ()) == [1.0, 1.0]
    assert _streaming_finish(4, 1.0, ()) == _finish_times(2, [(0.0, 1.0)] * 4)


def test_a_pool_streams_for_the_ranks_its_simulated_ranks_stand_for():
    from sim.cores import core_shares

    machine = CorePool(frozenset({0, 1}), 2.0, stream_bytes_per_s=_TESTBED_MEMORY)
    mine = core_shares(machine, frozenset({0}))[0]
    assert mine.memory_share(1) == machine.memory_share(2) == pytest.approx(33.71 / (2 * 23.66))
    assert mine.contended({0}) and not CorePool(frozenset({0}), 1.0).contended({0})
    # between measured counts the aggregate is linear, beyond the last it stays (saturated)
    assert machine.memory_share(3) == pytest.approx((33.71 + 40.62) / 2 / (3 * 23.66))
    assert machine.memory_share(8) == pytest.approx(40.62 / (8 * 23.66))
    with pytest.raises(ValueError, match="bandwidths"):
        CorePool(frozenset({0}), 2.0, stream_bytes_per_s=((2, 1e9),))


def test_a_pool_names_its_arrival_lag_only_where_the_engine_prices_it(monkeypatch):
    from sim import cores

    pool = CorePool(frozenset(range(4)), 2, lag_per_block=6.57)
    monkeypatch.setattr(cores, "ARRIVAL_LAGS_PRICED", False)
    assert pool.describe() == "4 ranks on 2 cores"
    monkeypatch.setattr(cores, "ARRIVAL_LAGS_PRICED", True)
    assert pool.describe() == "4 ranks on 2 cores, prefill arrival lags 6.57 (sim.arrival_skew)"
