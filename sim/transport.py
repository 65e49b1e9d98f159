"""Transport terms that transfer between networks, fitted from a profile's collective sweep.

A message of ``n`` bytes over a path of one-way latency ``L`` (the sum of its channels') and
bottleneck bandwidth ``B`` costs, once both endpoints are ready::

    per_message_s + latencies_per_message x L + n / (bandwidth_efficiency x B)

the LogP/LogGP decomposition of a message's cost into software overhead, wire latency and gap
per byte (Culler et al., "LogP: towards a realistic model of parallel computation", PPoPP 1993;
Alexandrov et al., "LogGP", SPAA 1995). ``latencies_per_message`` is more than one where the
backend pays round trips per message: a gloo ``isend``/``irecv`` pair over TCP rendezvouses
before the payload moves (gloo ``gloo/transport/tcp/pair.cc``: a receiver announces its buffer,
then the sender writes), so a message costs about two to three one-way latencies, not one.

The terms are fitted per collective implementation (kind and algorithm: gloo's own ``library``
collectives and the runtime's point-to-point schedules pay different overheads) on the isolated
``collective`` rows of a profile: every schedule is priced over the calibrated cluster's links
(rebuilt from the profile's context, :mod:`sim.context`) by the flow model
(:class:`sim.network.FlowNetwork`, max-min fair sharing, per-rank finishes so that arrival skew
emerges), and the terms are those minimising the squared log error over the rows. The latency
count is fitted only where the calibrated links have at least two distinct delays of at least
:data:`IDENTIFIABLE_DELAY_S`: over one delay ``L``, ``o + k L`` is one number and any ``k`` fits
it with its own ``o``, and below that the delay is lost in the overhead. Else the backend's
default count is kept (:func:`default_terms`) and the overhead absorbs the rest; but where a
calibrated link has such a delay, no more than the software overhead the profile's own
ping-pongs show with the link's known delay and rate taken out (:func:`message_overhead_s`: a
property of the backend on the host, not of the link). Left free, it absorbed the delay (fitted
0.53-0.75 ms for gloo's allreduce over 1-3 ms links against 0.13-0.33 ms over links without delay,
whose ping-pongs show 0.18-0.27 ms) and priced every message on a link without delay too slow.
Capped, it still takes what the default count leaves over the delayed link (0.5-0.7 ms for gloo's
own collectives over 3-5 ms), so a group whose paths have no delay pays the backend's default
overhead where that is less (:attr:`TransportTerms.undelayed_per_message_s`). Never fitted on a
target's measurements.

Where the ranks outnumber the cores they share, a message's software overhead is CPU work of
both its ends, and stretches like compute (:mod:`sim.cores`): by the busy ranks of its step over
the cores, when more are busy than there are cores (:meth:`_TransportLinks.stretch`). Fitting
prices the sweep over the calibrated machine's cores the same way, so the fitted overhead is a
message's on a core of its own, and a step that leaves ranks asleep (a two-level tree's
leader-only steps) pays it unstretched on any target.

A collective whose group lies inside one host is priced from what the profile measured inside a
host (:func:`fit_intra_host`): its sweep over one host's ranks, else no less than its intra-host
ping-pongs' overhead per message; never from the spanning sweep's overhead alone where its calls
over a delayed link left it unidentified (fitted 0-0.1 ms on v2x2_latency, whose intra-host
ping-pongs show 0.32).

A collective on any topology is then its schedule priced with these terms by
:class:`TransportNetwork`.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from sim.cluster_config import ClusterConfig
from sim.collectives.registry import LIBRARY, build_schedule
from sim.collectives.schedule import CommSchedule
from sim.context import CalibrationContext, LinkClass
from sim.network import CollectiveTiming, Links, _FlowRun, _StepClock, fluid_lower_bound_s
from sim.profile import noise_floor
from sim import token_bucket
from sim.topology import Topology, build_topology

IDENTIFIABLE_DELAY_S = 1e-3
_LATENCY_COUNTS = (1.0, 1.5, 2.0, 2.5, 3.0)
# A message's bytes cannot flow faster than its bottleneck channel: efficiencies above 1 fitted on
# rows a model term does not describe (noisy small sizes, two connections in opposite directions
# between one host pair) and priced every other network's large messages too fast.
_EFFICIENCIES = tuple(np.round(np.arange(0.5, 1.001, 0.1), 2))
_OVERHEADS_S = np.linspace(0.0, 5e-3, 201)


@dataclass(frozen=True)
class TransportTerms:
    """The per-message cost terms of one collective implementation (see the module docstring).

    Attributes:
        per_message_s: software overhead per message (s).
        per_call_s: fixed cost of launching a collective (s), once per call.
        min_message_s: the least a message costs (s) per core turn its step takes a busy rank
            (:func:`step_turns`), from both ends ready to its last byte, where ranks outnumber
            the cores: a rank moves its messages only while scheduled onto a core, which on a
            fast link takes longer than the wire; a long message's transfer hides it, the
            ranks sleeping meanwhile (:func:`sim.calibrated.contention_floor`,
            :meth:`_TransportLinks.floor_s`).
        latencies_per_message: one-way path latencies a message costs when both ends enter
            its step at once.
        bandwidth_efficiency: the fraction of the bottleneck bandwidth a message's bytes reach.
        notice_latencies: of ``latencies_per_message``, those of the receiver's ready notice
            (a gloo isend/irecv rendezvous: 1), which the receiver sends on entering the step:
            the payload leaves once the sender has entered and the notice has reached it, so a
            receiver that entered that much earlier saves them (:class:`_TransportRun`).
        sender_done_on_write: the sender is done once its payload is written, the payload's
            latencies before it arrives (a send over TCP completes when the kernel has taken
            the bytes: gloo's ``transport/tcp/pair.cc``), not on its arrival.
        send_buffer_s, send_buffer_max_bytes: with ``sender_done_on_write``, what the kernel
            takes of a payload before its bytes are through: the sender is done once what is
            left of it fits in its socket's send buffer, ``min(send_buffer_max_bytes,
            send_buffer_s x the path's bottleneck rate)`` bytes (0: once its last byte is
            through). See :data:`GLOO_SEND_BUFFER_S`.
        intra_host_min_message_s: ``min_message_s`` of a message between two ranks of one host,
            where its path's differs (None: the same): on the emulated cluster an intra-host
            message crosses loopback and costs about twice the core time of one between the
            hosts' namespaces (:func:`sim.calibrated.contention_floor`).
        undelayed_per_message_s: the software overhead per message (s) over a group none of whose
            paths has a delay of at least :data:`IDENTIFIABLE_DELAY_S`, where it differs from
            ``per_message_s`` (None: the same): terms fitted over delayed links only, whose
            overhead also took what the default latency count left of their messages' time
            there (:func:`fit_terms`).
        source: where the terms come from (fitted on which rows, or a documented default).
    """

    per_message_s: float
    latencies_per_message: float
    bandwidth_efficiency: float
    source: str
    per_call_s: float = 0.0
    min_message_s: float = 0.0
    notice_latencies: float = 0.0
    sender_done_on_write: bool = False
    send_buffer_s: float = 0.0
    send_buffer_max_bytes: float = 0.0
    undelayed_per_message_s: float | None = None
    intra_host_min_message_s: float | None = None

    def undelayed(self) -> TransportTerms:
        """These terms over a group whose paths have no delay (:attr:`undelayed_per_message_s`)."""
        return self if self.undelayed_per_message_s is None else _undelayed(self)

    def describe(self) -> str:
        call = f"{self.per_call_s * 1e6:.1f} us per call + " if self.per_call_s else ""
        if self.min_message_s:
            inside = ("" if self.intra_host_min_message_s is None else
                      f", {self.intra_host_min_message_s * 1e3:.2f} ms inside a host")
            call += f"at least {self.min_message_s * 1e3:.2f} ms (core contention{inside}), "
        notice = f" ({self.notice_latencies:g} of them the receiver's ready notice)" if self.notice_latencies else ""
        buffer = (f", the sender done once its tail fits {self.send_buffer_s * 1e3:g} ms of the path's rate "
                  f"(at most {self.send_buffer_max_bytes / 1e6:g} MB)"
                  if self.sender_done_on_write and self.send_buffer_s > 0 else "")
        undelayed = ("" if self.undelayed_per_message_s is None else
                     f" ({self.undelayed_per_message_s * 1e3:.3g} ms over links without delay)")
        return (f"{call}{self.per_message_s * 1e3:.3g} ms{undelayed} + "
                f"{self.latencies_per_message:g} latencies per message"
                f"{notice}, {self.bandwidth_efficiency:.0%} of the bandwidth{buffer} ({self.source})")


class _TransportLinks(Links):
    """Links whose routes' latency and channels' capacity include a :class:`TransportTerms`.

    ``cores``: the cores the ranks share (None: a core each); ``copies``: the replicas sharing
    them that run the priced group's steps at once, each a mirror of it (1: the group alone on the
    cores; :mod:`sim.replicas`). A step's
    message costs at least ``terms.min_message_s`` per core turn the step takes a busy rank where
    the machine's busy ranks outnumber its cores (:meth:`floor_s`)."""

    def __init__(self, topology: Topology, reduce_s_per_byte: Mapping[int, float] | None, terms: TransportTerms,
                 cores: int | None = None, copies: int = 1):
        super().__init__(topology, reduce_s_per_byte)
        self.terms = terms
        self.cores, self.copies = cores, copies
        self.capacity = [c * terms.bandwidth_efficiency for c in self.capacity]
        self._notices: dict[tuple[int, int], float] = {}
        self._delays: dict[tuple[int, ...], bool] = {}

    def message_latency_s(self, path) -> float:
        """What a message waits before its bytes flow over ``path`` (s): the terms' software
        overhead, plus their one-way latencies after the receiver's ready notice unless those come
        after the bytes leave (:meth:`payload_latency_s`)."""
        return self.terms.per_message_s + (0.0 if self.terms.sender_done_on_write else self.payload_latencies(path))

    def payload_latencies(self, path) -> float:
        """The one-way latencies of ``path`` a payload takes after the receiver's notice (s)."""
        return (self.terms.latencies_per_message - self.terms.notice_latencies) * sum(c.latency_s for c in path)

    def payload_latency_s(self, src: int, dst: int) -> float:
        """How long a payload from ``src`` travels after its sender is done (s): its latencies
        where the sender is done on writing it, else 0 (they came before its bytes flowed)."""
        if not self.terms.sender_done_on_write:
            return 0.0
        return self.payload_latencies(self.topology.path(src, dst))

    def send_buffer_bytes(self, route) -> float:
        """What a sender's socket takes of a payload over ``route`` before its bytes are through
        (bytes; 0 where the sender waits for its last byte): :attr:`TransportTerms.send_buffer_s`
        at the route's bottleneck rate, at most :attr:`TransportTerms.send_buffer_max_bytes`."""
        terms = self.terms
        if not (terms.sender_done_on_write and terms.send_buffer_s > 0 and route.channels):
            return 0.0
        rate = min(self.capacity[c] for c in route.channels)
        return min(terms.send_buffer_max_bytes, terms.send_buffer_s * rate)

    def notice_s(self, dst: int, src: int) -> float:
        """How long the receiver ``dst``'s ready notice takes to reach the sender ``src`` (s)."""
        if not self.terms.notice_latencies:
            return 0.0
        notice = self._notices.get((dst, src))
        if notice is None:
            notice = self._notices[(dst, src)] = self.terms.notice_latencies * self.topology.path_latency_s(dst, src)
        return notice

    def contending_ranks(self, schedule: CommSchedule) -> list[int]:
        """For each step of ``schedule``, how many of its busy ranks (:func:`busy_ranks`) want the
        cores at once: all of them, but in a step whose messages all stay inside hosts, of a group
        some of whose ranks are :data:`IDENTIFIABLE_DELAY_S` or more apart (:func:`delayed_group`), the most that one host keeps
        busy. The hosts' ranks leave every step that crosses that delay at times a wake-up apart
        and reach the next call apart (the master's wait for the last rank, measured in place at
        3 KiB: 0.8 ms a call over h2x2_mid's 1.1 ms, 2.7 over v2x2_latency's 5 ms, 6.1 over
        t2x2_slow's), so one host's exchange is over before the other's begins: priced with all
        4 busy, recursive doubling over 2 hosts of 2 on 2 cores cost 4.1 ms a call on h2x2_mid
        against 3.2 ms measured (in place 2.4, the wait 0.8), the two-level tree 6.8 against 5.3
        (its own profile's terms; ``validation/transfer-report/progress.md``, session 35). Over
        faster links the hosts' ranks meet the cores together, as the in-place floors were
        fitted (:func:`sim.calibrated.contention_floor`)."""
        busy = busy_ranks(schedule)
        group = tuple(schedule.group)
        delayed = self._delays.get(group)
        if delayed is None:
            delayed = self._delays[group] = delayed_group(self.topology, group)
        if not delayed:
            return busy
        topology = self.topology
        return [max(Counter(topology.devices[r].host for r in {r for t in step for r in (t.src, t.dst)}).values())
                if step and all(topology.same_host(t.src, t.dst) for t in step) else n
                for step, n in zip(schedule.steps, busy)]

    def stretch(self, busy_ranks: int) -> float:
        """How much longer a message's software overhead takes in a step that keeps ``busy_ranks``
        ranks of the group busy: processor sharing of the cores among them and their ``copies``'
        mirrors (:mod:`sim.cores`), 1 without cores."""
        return 1.0 if self.cores is None else max(1.0, busy_ranks * self.copies / self.cores)

    def floor_s(self, busy_ranks: int, turns: float = 1.0, inside_host: bool = False) -> float:
        """The least a message costs (s) in a step whose messages keep ``busy_ranks`` ranks of
        the group busy at once (:meth:`contending_ranks`), each for ``turns`` core turns
        (:func:`step_turns`), between two ranks of
        one host where ``inside_host`` (``terms.intra_host_min_message_s`` where set): ``terms.min_message_s``
        (a turn with the cores outnumbered) times ``turns`` where the machine's busy ranks (the
        group's and its ``copies``' mirrors', every replica in the same step: they run the same
        ops at once, :func:`sim.replicas.replica_pools`) outnumber its cores, else 0. A rank that
        takes no part in a step sleeps in its receive and leaves its core to the others
        (measured: a two-level tree over 2 hosts of 2 ranks on 2 cores, whose middle steps keep 2
        ranks busy, costs 4.2-4.6 ms in place at 3 KiB, a recursive doubling's 2 steps of 4 busy
        ranks 3.9-4.1 ms); a step of one message a rank (the tree's gather and broadcast inside a
        host) takes 2 turns where an exchange takes 3. ``terms.min_message_s`` is already the
        target machine's, at its ranks per core (:func:`contention_at`); a step pays it whole
        where its busy ranks outnumber the cores, not in proportion to them: a woken rank that
        finds the cores taken waits for a running one to be preempted (the kernel's tick), so a
        step of 3 busy ranks of 4 pays a whole turn too: gloo's broadcast tree's first
        step (:func:`sim.collectives.gloo.gloo_broadcast`): its root's decode calls timed in place
        at 1.03 and 1.08 ms on v2x2_bandwidth (validation/layouts-report/quiet-s17), 0.44-0.46 ms a
        turn so counted, against 0.48-0.50 ms for gloo's reduce there, whose every step keeps all 4
        busy; 0.88-0.92 ms with the step counted half, as busy ranks beyond the cores over all ranks
        beyond them counted it."""
        floor_s = self.terms.min_message_s
        if inside_host and self.terms.intra_host_min_message_s is not None:
            floor_s = self.terms.intra_host_min_message_s
        if self.cores is None or not floor_s:
            return floor_s * turns if self.cores is None else 0.0
        return floor_s * turns if busy_ranks * self.copies > self.cores else 0.0


@functools.cache
def _undelayed(terms: TransportTerms) -> TransportTerms:
    """``terms`` with :attr:`TransportTerms.undelayed_per_message_s` as their overhead, built once
    per terms (a network prices many schedules with each)."""
    return replace(terms, per_message_s=terms.undelayed_per_message_s, undelayed_per_message_s=None,
                   source=f"{terms.source}; over links without delay, the overhead "
                          f"{terms.undelayed_per_message_s * 1e3:.3g} ms")


def of_replicas(copies: int) -> str:
    """`` of N replicas`` where ``copies`` replicas share the cores, else ''."""
    return f" of {copies} replicas" if copies > 1 else ""


def busy_ranks(schedule: CommSchedule) -> list[int]:
    """For each step of ``schedule``, how many ranks it keeps busy (its senders and receivers)."""
    return [len({rank for t in step for rank in (t.src, t.dst)}) for step in schedule.steps]


def step_turns(schedule: CommSchedule) -> list[float]:
    """For each step of ``schedule``, the core turns it takes a busy rank, on average over its
    busy ranks: one to enter the step (post its receives and sends, :func:`runtime.comm.run_schedule`)
    and one per message it sends or receives (each waited for, ``request.wait()``); each transfer
    is one send and one receive. An exchange step (recursive doubling, Rabenseifner, a ring) 3,
    a gather or a broadcast 2, a binary tree's step whose inner nodes handle 3 messages and its
    leaves 1, 3. The count was chosen on the in-place calls of v2x2_bandwidth at 3 KiB, the one
    calibration whose calls mix both kinds of step (4 ranks on 2 cores): there a two-level tree's
    gather and broadcast steps cost 1.3-1.5 ms against 1.9-2.4 ms for recursive doubling's and
    Rabenseifner's exchange steps, 2 turns to 3 (a floor per step prices the tree's decode calls
    in the transfer runs +23% there, per call; one per message alone -18%; this -4%)."""
    return [1 + 2 * len(step) / n if n else 0.0 for step, n in zip(schedule.steps, busy_ranks(schedule))]


def steps_in_series(schedule: CommSchedule, weights: list[float]) -> float:
    """How many of ``schedule``'s steps, step k counting ``weights[k]``, a run goes through one
    after the other: all of them, where its steps wait for the ones before (their sum); where a
    rank keeps several in flight (``CommSchedule.in_flight``), the weighted length of its
    critical path, every transfer of step k lasting ``weights[k]`` once both its ends entered it."""
    if not schedule.overlapping:
        return sum(weights)
    clock = _StepClock(schedule)
    for k, (step, weight) in enumerate(zip(schedule.steps, weights)):
        ready = clock.enter(k, step)
        done: dict[int, float] = {}
        for t in step:
            end = max(ready[t.src], ready[t.dst]) + weight
            done[t.src] = max(done.get(t.src, 0.0), end)
            done[t.dst] = max(done.get(t.dst, 0.0), end)
        clock.leave(k, done)
    return max(clock.finish().values(), default=0.0)


class _TransportRun(_FlowRun):
    """A flow-model pricing with the transport terms' rendezvous and contention floor.

    * A message's payload leaves once its sender has entered its step and the receiver's ready
      notice, sent when the receiver entered the step, has reached the sender
      (``notice_latencies`` one-way latencies): both entering at once pay the whole
      ``latencies_per_message``; a receiver waiting since a notice's time before pays only the
      payload's latencies. The runtime runs a schedule so (:func:`runtime.comm.run_schedule`
      posts a step's receives on entering it; gloo's ``transport/tcp/pair.cc`` writes an
      unbound buffer's payload once the receiver's ``sendNotifyRecvReady`` has come). A rank
      that arrived at the collective before the last (``arrivals``: s relative to the last
      arrival, which starts the run at 0) entered its first step then (and every step that waits
      for none of its others: gloo's ring posts its first two segments at once).
    * Where the sender is done on writing its payload (``sender_done_on_write``), its bytes
      flow first and travel the payload's latencies after: the sender goes on to its next step
      that much before the receiver has them. It goes on sooner still where its socket's send
      buffer takes the payload's tail (:meth:`_TransportLinks.send_buffer_bytes`): once what is
      left of the payload at the flow's rate fits in it, re-projected whenever the rate changes.
      A ring's ranks so finish apart where its links differ: one whose last step sends over a
      slow link and receives over a fast one is done a slow transfer before one that receives
      over the slow link (the send buffer timed by ``benchmarks/bench_send_buffer.py``; on the
      emulated 2 hosts x 2 ranks the 5 MiB buckets' rings ended 0.05-0.11 s apart,
      ``validation/training-report/overlap-s25``).
    * No message takes less than its step's contention floor (:meth:`_TransportLinks.floor_s`,
      per core turn of the step) from both ends being ready to its last byte: a message whose
      wire time is shorter waits out the rest before its bytes flow (both ends scheduled onto a
      core).
    """

    def __init__(self, schedule: CommSchedule, links: _TransportLinks, arrivals: Mapping[int, float] | None = None):
        super().__init__(schedule, links)
        self.arrivals = arrivals or {}
        busy = links.contending_ranks(schedule)
        by_path = links.terms.intra_host_min_message_s is not None
        self.floor = [links.floor_s(n, turns, by_path and links.topology.same_host(t.src, t.dst))
                      for step, n, turns in zip(schedule.steps, busy, step_turns(schedule)) for t in step]
        self.extra_s = [links.terms.per_message_s * (links.stretch(n) - 1) for step, n in zip(schedule.steps, busy)
                        for _ in step]
        self.notice_s = [links.notice_s(t.dst, t.src) for t in self.transfers]
        self.notice_at = [0.0] * len(self.transfers)  # when each receiver's notice reaches its sender
        self.in_flight_s = [links.payload_latency_s(t.src, t.dst) for t in self.transfers]
        self.buffered = [links.send_buffer_bytes(route) for route in self.route]
        self.written: set[int] = set()  # transfers whose sender is done, their bytes still flowing
        self.written_at: dict[int, float] = {}  # flowing transfer -> when its tail fits the buffer

    def _enter(self, rank: int, position: int) -> None:
        # A rank that arrived early posted on arriving the receives of the steps that wait for none
        # of its others: its first, and gloo's ring's first two segments.
        posted = self.now + (min(0.0, self.arrivals.get(rank, 0.0)) if self.need[rank][position] == 0 else 0.0)
        for transfer in self.work[rank][position]:
            if self.transfers[transfer].dst == rank:
                self.notice_at[transfer] = posted + self.notice_s[transfer]
        super()._enter(rank, position)

    def _start(self, transfer: int) -> None:
        route = self.route[transfer]
        # Bytes the links' buckets hold now would go at once (:mod:`sim.token_bucket`).
        size = self.transfers[transfer].size_bytes
        if self.buckets:
            size = max(0.0, size - self.buckets.available_bytes(route.channels, self.now))
        wire_s = size / min((self.links.capacity[c] for c in route.channels), default=math.inf)
        leaves = max(self.now, self.notice_at[transfer])
        self._push(max(leaves + route.latency_s + self.extra_s[transfer],
                       self.now + self.floor[transfer] - wire_s - self.in_flight_s[transfer]),
                   self._LATENCY_OVER, transfer)

    def _reshare(self) -> None:
        super()._reshare()
        if not any(self.buffered):
            return
        done = []
        for f, end in self.end.items():
            if f in self.written or not self.buffered[f]:
                continue
            at = max(self.now, end - self.buffered[f] / self.route_rate[self.route[f].id])
            if at <= self.now:
                done.append(f)
            elif self.written_at.get(f) != at:
                self.written_at[f] = at
                self._push(at, self._WRITTEN, f)
        for f in sorted(done):
            self._written(f, None)

    def _written(self, transfer: int, at: float | None) -> None:
        if transfer in self.written or (at is not None and self.written_at.get(transfer) != at):
            return  # done already, or a projection a rate change has replaced
        self.written.add(transfer)
        self.written_at.pop(transfer, None)
        self._complete(self.transfers[transfer].src, transfer)  # its tail is the kernel's: the sender goes on

    def _arrived(self, transfer: int) -> None:
        self.written_at.pop(transfer, None)
        if transfer in self.written:  # the sender went on already
            if self.in_flight_s[transfer]:
                self._push(self.now + self.in_flight_s[transfer], self._DELIVERED, transfer)
            else:
                self._delivered(transfer)
            return
        if not self.in_flight_s[transfer]:
            return super()._arrived(transfer)
        self._complete(self.transfers[transfer].src, transfer)  # written: the sender goes on
        self._push(self.now + self.in_flight_s[transfer], self._DELIVERED, transfer)


def price(schedule: CommSchedule, topology: Topology, terms: TransportTerms,
          reduce_s_per_byte: Mapping[int, float] | None = None, cores: int | None = None) -> CollectiveTiming:
    """``schedule`` priced by the flow model with ``terms`` on every message, its ranks sharing
    ``cores`` (None: a core each)."""
    return _TransportRun(schedule, _TransportLinks(topology, reduce_s_per_byte, terms, cores)).run()


@dataclass
class TransportNetwork:
    """A network model pricing every collective as its schedule with fitted transport terms.

    Args:
        topology: the scenario's cluster.
        reduce_s_per_byte: gamma of every rank (s/byte), as the uncalibrated models take it.
        terms: per (kind, algorithm), the terms of that implementation.
        default: the terms of an implementation the profile did not time.
        gap_s: the framework's time between two ops, added to every collective.
        cores: the cores the target's ranks share (None: a core each, every message's floor
            as its terms say); ``copies``: the replicas that run each priced group's steps at
            once on them (:class:`_TransportLinks`).
        hops: per link class, the terms of a point-to-point message between two stages of a
            pipeline (:func:`fit_hops`); a hop over a class without them takes ``terms`` or
            ``default`` as any schedule does.
        intra_host: per (kind, algorithm), the terms of a collective whose group lies inside one
            host (:func:`fit_intra_host`); such a collective without them takes ``terms``.
    """

    topology: Topology
    reduce_s_per_byte: Mapping[int, float] | None
    terms: dict[tuple[str, str], TransportTerms]
    default: TransportTerms
    gap_s: float = 0.0
    cores: int | None = None
    copies: int = 1
    hops: dict[LinkClass, TransportTerms] = field(default_factory=dict)
    intra_host: dict[tuple[str, str], TransportTerms] = field(default_factory=dict)
    extrapolated: set[str] = field(default_factory=set)
    _routes: dict[TransportTerms, _TransportLinks] = field(default_factory=dict, repr=False)
    _horizons: dict[tuple[int, ...], float] = field(default_factory=dict, repr=False)
    _delays: dict[tuple[int, ...], bool] = field(default_factory=dict, repr=False)

    prices_by_call = False  # no timing of a call is replayed: a schedule costs the same wherever called

    def time(self, schedule: CommSchedule, call: str | None = None,
             arrivals: Mapping[int, float] | None = None) -> CollectiveTiming:
        """The timing of ``schedule`` from the last rank's arrival, the others having arrived
        ``arrivals`` before (s, <= 0; None: all at once). ``call`` is ignored: no timing of a
        call is replayed."""
        if len(schedule.group) == 1:
            return CollectiveTiming(0.0, {r: 0.0 for r in schedule.group})
        terms, links = self._links(schedule, note=True)
        timing = _TransportRun(schedule, links, arrivals).run()
        extra_s = self.gap_s + terms.per_call_s
        finish = {rank: t + extra_s for rank, t in timing.finish_s.items()}
        return CollectiveTiming(timing.duration_s + extra_s, finish)

    def arrival_horizon_s(self, group: tuple[int, ...]) -> float:
        """How long before the last arrival an arrival still changes a price (s): the longest
        ready notice between two ranks of ``group`` (0 where no terms have one)."""
        horizon = self._horizons.get(group)
        if horizon is None:
            notices = max((t.notice_latencies for t in (*self.terms.values(), self.default)), default=0.0)
            horizon = self._horizons[group] = notices * max(
                (self.topology.path_latency_s(a, b) for a in group for b in group if a != b), default=0.0) \
                if notices else 0.0
        return horizon

    def lower_bound_s(self, schedule: CommSchedule) -> float:
        """A duration :meth:`time` cannot beat (s): the fluid bound over the terms' links
        (:func:`sim.network.fluid_lower_bound_s`; a message's floor only adds to it) plus the
        per-call terms. The pricer skips the schedules of ``auto`` whose bound exceeds the best."""
        if len(schedule.group) == 1:
            return 0.0
        terms, links = self._links(schedule, note=False)
        return fluid_lower_bound_s(schedule, links) + self.gap_s + terms.per_call_s

    def _links(self, schedule: CommSchedule, note: bool) -> tuple[TransportTerms, _TransportLinks]:
        key = (str(schedule.kind), schedule.algorithm)
        terms = ((self.intra_host.get(key) if self.intra_host and self._inside_host(schedule.group) else None)
                 or self.terms.get(key) or self._hop_terms(schedule))
        if terms is None:
            terms = self.default
            if note:
                self.extrapolated.add(f"{schedule.kind} {schedule.algorithm}: not calibrated, {terms.describe()}")
        if terms.undelayed_per_message_s is not None and not self._delayed_group(schedule.group):
            terms = terms.undelayed()
        links = self._routes.get(terms)
        if links is None:
            links = self._routes[terms] = _TransportLinks(self.topology, self.reduce_s_per_byte, terms,
                                                          self.cores, self.copies)
        return terms, links

    def _inside_host(self, group: tuple[int, ...]) -> bool:
        return len({self.topology.devices[rank].host for rank in group}) == 1

    def _delayed_group(self, group: tuple[int, ...]) -> bool:
        """:func:`delayed_group` of ``group``, kept per group."""
        delayed = self._delays.get(group)
        if delayed is None:
            delayed = self._delays[group] = delayed_group(self.topology, group)
        return delayed

    def _hop_terms(self, schedule: CommSchedule) -> TransportTerms | None:
        """The :attr:`hops` terms of the link class a one-message point-to-point schedule crosses."""
        from models.ops import OpKind
        from sim.engine import P2P

        if not self.hops or schedule.kind != OpKind.SEND or schedule.algorithm != P2P or len(schedule.group) != 2:
            return None
        src, dst = schedule.group
        return self.hops.get(LinkClass.INTRA_HOST if self.topology.same_host(src, dst) else LinkClass.INTER_HOST)


def context_topology(context: CalibrationContext) -> Topology:
    """A cluster with the calibrated group's shape and links: hosts holding ``ranks_per_host``
    ranks of the first device type under one switch, the inter-host link's delay split over the
    two NICs, the intra-host link as a shared bus (as the shipped scenarios describe the
    emulated hosts), each with the link's token bucket, so that a fit over it takes the buckets
    out of the terms (:mod:`sim.token_bucket`). Where the context has several links of a class, the first (slowest) one."""
    def first(link_class: LinkClass):
        return next((l for l in context.links if l.link_class == link_class), None)

    inter, intra = first(LinkClass.INTER_HOST), first(LinkClass.INTRA_HOST)
    device = context.devices[0][0]
    hosts = []
    for index, ranks in enumerate(context.ranks_per_host):
        # An inter-host message crosses both hosts' buses too, where the hosts have one.
        bus_s = intra.delay_s if ranks > 1 and intra is not None else 0.0
        host = {"name": f"h{index}", "parent": "sw", "devices": {"type": device, "count": ranks, "memory": "1TiB"},
                "nic": {"bandwidth": f"{inter.rate_bytes_per_s if inter else 1e12}B/s",
                        "latency": f"{max(0.0, inter.delay_s / 2 - bus_s) if inter else 0.0}s",
                        "burst": inter.burst_bytes if inter else None}}
        if ranks > 1 and intra is not None:
            host["interconnect"] = {"bandwidth": f"{intra.rate_bytes_per_s}B/s", "latency": f"{intra.delay_s}s",
                                    "shared": True, "burst": intra.burst_bytes}
        hosts.append(host)
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": hosts}))


def fit_terms(rows, topology: Topology, default: TransportTerms, name: str,
              reduce_s_per_byte: Mapping[int, float] | None = None,
              cores: int | None = None, overhead_s: float | None = None) -> dict[tuple[str, str], TransportTerms]:
    """Fit :class:`TransportTerms` per (kind, algorithm) on a profile's isolated ``collective``
    rows (median times), each priced over the first ``group_size`` ranks of ``topology`` (the
    calibrated cluster); see the module docstring.

    Args:
        rows: the profile's ``collective`` rows.
        default: the backend's default terms; its latency count is kept where the links' delays
            cannot identify it.
        name: the calibrated cluster, named in each term's ``source``.
        overhead_s: the per-message software overhead the profile's ping-pongs show
            (:func:`message_overhead_s`, s); where given and a link has a delay of at least
            :data:`IDENTIFIABLE_DELAY_S`, the fitted overhead is at most that, and over a group
            whose paths have no such delay a message pays no more than ``default``'s overhead
            (:attr:`TransportTerms.undelayed_per_message_s`). Over one delay the overhead is not
            told from the latencies (module docstring): fitted over 3-5 ms links it took 0.5-0.7 ms
            for gloo's own collectives, where the clusters without delay fit 0.25-0.3 ms, and
            carried onto links without delay it priced their decode 20-47% slow (gloo's allreduce
            and reduce + broadcast from h3x1_delay's and v4x1_latency's profiles,
            ``validation/transfer-report/progress.md``, session 28). It stays on delayed paths,
            whose messages it describes.
    """
    capped = overhead_s is not None and _delayed(topology) >= 1
    counts = _LATENCY_COUNTS if _delayed(topology) >= 2 else (default.latencies_per_message,)
    fitted = {}
    for (kind, algorithm), of_kind in rows.groupby(["op", "algorithm"], sort=True):
        schedules, measured = [], []
        for row in of_kind.itertuples(index=False):
            group = tuple(range(int(row.group_size)))
            if len(group) > topology.num_ranks or row.size_bytes <= 0:
                continue
            schedules.append(build_schedule(kind, algorithm, group, int(row.size_bytes),
                                            root=None if kind == "allreduce" else group[0],
                                            host_groups=topology.host_groups(group)))
            measured.append(float(row.median))
        if schedules:
            how = ("" if len(counts) > 1 else f"; latency count: the {default.source}") + (
                f"; overhead at most {name}'s ping-pongs' less the link's delay" if capped else "")
            terms = _best_terms(schedules, measured, topology, counts, reduce_s_per_byte, cores,
                                f"fitted on {name}'s {len(schedules)} isolated timings{how}", default,
                                overhead_s if capped else None)
            if capped and terms.per_message_s > default.per_message_s:
                terms = replace(terms, undelayed_per_message_s=default.per_message_s)
            fitted[(str(kind), str(algorithm))] = terms
    return fitted


def delayed_group(topology: Topology, group: tuple[int, ...]) -> bool:
    """Whether a path between two ranks of ``group`` has a delay of at least :data:`IDENTIFIABLE_DELAY_S`."""
    return any(topology.path_latency_s(a, b) >= IDENTIFIABLE_DELAY_S for a in group for b in group if a != b)


def _delayed(topology: Topology) -> int:
    """How many distinct path delays of at least :data:`IDENTIFIABLE_DELAY_S` ``topology`` has:
    those that can tell a latency count from an overhead (module docstring)."""
    delays = {round(topology.path_latency_s(a, b), 6) for a in range(topology.num_ranks)
              for b in range(topology.num_ranks) if a != b}
    return len({d for d in delays if d >= IDENTIFIABLE_DELAY_S})


def _ping_overheads_s(pings, context: CalibrationContext, link_class: LinkClass, count: int,
                      floored: bool) -> np.ndarray | None:
    """The ``count`` smallest ping-pongs over ``link_class`` (half round trips, s), each less the
    link's one-way delay and its wire time beyond the link's token bucket where buckets are priced
    (a ping-pong's message finds the bucket full: :mod:`sim.token_bucket`), all from ``context``;
    ``floored``: their times first made non-decreasing in size (:func:`sim.profile.noise_floor`).
    None where the profile has no such ping-pong or the context no such link."""
    link = next((l for l in context.links if l.link_class == link_class), None)
    rows = pings[(pings["device_class"] == link_class.value) & (pings["size_bytes"] > 0)]
    if link is None or rows.empty:
        return None
    rows = rows.sort_values("size_bytes")
    times_s = rows["median"].to_numpy(dtype=float)
    times_s = (noise_floor(times_s) if floored else times_s)[:count]
    burst_bytes = (link.burst_bytes or 0) if token_bucket.PRICED else 0
    paced_s = np.maximum(0.0, rows["size_bytes"].to_numpy(dtype=float)[:count] - burst_bytes) / link.rate_bytes_per_s
    return times_s - link.delay_s - paced_s


def message_overhead_s(pings, context: CalibrationContext,
                       link_class: LinkClass = LinkClass.INTER_HOST) -> float | None:
    """The software overhead of one point-to-point message on the calibrated hosts (s): the
    profile's ping-pong over ``link_class`` (half a round trip, the receiver waiting) at its
    smallest size, floored by the larger sizes' (:func:`sim.profile.noise_floor`), less the link's
    one-way delay and the message's wire time at the link's rate beyond its token bucket where
    buckets are priced (:func:`_ping_overheads_s`), all from ``context`` (LogP's ``o`` on each end:
    Culler et al., PPoPP 1993). None where the profile has no such ping-pong or the context no
    such link."""
    overheads_s = _ping_overheads_s(pings, context, link_class, 1, floored=True)
    return None if overheads_s is None else max(0.0, float(overheads_s[0]))


HOP_SMALL_MESSAGES = 3
"""Ping-pong sizes (the smallest) whose time less the link's delay and wire time gives a hop's
software overhead (:func:`hop_overhead_s`)."""


def hop_overhead_s(pings, context: CalibrationContext, link_class: LinkClass) -> float | None:
    """The software overhead of a pipeline hop over ``link_class`` (s): the median, over the
    profile's :data:`HOP_SMALL_MESSAGES` smallest ping-pongs of that class (half a round trip, the
    receiver waiting, as a hop's receiver waits for it), of each one's time less the link's one-way
    delay and its wire time beyond the link's token bucket (:func:`_ping_overheads_s`; LogP's
    ``o``: Culler et al., PPoPP 1993). A median over a few small sizes, not the smallest alone:
    their medians scatter by a millisecond over delayed links (1 KiB 5.4 ms and 4 KiB 6.3 ms over
    5 ms), and a least-squares fit over every size put the sizes of tens of KiB's excess, which
    TCP's window growth adds and the model does not describe, into the overhead (a 3 KiB hop over
    5 ms priced 6.7-7.0 ms against 5.7-5.9 ms measured inside pipelines). None where the profile
    has no such ping-pong or the context no such link."""
    overheads_s = _ping_overheads_s(pings, context, link_class, HOP_SMALL_MESSAGES, floored=False)
    return None if overheads_s is None else float(max(0.0, np.median(overheads_s)))


def _best_terms(schedules: list[CommSchedule], measured: list[float], topology: Topology, counts: tuple[float, ...],
                reduce_s_per_byte: Mapping[int, float] | None, cores: int | None, source: str,
                default: TransportTerms, overhead_s: float | None = None, pinned: bool = False) -> TransportTerms:
    """The :class:`TransportTerms` minimising the squared log error of ``schedules`` priced over
    ``topology`` against their ``measured`` times (s): a grid over latency counts ``counts`` and
    bandwidth efficiencies, the overhead per message solved on a fine grid for each (up to
    ``overhead_s`` where given, or exactly ``overhead_s`` where ``pinned``); the rendezvous
    (``notice_latencies``, ``sender_done_on_write``) is the backend's ``default``. A
    pipeline hop is fitted and priced alike, both ends entering at once (its receiver's notice
    paid in both), so a hop costs its ping-pong."""
    log_measured = np.log(np.array(measured))
    best = None
    for count in counts:
        for efficiency in _EFFICIENCIES:
            trial = TransportTerms(0.0, count, efficiency, "", notice_latencies=min(count, default.notice_latencies),
                                   **_rendezvous(default))
            base = np.array([price(s, topology, trial, reduce_s_per_byte, cores).duration_s for s in schedules])
            probe = np.array([price(s, topology, replace(trial, per_message_s=1e-3), reduce_s_per_byte,
                                    cores).duration_s for s in schedules])
            slope = (probe - base) / 1e-3  # messages on each schedule's critical path
            overheads = _OVERHEADS_S if overhead_s is None else np.array([overhead_s]) if pinned else np.append(
                _OVERHEADS_S[_OVERHEADS_S < overhead_s], overhead_s)
            predicted = base[None, :] + overheads[:, None] * slope[None, :]
            loss = ((np.log(np.maximum(predicted, 1e-9)) - log_measured[None, :]) ** 2).sum(axis=1)
            index = int(np.argmin(loss))
            if best is None or loss[index] < best[0] - 1e-12:
                best = (float(loss[index]), float(overheads[index]), count, float(efficiency))
    loss, overhead, count, efficiency = best
    rms = float(np.sqrt(loss / len(schedules)))
    return TransportTerms(overhead, count, efficiency, f"{source}, rms log error {rms:.2f}",
                          notice_latencies=min(count, default.notice_latencies), **_rendezvous(default))


def fit_hops(rows, context: CalibrationContext) -> dict[LinkClass, TransportTerms]:
    """Per link class, the :class:`TransportTerms` of one point-to-point message (a pipeline's
    hop between stages), fitted on a profile's ``p2p`` rows of that class (half a ping-pong round
    trip, both ends otherwise idle: what a hop costs when its receiver waits for it), each priced
    as one message between two ranks of the calibrated cluster that the class joins (rebuilt from
    ``context``, :func:`context_topology`). One latency per message (a waiting receiver's ready
    notice has gone before the payload: a ping-pong pays the link's delay once; one link's delay
    could not identify a count anyway), the overhead from the smallest sizes
    (:func:`hop_overhead_s`), the bandwidth efficiency fitted over every size. Classes without
    rows, or without two ranks joined by them in ``context``, are left out."""
    from models.ops import OpKind
    from sim.collectives.schedule import Transfer
    from sim.engine import P2P

    topology = context_topology(context)
    default = default_terms("")
    fitted = {}
    for link_class, of_class in rows.groupby("device_class", sort=True):
        same_host = LinkClass(link_class) == LinkClass.INTRA_HOST
        pair = next(((a, b) for a in range(topology.num_ranks) for b in range(topology.num_ranks)
                     if a != b and topology.same_host(a, b) == same_host), None)
        of_class = of_class[of_class["size_bytes"] > 0]
        if pair is None or of_class.empty:
            continue
        schedules = [CommSchedule(OpKind.SEND, P2P, pair, None, int(n), ((Transfer(*pair, int(n), False),),))
                     for n in of_class["size_bytes"]]
        overhead_s = hop_overhead_s(of_class, context, LinkClass(link_class))
        fitted[LinkClass(link_class)] = _best_terms(
            schedules, [float(t) for t in of_class["median"]], topology, (1.0,), None, None,
            f"fitted on {context.name}'s {len(schedules)} {link_class} ping-pongs"
            + ("" if overhead_s is None else f" (overhead from the {HOP_SMALL_MESSAGES} smallest, bandwidth from all)"),
            default, overhead_s, pinned=overhead_s is not None)
    return fitted


class Transport(str, Enum):
    """A backend over a transport, as the uncalibrated defaults know them."""

    GLOO_TCP = "gloo/tcp"
    NCCL_NVLINK = "nccl/nvlink"
    NCCL_PCIE = "nccl/pcie"
    NCCL_NET = "nccl/net"  # InfiniBand or RoCE


@dataclass(frozen=True)
class TransportDefault:
    """Documented terms of a transport: (per-message overhead s, latencies per message) for the
    library's own collectives and for point-to-point schedules, a per-call cost, its source, and
    how many of a point-to-point message's latencies are the receiver's ready notice
    (:attr:`TransportTerms.notice_latencies`), whether a sender is done on writing its
    payload (:attr:`TransportTerms.sender_done_on_write`) and how much its socket takes of it
    (:attr:`TransportTerms.send_buffer_s`, :attr:`TransportTerms.send_buffer_max_bytes`)."""

    library: tuple[float, float]
    point_to_point: tuple[float, float]
    per_call_s: float
    source: str
    point_to_point_notice: float = 0.0
    sender_done_on_write: bool = False
    send_buffer_s: float = 0.0
    send_buffer_max_bytes: float = 0.0


class NcclProtocol(str, Enum):
    """NCCL's protocols (NVIDIA/nccl ``src/device/common.h`` / ``src/graph/tuning.cc``)."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


# NCCL's own latency model of its Ring algorithm (NVIDIA/nccl ``src/graph/tuning.cc``,
# ``ncclTunerConstantsDefaults``, read at commit 5067397c): ``baseLatencies`` per call, by protocol,
# and ``hwLatencies`` per ring step, by the link a step crosses (NVLINK, PCI, NET) and protocol (us).
# ``ncclTopoTuneModel`` prices a one-node Ring allreduce of p ranks at
# ``baseLat + 2 (p - 1) hwLat`` before its bytes; NCCL picks, per size, the algorithm and protocol
# of the least modelled time, which for messages of a few KiB is LL.
NCCL_RING_BASE_LATENCY_S = {NcclProtocol.LL: 6.6e-6, NcclProtocol.LL128: 14.0e-6, NcclProtocol.SIMPLE: 8.4e-6}
NCCL_RING_HOP_LATENCY_S = {
    Transport.NCCL_NVLINK: {NcclProtocol.LL: 0.6e-6, NcclProtocol.LL128: 1.9e-6, NcclProtocol.SIMPLE: 3.4e-6},
    Transport.NCCL_PCIE: {NcclProtocol.LL: 1.0e-6, NcclProtocol.LL128: 2.5e-6, NcclProtocol.SIMPLE: 5.7e-6},
    Transport.NCCL_NET: {NcclProtocol.LL: 2.7e-6, NcclProtocol.LL128: 4.0e-6, NcclProtocol.SIMPLE: 14.0e-6},
}
# The uncalibrated NCCL default is the Simple protocol's: ``baseLat`` per call and ``hwLat`` per
# message, one path latency each, NCCL's collectives and point-to-point alike. Not LL, which NCCL's
# model picks for a message of a few KiB: published nccl-tests times of 8-byte allreduces (a DGX
# A100 ring of 2 to 8 GPUs, ``validation/published/nccl_tests/rows.yaml``) lie on 5.6 us per call
# + 2.0 us per ring step, where LL has 0.6 us per NVLink step and its model falls 22-55% short
# (Simple: 50-71% over); priced by LL, a small allreduce would cost less than these defaults
# already charge, not more (``benchmarks/bench_nccl_tests.py`` writes the comparison to
# ``validation/published/nccl_tests/nccl_tests.md``).
NCCL_DEFAULT_PROTOCOL = NcclProtocol.SIMPLE


def _nccl_default(transport: Transport, name: str) -> TransportDefault:
    per_hop_s = NCCL_RING_HOP_LATENCY_S[transport][NCCL_DEFAULT_PROTOCOL]
    return TransportDefault((per_hop_s, 1.0), (per_hop_s, 1.0), NCCL_RING_BASE_LATENCY_S[NCCL_DEFAULT_PROTOCOL],
                            f"{name} default: NCCL tuning.cc Ring/{NCCL_DEFAULT_PROTOCOL.value}")


# gloo over TCP: gloo's own collectives (``library``) pay one latency per message, plus the
# receiver's ready notice for those whose messages rendezvous (:data:`RENDEZVOUS_LIBRARY_KINDS`:
# all three, :func:`default_terms`); a point-to-point isend/irecv pays the rendezvous, two (the
# module docstring). With these counts
# the overheads fitted on the six shipped profiles (``validation/report/profiles``,
# ``validation/holdout-report/profiles``: 2-core VM, torch 2.13.0, links of 0.05-5 ms) have
# medians of 0.3 ms (library) and 0.5 ms (point to point) and bandwidth efficiencies of 1.0
# (gloo's allreduce as its ring of two segments in flight, with the notice: a median of 0.29 ms).
GLOO_SEND_BUFFER_S = 0.1
"""What a TCP sender's socket takes of a payload before its bytes are through, in seconds of the
path's bottleneck rate (:attr:`TransportTerms.send_buffer_s`): Linux grows a socket's send buffer
to twice its congestion window (``tcp_sndbuf_expand``, ``net/ipv4/tcp_input.c``), and the window
fills the path's round trip and the queue before its bottleneck. Measured on the emulated
cluster (``benchmarks/bench_send_buffer.py``: one ``isend`` against its ``irecv``, 1-16 MiB),
whose tbf queues hold 50 ms (``runtime/testbed/shaping.py``): over 100 Mbit/s a send of up to
1.4 MB completes at once and a larger one 0.10-0.12 s (1.2-1.5 MB) before its receive without
added delay, 0.13-0.14 s (1.6-1.8 MB) over 5 ms of path latency."""
GLOO_SEND_BUFFER_MAX_BYTES = 2.8e6
"""The most a TCP sender's socket takes of a payload (bytes, :attr:`TransportTerms.send_buffer_max_bytes`):
measured over the emulated cluster's 1 Gbit/s links (``benchmarks/bench_send_buffer.py``: a
16 MiB send completes 22 ms before its receive), where Linux's ``tcp_wmem`` maximum, 4 MiB of
socket memory, caps the buffer."""

DEFAULTS: dict[Transport, TransportDefault] = {
    Transport.GLOO_TCP: TransportDefault((0.3e-3, 1.0), (0.5e-3, 2.0), 0.0,
                                         "gloo/tcp default: medians of the shipped profiles' fits", 1.0, True,
                                         GLOO_SEND_BUFFER_S, GLOO_SEND_BUFFER_MAX_BYTES),
    Transport.NCCL_NVLINK: _nccl_default(Transport.NCCL_NVLINK, "nccl/nvlink"),
    Transport.NCCL_PCIE: _nccl_default(Transport.NCCL_PCIE, "nccl/pcie"),
    Transport.NCCL_NET: _nccl_default(Transport.NCCL_NET, "nccl/net (InfiniBand/RoCE)"),
}


# gloo over TCP, where ranks outnumber the cores they share: the least a message costs when every
# rank is busy, per core turn of its step (:func:`step_turns`: one to enter it, one per message a
# rank sends or receives), keyed by "gloo's own collective" (else point-to-point)
# (:attr:`TransportTerms.min_message_s`), with 4 ranks on 2 cores (:data:`GLOO_CONTENTION_SHARING`).
# Fitted by :func:`sim.calibrated.contention_floor` on the shipped profiles whose links are fast
# enough for it to show (v2x2_bandwidth, v4x1_bandwidth as first measured), their mean.
# Point-to-point: 0.77 and 0.74 ms per turn in place (an exchange step of 3 turns 2.0-2.4 ms, a
# two-level tree's gather and broadcast steps of 2 turns 1.3-1.5 ms); gloo's own allreduce, reduce
# and broadcast, which wait inside one library call instead of returning to Python between
# messages: 0.35 ms per turn at full contention, where a step of gloo's ring is a round of its two
# segments in flight (:mod:`sim.collectives.gloo`), 3 turns. The default of a calibration whose
# links hid it, and of the uncalibrated model (:class:`DefaultTransportNetwork`); at another number
# of ranks per core, scaled as processor sharing scales a turn's core work
# (:func:`contention_at`).
GLOO_CONTENTION_PER_TURN_S = {False: 0.752e-3, True: 0.35e-3}
GLOO_CONTENTION_SOURCE = ("the gloo/tcp default, fitted in place on v2x2_bandwidth and v4x1_bandwidth "
                          "(4 ranks on 2 cores)")
GLOO_CONTENTION_SHARING = 2.0
"""Ranks per core at which :data:`GLOO_CONTENTION_PER_TURN_S` was measured (4 on 2)."""


def contention_at(floor_s: float, measured_sharing: float, sharing: float, library: bool) -> float:
    """A contention floor per core turn (s) measured with ``measured_sharing`` ranks per core, at
    ``sharing`` ranks per core (both > 0); 0 where the ranks do not outnumber the cores.

    Point-to-point schedules (``library`` False): scaled by the ratio, as processor sharing
    (:mod:`sim.cores`) stretches a turn's core work by the ranks per core (``floor_s /
    measured_sharing`` core-seconds a turn, what a training comm thread is charged too,
    :func:`sim.training.comm_thread.message_work_s`): each message is waited for from Python,
    the rank sleeping and waking for it. gloo's own collectives (``library``), which wait inside one
    library call: the same whatever the ranks beyond the cores. Judged in place on the emulated
    testbed, 3 ranks on 2 cores (t3x1_bandwidth, the one such calibration without delay; its
    figures are therefore not a held-out check of this law): the ring allreduce of 3 KiB (4
    exchange steps of 3 turns) 0.42 and 0.44 ms a turn in the two latest runs against 0.74-0.77 ms
    with 4 ranks (ratio 0.56-0.59; processor sharing 0.75); gloo's own allreduce 0.28-0.33 against
    0.35 ms (0.8-0.93). The first run's ring, 1.1 ms a turn (``validation/transfer-new-report``,
    read then as "the same whatever the ranks beyond the cores"), was not what its own decode
    paid: 24 such calls a token take longer than its measured TPOT
    (validation/transfer-report/progress.md, session 24)."""
    if sharing <= 1.0:
        return 0.0
    return floor_s if library else floor_s * sharing / measured_sharing


# gloo's broadcast (gloo ``gloo/broadcast.cc``) is the binomial tree it is modelled as, message for
# message, of unbound-buffer sends, which over TCP rendezvous as an isend/irecv does (gloo
# ``gloo/transport/tcp/pair.cc``, ``sendNotifyRecvReady``): it pays the receiver's ready notice too.
# Timed alone, every rank enters at once and the tree's first step waits for the notice: 3 one-way
# latencies over the 2 steps of 3 or 4 ranks (15.8 ms over 5 ms links, v4x1_latency); in a run the
# receivers posted long before the root came (it computed what it sends), so the root writes at once
# and leaves (0.3-1.4 ms in place over 3-5 ms links). Its default and fitted terms carry the notice
# (:func:`default_terms`), and a run prices it by the ranks' arrivals.
# gloo's ring allreduce and reduce (:mod:`sim.collectives.gloo`) send unbound buffers too: each
# segment's payload waits for its receiver's notice, posted when the receiver reaches that
# segment's iteration, two segments in flight; timed alone over 5 ms links that is 4(p-1) one-way
# latencies, the notice and the payload of 2(p-1) rounds.
RENDEZVOUS_LIBRARY_KINDS = frozenset({"allreduce", "broadcast", "reduce"})


def default_terms(algorithm: str, transport: Transport = Transport.GLOO_TCP, kind: str | None = None) -> TransportTerms:
    """The documented terms of ``algorithm`` over ``transport`` (:data:`DEFAULTS`), full bandwidth;
    the library's collectives of ``kind`` in :data:`RENDEZVOUS_LIBRARY_KINDS` pay a point-to-point
    message's ready notice on top of their latencies."""
    default = DEFAULTS[transport]
    overhead_s, latencies = default.library if algorithm == LIBRARY else default.point_to_point
    notice = default.point_to_point_notice if algorithm != LIBRARY or kind in RENDEZVOUS_LIBRARY_KINDS else 0.0
    if algorithm == LIBRARY:
        latencies += notice
    return TransportTerms(overhead_s, latencies, 1.0, default.source, default.per_call_s, notice_latencies=notice,
                          **_rendezvous(default))


def _rendezvous(default) -> dict:
    """The backend's terms no fit changes (:class:`TransportDefault` or :class:`TransportTerms`):
    when a sender is done."""
    return {"sender_done_on_write": default.sender_done_on_write, "send_buffer_s": default.send_buffer_s,
            "send_buffer_max_bytes": default.send_buffer_max_bytes}


def group_transport(topology: Topology, group: tuple[int, ...]) -> Transport:
    """The transport a group's messages take, by the defaults: gloo over TCP among CPUs; NCCL
    among GPUs, over the network where the group spans hosts, else NVLink on SXM parts and PCIe
    on the others (the slowest a message of the group crosses prices it)."""
    specs = [topology.devices[rank].spec for rank in group]
    if all(spec.name == "cpu" for spec in specs):
        return Transport.GLOO_TCP
    if len({topology.devices[rank].host for rank in group}) > 1:
        return Transport.NCCL_NET
    return Transport.NCCL_NVLINK if all("SXM" in spec.description for spec in specs) else Transport.NCCL_PCIE


DEFAULT_TRANSPORT_MODEL = "flow"  # the scenario network model the uncalibrated defaults refine


@dataclass
class DefaultTransportNetwork:
    """The uncalibrated network: every collective its schedule priced by the flow model with the
    documented terms of the transport its group takes (:func:`group_transport`, :data:`DEFAULTS`).

    Where the scenario's gloo ranks outnumber the cores they share (``cores``, ``ranks``), their
    messages pay what calibrated transfer charges them (:func:`sim.calibrated.calibrated_network`):
    a message's software overhead stretches by its step's busy ranks over the cores
    (:meth:`_TransportLinks.stretch`), and no message costs less than the gloo/tcp contention
    floor, :data:`GLOO_CONTENTION_PER_TURN_S`, per core turn of a step whose busy ranks
    outnumber the cores (:meth:`_TransportLinks.floor_s`).

    Args:
        topology: the scenario's cluster.
        reduce_s_per_byte: gamma of every rank (s/byte).
        cores: the cores the gloo ranks share (None: cores of their own).
        ranks: how many gloo ranks share them, every replica's.
        copies: the replicas that run each priced group's steps at once on them
            (:meth:`_TransportLinks.floor_s`).
    """

    topology: Topology
    reduce_s_per_byte: Mapping[int, float] | None = None
    cores: int | None = None
    ranks: int = 0
    copies: int = 1
    used: set[str] = field(default_factory=set)
    _networks: dict[Transport, TransportNetwork] = field(default_factory=dict, repr=False)

    prices_by_call = False  # ``call`` is ignored: a schedule costs the same wherever called

    def time(self, schedule: CommSchedule, call: str | None = None,
             arrivals: Mapping[int, float] | None = None) -> CollectiveTiming:
        """The timing of ``schedule``, see :meth:`TransportNetwork.time` (``call`` is ignored)."""
        return self._network(schedule, note=True).time(schedule, arrivals=arrivals)

    def arrival_horizon_s(self, group: tuple[int, ...]) -> float:
        """See :meth:`TransportNetwork.arrival_horizon_s`: the notice of the group's transport."""
        transport = group_transport(self.topology, tuple(group))
        if not DEFAULTS[transport].point_to_point_notice:
            return 0.0
        return self._of(transport).arrival_horizon_s(tuple(group))

    def lower_bound_s(self, schedule: CommSchedule) -> float:
        """A duration :meth:`time` cannot beat (s), see :meth:`TransportNetwork.lower_bound_s`."""
        return self._network(schedule, note=False).lower_bound_s(schedule)

    @property
    def contended(self) -> bool:
        """Whether the gloo ranks outnumber the cores they share."""
        return self.cores is not None and self.ranks > self.cores

    def contention_floor_s(self, algorithm: str) -> float:
        """The least a gloo message of ``algorithm`` costs per core turn of its step with every
        rank busy (s): the gloo/tcp default (:data:`GLOO_CONTENTION_PER_TURN_S`) at the ranks per
        core (:func:`contention_at`); 0 where the ranks have cores enough."""
        if not self.contended:
            return 0.0
        return contention_at(GLOO_CONTENTION_PER_TURN_S[algorithm == LIBRARY], GLOO_CONTENTION_SHARING,
                             self.ranks / self.cores, algorithm == LIBRARY)

    def contention_lines(self) -> tuple[str, ...]:
        """What the contention terms are and whence, one line each; none without contention."""
        if not self.contended:
            return ()
        return tuple(f"core contention per core turn ({family}): at least "
                     f"{self.contention_floor_s(LIBRARY if library else '') * 1e3:.2f} ms with every rank busy "
                     f"({self.ranks} gloo ranks{of_replicas(self.copies)} on {self.cores} cores; "
                     f"{GLOO_CONTENTION_SOURCE})"
                     for family, library in (("point-to-point", False), ("gloo's own collectives", True)))

    def _of(self, transport: Transport) -> TransportNetwork:
        network = self._networks.get(transport)
        if network is None:
            contended = transport == Transport.GLOO_TCP and self.contended
            network = self._networks[transport] = TransportNetwork(
                self.topology, self.reduce_s_per_byte, {}, self._terms("", transport, None),
                cores=self.cores if contended else None, copies=self.copies)
        return network

    def _terms(self, algorithm: str, transport: Transport, kind: str | None) -> TransportTerms:
        terms = default_terms(algorithm, transport, kind)
        if transport != Transport.GLOO_TCP or not self.contended:
            return terms
        return replace(terms, min_message_s=self.contention_floor_s(algorithm))

    def _network(self, schedule: CommSchedule, note: bool) -> TransportNetwork:
        transport = group_transport(self.topology, tuple(schedule.group))
        network = self._of(transport)
        key = (str(schedule.kind), schedule.algorithm)
        if key not in network.terms:
            network.terms[key] = self._terms(schedule.algorithm, transport, str(schedule.kind))
        if note:
            self.used.add(f"{schedule.kind} {schedule.algorithm} over {transport.value}: "
                          f"{network.terms[key].describe()}")
        return network


def fit_profile(rows, context: CalibrationContext,
                reduce_s_per_byte: Mapping[int, float] | None = None, pings=None) -> dict[tuple[str, str], TransportTerms]:
    """:func:`fit_terms` over the cluster ``context`` describes, each implementation's latency
    count and ready notice defaulting to :func:`default_terms`'s; ``pings``: the profile's ``p2p``
    rows, whose overhead (:func:`message_overhead_s`) bounds the overhead over delayed links.
    Where the calibrated group spans hosts, its rows timed over one host's ranks (``num_hosts``
    1: :func:`fit_intra_host`'s) are left out."""
    topology = context_topology(context)
    overhead_s = None if pings is None else message_overhead_s(pings, context)
    if len(context.ranks_per_host) > 1:  # the sweep over one host's group prices groups inside a host
        rows = rows[rows["num_hosts"] != 1]
    fitted = {}
    for (kind, algorithm), of_kind in rows.groupby(["op", "algorithm"], sort=True):
        fitted.update(fit_terms(of_kind, topology, default_terms(str(algorithm), kind=str(kind)), context.name,
                                reduce_s_per_byte, context.cores, overhead_s))
    return fitted


def fit_intra_host(rows, pings, context: CalibrationContext, fitted: Mapping[tuple[str, str], TransportTerms],
                   reduce_s_per_byte: Mapping[int, float] | None = None) -> dict[tuple[str, str], TransportTerms]:
    """Per (kind, algorithm), the terms of a collective whose group lies inside one host, priced
    from what the profile measured inside a host, never from calls that crossed the hosts' link
    (issues 18, 20): over 5 ms between hosts every call of the spanning sweep is its delays, and
    the per-message overhead its fit leaves (0-0.1 ms on v2x2_latency, against the 0.33 ms its
    own intra-host ping-pongs show) priced a TP-2 pair inside a host at half its measured TPOT.

    * Where the profile holds the collective sweep over one host's ranks (``collective`` rows of
      ``num_hosts`` 1 in a context spanning hosts: ``hetsim calibrate``'s
      :class:`runtime.comm_timing.CollectiveSweep` over the first host's ranks), :func:`fit_terms`
      on those, priced over the calibrated first host's ranks and cores (the other ranks sleep
      meanwhile).
    * Else each of ``fitted`` (the spanning sweep's terms) whose per-message overhead is below
      the intra-host ping-pongs' (:func:`message_overhead_s` over :attr:`LinkClass.INTRA_HOST`:
      LogP's ``o`` of a message between two ranks of one host, Culler et al., PPoPP 1993), with
      that overhead; its latency count, notice and bandwidth efficiency kept. A gloo message
      between two ranks of one host is a TCP send over the pair the ping-pong timed, so it costs
      at least that; a spanning fit below it left the overhead to the link's delays (not
      identified, module docstring), one at or above it was identified by its calls and still
      prices the group. Of three rules judged on the offline layouts sets (this floor; the
      ping-pongs' overhead always; only where a calibrated link is delayed), the one that made
      no case worse (``validation/layouts-report/progress.md``): chosen on those sets.

    Empty where the calibrated group lies in one host (its sweep is intra-host already) or the
    profile has neither; then a group inside a host takes the spanning terms.

    Args:
        rows: the profile's ``collective`` rows of ``context``'s cluster.
        pings: its ``p2p`` rows.
        fitted: :func:`fit_profile`'s terms of the same cluster.
        reduce_s_per_byte: gamma of the calibrated ranks (s/byte).
    """
    if len(context.ranks_per_host) <= 1 or context.ranks_per_host[0] < 2:
        return {}
    one_host = rows[(rows["num_hosts"] == 1) & (rows["group_size"] <= context.ranks_per_host[0])]
    terms: dict[tuple[str, str], TransportTerms] = {}
    if not one_host.empty:
        topology = context_topology(context)
        for (kind, algorithm), of_kind in one_host.groupby(["op", "algorithm"], sort=True):
            terms.update(fit_terms(of_kind, topology, default_terms(str(algorithm), kind=str(kind)),
                                   f"{context.name} (one host's ranks)", reduce_s_per_byte, context.cores))
    overhead_s = None if pings is None else message_overhead_s(pings, context, LinkClass.INTRA_HOST)
    if overhead_s is not None:
        for key, spanning in fitted.items():
            if key not in terms and spanning.per_message_s < overhead_s:
                terms[key] = replace(spanning, per_message_s=overhead_s, undelayed_per_message_s=None, source=(
                    f"overhead at least {context.name}'s intra-host ping-pongs'; latencies and bandwidth as "
                    "fitted on its sweep over the hosts"))
    return terms
