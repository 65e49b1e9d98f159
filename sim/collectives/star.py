"""Star (parameter-server) collectives: every rank talks to one hub directly.

One step each way, so the latency term is minimal (one or two alpha), but the hub's link carries
all p - 1 messages: allreduce ``2 alpha + 2(p-1) n beta_root + (p-1) n gamma`` (the root's link
serialises, after Thakur, Rabenseifner, Gropp, IJHPCA 2005); reduce and broadcast pay one half each. Only a network
model that shares the hub's link among the p - 1 concurrent messages reproduces that cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.ops import OpKind
from sim.collectives.schedule import CommSchedule, Transfer, make_schedule


def _gather(group: Sequence[int], hub: int, size_bytes: int) -> list[Transfer]:
    return [Transfer(rank, hub, size_bytes, True) for rank in group if rank != hub]


def _scatter(group: Sequence[int], hub: int, size_bytes: int) -> list[Transfer]:
    return [Transfer(hub, rank, size_bytes, False) for rank in group if rank != hub]


def star_reduce(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """Every rank sends its buffer to ``root``, which adds them all: one step."""
    return make_schedule(OpKind.REDUCE, "star", group, root, size_bytes, [_gather(group, root, size_bytes)])


def star_broadcast(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """``root`` sends its buffer to every rank: one step."""
    return make_schedule(OpKind.BROADCAST, "star", group, root, size_bytes, [_scatter(group, root, size_bytes)])


def star_allreduce(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Star reduce to the hub ``group[0]``, then star broadcast of the sum: two steps."""
    hub = group[0]
    steps = [_gather(group, hub, size_bytes), _scatter(group, hub, size_bytes)]
    return make_schedule(OpKind.ALLREDUCE, "star", group, None, size_bytes, steps)
