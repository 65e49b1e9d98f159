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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import simpy

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

    Raises:
        ValueError: a pool without cores or ranks, or whose background takes every core.
    """

    ranks: frozenset[int]
    cores: float
    background_cores: float = 0.0

    def __post_init__(self) -> None:
        if not self.ranks or not self.cores > 0 or not 0 <= self.background_cores < self.cores:
            raise ValueError(f"a core pool needs ranks, cores > 0 and 0 <= background < cores (got {len(self.ranks)} "
                             f"ranks, {self.cores} cores, {self.background_cores} background)")

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
        return f"{len(self.ranks)} ranks on {self.cores:g} cores{background}"


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

    def run(self, work_s: float) -> simpy.Event:
        """An event that succeeds once ``work_s`` seconds of one core's work, started now, are done."""
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


def core_shares(pool: CorePool, simulated: frozenset[int]) -> tuple[CorePool, ...]:
    """The pool the ``simulated`` ranks run on when they stand for all of ``pool``'s ranks
    (identical replicas simulated once): their share of its cores, so that each computes at the
    rate each of all the ranks would. The pool itself where every rank is simulated; none where
    no simulated rank is on it."""
    mine = pool.ranks & simulated
    if not mine:
        return ()
    if mine == pool.ranks:
        return (pool,)
    share = len(mine) / len(pool.ranks)
    return (CorePool(frozenset(mine), pool.cores * share, pool.background_cores * share),)
