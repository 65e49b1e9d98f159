"""Ranks competing for a machine's CPU cores: a resource of the simulated segment, shared or in turns.

Where more ranks run on a machine than it has cores (the emulated cluster: every emulated host's
ranks, and the delay forwarder that carries their packets, on one 2-core virtual machine), a rank
computes only while the scheduler gives it a core. Linux's fair scheduler shares the cores among
the runnable tasks in equal slices, which over a compute op of many slices is processor sharing:
with ``k`` runnable tasks on ``c`` cores each runs at ``min(1, c / k)`` of a core (Kleinrock,
"Queueing Systems", vol. 2, 1976, section 4.4; the kernel's CFS, ``kernel/sched/fair.c``, aims
at exactly this "ideal multi-tasking CPU"). A rank that waits in a collective sleeps and
leaves its core to the others, so a compute op's time depends on what the other ranks do at that
moment, which a constant factor on every op cannot say: the master's embedding and LM head, run
while the other ranks wait for it, get a whole core.

Processor sharing is the fluid limit. Over ops shorter than the scheduler's turn the kernel does
something else (:class:`TakingTurns`, :data:`SCHEDULING` :attr:`CoreScheduling.TURNS`): a core
runs one task until it blocks or until the first scheduler tick after its slice is used up, and
a task that wakes while every core is taken waits for one. Ranks doing equal work then finish
apart (two run, two wait) and a rank woken by a collective's end waits for a core: arrival skew
that processor sharing, whose ranks finish together, cannot produce.

:class:`CorePool` names the ranks sharing some cores and the share other processes take
(``background_cores``: the delay forwarder, measured at 30-37% of a core while a 4-rank decode
runs, :mod:`runtime.testbed.cluster`); :class:`ProcessorSharing` is one pool's server inside a
segment's simpy environment. The engine (:mod:`sim.engine`) runs a segment's compute ops
through it only where some pool's ranks in the segment outnumber its cores: everywhere else
nothing changes, bit for bit.

A machine's ranks share its memory bandwidth too (:attr:`CorePool.stream_bytes_per_s`, the
aggregate bytes/s k one-thread processes streaming at once achieve, measured by a calibration:
:mod:`runtime.stream_bandwidth`). On the 2-vCPU testbed, quiet, one process streamed 23.7 GB/s,
two 33.7, four 40.6 (``benchmarks/bench_machine_sharing.py``): two processes streaming on the
two cores each took 1.40 times as long. An op's time alone holds a memory part, its traffic at
the lone process's bandwidth (at most its whole time); with ``k`` ranks computing at once that
part stretches to the per-stream share ``B(k) / k`` and the rest of the op does not, and the op
takes the longer of that and its core share's time (:meth:`ProcessorSharing.run`). The memory
transfer adds to the core's other work rather than hiding under it, as in the ECM model of a
core's time (Hager, Treibig, Habich and Wellein, Concurrency Computat.: Pract. Exper. 28(2),
2016, arXiv 1208.2908: T = max(T_OL, T_nOL + T_data); all non-memory time taken here as
non-overlapping). Judged on the quiet bench's ``decode`` pass (GPT-2's weights, k = 2): +10%
(32.1 ms measured, 35.4 modelled; overlapping the parts, the larger of the two, -8%), and on
the plan check's replicas, a prediction: two one-rank replicas of batch 2 TPOT -20.5% -> -9.1%
(overlapping the parts left them at -20.5%: a batch-2 decode op takes twice its traffic's time
alone). Pools without a bandwidth: cores only, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

import numpy as np
import simpy

# A job whose remaining work at its rate is below this share of the clock is done (float rounding).
_DONE_REL = 1e-12


class CoreScheduling(StrEnum):
    """How a pool's ranks share its cores in the simulation: the fluid limit
    (:class:`ProcessorSharing`) or in turns (:class:`TakingTurns`)."""

    PROCESSOR_SHARING = "processor_sharing"
    TURNS = "turns"


SCHEDULING = CoreScheduling.PROCESSOR_SHARING
"""The engine's core scheduling (:func:`core_server`); benchmarks switch it (``--core-turns``)."""

TICK_S = 1 / 250
"""The scheduler tick of the emulated hosts' kernel, CONFIG_HZ=250 (s): the fair scheduler checks
whether the running task used up its slice only at a tick (``kernel/sched/fair.c``,
``entity_tick`` -> ``update_curr`` -> ``resched_curr``; ``HRTICK``, the exact-slice timer, is off
by default, ``kernel/sched/features.h``)."""

SLICE_S = 0.75e-3 * (1 + math.floor(math.log2(2)))
"""A task's slice on the emulated 2-core machine (s): EEVDF's base slice, 0.75 ms normalised,
scaled by ``1 + ilog2(min(cpus, 8))`` (``sysctl_sched_base_slice`` and
``get_update_sysctl_factor``, ``kernel/sched/fair.c``, the default ``SCHED_TUNABLESCALING_LOG``):
1.5 ms; the kernel's default, not calibrated."""


ARRIVAL_LAGS_PRICED = True
"""Whether the engine adds a pool's prefill arrival lags (:attr:`CorePool.lag_per_block`: the expected
lead of :mod:`sim.arrival_skew`, :mod:`sim.engine`); on by default, with the links' token buckets
(:data:`sim.token_bucket.PRICED`, whose comment has the figures that switched both on): without the
buckets the prefill's calls are priced 17-18% of TTFT too slow and hide the missing wait. The
offline benchmarks clear it (``--no-arrival-lags``); sections "branch bucketttft" and "branch
skewmean" of ``validation/transfer-report/progress.md`` derive it. Here rather than in
:mod:`sim.arrival_skew`, which imports this module, so that :meth:`CorePool.describe` reads it."""

@dataclass(frozen=True)
class CorePool:
    """Ranks sharing ``cores`` CPU cores, of which other processes take ``background_cores``.

    Attributes:
        ranks: the ranks on the machine.
        cores: its cores (> 0).
        background_cores: cores' worth of time other processes take while the ranks run (>= 0,
            less than ``cores``).
        stream_bytes_per_s: the machine's aggregate memory bandwidth as (one-thread processes
            streaming at once, bytes/s) pairs, counts rising from 1, bandwidths > 0; empty: not
            known, not shared.
        stands_for: machine ranks each of ``ranks`` stands for (>= 1; identical replicas
            simulated once, :func:`core_shares`): ``n`` of them streaming are ``n x stands_for``
            streams on the machine.
        lag_per_block: the machine's coefficient of the ranks' arrival lags at a collective
            (>= 0, :mod:`sim.arrival_skew`: fitted on its calibration's prefill waits; 0: the
            ranks arrive as processor sharing runs them).

    Raises:
        ValueError: a pool without cores or ranks, whose background takes every core, with
            bandwidth pairs not as described, ``stands_for`` < 1 or ``lag_per_block`` < 0.
    """

    ranks: frozenset[int]
    cores: float
    background_cores: float = 0.0
    stream_bytes_per_s: tuple[tuple[int, float], ...] = ()
    stands_for: float = 1.0
    lag_per_block: float = 0.0

    def __post_init__(self) -> None:
        if not self.ranks or not self.cores > 0 or not 0 <= self.background_cores < self.cores:
            raise ValueError(f"a core pool needs ranks, cores > 0 and 0 <= background < cores (got {len(self.ranks)} "
                             f"ranks, {self.cores} cores, {self.background_cores} background)")
        counts = [k for k, _ in self.stream_bytes_per_s]
        if (not all(b > 0 for _, b in self.stream_bytes_per_s) or not self.stands_for >= 1
                or not self.lag_per_block >= 0
                or (counts and (counts[0] != 1 or any(b <= a for a, b in zip(counts, counts[1:]))))):
            raise ValueError(f"a core pool needs bandwidths > 0, stands_for >= 1 and lag_per_block >= 0 (got "
                             f"{self.stream_bytes_per_s} bytes/s, stands_for {self.stands_for}, lag_per_block "
                             f"{self.lag_per_block})")

    @property
    def free_cores(self) -> float:
        """The cores left to the ranks."""
        return self.cores - self.background_cores

    def oversubscribed(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` (the ranks of a segment) put more runnable ranks on the pool than
        it has free cores."""
        return len(self.ranks.intersection(ranks)) > self.free_cores

    def contended(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` (the ranks of a segment) contend on the pool: they outnumber its free
        cores, or more than one stream shares its known memory bandwidth."""
        return self.oversubscribed(ranks) or (
            bool(self.stream_bytes_per_s) and len(self.ranks.intersection(ranks)) * self.stands_for > 1)

    def memory_share(self, streaming: int) -> float:
        """Each stream's bandwidth with ``streaming`` of the pool's ranks computing at once, over a
        lone stream's (<= 1; 1 without a known bandwidth): ``B(n) / (n B(1))`` for the ``n =
        streaming x stands_for`` streams on the machine, ``B`` linear between the measured counts
        and the last measured beyond them (saturated)."""
        curve = self.stream_bytes_per_s
        streams = streaming * self.stands_for
        if not curve or streams <= 1:
            return 1.0
        aggregate = float(np.interp(streams, [k for k, _ in curve], [b for _, b in curve]))
        return min(1.0, aggregate / (streams * curve[0][1]))

    def factor(self, runnable: int) -> float:
        """How much longer an op takes with ``runnable`` ranks computing at once: ``max(1, k / c)``."""
        return max(1.0, runnable / self.free_cores)

    def describe(self) -> str:
        """The pool in a few words: its ranks and cores, the share others take, its memory
        bandwidth, and its arrival lag coefficient where the engine prices it
        (:data:`ARRIVAL_LAGS_PRICED`; a coefficient it does not add is not named)."""
        background = f", {self.background_cores:g} taken by other processes" if self.background_cores else ""
        memory = "" if not self.stream_bytes_per_s else (
            ", memory " + ", ".join(f"{b / 1e9:.3g} GB/s at {k}" for k, b in self.stream_bytes_per_s) + " streams")
        lag = (f", prefill arrival lags {self.lag_per_block:.2f} (sim.arrival_skew)"
               if self.lag_per_block and ARRIVAL_LAGS_PRICED else "")
        return f"{len(self.ranks)} ranks on {self.cores:g} cores{background}{memory}{lag}"


class SharedProgress:
    """Jobs that progress at once, each at a rate set by the jobs running beside it, recomputed
    at every arrival and departure: the mechanism of processor sharing (Kleinrock 1976, vol. 2,
    section 4.4) with the rates left to a subclass (:meth:`_set_rates`). Used by
    :class:`ProcessorSharing` (a pool's compute ops) and by the pipeline's schedule
    (:mod:`sim.pipeline_run`: whole stage passes on one machine).

    Each job is ``[amount left, done event, rate (amount per second), payload]``; a job is done
    once its amount left at its rate is below :data:`_DONE_REL` of the clock (float rounding).

    Args:
        env: the environment the jobs run in.
    """

    def __init__(self, env: simpy.Environment):
        self.env = env
        self._jobs: dict[int, list] = {}
        self._updated_s = 0.0
        self._generation = 0
        self._next_job = 0

    def _start(self, amount: float, payload) -> simpy.Event:
        """An event that succeeds once ``amount`` (> 0) of the job's work is done, started now."""
        done = self.env.event()
        self._advance()
        self._jobs[self._next_job] = [float(amount), done, 1.0, payload]
        self._next_job += 1
        self._reshare()
        return done

    def _set_rates(self) -> None:
        """Set every running job's rate (its ``[2]``) for the jobs running now."""
        raise NotImplementedError

    def _advance(self) -> None:
        elapsed = self.env.now - self._updated_s
        if elapsed:
            for job in self._jobs.values():
                job[0] -= job[2] * elapsed
        self._updated_s = self.env.now

    def _reshare(self) -> None:
        self._generation += 1
        if not self._jobs:
            return
        self._set_rates()
        wait = min(max(job[0], 0.0) / job[2] for job in self._jobs.values())
        self.env.timeout(wait).callbacks.append(partial(self._wake, self._generation))

    def _wake(self, generation: int, _event: simpy.Event) -> None:
        if generation != self._generation:
            return  # a job arrived or left meanwhile and rescheduled
        self._advance()
        done_s = _DONE_REL * max(1.0, self.env.now)
        finished = [j for j, job in self._jobs.items() if job[0] / job[2] <= done_s]
        events = [self._jobs.pop(j)[1] for j in finished]
        self._reshare()
        for event in events:
            event.succeed()


class ProcessorSharing(SharedProgress):
    """One :class:`CorePool` inside a segment's environment: its jobs (compute ops, in seconds of
    one whole core) share the free cores equally, rates recomputed at each arrival and departure;
    where the pool knows its memory bandwidth, a job's rate is also bounded by its memory part at
    the per-stream share (:meth:`run`).

    Args:
        env: the segment's environment.
        pool: the pool.
    """

    def __init__(self, env: simpy.Environment, pool: CorePool):
        super().__init__(env)
        self.pool = pool

    def run(self, work_s: float, rank: int = 0, memory_s: float = 0.0) -> simpy.Event:
        """An event that succeeds once ``work_s`` seconds of one core's work, started now, are done
        (``rank``: whose work, which sharing ignores). ``memory_s``: the part of ``work_s`` that
        streams memory alone (s, capped at ``work_s``): while ``k`` jobs run, the job progresses at
        the lower of its core share and the rate at which its memory part stretches to the
        stream's share (:meth:`CorePool.memory_share`) and the rest does not, so at constant ``k``
        it takes ``max(work_s x factor(k), work_s - memory_s + memory_s / memory_share(k))``."""
        if work_s <= 0:
            done = self.env.event()
            done.succeed()
            return done
        return self._start(work_s, min(1.0, max(0.0, memory_s) / work_s))

    def wait_for_core(self, work_s: float, rank: int = 0) -> simpy.Event:
        """A thread waking to be scheduled (a comm thread handling its messages,
        :mod:`sim.training.comm_thread`): done at once where the pool's jobs leave a core free,
        else a job of ``work_s`` core-seconds sharing the cores with them, as :meth:`run`."""
        if len(self._jobs) < self.pool.free_cores:
            done = self.env.event()
            done.succeed()
            return done
        return self.run(work_s, rank)

    def _set_rates(self) -> None:
        rate = 1.0 / self.pool.factor(len(self._jobs))
        memory = self.pool.memory_share(len(self._jobs))
        for job in self._jobs.values():
            # the payload: the job's memory part over its work; stretched to the stream's share, the rest as alone
            job[2] = rate if not job[3] or memory >= 1.0 else min(rate, 1.0 / ((1.0 - job[3]) + job[3] / memory))


# simpy runs an instant's events by priority (URGENT 0, NORMAL 1), then by when they were
# scheduled: an event of priority 2 runs once everything else of its instant has, so a turn is
# given out after every rank that wakes or finishes at that instant has said so.
_END_OF_INSTANT = 2


class TakingTurns:
    """One :class:`CorePool` inside a segment's environment, its ranks running in turns.

    ``ceil(free cores)`` ranks run at once, each at ``min(1, free cores / running)`` of a core
    (the other processes' share spread over them, as :class:`ProcessorSharing` spreads it); the
    others wait in line. A running rank keeps its core while it computes, op after op, until it
    blocks (its op ends and it starts no other at that instant: a collective, a load, its
    program's end) or, while some rank waits, until the first tick (:data:`TICK_S`, from the
    segment's start) after it has run a slice (:data:`SLICE_S`) in this turn: then it goes to the
    back of the line. A rank that wakes while every core is taken waits for one (EEVDF may let a
    woken task preempt a running one at once, ``check_preempt_wakeup_fair``; waiting is the
    bound that makes the woken rank arrive late, which is what this model is for). The line is
    kept in order of waiting since; ranks that join it at the same instant by the core time they
    have had (the fair scheduler runs the task owed the most first: its vruntime, ``kernel/sched/fair.c``),
    then by rank id, so a run is deterministic (which of equals the kernel picks no measurement
    here tells).

    Args:
        env: the segment's environment.
        pool: the pool.
        tick_s: the scheduler tick (s, > 0).
        slice_s: a rank's slice (s, >= 0).
    """

    def __init__(self, env: simpy.Environment, pool: CorePool, tick_s: float = TICK_S, slice_s: float = SLICE_S):
        self.env = env
        self.pool = pool
        self.tick_s = tick_s
        self.slice_s = slice_s
        self.slots = math.ceil(pool.free_cores)
        self._running: dict[int, list] = {}  # job id -> [rank, remaining core-s, done, turn start s]
        self._waiting: list[tuple[float, float, int, int]] = []  # (waiting since s, core-s had, rank, job id)
        self._had: dict[int, float] = {}  # rank -> core-seconds it has had (the kernel's vruntime)
        self._jobs: dict[int, list] = {}  # job id -> [rank, remaining core-s, done, turn start s or None]
        self._held: dict[int, float] = {}  # rank whose op just ended -> its turn's start, until the instant ends
        self._rate = 1.0
        self._updated_s = 0.0
        self._generation = 0
        self._next_job = 0
        self._dispatching = False

    def run(self, work_s: float, rank: int = 0, memory_s: float = 0.0) -> simpy.Event:
        """An event that succeeds once ``rank`` has had ``work_s`` seconds of a core's work,
        started now: at once on a core it holds from its previous op, else after its wait.
        ``memory_s`` is ignored: turns share the cores only (the memory bandwidth's sharing,
        :meth:`ProcessorSharing.run`, is not modelled in turns)."""
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        self._advance()
        job = self._next_job
        self._next_job += 1
        if rank in self._held:  # it goes on computing on the core it has
            self._jobs[job] = [rank, float(work_s), done, self._held.pop(rank)]
            self._running[job] = self._jobs[job]
        else:
            self._jobs[job] = [rank, float(work_s), done, None]
            self._waiting.append((self.env.now, self._had.get(rank, 0.0), rank, job))
            self._end_of_instant()
        self._reschedule()
        return done

    def wait_for_core(self, work_s: float, rank: int = 0) -> simpy.Event:
        """A thread waking to be scheduled (a comm thread, :mod:`sim.training.comm_thread`): done
        at once where a core is free, else ``work_s`` core-seconds in line as :meth:`run`."""
        if len(self._running) + len(self._held) < self.slots and not self._waiting:
            done = self.env.event()
            done.succeed()
            return done
        return self.run(work_s, rank)

    def _end_of_instant(self) -> None:
        if not self._dispatching:
            self._dispatching = True
            event = simpy.Event(self.env)
            event._ok, event._value = True, None
            event.callbacks.append(self._dispatch)
            self.env.schedule(event, _END_OF_INSTANT)

    def _dispatch(self, _event: simpy.Event) -> None:
        """The instant's end: cores held by ranks that started nothing are free; the line's head
        takes each free core."""
        self._dispatching = False
        self._advance()
        self._held.clear()
        self._waiting.sort()
        while self._waiting and len(self._running) < self.slots:
            *_, job = self._waiting.pop(0)
            self._jobs[job][3] = self.env.now
            self._running[job] = self._jobs[job]
        self._reschedule()

    def _advance(self) -> None:
        elapsed = self.env.now - self._updated_s
        if elapsed:
            for job in self._running.values():
                job[1] -= self._rate * elapsed
                self._had[job[0]] = self._had.get(job[0], 0.0) + self._rate * elapsed
        self._updated_s = self.env.now

    def _preempt_s(self, turn_start_s: float) -> float:
        """When a turn started at ``turn_start_s`` ends while some rank waits: the first tick
        after its slice, and not before now (a rank running alone past its slice is sent back at
        the tick after someone comes to wait)."""
        tick_s = math.ceil(max(turn_start_s + self.slice_s, self.env.now) / self.tick_s * (1 - _DONE_REL)) * self.tick_s
        return tick_s if tick_s > turn_start_s else tick_s + self.tick_s  # a turn that starts on a tick lasts to the next

    def _reschedule(self) -> None:
        self._generation += 1
        if not self._running:
            return
        self._rate = min(1.0, self.pool.free_cores / len(self._running))
        wake_s = self.env.now + min(max(job[1], 0.0) for job in self._running.values()) / self._rate
        if self._waiting:
            wake_s = min(wake_s, min(self._preempt_s(job[3]) for job in self._running.values()))
        self.env.timeout(max(0.0, wake_s - self.env.now)).callbacks.append(partial(self._wake, self._generation))

    def _wake(self, generation: int, _event: simpy.Event) -> None:
        if generation != self._generation:
            return  # a job arrived or left meanwhile and rescheduled
        self._advance()
        done_s = _DONE_REL * max(1.0, self.env.now)
        finished = [j for j, job in self._running.items() if job[1] / self._rate <= done_s]
        events = []
        for j in finished:
            rank, _, done, turn_start_s = self._jobs.pop(j)
            del self._running[j]
            self._held[rank] = turn_start_s
            events.append(done)
        if self._waiting:
            for j, job in list(self._running.items()):
                if self._preempt_s(job[3]) <= self.env.now * (1 + _DONE_REL):
                    del self._running[j]
                    job[3] = None
                    self._waiting.append((self.env.now, self._had.get(job[0], 0.0), job[0], j))
        if finished or len(self._running) < self.slots:
            self._end_of_instant()
        self._reschedule()
        for event in events:
            event.succeed()


def core_server(env: simpy.Environment, pool: CorePool,
                scheduling: CoreScheduling | None = None) -> ProcessorSharing | TakingTurns:
    """``pool``'s server in ``env`` under ``scheduling`` (default :data:`SCHEDULING`)."""
    if (scheduling or SCHEDULING) is CoreScheduling.TURNS:
        return TakingTurns(env, pool)
    return ProcessorSharing(env, pool)


def core_shares(pool: CorePool, simulated: frozenset[int]) -> tuple[CorePool, ...]:
    """The pool the ``simulated`` ranks run on when they stand for all of ``pool``'s ranks
    (identical replicas simulated once): their share of its cores, so that each computes at the
    rate each of all the ranks would, and each streams memory for all the ranks it stands for
    (:attr:`CorePool.stands_for`). The pool itself where every rank is simulated; none where
    no simulated rank is on it."""
    mine = pool.ranks & simulated
    if not mine:
        return ()
    if mine == pool.ranks:
        return (pool,)
    share = len(mine) / len(pool.ranks)
    # each simulated rank streams for the ranks it stands for (a pool without a bandwidth: no stream counted)
    stands_for = pool.stands_for / share if pool.stream_bytes_per_s else pool.stands_for
    return (CorePool(frozenset(mine), pool.cores * share, pool.background_cores * share, pool.stream_bytes_per_s,
                     stands_for, pool.lag_per_block),)
