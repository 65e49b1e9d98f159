"""NCCL's double binary tree allreduce (``src/graph/trees.cc``; Sanders, Speck, Traeff 2009).

Two binary trees over the p group positions: tree 0 is NCCL's ``ncclGetBtree`` (root 0, which has
a single child), tree 1 its mirror (position i -> p-1-i) when p is even, or tree 0 shifted by one
position when p is odd. Each position is interior in at most one tree when p is even (with p odd,
position 0 has children in both). Tree t carries half t of the buffer.

Each half is pipelined in k segments (as NCCL's tree kernel does, reduce up then broadcast down
per segment). Segment s of a tree is sent up by a node of height h (leaves have height 0) in step
``s + h`` (the parent adds it), and sent down by a node of depth d in step ``s + H + d`` where H is
the root's height. Both trees run in the same steps, so a step moves up to four segments through
a rank's link each way. The number of segments k is a fixed function of the size (a
:data:`SEGMENT_BYTES` segment, at most :data:`MAX_SEGMENTS`), so that the schedule depends only
on (group, size) and the simulator and the runtime build the same one; the pipelining optimum
``k* = sqrt((D-1) n beta / alpha)`` (Sanders, Speck, Traeff, Parallel Computing 35(12), 2009) would need the network's alpha and beta.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from models.ops import OpKind
from sim.collectives.chunks import ByteRange, split
from sim.collectives.schedule import CommSchedule, Steps, Transfer, make_schedule, send

SEGMENT_BYTES = 64 * 1024  # per tree; about NCCL's tree chunk, and small enough to fill a pipeline of a few MB
MAX_SEGMENTS = 64


@dataclass(frozen=True)
class BinaryTree:
    """A rooted tree over positions 0..p-1: ``parent[v]`` (-1 at the root) and ``children[v]``."""

    root: int
    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    def height(self, node: int) -> int:
        """Edges on the longest way down from ``node`` to a leaf (0 for a leaf)."""
        return max((1 + self.height(child) for child in self.children[node]), default=0)

    def depth(self, node: int) -> int:
        """Edges from the root to ``node``."""
        return 0 if node == self.root else 1 + self.depth(self.parent[node])


def _nccl_btree(nranks: int, rank: int) -> tuple[int, int, int]:
    """(up, down0, down1) of ``rank``, -1 for none: a port of ``ncclGetBtree``."""
    bit = 1
    while bit < nranks and not bit & rank:
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1)
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = rank - lowbit if lowbit else -1
    down1 = rank + lowbit if lowbit else -1
    while down1 >= nranks:
        down1 = rank + lowbit if lowbit else -1
        lowbit >>= 1
    return up, down0, down1


def _tree(nranks: int, relabel) -> BinaryTree:
    """Tree 0 with every position v renamed ``relabel(v)``."""
    parent = [-1] * nranks
    children: list[tuple[int, ...]] = [()] * nranks
    root = -1
    for v in range(nranks):
        up, down0, down1 = _nccl_btree(nranks, v)
        node = relabel(v)
        parent[node] = relabel(up) if up >= 0 else -1
        children[node] = tuple(relabel(c) for c in (down0, down1) if c >= 0)
        if up < 0:
            root = node
    return BinaryTree(root, tuple(parent), tuple(children))


@cache
def nccl_double_tree(nranks: int) -> tuple[BinaryTree, BinaryTree]:
    """The two trees of ``ncclGetDtree`` over positions 0..nranks-1 (nranks >= 1)."""
    first = _tree(nranks, lambda v: v)
    if nranks % 2:
        return first, _tree(nranks, lambda v: (v + 1) % nranks)
    return first, _tree(nranks, lambda v: nranks - 1 - v)


def num_segments(size_bytes: int) -> int:
    """Pipeline segments per tree: ``clamp(ceil((n/2) / SEGMENT_BYTES), 1, MAX_SEGMENTS)``."""
    return min(MAX_SEGMENTS, max(1, math.ceil(size_bytes / 2 / SEGMENT_BYTES)))


def double_binary_tree(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Double-binary-tree allreduce over ``group`` (positions in group order), pipelined in
    :func:`num_segments` segments per tree. Takes ``k + 2H - 1`` steps, H the taller root's height.
    """
    p = len(group)
    steps: Steps = []
    if p > 1:
        k = num_segments(size_bytes)
        for tree, half in zip(nccl_double_tree(p), split(ByteRange(0, size_bytes), 2)):
            top = tree.height(tree.root)
            segments = split(half, k)
            for node in range(p):
                height, depth = tree.height(node), tree.depth(node)
                for s, segment in enumerate(segments):
                    if node != tree.root:
                        _at(steps, s + height).append(send(group[node], group[tree.parent[node]], segment, reduce=True))
                    for child in tree.children[node]:
                        _at(steps, s + top + depth).append(send(group[node], group[child], segment, reduce=False))
    return make_schedule(OpKind.ALLREDUCE, "double_binary_tree", group, None, size_bytes, steps)


def _at(steps: Steps, index: int) -> list[Transfer]:
    while len(steps) <= index:
        steps.append([])
    return steps[index]
