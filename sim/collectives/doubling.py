"""Butterfly allreduces: recursive doubling, and Rabenseifner's halving reduce-scatter + doubling allgather.

Both follow MPICH (``src/mpi/coll/allreduce/allreduce_intra_recursive_doubling.c`` and
``allreduce_intra_reduce_scatter_allgather.c``; Thakur, Rabenseifner, Gropp, IJHPCA 2005). When p
is not a power of two, the r = p - 2^floor(lg p) "extra" ranks fold in first: among the first 2r
group positions, each even one sends its whole buffer to the next odd one, which adds it; the
remaining p' = 2^floor(lg p) ranks run the power-of-two algorithm; finally each odd one sends the
result back to its even partner.

Costs, p' = 2^floor(lg p), r = p - p' (exact for these schedules; see :mod:`.closed_form`):

* recursive doubling: ``lg p' (alpha + n beta + n gamma)``, plus, when r > 0,
  ``2 alpha + 2 n beta + n gamma`` for the fold and unfold.
* Rabenseifner: ``2 lg p' alpha + 2((p'-1)/p') n beta + ((p'-1)/p') n gamma``, plus the same
  fold and unfold.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.ops import OpKind
from sim.collectives.chunks import ByteRange, span, split
from sim.collectives.schedule import CommSchedule, Steps, make_schedule, send


def _fold(group: Sequence[int], whole: ByteRange) -> tuple[list[int], Steps, Steps]:
    """(the p' ranks of the power-of-two phase in "new rank" order, fold step, unfold step)."""
    p = len(group)
    extra = p - (1 << (p.bit_length() - 1))
    survivors = [group[i] for i in range(1, 2 * extra, 2)] + list(group[2 * extra :])
    fold = [send(group[i], group[i + 1], whole, reduce=True) for i in range(0, 2 * extra, 2)]
    unfold = [send(group[i + 1], group[i], whole, reduce=False) for i in range(0, 2 * extra, 2)]
    return survivors, [fold], [unfold]


def recursive_doubling(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Recursive-doubling allreduce: in step j new rank i exchanges its whole buffer with i xor 2^j.

    ``lg p'`` exchange steps of n bytes each way (plus the fold and unfold when p is not a power of
    two): latency-optimal, for small messages.
    """
    whole = ByteRange(0, size_bytes)
    survivors, fold, unfold = _fold(group, whole)
    exchanges: Steps = []
    mask = 1
    while mask < len(survivors):
        exchanges.append([send(survivors[i], survivors[i ^ mask], whole, reduce=True) for i in range(len(survivors))])
        mask <<= 1
    return make_schedule(OpKind.ALLREDUCE, "recursive_doubling", group, None, size_bytes, fold + exchanges + unfold)


def rabenseifner(group: Sequence[int], size_bytes: int) -> CommSchedule:
    """Rabenseifner allreduce: reduce-scatter by recursive halving, then allgather by recursive doubling.

    The buffer is split into p' chunks. In halving step j (distance 2^j, as in MPICH) partners
    hold the same chunk range; the lower new rank keeps the lower half and sends the upper half,
    the other the reverse, and each adds what it receives. The allgather retraces the steps in
    reverse order, each partner sending the range it holds.
    """
    survivors, fold, unfold = _fold(group, ByteRange(0, size_bytes))
    p2 = len(survivors)
    chunks = split(ByteRange(0, size_bytes), p2)
    held = [(0, p2)] * p2  # chunk index range [first, stop) each new rank holds
    history: list[list[tuple[int, int]]] = []
    halving: Steps = []
    mask = 1
    while mask < p2:
        history.append(held)
        step, kept = [], []
        for i in range(p2):
            first, stop = held[i]
            middle = (first + stop) // 2
            keep, give = ((first, middle), (middle, stop)) if i < i ^ mask else ((middle, stop), (first, middle))
            step.append(send(survivors[i], survivors[i ^ mask], span(chunks, *give), reduce=True))
            kept.append(keep)
        halving.append(step)
        held = kept
        mask <<= 1
    doubling: Steps = []
    for before in reversed(history):
        mask >>= 1
        step = []
        for i in range(p2):
            step.append(send(survivors[i], survivors[i ^ mask], span(chunks, *held[i]), reduce=False))
        doubling.append(step)
        held = before
    return make_schedule(OpKind.ALLREDUCE, "rabenseifner", group, None, size_bytes, fold + halving + doubling + unfold)
