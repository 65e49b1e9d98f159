"""Gloo's own collectives as PyTorch calls them, as schedules: what ``library`` stands for.

* Allreduce (gloo ``AllreduceRing``): a ring whose buffer is cut into at least two segments per
  rank; measured on this machine it costs about 4(p-1) message latencies, not 2(p-1)
  (gloo ``gloo/allreduce.cc``, torch 2.13.0's ``ProcessGroupGloo.cpp``), so it is modelled as two ring allreduces of half the buffer each, one
  after the other: ``4(p-1) alpha + 2((p-1)/p) n beta``.
* Reduce (gloo ``reduce.cc``): the same segmented ring reduce-scatter, after which every rank
  sends its reduced chunk to the root at once (a gather): ``(2(p-1) + 1) alpha``, about
  ``((p-1)/p) n beta`` in the ring plus the root's incoming ``((p-1)/p) n``.
* Broadcast: a binomial tree (gloo ``broadcast.cc``), as :mod:`sim.collectives.binomial` builds.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.ops import OpKind
from sim.collectives.chunks import ByteRange, split
from sim.collectives.ring import ring_allreduce_steps, ring_reduce_scatter
from sim.collectives.schedule import CommSchedule, make_schedule, send

SEGMENTS_PER_RANK = 2


def gloo_allreduce(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Gloo's segmented ring allreduce of ``size_bytes`` per rank over ``group`` (ring order)."""
    halves = split(ByteRange(0, size_bytes), SEGMENTS_PER_RANK)
    steps = [step for half in halves for step in ring_allreduce_steps(group, half)]
    return make_schedule(OpKind.ALLREDUCE, "gloo_ring", group, None, size_bytes, steps)


def gloo_reduce(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """Gloo's reduce: segmented ring reduce-scatter, then a gather of the chunks to ``root``."""
    p = len(group)
    halves = split(ByteRange(0, size_bytes), SEGMENTS_PER_RANK)
    steps = []
    owned: list[tuple[int, ByteRange]] = []
    for half in halves:
        chunks = split(half, p)
        steps += ring_reduce_scatter(group, chunks)
        # After the reduce-scatter member i holds the sum of chunk (i + 1) mod p.
        owned += [(group[i], chunks[(i + 1) % p]) for i in range(p)]
    steps.append([send(member, root, chunk, reduce=False) for member, chunk in owned if member != root])
    return make_schedule(OpKind.REDUCE, "gloo_reduce", group, root, size_bytes, steps)
