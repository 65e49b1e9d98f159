"""Files a run writes, simulated or measured: the tidy result table and the Chrome/Perfetto trace
(the HTML reports and terminal tables are presentation, in :mod:`validation.present`).

Every file is written to a temporary name beside its target and renamed into place, so an
interrupted run leaves either the previous file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from sim.metrics import with_calibration
from sim.plan import Stream
from sim.topology import Topology
from sim.trace import Trace

if TYPE_CHECKING:  # the orchestrator's result, read here; measured runs write without it
    from sim.simulate import SimulationResult

_TID = {"steps": 0, Stream.COMPUTE: 1, Stream.COMM: 2, Stream.LOADER: 3}  # thread per stream, steps first
_UMASK = os.umask(0)
os.umask(_UMASK)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` through a temporary file in the same directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as handle:
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
        device_names: the device name of each rank that appears; a trace gets processes for the
            ranks it has ops of (each replica its own group), or for all when it has none.
    """
    events: list[dict] = []
    for v_index, (name, trace) in enumerate(traces):
        present = set(trace.ops["rank"].astype(int))
        for rank, device in device_names.items():
            if present and rank not in present:
                continue
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


def read_chrome_trace(data: Mapping, variant: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ops and steps of variant index ``variant`` in a :func:`chrome_trace` (a simulated or a
    measured run's ``trace.json``, parsed), times in seconds: ops with the columns
    ``rank, stream, kind, name, phase, step, layer, start_s, end_s``, steps ``step, phase, start_s,
    end_s`` (once, from the lowest rank's step spans).

    Raises:
        KeyError: ``data`` is not in :func:`chrome_trace`'s format.
    """
    streams = {tid: stream for stream, tid in _TID.items()}
    ops, steps = [], []
    events = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["pid"] // 1000 == variant]
    first = min((e["pid"] for e in events), default=None)
    for event in events:
        start_s, end_s = event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6
        if event["cat"] == "step":
            if event["pid"] == first:
                phase, step = event["name"].rsplit(" ", 1)
                steps.append({"step": int(step), "phase": phase, "start_s": start_s, "end_s": end_s})
            continue
        args = event["args"]
        ops.append({"rank": event["pid"] % 1000, "stream": str(streams[event["tid"]]), "kind": event["cat"],
                    "name": event["name"], "phase": args["phase"], "step": int(args["step"]),
                    "layer": int(args["layer"]), "start_s": start_s, "end_s": end_s})
    return (pd.DataFrame(ops, columns=["rank", "stream", "kind", "name", "phase", "step", "layer", "start_s", "end_s"]),
            pd.DataFrame(steps, columns=["step", "phase", "start_s", "end_s"]).sort_values("step", ignore_index=True))


def device_names(topology: Topology, ranks: Sequence[int]) -> dict[int, str]:
    """Rank -> device name, for the ranks of a run."""
    return {rank: topology.devices[rank].name for rank in ranks}


def write_files(out_dir: Path, files: Mapping[str, str | bytes]) -> list[Path]:
    """Write each ``name: text`` (or bytes) into ``out_dir`` atomically; returns the paths written."""
    paths = []
    for name, text in files.items():
        write_atomic(out_dir / name, text)
        paths.append(out_dir / name)
    return paths


def simulation_files(result: SimulationResult) -> dict[str, str]:
    """``results.csv`` (with each variant's :data:`sim.metrics.CALIBRATION_COLUMN`) and
    ``trace.json`` of a simulation, by file name."""
    traces = [labelled for v in result.variants for labelled in v.traces()]
    trace = chrome_trace(traces, device_names(result.topology, result.ranks))
    return {"results.csv": results_csv(with_calibration(result.results, result.calibrations)),
            "trace.json": json.dumps(trace, separators=(",", ":"))}
