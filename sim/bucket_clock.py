"""The token state of the links through a segment, for collectives that keep their priced timing.

A collective's priced timing (closed form, cached, or calibrated: :class:`sim.network.CollectivePricer`)
is computed once on an idle network, so its links' token buckets (:mod:`sim.token_bucket`) are
full at its start, however soon after the previous collective over those links it runs. A
:class:`BucketClock` follows the buckets of one segment in simulated time instead: a call
starting at ``t`` finds each bucketed channel of its schedule holding what the previous call over
it left, refilled at the channel's rate since (``min(depth, left + rate * idle_s)``, as
``tbf_dequeue`` in Linux's ``net/sched/sch_tbf.c`` accrues tokens); the call is delayed, per rank,
by what the fluid model (:class:`sim.network.FlowNetwork`) says those missing tokens cost
(its finish from the drained buckets less its finish from full ones), and leaves the channels
holding what that fluid run leaves them, from the call's end on. A call whose timing was measured
in place on the cluster it prices (a same-cluster replay, :attr:`sim.network.CollectiveTiming.in_place`)
is not delayed: the run it was timed in had the same calls before it over the same links, so the
tokens it found, and the bursts it got or missed, are in its measured time already; delaying it
again counted the missing tokens twice (validation/layouts-report/progress.md, session 20: the
tp4 replay on v2x2_bandwidth +17-23% TTFT with gloo's broadcast tree). It still drains the buckets
it crosses, as the fluid model says, for the calls after it that are priced.

The drained runs are cached per schedule and bucket level, the level rounded down to
``1 / LEVELS`` of each bucket's depth (a bucket holding a little less than it does costs at
most ``depth / LEVELS`` bytes at the rate more): a segment's calls repeat a few levels, so the
cache keeps the engine's per-call cost O(1).

A segment starts with full buckets, except a repeated one (a decode step's layers): its
instances run back to back, so the engine prices it from the buckets its own end leaves
(:meth:`sim.engine.Engine.run_segment`). The fabric's transfers (:class:`sim.fabric.Fabric`) draw
on the same buckets.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import replace

from sim.collectives.schedule import CommSchedule
from sim.network import CollectiveTiming, FlowNetwork, Links

# The resolution of a bucket level in the cache key: 1 / LEVELS of its depth.
LEVELS = 32


class BucketClock:
    """The buckets of one segment's links, from full at t = 0.

    Args:
        links: the segment's links (their bursts, refill rates and capacities).
        fluid: the fluid model pricing a schedule from given bucket levels (over ``links``).
        cache: drained runs shared across segments: (schedule key, levels) -> (per rank delay
            (s), tokens left per channel (bytes)).
        tokens_bytes: per channel id, the tokens its bucket holds at t = 0 (bytes); full where absent.
    """

    def __init__(self, links: Links, fluid: FlowNetwork, cache: dict, tokens_bytes: dict[int, float] | None = None):
        self.buckets = links.buckets(tokens_bytes)
        self.fluid = fluid
        self.cache = cache

    def full(self) -> dict[int, float]:
        """Every bucketed channel's depth (bytes)."""
        return self.buckets.depth

    def left_at(self, end_s: float) -> dict[int, float]:
        """The tokens (bytes) every bucketed channel holds at ``end_s`` (s), nothing crossing it then."""
        return {c: self.buckets.filled(c, end_s) for c in self.buckets.depth}

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def delays(self, key: Hashable, schedule: CommSchedule, channels: Iterable[int],
               start_s: float) -> tuple[dict[int, float], dict[int, float]]:
        """What a call of ``schedule`` (cached under ``key``) over ``channels`` (ids) starting at
        ``start_s`` (s) waits beyond its priced timing for its buckets' missing tokens: per rank
        (s, 0 where its buckets are as full as pricing took them); and the tokens (bytes) each of
        its bucketed channels holds at its end (pass them to :meth:`used`)."""
        buckets = self.buckets
        paced = sorted(c for c in channels if c in buckets.depth)
        if not paced:
            return {}, {}
        levels = tuple(min(LEVELS, math.floor(buckets.filled(c, start_s) / buckets.depth[c] * LEVELS)) for c in paced)
        entry = self.cache.get((key, levels))
        if entry is None:
            full = self.cache.get((key, None))
            if full is None:
                full = self.cache[(key, None)] = self.fluid.time(schedule)
            held = {c: level / LEVELS * buckets.depth[c] for c, level in zip(paced, levels)}
            drained, left = self.fluid.time_from(schedule, held)
            delay = {rank: max(0.0, drained.finish_s[rank] - full.finish_s[rank]) for rank in full.finish_s}
            entry = self.cache[(key, levels)] = (delay, {c: left[c] for c in paced})
        return entry

    def used(self, left_bytes: dict[int, float], end_s: float) -> None:
        """A call has left its bucketed channels holding ``left_bytes`` (per channel id, bytes) at
        ``end_s`` (s), idle from then on."""
        for c, held in left_bytes.items():
            self.buckets.tokens[c] = held
            self.buckets.idle_since[c] = end_s


def delayed(timing: CollectiveTiming, delay_s: dict[int, float]) -> CollectiveTiming:
    """``timing`` with each rank's finish later by ``delay_s[rank]`` (s; none where absent); a
    timing measured in place (:attr:`sim.network.CollectiveTiming.in_place`) unchanged: the
    tokens its run found are in it already."""
    if timing.in_place or not any(delay_s.values()):
        return timing
    finish = {rank: t + delay_s.get(rank, 0.0) for rank, t in timing.finish_s.items()}
    return replace(timing, duration_s=max(finish.values(), default=0.0), finish_s=finish)
