"""Binomial-tree reduce and broadcast (MPICH ``reduce_intra_binomial.c``, ``bcast_intra_binomial.c``).

Ranks are numbered relative to the root (rel = (position - root position) mod p). Reduce: in step
j every rel with rel mod 2^(j+1) = 2^j sends its whole buffer to rel - 2^j, which adds it. Broadcast
is the same tree walked top-down. ``ceil(lg p)`` steps of n bytes each:
``ceil(lg p)(alpha + n beta)``, plus ``ceil(lg p) n gamma`` on the critical path of a reduce
(Thakur, Rabenseifner, Gropp 2005).
"""

from __future__ import annotations

from collections.abc import Sequence

from models.ops import OpKind
from sim.collectives.chunks import ByteRange
from sim.collectives.schedule import CommSchedule, Steps, make_schedule, send


def by_relative_rank(members: Sequence[int], root: int) -> list[int]:
    """``members`` renumbered relative to ``root``: entry rel is the member ``rel`` places after it
    (cyclically), so entry 0 is ``root``."""
    start = list(members).index(root)
    return [members[(start + rel) % len(members)] for rel in range(len(members))]


def _masks(p: int) -> list[int]:
    """1, 2, 4, ... below p: one per step of the tree."""
    return [1 << j for j in range((p - 1).bit_length())]


def binomial_reduce_steps(members: Sequence[int], root: int, whole: ByteRange) -> Steps:
    """Steps of a binomial reduce of the range ``whole`` to ``root`` (one of ``members``)."""
    ranks = by_relative_rank(members, root)
    return [
        [send(ranks[rel], ranks[rel - mask], whole, reduce=True) for rel in range(mask, len(ranks), 2 * mask)]
        for mask in _masks(len(ranks))
    ]


def binomial_broadcast_steps(members: Sequence[int], root: int, whole: ByteRange) -> Steps:
    """Steps of a binomial broadcast of the range ``whole`` from ``root`` (one of ``members``)."""
    ranks = by_relative_rank(members, root)
    return [
        [send(ranks[rel], ranks[rel + mask], whole, reduce=False) for rel in range(0, len(ranks) - mask, 2 * mask)]
        for mask in reversed(_masks(len(ranks)))
    ]


def binomial_reduce(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """Binomial-tree reduce of ``size_bytes`` per rank to ``root``."""
    steps = binomial_reduce_steps(group, root, ByteRange(0, size_bytes))
    return make_schedule(OpKind.REDUCE, "binomial", group, root, size_bytes, steps)


def binomial_broadcast(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """Binomial-tree broadcast of ``size_bytes`` from ``root``."""
    steps = binomial_broadcast_steps(group, root, ByteRange(0, size_bytes))
    return make_schedule(OpKind.BROADCAST, "binomial", group, root, size_bytes, steps)
