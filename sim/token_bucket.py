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
* a channel's bucket fills at the channel's bandwidth (not a transport's efficiency-scaled share)
  up to its depth while no flow crosses it, and not at all while one does (a flow is taken to keep
  its bucketed channels busy: exact where the bucketed channel is the flow's bottleneck);
* a flow starting over a route whose narrowest channel has a bucket sends at once
  ``min(size, tokens)`` bytes, the tokens being the least of the route's bucketed channels', and
  takes that many from each; the rest flows at its max-min rate. The burst leaves at the speed of
  the rest of the path, taken as instant: the emulated testbed's veths are tens of times faster
  than its shaped rates. A route whose narrowest channel has no bucket is paced by that channel
  and gets nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Whether the fluid network prices declared buckets (read when a :class:`sim.network.Links` is
# built, and by the ping-pong overhead of a fit, :func:`sim.transport.message_overhead_s`; the
# offline benchmarks' ``--token-buckets`` sets it). Off, because on the shipped transfer figure it
# does not help (benchmarks/bench_transfer_offline.py --also validation/transfer-new.yaml
# validation/transfer-new-report, prediction, |error| median/p90 off -> on: the 6 shipped
# clusters with another shipped cluster's profile 5.8/15.7% -> 5.5/18.0%, TTFT's median bias
# +3.8% -> -3.9%; uncalibrated 5.3/15.2% -> 6.3/21.4%, its gloo defaults fitted without
# buckets). It helps elsewhere: the 3 clusters of validation/transfer-new.yaml as targets (held
# out) 9.9/32.6% -> 6.7/30.9%; layouts (bench_layouts_offline.py, new layouts, prediction) TTFT
# 13.7/32.8% -> 6.7/30.5%, TPOT 8.0/29.9% -> 6.4/27.6%; and the transport fits over bucketed
# links explain the sweeps better (rms log error of the bandwidth clusters' broadcasts and
# ping-pongs 0.37-0.66 -> 0.07-0.14). Following the buckets' state through a segment
# (:mod:`sim.bucket_clock`) moved the transfer figures by at most 0.2 points. What keeps it off:
# with buckets on, TTFT is about 9 points lower on every shipped target, and that is not a bucket
# term (benchmarks/bench_bucket_terms.py, offline, prediction): the prefill's collective calls go
# from +18% of TTFT too slow to +4% (no profile; pooled +17% -> +3%), as the isolated held-out
# sweep says they should (96 KiB calls from another cluster's terms +10.6% -> -4.5% median), while
# the master's wait for the last rank in prefill, 13% of the measured TTFT (median; 2-61%), is
# simulated 0 either way: off, the over-priced calls hid it. The fits price the buckets as the runs
# do (a fit made with them and runs without: shipped other 5.8/15.7% -> 8.4/22.8%), and a real
# message after idle gets its burst (benchmarks/bench_tbf_burst.py: raw TCP, BBR or cubic, 3.5 ms
# to 300 ms idle, with or without busy processes on its two cores; BBR right after a 4 MiB stream
# paces a 64 KiB message at the rate, tcp_bbr.c's restart from idle at its bandwidth estimate).
# With the prefill's wait (sim.cores.ARRIVAL_LAGS_PRICED) and gloo's broadcast tree
# (sim.collectives.registry.LIBRARY_BROADCAST) TTFT comes right, but decode's TPOT gets worse:
# fitted with the buckets, the sweeps' and ping-pongs' small-message excess lands in the
# per-message overhead, which a run's decode calls do not pay
# (validation/transfer-report/progress.md, session 20).
PRICED = False


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
        """The bucketed channels of a route, empty where its narrowest channel has no bucket."""
        if not channels or min(channels, key=lambda c: self.capacity[c]) not in self.depth:
            return []
        return [c for c in channels if c in self.depth]

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
        at once, taken from every bucket it crosses. Call :meth:`end` when it ends."""
        paced = self._paced(channels)
        burst = min(size_bytes, min((self.filled(c, now_s) for c in paced), default=0.0))
        for c in channels:
            if c in self.depth:
                self.tokens[c] = self.filled(c, now_s) - (burst if c in paced else 0.0)
                self.idle_since[c] = None
                self.flows[c] += 1
        return burst

    def end(self, channels: Sequence[int], now_s: float) -> None:
        """A flow started over ``channels`` has ended at ``now_s`` (s): its channels left idle refill."""
        for c in channels:
            if c in self.depth:
                self.flows[c] -= 1
                if not self.flows[c]:
                    self.idle_since[c] = now_s


def bucket_lower_bound_s(carried_bytes: float, depth_bytes: int | None, capacity_bytes_per_s: float,
                         refill_bytes_per_s: float) -> float:
    """A time (s) a channel cannot carry ``carried_bytes`` in: ``carried / capacity`` without a
    bucket; with one, its tokens pay at most its depth plus its refill over the time, the rest
    going at the capacity, so ``T >= (carried - depth) / (capacity + refill)``."""
    if not depth_bytes:
        return carried_bytes / capacity_bytes_per_s
    return max(0.0, carried_bytes - depth_bytes) / (capacity_bytes_per_s + refill_bytes_per_s)
