"""memory_report.html of a sweep (:mod:`sim.sweep`); its console tables are in :mod:`validation.present.tables`.

The page opens with one sentence saying, per model, which memory policy on how many devices to
use and why (:func:`memory_verdict`). Per model, against the number of devices: the largest
per-device peak memory against the device capacity, TTFT and TPOT, one line per memory policy
(and variant) in its colour of every report (:mod:`validation.present.colors`), so the cheapest
policy that fits reads off one column. Displayed units are GiB, ms (TPOT) and s (TTFT), named on
every axis; the table stays SI.
"""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.parallel import UNEVEN_SHARES
from sim.units import duration_text
from sim.vocabulary import Metric
from validation.present.colors import CAPACITY_LINE, category_colors
from validation.present.page import answer, report_page

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


def _devices(count: float) -> str:
    return f"{int(count)} device{'s' * (int(count) != 1)}"


def _on(row: pd.Series) -> str:
    """``6 devices``, or ``6 devices split unevenly`` for a point whose note says so."""
    return _devices(row["devices"]) + (" split unevenly" if row["note"].startswith(UNEVEN_SHARES) else "")


def memory_verdict(sweep: pd.DataFrame) -> str:
    """One sentence: per model, the policy and device count to use (the lowest TPOT among the
    points that fit; fewer devices break a tie) and why: the faster point that does not fit and
    needs least memory, or else the fewest devices on which some policy fits."""
    sweep = sweep.assign(label=labels(sweep), _order=range(len(sweep)))
    clauses = []
    for model, rows in sweep[sweep["feasible"]].groupby("model", sort=False):
        capacity = rows[Metric.MEMORY_CAPACITY].min() / _GIB
        fits = rows[rows["fits"]].sort_values([Metric.TPOT, "devices", "_order"])
        if fits.empty:
            leanest = rows.sort_values([Metric.MAX_PEAK_MEMORY, "_order"]).iloc[0]
            clauses.append(f"no policy fits {model} on up to {_devices(rows['devices'].max())} (the leanest, "
                           f"{leanest['label']} on {_on(leanest)}, needs "
                           f"{leanest[Metric.MAX_PEAK_MEMORY] / _GIB:.2f} of {capacity:.3g} GiB per device)")
            continue
        best = fits.iloc[0]
        clause = (f"for {model} use {best['label']} on {_on(best)} "
                  f"({duration_text(best[Metric.TPOT])} per token, {best[Metric.MAX_PEAK_MEMORY] / _GIB:.2f} of "
                  f"{capacity:.3g} GiB per device), the lowest TPOT that fits")
        faster = rows[~rows["fits"] & (rows[Metric.TPOT] < best[Metric.TPOT])]
        fewest = fits.sort_values(["devices", Metric.TPOT, "_order"]).iloc[0]
        if len(faster):
            miss = faster.sort_values([Metric.MAX_PEAK_MEMORY, "_order"]).iloc[0]
            clause += (f" ({miss['label']} on {_on(miss)} would take "
                       f"{duration_text(miss[Metric.TPOT])} but needs {miss[Metric.MAX_PEAK_MEMORY] / _GIB:.2f} GiB)")
        elif fewest["devices"] < best["devices"]:
            clause += (f" ({fewest['label']} fits on as few as {_on(fewest)}, at "
                       f"{duration_text(fewest[Metric.TPOT])} per token)")
        clauses.append(clause)
    if not clauses:
        return "No point of the sweep can run: see the note column of sweep.csv."
    text = "; ".join(clauses)
    return text[0].upper() + text[1:] + "."


def sweep_figure(sweep: pd.DataFrame) -> go.Figure:
    """Peak memory, TPOT and TTFT against devices; a column per model, a line per policy."""
    sweep = sweep.assign(label=labels(sweep))
    models = list(dict.fromkeys(sweep["model"]))
    panels = ((Metric.MAX_PEAK_MEMORY, 1 / _GIB, "max peak memory per device (GiB, log scale)"),
              (Metric.TPOT, 1e3, "TPOT (ms, log scale)"), (Metric.TTFT, 1, "TTFT (s)"))
    fig = make_subplots(rows=3, cols=len(models), shared_xaxes=True, column_titles=models,
                        vertical_spacing=0.08, horizontal_spacing=0.07)
    colors = category_colors(sweep["label"])
    for col, model in enumerate(models, 1):
        rows = sweep[(sweep["model"] == model) & sweep["feasible"]]
        for label, line in rows.groupby("label", sort=False):
            line = line.sort_values("devices")
            hover = [f"{label}<br>{'fits' if fits else 'does not fit'}" for fits in line["fits"]]
            for row, (metric, scale, _) in enumerate(panels, 1):
                fig.add_trace(go.Scatter(
                    x=line["devices"], y=line[metric] * scale, mode="lines+markers", name=label,
                    legendgroup=label, showlegend=col == 1 and row == 1, line={"color": colors[label]},
                    marker={"symbol": ["circle" if f else "x" for f in line["fits"]], "size": 9},
                    hovertext=hover), row=row, col=col)
        if len(rows):
            devices = sorted(rows["devices"].unique())
            fig.add_trace(go.Scatter(x=devices, y=[rows[Metric.MEMORY_CAPACITY].min() / _GIB] * len(devices),
                                     mode="lines", name="device capacity", legendgroup="capacity",
                                     showlegend=col == 1, line=CAPACITY_LINE), row=1, col=col)
    for row, (_, _, title) in enumerate(panels, 1):
        fig.update_yaxes(title_text=title, row=row)
        fig.update_xaxes(title_text="devices (tensor-parallel degree)", showticklabels=True, row=row)
    fig.update_yaxes(type="log", row=1)
    fig.update_yaxes(type="log", row=2)
    fig.update_layout(height=1000, title="Memory policies: peak memory and its cost (x: does not fit)",
                      legend={"title": "memory policy"})
    return fig


def sweep_html(name: str, description: str, sweep: pd.DataFrame) -> str:
    """A self-contained page (:func:`validation.present.page.report_page`) for the scenario
    ``name``: the sentence, the ``description``, the figure, then the table (infeasible points
    with their reason)."""
    table = pd.DataFrame({
        "model": sweep["model"], "devices": sweep["devices"], "policy": labels(sweep),
        "fits": sweep["fits"].map({True: "yes", False: "no"}).where(sweep["feasible"], ""),
        "max peak memory (GiB)": (sweep[Metric.MAX_PEAK_MEMORY] / _GIB).round(2),
        "TTFT (s)": sweep[Metric.TTFT].round(2), "TPOT (s)": sweep[Metric.TPOT].round(3),
        "loader stall per decode step (s)": sweep[Metric.LOADER_STALL_DECODE].round(3), "note": sweep["note"]})
    return report_page(f"hetsim simulate: {name} (memory sweep)",
                       [answer(memory_verdict(sweep)), f"<p>{html.escape(description)}</p>"], [sweep_figure(sweep)],
                       [table.to_html(index=False, na_rep="", border=0)])
