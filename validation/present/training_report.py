"""A training scenario's terminal table and report.html: step time per variant and its breakdown,
one step's timeline showing backward compute and bucket allreduces overlapping, and memory by
category. Displayed units are ms, GiB and samples/s; the tables stay SI.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sim.outputs import chrome_trace, device_names, results_csv, write_files
from sim.training.simulate import MEMORY_CATEGORIES, TrainingSimulation, TrainingVariantResult
from sim.vocabulary import Metric

_GIB = 2**30
_MAX_TIMELINE_OPS = 6000  # more bars than this make the page sluggish; show the busiest ranks' then


def training_summary(result: TrainingSimulation) -> pd.DataFrame:
    """One row per variant: step time, its change against the baseline (%), samples/s, tokens/s,
    exposed communication, overlap ratio, micro-batch x accumulation, buckets, largest
    per-device memory and whether every device holds it (SI units)."""
    base = result.variant(result.scenario.baseline).metrics[Metric.STEP_TIME]
    rows = []
    for vr in result.variants:
        m = vr.metrics
        peak = max(memory.total for memory in vr.memory.values())
        fits = all(memory.total <= result.topology.devices[rank].memory_capacity_bytes
                   for rank, memory in vr.memory.items())
        rows.append({"variant": vr.variant.name, Metric.STEP_TIME: m[Metric.STEP_TIME],
                     "step_time_change_pct": (m[Metric.STEP_TIME] / base - 1) * 100,
                     Metric.SAMPLES_PER_S: m[Metric.SAMPLES_PER_S], Metric.TOKENS_PER_S: m[Metric.TOKENS_PER_S],
                     Metric.EXPOSED_COMMUNICATION: m[Metric.EXPOSED_COMMUNICATION],
                     Metric.OVERLAP_RATIO: m[Metric.OVERLAP_RATIO],
                     "micro_batches": f"{vr.micro_batch_size} x {vr.accumulation}",
                     "buckets": max((len(b) for b in vr.steps[-1].step.buckets), default=0),
                     Metric.MAX_PEAK_MEMORY: peak, "fits_in_memory": fits})
    return pd.DataFrame(rows)


def print_training_summary(result: TrainingSimulation, console: Console) -> None:
    """The per-variant table of a training scenario."""
    config = result.scenario.config
    w = config.workload
    table = Table(title=escape(f"{config.name}: {result.scenario.model.name}, TP={result.plan.tensor} x "
                               f"DP={result.plan.data}, global batch {w.global_batch_size} x {w.sequence_length} "
                               f"tokens (baseline {result.scenario.baseline})"))
    for column in ("variant", "step ms", "Δ", "samples/s", "tokens/s", "exposed comm ms", "overlap",
                   "micro x k", "buckets", "max peak GiB", "fits"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in training_summary(result).to_dict("records"):
        table.add_row(escape(row["variant"]), f"{row[Metric.STEP_TIME] * 1e3:.1f}",
                      f"{row['step_time_change_pct']:+.1f}%", f"{row[Metric.SAMPLES_PER_S]:.2f}",
                      f"{row[Metric.TOKENS_PER_S]:.0f}", f"{row[Metric.EXPOSED_COMMUNICATION] * 1e3:.1f}",
                      f"{row[Metric.OVERLAP_RATIO] * 100:.0f}%", row["micro_batches"], str(row["buckets"]),
                      f"{row[Metric.MAX_PEAK_MEMORY] / _GIB:.2f}",
                      "yes" if row["fits_in_memory"] else "[red]no[/red]")
    console.print(table)


def _breakdown_figure(result: TrainingSimulation) -> go.Figure:
    names = [v.variant.name for v in result.variants]
    fig = go.Figure()
    # backward_s holds the recomputation (sim.training.metrics): its bar is the rest of the pass.
    parts = {str(Metric.FORWARD_TIME): lambda m: m[Metric.FORWARD_TIME],
             "backward_s less recompute_s": lambda m: m[Metric.BACKWARD_TIME] - m[Metric.RECOMPUTE_TIME],
             **{str(metric): (lambda m, metric=metric: m[metric])
                for metric in (Metric.RECOMPUTE_TIME, Metric.OPTIMIZER_TIME, Metric.EXPOSED_COMMUNICATION)}}
    for name, value in parts.items():
        fig.add_trace(go.Bar(x=names, y=[value(v.metrics) * 1e3 for v in result.variants], name=name))
    fig.add_trace(go.Scatter(x=names, y=[v.metrics[Metric.STEP_TIME] * 1e3 for v in result.variants],
                             mode="markers", name="step time", marker={"symbol": "diamond", "size": 10,
                                                                       "color": "black"}))
    fig.update_layout(title="Step time per variant (ms): compute by phase on the busiest rank, and exposed "
                            "communication", barmode="stack", height=460, yaxis_title="ms")
    return fig


def _timeline_figure(vr: TrainingVariantResult) -> go.Figure:
    ops = vr.trace.ops
    last = ops["step"].max() if len(ops) else 0
    ops = ops[ops["step"] == last]
    note = ""
    if len(ops) > _MAX_TIMELINE_OPS:
        keep = sorted(ops["rank"].unique())[:2]
        ops = ops[ops["rank"].isin(keep)]
        note = f" (ranks {', '.join(map(str, keep))})"
    fig = go.Figure()
    t0 = ops["start_s"].min() if len(ops) else 0.0
    for (phase, kind), group in ops.groupby(["phase", "kind"], sort=True):
        fig.add_trace(go.Bar(
            y=[f"rank {r} {s}" for r, s in zip(group["rank"], group["stream"])],
            x=(group["end_s"] - group["start_s"]) * 1e3, base=(group["start_s"] - t0) * 1e3,
            orientation="h", name=f"{phase} {kind}", customdata=group[["name", "layer"]].to_numpy(),
            hovertemplate="%{customdata[0]} layer %{customdata[1]}<br>start %{base:.3f} ms<br>%{x:.3f} ms"))
    rows = ops[["rank", "stream"]].drop_duplicates().sort_values(["rank", "stream"], kind="stable")
    fig.update_layout(title=f"One step's last micro-batch, {vr.variant.name}{note}: backward compute and "
                            f"bucket allreduces", xaxis_title="ms from the micro-batch's start",
                      barmode="overlay", height=300 + 22 * len(rows))
    fig.update_yaxes(autorange="reversed", categoryorder="array",
                     categoryarray=[f"rank {r} {s}" for r, s in zip(rows["rank"], rows["stream"])])
    return fig


def _memory_figure(result: TrainingSimulation) -> go.Figure:
    names = [v.variant.name for v in result.variants]
    fig = go.Figure()
    largest = [max(v.memory, key=lambda r: (v.memory[r].total, -r)) for v in result.variants]
    for metric, field in MEMORY_CATEGORIES.items():
        fig.add_trace(go.Bar(x=names, y=[getattr(v.memory[r], field) / _GIB for v, r in zip(result.variants, largest)],
                             name=field))
    capacity = [result.topology.devices[r].memory_capacity_bytes / _GIB for r in largest]
    fig.add_trace(go.Scatter(x=names, y=capacity, mode="markers+lines", name="capacity",
                             line={"dash": "dash", "color": "black"}))
    fig.update_layout(title="Memory by category on the fullest device (GiB)", barmode="stack", height=460,
                      yaxis_title="GiB")
    return fig


def training_report_html(result: TrainingSimulation) -> str:
    """The report page as HTML text (plotly.js embedded, so it opens offline)."""
    config = result.scenario.config
    w = config.workload
    baseline = result.variant(result.scenario.baseline)
    figures = [_breakdown_figure(result), _timeline_figure(baseline)]
    best = min(result.variants, key=lambda v: (v.metrics[Metric.STEP_TIME], v.variant.name))
    if best is not baseline:
        figures.append(_timeline_figure(best))
    figures.append(_memory_figure(result))
    table = training_summary(result)
    shown = pd.DataFrame({
        "variant": table["variant"],
        "step time (ms)": (table[Metric.STEP_TIME] * 1e3).map("{:.1f}".format),
        "vs baseline": table["step_time_change_pct"].map("{:+.1f}%".format),
        "samples/s": table[Metric.SAMPLES_PER_S].map("{:.2f}".format),
        "tokens/s": table[Metric.TOKENS_PER_S].map("{:.0f}".format),
        "exposed communication (ms)": (table[Metric.EXPOSED_COMMUNICATION] * 1e3).map("{:.1f}".format),
        "overlap": (table[Metric.OVERLAP_RATIO] * 100).map("{:.0f}%".format),
        "micro-batch x accumulation": table["micro_batches"],
        "buckets": table["buckets"],
        "max peak memory (GiB)": (table[Metric.MAX_PEAK_MEMORY] / _GIB).map("{:.2f}".format),
        "fits": table["fits_in_memory"].map({True: "yes", False: "no"}),
    })
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>hetsim: {html.escape(config.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
        "td,th{padding:4px 10px;text-align:right} th{border-bottom:1px solid #888}</style></head><body>",
        f"<h1>hetsim simulate: {html.escape(config.name)} (training)</h1>",
        f"<p>{html.escape(config.description)}</p>",
        f"<p>Model {html.escape(result.scenario.model.name)}, tensor parallel {result.plan.tensor} x data parallel "
        f"{result.plan.data}, global batch {w.global_batch_size} sequences of {w.sequence_length} tokens, network "
        f"model {html.escape(config.network_model)}, roofline compute and datasheet links (uncalibrated). One "
        f"optimizer step per variant. Baseline: {html.escape(result.scenario.baseline)}.</p>",
        shown.to_html(index=False, border=0),
    ]
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=f"figure-{i}"))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_training_outputs(result: TrainingSimulation, out_dir: Path) -> list[Path]:
    """Write results.csv, trace.json (one step of each variant) and report.html into ``out_dir``;
    returns the paths written."""
    traces = [(v.variant.name, v.trace) for v in result.variants]
    trace = chrome_trace(traces, device_names(result.topology, result.ranks))
    return write_files(out_dir, {"results.csv": results_csv(result.results),
                                 "trace.json": json.dumps(trace, separators=(",", ":")),
                                 "report.html": training_report_html(result)})
