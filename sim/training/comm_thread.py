"""DDP's communication thread on cores the ranks share: what a bucket's allreduce takes from the
backward pass, and the scheduling wait each of its messages pays.

The runtime reduces each bucket on a communication thread of the rank's process
(:mod:`runtime.training.hooks`, like the reducer's own comm hooks on gloo: a thread beside the
autograd engine's), while the backward pass goes on computing. Where the ranks outnumber the
machine's cores (the emulated cluster: every host's ranks on one 2-core machine), that thread
is one more task for the same cores: each message of the bucket's schedule is posted, received
and reduced only once the thread is scheduled, and while it runs the backward's threads run
less. Calibrated or documented figures price it, none fitted on a training measurement:

* the ranks' compute shares the cores as :mod:`sim.cores` models it (processor sharing). The
  calibration timed every op with every data-parallel rank computing at once
  (:mod:`runtime.training.calibrate`), ``ranks / cores`` times its work on a core of its own,
  so the simulation divides its times by that factor and lets the ranks (and their comm
  threads) share the cores as they run;
* each core turn of a bucket's schedule on the rank (one to enter each step it takes part in,
  one per message it sends or receives there: :func:`schedule_work`) costs its comm thread the
  core-contention floor per turn the inference transport prices
  (:func:`sim.calibrated.contention_floor`: fitted on a calibration's in-place collectives
  where its links let it show, else the gloo/tcp default), the wait of a rank to be scheduled
  while every rank is busy. That floor is a wait with all ``ranks`` tasks runnable on
  ``cores``, ``ranks / cores`` times its work on a core of its own: the comm thread's work per
  turn is ``floor x cores / ranks`` core-seconds;
* the bytes the rank receives to reduce (``(p - 1) / p n`` of an n-byte ring allreduce over p
  ranks) are summed on the same thread (``runtime.comm.run_schedule``'s ``add_``), at the
  device's reduction cost per byte (the gamma the collectives price, :mod:`sim.cost`).

That work follows the bucket's wire time on the communication stream
(:class:`sim.training.step_compute.StepCompute`): in a ring each step's received chunk is
reduced before it is sent on, so the thread's scheduling and its reductions lie on the ring's
critical path, not beside it (work priced concurrently with the wire hides behind it: tried on
the shipped training report, the overlap gain moved 3-4 points away from the measurement). It is
a wait for a core (:meth:`sim.cores.ProcessorSharing.wait_for_core`): nothing where a core is
free as it starts (after the backward, every rank waiting on the wire: the calibration's
isolated timings hold that case), else it shares the cores with the backward's compute,
stretched by it (small buckets: many messages, each waiting for a core) and slowing it
meanwhile (the overlap that costs compute).

Where identical replicas are simulated once (:mod:`sim.training.symmetry`), the simulated
ranks get their share of the cores (:func:`sim.cores.core_shares`), so that one rank standing for four
on two cores runs at half a core, as each of the four does.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.cores import CorePool


@dataclass(frozen=True)
class SharedCores:
    """The cores a training step's ranks share and what their comm threads pay on them.

    Attributes:
        pool: every rank of the step on the machine's cores.
        message_work_s: core-seconds of the comm thread's work per core turn of a schedule
            (:func:`schedule_work`), for the runtime's point-to-point schedules (False) and
            gloo's own collectives (True).
        sources: one line per term, whence it comes.
    """

    pool: CorePool
    message_work_s: dict[bool, float]
    sources: tuple[str, ...] = ()


def message_work_s(floor_s: float, ranks: int, cores: float) -> float:
    """The core-seconds one core turn costs a comm thread, from the contention floor ``floor_s``
    (s, the wait with all ``ranks`` tasks runnable on ``cores``): ``floor_s x cores / ranks``
    (processor sharing stretches a job by ``ranks / cores`` then, :mod:`sim.cores`)."""
    return floor_s * min(1.0, cores / ranks)


def schedule_work(schedule, rank: int) -> tuple[int, int]:
    """What ``schedule`` (:class:`sim.collectives.schedule.CommSchedule`) asks of ``rank``'s comm
    thread: (its core turns: in each step in which it sends or receives, one to enter the step and
    one per message it sends or receives there, as the contention floor counts them,
    :func:`sim.transport.step_turns`; the bytes it receives to reduce: the transfers marked
    ``reduce``, :class:`sim.collectives.schedule.Transfer`; ``(p - 1) / p n`` for a ring allreduce
    of n bytes over p ranks, its reduce-scatter half)."""
    turns = 0
    for step in schedule.steps:
        handled = sum((t.src == rank) + (t.dst == rank) for t in step)
        turns += 1 + handled if handled else 0
    reduced = sum(t.size_bytes for step in schedule.steps for t in step if t.reduce and t.dst == rank)
    return turns, reduced


def shared_cores(profile, network, target, ranks: tuple[int, ...]) -> SharedCores | None:
    """The cores ``ranks`` (topology rank ids) share on the target and their comm threads' work
    per core turn, from a calibration ``profile``; None where the profile records no cores or the
    ranks do not outnumber them.

    Args:
        network: the network model the profile gives the target (a transport network's fitted
            terms set the floor where the profile's in-place collectives show it; replayed
            timings have none, and the floor is the gloo/tcp default:
            :func:`sim.calibrated.contention_floor`).
        target: the target's :class:`sim.context.CalibrationContext` of ``ranks``.
    """
    from sim.calibrated import contention_cores, contention_floor
    from sim.context import profile_contexts

    contexts = profile_contexts(profile.rows)
    cores = contention_cores(contexts, target)
    if cores is None or len(ranks) <= cores:
        return None
    fitted = getattr(network, "terms", {})
    floors = {library: contention_floor(profile, contexts, target, fitted, library=library) for library in (False, True)}
    work = {library: message_work_s(floor.floor_s, len(ranks), cores) for library, floor in floors.items()}
    pool = CorePool(frozenset(ranks), cores)
    lines = (f"comm threads: {pool.describe()}, each core turn of a bucket's schedule on them at "
             f"{work[False] * 1e3:.2f} ms (point to point) / {work[True] * 1e3:.2f} ms (gloo's own) of a core each",
             *(floor.source for floor in floors.values()))
    return SharedCores(pool, work, lines)
