"""Token buckets on links: what a tbf-shaped link lets through faster than its rate.

A link declaring ``burst`` (:attr:`sim.cluster_config.LinkConfig.burst_bytes`) is paced by a
token bucket of that depth filled at the link's bandwidth, as Linux's Token Bucket Filter shapes
it (tc-tbf(8); ``net/sched/sch_tbf.c``: ``tbf_dequeue`` lets a packet go when the tokens
accrued since the last one, ``min(now - t_c, buffer)`` at the rate, cover it, and keeps the
remainder). A message that finds tokens goes out their worth of bytes at the speed of the rest
of its path and only the rest at the rate: after an idle gap long enough to fill the bucket
(32 kB at 100 Mbit/s: 2.6 ms), a message of at most ``burst`` bytes costs its per-message terms
alone, a long stream converges to the rate.

The fluid model's version, where :data:`PRICED` (:class:`TokenBuckets`, one per run of the fluid network: a
:class:`sim.network.FlowNetwork` pricing on an idle network starts with full buckets; the
engine follows one through each segment, :mod:`sim.bucket_clock`, shared by its
:class:`sim.fabric.Fabric` and by the collectives that keep their priced timing, which it
delays by the tokens their links miss at their start):

* tokens are the link's (its channel's), not a flow's: flows crossing a channel draw on one bucket;
* a flow draws on the buckets of its route's narrowest channels only (its bottleneck: the
  channels of the route's least capacity): a faster channel's bucket, full or empty, passes the
  flow's bytes faster than the bottleneck takes them, and refills faster than they come once the
  burst is through. On the emulated testbed a message between hosts does not cross the shaped
  ``lo`` of either host at all (:mod:`runtime.testbed.shaping`), whose bucket the topology puts
  on a host's interconnect; drawn on as well, a root's broadcast to a rank of its own host
  emptied it and left its message to the other host no burst (uneven TP 3 of GPT-2 on
  v2x2_bandwidth, prefill: 8.4 ms from the root's start to the far rank's end, 6.5 ms measured,
  ``validation/layouts-report/progress.md``, session 34);
* a bottleneck's bucket fills at the channel's bandwidth (not a transport's efficiency-scaled
  share) up to its depth while no flow it paces crosses it, and not at all while one does (the
  flow is taken to keep it busy);
* a flow starting over a route whose narrowest channel has a bucket sends at once
  ``min(size, tokens)`` bytes, the tokens being the least of its bottleneck buckets', and takes
  that many from each; the rest flows at its max-min rate. The burst leaves at the speed of
  the rest of the path, taken as instant: the emulated testbed's veths are tens of times faster
  than its shaped rates. A route whose narrowest channel has no bucket is paced by that channel
  and gets nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Whether the fluid network prices declared buckets (read when a :class:`sim.network.Links` is
# built, and by the ping-pong overhead of a fit, :func:`sim.transport.message_overhead_s`; the
# offline benchmarks' ``--no-token-buckets`` clears it). On, with the prefill's arrival lags
# (sim.cores.ARRIVAL_LAGS_PRICED) and gloo's broadcast tree (sim.collectives.registry.
# LIBRARY_BROADCAST), since the quiet full transfer run from a fresh clone (9 clusters,
# validation/transfer-report/fresh-s23-quiet), re-simulated offline (prediction from another
# cluster's profile, |error| median / p90, off -> on): TTFT 7.8/24.9% -> 5.1/15.1%, TPOT
# 5.7/21.5% -> 4.9/17.1%; uncalibrated TTFT 9.7/17.9% -> 3.1/11.4%; every replay unchanged; the
# layouts' new layouts (quiet-s19) TTFT 17.7/34.7% -> 3.8/10.4%, TPOT 3.4/12.6% -> 4.4/18.6%;
# training step time (prediction) 5.6/12.7% -> 4.8/12.0% (validation/transfer-report/progress.md,
# session 24). A real message after idle gets its burst (benchmarks/bench_tbf_burst.py: raw TCP,
# BBR or cubic, 3.5 ms to 300 ms idle), and the fits price the buckets as the runs do. Off, the
# wire time the buckets take away hid the prefill master's wait for the last rank (13% of the
# measured TTFT, median), which the arrival lags now price. What the buckets cost: decode's TPOT
# p90 on the older layout runs (fitted with the buckets, the sweeps' and ping-pongs' small-message
# excess lands in the per-message overhead, which a run's decode calls do not pay; section
# "session 20" of progress.md).
PRICED = True


class TokenBuckets:
    """The token state of the bucketed channels of one fluid run, from its start at t = 0.

    Args:
        depth_bytes: per channel id, its bucket's depth (bytes) or None for none; ids beyond the
            sequence (channels appended later) have none.
        refill_bytes_per_s: per channel id, the rate its bucket fills at (bytes/s).
        capacity: per channel id, what a flow's bytes get of it (bytes/s): which is a route's
            narrowest channel.
        tokens_bytes: per channel id, the tokens its bucket holds at t = 0 (bytes, at most its
            depth); a bucketed channel missing here starts full (a run on a network idle long enough).
    """

    def __init__(self, depth_bytes: Sequence[int | None], refill_bytes_per_s: Sequence[float],
                 capacity: Sequence[float], tokens_bytes: Mapping[int, float] | None = None):
        self.depth = {c: float(d) for c, d in enumerate(depth_bytes) if d}
        self.refill = refill_bytes_per_s
        self.capacity = capacity
        self.tokens = dict(self.depth)
        for c, held in (tokens_bytes or {}).items():
            if c in self.depth:
                self.tokens[c] = min(self.depth[c], max(0.0, float(held)))
        self.idle_since: dict[int, float | None] = dict.fromkeys(self.depth, 0.0)  # None while crossed
        self.flows = dict.fromkeys(self.depth, 0)

    def __bool__(self) -> bool:
        return bool(self.depth)

    def _paced(self, channels: Sequence[int]) -> list[int]:
        return pacing(channels, self.capacity, self.depth)

    def filled(self, channel: int, now_s: float) -> float:
        """The tokens (bytes) bucketed ``channel`` holds at ``now_s`` (s), refilled since its last flow."""
        since = self.idle_since[channel]
        if since is None:
            return self.tokens[channel]
        return min(self.depth[channel], self.tokens[channel] + (now_s - since) * self.refill[channel])

    def available_bytes(self, channels: Sequence[int], now_s: float) -> float:
        """The bytes a flow starting at ``now_s`` (s) over ``channels`` would send at once."""
        paced = self._paced(channels)
        return min((self.filled(c, now_s) for c in paced), default=0.0)

    def start(self, channels: Sequence[int], size_bytes: float, now_s: float) -> float:
        """A flow of ``size_bytes`` starts over ``channels`` at ``now_s`` (s): the bytes it sends
        at once, taken from every bucket pacing it. Call :meth:`end` when it ends."""
        paced = self._paced(channels)
        burst = min(size_bytes, min((self.filled(c, now_s) for c in paced), default=0.0))
        for c in paced:
            self.tokens[c] = self.filled(c, now_s) - burst
            self.idle_since[c] = None
            self.flows[c] += 1
        return burst

    def end(self, channels: Sequence[int], now_s: float) -> None:
        """A flow started over ``channels`` has ended at ``now_s`` (s): the buckets it kept busy
        refill once no other flow they pace crosses them."""
        for c in self._paced(channels):
            self.flows[c] -= 1
            if not self.flows[c]:
                self.idle_since[c] = now_s


def pacing(channels: Sequence[int], capacity: Sequence[float], depth: Mapping[int, float]) -> list[int]:
    """The bucketed channels pacing a route over ``channels`` (ids): its narrowest ones (least
    ``capacity``, bytes/s), whose buckets a flow over it draws on (module docstring); empty where
    one of them has no bucket (``depth``: per bucketed channel id, its depth in bytes)."""
    if not channels:
        return []
    narrowest = min(capacity[c] for c in channels)
    paced = [c for c in channels if capacity[c] == narrowest]
    return paced if all(c in depth for c in paced) else []


def bucket_lower_bound_s(carried_bytes: float, depth_bytes: float, capacity_bytes_per_s: float,
                         refill_bytes_per_s: float) -> float:
    """A time (s) a channel cannot carry ``carried_bytes`` in, where the buckets pacing the flows
    over it hold ``depth_bytes`` in all (0: none) and refill at ``refill_bytes_per_s`` in all:
    ``carried / capacity`` without; with them, their tokens pay at most their depth plus their
    refill over the time, the rest going at the capacity, so
    ``T >= (carried - depth) / (capacity + refill)``."""
    if not depth_bytes:
        return carried_bytes / capacity_bytes_per_s
    return max(0.0, carried_bytes - depth_bytes) / (capacity_bytes_per_s + refill_bytes_per_s)
