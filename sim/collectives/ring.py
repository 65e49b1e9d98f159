"""Ring allreduce: a ring reduce-scatter followed by a ring allgather (MPICH, NCCL, gloo).

Cost (Thakur, Rabenseifner, Gropp 2005; MPICH ``src/mpi/coll``):
``2(p-1) alpha + 2((p-1)/p) n beta + ((p-1)/p) n gamma``, bandwidth-optimal (Patarasuk and Yuan 2009).
"""

from __future__ import annotations

from collections.abc import Sequence

from models.ops import OpKind
from sim.collectives.chunks import ByteRange, split
from sim.collectives.schedule import CommSchedule, Steps, make_schedule, send


def ring_reduce_scatter(members: Sequence[int], chunks: Sequence[ByteRange]) -> Steps:
    """p-1 steps; in step s member i sends chunk (i - s) mod p to member i+1, which adds it.

    ``chunks`` has one range per member. Afterwards member i holds the sum of chunk (i + 1) mod p.
    """
    p = len(members)
    return [[send(members[i], members[(i + 1) % p], chunks[(i - s) % p], reduce=True) for i in range(p)] for s in range(p - 1)]


def ring_allgather(members: Sequence[int], chunks: Sequence[ByteRange]) -> Steps:
    """p-1 steps passing each member's chunk around: member i starts owning chunk (i + 1) mod p.

    This is the ownership :func:`ring_reduce_scatter` leaves; afterwards every member has every chunk.
    """
    p = len(members)
    return [
        [send(members[i], members[(i + 1) % p], chunks[(i + 1 - s) % p], reduce=False) for i in range(p)] for s in range(p - 1)
    ]


def ring_allreduce_steps(members: Sequence[int], whole: ByteRange) -> Steps:
    """Allreduce of the range ``whole`` among ``members``: 2(p-1) steps of about |whole|/p bytes."""
    chunks = split(whole, len(members))
    return ring_reduce_scatter(members, chunks) + ring_allgather(members, chunks)


def ring_allreduce(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Ring allreduce of ``size_bytes`` per rank over ``group`` (ring order = group order)."""
    steps = ring_allreduce_steps(group, ByteRange(0, size_bytes))
    return make_schedule(OpKind.ALLREDUCE, "ring", group, None, size_bytes, steps)
