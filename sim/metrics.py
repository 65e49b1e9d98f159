"""Metrics of a run, computed from its trace, as rows of the tidy result table.

Result table (one row per value; shared with measured runs so the two join):
``scenario, variant, source, metric, value, unit, device`` (device empty for whole-run metrics);
a simulated run's file adds ``calibration`` (:data:`CALIBRATION_COLUMN`).

Definitions (as vLLM and MLPerf Inference use them):

* ``ttft_s``: time to first token, from the start of the prefill to the end of the LM head that
  yields the first output token.
* ``tpot_s``: time per output token after the first, the mean decode step time
  (``(end of last step - TTFT) / (output_tokens - 1)``); NaN with a single output token.
* ``decode_tokens_per_s``: tokens produced per second while decoding, ``batch_size / tpot_s``.
* ``e2e_latency_s``: from the start of the prefill to the last token.
* ``loader_stall_prefill_s``: the slowest rank's wait for streamed weights in the prefill;
  ``loader_stall_decode_s``: the same, mean per decode step (zero for resident weights).
* ``peak_memory_bytes`` (per device): the highest device memory in use during the run
  (:func:`peak_memory_bytes`).

The simulator and the runtime compute them with the same functions from the same trace tables
(:mod:`sim.trace`); the runtime per timed repeat, then summarised over repeats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd

from sim.trace import Trace
from sim.vocabulary import Calibration, Metric, PhaseKind, unit_of

RESULT_COLUMNS = ["scenario", "variant", "source", "metric", "value", "unit", "device"]
CALIBRATION_COLUMN = "calibration"
"""The column a simulated run's ``results.csv`` adds after :data:`RESULT_COLUMNS`: how each row's
variant was priced (:class:`sim.vocabulary.Calibration`: ``replay``, ``prediction`` or
``uncalibrated``), so that a replay of the calibrated cluster's own timings is never taken for a
prediction (:func:`with_calibration`). Measured runs' tables have none."""


def timing_metrics(trace: Trace, batch_size: int) -> dict[str, float]:
    """TTFT, TPOT, decode tokens/s and end-to-end latency (s, tokens/s) from ``trace.steps``."""
    # numpy on the columns: pandas' per-call overhead was a third of a plan candidate's simulation.
    phase, end_s = trace.steps["phase"].to_numpy(), trace.steps["end_s"].to_numpy()
    ttft = float(end_s[np.flatnonzero(phase == PhaseKind.PREFILL)[0]])
    decodes = int(np.count_nonzero(phase == PhaseKind.DECODE))
    e2e = float(end_s[-1])
    tpot = (e2e - ttft) / decodes if decodes else math.nan
    return {
        Metric.TTFT: ttft,
        Metric.TPOT: tpot,
        Metric.DECODE_TOKENS_PER_S: batch_size / tpot if decodes else math.nan,
        Metric.E2E_LATENCY: e2e,
    }


def loader_stall_metrics(trace: Trace) -> dict[str, float]:
    """``loader_stall_prefill_s`` and ``loader_stall_decode_s`` (mean per decode step; NaN without
    decode steps) in seconds, from the ``stall_s`` column of ``trace.steps``."""
    steps = trace.steps
    phase, stall_s = steps["phase"].to_numpy(), steps["stall_s"].to_numpy()
    decode = (phase == PhaseKind.DECODE) & ~pd.isna(stall_s)
    return {Metric.LOADER_STALL_PREFILL: float(stall_s[np.flatnonzero(phase == PhaseKind.PREFILL)[0]]),
            Metric.LOADER_STALL_DECODE: _mean_of_linear(steps["step"].to_numpy()[decode], stall_s[decode])}


def _mean_of_linear(steps: np.ndarray, values: np.ndarray) -> float:
    """The mean over every integer step from ``steps[0]`` to ``steps[-1]`` (ascending) of the
    linear interpolation of ``values`` between them; the plain mean when every step is given.

    The simulator gives a step table's stall only for the steps it simulated (the others are
    interpolated, :mod:`sim.timeline`); this is the mean over all of them without filling them
    in, and for a single interval exactly ``(first + last) / 2``.
    """
    if len(steps) == 0:
        return math.nan
    if len(steps) == 1:
        return float(values[0])
    count = steps[-1] - steps[0] + 1
    # Each interval [a, b] holds b - a + 1 steps whose interpolated values average (f(a) + f(b)) / 2;
    # an interior knot belongs to two intervals, so it is taken out once.
    total = sum((b - a + 1) / count * ((fa + fb) / 2)
                for a, b, fa, fb in zip(steps[:-1], steps[1:], values[:-1], values[1:]))
    return float(total - np.sum(values[1:-1]) / count)


def run_metrics(trace: Trace, batch_size: int) -> dict[str, float]:
    """Every whole-run metric of one generation: :func:`timing_metrics` and :func:`loader_stall_metrics`."""
    return timing_metrics(trace, batch_size) | loader_stall_metrics(trace)


def peak_memory_bytes(trace: Trace) -> dict[int, float]:
    """Per rank of the trace, the highest device memory in use (bytes): the larger of its
    high-water mark (``trace.peaks``) and its highest memory sample."""
    ranks = np.concatenate([trace.peaks["rank"].to_numpy(), trace.memory["rank"].to_numpy()])
    marks = pd.concat([trace.peaks["bytes"], trace.memory["bytes"]], ignore_index=True)
    # One grouped max (missing values skipped: a rank with none known peaks at NaN), not a mask
    # over every sample per rank (a pipeline's trace holds 64 ranks); Python numbers, ranks ascending.
    return {int(rank): peak for rank, peak in marks.groupby(ranks).max().items()}


def result_rows(scenario: str, variant: str, source: str, timing: dict[str, float],
                memory_by_device: dict[str, dict[str, float]]) -> pd.DataFrame:
    """Tidy rows for one variant: whole-run ``timing`` metrics and per-device memory metrics."""
    rows = [(scenario, variant, source, metric, value, unit_of(metric), "") for metric, value in timing.items()]
    for device, metrics in memory_by_device.items():
        rows += [(scenario, variant, source, metric, value, unit_of(metric), device) for metric, value in metrics.items()]
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)


def with_calibration(results: pd.DataFrame, modes: Mapping[str, Calibration]) -> pd.DataFrame:
    """``results`` (tidy rows of a simulated run) with the :data:`CALIBRATION_COLUMN`: each row's
    variant's mode, from ``modes`` (variant name -> mode; every variant of ``results`` in it).

    Raises:
        KeyError: a variant of ``results`` without a mode.
    """
    missing = sorted(set(results["variant"]) - set(modes))
    if missing:
        raise KeyError(f"no calibration mode for variants {missing}")
    return results.assign(**{CALIBRATION_COLUMN: [str(modes[v]) for v in results["variant"]]})
