"""A collective as an explicit point-to-point schedule: steps of transfers over one buffer per rank.

Buffer semantics (shared by the simulator, which prices a schedule, and the runtime, which can
execute it with isend/irecv):

* Every rank of ``group`` holds one buffer of ``size_bytes`` bytes (n in the alpha-beta formulas).
  Initially it holds the rank's input: its contribution for allreduce and reduce, the data to
  broadcast on the root (other ranks' initial contents are irrelevant) for broadcast.
* A :class:`Transfer` moves the byte range ``[offset_bytes, offset_bytes + size_bytes)`` of the
  sender's buffer into the same range of the receiver's buffer, overwriting it (``reduce=False``)
  or adding it elementwise (``reduce=True``, costing gamma per byte at the receiver).
* Steps run in order. Within a step, every send reads the sender's buffer as it was at the start
  of the step, and the receives are applied after it (so a runtime receives into scratch space and
  then copies or adds). Several reduce-transfers into one range of a rank in one step are all
  added; a copy-transfer's range overlaps no other range the rank receives in that step.
* At the end, for ``allreduce`` every buffer holds the elementwise sum of all inputs; for
  ``reduce`` the root's buffer holds it (other buffers are scratch); for ``broadcast`` every
  buffer holds the root's input. :func:`execute` is the executable reference of these semantics.

Steps order each rank's work; they are not global barriers: a network model lets a rank begin
step k as soon as its own transfers of the earlier steps are done (see :mod:`sim.network`). A
schedule may let a rank keep several of its steps in flight (``in_flight``): gloo's ring posts the
send and receive of segment i + 2 once those of segment i are done, while segment i + 1's are
still under way (gloo ``gloo/allreduce.cc``, ``gloo/reduce.cc``). Such overlap never changes the
data: a step that may overlap earlier ones sends no range its sender receives in them (checked).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from models.ops import OpKind
from sim.collectives.chunks import ByteRange

Steps = list[list["Transfer"]]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message: ``size_bytes`` bytes at ``offset_bytes`` of ``src``'s buffer to ``dst``'s.

    Ranks are global rank ids. ``reduce=True``: ``dst`` adds the bytes into its buffer (a local
    reduction costing gamma per byte at ``dst``); ``False``: ``dst`` overwrites the range.
    """

    src: int
    dst: int
    size_bytes: int
    reduce: bool
    offset_bytes: int = 0

    @property
    def end_bytes(self) -> int:
        """One past the last byte of the range carried."""
        return self.offset_bytes + self.size_bytes


@dataclass(frozen=True, slots=True)
class CommSchedule:
    """A collective operation spelled out as steps of point-to-point transfers.

    Attributes:
        kind: allreduce, reduce or broadcast.
        algorithm: the registry name that built it (e.g. ``"ring"``).
        group: the participating global ranks, in the order the algorithm uses them.
        root: the root of a reduce or broadcast; None for allreduce.
        size_bytes: n, the buffer size of every rank (bytes).
        steps: ``steps[k]`` holds the transfers of step k; see the module docstring.
        in_flight: for each step k, how many steps a rank may have under way when it enters step
            k, step k included: it enters once it has entered its earlier steps and completed
            its transfers of steps ``<= k - in_flight[k]``. 1 (the default, spelled ``()``)
            waits for all earlier steps; gloo's ring keeps 2 (:mod:`sim.collectives.gloo`).
        reduce_dtype: the dtype its reductions add in, whose gamma prices them
            (:meth:`sim.network.Links.gamma_in`); None: the network's default, the gamma each
            rank was built with. A name of :data:`models.dtypes.DTYPE_BYTES`.

    Raises:
        ValueError: a rank outside ``group``, a transfer to itself, a range outside the buffer, a
            root outside the group, a copy overlapping another range received in its step,
            ``in_flight`` not one entry >= 1 per step, or a step that may overlap an earlier one
            sending a range its sender receives in that earlier step.
    """

    kind: OpKind
    algorithm: str
    group: tuple[int, ...]
    root: int | None
    size_bytes: int
    steps: tuple[tuple[Transfer, ...], ...]
    in_flight: tuple[int, ...] = ()
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        members = set(self.group)
        if not self.group or len(members) != len(self.group):
            raise ValueError(f"group must be non-empty with distinct ranks (got {self.group})")
        if self.root is not None and self.root not in members:
            raise ValueError(f"root {self.root} is not in group {self.group}")
        size_bytes = self.size_bytes
        for index, step in enumerate(self.steps):
            received: dict[int, list[Transfer]] = {}
            for t in step:
                src, dst, offset = t.src, t.dst, t.offset_bytes
                if src == dst or src not in members or dst not in members:
                    raise ValueError(f"step {index}: bad endpoints in {t} for group {self.group}")
                if offset < 0 or t.size_bytes < 0 or offset + t.size_bytes > size_bytes:
                    raise ValueError(f"step {index}: {t} lies outside the {self.size_bytes}-byte buffer")
                incoming = received.get(dst)
                if incoming is None:
                    received[dst] = [t]
                else:
                    incoming.append(t)
            for incoming in received.values():
                # one receive overlaps nothing, and reduce-transfers may overlap each other
                if len(incoming) > 1 and not all(t.reduce for t in incoming):
                    _check_no_copy_overlap(index, incoming)
        if self.in_flight:
            if len(self.in_flight) != len(self.steps) or min(self.in_flight) < 1:
                raise ValueError(f"in_flight must hold one count >= 1 per step (got {self.in_flight} "
                                 f"for {len(self.steps)} steps)")
            _check_overlap_reads(self.steps, self.in_flight)

    @property
    def overlapping(self) -> bool:
        """Whether a rank may keep more than one step in flight (some ``in_flight`` above 1)."""
        return bool(self.in_flight) and max(self.in_flight) > 1

    def window(self, step: int) -> int:
        """``in_flight[step]``: how many steps a rank may have under way on entering ``step``."""
        return self.in_flight[step] if self.in_flight else 1

    @property
    def num_steps(self) -> int:
        """Number of steps (the latency term's multiplier for step-synchronous algorithms)."""
        return len(self.steps)

    def transfers(self) -> Iterator[Transfer]:
        """All transfers, step by step."""
        for step in self.steps:
            yield from step

    def bytes_sent_per_rank(self) -> dict[int, int]:
        """Bytes each group rank sends over the whole operation (0 for a rank that only receives)."""
        sent = dict.fromkeys(self.group, 0)
        for t in self.transfers():
            sent[t.src] += t.size_bytes
        return sent

    def bytes_received_per_rank(self) -> dict[int, int]:
        """Bytes each group rank receives over the whole operation."""
        received = dict.fromkeys(self.group, 0)
        for t in self.transfers():
            received[t.dst] += t.size_bytes
        return received


def send(src: int, dst: int, chunk: ByteRange, *, reduce: bool) -> Transfer:
    """The transfer of the byte range ``chunk`` from ``src`` to ``dst``."""
    return Transfer(src, dst, chunk.size_bytes, reduce, chunk.offset_bytes)


def _check_no_copy_overlap(step: int, incoming: list[Transfer]) -> None:
    ordered = sorted(incoming, key=lambda t: (t.offset_bytes, t.end_bytes))
    for before, after in zip(ordered, ordered[1:]):
        if after.offset_bytes < before.end_bytes and not (before.reduce and after.reduce):
            raise ValueError(f"step {step}: a copy overlaps another receive at rank {after.dst}: {before}, {after}")


def _check_overlap_reads(steps: tuple[tuple[Transfer, ...], ...], in_flight: tuple[int, ...]) -> None:
    """Raise ValueError where a transfer of step k sends bytes its sender receives in one of the
    ``in_flight[k] - 1`` steps before, which may still be under way when it starts."""
    for index, window in enumerate(in_flight):
        if window == 1:
            continue
        received: dict[int, list[Transfer]] = {}
        for step in steps[max(0, index - window + 1):index]:
            for before in step:
                if before.size_bytes:
                    received.setdefault(before.dst, []).append(before)
        for t in steps[index]:
            for before in received.get(t.src, ()) if t.size_bytes else ():
                if before.offset_bytes < t.end_bytes and t.offset_bytes < before.end_bytes:
                    raise ValueError(f"step {index} may overlap an earlier step but sends bytes received there: "
                                     f"{before}, {t}")


def make_schedule(
    kind: OpKind, algorithm: str, group: Sequence[int], root: int | None, size_bytes: int,
    steps: Iterable[Iterable[Transfer]], in_flight: Sequence[int] = (),
) -> CommSchedule:
    """A :class:`CommSchedule` from lists of transfers, dropping empty steps (they change nothing)
    and their ``in_flight`` entries (see :class:`CommSchedule`; empty: 1 for every step)."""
    kept = tuple(tuple(step) for step in steps)
    windows = tuple(w for step, w in zip(kept, in_flight) if step) if in_flight else ()
    return CommSchedule(kind, algorithm, tuple(group), root, size_bytes, tuple(step for step in kept if step),
                        windows if any(w != 1 for w in windows) else ())


def in_parallel(*parts: Steps) -> Steps:
    """Sub-schedules over disjoint sets of ranks run side by side: step k of each becomes step k."""
    merged: Steps = [[] for _ in range(max((len(part) for part in parts), default=0))]
    for part in parts:
        for index, step in enumerate(part):
            merged[index].extend(step)
    return merged


def execute(schedule: CommSchedule, buffers: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Run ``schedule`` on real data: the reference of the buffer semantics in the module docstring.

    Args:
        schedule: the schedule to run.
        buffers: for each group rank, a 1-D array of ``schedule.size_bytes`` entries (one entry
            per byte, so that ranges index it directly; any numeric dtype).

    Returns:
        The final buffer of every group rank (new arrays; the inputs are left alone).

    Raises:
        ValueError: a buffer is missing or has the wrong length.
    """
    state = {rank: np.array(buffers[rank], copy=True) for rank in schedule.group if rank in buffers}
    if len(state) != len(schedule.group) or any(b.shape != (schedule.size_bytes,) for b in state.values()):
        raise ValueError(f"need a buffer of {schedule.size_bytes} entries for each rank of {schedule.group}")
    for step in schedule.steps:
        payloads = [state[t.src][t.offset_bytes : t.end_bytes].copy() for t in step]
        for t, payload in zip(step, payloads):
            if not t.reduce:
                state[t.dst][t.offset_bytes : t.end_bytes] = payload
        for t, payload in zip(step, payloads):
            if t.reduce:
                state[t.dst][t.offset_bytes : t.end_bytes] += payload
    return state


_BUS_FACTOR_KINDS = (OpKind.ALLREDUCE, OpKind.REDUCE, OpKind.BROADCAST)


def bus_bandwidth_factor(kind: OpKind, num_ranks: int) -> float:
    """busBW / algBW as nccl-tests defines it (doc/PERFORMANCE.md): allreduce 2(p-1)/p, else 1.

    Raises:
        ValueError: ``kind`` is not a collective this layer implements, or ``num_ranks < 1``.
    """
    if kind not in _BUS_FACTOR_KINDS or num_ranks < 1:
        raise ValueError(f"no bus bandwidth factor for {kind} over {num_ranks} ranks")
    return 2 * (num_ranks - 1) / num_ranks if kind == OpKind.ALLREDUCE else 1.0


def alg_bw_bytes_per_s(size_bytes: int, time_s: float) -> float:
    """nccl-tests' algorithm bandwidth S / t (bytes/s), S the operation's size per rank."""
    return size_bytes / time_s


def bus_bw_bytes_per_s(kind: OpKind, num_ranks: int, size_bytes: int, time_s: float) -> float:
    """nccl-tests' bus bandwidth: algBW times :func:`bus_bandwidth_factor` (bytes/s).

    Comparable to the bottleneck link's bandwidth; the figure users quote.
    """
    return alg_bw_bytes_per_s(size_bytes, time_s) * bus_bandwidth_factor(kind, num_ranks)
