"""Metrics of a run, computed from its trace, as rows of the tidy result table.

Result table (one row per value; shared with measured runs so the two join):
``scenario, variant, source, metric, value, unit, device`` (device empty for whole-run metrics).

Definitions (as vLLM and MLPerf Inference use them):

* ``ttft_s``: time to first token, from the start of the prefill to the end of the LM head that
  yields the first output token.
* ``tpot_s``: time per output token after the first, the mean decode step time
  (``(end of last step - TTFT) / (output_tokens - 1)``); NaN with a single output token.
* ``decode_tokens_per_s``: tokens produced per second while decoding, ``batch_size / tpot_s``.
* ``e2e_latency_s``: from the start of the prefill to the last token.
* ``peak_memory_bytes`` (per device): the highest device memory in use during the run.
"""

from __future__ import annotations

import math

import pandas as pd

from sim.trace import Trace

RESULT_COLUMNS = ["scenario", "variant", "source", "metric", "value", "unit", "device"]

def unit_of(metric: str) -> str:
    """The unit a metric's name ends with: ``*_per_s`` tokens/s, ``*_bytes`` bytes, ``*_s`` s."""
    if metric.endswith("_per_s"):
        return "tokens/s"
    if metric.endswith("_bytes"):
        return "bytes"
    if metric.endswith("_s"):
        return "s"
    return "count"


def timing_metrics(trace: Trace, batch_size: int) -> dict[str, float]:
    """TTFT, TPOT, decode tokens/s and end-to-end latency (s, tokens/s) from ``trace.steps``."""
    steps = trace.steps
    ttft = float(steps.loc[steps["phase"] == "prefill", "end_s"].iloc[0])
    decode = steps[steps["phase"] == "decode"]
    e2e = float(steps["end_s"].iloc[-1])
    tpot = (e2e - ttft) / len(decode) if len(decode) else math.nan
    return {
        "ttft_s": ttft,
        "tpot_s": tpot,
        "decode_tokens_per_s": batch_size / tpot if len(decode) else math.nan,
        "e2e_latency_s": e2e,
    }


def result_rows(scenario: str, variant: str, source: str, timing: dict[str, float],
                memory_by_device: dict[str, dict[str, float]]) -> pd.DataFrame:
    """Tidy rows for one variant: whole-run ``timing`` metrics and per-device memory metrics."""
    rows = [(scenario, variant, source, metric, value, unit_of(metric), "") for metric, value in timing.items()]
    for device, metrics in memory_by_device.items():
        rows += [(scenario, variant, source, metric, value, unit_of(metric), device) for metric, value in metrics.items()]
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)
