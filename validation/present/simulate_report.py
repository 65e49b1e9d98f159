"""report.html: the scenario's variants side by side, as plotly figures in one self-contained page.

Where the variants run different layouts, the page opens with which layout wins TTFT, TPOT and
decode tokens/s and the term that decides each (:mod:`sim.layout_compare`); then comes one
sentence saying which variant to use and why (:func:`recommendation`). Figures: timing per
variant (TTFT, TPOT, decode tokens/s; labelled with each layout where they differ); where the
layouts differ, where each layout's devices spend the prefill and the first decode step;
peak memory per device against its capacity; the timeline of one decode step (baseline and
fastest variant); memory over time per device (baseline). A variant has one colour in every
figure, an op kind or step term one colour in every figure (:mod:`validation.present.colors`).
Displayed units are ms, GiB and tokens/s, named on every axis; the data stay SI.
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from models.weight_formats import WeightFormat
from sim.bottleneck import StepTerm, bottleneck
from sim.layout_compare import LayoutComparison, compare_layouts, layouts_differ
from sim.outputs import simulation_files, write_files
from sim.simulate import SimulationResult, VariantResult
from sim.units import duration_text
from sim.vocabulary import Metric, PhaseKind
from validation.present.layout import idle_warnings, layout_label, layout_lines
from validation.present.colors import CAPACITY_LINE, category_colors, op_kind_color, term_color
from validation.present.page import answer, came_from_html, priced_by, report_page
from validation.present.tables import change_column, summary_table

_GIB = 2**30
_MAX_TIMELINE_OPS = 4000  # more bars than this make the page sluggish; show the first layers then


def recommendation(result: SimulationResult) -> str:
    """One sentence: the variant to use (the lowest end-to-end latency among those that fit) and
    why, with its gain over the baseline and what bounds its decode step."""
    fitting = [v for v in result.variants if v.overflow is None]
    if not fitting:
        first = result.variants[0]
        return (f"No variant fits in memory ({first.overflow.describe(result.topology.devices[first.overflow.rank].name)}"
                "): use more devices, a sliding_window memory policy, or a smaller batch or prompt.")
    best = min(fitting, key=lambda v: (v.timing[Metric.E2E_LATENCY], v.variant.name))
    baseline = result.variant(result.scenario.baseline)
    gain = ""
    if best is not baseline and baseline.overflow is None:
        gain = (f", {100 * (1 - best.timing[Metric.E2E_LATENCY] / baseline.timing[Metric.E2E_LATENCY]):.0f}% below "
                f"the baseline {baseline.variant.name}")
    decode = 1 if result.scenario.config.workload.output_tokens > 1 else 0
    bound = bottleneck(result, best, decode)
    why = f"; its {'decode step' if decode else 'prefill'} is bound by {bound.split(' (')[0]}" if bound else ""
    return (f"Use {best.variant.name} ({best.variant.strategy}, {', '.join(best.algorithms) or 'no collectives'}): "
            f"the lowest end-to-end latency of the {len(fitting)} variants that fit in memory "
            f"({duration_text(best.timing[Metric.E2E_LATENCY])} per request{gain}){why}.")


def _timing_figure(result: SimulationResult, compared: bool) -> go.Figure:
    """TTFT, TPOT and decode tokens/s side by side, a bar per variant in its colour in each panel;
    ``compared``: each variant named with its layout."""
    colors = category_colors(v.variant.name for v in result.variants)
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT", "TPOT", "decode throughput"))
    panels = ((Metric.TTFT, 1e3, "TTFT (ms)"), (Metric.TPOT, 1e3, "TPOT (ms)"),
              (Metric.DECODE_TOKENS_PER_S, 1, "decode throughput (tokens/s)"))
    for v in result.variants:
        name = f"{v.variant.name} ({v.layout.label})" if compared else v.variant.name
        for col, (metric, scale, _) in enumerate(panels, 1):
            fig.add_trace(go.Bar(x=[name], y=[v.timing[metric] * scale], name=name, legendgroup=name,
                                 marker_color=colors[v.variant.name], showlegend=col == 1), row=1, col=col)
    for col, (_, _, title) in enumerate(panels, 1):
        fig.update_yaxes(title_text=title, row=1, col=col)
        fig.update_xaxes(title_text="layout" if compared else "variant", showticklabels=not compared, row=1, col=col)
    fig.update_layout(title="Timing per layout" if compared else "Timing per variant", height=420)
    return fig


def _breakdown_figure(comparison: LayoutComparison) -> go.Figure:
    """Per layout, where its devices spend the prefill and the first decode step: stacked bars
    of each term's mean seconds per device (:func:`sim.bottleneck.step_breakdown`)."""
    phases = ((PhaseKind.PREFILL, "prefill (TTFT)"), (PhaseKind.DECODE, "first decode step (TPOT)"))
    fig = make_subplots(rows=1, cols=2, subplot_titles=[title for _, title in phases])
    names = [row.title for row in comparison.rows]
    for term in StepTerm:
        shown = False
        for col, (phase, _) in enumerate(phases, 1):
            seconds = [row.breakdown.get(phase, {}).get(term, 0.0) * 1e3 for row in comparison.rows]
            if not any(seconds):
                continue
            fig.add_trace(go.Bar(x=names, y=seconds, name=term.value, legendgroup=term.value,
                                 marker_color=term_color(term), showlegend=not shown), row=1, col=col)
            shown = True
    for col, (_, title) in enumerate(phases, 1):
        fig.update_yaxes(title_text="mean time per device (ms)", row=1, col=col)
        fig.update_xaxes(title_text="layout", row=1, col=col)
    fig.update_layout(title="Where each layout's devices spend a step", barmode="stack", height=480,
                      legend={"title": "term"})
    return fig


def _memory_peak_figure(result: SimulationResult) -> go.Figure:
    devices = [result.topology.devices[r] for r in result.ranks]
    colors = category_colors(v.variant.name for v in result.variants)
    fig = go.Figure()
    for v in result.variants:
        fig.add_trace(go.Bar(x=[d.name for d in devices], y=[v.peak_bytes.get(d.rank, 0) / _GIB for d in devices],
                             name=v.variant.name, marker_color=colors[v.variant.name]))
    fig.add_trace(go.Scatter(x=[d.name for d in devices], y=[d.memory_capacity_bytes / _GIB for d in devices],
                             mode="markers+lines", name="capacity", line=CAPACITY_LINE))
    fig.update_layout(title="Peak memory per device", barmode="group", height=420, yaxis_title="peak memory (GiB)",
                      xaxis_title="device")
    return fig


def _timeline_figure(vr: VariantResult) -> go.Figure:
    ops = vr.trace.ops[(vr.trace.ops["phase"] == PhaseKind.DECODE)]
    ops = ops[ops["step"] == ops["step"].min()] if len(ops) else ops
    note = ""
    if len(ops) > _MAX_TIMELINE_OPS:
        per_layer = max(1, (ops["layer"] >= 0).sum() // max(1, ops["layer"].max() + 1))
        keep = max(1, _MAX_TIMELINE_OPS // per_layer)
        ops = ops[ops["layer"] < keep]
        note = f" (first {keep} layers)"
    fig = go.Figure()
    t0 = ops["start_s"].min() if len(ops) else 0.0
    for kind, group in ops.groupby("kind", sort=True):
        fig.add_trace(go.Bar(
            y=[f"rank {r} {s}" for r, s in zip(group["rank"], group["stream"])],
            x=(group["end_s"] - group["start_s"]) * 1e3, base=(group["start_s"] - t0) * 1e3,
            orientation="h", name=kind, marker_color=op_kind_color(kind), customdata=group[["name", "layer"]].to_numpy(),
            hovertemplate="%{customdata[0]} layer %{customdata[1]}<br>start %{base:.3f} ms<br>%{x:.3f} ms"))
    fig.update_layout(title=f"One decode step, {vr.variant.name}{note}", xaxis_title="time from the step's start (ms)",
                      yaxis_title="rank and stream", legend={"title": "op kind"},
                      barmode="overlay", height=300 + 18 * ops[["rank", "stream"]].drop_duplicates().shape[0])
    rows = ops[["rank", "stream"]].drop_duplicates().sort_values(["rank", "stream"], kind="stable")
    fig.update_yaxes(autorange="reversed", categoryorder="array",
                     categoryarray=[f"rank {r} {s}" for r, s in zip(rows["rank"], rows["stream"])])
    return fig


def _memory_timeline_figure(vr: VariantResult, result: SimulationResult) -> go.Figure:
    fig = go.Figure()
    for rank, group in vr.trace.memory.groupby("rank", sort=True):
        fig.add_trace(go.Scatter(x=group["time_s"], y=group["bytes"] / _GIB, mode="lines", line_shape="hv",
                                 name=result.topology.devices[rank].name))
    fig.update_layout(title=f"Memory over time per device, {vr.variant.name}", xaxis_title="time from the request (s)",
                      yaxis_title="memory in use (GiB)", height=420)
    return fig


def _summary_html(result: SimulationResult, compared: bool) -> str:
    table = summary_table(result)
    layouts = {"layout": table["layout"], "devices": table["devices"]} if compared else {}
    shown = pd.DataFrame({
        "variant": table["variant"],
        **layouts,
        "algorithms": table["algorithms"],
        "TTFT": table[Metric.TTFT].map(duration_text),
        "TTFT vs baseline": table[change_column(Metric.TTFT)].map("{:+.1f}%".format),
        "TPOT": table[Metric.TPOT].map(duration_text),
        "TPOT vs baseline": table[change_column(Metric.TPOT)].map("{:+.1f}%".format),
        "decode tokens/s": table[Metric.DECODE_TOKENS_PER_S].map("{:.1f}".format),
        "max peak memory (GiB)": (table[Metric.MAX_PEAK_MEMORY] / _GIB).map("{:.2f}".format),
        "fits": table["fits_in_memory"].map({True: "yes", False: "no"}),
    })
    return shown.to_html(index=False, border=0)


def report_html(result: SimulationResult) -> str:
    """The whole report page as HTML text (plotly.js embedded, so it opens offline)."""
    baseline = result.variant(result.scenario.baseline)
    fastest = min(result.variants, key=lambda v: (v.timing[Metric.TPOT], v.variant.name))
    compared = layouts_differ(result)
    comparison = compare_layouts(result) if compared else None
    figures = [_timing_figure(result, compared)]
    if comparison is not None:
        figures.append(_breakdown_figure(comparison))
    figures += [_memory_peak_figure(result), _timeline_figure(baseline)]
    if fastest is not baseline:
        figures.append(_timeline_figure(fastest))
    figures.append(_memory_timeline_figure(baseline, result))
    config = result.scenario.config
    overflows = [f"<li>{html.escape(v.variant.name)}: "
                 f"{html.escape(v.overflow.describe(result.topology.devices[v.overflow.rank].name))}</li>"
                 for v in result.variants if v.overflow is not None]
    parts = [
        *([] if comparison is None else [
            "<div class='answer'><b>Layouts compared</b> (the term: where the runner-up's devices spend more time, "
            "mean over its devices, prefill or first decode step):<ul>"
            + "".join(f"<li>{html.escape(line)}</li>" for line in comparison.sentences()) + "</ul></div>"]),
        answer(recommendation(result)),
        f"<p>{html.escape(config.description)}</p>",
        f"<p>Model {html.escape(result.scenario.model.name)} ({html.escape(result.scenario.model.dtype)}"
        f"{'' if result.scenario.model.weights == WeightFormat.NATIVE else f', {result.scenario.model.weights} weights'}), "
        f"{html.escape(layout_label(result))}, batch {config.workload.batch_size}, "
        f"prompt {config.workload.prompt_tokens} tokens, {config.workload.output_tokens} output tokens, "
        f"network model {html.escape(config.network_model)}, "
        f"{priced_by(result.calibrated)}. "
        f"Baseline: {html.escape(result.scenario.baseline)}.</p>",
        *(f"<p>{html.escape(line)}</p>" for line in [*layout_lines(result), *idle_warnings(result)]),
        _summary_html(result, compared),
        came_from_html(result.calibrations, result.sources),
    ]
    if result.extrapolated:
        parts.append("<h2>Extrapolated outside the calibrated range</h2><ul>"
                     + "".join(f"<li>{html.escape(line)}</li>" for line in result.extrapolated) + "</ul>")
    if overflows:
        parts.append("<h2>Out of memory</h2><ul>" + "".join(overflows) + "</ul>")
    return report_page(f"hetsim simulate: {config.name}", parts, figures)


def write_outputs(result: SimulationResult, out_dir: Path) -> list[Path]:
    """Write results.csv, trace.json (:func:`sim.outputs.simulation_files`) and report.html into
    ``out_dir``; returns the paths written."""
    return write_files(out_dir, simulation_files(result) | {"report.html": report_html(result)})
