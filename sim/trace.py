"""The trace: what happened when, in one schema shared by the simulator and the runtime.

A :class:`Trace` holds three tidy tables (pandas DataFrames), all times in seconds from the run's
start:

* ``ops``: one row per op instance, a :class:`TraceEvent` each (its fields are the columns). The
  runtime's executor records one per op it runs; the simulator's trace builder writes the same
  fields for every op instance it prices.
* ``steps``: one row per forward pass, built by :func:`step_table` on both sides:
  ``step, phase, start_s, end_s, stall_s`` (step 0 is the prefill; ``stall_s``: the slowest rank's
  wait for streamed weights in the step; a simulated run gives it for the prefill and the first and
  last decode steps, NaN between).
* ``memory``: counter samples ``rank, time_s, bytes`` (device memory in use).
* ``peaks``: ``rank, bytes``, each rank's high-water mark of device memory, which the samples may
  miss (a measured process's peak between two readings; a simulated step whose ops the trace
  does not hold).

A run of hundreds of decode steps on an 80-layer model has millions of op instances, so ``ops``
holds the phases chosen when the trace is built (by default the prefill and the first decode step);
``steps`` always covers every step and is what the timing metrics are computed from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import Iterable, NamedTuple

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.loader import stall_s
from sim.memory import segment_ledger
from sim.timeline import PhaseRun, RunResult
from sim.vocabulary import PhaseKind


class TraceEvent(NamedTuple):
    """One op instance of a run: a row of a trace's ``ops`` table (times: s from the run's start).

    ``stream``, ``kind`` and ``phase`` hold the values of :class:`sim.plan.Stream`,
    :class:`models.ops.OpKind` and :class:`sim.vocabulary.PhaseKind`; ``layer`` is -1 for an op
    outside the decoder layers; ``bytes`` is the memory traffic of a compute op, the message size
    of a collective, the block size of a weight load.
    """

    rank: int
    stream: str
    kind: str
    name: str
    phase: str
    step: int
    layer: int
    start_s: float
    end_s: float
    bytes: float
    flops: float


OP_COLUMNS = list(TraceEvent._fields)
STEP_COLUMNS = ["step", "phase", "start_s", "end_s", "stall_s"]
MEMORY_COLUMNS = ["rank", "time_s", "bytes"]
PEAK_COLUMNS = ["rank", "bytes"]


def op_table(events: Iterable[TraceEvent]) -> pd.DataFrame:
    """The ``ops`` table of recorded events (in the order given)."""
    return pd.DataFrame(list(events), columns=OP_COLUMNS)


def step_table(start_s, end_s, stall_s=None) -> pd.DataFrame:
    """The ``steps`` table of one generation, the same for a simulated and a measured run.

    Args:
        start_s, end_s: [steps] start and end of each forward pass (s); step 0 is the prefill.
        stall_s: [steps] the slowest rank's wait for streamed weights in each step (s); zeros
            when omitted (resident weights).
    """
    start_s = np.asarray(start_s, dtype=float)
    steps = len(start_s)
    return pd.DataFrame({"step": np.arange(steps), "phase": [PhaseKind.of_step(s).value for s in range(steps)],
                         "start_s": start_s, "end_s": np.asarray(end_s, dtype=float),
                         "stall_s": np.zeros(steps) if stall_s is None else np.asarray(stall_s, dtype=float)})


@dataclass(frozen=True)
class Trace:
    """Op, step, memory and peak tables of one run (see the module docstring for their columns)."""

    ops: pd.DataFrame
    steps: pd.DataFrame
    memory: pd.DataFrame
    peaks: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PEAK_COLUMNS))


def peak_table(peak_bytes: dict[int, float]) -> pd.DataFrame:
    """The ``peaks`` table of rank -> high-water mark (bytes)."""
    return pd.DataFrame({"rank": list(peak_bytes), "bytes": list(peak_bytes.values())}, columns=PEAK_COLUMNS)


def build_trace(run: RunResult, expand_steps: Iterable[int] = (0, 1)) -> Trace:
    """The trace of a simulated run, with op-level detail for the simulated steps in ``expand_steps``."""
    plan = run.plan
    num_steps = plan.num_phases
    # Stalls of the prefill and the first and last decode steps; those between stay NaN:
    # sim.timeline verified that the decode steps' op times are linear between the simulated
    # ones, and sim.metrics averages the known stalls as a linear interpolation, without
    # rounding each interpolated step's value.
    stalls = np.full(num_steps, np.nan)
    for step in {0, 1, num_steps - 1} & set(run.simulated):
        stalls[step] = _phase_stall_s(run.simulated[step])
    steps = step_table(run.step_start_s, run.step_end_s, stalls)
    op_parts, memory_parts = [], []
    strings = TraceStrings()
    for step in sorted(set(expand_steps)):
        if step in run.simulated:
            phase_run = run.simulated[step]
            # A pipeline's phase (sim.pipeline_run) lays its stages' passes out itself.
            expand = getattr(phase_run, "expand", partial(_expand_phase, phase_run))
            ops, memory = expand(float(run.step_start_s[step]),
                                 {r: float(run.step_base_bytes[r][step]) for r in plan.ranks}, strings)
            op_parts.append(ops)
            memory_parts.append(memory)
    memory_parts.append({
        "rank": np.repeat(plan.ranks, num_steps),
        "time_s": np.tile(run.step_start_s, len(plan.ranks)),
        "bytes": np.concatenate([run.step_base_bytes[r] for r in plan.ranks]),
    })
    ops = _sorted_table(op_parts, OP_COLUMNS, "rank", "start_s", strings) if op_parts \
        else pd.DataFrame(columns=OP_COLUMNS)
    return Trace(ops, steps, _sorted_table(memory_parts, MEMORY_COLUMNS, "rank", "time_s"), peak_table(run.peak_bytes))


STRING_COLUMNS = frozenset({"stream", "kind", "name", "phase"})
"""The columns of an ``ops`` table holding strings: while a trace is built, codes of a
:class:`TraceStrings`."""


class TraceStrings:
    """The strings of a trace being built, each coded by an integer: the op columns of
    :data:`STRING_COLUMNS` are laid out as code arrays and decoded once, when the table is made
    (pandas turns a column of Python strings into its string dtype one element at a time, a
    large part of a trace's cost; from codes it takes them from the few distinct strings)."""

    def __init__(self):
        self._codes: dict[str, int] = {}

    def code(self, text: str) -> int:
        """The code of ``text``, new if it has none yet."""
        return self._codes.setdefault(text, len(self._codes))

    def decode(self, codes: np.ndarray):
        """The strings of ``codes`` as the column pandas would make of those strings (its default
        string dtype, whatever the version: an array for a DataFrame)."""
        return pd.Series(np.array(list(self._codes), dtype=object)).array.take(codes)


def _sorted_table(parts: list[dict[str, np.ndarray]], columns: list[str], first: str, then: str,
                  strings: TraceStrings | None = None) -> pd.DataFrame:
    """The table of ``parts`` (column arrays, one dict per part, rows in part order; the
    :data:`STRING_COLUMNS` as codes of ``strings``) sorted by ``first`` then ``then``, ties in
    their order: what concatenating their DataFrames and ``sort_values(kind="stable")
    .reset_index(drop=True)`` gives, with one DataFrame built instead of one per part (a plan
    simulates thousands of runs); numpy's lexsort is stable and sorts NaN last as pandas does."""
    table = {c: np.concatenate([part[c] for part in parts]) if len(parts) > 1 else parts[0][c] for c in columns}
    order = np.lexsort((table[then], table[first]))
    return pd.DataFrame({c: strings.decode(values[order]) if c in STRING_COLUMNS else values[order]
                         for c, values in table.items()})


def _phase_stall_s(run: PhaseRun) -> float:
    """The slowest rank's wait for weight loads in one simulated phase (s): per segment instance
    (:func:`sim.loader.stall_s`), times its repeats (a pipeline's phase knows its own)."""
    if hasattr(run, "stall_s"):
        return run.stall_s()
    return sum(seg.repeat * stall_s(seg, res) for seg, res in zip(run.phase.segments, run.results))


def _expand_phase(run: PhaseRun, start_s: float, base_bytes: dict[int, float], strings: TraceStrings
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Op rows (``OP_COLUMNS``, strings coded by ``strings``) and memory samples
    (``MEMORY_COLUMNS``) of every instance of every segment of one phase, as column arrays."""
    ops, memory = phase_columns(run, start_s, base_bytes, strings)
    return phase_ops(ops, str(run.phase.name), run.phase.step, strings), memory


def phase_ops(ops: dict[str, np.ndarray], phase: str, step: int, strings: TraceStrings) -> dict[str, np.ndarray]:
    """``ops`` (:func:`phase_columns`'s op columns) with the ``phase`` (coded by ``strings``) and
    ``step`` columns of their phase."""
    rows = len(ops["rank"])
    return {**ops, "phase": np.full(rows, strings.code(phase)), "step": np.full(rows, step, dtype=np.int64)}


def phase_columns(run: PhaseRun, start_s: float, base_bytes: dict[int, float], strings: TraceStrings
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The columns of :func:`_expand_phase`'s tables as arrays: op rows (every :class:`TraceEvent`
    field but ``phase`` and ``step``, which are the phase's; strings coded by ``strings``) and
    memory samples (``MEMORY_COLUMNS``), for a caller that lays out many phases (a pipeline's
    stage passes, :mod:`sim.pipeline_run`)."""
    phase = run.phase
    op_parts, mem_parts = [], []
    offset = start_s
    running_base = dict(base_bytes)
    for segment, result, layer0 in zip(phase.segments, run.results, phase.layer_of_segment):
        rows = []
        code = strings.code
        for rank in sorted(segment.programs):
            for i, op in enumerate(segment.programs[rank]):
                rows.append((rank, code(op.stream.value), code(op.kind.value), code(op.name),
                             -1 if op.layer is None else op.layer, result.starts[rank][i], result.ends[rank][i],
                             op.traffic_bytes, op.flops))
        if not rows:
            continue
        rank_col, stream, kind, name, op_layer, rel_start, rel_end, traffic, flops = map(np.array, zip(*rows))
        instance = np.arange(segment.repeat)
        n = len(rows)
        shift = offset + np.repeat(instance, n) * result.duration_s
        op_parts.append(dict(  # one row per op instance
            rank=np.tile(rank_col, segment.repeat), stream=np.tile(stream, segment.repeat),
            kind=np.tile(kind, segment.repeat), name=np.tile(name, segment.repeat),
            layer=(np.repeat(instance, n) + layer0) if layer0 is not None else np.tile(op_layer, segment.repeat),
            start_s=shift + np.tile(rel_start, segment.repeat), end_s=shift + np.tile(rel_end, segment.repeat),
            bytes=np.tile(traffic, segment.repeat), flops=np.tile(flops, segment.repeat)))
        # Consecutive ranks sharing one ledger (a tensor-parallel group's, sim.memory.phase_memory)
        # have the same samples but their base: laid out once for them all.
        for _, alike in groupby(sorted(segment.programs), key=lambda rank: id(segment_ledger(segment, result, rank))):
            alike = list(alike)
            ledger = segment_ledger(segment, result, alike[0])
            net = sum(ledger.net_bytes.values())
            k = len(ledger.times_s)
            if k:
                samples = k * segment.repeat
                mem_parts.append((np.repeat(alike, samples),
                                  np.tile(offset + np.repeat(instance, k) * result.duration_s
                                          + np.tile(ledger.times_s, segment.repeat), len(alike)),
                                  np.repeat([running_base[rank] for rank in alike], samples)
                                  + np.tile(np.repeat(instance, k) * net, len(alike))
                                  + np.tile(np.tile(ledger.running_bytes, segment.repeat), len(alike))))
            for rank in alike:
                running_base[rank] += segment.repeat * net
        offset += segment.repeat * result.duration_s
    ops = {column: np.concatenate([part[column] for part in op_parts]) for column in op_parts[0]}
    return ops, dict(zip(MEMORY_COLUMNS, map(np.concatenate, zip(*mem_parts))))


COLLECTIVE_KINDS = tuple(kind.value for kind in OpKind if kind.is_communication)
"""The ``kind`` values of collective calls in an ``ops`` table."""

CALL_KEYS = ["step", "layer", "name"]
"""Columns of an ``ops`` table that name one collective call across its ranks."""


def master_calls(calls: pd.DataFrame, keys: list[str] = CALL_KEYS, master: int | None = None) -> pd.DataFrame:
    """Each collective call as the master rank sees it, the split every consumer of a trace uses
    (the simulator's ``collective_in_place`` / ``collective_wait`` charges, the calibration that
    measures them, validation's error terms).

    The master's time inside a call splits into its wait for the last rank to arrive and the
    rest, from that arrival to its own end: ``wait_s = clip(min(end, last start) - start, 0)``,
    ``call_s = end - start - wait_s``. The simulator starts a collective when the last rank of its
    group arrives (:mod:`sim.engine`), so ``call_s`` is what it charges for the call itself.

    Args:
        calls: one row per rank and call, with ``rank``, ``start_s``, ``end_s`` (s on one clock)
            and the ``keys`` columns, which name a call across ranks.
        master: the master's rank (default: the lowest rank in ``calls``).

    Returns:
        The master's rows of ``calls`` with ``wait_s`` and ``call_s`` added (s).
    """
    if calls.empty:
        return calls.assign(wait_s=pd.Series(dtype=float), call_s=pd.Series(dtype=float))
    last_start = calls.groupby(keys, sort=False)["start_s"].max().rename("_last_start_s")
    master = calls["rank"].min() if master is None else master
    mine = calls[calls["rank"] == master].join(last_start, on=keys)
    wait = (np.minimum(mine["end_s"], mine["_last_start_s"]) - mine["start_s"]).clip(lower=0.0)
    return mine.drop(columns="_last_start_s").assign(wait_s=wait, call_s=mine["end_s"] - mine["start_s"] - wait)
