"""The discrete-event engine: executes one segment of a plan in simulated time (simpy).

Semantics (what the tests pin down):

* One simpy process per rank and stream, created in rank order then stream order, so a run is
  deterministic. Ops of one stream run one at a time in program order; an op also waits for the
  ops named in ``Op.after`` (default: the previous op of its rank's program).
* A compute op holds its stream for the compute model's duration.
* A collective is a rendezvous: it starts when the last rank of its group arrives, and each rank is
  released at ``start + finish_s[rank]`` of the network model's timing of the collective's
  point-to-point schedule (so a broadcast's root leaves before its leaves do). A timing's
  ``wait_s`` (calibrated arrival skew) is the group's first rank waiting for the others: the
  trace shows the others arriving ``wait_s`` after the simulated last arrival. Timings are priced
  once per (kind, algorithm, group, size, root) and cached by the :class:`CollectivePricer`.
* Every transfer in flight shares one network, the segment's :class:`sim.fabric.Fabric`: weight
  loads (``Op.load``, over the rank's loader path) always run on it, max-min fair among
  themselves and with whatever else crosses their channels.
* What contends with what, and when a collective keeps its closed form: before a segment runs,
  the engine asks, per group, whether the group's collectives *could* meet other traffic on a
  channel: a channel their schedules cross is on the loader path of a rank that loads weights in
  the segment, or is crossed by a collective of another group, or the group is called from two
  streams of a rank (so possibly twice at the same time). If not (the common tensor-parallel
  segment: one group, every rank waiting on each collective in program order, no loader on its
  channels; a training step's tensor-parallel groups inside hosts whose devices each have their
  own NIC for the data-parallel traffic), the group's collectives take their priced timing
  (closed form, cached, or calibrated) unchanged, and nothing but the rendezvous is simulated:
  exact, since nothing else crosses their channels. If so, every collective of the group runs its
  schedule on the fabric, and each rank is released at its fluid finish plus the difference
  between the priced timing and the fluid model's timing on an idle network, never before its
  fluid finish (:meth:`sim.fabric.Fabric.collective`): a collective that meets nothing still takes its priced
  (e.g. calibrated) time, and contention adds what the fluid model says it costs. A calibrated
  timing is a measured duration; contention is the uncalibrated fluid model's delay added to it.
  ``auto`` picks its algorithm on the idle network either way.
* Groups that share a channel but never use it at once keep their priced timing too (a
  data-parallel ring whose hop inside a host crosses the ports of two tensor-parallel groups,
  reducing after the backward), where the segment loads nothing, its ranks have cores of their
  own and its links no token buckets: the segment is first run with every collective at its
  priced timing, and that run is kept where no two calls of the groups that could meet carry
  bytes on a common channel at the same time (a call from its start until its last rank's
  finish on an idle network: every transfer is in before its receiver is done) and no rank's
  priced finish is before its idle fluid finish (the fabric would release it then, not
  earlier). Then the fabric's run is that run. Both start alike, and compute and rendezvous go
  alike in both; were they to part, the first event to differ would be a rank's release from a
  call that, in the fabric's run, shared a channel with another call's bytes. Both calls
  started before that release, so at the same times in both runs, and they would overlap in
  the priced run too, which the check rules out. The same times, that is, to the rounding of
  the fabric's event arithmetic (its runs differ from the closed form in the last bits: 4e-15
  of the Megatron-LM 7.5B step, ``validation/published``). Otherwise the groups that could
  meet run on the fabric as above.
* Core contention (:mod:`sim.cores`): where a :class:`sim.cores.CorePool` puts more of the
  segment's ranks on a machine than it has free cores, the ranks' compute ops run through the
  pool's server (:func:`sim.cores.core_server`: processor sharing, or in turns): a compute op's
  duration is its work at one whole core, and it stretches while more ranks compute at once than
  there are cores (shared), or waits for a core (in turns). A rank waiting in a
  collective does not compute and leaves its core to the others. A comm thread's op
  (``comm_thread``: a training bucket's messages, :mod:`sim.training.comm_thread`) only waits for
  a core: nothing where one is free as it starts, else its work shares the cores like compute.
  A rank's lag (``step_lag``: asleep until the step before releases it, :mod:`sim.training.lag`)
  holds no core: it only passes its time. Pools with enough cores change nothing, but for a pool that knows its machine's memory
  bandwidth (measured by the calibration): there two or more of the segment's ranks on it also
  share that, and an op timed alone (:meth:`sim.cost.ComputeModel.timed_alone`) stretches its
  memory part, its traffic at the lone process's bandwidth, to its share (processor sharing only).
  Where a pool has an arrival lag coefficient (:attr:`sim.cores.CorePool.lag_per_block`) and
  :data:`sim.cores.ARRIVAL_LAGS_PRICED` is on (the default), a
  prefill's collective whose ranks share its cores, priced in closed form, starts later than the
  simulated last arrival by the expected lead of the last rank's lag over the first rank's
  (:mod:`sim.arrival_skew`; each rank's lag ranges over the coefficient times its off-core share
  times its block since its previous collective): the first rank waits that long (``wait_s``).
* A segment starts with every rank idle at time 0 and lasts until its last op ends. Idle since
  before: a rank whose first op is a collective that another rank reaches later has been waiting
  in it (a network that prices arrivals, :class:`sim.network.CollectivePricer`, sees it arrive
  long before the last).
* A segment whose every op waits for the previous op of its rank and whose collectives keep their
  priced timings (no loads, no contention) is computed without simpy, by simpy's arithmetic
  (an event at ``now + delay``): the same times, bit for bit, at a fraction of the cost.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import simpy

from models.ops import OpKind
from sim import cores
from sim.arrival_skew import expected_lead_s, lagging_block_s, off_core_share, waited
from sim.bucket_clock import BucketClock, delayed
from sim.channel_spans import ChannelSpans
from sim.collectives.schedule import CommSchedule, Transfer
from sim.cores import CorePool, core_server
from sim.cost import ComputeModel
from sim.fabric import Fabric
from sim.network import CollectivePricer, CollectiveTiming, FlowNetwork, Links, reduction_costs
from sim.plan import Collective, Op, Segment, Stream
from sim.topology import Topology

P2P = "p2p"
"""The algorithm name of a point-to-point message's one-transfer schedule (:meth:`Engine.send`)."""


@dataclass(frozen=True)
class SegmentResult:
    """Op times of one segment instance, relative to its start (s).

    ``starts[r][i]`` / ``ends[r][i]``: start and end of op ``i`` of rank ``r``'s program;
    ``algorithms[call]``: (kind, algorithm) a collective call resolved to (``auto`` becomes a name).
    """

    starts: dict[int, np.ndarray]
    ends: dict[int, np.ndarray]
    duration_s: float
    algorithms: dict[int, tuple[str, str]]
    ledgers: dict = field(default_factory=dict, compare=False, repr=False)  # rank -> memory ledger (sim.memory)


class Engine:
    """Executes segments over a topology with a compute model and a collective pricer."""

    def __init__(self, topology: Topology, compute: ComputeModel, pricer: CollectivePricer,
                 load_rate_cap: Callable[[int], float | None] = lambda rank: None,
                 cores: tuple[CorePool, ...] = ()):
        """``load_rate_cap(rank)``: a calibrated ceiling on a weight load's rate (bytes/s), or None;
        ``cores``: the machines whose cores ranks share (:mod:`sim.cores`; none: a core each)."""
        self.topology = topology
        self.cores = cores
        self.compute = compute
        self.pricer = pricer
        self.load_rate_cap = load_rate_cap
        self.links = Links(topology, reduction_costs(compute, topology.devices))
        self._idle_fluid = FlowNetwork(topology, links=self.links)
        self._extra_s: dict[tuple, dict[int, float]] = {}
        self._drained: dict[tuple, tuple[dict[int, float], dict[int, float]]] = {}  # BucketClock's cache
        # Without a priced bucket a clock holds no state: one serves every segment (the hot path).
        self._unbucketed = None if any(self.links.burst) else BucketClock(self.links, self._idle_fluid, self._drained)
        self._footprints: dict[tuple, frozenset[int]] = {}
        self._idle: dict[tuple, CollectiveTiming] = {}  # schedule key -> its fluid timing on an idle network

    def run_segment(self, segment: Segment, images: tuple[dict[int, int], ...] = ()) -> SegmentResult | None:
        """Simulate one instance of ``segment``; see the module docstring for the semantics.

        ``images``: where ``segment`` holds one replica of several that run identically (the
        others' programs are its own on other ranks, :mod:`sim.training.symmetry`), one rank map
        per other replica (its rank at each of the segment's ranks). Their collectives inside a
        replica are counted as running at the same times as the segment's own, on their own
        channels, where the engine decides what meets what. Returns None where that decision
        needs the replicas simulated whole: their collectives would meet on a channel, or the
        segment loads weights."""
        starts = {r: np.zeros(len(p)) for r, p in segment.programs.items()}
        ends = {r: np.zeros(len(p)) for r, p in segment.programs.items()}
        algorithms: dict[int, tuple[str, str]] = {}
        shared = self._fabric_groups(segment, images)
        pools = tuple(pool for pool in self.cores if pool.contended(segment.programs))
        ops = [op for program in segment.programs.values() for op in program]
        loads = any(op.load is not None for op in ops)
        if images and loads:
            return None
        clock = self._bucket_clock()
        for _ in range(2):
            # Where ranks share cores, one replica's contention is decided on its share of them
            # (sim.cores.core_shares): not the whole run's, so not checked for it.
            if shared and not (pools or loads or clock or (images and self.cores)) and \
                    self._run_apart(segment, shared, images, starts, ends, algorithms):
                pass  # every collective kept its priced timing, the fabric's answer (module docstring)
            elif shared and images:
                return None
            elif shared or pools or loads:
                self._run_events(segment, shared, starts, ends, algorithms, clock, pools)
            elif all(op.after is None for op in ops):
                self._run_in_order(segment, starts, ends, algorithms, clock)
            else:
                self._run_dag(segment, starts, ends, algorithms, clock)
            duration = max((float(e.max()) for e in ends.values() if len(e)), default=0.0)
            left = clock.left_at(duration)
            if segment.repeat == 1 or left == clock.full():
                break
            # A repeated segment's instances run back to back: the one simulated is priced with
            # the buckets the one before it leaves (its own end state), not full ones.
            clock = self._bucket_clock(left)
        return SegmentResult(starts, ends, duration, algorithms)

    def _run_apart(self, segment: Segment, shared: frozenset[tuple[int, ...]], images, starts, ends,
                   algorithms) -> bool:
        """Run ``segment`` with every collective at its priced timing, and say whether that is the
        fabric's answer: whether no two calls of the ``shared`` groups (those of ``images`` too:
        a call inside the maps' ranks has an image in each, at the same start with the same
        timing per position) carry bytes on a common channel at once (:mod:`sim.channel_spans`),
        and none is released before the fabric would release it. A call carries bytes from its
        start until its last rank's finish on an idle network (each transfer is in before its
        receiver is done); the fabric releases a rank no earlier than that rank's idle finish, so
        a priced finish before it is not the fabric's. Stops at the first call that fails
        (``starts`` and ``ends`` then partial; the caller runs the segment on the fabric)."""
        spans = ChannelSpans()

        def apart(start: float, op: Op, timing: CollectiveTiming) -> bool:
            algorithm = algorithms[op.call][1]
            copies = [(op.collective, timing.finish_s)]
            copies += [(c, {ranks[r]: s for r, s in timing.finish_s.items()}) for c, ranks in _images(op.collective,
                                                                                                        images)]
            for c, finish_s in copies:
                if c.group not in shared:
                    continue
                key = (c.kind, algorithm, c.group, c.size_bytes, c.root, c.dtype)
                idle = self._idle_timing(key)
                if any(finish_s.get(r, 0.0) < idle.finish_s.get(r, 0.0) for r in c.group):
                    return False
                if not spans.add(start, start + idle.duration_s, c.group, self._channels(key)):
                    return False
            return True

        if all(op.after is None for program in segment.programs.values() for op in program):
            return self._run_in_order(segment, starts, ends, algorithms, None, apart)
        return self._run_dag(segment, starts, ends, algorithms, None, apart)

    def _run_in_order(self, segment: Segment, starts, ends, algorithms, clock: BucketClock | None,
                      record: Callable[[float, Op, CollectiveTiming], bool] | None = None) -> bool:
        """The simpy run of a segment whose programs run in order and whose collectives keep their
        priced timings, without simpy: each rank runs until a collective, the last arrival starts
        it. The arithmetic is simpy's (an event at ``now + delay``), so the times are the same bits.
        ``record``: where given, called with each collective call's start (s), op and timing as
        the call starts; the run stops where it returns False, and so does this."""
        programs = segment.programs
        position = dict.fromkeys(programs, 0)
        now = dict.fromkeys(programs, 0.0)
        waiting: dict[int, list[tuple[int, int]]] = {}  # call -> [(rank, op index)] arrived
        runnable = sorted(programs)
        while runnable:
            released = []
            for rank in runnable:
                program, device = programs[rank], self.topology.devices[rank]
                rank_starts, rank_ends = starts[rank], ends[rank]
                t, i = now[rank], position[rank]
                while i < len(program):
                    op = program[i]
                    rank_starts[i] = t
                    if op.collective is None:
                        t = t + self.compute.duration_s(op, device)
                        rank_ends[i] = t
                        i += 1
                        continue
                    timing = self._timing(op, algorithms)
                    arrived = waiting.setdefault(op.call, [])
                    arrived.append((rank, i))
                    if len(arrived) == _members(op, programs):
                        start = max(starts[r][j] for r, j in arrived)
                        timing = self._timing(op, algorithms, {r: _arrival(starts[r][j] - start, j) for r, j in arrived})
                        timing = self._after_buckets(clock, op, algorithms, timing, start)
                        if record is not None and not record(start, op, timing):
                            return False
                        first = op.collective.group[0]
                        for r, j in arrived:
                            if timing.wait_s and r != first:
                                starts[r][j] = max(starts[r][j], start + timing.wait_s)
                            ends[r][j] = now[r] = start + (start + timing.finish_s.get(r, 0.0) - start)
                            position[r] = j + 1
                            released.append(r)
                    break
                else:
                    position[rank] = i
            runnable = sorted(set(released))
        return True

    def _run_dag(self, segment: Segment, starts, ends, algorithms, clock: BucketClock | None,
                 record: Callable[[float, Op, CollectiveTiming], bool] | None = None) -> bool:
        """The simpy run of a segment whose ops wait for other streams' ops (``Op.after``) but
        whose collectives keep their priced timings and which loads nothing, without simpy: each
        stream runs until an op whose dependencies are not done or a collective whose group has
        not all arrived; finishing an op wakes the streams waiting on it. An op starts at the
        latest end among its stream's previous op and its dependencies (the time simpy's process
        resumes), so the times are the same bits as :meth:`_run_events`'. ``record``: as
        :meth:`_run_in_order`'s."""
        programs = segment.programs
        queues: dict[tuple[int, Stream], list[int]] = {}
        for rank in sorted(programs):
            for i, op in enumerate(programs[rank]):
                queues.setdefault((rank, op.stream), []).append(i)
        position = dict.fromkeys(queues, 0)
        stream_end = dict.fromkeys(queues, 0.0)
        done = {rank: [False] * len(program) for rank, program in programs.items()}
        waiters: dict[tuple[int, int], list[tuple[int, Stream]]] = {}  # (rank, op) -> streams blocked on it
        arrivals: dict[int, list[tuple[int, int, tuple[int, Stream]]]] = {}  # call -> [(rank, op, stream)]
        arrived: set[tuple[int, int]] = set()
        work = deque(queues)

        def finish(rank: int, i: int, key: tuple[int, Stream], end: float) -> None:
            ends[rank][i] = stream_end[key] = end
            done[rank][i] = True
            position[key] += 1
            work.extend(waiters.pop((rank, i), ()))

        while work:
            key = work.popleft()
            rank, _ = key
            queue, program, done_rank, rank_ends = queues[key], programs[rank], done[rank], ends[rank]
            while position[key] < len(queue):
                i = queue[position[key]]
                if (rank, i) in arrived:
                    break  # waiting for the rest of its group
                op = program[i]
                t = stream_end[key]
                blocked = False
                for dep in op.after if op.after is not None else ((i - 1,) if i else ()):
                    if not done_rank[dep]:
                        waiters.setdefault((rank, dep), []).append(key)
                        blocked = True
                        break
                    if rank_ends[dep] > t:
                        t = rank_ends[dep]
                if blocked:
                    break
                starts[rank][i] = t
                if op.collective is None:
                    finish(rank, i, key, t + self.compute.duration_s(op, self.topology.devices[rank]))
                    continue
                timing = self._timing(op, algorithms)
                members = arrivals.setdefault(op.call, [])
                members.append((rank, i, key))
                arrived.add((rank, i))
                if len(members) < _members(op, programs):
                    break
                start = max(starts[r][j] for r, j, _ in members)
                timing = self._timing(op, algorithms, {r: _arrival(starts[r][j] - start, j) for r, j, _ in members})
                timing = self._after_buckets(clock, op, algorithms, timing, start)
                if record is not None and not record(start, op, timing):
                    return False
                first = op.collective.group[0]
                for r, j, stream in members:
                    if timing.wait_s and r != first:
                        starts[r][j] = max(starts[r][j], start + timing.wait_s)
                    arrived.discard((r, j))
                    finish(r, j, stream, start + (start + timing.finish_s.get(r, 0.0) - start))
                    if stream != key:
                        work.append(stream)
        return True

    def _run_events(self, segment: Segment, shared: frozenset, starts, ends, algorithms, clock: BucketClock,
                    pools: tuple[CorePool, ...] = ()) -> None:
        """Simulate ``segment`` in simpy, on a :class:`Fabric` shared by its transfers, the compute
        of the ranks of ``pools`` on their processor-sharing servers; the fabric's channels and
        the others' share ``clock``'s buckets."""
        env = simpy.Environment()
        fabric = Fabric(env, self.links, self.load_rate_cap, clock.buckets)
        servers = [core_server(env, pool) for pool in pools]
        cpu = {rank: server for server in servers for rank in server.pool.ranks}
        # each rank's arrival lag per second of its block (sim.arrival_skew), where its pool has one
        lags = {rank: pool.lag_per_block * off_core_share(len(pool.ranks.intersection(segment.programs)),
                                                          pool.free_cores)
                for pool in pools if pool.lag_per_block and cores.ARRIVAL_LAGS_PRICED for rank in pool.ranks}
        # when each rank left its last collective (s): kept only where lags are priced
        released = dict.fromkeys(segment.programs, 0.0) if lags else None
        calls: dict[int, list] = {}
        for rank in sorted(segment.programs):
            program = segment.programs[rank]
            if all(op.after is None for op in program):
                # Every op waits for the previous one: one process runs the program, the same
                # schedule as one process per stream, with half the simpy events.
                groups = [list(range(len(program)))] if program else []
            else:
                groups = [[i for i, op in enumerate(program) if op.stream == stream] for stream in Stream]
            done = [env.event() for _ in program]
            for indices in groups:
                if indices:
                    env.process(self._stream(env, fabric, shared, rank, program, indices, done, starts[rank],
                                             ends[rank], calls, algorithms, segment.programs, cpu.get(rank), clock,
                                             lags, released))
        env.run()

    def _memory_s(self, op: Op, device, pool: CorePool, duration_s: float) -> float:
        """The part of ``op``'s ``duration_s`` that streams memory (s): its traffic at the lone
        process's bandwidth of ``pool``'s machine, at most its whole time; 0 where the machine's
        bandwidth is not known or the op's time was measured sharing it already
        (:meth:`sim.cost.ComputeModel.timed_alone`)."""
        if not pool.stream_bytes_per_s or op.cost is None or not self.compute.timed_alone(op, device):
            return 0.0
        return min(duration_s, op.traffic_bytes / pool.stream_bytes_per_s[0][1])

    def _stream(self, env, fabric, shared, rank, program, indices, done, starts, ends, calls, algorithms,
                segment_programs, cpu=None, clock=None, lags=None, released=None):
        device = self.topology.devices[rank]
        for i in indices:
            op: Op = program[i]
            for dep in op.after if op.after is not None else ((i - 1,) if i else ()):
                if not done[dep].processed:
                    yield done[dep]
            starts[i] = env.now
            if op.load is not None:
                yield fabric.load(rank, op.load.size_bytes)
            elif op.collective is None:
                duration = self.compute.duration_s(op, device)
                if cpu is None or op.kind is OpKind.STEP_LAG:  # a rank asleep holds no core
                    yield env.timeout(duration)
                else:  # a comm thread's work is waiting for a core (sim.cores)
                    yield cpu.wait_for_core(duration, rank) if op.kind is OpKind.COMM_THREAD else cpu.run(
                        duration, rank, self._memory_s(op, device, cpu.pool, duration))
            else:
                on_fabric = op.collective.group in shared
                entry = calls.setdefault(op.call, [0, env.event(), None, {}, None])
                entry[0] += 1
                entry[3][rank] = (env.now, i)
                if entry[0] == _members(op, segment_programs):
                    entry[4] = self._timing(op, algorithms, {r: _arrival(t - env.now, j) for r, (t, j) in entry[3].items()})
                    if on_fabric:
                        entry[2] = self._on_fabric(fabric, op, algorithms[op.call][1], entry[4], clock)
                    else:  # the fabric follows its own channels' buckets
                        lag_s = _expected_lag_s(op, program[i - 1] if i else op, entry[3], released,
                                                lags) if lags else 0.0
                        entry[4] = waited(self._after_buckets(clock, op, algorithms, entry[4], env.now + lag_s), lag_s)
                    entry[1].succeed(env.now)
                start = yield entry[1]
                timing = entry[4]
                if timing.wait_s and rank != op.collective.group[0]:
                    starts[i] = max(starts[i], start + timing.wait_s)
                if on_fabric:
                    yield entry[2][rank]
                else:
                    yield env.timeout(start + timing.finish_s.get(rank, 0.0) - env.now)
                if released is not None:
                    released[rank] = env.now
            ends[i] = env.now
            done[i].succeed()

    def _fabric_groups(self, segment: Segment, images: tuple[dict[int, int], ...] = ()) -> frozenset[tuple[int, ...]]:
        """The groups whose collectives in ``segment`` could share a channel with other traffic in
        flight (see the module docstring), decided per group; the others keep their priced timing
        (exact: their channels carry nothing else). ``images``: as :meth:`run_segment`'s, whose
        groups count as the segment's own."""
        load_ranks: set[int] = set()
        calls: dict[int, Op] = {}
        mixed: set[tuple[int, ...]] = set()  # groups a rank calls from more than one stream, concurrently
        for rank, program in segment.programs.items():
            streams: dict[tuple[int, ...], set[Stream]] = {}
            sequential = True
            for op in program:
                if op.after is not None:
                    sequential = False
                if op.load is not None:
                    load_ranks.add(rank)
                elif op.collective is not None:
                    calls[op.call] = op
                    streams.setdefault(op.collective.group, set()).add(op.stream)
            if not sequential:
                mixed.update(group for group, used in streams.items() if len(used) > 1)
        if not calls:
            return frozenset()
        by_group: dict[tuple[int, ...], set[int]] = {}
        count: dict[tuple[int, ...], int] = {}
        distinct: dict[tuple[Collective, str], Op] = {}  # a layer's calls repeat: one footprint each
        for op in calls.values():
            count[op.collective.group] = count.get(op.collective.group, 0) + 1
            distinct.setdefault((op.collective, op.name), op)
        for op in distinct.values():
            by_group.setdefault(op.collective.group, set()).update(self.footprint(op))
            for image, _ in _images(op.collective, images):
                by_group.setdefault(image.group, set()).update(self._footprint(image, op.name))
        if not load_ranks and len(by_group) == 1 and not mixed:
            return frozenset()
        shared = {group for group in mixed if count[group] > 1}
        loaded = {c for rank in load_ranks for c in self.links.loader(rank, self.load_rate_cap(rank)).channels}
        groups = list(by_group)
        for i, group in enumerate(groups):
            footprint = by_group[group]
            if footprint & loaded:
                shared.add(group)
            for other in groups[i + 1:]:
                if footprint & by_group[other]:
                    shared.update((group, other))
        return frozenset(shared)

    def footprint(self, op: Op) -> frozenset[int]:
        """The channel ids the schedule of collective ``op`` crosses."""
        return self._footprint(op.collective, op.name)

    def _footprint(self, c: Collective, name: str) -> frozenset[int]:
        """The channel ids the schedule of ``c``, called ``name``, crosses."""
        algorithm, _ = self.pricer.price(c.kind, c.algorithm, c.group, c.size_bytes, c.root, name, dtype=c.dtype)
        return self._channels((c.kind, algorithm, c.group, c.size_bytes, c.root, c.dtype))

    def _channels(self, key: tuple) -> frozenset[int]:
        """The channel ids the schedule of ``key`` (the pricer's schedule key) crosses."""
        footprint = self._footprints.get(key)
        if footprint is None:
            schedule = self.pricer.schedule(*key)
            footprint = self._footprints[key] = frozenset(
                channel for t in schedule.transfers() for channel in self.links.get(t.src, t.dst).channels)
        return footprint

    def _idle_timing(self, key: tuple) -> CollectiveTiming:
        """The fluid model's timing of the schedule of ``key`` on an idle network (cached)."""
        timing = self._idle.get(key)
        if timing is None:
            timing = self._idle[key] = self._idle_fluid.time(self.pricer.schedule(*key))
        return timing

    def _bucket_clock(self, tokens_bytes: dict[int, float] | None = None) -> BucketClock:
        """The token buckets of a segment's links, holding ``tokens_bytes`` (per channel id,
        bytes; full where absent) at its start."""
        if self._unbucketed is not None:
            return self._unbucketed
        return BucketClock(self.links, self._idle_fluid, self._drained, tokens_bytes)

    def _after_buckets(self, clock: BucketClock | None, op: Op, algorithms: dict[int, tuple[str, str]],
                       timing: CollectiveTiming, start_s: float) -> CollectiveTiming:
        """``op``'s priced ``timing``, started at ``start_s`` (s), delayed by the tokens its links'
        buckets miss then (:mod:`sim.bucket_clock`); ``clock`` follows the call's use of them."""
        if not clock:
            return timing
        c = op.collective
        key = (c.kind, algorithms[op.call][1], c.group, c.size_bytes, c.root, c.dtype)
        delay, left = clock.delays(key, self.pricer.schedule(*key), self.footprint(op), start_s)
        timing = delayed(timing, delay)
        clock.used(left, start_s + timing.duration_s)
        return timing

    def _on_fabric(self, fabric: Fabric, op: Op, algorithm: str, timing: CollectiveTiming, clock: BucketClock):
        """Start collective ``op`` on the fabric now; per rank, the event releasing it. The fabric
        runs it from the buckets ``clock`` holds now (they are the fabric's); a timing measured in
        place holds what its run's buckets did to it, so it is released at its measured time plus
        what the fabric's traffic adds to an idle run from the same buckets (:mod:`sim.bucket_clock`)."""
        c = op.collective
        key = (c.kind, algorithm, c.group, c.size_bytes, c.root, c.dtype)
        schedule = self.pricer.schedule(*key)
        priced = (key, tuple(timing.finish_s.get(rank, 0.0) for rank in c.group))  # one per arrival pattern
        extra = self._extra_s.get(priced)
        if extra is None:
            idle = self._idle_timing(key)
            extra = self._extra_s[priced] = {rank: timing.finish_s.get(rank, 0.0) - idle.finish_s[rank]
                                             for rank in c.group}
        if timing.in_place and clock:
            drained, _ = clock.delays(key, schedule, self.footprint(op), fabric.env.now)
            extra = {rank: s - drained.get(rank, 0.0) for rank, s in extra.items()}
        return fabric.collective(schedule, extra)

    def send(self, fabric: Fabric, src: int, dst: int, size_bytes: int):
        """A point-to-point message of ``size_bytes`` from rank ``src`` to ``dst`` issued now on
        ``fabric`` (a pipeline's hop between stages): the event of its arrival at ``dst``. Priced
        as a one-transfer schedule by the network model (its transport terms included), on the
        fabric like a contending collective: its priced time, plus what sharing links costs."""
        schedule = _message(src, dst, size_bytes)
        extra = self._extra_s.get(schedule)
        if extra is None:
            priced, idle = self.pricer.network.time(schedule), self._idle_fluid.time(schedule)
            extra = self._extra_s[schedule] = {r: priced.finish_s.get(r, 0.0) - idle.finish_s[r] for r in (src, dst)}
        return fabric.collective(schedule, extra)[dst]

    def message_s(self, src: int, dst: int, size_bytes: int, beside: tuple[tuple[int, int], ...] = ()) -> float:
        """The time (s) a point-to-point message of ``size_bytes`` takes from rank ``src`` to
        ``dst``: :meth:`send`'s price without a fabric to share, on an otherwise idle network, or
        sent at once with a message of the same size between each pair of ranks ``beside`` (src,
        dst; none involving ``src`` or ``dst``), sharing the links they cross with it as the network
        model shares a step's transfers (:mod:`sim.network`)."""
        return self.pricer.network.time(_message(src, dst, size_bytes, beside)).finish_s[dst]

    def _timing(self, op: Op, algorithms: dict[int, tuple[str, str]],
                arrivals: dict[int, float] | None = None) -> CollectiveTiming:
        """``op``'s timing, its ranks having arrived ``arrivals`` (s) before the last (None: at once)."""
        c = op.collective
        algorithm, timing = self.pricer.price(c.kind, c.algorithm, c.group, c.size_bytes, c.root, op.name, arrivals,
                                             c.dtype)
        algorithms[op.call] = (c.kind.value, algorithm)
        return timing


def _images(collective: Collective, images: tuple[dict[int, int], ...]) -> list[tuple[Collective, dict[int, int]]]:
    """``collective`` as each rank map of ``images`` places it (its group's and root's ranks
    mapped), with the map; none where its group is not inside the maps' ranks (a group across
    the replicas is one call of the whole run, not one per replica)."""
    if not images or not all(rank in images[0] for rank in collective.group):
        return []
    return [(replace(collective, group=tuple(ranks[r] for r in collective.group),
                     root=None if collective.root is None else ranks[collective.root]), ranks) for ranks in images]


def _message(src: int, dst: int, size_bytes: int, beside: tuple[tuple[int, int], ...] = ()) -> CommSchedule:
    """A point-to-point message as the network models price it: a one-step schedule of its
    transfer, with one of the same size between each pair of ``beside`` sent at once."""
    transfers = tuple(Transfer(a, b, size_bytes, False) for a, b in ((src, dst), *beside))
    ranks = tuple(dict.fromkeys(rank for t in transfers for rank in (t.src, t.dst)))
    return CommSchedule(OpKind.SEND, P2P, ranks, None, size_bytes, (transfers,))


def _arrival(offset_s: float, index: int) -> float:
    """When a rank arrived at a collective, relative to the last arrival (s): ``offset_s``, or long
    before where the collective is the rank's first op and another rank came later: it was idle
    before the segment began."""
    return -math.inf if index == 0 and offset_s < 0 else offset_s


def _expected_lag_s(op: Op, before: Op, arrivals: dict[int, tuple[float, int]], released: dict[int, float],
                    lags: dict[int, float]) -> float:
    """How much later than the simulated last arrival the last rank of ``op``'s group arrives, on
    average, as its first rank sees it (s; :func:`sim.arrival_skew.expected_lead_s`): each rank's
    lag ranges over ``lags[rank]`` (0 off a lagging pool) times its block (at most a turn,
    :func:`sim.arrival_skew.lagging_block_s`), from when it left its
    previous collective (``released``, s) to its arrival (``arrivals``: rank -> (s, op index)).
    Prefill blocks only (``before``, the op before the call, of more than one new token,
    ``Op.shape``; see :mod:`sim.arrival_skew`)."""
    if before.shape[0] <= 1:
        return 0.0
    group = [r for r in op.collective.group if r in arrivals]
    ranges = [lags.get(r, 0.0) * lagging_block_s(arrivals[r][0] - released[r]) for r in group]
    return expected_lead_s(ranges, 0) if group and group[0] == op.collective.group[0] else 0.0


def _members(op: Op, programs: dict[int, tuple[Op, ...]]) -> int:
    """How many ranks of ``op``'s group meet at its rendezvous: those with a program in the
    segment (every one, unless the segment simulates one of several identical replicas and the
    others stand in for themselves, :mod:`sim.training.simulate`)."""
    return sum(1 for rank in op.collective.group if rank in programs)
