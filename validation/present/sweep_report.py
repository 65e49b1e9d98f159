"""memory_report.html of a sweep (:mod:`sim.sweep`); its console tables are in :mod:`validation.present.tables`.

Per model, against the number of devices: the largest per-device peak memory against the device
capacity, TTFT and TPOT, one line per memory policy (and variant), so the cheapest policy that fits
reads off one column. Displayed units are GiB, ms (TPOT) and s (TTFT); the table stays SI.
"""

from __future__ import annotations

import html
import itertools

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.vocabulary import Metric

_GIB = 2**30


def policy_label(row: pd.Series) -> str:
    """``resident``, ``window 2`` or ``window 2, retain 1/4``, prefixed by the variant when several."""
    if row["memory_policy"] == "resident":
        return "resident"
    label = f"window {int(row['window'])}"
    return label + (f", retain 1/{int(row['retain_every'])}" if row["retain_every"] == row["retain_every"] else "")


def labels(sweep: pd.DataFrame) -> pd.Series:
    many = sweep["variant"].nunique() > 1
    return sweep.apply(lambda r: (f"{r['variant']}: " if many else "") + policy_label(r), axis=1)


def sweep_figure(sweep: pd.DataFrame) -> go.Figure:
    """Peak memory, TPOT and TTFT against devices; a column per model, a line per policy."""
    sweep = sweep.assign(label=labels(sweep))
    models = list(dict.fromkeys(sweep["model"]))
    fig = make_subplots(rows=3, cols=len(models), shared_xaxes=True, column_titles=models,
                        row_titles=["max peak memory per device (GiB)", "TPOT (ms)", "TTFT (s)"],
                        vertical_spacing=0.06, horizontal_spacing=0.05)
    colors = dict(zip(dict.fromkeys(sweep["label"]), itertools.cycle(_PALETTE)))  # any number of policies
    for col, model in enumerate(models, 1):
        rows = sweep[(sweep["model"] == model) & sweep["feasible"]]
        for label, line in rows.groupby("label", sort=False):
            line = line.sort_values("devices")
            hover = [f"{label}<br>{'fits' if fits else 'does not fit'}" for fits in line["fits"]]
            for row, (metric, scale) in enumerate(((Metric.MAX_PEAK_MEMORY, 1 / _GIB), (Metric.TPOT, 1e3),
                                                    (Metric.TTFT, 1)), 1):
                fig.add_trace(go.Scatter(
                    x=line["devices"], y=line[metric] * scale, mode="lines+markers", name=label,
                    legendgroup=label, showlegend=col == 1 and row == 1, line={"color": colors[label]},
                    marker={"symbol": ["circle" if f else "x" for f in line["fits"]], "size": 9},
                    hovertext=hover), row=row, col=col)
        if len(rows):
            devices = sorted(rows["devices"].unique())
            fig.add_trace(go.Scatter(x=devices, y=[rows[Metric.MEMORY_CAPACITY].min() / _GIB] * len(devices),
                                     mode="lines", name="device capacity", legendgroup="capacity",
                                     showlegend=col == 1, line={"dash": "dash", "color": "black"}), row=1, col=col)
    fig.update_yaxes(type="log", row=1)
    fig.update_yaxes(type="log", row=2)
    fig.update_xaxes(title_text="devices (tensor-parallel degree)", row=3)
    fig.update_layout(height=900, title="Memory policies: peak memory and its cost (x: does not fit)")
    return fig


def sweep_html(title: str, sweep: pd.DataFrame) -> str:
    """A self-contained page: the figure, then the table (infeasible points with their reason)."""
    shown = sweep.assign(policy=labels(sweep),
                         max_peak_gib=(sweep[Metric.MAX_PEAK_MEMORY] / _GIB).round(2),
                         **{Metric.TPOT: sweep[Metric.TPOT].round(3), Metric.TTFT: sweep[Metric.TTFT].round(2),
                            Metric.LOADER_STALL_DECODE: sweep[Metric.LOADER_STALL_DECODE].round(3)})
    table = shown[["model", "devices", "policy", "fits", "max_peak_gib", Metric.TTFT, Metric.TPOT,
                   Metric.LOADER_STALL_DECODE, "note"]].to_html(index=False, na_rep="")
    figure = sweep_figure(sweep).to_html(full_html=False, include_plotlyjs=True, div_id="sweep-figure")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body><h1>{html.escape(title)}</h1>{figure}{table}</body></html>")


_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
