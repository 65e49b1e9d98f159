"""Ranks that start a training step apart: the reducer's last ring releases them at different
times, and on cores the ranks share that decides what overlap buys.

A TCP send completes once the kernel has taken its bytes, the tail of a large one into the
socket's send buffer (:class:`sim.transport._TransportRun`). In a ring allreduce whose links
differ (two hosts of two ranks: a fast link inside a host, a slow one between), a rank whose last
step sends over the slow link and receives over the fast one is done a slow transfer before the
rank that receives over the slow link (``benchmarks/bench_send_buffer.py`` times the send buffer).
Measured on the emulated 2 hosts x 2 ranks at 100 Mbit/s between hosts
(``validation/training-report/overlap-s25``, the 5 MiB bucket case's last step): the two ranks
that receive across hosts end the ring 0.05-0.11 s after the others and start the next step
0.10-0.14 s after them; on 4 hosts x 1 rank, links all alike, within 0.02 s.

Each step is one more of the same, so a step starts as the one before ended: the late ranks still
wait in the ring's last receive (asleep: they hold no core) while the early ones go on to the
optimizer and the next forward pass. On cores of their own that only shifts each rank's step. On
cores the ranks share it does not:

* without overlap, every rank computes its whole backward before any bucket moves: the early ones,
  done first, sleep in the first bucket's ring and leave the cores to the late ones, so the last
  gradient comes about as soon as the cores can do all the ranks' work, and the late ranks' wait
  overlapped the early ones' compute: the step is shorter by about the lag;
* with overlap, the early ranks compute on through the backward while the first bucket's ring
  waits for the late ranks, which compute at their share of the cores all along: the chain of
  buckets starts that much later than the early ranks' first gradient, and the step is no shorter.

Measured there (30 steps of each case, interleaved), from the late rank's start: the first
bucket's ring started 0.25-0.29 s in with overlap and the last gradient came 0.37-0.44 s in
without (every rank at once: 0.52 s), so the overlap gain was 1.05-1.06 where ranks starting
together give 1.09 (``validation/training-report/progress.md``, session 25).

:func:`finish_lags` reads each rank's lag off a simulated step (the end of its part in the
bucket segment's last collective, after the first rank's); :func:`with_lags` starts each late
rank's bucket segment with a wait of its lag (:data:`models.ops.OpKind.STEP_LAG`: asleep, no
core, :mod:`sim.engine`; shown where it tells, in the trace too); what the earlier segments do, every rank computing at its share of the
cores from the step's start, leaves the same lag (a rank that started late is as late at the
backward), so the lag is placed where it tells: the segment whose collectives wait for the
slowest rank. :func:`lagged_step` counts the segment's time as each rank's from the end of its lag, the
longest of them (every rank's step is the period: the lag overlaps the step before).
"""

from __future__ import annotations

from dataclasses import replace

from models.accounting import OpCost
from models.ops import OpKind
from sim.program import Op, Stream
from sim.vocabulary import TrainingPhase

LAG_TOLERANCE_S = 1e-6
"""Lags below this (s) are float rounding: ranks released together."""

_NO_COST = OpCost(flops=0, bytes_read=0, bytes_written=0, weight_bytes=0, workspace_bytes=0)


def bucket_segment(step) -> int | None:
    """The index of ``step``'s (:class:`sim.training.lower.TrainingStep`) segment that holds the
    reducer's bucket allreduces (collectives on the communication stream in the backward), None
    where it has none or a later segment communicates too (a ZeRO-1 broadcast, a parameter
    average: what releases the ranks last is not a bucket's ring)."""
    found = None
    for index, part in enumerate(step.segments):
        for rank, program in part.segment.programs.items():
            phases = part.phases[rank]
            for op, phase in zip(program, phases):
                if op.collective is not None and op.stream is Stream.COMM:
                    if phase is not TrainingPhase.BACKWARD:
                        return None
                    found = index
    return found


def finish_lags(simulated) -> dict[int, float]:
    """Per rank of a simulated step (:class:`sim.training.simulate.SimulatedStep`), how long after
    the first rank its part in the bucket segment's communication ends (s, >= 0): the end of its
    last op on the communication stream there. Empty where the step has no bucket segment, or
    where it was simulated as one replica standing for the others (their ranks leave together)."""
    index = bucket_segment(simulated.step)
    if index is None or simulated.mirrors:
        return {}
    segment = simulated.step.segments[index].segment
    result = simulated.results[index]
    ends = {}
    for rank, program in segment.programs.items():
        comm = [i for i, op in enumerate(program) if op.stream is Stream.COMM]
        if comm:
            ends[rank] = float(result.ends[rank][comm].max())
    if not ends:
        return {}
    first = min(ends.values())
    return {rank: end - first for rank, end in ends.items()}


def with_lags(step, lags: dict[int, float]):
    """``step`` (:class:`sim.training.lower.TrainingStep`) whose bucket segment starts each rank
    with a wait of its lag (:data:`OpKind.STEP_LAG`, on the compute stream, in the phase
    :data:`TrainingPhase.LAG`; ranks without a lag above :data:`LAG_TOLERANCE_S` unchanged); the
    ops' ``after`` indices follow the shift."""
    index = bucket_segment(step)
    if index is None:
        return step
    part = step.segments[index]
    programs, phases = dict(part.segment.programs), dict(part.phases)
    for rank, lag_s in lags.items():
        if lag_s <= LAG_TOLERANCE_S or rank not in programs:
            continue
        wait = Op(OpKind.STEP_LAG, OpKind.STEP_LAG.value, Stream.COMPUTE, cost=_NO_COST)
        shifted = [op if op.after is None else replace(op, after=tuple(i + 1 for i in op.after))
                   for op in programs[rank]]
        programs[rank] = (wait, *shifted)
        phases[rank] = (TrainingPhase.LAG, *phases[rank])
    segment = replace(part.segment, programs=programs)
    segments = list(step.segments)
    segments[index] = replace(part, segment=segment, phases=phases)
    return replace(step, segments=tuple(segments))


def lagged_step(simulated, lags: dict[int, float]):
    """``simulated`` (:class:`sim.training.simulate.SimulatedStep` of :func:`with_lags`'s step)
    with its ``overlap_s`` set: how much less than its segments' durations the step takes, its
    bucket segment counted per rank from the end of the rank's lag (the lag is the previous step's
    tail), the longest of them."""
    index = bucket_segment(simulated.step)
    if index is None:
        return simulated
    result = simulated.results[index]
    duration = max((float(ends.max()) - lags.get(rank, 0.0) for rank, ends in result.ends.items() if len(ends)),
                   default=result.duration_s)
    return replace(simulated, overlap_s=max(0.0, result.duration_s - duration))
