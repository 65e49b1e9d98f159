"""A training scenario's terminal table and report.html: one sentence saying which variant to use
and why (:func:`recommendation`), step time per variant split into its terms, one step's
timeline showing backward compute and bucket allreduces overlapping, and memory by category. A
term, op kind or memory category has its colour of every report (:mod:`validation.present.colors`).
Displayed durations are in the unit their values suit (s or ms, named on the axis and in the
column), memory in GiB; the tables stay SI.
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

from sim.metrics import with_calibration
from sim.outputs import chrome_trace, device_names, results_csv, write_files
from sim.training.metrics import STEP_TERMS, bottleneck, step_terms
from sim.training.simulate import MEMORY_CATEGORIES, TrainingSimulation, TrainingVariantResult
from sim.units import duration_text, significant, time_unit
from sim.vocabulary import Metric, TrainingPhase
from validation.present.colors import (CAPACITY_LINE, MEMORY_CATEGORY_COLORS, TRAINING_TERM_COLORS,
                                       op_kind_color)
from validation.present.page import answer, came_from_html, priced_by, report_page

_GIB = 2**30
_MAX_TIMELINE_OPS = 6000  # more bars than this make the page sluggish; show the busiest ranks' then
_PHASE_PATTERNS = {TrainingPhase.BACKWARD.value: "/", TrainingPhase.RECOMPUTE.value: "x"}  # forward, optimizer: solid


def fits_in_memory(result: TrainingSimulation, vr: TrainingVariantResult) -> bool:
    """Whether every device holds the variant's step."""
    return all(memory.total <= result.topology.devices[rank].memory_capacity_bytes
               for rank, memory in vr.memory.items())


def training_summary(result: TrainingSimulation) -> pd.DataFrame:
    """One row per variant: step time, its change against the baseline (%), samples/s, tokens/s,
    exposed communication, overlap ratio, micro-batch x accumulation, buckets, largest
    per-device memory and whether every device holds it (SI units)."""
    base = result.variant(result.scenario.baseline).metrics[Metric.STEP_TIME]
    rows = []
    for vr in result.variants:
        m = vr.metrics
        rows.append({"variant": vr.variant.name, Metric.STEP_TIME: m[Metric.STEP_TIME],
                     "step_time_change_pct": (m[Metric.STEP_TIME] / base - 1) * 100,
                     Metric.SAMPLES_PER_S: m[Metric.SAMPLES_PER_S], Metric.TOKENS_PER_S: m[Metric.TOKENS_PER_S],
                     Metric.EXPOSED_COMMUNICATION: m[Metric.EXPOSED_COMMUNICATION],
                     Metric.OVERLAP_RATIO: m[Metric.OVERLAP_RATIO],
                     "micro_batches": f"{vr.micro_batch_size} x {vr.accumulation}",
                     "buckets": max((len(b) for b in vr.steps[-1].step.buckets), default=0),
                     Metric.MAX_PEAK_MEMORY: max(memory.total for memory in vr.memory.values()),
                     "fits_in_memory": fits_in_memory(result, vr)})
    return pd.DataFrame(rows)


def recommendation(result: TrainingSimulation) -> str:
    """One sentence: the variant to use (the shortest optimizer step among those that fit in
    memory) and why: its gain over the baseline (or, where the baseline wins, its lead over the
    runner-up), the term of the step (:func:`sim.training.metrics.step_terms`) that makes most of
    that difference, and the term that bounds its step (:func:`sim.training.metrics.bottleneck`)."""
    fitting = sorted((v for v in result.variants if fits_in_memory(result, v)),
                     key=lambda v: (v.metrics[Metric.STEP_TIME], v.variant.name))
    if not fitting:
        leanest = min(result.variants, key=lambda v: (max(m.total for m in v.memory.values()), v.variant.name))
        devices = result.topology.devices
        rank = max(leanest.memory, key=lambda r: (leanest.memory[r].total - devices[r].memory_capacity_bytes, -r))
        device = devices[rank]
        return (f"No variant fits in memory (the leanest, {leanest.variant.name}, needs "
                f"{leanest.memory[rank].total / _GIB:.2f} GiB on {device.name} of its "
                f"{device.memory_capacity_bytes / _GIB:.2f} GiB): use more devices, ZeRO-1, activation checkpointing "
                "or smaller micro-batches.")
    best, baseline = fitting[0], result.variant(result.scenario.baseline)
    other = baseline if best is not baseline and baseline in fitting else next(iter(fitting[1:]), None)
    step = best.metrics[Metric.STEP_TIME]
    why = ""
    if other is not None:
        theirs, ours = step_terms(other.metrics), step_terms(best.metrics)
        term = max(STEP_TERMS, key=lambda m: (theirs[m] - ours[m], m))
        whom = "the baseline" if other is baseline else "the runner-up"
        why = (f", {100 * (1 - step / other.metrics[Metric.STEP_TIME]):.0f}% below {whom} {other.variant.name} "
               f"because its {STEP_TERMS[term]} is {duration_text(theirs[term] - ours[term])} shorter")
    bound = bottleneck(best.metrics)
    which = (f"the shortest optimizer step of the {len(fitting)} variants that fit" if len(fitting) > 1 else
             f"the only one of the {len(result.variants)} variants that fits")
    return (f"Use {best.variant.name}: {which} in memory ({duration_text(step)}, "
            f"{significant(best.metrics[Metric.TOKENS_PER_S])} tokens/s){why}"
            + (f"; its step is bound by {bound}" if bound else "") + ".")


def print_training_summary(result: TrainingSimulation, console: Console) -> None:
    """The per-variant table of a training scenario, then the sentence saying which to use."""
    config = result.scenario.config
    w = config.workload
    table = training_summary(result)
    size, unit = time_unit(table[Metric.STEP_TIME])
    rich = Table(title=escape(f"{config.name}: {result.scenario.model.name}, TP={result.plan.tensor} x "
                              f"DP={result.plan.data}, global batch {w.global_batch_size} x {w.sequence_length} "
                              f"tokens (baseline {result.scenario.baseline})"))
    for column in ("variant", f"step {unit}", "Δ", "samples/s", "tokens/s", f"exposed comm {unit}", "overlap",
                   "micro x k", "buckets", "max peak GiB", "fits"):
        rich.add_column(column, justify="left" if column == "variant" else "right")
    for row in table.to_dict("records"):
        rich.add_row(escape(row["variant"]), significant(row[Metric.STEP_TIME] / size),
                     f"{row['step_time_change_pct']:+.1f}%", f"{row[Metric.SAMPLES_PER_S]:.2f}",
                     f"{row[Metric.TOKENS_PER_S]:.0f}", significant(row[Metric.EXPOSED_COMMUNICATION] / size),
                     f"{row[Metric.OVERLAP_RATIO] * 100:.0f}%", row["micro_batches"], str(row["buckets"]),
                     f"{row[Metric.MAX_PEAK_MEMORY] / _GIB:.2f}",
                     "yes" if row["fits_in_memory"] else "[red]no[/red]")
    console.print(rich)
    console.print(escape(recommendation(result)))


def _breakdown_figure(result: TrainingSimulation) -> go.Figure:
    """Per variant, its step's terms stacked (:func:`sim.training.metrics.step_terms`) and its step time."""
    names = [v.variant.name for v in result.variants]
    size, unit = time_unit(v.metrics[Metric.STEP_TIME] for v in result.variants)
    terms = [step_terms(v.metrics) for v in result.variants]
    fig = go.Figure()
    for metric, name in STEP_TERMS.items():
        fig.add_trace(go.Bar(x=names, y=[t[metric] / size for t in terms], name=name,
                             marker_color=TRAINING_TERM_COLORS[metric]))
    fig.add_trace(go.Scatter(x=names, y=[v.metrics[Metric.STEP_TIME] / size for v in result.variants],
                             mode="markers", name="step time", marker={"symbol": "diamond", "size": 10,
                                                                       "color": "black"}))
    fig.update_layout(title="Step time per variant: compute by phase on the busiest rank, and exposed communication",
                      barmode="stack", height=460, xaxis_title="variant",
                      yaxis_title=f"time in one optimizer step ({unit})", legend={"title": "term"})
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
    size, unit = time_unit([ops["end_s"].max() - t0] if len(ops) else [])
    for (phase, kind), group in ops.groupby(["phase", "kind"], sort=True):
        fig.add_trace(go.Bar(
            y=[f"rank {r} {s}" for r, s in zip(group["rank"], group["stream"])],
            x=(group["end_s"] - group["start_s"]) / size, base=(group["start_s"] - t0) / size,
            orientation="h", name=f"{phase} {kind}", customdata=group[["name", "layer"]].to_numpy(),
            marker={"color": op_kind_color(kind), "pattern": {"shape": _PHASE_PATTERNS.get(phase, "")}},
            hovertemplate=(f"%{{customdata[0]}} layer %{{customdata[1]}}<br>start %{{base:.4g}} {unit}"
                           f"<br>%{{x:.4g}} {unit}")))
    rows = ops[["rank", "stream"]].drop_duplicates().sort_values(["rank", "stream"], kind="stable")
    fig.update_layout(title=f"One step's last micro-batch, {vr.variant.name}{note}: backward compute (hatched) "
                            f"and bucket allreduces", xaxis_title=f"time from the micro-batch's start ({unit})",
                      yaxis_title="rank and stream", legend={"title": "phase and op kind"},
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
                             name=field.replace("_", " "), marker_color=MEMORY_CATEGORY_COLORS[metric]))
    capacity = [result.topology.devices[r].memory_capacity_bytes / _GIB for r in largest]
    fig.add_trace(go.Scatter(x=names, y=capacity, mode="markers+lines", name="capacity", line=CAPACITY_LINE))
    fig.update_layout(title="Memory by category on the fullest device", barmode="stack", height=460,
                      xaxis_title="variant", yaxis_title="memory on the fullest device (GiB)",
                      legend={"title": "category"})
    return fig


def training_report_html(result: TrainingSimulation) -> str:
    """The report page as HTML text (:func:`validation.present.page.report_page`)."""
    config = result.scenario.config
    w = config.workload
    baseline = result.variant(result.scenario.baseline)
    figures = [_breakdown_figure(result), _timeline_figure(baseline)]
    best = min(result.variants, key=lambda v: (v.metrics[Metric.STEP_TIME], v.variant.name))
    if best is not baseline:
        figures.append(_timeline_figure(best))
    figures.append(_memory_figure(result))
    table = training_summary(result)
    size, unit = time_unit(table[Metric.STEP_TIME])
    shown = pd.DataFrame({
        "variant": table["variant"],
        f"step time ({unit})": (table[Metric.STEP_TIME] / size).map(significant),
        "vs baseline": table["step_time_change_pct"].map("{:+.1f}%".format),
        "samples/s": table[Metric.SAMPLES_PER_S].map("{:.2f}".format),
        "tokens/s": table[Metric.TOKENS_PER_S].map("{:.0f}".format),
        f"exposed communication ({unit})": (table[Metric.EXPOSED_COMMUNICATION] / size).map(significant),
        "overlap": (table[Metric.OVERLAP_RATIO] * 100).map("{:.0f}%".format),
        "micro-batch x accumulation": table["micro_batches"],
        "buckets": table["buckets"],
        "max peak memory (GiB)": (table[Metric.MAX_PEAK_MEMORY] / _GIB).map("{:.2f}".format),
        "fits": table["fits_in_memory"].map({True: "yes", False: "no"}),
    })
    parts = [
        answer(recommendation(result)),
        f"<p>{html.escape(config.description)}</p>",
        f"<p>Model {html.escape(result.scenario.model.name)}, tensor parallel {result.plan.tensor} x data parallel "
        f"{result.plan.data}, global batch {w.global_batch_size} sequences of {w.sequence_length} tokens, network "
        f"model {html.escape(config.network_model)}, {priced_by(result.calibrated)}. One optimizer step per variant. Baseline: "
        f"{html.escape(result.scenario.baseline)}.</p>",
        shown.to_html(index=False, border=0),
        came_from_html(result.calibrations, result.sources),
    ]
    return report_page(f"hetsim simulate: {config.name} (training)", parts, figures)


def write_training_outputs(result: TrainingSimulation, out_dir: Path) -> list[Path]:
    """Write results.csv, trace.json (one step of each variant) and report.html into ``out_dir``;
    returns the paths written."""
    traces = [(v.variant.name, v.trace) for v in result.variants]
    trace = chrome_trace(traces, device_names(result.topology, result.ranks))
    return write_files(out_dir, {"results.csv": results_csv(with_calibration(result.results, result.calibrations)),
                                 "trace.json": json.dumps(trace, separators=(",", ":")),
                                 "report.html": training_report_html(result)})
