"""report.html: the scenario's variants side by side, as plotly figures in one self-contained page.

Figures: timing per variant (TTFT, TPOT, decode tokens/s); peak memory per device against its
capacity; the timeline of one decode step (baseline and fastest variant); memory over time per
device (baseline). Displayed units are ms, GiB and tokens/s; the data stay SI.
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.outputs import simulation_files, write_files
from sim.simulate import SimulationResult, VariantResult
from sim.vocabulary import Metric, PhaseKind
from validation.present.tables import change_column, summary_table

_GIB = 2**30
_MAX_TIMELINE_OPS = 4000  # more bars than this make the page sluggish; show the first layers then


def _timing_figure(result: SimulationResult) -> go.Figure:
    names = [v.variant.name for v in result.variants]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "TPOT (ms)", "decode tokens/s"))
    for col, (metric, scale) in enumerate(((Metric.TTFT, 1e3), (Metric.TPOT, 1e3), (Metric.DECODE_TOKENS_PER_S, 1)), 1):
        fig.add_trace(go.Bar(x=names, y=[v.timing[metric] * scale for v in result.variants], name=metric,
                             showlegend=False), row=1, col=col)
    fig.update_layout(title="Timing per variant", height=420)
    return fig


def _memory_peak_figure(result: SimulationResult) -> go.Figure:
    devices = [result.topology.devices[r] for r in result.ranks]
    fig = go.Figure()
    for v in result.variants:
        fig.add_trace(go.Bar(x=[d.name for d in devices], y=[v.run.peak_bytes.get(d.rank, 0) / _GIB for d in devices],
                             name=v.variant.name))
    fig.add_trace(go.Scatter(x=[d.name for d in devices], y=[d.memory_capacity_bytes / _GIB for d in devices],
                             mode="markers+lines", name="capacity", line={"dash": "dash", "color": "black"}))
    fig.update_layout(title="Peak memory per device (GiB)", barmode="group", height=420, yaxis_title="GiB")
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
            orientation="h", name=kind, customdata=group[["name", "layer"]].to_numpy(),
            hovertemplate="%{customdata[0]} layer %{customdata[1]}<br>start %{base:.3f} ms<br>%{x:.3f} ms"))
    fig.update_layout(title=f"One decode step, {vr.variant.name}{note}", xaxis_title="ms from step start",
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
    fig.update_layout(title=f"Memory over time per device, {vr.variant.name} (GiB)", xaxis_title="s",
                      yaxis_title="GiB", height=420)
    return fig


def _summary_html(result: SimulationResult) -> str:
    table = summary_table(result)
    shown = pd.DataFrame({
        "variant": table["variant"],
        "algorithms": table["algorithms"],
        "TTFT (ms)": (table[Metric.TTFT] * 1e3).map("{:.3f}".format),
        "TTFT vs baseline": table[change_column(Metric.TTFT)].map("{:+.1f}%".format),
        "TPOT (ms)": (table[Metric.TPOT] * 1e3).map("{:.3f}".format),
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
    figures = [_timing_figure(result), _memory_peak_figure(result), _timeline_figure(baseline)]
    if fastest is not baseline:
        figures.append(_timeline_figure(fastest))
    figures.append(_memory_timeline_figure(baseline, result))
    config = result.scenario.config
    overflows = [f"<li>{html.escape(v.variant.name)}: "
                 f"{html.escape(v.overflow.describe(result.topology.devices[v.overflow.rank].name))}</li>"
                 for v in result.variants if v.overflow is not None]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>hetsim: {html.escape(config.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
        "td,th{padding:4px 10px;text-align:right} th{border-bottom:1px solid #888}</style></head><body>",
        f"<h1>hetsim simulate: {html.escape(config.name)}</h1>",
        f"<p>{html.escape(config.description)}</p>",
        f"<p>Model {html.escape(result.scenario.model.name)} ({html.escape(result.scenario.model.dtype)}), "
        f"tensor parallel over {len(result.ranks)} devices, batch {config.workload.batch_size}, "
        f"prompt {config.workload.prompt_tokens} tokens, {config.workload.output_tokens} output tokens, "
        f"network model {html.escape(config.network_model)}, "
        f"{'calibrated from a profile' if result.calibrated else 'roofline compute and datasheet links (uncalibrated)'}. "
        f"Baseline: {html.escape(result.scenario.baseline)}.</p>",
        _summary_html(result),
    ]
    if result.extrapolated:
        parts.append("<h2>Extrapolated outside the calibrated range</h2><ul>"
                     + "".join(f"<li>{html.escape(line)}</li>" for line in result.extrapolated) + "</ul>")
    if overflows:
        parts.append("<h2>Out of memory</h2><ul>" + "".join(overflows) + "</ul>")
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=f"figure-{i}"))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_outputs(result: SimulationResult, out_dir: Path) -> list[Path]:
    """Write results.csv, trace.json (:func:`sim.outputs.simulation_files`) and report.html into
    ``out_dir``; returns the paths written."""
    return write_files(out_dir, simulation_files(result) | {"report.html": report_html(result)})
