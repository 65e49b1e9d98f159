"""Network models: how long a collective's point-to-point schedule takes on a topology.

Dependency semantics, identical in every model:

* All ranks of the schedule's group start at t = 0.
* A rank is ready for step k when all its transfers of the steps before k are complete: those it
  sends (complete when the bytes have arrived) and those it receives (on arrival, or for a
  reduce-transfer when the receiver has also added the bytes, see below).
* A transfer of step k starts at ``max(ready_k(src), ready_k(dst))``: steps order each rank's
  work, they are not barriers across the group.
* Where the schedule lets a rank keep steps in flight (``CommSchedule.in_flight``, gloo's ring:
  2), ready_k waits only for the rank's steps ``<= k - in_flight[k]`` (and its entering step
  k - 1); the messages of one pair of ranks then move their bytes one at a time, in the order
  their latencies end (one TCP connection per pair, whose ops gloo's ``transport/tcp/pair.cc``
  writes in order), where a step waiting for the ones before never has two under way.
* A rank adds received reduce-transfers one at a time, in order of arrival (ties in schedule
  order); each reduction starts when its bytes have arrived and the previous one is done, and
  takes ``gamma(rank) x size_bytes``, the gamma of the dtype the schedule reduces in
  (``CommSchedule.reduce_dtype``, :class:`ReductionCosts`).
* A rank finishes when its last transfer or reduction completes (at 0 if it takes part in no step).

The models differ in what a transfer costs once started:

* :class:`AlphaBetaNetwork`: ``path latency + size / bandwidth``, where a channel crossed by c
  non-empty transfers of the same step gives each 1/c of its bandwidth and the path's narrowest
  share counts. This is the static sharing MPICH's formulas assume (a star's hub link serialises
  its p-1 messages), which makes it reproduce :mod:`sim.collectives.closed_form` on a uniform
  network; transfers of different steps never slow each other down.
* :class:`FlowNetwork`: a fluid model. A transfer first waits its path latency, then its bytes
  flow; all flowing transfers share every channel max-min fairly (progressive filling), with rates
  recomputed whenever a flow starts or ends. This is what a shared NIC or an unlucky overlap of
  steps costs.

Where no channel is ever crossed by two flows at once, the two models agree.

The transport model (:class:`sim.transport.TransportNetwork`) keeps these semantics and adds a
rendezvous: a message's payload may also wait for its receiver's ready notice, and a sender may be
done before its payload arrives; there, when each rank arrived (before the last, whose arrival is
t = 0) changes the price, and :class:`CollectivePricer` passes arrivals to it.

Both price a schedule on an otherwise idle network, and :class:`CollectivePricer` caches the
result: the engine uses it where nothing else can be in flight on the schedule's channels. What
runs concurrently shares one fluid network, :class:`sim.fabric.Fabric`, built on the same
:class:`Links` (routes, capacities, gamma, cached max-min solutions) and the same dependency
semantics (:class:`_ScheduleRun`) as :class:`FlowNetwork`; :mod:`sim.engine` says when which applies.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple, Protocol

from models.errors import ConfigError
from models.ops import OpKind
from sim.collectives.registry import ALGORITHMS, AUTO, build_schedule
from sim.collectives.schedule import CommSchedule
from sim import token_bucket
from sim.token_bucket import TokenBuckets, bucket_lower_bound_s, pacing
from sim.topology import Topology


@dataclass(frozen=True)
class CollectiveTiming:
    """When a collective's ranks are done, relative to the common start.

    Attributes:
        duration_s: from the start until the last rank finishes (s).
        finish_s: for every rank of the group, the offset (s) at which it is done.
        wait_s: the part of both that the group's first rank spends waiting for the others to
            arrive beyond the simulated arrivals (a calibrated arrival skew, :mod:`sim.calibrated`;
            0 for the uncalibrated models, whose ranks arrive as simulated).
        in_place: the timing is the call's own, measured in place on the cluster it prices (a
            same-cluster replay, :class:`sim.calibrated.CalibratedNetwork`): whatever its links'
            token buckets held when it ran is in it already, so :mod:`sim.bucket_clock` delays
            it by nothing (it still drains the buckets it crosses); False for a timing priced
            on an idle network, whose buckets were full at its start.
    """

    duration_s: float
    finish_s: Mapping[int, float]
    wait_s: float = 0.0
    in_place: bool = False


class NetworkModel(Protocol):
    """Prices a point-to-point schedule; see the module docstring for the shared semantics.

    A model may set ``prices_by_call = False`` to say that :meth:`time` ignores ``call``, so the
    :class:`CollectivePricer` prices a schedule once for all the calls that use it (a model
    without the attribute is priced per call).
    """

    def time(self, schedule: CommSchedule, call: str | None = None) -> CollectiveTiming:
        """The timing of ``schedule`` started at t = 0 on an otherwise idle network. ``call``: the
        plan op's name (``attn_allreduce``), which a network priced from calls timed inside real
        runs looks its timings up by (:class:`sim.calibrated.CalibratedNetwork`); the models
        that price the schedule itself ignore it."""
        ...


class Route(NamedTuple):
    """A path through the network as :class:`Links` numbers it."""

    id: int  # small integer naming the channel tuple, for cheap rate-cache keys
    latency_s: float
    channels: tuple[int, ...]  # channel ids: indices into ``Links.capacity``


class ReductionCosts(Mapping[int, float]):
    """Gamma of every rank (s/byte): a mapping rank -> the gamma of the default dtype (the one a
    schedule naming no ``reduce_dtype`` reduces in), and :meth:`in_dtype` for the others.

    A reduction's cost per byte depends on its dtype (on a CPU, an fp16 or bf16 add costs more
    per byte than an fp32 one: :mod:`sim.reduction`), so a collective reducing bf16 data is priced
    with bf16's gamma, not fp32's.

    Args:
        default: gamma of every rank in the default dtype (s/byte).
        of_dtype: ``of_dtype(rank, dtype)``, the gamma of ``rank`` in ``dtype`` (s/byte).
    """

    def __init__(self, default: Mapping[int, float], of_dtype: Callable[[int, str], float]):
        self._default = dict(default)
        self._of_dtype = of_dtype
        self._by_dtype: dict[str, dict[int, float]] = {}

    def __getitem__(self, rank: int) -> float:
        return self._default[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._default)

    def __len__(self) -> int:
        return len(self._default)

    def in_dtype(self, dtype: str) -> dict[int, float]:
        """Gamma of every rank in ``dtype`` (s/byte), asked of ``of_dtype`` once per dtype."""
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = {rank: float(self._of_dtype(rank, dtype)) for rank in self._default}
        return self._by_dtype[dtype]


def reduction_costs(compute, devices) -> ReductionCosts:
    """The :class:`ReductionCosts` of ``devices`` (:class:`sim.topology.Device`, every rank of a
    topology) under ``compute``, a compute model whose ``reduce_s_per_byte(device, dtype=None)``
    gives a device's gamma in a dtype (None: its default)."""
    by_rank = {d.rank: d for d in devices}
    return ReductionCosts({rank: compute.reduce_s_per_byte(d) for rank, d in by_rank.items()},
                          lambda rank, dtype: compute.reduce_s_per_byte(by_rank[rank], dtype))


class Links:
    """The channels of a topology as numbered capacities, the routes over them, and per-rank gamma.

    Shared by every fluid computation of a simulation (:class:`FlowNetwork` pricing a schedule on
    an idle network, :class:`sim.fabric.Fabric` carrying every transfer of a segment), so a route
    or a max-min solution is computed once. Channel ids ``0 .. len(topology.channels) - 1`` are
    the topology's channels in order; :meth:`private_channel` appends channels no route of the
    topology crosses (a calibrated ceiling on one rank's weight loads).

    Args:
        topology: where the ranks are and what connects them.
        reduce_s_per_byte: gamma of every rank of the topology (s/byte); None: free reductions.
            A :class:`ReductionCosts` also prices schedules reducing in another dtype
            (:meth:`gamma_in`); a plain mapping prices every dtype alike.

    Raises:
        ValueError: ``reduce_s_per_byte`` misses a rank of the topology.
    """

    def __init__(self, topology: Topology, reduce_s_per_byte: Mapping[int, float] | None = None):
        self.topology = topology
        self.index = {channel.name: i for i, channel in enumerate(topology.channels)}
        self.capacity = [channel.bandwidth_bytes_per_s for channel in topology.channels]
        # Token buckets fill at the link's own rate, whatever share of it a transport's bytes get.
        self.refill = list(self.capacity)
        self.burst = [channel.burst_bytes if token_bucket.PRICED else None for channel in topology.channels]
        if reduce_s_per_byte is None:
            self.gamma = [0.0] * topology.num_ranks
        else:
            missing = [rank for rank in range(topology.num_ranks) if rank not in reduce_s_per_byte]
            if missing:
                raise ValueError(f"reduce_s_per_byte lacks ranks {missing}")
            self.gamma = [float(reduce_s_per_byte[rank]) for rank in range(topology.num_ranks)]
        self._costs = reduce_s_per_byte if isinstance(reduce_s_per_byte, ReductionCosts) else None
        self._gamma_of: dict[str, list[float]] = {}
        self.channels_of: list[tuple[int, ...]] = []  # route id -> channel ids
        self._route_ids: dict[tuple[int, ...], int] = {}
        self._pairs: dict[tuple[int, int], Route] = {}
        self._loaders: dict[tuple[int, float | None], Route] = {}
        self._caps: dict[tuple[int, float], int] = {}
        self._solved: dict[tuple[int, ...], dict[int, float]] = {}

    def gamma_in(self, dtype: str | None) -> list[float]:
        """Gamma of every rank (s/byte) for a schedule reducing in ``dtype``
        (``CommSchedule.reduce_dtype``): :attr:`gamma` where it is None or the links were built
        without :class:`ReductionCosts`."""
        if dtype is None or self._costs is None:
            return self.gamma
        if dtype not in self._gamma_of:
            costs = self._costs.in_dtype(dtype)
            self._gamma_of[dtype] = [costs[rank] for rank in range(len(self.gamma))]
        return self._gamma_of[dtype]

    def route(self, channels: tuple[int, ...], latency_s: float) -> Route:
        """The :class:`Route` over ``channels`` (ids), numbered on first use."""
        route_id = self._route_ids.get(channels)
        if route_id is None:
            route_id = self._route_ids[channels] = len(self.channels_of)
            self.channels_of.append(channels)
        return Route(route_id, latency_s, channels)

    def get(self, src: int, dst: int) -> Route:
        """The route of a transfer from rank ``src`` to rank ``dst`` (:meth:`Topology.path`)."""
        key = (src, dst)
        route = self._pairs.get(key)
        if route is None:
            path = self.topology.path(src, dst)
            route = self._pairs[key] = self.route(tuple(self.index[c.name] for c in path), self.message_latency_s(path))
        return route

    def message_latency_s(self, path) -> float:
        """What a message waits before its bytes flow over ``path`` (channels): the sum of their
        latencies (s). Transport models add their per-message terms here."""
        return sum(c.latency_s for c in path)

    def loader(self, rank: int, rate_cap: float | None = None) -> Route:
        """The route of a weight load to ``rank`` (:meth:`Topology.loader_path`), plus a channel
        private to the rank of capacity ``rate_cap`` (bytes/s) where one is given."""
        key = (rank, rate_cap)
        route = self._loaders.get(key)
        if route is None:
            path = self.topology.loader_path(rank)
            channels = tuple(self.index[c.name] for c in path)
            if rate_cap is not None:
                channels += (self.private_channel(rank, rate_cap),)
            route = self._loaders[key] = self.route(channels, sum(c.latency_s for c in path))
        return route

    def private_channel(self, owner: int, capacity_bytes_per_s: float) -> int:
        """The id of a channel of ``capacity_bytes_per_s`` that only ``owner``'s routes cross."""
        key = (owner, capacity_bytes_per_s)
        if key not in self._caps:
            self._caps[key] = len(self.capacity)
            self.capacity.append(capacity_bytes_per_s)
        return self._caps[key]

    def buckets(self, tokens_bytes: Mapping[int, float] | None = None) -> TokenBuckets:
        """The token buckets of the channels declaring a burst, for one fluid run from t = 0
        (:mod:`sim.token_bucket`): holding ``tokens_bytes`` (per channel id, bytes) there, full
        where it says nothing."""
        return TokenBuckets(self.burst, self.refill, self.capacity, tokens_bytes)

    def rates(self, mix: tuple[int, ...]) -> dict[int, float]:
        """Max-min fair rate (bytes/s) per route id of the flows ``mix`` (route ids, sorted, one
        entry per flow), by :func:`max_min_rates`; cached, since pipelines repeat the same mixes."""
        rates = self._solved.get(mix)
        if rates is None:
            rates = self._solved[mix] = max_min_rates(Counter(mix), self.channels_of, self.capacity)
        return rates


class _ScheduleRun:
    """The dependency state of one run of a schedule (module docstring), whatever carries the bytes.

    Subclasses say how a transfer travels (:meth:`_start`, called once both endpoints reached its
    step, at ``now``) and how a reduction's end is awaited (:meth:`_reduce_until`); they call
    :meth:`_arrived` when a transfer's bytes are in and :meth:`_complete` (of the receiver) when a
    reduction ends, with ``now`` set. ``finish[rank]`` is relative to the run's start.
    """

    def __init__(self, schedule: CommSchedule, links: Links):
        self.links = links
        self.gamma = links.gamma_in(schedule.reduce_dtype)
        self.transfers = [t for step in schedule.steps for t in step]
        self.route = [links.get(t.src, t.dst) for t in self.transfers]
        # Each rank's work: the transfer ids of each step it takes part in, in step order; and
        # where each transfer sits in its sender's and its receiver's work.
        by_step: dict[int, dict[int, list[int]]] = {rank: {} for rank in schedule.group}
        self.at_src, self.at_dst = [], []
        i = 0
        for k, step in enumerate(schedule.steps):
            for t in step:
                for rank, at in ((t.src, self.at_src), (t.dst, self.at_dst)):
                    steps = by_step[rank]
                    if k not in steps:
                        steps[k] = []
                    steps[k].append(i)
                    at.append(len(steps) - 1)
                i += 1
        self.work = {rank: list(steps.values()) for rank, steps in by_step.items()}
        # need[rank][j]: how many of the rank's first steps must be complete before it enters its
        # j-th, by the schedule's in_flight (j itself where a step waits for all earlier ones).
        self.need = {rank: _needs(list(steps), schedule) for rank, steps in by_step.items()}
        self.pending = {rank: [len(transfers) for transfers in work] for rank, work in self.work.items()}
        self.entered = dict.fromkeys(schedule.group, 0)  # how many of its steps each rank entered
        self.completed = dict.fromkeys(schedule.group, 0)  # how many of its first steps are complete
        self.endpoints_ready = [0] * len(self.transfers)
        self.finish = dict.fromkeys(schedule.group, 0.0)
        self.reducer_free = dict.fromkeys(schedule.group, 0.0)
        self.now = 0.0
        # Where ranks keep steps in flight, a pair's messages move their bytes one at a time:
        # (src, dst) -> the transfers waiting behind the one whose bytes are flowing.
        self.in_order = schedule.overlapping
        self.connections: dict[tuple[int, int], deque[int]] = {}

    def _begin(self) -> None:
        for rank, work in self.work.items():
            if work:
                self._advance(rank)
            else:
                self._done(rank)

    def _start(self, transfer: int) -> None:
        raise NotImplementedError

    def _reduce_until(self, time_s: float, transfer: int) -> None:
        raise NotImplementedError

    def _flow(self, transfer: int) -> None:
        """Let the bytes of ``transfer`` (not empty) flow from ``now``."""
        raise NotImplementedError

    def _done(self, rank: int) -> None:
        """Called once ``rank`` has finished all its work (at ``now``); nothing by default."""

    def _latency_over(self, transfer: int) -> None:
        """The bytes of ``transfer`` (not empty) may flow: now, or once those its pair sent
        before have, where ranks keep steps in flight (module docstring)."""
        if self.in_order:
            t = self.transfers[transfer]
            waiting = self.connections.get((t.src, t.dst))
            if waiting is not None:
                waiting.append(transfer)
                return
            self.connections[(t.src, t.dst)] = deque()
        self._flow(transfer)

    def _flowed(self, transfer: int) -> None:
        """The bytes of ``transfer`` (not empty) are through: its pair's next message may flow."""
        if self.in_order:
            t = self.transfers[transfer]
            waiting = self.connections[(t.src, t.dst)]
            if waiting:
                self._flow(waiting.popleft())
            else:
                del self.connections[(t.src, t.dst)]

    def _advance(self, rank: int) -> None:
        """Enter every step of ``rank`` that its completed steps now allow, in order."""
        need, count = self.need[rank], len(self.work[rank])
        while self.entered[rank] < count and need[self.entered[rank]] <= self.completed[rank]:
            self.entered[rank] += 1
            self._enter(rank, self.entered[rank] - 1)

    def _enter(self, rank: int, position: int) -> None:
        for transfer in self.work[rank][position]:
            self.endpoints_ready[transfer] += 1
            if self.endpoints_ready[transfer] == 2:
                self._start(transfer)

    def _complete(self, rank: int, transfer: int) -> None:
        """One of ``rank``'s parts in ``transfer`` (sending or receiving) is complete, at ``now``."""
        pending = self.pending[rank]
        pending[self.at_src[transfer] if self.transfers[transfer].src == rank else self.at_dst[transfer]] -= 1
        completed = self.completed[rank]
        if pending[completed]:
            return
        while completed < len(pending) and not pending[completed]:
            completed += 1
        self.completed[rank] = completed
        self.finish[rank] = self.now
        if completed < len(pending):
            self._advance(rank)
        else:
            self._done(rank)

    def _arrived(self, transfer: int) -> None:
        self._complete(self.transfers[transfer].src, transfer)
        self._delivered(transfer)

    def _delivered(self, transfer: int) -> None:
        """The receiver's side of :meth:`_arrived`: complete it, or start its reduction."""
        t = self.transfers[transfer]
        if t.reduce:
            self.reducer_free[t.dst] = max(self.now, self.reducer_free[t.dst]) + self.gamma[t.dst] * t.size_bytes
            self._reduce_until(self.reducer_free[t.dst], transfer)
        else:
            self._complete(t.dst, transfer)


def _needs(steps: list[int], schedule: CommSchedule) -> list[int]:
    """For a rank taking part in ``steps`` (schedule step indices, ascending) of ``schedule``: how
    many of its first steps must be complete before it enters each (``CommSchedule.in_flight``)."""
    if not schedule.overlapping:
        return list(range(len(steps)))
    return [bisect.bisect_right(steps, k - schedule.window(k)) for k in steps]


class AlphaBetaNetwork:
    """Alpha-beta pricing with bandwidth shared only among the transfers of one step.

    A transfer costs ``latency(path) + size_bytes x max over its channels of (c / bandwidth)``, c
    the number of non-empty transfers of its step crossing that channel (1 where none other
    does). Exact against the closed forms on a uniform network; see the module docstring.

    Args:
        topology: where the ranks are and what connects them.
        reduce_s_per_byte: gamma of every rank of the topology (s/byte); None: free reductions.
        links: share this :class:`Links` (its routes and cached solutions) instead of building
            one from the first two arguments.

    Raises:
        ValueError: ``reduce_s_per_byte`` misses a rank of the topology.
    """

    prices_by_call = False

    def __init__(self, topology: Topology, reduce_s_per_byte: Mapping[int, float] | None = None, *,
                 links: Links | None = None):
        self.links = links if links is not None else Links(topology, reduce_s_per_byte)

    def time(self, schedule: CommSchedule, call: str | None = None) -> CollectiveTiming:
        """The timing of ``schedule``; O(number of transfers x path length). ``call`` is ignored."""
        capacity, gamma = self.links.capacity, self.links.gamma_in(schedule.reduce_dtype)
        clock = _StepClock(schedule)
        for k, step in enumerate(schedule.steps):
            ready = clock.enter(k, step)
            routes = [self.links.get(t.src, t.dst) for t in step]
            load = Counter(c for t, route in zip(step, routes) if t.size_bytes for c in route.channels)
            done: dict[int, float] = {}
            arrivals = []
            for index, (t, route) in enumerate(zip(step, routes)):
                end = max(ready[t.src], ready[t.dst]) + route.latency_s
                if t.size_bytes:
                    end += t.size_bytes * max(load[c] / capacity[c] for c in route.channels)
                done[t.src] = max(done.get(t.src, 0.0), end)
                if t.reduce:
                    arrivals.append((end, index, t.dst, t.size_bytes))
                else:
                    done[t.dst] = max(done.get(t.dst, 0.0), end)
            reducer_free: dict[int, float] = {}
            for end, _, dst, size in sorted(arrivals):
                finish = max(end, reducer_free.get(dst, end)) + gamma[dst] * size
                reducer_free[dst] = finish
                done[dst] = max(done.get(dst, 0.0), finish)
            clock.leave(k, done)
        return _timing(clock.finish())


class FlowNetwork:
    """Fluid network: latency first, then bytes at max-min fair shares of every channel.

    Events happen only when a flow's latency ends, a flow ends or a reduction ends; flow rates are
    recomputed by progressive filling once per batch of simultaneous events. See the module
    docstring for the dependency semantics.

    Args:
        topology: where the ranks are and what connects them.
        reduce_s_per_byte: gamma of every rank of the topology (s/byte); None: free reductions.
        links: share this :class:`Links` (its routes and cached solutions) instead of building
            one from the first two arguments.

    Raises:
        ValueError: ``reduce_s_per_byte`` misses a rank of the topology.
    """

    prices_by_call = False

    def __init__(self, topology: Topology, reduce_s_per_byte: Mapping[int, float] | None = None, *,
                 links: Links | None = None):
        self.links = links if links is not None else Links(topology, reduce_s_per_byte)

    def time(self, schedule: CommSchedule, call: str | None = None) -> CollectiveTiming:
        """The timing of ``schedule``. ``call`` is ignored."""
        return _FlowRun(schedule, self.links).run()

    def time_from(self, schedule: CommSchedule, tokens_bytes: Mapping[int, float]
                  ) -> tuple[CollectiveTiming, dict[int, float]]:
        """The timing of ``schedule`` on links whose buckets hold ``tokens_bytes`` (per channel
        id, bytes; full where it says nothing) at its start, and the tokens (bytes) every
        bucketed channel holds when its last rank is done (:mod:`sim.token_bucket`)."""
        run = _FlowRun(schedule, self.links, tokens_bytes)
        timing = run.run()
        return timing, {c: run.buckets.filled(c, timing.duration_s) for c in run.buckets.depth}

    def lower_bound_s(self, schedule: CommSchedule) -> float:
        """A duration :meth:`time` cannot beat (s): :func:`fluid_lower_bound_s`. The pricer skips
        the schedules of ``auto`` whose bound exceeds the best time found."""
        return fluid_lower_bound_s(schedule, self.links)


def fluid_lower_bound_s(schedule: CommSchedule, links: Links) -> float:
    """A duration the fluid model cannot beat for ``schedule`` over ``links`` (s), in
    O(transfers x path length): the larger of the schedule's critical path of route latencies
    alone and the busiest channel's bytes over its capacity (max-min rates never exceed a
    channel's capacity), less what the token buckets pacing its flows can let through
    (:func:`sim.token_bucket.bucket_lower_bound_s`; a flow's burst crosses every channel of its
    route, paced by its narrowest ones' buckets alone: :func:`sim.token_bucket.pacing`)."""
    clock = _StepClock(schedule)
    carried: dict[int, int] = {}
    buckets: dict[int, set[int]] = {}  # channel -> the bucketed channels pacing the flows over it
    depth = {c: d for c, d in enumerate(links.burst) if d}
    for k, step in enumerate(schedule.steps):
        ready = clock.enter(k, step)
        done: dict[int, float] = {}
        for t in step:
            route = links.get(t.src, t.dst)
            end = max(ready[t.src], ready[t.dst]) + route.latency_s
            paced = pacing(route.channels, links.capacity, depth) if depth else ()
            for channel in route.channels:
                carried[channel] = carried.get(channel, 0) + t.size_bytes
                buckets.setdefault(channel, set()).update(paced)
            done[t.src] = max(done.get(t.src, 0.0), end)
            done[t.dst] = max(done.get(t.dst, 0.0), end)
        clock.leave(k, done)
    refill = links.refill
    busiest = max((bucket_lower_bound_s(size, sum(depth[b] for b in buckets[channel]), links.capacity[channel],
                                        sum(refill[b] for b in buckets[channel]))
                   for channel, size in carried.items()), default=0.0)
    return max(max(clock.finish().values(), default=0.0), busiest)


class _StepClock:
    """When each rank enters each step of a schedule priced one step after the other (the
    dependency semantics of the module docstring, ``CommSchedule.in_flight`` included): a rank
    enters step k once it entered its previous step and its steps ``<= k - in_flight[k]`` are done."""

    def __init__(self, schedule: CommSchedule):
        self.schedule = schedule
        self.entered = dict.fromkeys(schedule.group, 0.0)  # when each rank entered its latest step
        # per rank: (step, latest end of its steps up to that one), in step order
        self.done: dict[int, list[tuple[int, float]]] = {rank: [] for rank in schedule.group}
        self.ready: dict[int, float] = {}

    def enter(self, k: int, step) -> dict[int, float]:
        """When each rank of step ``k`` (its transfers ``step``) enters it (s); other ranks unset."""
        last_allowed = k - self.schedule.window(k)
        ready = self.ready = {}
        for t in step:
            for rank in (t.src, t.dst):
                if rank not in ready:
                    history = self.done[rank]
                    index = len(history) - 1
                    while index >= 0 and history[index][0] > last_allowed:
                        index -= 1
                    ready[rank] = max(self.entered[rank], history[index][1]) if index >= 0 else self.entered[rank]
        return ready

    def leave(self, k: int, done: Mapping[int, float]) -> None:
        """Record the end (s) of each rank's part in step ``k``."""
        for rank, end in done.items():
            history = self.done[rank]
            self.entered[rank] = self.ready[rank]
            history.append((k, max(end, history[-1][1]) if history else end))

    def finish(self) -> dict[int, float]:
        """When each rank is done (s; 0 for a rank in no step)."""
        return {rank: history[-1][1] if history else 0.0 for rank, history in self.done.items()}


class _FlowRun(_ScheduleRun):
    """One pricing of a schedule by :class:`FlowNetwork`: its own event loop on an idle network.

    A transfer starts once both endpoints have reached its step; a "latency over" event then
    turns it into a flow. A flow's projected end only changes when the rate of its route does
    (flows on one route share one rate), so a rate update touches only the routes it changes;
    projected ends sit in a heap whose stale entries are skipped.
    """

    _LATENCY_OVER, _REDUCED, _DELIVERED, _WRITTEN = 0, 1, 2, 3

    def __init__(self, schedule: CommSchedule, links: Links, tokens_bytes: Mapping[int, float] | None = None):
        super().__init__(schedule, links)
        self.events: list[tuple[float, int, int, int]] = []  # (time, sequence, kind, transfer id)
        self.sequence = 0
        self.end: dict[int, float] = {}  # projected end of each flowing transfer at its rate
        self.ends: list[tuple[float, int]] = []  # heap of (projected end, transfer id), some stale
        self.mix: list[int] = []  # route id of every flowing transfer, sorted
        self.on_route: dict[int, set[int]] = {}  # route id -> its flowing transfers (never empty)
        self.route_rate: dict[int, float] = {}  # route id -> rate of each of its flows, bytes/s
        self.starting: list[int] = []  # transfers whose bytes start flowing now
        self.buckets = links.buckets(tokens_bytes)

    def run(self) -> CollectiveTiming:
        self._begin()
        events, ends, end = self.events, self.ends, self.end
        while events or end:
            while ends and end.get(ends[0][1]) != ends[0][0]:
                heapq.heappop(ends)
            self.now = min(events[0][0] if events else math.inf, ends[0][0] if ends else math.inf)
            # Events this close to now are simultaneous up to rounding: one rate update serves all.
            horizon = self.now * (1 + 1e-12) + 1e-15
            ended = []
            while ends and ends[0][0] <= horizon:
                finish, f = heapq.heappop(ends)
                if end.get(f) == finish:
                    del end[f]
                    ended.append(f)
            ended.sort()
            for f in ended:
                if self.buckets:
                    self.buckets.end(self.route[f].channels, self.now)
                route_id = self.route[f].id
                del self.mix[bisect.bisect_left(self.mix, route_id)]
                flows = self.on_route[route_id]
                flows.discard(f)
                if not flows:
                    del self.on_route[route_id]
            for f in ended:
                self._flowed(f)
                self._arrived(f)
            while events and events[0][0] <= horizon:
                at, _, kind, f = heapq.heappop(events)
                if kind == self._REDUCED:
                    self._complete(self.transfers[f].dst, f)
                elif kind == self._DELIVERED:  # a subclass's payload, in flight after its sender was done
                    self._delivered(f)
                elif kind == self._WRITTEN:  # a subclass's sender, done before its bytes are through
                    self._written(f, at)
                elif self.transfers[f].size_bytes:
                    self._latency_over(f)
                else:
                    self._arrived(f)
            if ended or self.starting:
                self._reshare()
        return _timing(self.finish)

    def _reshare(self) -> None:
        now, end, ends, route, on_route, route_rate = self.now, self.end, self.ends, self.route, self.on_route, \
            self.route_rate
        for f in self.starting:
            bisect.insort(self.mix, route[f].id)
        by_route = self.links.rates(tuple(self.mix))
        for route_id, flows in on_route.items():
            new, old = by_route[route_id], route_rate[route_id]
            if new != old:
                for f in flows:
                    end[f] = finish = now + (end[f] - now) * old / new
                    heapq.heappush(ends, (finish, f))
        self.route_rate = by_route
        for f in self.starting:
            route_id = route[f].id
            on_route.setdefault(route_id, set()).add(f)
            size = self.transfers[f].size_bytes
            if self.buckets:  # what the links' buckets let through at once
                size -= self.buckets.start(route[f].channels, size, now)
            end[f] = finish = now + size / by_route[route_id]
            heapq.heappush(ends, (finish, f))
        self.starting = []

    def _flow(self, transfer: int) -> None:
        self.starting.append(transfer)

    def _written(self, transfer: int, at: float) -> None:
        """A subclass's event, scheduled for ``at``: the sender of ``transfer`` is done before its
        bytes are through."""
        raise NotImplementedError

    def _push(self, time: float, kind: int, transfer: int) -> None:
        heapq.heappush(self.events, (time, self.sequence, kind, transfer))
        self.sequence += 1

    def _start(self, transfer: int) -> None:
        self._push(self.now + self.route[transfer].latency_s, self._LATENCY_OVER, transfer)

    def _reduce_until(self, time_s: float, transfer: int) -> None:
        self._push(time_s, self._REDUCED, transfer)


def max_min_rates(flows_per_route: Mapping[int, int], routes: Sequence[Sequence[int]],
                  capacity: Sequence[float]) -> dict[int, float]:
    """Max-min fair rate (bytes/s) of a flow on each route, by progressive filling (Bertsekas and Gallager).

    ``flows_per_route`` counts the flows on each route id; flows on one route get one rate.
    ``routes[route]`` lists the channel ids it crosses; ``capacity[channel]`` is in bytes/s.
    Repeatedly the channel with the smallest fair share (remaining capacity / unfrozen flows)
    fixes the rate of every unfrozen flow crossing it at that share.
    """
    users: dict[int, list[int]] = {}
    unfrozen: dict[int, int] = {}
    for route, count in flows_per_route.items():
        for c in routes[route]:
            users.setdefault(c, []).append(route)
            unfrozen[c] = unfrozen.get(c, 0) + count
    left = {c: capacity[c] for c in users}
    rates: dict[int, float] = {}
    while unfrozen:
        share = min(left[c] / unfrozen[c] for c in unfrozen)
        level = share * (1 + 1e-9)
        for c in [c for c in unfrozen if left[c] / unfrozen[c] <= level]:
            for route in users[c]:
                if route not in rates:
                    rates[route] = share
                    count = flows_per_route[route]
                    for other in routes[route]:
                        left[other] -= share * count
                        unfrozen[other] -= count
        unfrozen = {c: n for c, n in unfrozen.items() if n > 0}
    return rates


def _timing(finish: dict[int, float]) -> CollectiveTiming:
    return CollectiveTiming(max(finish.values(), default=0.0), MappingProxyType(finish))


NETWORK_MODELS: dict[str, type] = {"alpha_beta": AlphaBetaNetwork, "flow": FlowNetwork}
"""Network models by the name a scenario writes (``network_model``); each is built as
``NETWORK_MODELS[name](topology, reduce_s_per_byte)``. An unknown name is the caller's
``ConfigError("network_model", ...)`` (see :func:`sim.simulate.simulate`)."""


def channel_bytes(schedule: CommSchedule, topology: Topology) -> dict[str, int]:
    """Bytes crossing each channel of ``topology`` over the whole schedule, by channel name."""
    total = dict.fromkeys((channel.name for channel in topology.channels), 0)
    for t in schedule.transfers():
        for channel in topology.path(t.src, t.dst):
            total[channel.name] += t.size_bytes
    return total


ARRIVAL_RESOLUTION_S = 1e-5  # arrivals are priced to this resolution, so that repeated patterns share a timing


class CollectivePricer:
    """Prices collective calls on one network, caching by (kind, algorithm, group, size, root,
    reduction dtype).

    Two-level algorithms get their host groups from ``topology.host_groups(group)``. Algorithm
    ``"auto"`` prices every registered algorithm of the kind that applies to the group and
    picks the fastest, ties broken by name, so the choice is deterministic.

    A network whose price depends on when the ranks arrived says how far back an arrival still
    matters (``arrival_horizon_s(group)``, s; :class:`sim.transport.TransportNetwork`: a
    receiver that arrived early has sent its ready notice); :meth:`price` then keys its timing
    by the ranks' arrivals too, clamped to that horizon and rounded to
    :data:`ARRIVAL_RESOLUTION_S`. Other networks never see arrivals.
    """

    def __init__(self, network: NetworkModel, topology: Topology):
        self.network = network
        self.topology = topology
        self._timings: dict[tuple, CollectiveTiming] = {}
        self._choices: dict[tuple, str] = {}
        self._schedules: dict[tuple, CommSchedule] = {}
        self._by_call = getattr(network, "prices_by_call", True)

    def price(
        self, kind: OpKind, algorithm: str, group: tuple[int, ...], size_bytes: int, root: int | None = None,
        call: str | None = None, arrivals: Mapping[int, float] | None = None, dtype: str | None = None,
    ) -> tuple[str, CollectiveTiming]:
        """(resolved algorithm name, timing) of collective ``kind`` of ``size_bytes`` per rank,
        reducing in ``dtype`` (``CommSchedule.reduce_dtype``; None: the network's default);
        ``call``: the plan op's name, passed to the network model (:meth:`NetworkModel.time`);
        ``arrivals``: when each rank of the group arrived, relative to the last (s, <= 0; None:
        all at once; a rank missing: with the last), for a network that prices them (see the
        class docstring). ``auto``
        chooses among the algorithms with the ranks arriving at once.

        Raises:
            ConfigError: from :func:`sim.collectives.registry.build_schedule` (unknown kind or
                algorithm, bad group or root, host layout unfit for a two-level algorithm); for
                ``"auto"``, only when no algorithm applies.
        """
        group = tuple(group)
        if not self._by_call:
            call = None  # the same schedule costs the same wherever it is called: price it once
        if algorithm == AUTO:
            key = (kind, group, size_bytes, root, call, dtype)
            if key not in self._choices:
                self._choices[key] = self._fastest(kind, group, size_bytes, root, call, dtype)
            algorithm = self._choices[key]
        return algorithm, self._time(kind, algorithm, group, size_bytes, root, call, self._arrived(group, arrivals),
                                     dtype)

    def _arrived(self, group: tuple[int, ...], arrivals: Mapping[int, float] | None) -> tuple[float, ...] | None:
        """The arrivals as the network prices them (clamped, rounded, in group order), None where
        they change nothing."""
        horizon = getattr(self.network, "arrival_horizon_s", None)
        if arrivals is None or horizon is None:
            return None
        back = horizon(group)
        if back <= 0:
            return None
        # A rank the segment does not simulate (a replica standing in for itself) comes with the last.
        offsets = tuple(round(max(-back, min(0.0, arrivals.get(rank, 0.0))) / ARRIVAL_RESOLUTION_S)
                        * ARRIVAL_RESOLUTION_S for rank in group)
        return offsets if any(offsets) else None

    def _time(self, kind: OpKind, algorithm: str, group: tuple[int, ...], size_bytes: int, root: int | None,
              call: str | None, arrivals: tuple[float, ...] | None = None,
              dtype: str | None = None) -> CollectiveTiming:
        key = (kind, algorithm, group, size_bytes, root, call, arrivals, dtype)
        if key not in self._timings:
            schedule = self.schedule(kind, algorithm, group, size_bytes, root, dtype)
            self._timings[key] = self.network.time(schedule, call) if arrivals is None else \
                self.network.time(schedule, call, arrivals=dict(zip(group, arrivals)))
        return self._timings[key]

    def schedule(self, kind: OpKind, algorithm: str, group: tuple[int, ...], size_bytes: int,
                 root: int | None = None, dtype: str | None = None) -> CommSchedule:
        """The point-to-point schedule of ``algorithm`` (a registered name, not ``auto``), reducing
        in ``dtype`` (``CommSchedule.reduce_dtype``), cached.

        Raises:
            ConfigError: as :func:`sim.collectives.registry.build_schedule`.
        """
        key = (kind, algorithm, group, size_bytes, root, dtype)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = build_schedule(kind, algorithm, group, size_bytes, root=root,
                                      host_groups=self.topology.host_groups(group))
            if dtype is not None:
                schedule = replace(schedule, reduce_dtype=dtype)
            self._schedules[key] = schedule
        return schedule

    def _fastest(self, kind: OpKind, group: tuple[int, ...], size_bytes: int, root: int | None,
                 call: str | None, dtype: str | None = None) -> str:
        if kind not in ALGORITHMS:
            raise ConfigError("kind", f"not a collective; known: {', '.join(ALGORITHMS)} (got {str(kind)!r})")
        candidates, errors = [], []
        for name in sorted(ALGORITHMS[kind]):
            try:
                candidates.append((name, self.schedule(kind, name, group, size_bytes, root, dtype)))
            except ConfigError as error:  # e.g. two_level_rs on hosts holding different numbers of ranks
                errors.append(error)
        if not candidates:
            raise errors[0]
        bound = getattr(self.network, "lower_bound_s", None)

        def lower_bound(name: str, schedule: CommSchedule) -> float:
            priced = self._timings.get((kind, name, group, size_bytes, root, call, None, dtype))
            return priced.duration_s if priced is not None else bound(schedule)  # a time is its own bound

        ordered = sorted((lower_bound(name, schedule), name) for name, schedule in candidates) if bound else \
            [(0.0, name) for name, _ in candidates]
        priced, best = [], math.inf
        for lower_bound, name in ordered:
            # A schedule that cannot beat the best so far is not priced: the choice is the same.
            if lower_bound > best * (1 + 1e-9):
                break
            priced.append((self._time(kind, name, group, size_bytes, root, call, dtype=dtype).duration_s, name))
            best = min(best, priced[-1][0])
        return min(priced)[1]
