"""When collective calls carry bytes on each channel, kept as long as no two of them meet.

:meth:`sim.engine.Engine.run_segment` runs a segment with every collective at its priced timing
and keeps that run where no two calls of different groups carry bytes on a common channel at
the same time (the engine's module docstring says why that is the fabric's answer). The calls
arrive in the order the engine resolves them, not in time order; a :class:`ChannelSpans` says
at each call whether it meets one already added, so that a run that cannot be kept stops early.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable


class ChannelSpans:
    """Per channel id, the spans (start s, end s, group) added so far, sorted and pairwise apart:
    one ends before the next starts, or exactly as it starts where both are calls of one group
    (a group's calls on one stream follow one another: every rank leaves one before the group
    meets in the next)."""

    def __init__(self):
        self._spans: dict[int, list[tuple[float, float, tuple[int, ...]]]] = {}

    def add(self, start_s: float, end_s: float, group: tuple[int, ...], channels: Iterable[int]) -> bool:
        """Add a call of ``group`` carrying bytes on ``channels`` from ``start_s`` to ``end_s``;
        False (and the spans left in an unspecified state) where it meets a span already there."""
        span = (start_s, end_s, group)
        for channel in channels:
            spans = self._spans.setdefault(channel, [])
            at = bisect_left(spans, span)
            # the spans are apart, so their ends follow their starts: the neighbours decide
            if at and not _before(spans[at - 1], span):
                return False
            if at < len(spans) and not _before(span, spans[at]):
                return False
            spans.insert(at, span)
        return True


def _before(first: tuple[float, float, tuple[int, ...]], then: tuple[float, float, tuple[int, ...]]) -> bool:
    """Whether span ``first`` is over when ``then`` starts (touching it only within one group)."""
    return first[1] < then[0] or (first[1] == then[0] and first[2] == then[2])
