"""Files a run writes, simulated or measured: the tidy result table, the Chrome/Perfetto trace,
and the per-variant summary table.

Every file is written to a temporary name beside its target and renamed into place, so an
interrupted run leaves either the previous file or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from sim.simulate import SimulationResult
from sim.topology import Topology
from sim.trace import Trace

_TID = {"steps": 0, "compute": 1, "comm": 2, "loader": 3}
_UMASK = os.umask(0)
os.umask(_UMASK)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def results_csv(results: pd.DataFrame) -> str:
    """A tidy result table as CSV text (deterministic: fixed row order, repr floats)."""
    return results.to_csv(index=False, lineterminator="\n")


def chrome_trace(traces: Sequence[tuple[str, Trace]], device_names: Mapping[int, str]) -> dict:
    """Traces of several variants in the Chrome trace-event format (Perfetto opens it).

    One process per variant and rank (pid = 1000 * variant index + rank), threads for the step
    spans, the compute stream and the communication stream, and a ``memory`` counter per rank.
    Times are microseconds, as the format requires.

    Args:
        traces: (variant name, trace) pairs, in display order.
        device_names: the device name of each rank that appears.
    """
    events: list[dict] = []
    for v_index, (name, trace) in enumerate(traces):
        for rank, device in device_names.items():
            pid = 1000 * v_index + rank
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"{name} / rank {rank} ({device})"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            for thread, tid in _TID.items():
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
            for row in trace.steps.itertuples(index=False):
                events.append({"ph": "X", "name": f"{row.phase} {row.step}", "cat": "step", "pid": pid, "tid": 0,
                               "ts": row.start_s * 1e6, "dur": (row.end_s - row.start_s) * 1e6})
        for row in trace.ops.itertuples(index=False):
            events.append({"ph": "X", "name": row.name, "cat": row.kind, "pid": 1000 * v_index + int(row.rank),
                           "tid": _TID[row.stream], "ts": row.start_s * 1e6, "dur": (row.end_s - row.start_s) * 1e6,
                           "args": {"phase": row.phase, "step": int(row.step), "layer": int(row.layer),
                                    "bytes": float(row.bytes), "flops": float(row.flops)}})
        for row in trace.memory.itertuples(index=False):
            events.append({"ph": "C", "name": "memory", "pid": 1000 * v_index + int(row.rank),
                           "ts": row.time_s * 1e6, "args": {"bytes": float(row.bytes)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def device_names(topology: Topology, ranks: Sequence[int]) -> dict[int, str]:
    """Rank -> device name, for the ranks of a run."""
    return {rank: topology.devices[rank].name for rank in ranks}


def summary_table(result: SimulationResult) -> pd.DataFrame:
    """One row per variant: TTFT, TPOT, decode tokens/s, the largest per-device peak memory, whether
    it fits, and the change of each timing against the baseline (%; negative TTFT/TPOT = faster)."""
    baseline = result.variant(result.scenario.baseline)
    rows = []
    for vr in result.variants:
        row = {"variant": vr.variant.name, "algorithms": ", ".join(vr.algorithms)}
        for metric in ("ttft_s", "tpot_s", "decode_tokens_per_s"):
            value, base = vr.timing[metric], baseline.timing[metric]
            row[metric] = value
            row[f"{metric}_change_pct"] = (value / base - 1) * 100 if base and not math.isnan(base) else math.nan
        row["max_peak_memory_bytes"] = max(vr.run.peak_bytes.values())
        row["fits_in_memory"] = vr.overflow is None
        rows.append(row)
    return pd.DataFrame(rows)


def write_files(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """Write each ``name: text`` into ``out_dir`` atomically; returns the paths written."""
    paths = []
    for name, text in files.items():
        write_atomic(out_dir / name, text)
        paths.append(out_dir / name)
    return paths


def write_outputs(result: SimulationResult, out_dir: Path) -> list[Path]:
    """Write results.csv, trace.json and report.html into ``out_dir``; returns the paths written."""
    from sim.report import report_html

    traces = [(v.variant.name, v.trace) for v in result.variants]
    trace = chrome_trace(traces, device_names(result.topology, result.ranks))
    return write_files(out_dir, {"results.csv": results_csv(result.results),
                                 "trace.json": json.dumps(trace, separators=(",", ":")),
                                 "report.html": report_html(result)})
