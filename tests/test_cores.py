"""Core contention as a resource of the simulated segment (sim.cores): ranks that outnumber a
machine's cores share them, ranks with cores enough are left exactly as they were."""

import pytest
import simpy

from sim.cores import CorePool, ProcessorSharing
from sim.simulate import simulate
from tests.conftest import cluster, make_scenario


def _finish_times(cores: float, jobs: list[tuple[float, float]], background: float = 0.0) -> list[float]:
    """(start s, work s) jobs on one pool; each one's finish time."""
    env = simpy.Environment()
    server = ProcessorSharing(env, CorePool(frozenset(range(len(jobs))), cores, background))
    finished = [0.0] * len(jobs)

    def job(index, start_s, work_s):
        yield env.timeout(start_s)
        yield server.run(work_s)
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


@pytest.mark.parametrize("cores, ranks, background", [(0, 2, 0.0), (2, 0, 0.0), (2, 2, 2.0)])
def test_a_pool_without_free_cores_or_ranks_is_refused(cores, ranks, background):
    with pytest.raises(ValueError, match="core pool"):
        CorePool(frozenset(range(ranks)), cores, background)


def _layer_on(cores: int | None):
    """The first decoder layer segment of a 4-rank tensor-parallel prefill, run by an engine
    whose 4 ranks share ``cores`` cores (None: a core each), and its compute and collective time."""
    from sim.cost import RooflineCompute
    from sim.engine import Engine
    from sim.network import NETWORK_MODELS, CollectivePricer

    result = simulate(make_scenario(cluster=cluster(4, 1), network_model="alpha_beta",
                                    variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}]))
    config = result.scenario.config
    compute = RooflineCompute(result.scenario.model.dtype, config.compute.flops_efficiency,
                              config.compute.memory_efficiency, config.compute.op_overhead_s)
    pricer = CollectivePricer(NETWORK_MODELS["alpha_beta"](
        result.topology, {d.rank: compute.reduce_s_per_byte(d) for d in result.topology.devices}), result.topology)
    pools = () if cores is None else (CorePool(frozenset(range(4)), cores),)
    layer = result.variants[0].run.simulated[0].phase.segments[1]
    engine = Engine(result.topology, compute, pricer, cores=pools)
    ops = layer.programs[0]
    compute_s = sum(compute.duration_s(op, result.topology.devices[0]) for op in ops if op.collective is None)
    return engine.run_segment(layer), compute_s


def test_engine_stretches_compute_where_ranks_outnumber_cores():
    alone, compute_s = _layer_on(None)
    shared, _ = _layer_on(2)
    # every rank computes the same ops at once: each at half a core, the collectives as before
    assert shared.duration_s == pytest.approx(alone.duration_s + compute_s, rel=1e-9)


def test_engine_with_cores_enough_is_bit_for_bit_unchanged():
    alone, _ = _layer_on(None)
    enough, _ = _layer_on(4)
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
