"""Ranks competing for a machine's CPU cores: a processor-sharing resource of the simulated segment.

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

:class:`CorePool` names the ranks sharing some cores and the share other processes take
(``background_cores``: the delay forwarder, measured at 30-37% of a core while a 4-rank decode
runs, :mod:`runtime.testbed.cluster`); :class:`ProcessorSharing` is one pool's server inside a
segment's simpy environment. The engine (:mod:`sim.engine`) runs a segment's compute ops
through it only where some pool's ranks in the segment outnumber its cores: everywhere else
nothing changes, bit for bit.

Processor sharing is the limit of slices much shorter than the work. The kernel's slices are not
(EEVDF, Linux 6.6 and later, ``kernel/sched/fair.c``: ``sysctl_sched_base_slice`` = 0.75 ms times
``1 + ilog2(min(cpus, 8))``, ``update_sysctl``/``get_update_sysctl_factor``: 1.5 ms on 2 cores), and
a decode step's compute between two collectives is shorter than one (GPT-2 on this machine: about
1 ms a block). With 4 ranks on 2 cores the first two ranks runnable compute a block whole while
the others wait for a core, and the master, first to arrive at the next collective, waits there
for them: measured, the master's wait per decode collective is about one block's compute
(``collective_wait`` rows of validation/report's profiles: 1.2-1.6 ms at 3 KiB, against 1.1 ms of
compute a block), and 4 single-threaded processes doing 0.67 ms matmuls on this VM see a median
op time unchanged from alone: contention arrives as whole preemptions, not as slowed ops. A pool
with ``slice_s`` > 0 runs :class:`TimeSlicing`, round robin in those slices: a rank given a core
keeps it for its consecutive ops until its slice ends and another waits, then waits at the back
of the queue. :func:`work_s` reads a calibrated op's work from its time in place under either.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import simpy
from simpy.events import NORMAL

# A job whose remaining work at its rate is below this share of the clock is done (float rounding).
_DONE_REL = 1e-12


@dataclass(frozen=True)
class CorePool:
    """Ranks sharing ``cores`` CPU cores, of which other processes take ``background_cores``.

    Attributes:
        ranks: the ranks on the machine.
        cores: its cores (> 0).
        background_cores: cores' worth of time other processes take while the ranks run (>= 0,
            less than ``cores``).
        slice_s: the scheduler's time slice (s, >= 0): 0 shares the cores as a fluid
            (:class:`ProcessorSharing`), more hands them out in whole slices (:class:`TimeSlicing`).

    Raises:
        ValueError: a pool without cores or ranks, or whose background takes every core.
    """

    ranks: frozenset[int]
    cores: float
    background_cores: float = 0.0
    slice_s: float = 0.0

    def __post_init__(self) -> None:
        if (not self.ranks or not self.cores > 0 or not 0 <= self.background_cores < self.cores
                or not self.slice_s >= 0):
            raise ValueError(f"a core pool needs ranks, cores > 0, 0 <= background < cores and a slice >= 0 (got "
                             f"{len(self.ranks)} ranks, {self.cores} cores, {self.background_cores} background, "
                             f"slice {self.slice_s} s)")

    @property
    def free_cores(self) -> float:
        """The cores left to the ranks."""
        return self.cores - self.background_cores

    def oversubscribed(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` (the ranks of a segment) put more runnable ranks on the pool than
        it has free cores."""
        return len(self.ranks.intersection(ranks)) > self.free_cores

    def factor(self, runnable: int) -> float:
        """How much longer an op takes with ``runnable`` ranks computing at once: ``max(1, k / c)``."""
        return max(1.0, runnable / self.free_cores)

    def describe(self) -> str:
        background = f", {self.background_cores:g} taken by other processes" if self.background_cores else ""
        slices = f", in {self.slice_s * 1e3:g} ms slices" if self.slice_s else ""
        return f"{len(self.ranks)} ranks on {self.cores:g} cores{background}{slices}"


BASE_SLICE_S = 0.75e-3  # kernel/sched/fair.c: sysctl_sched_base_slice (normalized, before scaling)
SLICE_SCALING_CPUS = 8  # get_update_sysctl_factor: the scaling stops at 8 CPUs


def scheduler_slice_s(cores: int) -> float:
    """The Linux scheduler's time slice on a machine of ``cores`` CPUs (s): EEVDF's base slice,
    0.75 ms, times ``1 + ilog2(min(cores, 8))`` (the default logarithmic tunable scaling,
    ``kernel/sched/fair.c``: ``update_sysctl``, ``get_update_sysctl_factor``): 1.5 ms on 2 cores."""
    return BASE_SLICE_S * (1 + int(math.log2(max(1, min(cores, SLICE_SCALING_CPUS)))))


def work_s(in_place_s: float, scale: float, slice_s: float = 0.0) -> float:
    """An op's work on a core of its own (s) from its time ``in_place_s`` (s) timed while the
    ranks shared cores, ``scale`` being cores over ranks computing at once (<= 1).

    Processor sharing (``slice_s`` 0) stretched the whole op: ``in_place_s x scale``. In slices of
    ``slice_s``, an op no longer than a slice runs whole once its rank has a core (the wait for
    the core is the previous collective's or the master's wait, not the op's), so its (median)
    time is its work; a longer one is preempted at the end of each slice, its time beyond the
    first slice stretched as processor sharing stretches it. See the module docstring."""
    if not slice_s or scale >= 1.0:
        return in_place_s * scale
    return in_place_s if in_place_s <= slice_s else slice_s + (in_place_s - slice_s) * scale


def core_server(env: simpy.Environment, pool: CorePool):
    """The server of ``pool`` in ``env``: :class:`TimeSlicing` where it has a slice, else
    :class:`ProcessorSharing`."""
    return TimeSlicing(env, pool) if pool.slice_s else ProcessorSharing(env, pool)


class ProcessorSharing:
    """One :class:`CorePool` inside a segment's environment: its jobs (compute ops, in seconds of
    one whole core) share the free cores equally, rates recomputed at each arrival and departure.

    Args:
        env: the segment's environment.
        pool: the pool.
    """

    def __init__(self, env: simpy.Environment, pool: CorePool):
        self.env = env
        self.pool = pool
        self._jobs: dict[int, list] = {}  # job id -> [remaining core-seconds, done event]
        self._rate = 1.0
        self._updated_s = 0.0
        self._generation = 0
        self._next_job = 0

    def run(self, work_s: float, owner=None) -> simpy.Event:
        """An event that succeeds once ``work_s`` seconds of one core's work, started now, are done
        (``owner``: the rank, which processor sharing does not need)."""
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        self._advance()
        self._jobs[self._next_job] = [float(work_s), done]
        self._next_job += 1
        self._reshare()
        return done

    def wait_for_core(self, work_s: float) -> simpy.Event:
        """A thread waking to be scheduled (a comm thread handling its messages,
        :mod:`sim.training.comm_thread`): done at once where the pool's jobs leave a core free,
        else a job of ``work_s`` core-seconds sharing the cores with them, as :meth:`run`."""
        if len(self._jobs) < self.pool.free_cores:
            done = self.env.event()
            done.succeed()
            return done
        return self.run(work_s)

    def _advance(self) -> None:
        elapsed = self.env.now - self._updated_s
        if elapsed:
            for job in self._jobs.values():
                job[0] -= self._rate * elapsed
        self._updated_s = self.env.now

    def _reshare(self) -> None:
        self._generation += 1
        if not self._jobs:
            return
        self._rate = 1.0 / self.pool.factor(len(self._jobs))
        wait = min(max(job[0], 0.0) for job in self._jobs.values()) / self._rate
        self.env.timeout(wait).callbacks.append(partial(self._wake, self._generation))

    def _wake(self, generation: int, _event: simpy.Event) -> None:
        if generation != self._generation:
            return  # a job arrived or left meanwhile and rescheduled
        self._advance()
        done_s = _DONE_REL * max(1.0, self.env.now)
        finished = [j for j, job in self._jobs.items() if job[0] / self._rate <= done_s]
        events = [self._jobs.pop(j)[1] for j in finished]
        self._reshare()
        for event in events:
            event.succeed()


class TimeSlicing:
    """One :class:`CorePool` with a slice inside a segment's environment: round robin in whole
    slices (see the module docstring). The free cores are ``ceil(free)`` slots, each at
    ``free / slots`` of a core (other processes' share spread over them). Jobs wait for a slot
    in the order they became runnable (ranks released together by a collective in the order the
    engine resumes them: first arrived, first served); a job runs until done or until its
    rank's slice ends while another waits, then goes to the back of the queue. A rank whose job
    ends keeps its slot and slice for a job it starts at the same instant (its next op).

    Args:
        env: the segment's environment.
        pool: the pool (``slice_s`` > 0).
    """

    def __init__(self, env: simpy.Environment, pool: CorePool):
        self.env = env
        self.pool = pool
        self.slots = max(1, math.ceil(pool.free_cores - _DONE_REL))
        self.rate = pool.free_cores / self.slots
        self._queue: deque[list] = deque()  # [owner, remaining core-seconds, done event]
        self._running = 0
        self._kept: dict = {}  # owner -> the end of its slice, its slot held for its next op this instant

    def run(self, work_s: float, owner=None) -> simpy.Event:
        """An event that succeeds once ``work_s`` seconds of one core's work, started now, are
        done; ``owner`` is the rank (None: a thread of its own)."""
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        job = [object() if owner is None else owner, float(work_s), done]
        if job[0] in self._kept:
            self._start(job, self._kept.pop(job[0]))
        else:
            self._queue.append(job)
            self._dispatch()
        return done

    def wait_for_core(self, work_s: float) -> simpy.Event:
        """As :meth:`ProcessorSharing.wait_for_core`: done at once where a slot is free, else a
        job of ``work_s`` core-seconds waiting for one."""
        if self._running + len(self._kept) < self.slots and not self._queue:
            done = self.env.event()
            done.succeed()
            return done
        return self.run(work_s)

    def _dispatch(self) -> None:
        while self._queue and self._running + len(self._kept) < self.slots:
            self._start(self._queue.popleft(), self.env.now + self.pool.slice_s)

    def _start(self, job: list, slice_end_s: float) -> None:
        now = self.env.now
        if slice_end_s <= now:
            if self._queue:  # its slice is spent and another waits: to the back of the queue
                self._queue.append(job)
                self._dispatch()
                return
            slice_end_s = now + self.pool.slice_s
        self._running += 1
        finish_s = job[1] / self.rate
        ran_s = min(finish_s, slice_end_s - now)
        self.env.timeout(ran_s).callbacks.append(partial(self._stop, job, ran_s >= finish_s, ran_s, slice_end_s))

    def _stop(self, job: list, finished: bool, ran_s: float, slice_end_s: float, _event: simpy.Event) -> None:
        self._running -= 1
        if finished:
            self._kept[job[0]] = slice_end_s
            job[2].succeed()
            # once every event of this instant is done (the rank's next op started, if any): the
            # slot goes to the queue
            _AfterInstant(self.env).callbacks.append(partial(self._release, job[0]))
            return
        job[1] -= ran_s * self.rate
        self._start(job, slice_end_s)  # spent: requeued behind any waiting job, else a new slice

    def _release(self, owner, _event: simpy.Event) -> None:
        if self._kept.pop(owner, None) is not None:
            self._dispatch()


class _AfterInstant(simpy.Event):
    """An event processed after every other event of the current instant (scheduled below
    simpy's ``NORMAL`` priority, so after those scheduled later at the same time)."""

    def __init__(self, env: simpy.Environment):
        super().__init__(env)
        self._ok, self._value = True, None
        env.schedule(self, NORMAL + 1)
