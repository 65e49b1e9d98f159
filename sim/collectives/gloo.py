"""Gloo's own collectives as PyTorch calls them, as schedules: what ``library`` stands for.

torch 2.13.0's ``ProcessGroupGloo.cpp`` calls ``gloo::allreduce`` (its default algorithm, the
ring) and ``gloo::reduce``; both are the ring of gloo ``gloo/allreduce.cc`` and ``gloo/reduce.cc``:

* Member j of the group (gloo's rank j) sends to member j - 1 and receives from member j + 1.
* The buffer is cut into ``numSegments`` segments, a multiple of p and at least 2p (S >= 2 per
  rank), of at most ``kMaxSegmentSize`` = 1 MiB for allreduce (``gloo/allreduce.h``); reduce
  sizes them ``min(ceil(n / 2p), 1 MiB)``. Member j's chunk is segments ``jS .. jS + S - 1``.
* Iteration i posts the receive and the send of one segment, after waiting for those of
  iteration i - 2: two segments are in flight at all times, the bytes of one flowing while the
  other's latencies run. Here an iteration is a step and ``in_flight`` is 2
  (:class:`sim.collectives.schedule.CommSchedule`); each loop starts once the previous one has
  waited for all its operations (in flight 1 at its first iteration).
* Allreduce: a reduce-scatter of ``numSegments - S`` iterations (member j sends segment
  ``(j + 1)S + i`` and adds segment ``(j + 2)S + i``), then an allgather of as many (member j sends
  segment ``jS + i``): ``2 S (p-1)`` messages of ``n / Sp`` bytes per rank, ``2 (p-1) / p n`` bytes.
* Reduce: the same reduce-scatter, over ``numSegments - 2`` iterations (the source's loop bound,
  equal to ``numSegments - S`` at two segments per rank, i.e. up to 2p MiB), then every other
  member sends its chunk to the root at once (a gather).

Segments here are :func:`sim.collectives.chunks.split`'s near-equal 8-byte-aligned ranges, where
gloo rounds each up to whole elements and leaves the last ones short. Each message is an
unbound-buffer send that waits for its receiver's ready notice over TCP
(``gloo/transport/tcp/pair.cc``): the transport terms price that rendezvous
(:data:`sim.transport.RENDEZVOUS_LIBRARY_KINDS`). A buffer of 0 bytes sends nothing (both return
at once on zero elements).

* Broadcast: gloo's binomial tree (``gloo/broadcast.cc``, ``broadcast``; torch's
  ``AsyncBroadcastWork`` calls it), walked from the nearest peer out, every rank posting all its
  sends at once (:func:`gloo_broadcast`). Relative to the root (vrank = (rank - root) mod p),
  iteration i pairs each vrank below 2^(i+1) with ``vrank ^ 2^i``, the lower one sending: a rank
  receives once, from vrank minus its highest set bit, waiting for it (``waitRecv``) before it
  posts anything, then posts a send to vrank + 2^i for every 2^i above its vrank without waiting
  (``in->send``), and returns once every send has completed (``waitSend`` after the loop; over
  TCP a send completes when its payload is written to the socket, ``Pair::writeComplete``, which
  is after the receiver's ready notice has come). So a rank's sends are one step, the step of its
  depth in the tree (the popcount of its vrank): the root's ``ceil(lg p)`` sends are the first
  step, all under way at once, where MPICH's order (:mod:`sim.collectives.binomial`) has the root
  send one level after the other, farthest first. The root leaves once its last payload is
  written. Which of the two ``library`` stands for is :data:`sim.collectives.registry.LIBRARY_BROADCAST`.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.ops import OpKind
from sim.collectives.binomial import by_relative_rank
from sim.collectives.chunks import ByteRange, span, split
from sim.collectives.schedule import CommSchedule, Steps, make_schedule, send

MAX_SEGMENT_BYTES = 1024 * 1024  # gloo/allreduce.h: kMaxSegmentSize (reduce.cc uses the same default)
IN_FLIGHT = 2  # segments a member has under way: "one segment in flight while computing a reduction on the other"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def allreduce_segments(num_ranks: int, size_bytes: int) -> int:
    """``numSegments`` of gloo's ring allreduce of ``size_bytes`` over ``num_ranks`` ranks
    (``gloo/allreduce.cc``): ``roundUp(max(ceil(n / 1 MiB), 2p), p)``."""
    return _round_up(max(-(-size_bytes // MAX_SEGMENT_BYTES), 2 * num_ranks), num_ranks)


def reduce_segments(num_ranks: int, size_bytes: int) -> int:
    """``numSegments`` of gloo's ring reduce (``gloo/reduce.cc``): segments of
    ``min(ceil(n / 2p), 1 MiB)`` bytes, their count rounded up to a multiple of p, at least 2p."""
    segment_bytes = max(1, min(-(-size_bytes // (2 * num_ranks)), MAX_SEGMENT_BYTES))
    return _round_up(max(-(-size_bytes // segment_bytes), 2 * num_ranks), num_ranks)


def _reduce_scatter(group: Sequence[int], segments: Sequence[ByteRange], iterations: int) -> Steps:
    """Gloo's ring reduce-scatter: in iteration i member j sends segment ``(j + 1)S + i`` to j - 1."""
    p, count = len(group), len(segments)
    per_rank = count // p
    return [[send(group[j], group[j - 1], segments[((j + 1) * per_rank + i) % count], reduce=True) for j in range(p)]
            for i in range(iterations)]


def _loop(iterations: int) -> list[int]:
    """``in_flight`` of one of gloo's loops: its first iteration waits for everything before it."""
    return [1] + [IN_FLIGHT] * (iterations - 1) if iterations else []


def gloo_allreduce(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Gloo's ring allreduce of ``size_bytes`` per rank over ``group`` (gloo's rank order), two
    segments in flight (module docstring)."""
    p = len(group)
    if size_bytes == 0 or p == 1:
        return make_schedule(OpKind.ALLREDUCE, "gloo_ring", group, None, size_bytes, [])
    segments = split(ByteRange(0, size_bytes), allreduce_segments(p, size_bytes))
    count = len(segments)
    per_rank = count // p
    iterations = count - per_rank
    allgather = [[send(group[j], group[j - 1], segments[(j * per_rank + i) % count], reduce=False) for j in range(p)]
                 for i in range(iterations)]
    return make_schedule(OpKind.ALLREDUCE, "gloo_ring", group, None, size_bytes,
                         _reduce_scatter(group, segments, iterations) + allgather, _loop(iterations) * 2)


def gloo_reduce(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """Gloo's reduce of ``size_bytes`` per rank to ``root``: the ring reduce-scatter with two
    segments in flight, then a gather of every member's chunk to the root (module docstring)."""
    p = len(group)
    if size_bytes == 0 or p == 1:
        return make_schedule(OpKind.REDUCE, "gloo_reduce", group, root, size_bytes, [])
    segments = split(ByteRange(0, size_bytes), reduce_segments(p, size_bytes))
    per_rank = len(segments) // p
    iterations = len(segments) - 2
    gather = [send(member, root, span(segments, j * per_rank, (j + 1) * per_rank), reduce=False)
              for j, member in enumerate(group) if member != root]
    return make_schedule(OpKind.REDUCE, "gloo_reduce", group, root, size_bytes,
                         _reduce_scatter(group, segments, iterations) + [gather], _loop(iterations) + [1])


def gloo_broadcast(group: Sequence[int], size_bytes: int, root: int) -> CommSchedule:
    """Gloo's broadcast of ``size_bytes`` from ``root`` over ``group`` (gloo's rank order): step k
    holds the sends of the ranks at depth k of gloo's tree (vrank with k bits set), each rank's
    sends posted together once it has received (module docstring). As many steps as the most
    bits a vrank below p has (at most the binomial tree's ``ceil(lg p)``; 1 for 3 ranks, where
    MPICH's takes 2). A buffer of 0 bytes still sends its (empty) messages: ``broadcast.cc`` has
    no early return."""
    ranks = by_relative_rank(group, root)
    p = len(ranks)
    steps: Steps = [[] for _ in range((p - 1).bit_length())]
    for vrank in range(p):
        # children: vrank + 2^i for every 2^i above vrank (all of them for the root)
        for bit in (1 << i for i in range((p - 1).bit_length())):
            if bit > vrank and vrank + bit < p:
                steps[vrank.bit_count()].append(send(ranks[vrank], ranks[vrank + bit], ByteRange(0, size_bytes),
                                                     reduce=False))
    return make_schedule(OpKind.BROADCAST, "gloo_broadcast", group, root, size_bytes, steps)
