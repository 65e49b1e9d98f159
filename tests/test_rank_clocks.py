"""The ranks' own clocks across a phase's segments (sim.rank_clocks): a rank that leaves a segment
early starts the next one early, and waits in its next collective for the others."""

import numpy as np
import pytest

from sim.engine import SegmentResult
from sim.program import Phase, Segment
from sim.rank_clocks import DISTINCT_INSTANCES, run_phase_segments
from sim.vocabulary import PhaseKind
from tests.conftest import cluster, make_scenario


class _Rendezvous:
    """An engine stand-in: every segment is one compute op of ``work_s[rank]`` then a collective
    that starts at the last arrival and frees rank r ``hold_s[r]`` later."""

    def __init__(self, work_s: dict[int, float], hold_s: dict[int, float]):
        self.work_s, self.hold_s, self.calls = work_s, hold_s, []

    def run_segment(self, segment: Segment, ready_s=None) -> SegmentResult:
        ready = {r: (ready_s or {}).get(r, 0.0) for r in segment.programs}
        self.calls.append(dict(ready))
        arrive = {r: ready[r] + self.work_s[r] for r in segment.programs}
        start = max(arrive.values())
        starts = {r: np.array([ready[r], arrive[r]]) for r in segment.programs}
        ends = {r: np.array([arrive[r], start + self.hold_s[r]]) for r in segment.programs}
        return SegmentResult(starts, ends, max(float(e.max()) for e in ends.values()), {})


def _phase(*repeats: int) -> Phase:
    segments = tuple(Segment(f"s{i}", {0: ("op", "call"), 1: ("op", "call")}, repeat=n, layers=1)
                     for i, n in enumerate(repeats))
    return Phase(PhaseKind.PREFILL, 0, 1, 1, segments)


def test_ranks_that_leave_together_keep_the_segments_and_their_durations():
    engine = _Rendezvous({0: 1.0, 1: 2.0}, {0: 0.5, 1: 0.5})
    phase = _phase(1, 11, 1)
    timed, results, duration = run_phase_segments(engine, phase)
    assert timed is phase
    assert [r.duration_s for r in results] == [2.5, 2.5, 2.5]
    assert duration == 13 * 2.5
    assert all(not any(ready.values()) for ready in engine.calls)  # every instance from a barrier


def test_a_rank_freed_early_starts_the_next_segment_early_and_waits_there():
    # rank 0 (a broadcast's root) leaves each call 3 s before rank 1; both compute 1 s
    engine = _Rendezvous({0: 1.0, 1: 1.0}, {0: 1.0, 1: 4.0})
    timed, results, duration = run_phase_segments(engine, _phase(1, 5))
    # the first instance starts both ranks together; from the second on rank 1 comes 3 s late,
    # every instance alike: one piece stands for the repeated segment's instances
    assert engine.calls[0] == {0: 0.0, 1: 0.0}
    assert engine.calls[1] == {0: 0.0, 1: 3.0}
    assert [s.repeat for s in timed.segments] == [1, 5]
    assert len(engine.calls) == 2
    # rank 0 waits in each later call for rank 1: it arrives at 1 s, rank 1 at 4 s
    assert results[1].ends[0][0] == 1.0 and results[1].starts[1][1] == 4.0
    # instances start when rank 0 leaves (at 5 s after the one before); the phase ends with rank 1
    assert results[0].duration_s == 2.0 and results[1].duration_s == 5.0
    assert duration == pytest.approx(2.0 + 5 * 5.0 + 3.0)


def test_a_pattern_that_keeps_changing_is_simulated_at_most_a_few_instances_apart():
    class Drifting(_Rendezvous):
        def run_segment(self, segment, ready_s=None):
            self.hold_s = {0: 1.0, 1: 2.0 + len(self.calls)}  # rank 1 later at every instance
            return super().run_segment(segment, ready_s)

    engine = Drifting({0: 1.0, 1: 1.0}, {})
    timed, _, _ = run_phase_segments(engine, _phase(10))
    assert len(engine.calls) == DISTINCT_INSTANCES
    assert [s.repeat for s in timed.segments] == [1] * (DISTINCT_INSTANCES - 1) + [10 - DISTINCT_INSTANCES + 1]
    assert timed.layer_of_segment == (0, 1, 2, 3)


def test_gpu_ranks_leaving_their_calls_together_simulate_as_before():
    # four one-device hosts: the embedding broadcast and the allreduces free every rank at once,
    # so the phase is its segments run from a barrier each, bit for bit
    from sim.simulate import simulate
    from tests.test_engine import _engine_parts

    scenario = make_scenario(cluster=cluster(4, 1), network_model="flow",
                             variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}])
    result = simulate(scenario)
    _, _, engine = _engine_parts(result)
    run = result.variants[0].run
    phase = run.plan.phase(0)
    barriers = [engine.run_segment(segment) for segment in phase.segments]
    assert run.simulated[0].phase is phase
    assert run.simulated[0].duration_s == sum(s.repeat * r.duration_s for s, r in zip(phase.segments, barriers))
    for got, want in zip(run.simulated[0].results, barriers):
        assert all((got.ends[r] == want.ends[r]).all() for r in want.ends)
