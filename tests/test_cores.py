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
