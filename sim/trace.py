"""The trace: what happened when, in one schema shared by the simulator and the runtime.

A :class:`Trace` holds three tidy tables (pandas DataFrames), all times in seconds from the run's
start:

* ``ops``: one row per op instance: ``rank, stream, kind, name, phase, step, layer, start_s, end_s,
  bytes, flops`` (``bytes``: memory traffic of a compute op, message size of a collective).
* ``steps``: one row per forward pass: ``step, phase, start_s, end_s`` (step 0 is the prefill).
* ``memory``: counter samples ``rank, time_s, bytes`` (device memory in use).

A run of hundreds of decode steps on an 80-layer model has millions of op instances, so ``ops``
holds the phases chosen when the trace is built (by default the prefill and the first decode step);
``steps`` always covers every step and is what the timing metrics are computed from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pandas as pd

from sim.memory import segment_ledger
from sim.timeline import PhaseRun, RunResult

OP_COLUMNS = ["rank", "stream", "kind", "name", "phase", "step", "layer", "start_s", "end_s", "bytes", "flops"]
STEP_COLUMNS = ["step", "phase", "start_s", "end_s"]
MEMORY_COLUMNS = ["rank", "time_s", "bytes"]


@dataclass(frozen=True)
class Trace:
    """Op, step and memory tables of one run (see the module docstring for their columns)."""

    ops: pd.DataFrame
    steps: pd.DataFrame
    memory: pd.DataFrame


def build_trace(run: RunResult, expand_steps: Iterable[int] = (0, 1)) -> Trace:
    """The trace of a simulated run, with op-level detail for the simulated steps in ``expand_steps``."""
    plan = run.plan
    num_steps = plan.num_phases
    steps = pd.DataFrame({
        "step": np.arange(num_steps),
        "phase": ["prefill"] + ["decode"] * (num_steps - 1),
        "start_s": run.step_start_s,
        "end_s": run.step_end_s,
    })
    op_frames, memory_frames = [], []
    for step in sorted(set(expand_steps)):
        if step in run.simulated:
            ops, memory = _expand_phase(run.simulated[step], float(run.step_start_s[step]),
                                        {r: float(run.step_base_bytes[r][step]) for r in plan.ranks})
            op_frames.append(ops)
            memory_frames.append(memory)
    memory_frames.append(pd.DataFrame({
        "rank": np.repeat(plan.ranks, num_steps),
        "time_s": np.tile(run.step_start_s, len(plan.ranks)),
        "bytes": np.concatenate([run.step_base_bytes[r] for r in plan.ranks]),
    }))
    ops = pd.concat(op_frames, ignore_index=True) if op_frames else pd.DataFrame(columns=OP_COLUMNS)
    memory = (pd.concat(memory_frames, ignore_index=True)
              .sort_values(["rank", "time_s"], kind="stable").reset_index(drop=True))
    return Trace(ops.sort_values(["rank", "start_s"], kind="stable").reset_index(drop=True), steps, memory)


def _expand_phase(run: PhaseRun, start_s: float, base_bytes: dict[int, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Op rows and memory samples of every instance of every segment of one phase."""
    phase = run.phase
    op_parts, mem_parts = [], []
    offset = start_s
    running_base = dict(base_bytes)
    for segment, result, layer0 in zip(phase.segments, run.results, phase.layer_of_segment):
        rows = []
        for rank in sorted(segment.programs):
            for i, op in enumerate(segment.programs[rank]):
                rows.append((rank, op.stream.value, op.kind.value, op.name, -1 if op.layer is None else op.layer,
                             result.starts[rank][i], result.ends[rank][i], op.traffic_bytes, op.flops))
        if not rows:
            continue
        rank_col, stream, kind, name, op_layer, rel_start, rel_end, traffic, flops = map(np.array, zip(*rows))
        # Object arrays of the same str objects: pandas makes its string columns from them 3x faster.
        stream, kind, name = (column.astype(object) for column in (stream, kind, name))
        instance = np.arange(segment.repeat)
        n = len(rows)
        shift = offset + np.repeat(instance, n) * result.duration_s
        op_parts.append(pd.DataFrame({
            "rank": np.tile(rank_col, segment.repeat), "stream": np.tile(stream, segment.repeat),
            "kind": np.tile(kind, segment.repeat), "name": np.tile(name, segment.repeat),
            "phase": phase.name, "step": phase.step,
            "layer": (np.repeat(instance, n) + layer0) if layer0 is not None else np.tile(op_layer, segment.repeat),
            "start_s": shift + np.tile(rel_start, segment.repeat), "end_s": shift + np.tile(rel_end, segment.repeat),
            "bytes": np.tile(traffic, segment.repeat), "flops": np.tile(flops, segment.repeat),
        }))
        for rank in sorted(segment.programs):
            ledger = segment_ledger(segment, result, rank)
            net = sum(ledger.net_bytes.values())
            k = len(ledger.times_s)
            if k:
                mem_parts.append((np.full(k * segment.repeat, rank),
                                  offset + np.repeat(instance, k) * result.duration_s
                                  + np.tile(ledger.times_s, segment.repeat),
                                  running_base[rank] + np.repeat(instance, k) * net
                                  + np.tile(ledger.running_bytes, segment.repeat)))
            running_base[rank] += segment.repeat * net
        offset += segment.repeat * result.duration_s
    memory = pd.DataFrame(dict(zip(MEMORY_COLUMNS, map(np.concatenate, zip(*mem_parts)))))
    return pd.concat(op_parts, ignore_index=True), memory
