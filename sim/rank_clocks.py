"""The ranks' own clocks across a forward pass's segments: no barrier where the real run has none.

A phase is lowered into segments (:mod:`sim.program`: the prologue, a decoder layer repeated,
the last layer), but the runtime runs a rank's program straight through them
(``runtime/executor.py``, ``_run_phase``): nothing waits for the other ranks at a segment's end.
A rank that leaves a collective early (a broadcast's root, once its sends are done: gloo
``gloo/broadcast.cc`` and ``gloo/transport/tcp/pair.cc``, :func:`sim.collectives.gloo.gloo_broadcast`)
starts its next ops early, and waits in its next collective for the ranks still receiving: the
master's wait for the embedding broadcast's leaves inside the first layer's allreduce.

:func:`run_phase_segments` runs a phase's segment instances in order, each rank starting an
instance when it left the one before (``ready_s`` of :meth:`sim.engine.Engine.run_segment`). An
instance's results are relative to its start, the earliest rank's; the next instance starts when
the first rank leaves this one. Where an instance leaves its ranks apart exactly as they came
(the common case: ranks that leave an allreduce together come and leave together), every further
instance of the segment is the same, and one result stands for them, as the engine's repeated
segments always have; otherwise the instance is split off and the next one simulated, at most
:data:`DISTINCT_INSTANCES` times per segment, after which the last one simulated stands for the
rest (a pattern still changing after that many layers is taken as settled). Ranks that leave
every instance together give the segments' own results, bit for bit.

The phase still starts with every rank idle and ends when its last rank is done: a forward pass
begins with the master's embedding (or a stage's receive), which every other rank waits for.
"""

from __future__ import annotations

from dataclasses import replace

from sim.engine import Engine, SegmentResult
from sim.program import Phase, Segment

DISTINCT_INSTANCES = 4
"""How many instances of one repeated segment are simulated apart, at most, before the last one
stands for the rest: a decoder layer's ranks settle into a pattern after the first."""

SETTLED_S = 1e-12
"""Two ranks' offsets within this (s) are the same: float rounding, not a different pattern."""


def run_phase_segments(engine: Engine, phase: Phase) -> tuple[Phase, tuple[SegmentResult, ...], float]:
    """Simulate ``phase`` with the ranks' clocks carried across its segments (module docstring).

    Returns:
        ``(timed phase, results, duration_s)``: the phase with a segment split into pieces where
        its instances differ (each piece a :class:`sim.program.Segment` with its repeat count
        and decoder layers, so :attr:`sim.program.Phase.layer_of_segment` still numbers them),
        one result per piece (op times relative to the instance's start; ``duration_s`` the time
        from one instance's start to the next's: its first rank's leaving), and the phase's
        duration (s): from its start to its last rank's leaving.
    """
    start = 0.0  # the current instance's start, from the phase's (s): the shifts summed in order
    ready: dict[int, float] = {}  # rank -> when it left its last op, from the phase's start (s)
    pieces: list[Segment] = []
    results: list[SegmentResult] = []
    for segment in phase.segments:
        ranks = [r for r, program in segment.programs.items() if program]
        left = segment.repeat
        simulated = 0
        while left:
            offsets = _settled({r: max(0.0, ready.get(r, 0.0) - start) for r in segment.programs})
            result = engine.run_segment(segment, offsets if any(offsets.values()) else None)
            simulated += 1
            exits = {r: float(result.ends[r].max()) for r in ranks}
            step_s = min(exits.values(), default=0.0)
            after = _settled({r: exits[r] - step_s for r in ranks})
            same = all(abs(after[r] - offsets[r]) <= SETTLED_S for r in ranks)
            count = left if same or simulated >= DISTINCT_INSTANCES else 1
            pieces.append(replace(segment, repeat=count))
            results.append(replace(result, duration_s=step_s))
            last_start = start + (count - 1) * step_s if count > 1 else start
            ready.update({r: last_start + exits[r] for r in ranks})
            start += count * step_s
            left -= count
    last = max(ready.values(), default=start)
    duration = last if last - start > SETTLED_S else start  # start: the segments' durations summed, as before
    timed = phase if len(pieces) == len(phase.segments) else replace(phase, segments=tuple(pieces))
    return timed, tuple(results), duration


def _settled(offsets: dict[int, float]) -> dict[int, float]:
    """``offsets`` (s) with those within :data:`SETTLED_S` of 0 made 0."""
    return {r: 0.0 if abs(t) <= SETTLED_S else t for r, t in offsets.items()}


def split_like(phase: Phase, timed: Phase) -> Phase:
    """``phase`` with its segments split into the pieces of ``timed`` (what
    :func:`run_phase_segments` returned for a phase of the same segments and repeats: the same
    pass lowered for other ranks, a pipeline stage's twin), so ``timed``'s results fit it."""
    if len(timed.segments) == len(phase.segments):
        return phase
    pieces = iter(timed.segments)
    out = []
    for segment in phase.segments:
        left = segment.repeat
        while left:
            piece = next(pieces)
            out.append(replace(segment, repeat=piece.repeat))
            left -= piece.repeat
    return replace(phase, segments=tuple(out))
