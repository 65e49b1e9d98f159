"""A whole inference run: the prefill, then every decode step, priced without simulating each step.

Decode step s differs from step s+1 only in the context length, and every op's cost is affine in
it; an op's duration is a roofline ``max`` of affine functions and every start time a ``max`` over
dependencies of sums of those. Each simulated quantity of a step (op start and end times, the
memory peak above the step's base) is therefore a convex piecewise-linear function of s. A convex
function that meets its chord at an interior point is linear on the whole interval, so the run
simulates the first and last decode steps, then bisects only where the midpoint step disagrees with
the chord (relative tolerance 1e-9). Steps in between are interpolated exactly. A typical decode of
hundreds of tokens costs three simulated steps; every op regime change adds a few more.

Convexity holds where collectives keep their priced timings (every shipped scenario). Where
transfers share links on the segment's network (:mod:`sim.fabric`: streamed weight loads among
themselves, or with a collective crossing their links), a time can also fall as a step's compute
grows (a load that overlaps less of a collective), so it is piecewise linear but not necessarily
convex, and a midpoint on the chord is strong evidence of linearity, not a proof.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.engine import Engine, SegmentResult
from sim.memory import CATEGORIES, Overflow, PhaseMemory, phase_memory
from sim.plan import MemoryCategory, Phase, Plan
from sim.topology import Topology
from sim.vocabulary import PhaseKind

_RTOL = 1e-9


@dataclass(frozen=True)
class PhaseRun:
    """A simulated phase: one result per segment (instance), its duration and per-rank memory."""

    phase: Phase
    results: tuple[SegmentResult, ...]
    duration_s: float
    memory: dict[int, PhaseMemory]

    def signature(self) -> np.ndarray:
        """Every simulated quantity of the phase as one vector (for the linearity test)."""
        parts = [np.array([r.duration_s for r in self.results])]
        for r in self.results:
            for rank in sorted(r.starts):
                parts += [r.starts[rank], r.ends[rank]]
        start_totals = {rank: m.peak_bytes for rank, m in self.memory.items()}
        parts.append(np.array([start_totals[k] for k in sorted(start_totals)], dtype=float))
        return np.concatenate(parts)


@dataclass(frozen=True)
class RunResult:
    """The simulated run of one plan.

    ``step_start_s[s]``/``step_end_s[s]``: absolute times of phase s (0 = prefill), for every step.
    ``simulated``: the phases actually simulated, by step (others were interpolated).
    ``peak_bytes[r]``, ``peak_by_category[r]``: the rank's highest memory over the run.
    ``overflow``: the first op that does not fit, over all ranks, or None.
    """

    plan: Plan
    step_start_s: np.ndarray
    step_end_s: np.ndarray
    simulated: dict[int, PhaseRun]
    peak_bytes: dict[int, int]
    peak_by_category: dict[int, dict[MemoryCategory, int]]
    step_base_bytes: dict[int, np.ndarray]
    overflow: Overflow | None


class _Runner:
    def __init__(self, plan: Plan, engine: Engine, topology: Topology):
        self.plan, self.engine, self.topology = plan, engine, topology

    def run_phase(self, step: int, start: dict[int, dict[MemoryCategory, int]], start_s: float) -> PhaseRun:
        phase = self.plan.phase(step)
        results = tuple(self.engine.run_segment(seg) for seg in phase.segments)
        duration = sum(seg.repeat * res.duration_s for seg, res in zip(phase.segments, results))
        same_ledgers: dict = {}  # ranks whose ledgers are equal share one
        memory = {r: phase_memory(phase, results, r, start[r], self.topology.devices[r].memory_capacity_bytes,
                                  start_s, same_ledgers) for r in self.plan.ranks}
        return PhaseRun(phase, results, duration, memory)


def simulate_run(plan: Plan, engine: Engine, topology: Topology, runner=None) -> RunResult:
    """Price every phase of ``plan``: prefill, then decode steps by verified interpolation.
    ``runner``: what prices one phase, ``run_phase(step, start_bytes, start_s)`` returning a
    :class:`PhaseRun` or one with its ``duration_s``, ``memory`` and ``signature()`` (a
    pipeline's, :mod:`sim.pipeline_run`); default: the engine on the plan's phase."""
    runner = runner or _Runner(plan, engine, topology)
    ranks = plan.ranks
    initial = plan.initial_memory_bytes
    prefill = runner.run_phase(0, {r: {c: initial[r].get(c, 0) for c in CATEGORIES} for r in ranks}, 0.0)
    simulated = {0: prefill}
    num_steps = plan.num_phases
    durations = np.zeros(num_steps)
    durations[0] = prefill.duration_s
    after_prefill = {r: prefill.memory[r].end_by_category for r in ranks}
    peak_bytes = {r: prefill.memory[r].peak_bytes for r in ranks}
    peak_by_category = {r: prefill.memory[r].peak_by_category for r in ranks}
    base_totals = {r: np.full(num_steps, float(sum(after_prefill[r].values()))) for r in ranks}
    for r in ranks:
        base_totals[r][0] = sum(initial[r].values())

    if num_steps > 1:
        first = runner.run_phase(1, after_prefill, prefill.duration_s)
        per_step = {r: {c: first.memory[r].end_by_category[c] - after_prefill[r][c] for c in CATEGORIES}
                    for r in ranks}

        def start_of(step: int) -> dict[int, dict[MemoryCategory, int]]:
            return {r: {c: after_prefill[r][c] + (step - 1) * per_step[r][c] for c in CATEGORIES}
                    for r in ranks}

        def run(step: int) -> PhaseRun:
            if step not in simulated:
                # Start times of sampled steps are not known yet; overflow times are fixed up below.
                simulated[step] = first if step == 1 else runner.run_phase(step, start_of(step), 0.0)
            return simulated[step]

        signatures: dict[int, np.ndarray] = {}

        def sig(step: int) -> np.ndarray:
            if step not in signatures:
                signatures[step] = run(step).signature()
            return signatures[step]

        lo, hi = 1, num_steps - 1
        stack, intervals = [(lo, hi)], []
        while stack:
            a, b = stack.pop()
            if b - a <= 1:
                intervals.append((a, b))
                continue
            m = (a + b) // 2
            chord = sig(a) + (m - a) / (b - a) * (sig(b) - sig(a))
            if np.allclose(sig(m), chord, rtol=_RTOL, atol=1e-15):
                intervals.append((a, b))
            else:
                stack += [(m, b), (a, m)]
        for a, b in intervals:
            da, db = run(a).duration_s, run(b).duration_s
            steps = np.arange(a, b + 1)
            durations[a:b + 1] = da + (steps - a) / max(b - a, 1) * (db - da)
        for r in ranks:
            base_totals[r][1:] = sum(after_prefill[r].values()) + np.arange(num_steps - 1) * sum(per_step[r].values())
        # Peaks are convex in the step, so the extreme decode steps bound every step in between.
        for step in (1, num_steps - 1):
            for r in ranks:
                mem = run(step).memory[r]
                if mem.peak_bytes > peak_bytes[r]:
                    peak_bytes[r], peak_by_category[r] = mem.peak_bytes, mem.peak_by_category

    ends = np.cumsum(durations)
    starts = ends - durations
    overflow = _first_overflow(plan, topology, simulated, starts, runner, start_of if num_steps > 1 else None)
    return RunResult(plan, starts, ends, dict(sorted(simulated.items())), peak_bytes, peak_by_category,
                     base_totals, overflow)


def _first_overflow(plan, topology, simulated, starts, runner, start_of):
    """The first op, in time, whose rank's memory exceeds its capacity (None if all fit)."""
    for r in plan.ranks:
        capacity = topology.devices[r].memory_capacity_bytes
        resident = sum(plan.initial_memory_bytes[r].values())
        if resident > capacity:
            return Overflow(r, "weights (resident before the first op)", PhaseKind.PREFILL, 0, None, 0.0, resident, capacity)
    candidates = [m.overflow for m in simulated[0].memory.values() if m.overflow is not None]
    if candidates:
        return min(candidates, key=lambda o: (o.time_s, o.rank))
    if start_of is None or plan.num_phases - 1 not in simulated:
        return None
    last = simulated[plan.num_phases - 1]
    if all(m.overflow is None for m in last.memory.values()):
        return None
    # Memory grows with the step: bisect for the first decode step that overflows, then replay it.
    lo, hi = 1, plan.num_phases - 1
    while lo < hi:
        mid = (lo + hi) // 2
        run = runner.run_phase(mid, start_of(mid), float(starts[mid]))
        if any(m.overflow is not None for m in run.memory.values()):
            hi = mid
        else:
            lo = mid + 1
    run = runner.run_phase(lo, start_of(lo), float(starts[lo]))
    return min((m.overflow for m in run.memory.values() if m.overflow is not None), key=lambda o: (o.time_s, o.rank))
