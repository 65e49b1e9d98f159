"""The memory ledger: device memory per rank over time, its peak, and the first op that overflows.

Each op of a segment contributes events: at its start its persistent ``alloc`` and its transient
bytes (workspace or communication buffer); at its end the transient bytes are released and its
``free`` applied. Events at the same instant apply releases before allocations (a buffer freed as
the next op starts is reused), so the ledger never double counts a hand-over.

A segment repeated k times whose instance leaves ``net`` bytes behind (the KV cache of one layer)
starts instance j at ``base + j * net``; its peak is therefore at the first or the last instance,
and the first overflowing instance is found in closed form, not by replaying k instances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter

import numpy as np

from sim.engine import SegmentResult
from sim.plan import MemoryCategory, Op, Phase, Segment

CATEGORIES = tuple(MemoryCategory)


@dataclass(frozen=True)
class SegmentLedger:
    """One rank's memory within one segment instance, relative to the instance's start.

    ``times_s``/``running_bytes``: after each event, in event order; ``op_index``: the op that caused
    it; ``net_bytes``: what the instance leaves behind, by category; ``peak_*``: its highest point.
    """

    times_s: np.ndarray
    running_bytes: np.ndarray
    op_index: np.ndarray
    net_bytes: dict[MemoryCategory, int]
    peak_bytes: int
    peak_by_category: dict[MemoryCategory, int]


def segment_ledger(segment: Segment, result: SegmentResult, rank: int, alike: dict | None = None) -> SegmentLedger:
    """Build ``rank``'s ledger of one instance of ``segment`` from its simulated op times (kept in
    ``result``: the run's memory and its trace ask for the same ledgers). ``alike``: ledgers by
    their events, shared by ranks whose ops allocate and free the same bytes at the same times
    (the ranks of a tensor-parallel group): those build one ledger (see :func:`phase_memory`)."""
    ledger = result.ledgers.get(rank)
    if ledger is None:
        events = _events(segment.programs[rank], result, rank)
        if alike is None:
            ledger = _ledger(events)
        else:
            key = tuple(events)
            ledger = alike.get(key)
            if ledger is None:
                ledger = alike[key] = _ledger(events)
        result.ledgers[rank] = ledger
    return ledger


def _events(program: tuple[Op, ...], result: SegmentResult, rank: int
            ) -> list[tuple[float, int, int, MemoryCategory, int]]:
    """``rank``'s memory events in one instance of a segment: (time, order, op, category, delta),
    an op's releases (order 0) before the allocations (order 1) of an op starting then."""
    starts, ends = result.starts[rank].tolist(), result.ends[rank].tolist()
    events: list[tuple[float, int, int, MemoryCategory, int]] = []
    append = events.append
    for i, op in enumerate(program):
        start, end = starts[i], ends[i]
        for category, size in op.alloc:
            append((start, 1, i, category, size))
        transient = op.transient_bytes
        if transient:
            category = op.transient_category
            append((start, 1, i, category, transient))
            append((end, 0, i, category, -transient))
        for category, size in op.free:
            append((end, 0, i, category, -size))
    return events


def _ledger(events: list[tuple[float, int, int, MemoryCategory, int]]) -> SegmentLedger:
    """The ledger of a segment instance's memory ``events`` (:func:`_events`, sorted here)."""
    events = sorted(events, key=_EVENT_ORDER)
    totals = list(accumulate(event[4] for event in events))
    peak = max(totals, default=0)
    at = totals.index(peak) if peak > 0 else -1  # the first event at the highest total
    peak = max(peak, 0)
    by_category = dict.fromkeys(CATEGORIES, 0)
    for _, _, _, category, delta in events[:at + 1]:
        by_category[category] += delta
    peak_by_category = dict(by_category)
    for _, _, _, category, delta in events[at + 1:]:
        by_category[category] += delta
    return SegmentLedger(np.array([event[0] for event in events]), np.array(totals, dtype=np.int64),
                         np.array([event[2] for event in events], dtype=np.int64), by_category, peak,
                         peak_by_category)


_EVENT_ORDER = itemgetter(0, 1, 2)


@dataclass(frozen=True)
class Overflow:
    """The first op whose memory does not fit: when, where, and by how much (bytes)."""

    rank: int
    op_name: str
    phase: str
    step: int
    layer: int | None
    time_s: float
    needed_bytes: int
    capacity_bytes: int

    def describe(self, device_name: str) -> str:
        where = f"layer {self.layer} " if self.layer is not None else ""
        return (f"out of memory on rank {self.rank} ({device_name}) at {self.phase} step {self.step} "
                f"{where}op {self.op_name}: needs {self.needed_bytes / 2**30:.2f} GiB of "
                f"{self.capacity_bytes / 2**30:.2f} GiB")


@dataclass(frozen=True)
class PhaseMemory:
    """One rank's memory over one phase, given the bytes resident when it starts.

    ``peak_bytes`` is absolute; ``peak_by_category`` its composition; ``end_bytes`` what the phase
    leaves resident (by category); ``overflow`` the first op past ``capacity_bytes``, if any.
    """

    peak_bytes: int
    peak_by_category: dict[MemoryCategory, int]
    end_by_category: dict[MemoryCategory, int]
    overflow: Overflow | None


def phase_memory(phase: Phase, results: tuple[SegmentResult, ...], rank: int,
                 start_by_category: dict[MemoryCategory, int], capacity_bytes: int,
                 phase_start_s: float, alike: dict | None = None) -> PhaseMemory:
    """Fold the segment ledgers of ``phase`` (with repeats) into the rank's phase memory.

    Args:
        results: one simulated instance per segment of ``phase``, in order.
        start_by_category: bytes resident when the phase starts, by category.
        capacity_bytes: the device's memory; the first event above it is reported.
        phase_start_s: absolute start time of the phase, for the overflow's time.
        alike: one dict passed for every rank of ``phase`` (empty at first): ranks whose
            segment ledgers would be equal share one (:func:`segment_ledger`).
    """
    current = dict(start_by_category)
    peak_bytes, peak_by_category = sum(current.values()), dict(current)
    overflow = None
    t0 = phase_start_s
    for index, (segment, result, layer0) in enumerate(zip(phase.segments, results, phase.layer_of_segment)):
        ledger = segment_ledger(segment, result, rank, None if alike is None else alike.setdefault(index, {}))
        base = sum(current.values())
        net = sum(ledger.net_bytes.values())
        last = segment.repeat - 1
        j_peak = last if net > 0 else 0
        if base + j_peak * net + ledger.peak_bytes > peak_bytes:
            peak_bytes = base + j_peak * net + ledger.peak_bytes
            peak_by_category = {c: current[c] + j_peak * ledger.net_bytes[c] + ledger.peak_by_category[c]
                                for c in CATEGORIES}
        if overflow is None and base + j_peak * net + ledger.peak_bytes > capacity_bytes:
            overflow = _first_overflow(phase, segment, result, ledger, rank, base, net, capacity_bytes,
                                       layer0, t0)
        current = {c: current[c] + segment.repeat * ledger.net_bytes[c] for c in CATEGORIES}
        t0 += segment.repeat * result.duration_s
    return PhaseMemory(peak_bytes, peak_by_category, current, overflow)


def _first_overflow(phase, segment, result, ledger, rank, base, net, capacity_bytes, layer0, t0) -> Overflow:
    """The earliest instance and event of a segment whose running total exceeds the capacity."""
    if base + ledger.peak_bytes > capacity_bytes:
        j = 0
    else:  # only later instances overflow, which needs net > 0
        j = max(1, math.ceil((capacity_bytes - base - ledger.peak_bytes) / net))
        while base + j * net + ledger.peak_bytes <= capacity_bytes:
            j += 1
    event = int(np.argmax(base + j * net + ledger.running_bytes > capacity_bytes))
    op = segment.programs[rank][int(ledger.op_index[event])]
    layer = op.layer if layer0 is None else layer0 + j
    return Overflow(rank, op.name, phase.name, phase.step, layer,
                    t0 + j * result.duration_s + float(ledger.times_s[event]),
                    int(base + j * net + ledger.running_bytes[event]), capacity_bytes)
