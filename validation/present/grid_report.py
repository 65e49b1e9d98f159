"""report.html of a grid sweep (``hetsim sweep SCENARIO --grid GRID.yaml``), and its verdict.

Both are built from the sweep's tidy table (:func:`validation.sweep_runner.tidy_table`: the rows
its store holds for the grid's points), so a resumed sweep reports every point, whichever run
computed it.

The verdict (:func:`grid_verdict`) names the point and variant that rank best among those that fit
(:func:`validation.present.sweep_table.objective`: a generation's TPOT, a training job's step
time, a serving run's maximum request rate) and why: of the axes and the variant, the one that
matters most, the one whose worst choice costs most when everything else is chosen at its best
(the best that fits at each of its values, the worst of those against the pick); a training
point adds the term that bounds its step (:func:`sim.training.metrics.bottleneck`).

The page opens with that sentence; then a figure per metric of the workload kind, a panel per
axis: at each of the axis's values, the best that fits per variant (a line, a variant in its
colour of every report, :mod:`validation.present.colors`) and, up to :data:`MAX_POINTS` rows,
every point-variant as a faint marker (an x where it does not fit), hover giving the point's
axes; the pick as a star. Each metric's axis names its unit (a duration in the unit its values
suit); an axis of the grid is labelled with its field, its values as the grid writes them
(``1Gbit/s``), and a bare number's unit after the field (:func:`sim.grid.axis_unit`:
``parallel.tensor (count)``, ``training.bucket_cap_mb (MB)``). Then the table of the terminal.
"""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.grid import axis_unit
from sim.training.metrics import bottleneck
from sim.vocabulary import WorkloadKind
from validation.present.colors import category_colors
from validation.present.page import answer, report_page
from validation.present.sweep_table import (GridColumn, fitting, objective, shown_columns, shown_rows,
                                            wide_results)

MAX_POINTS = 1000  # past this many point-variants, a figure draws only each value's best: the page stays light
_LOG_SPREAD = 30  # a metric spanning more than this factor is drawn on a log axis


def _where(row: pd.Series, axes: list[str]) -> str:
    return ", ".join(f"{a} = {row[a]}" for a in axes)


def _decisive(fits: pd.DataFrame, factors: list[str], column: GridColumn, best: float) -> str:
    """The clause naming the factor (an axis, or ``variant``) that matters most (see the module
    docstring) with its worst value's best; '' where no factor changes the metric."""
    found = []
    for position, factor in enumerate(factors):
        bests = fits.groupby(factor, sort=False)[column.metric].agg("min" if column.lower_wins else "max")
        if len(bests) < 2:
            continue
        worst_at = bests.idxmax() if column.lower_wins else bests.idxmin()
        worst = bests[worst_at]
        cost = worst / best if column.lower_wins else best / worst if worst > 0 else float("inf")
        found.append((cost, -position, factor, worst_at, worst))
    if not found or max(found)[0] <= 1:
        return ""
    _, _, factor, worst_at, worst = max(found)
    return (f"; {factor} matters most: the best that fits with {factor} = {worst_at} is {column.text(worst)} "
            f"({100 * (worst / best - 1):+.0f}%)")


def grid_verdict(tidy: pd.DataFrame, axes: list[str], kind: WorkloadKind) -> str:
    """One sentence: the point and variant to use and why (see the module docstring)."""
    wide = wide_results(tidy, axes)
    column = objective(kind, wide)
    fits = fitting(wide, column)
    if fits.empty:
        return "No point fits in memory and simulates: see the oom and error columns of results.csv."
    best = fits.iloc[0]
    others = [c for c in shown_columns(kind, wide) if c.metric != column.metric]
    figures = ", ".join(f"{c.long} {c.text(best[c.metric])}" for c in [column, *others] if pd.notna(best[c.metric]))
    text = (f"Use {_where(best, axes)} with variant {best['variant']}: {column.best} of the {len(fits)} of "
            f"{len(wide)} point-variants that fit ({figures})"
            + _decisive(fits, [*axes, "variant"], column, best[column.metric]))
    if kind is WorkloadKind.TRAINING and (bound := bottleneck(best.to_dict())):
        text += f"; its step is bound by {bound}"
    return text + "."


def _hover(rows: pd.DataFrame, axes: list[str], columns: list[GridColumn]) -> list[str]:
    return ["<br>".join([f"<b>{html.escape(str(r['variant']))}</b>",
                         *(f"{html.escape(a)} = {html.escape(str(r[a]))}" for a in axes),
                         *(f"{c.long}: {c.text(r[c.metric])}" for c in columns if pd.notna(r[c.metric])),
                         "fits" if not r["oom"] else f"does not fit: {html.escape(r['oom'])}"])
            for _, r in rows.iterrows()]


def _axis_title(axis: str, values: pd.Series) -> str:
    """The field ``axis`` with the unit its bare numbers are in (:func:`sim.grid.axis_unit`);
    values written with their unit (``1Gbit/s``) or without one (a strategy) show as written."""
    unit = axis_unit(axis)
    numeric = values.map(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)).all()
    return f"{axis} ({unit})" if unit and numeric else axis


def metric_figure(wide: pd.DataFrame, axes: list[str], column: GridColumn, hover: pd.Series,
                  pick: pd.Series | None) -> go.Figure:
    """``column`` against each axis (a panel each, see the module docstring); ``hover``: each row's
    hover text, by ``wide``'s index."""
    simulated = wide[(wide["error"] == "") & wide[column.metric].notna()]
    fits = fitting(wide, column)
    size, unit = column.display(simulated[column.metric])
    values = simulated[column.metric] / size
    log = len(values) > 0 and values.min() > 0 and values.max() / values.min() > _LOG_SPREAD
    colors = category_colors(wide["variant"])
    fig = make_subplots(rows=1, cols=len(axes), shared_yaxes=True, horizontal_spacing=0.04)
    for col, axis in enumerate(axes, 1):
        order = list(dict.fromkeys(wide[axis].astype(str)))
        for variant, rows in simulated.groupby("variant", sort=True):
            if len(simulated) <= MAX_POINTS:
                fig.add_trace(go.Scatter(
                    x=rows[axis].astype(str), y=rows[column.metric] / size, mode="markers",
                    name=f"{variant} (each point)", legendgroup=variant, showlegend=False, offsetgroup=variant,
                    opacity=0.35, marker={"color": colors[variant], "size": 7,
                                          "symbol": ["x" if oom else "circle" for oom in rows["oom"]]},
                    hovertext=list(hover[rows.index]), hoverinfo="text"), row=1, col=col)
            best = fits[fits["variant"] == variant].groupby(fits[axis].astype(str), sort=False)[column.metric]
            best = (best.min() if column.lower_wins else best.max()).reindex([o for o in order if o in best.groups])
            fig.add_trace(go.Scatter(
                x=list(best.index), y=best / size, mode="lines+markers", name=variant, legendgroup=variant,
                showlegend=col == 1, offsetgroup=variant, line={"color": colors[variant], "width": 2},
                hovertemplate=f"{html.escape(variant)}, {html.escape(axis)} = %{{x}}: best that fits %{{y:.4g}} {unit}"
                              "<extra></extra>"), row=1, col=col)
        if pick is not None and pd.notna(pick[column.metric]):
            fig.add_trace(go.Scatter(
                x=[str(pick[axis])], y=[pick[column.metric] / size], mode="markers", name="the pick",
                legendgroup="pick", showlegend=col == 1, offsetgroup=pick["variant"],
                marker={"symbol": "star", "size": 16, "color": "gold", "line": {"color": "black", "width": 1}},
                hovertext=[hover[pick.name]], hoverinfo="text"), row=1, col=col)
        fig.update_xaxes(title_text=_axis_title(axis, wide[axis]), type="category", categoryorder="array", categoryarray=order, row=1, col=col)
        fig.update_yaxes(title_text=f"{column.long} ({unit}{', log scale' if log else ''})",
                         type="log" if log else "linear", row=1, col=col)
    fig.update_layout(title=f"{column.long[0].upper()}{column.long[1:]} against each axis "
                            f"(lines: the {'lowest' if column.lower_wins else 'highest'} that fits, per variant)",
                      scattermode="group", height=460, legend={"title": "variant"})
    return fig


def grid_html(tidy: pd.DataFrame, axes: list[str], kind: WorkloadKind, title: str) -> str:
    """The report page of a sweep (see the module docstring)."""
    wide = wide_results(tidy, axes)
    column = objective(kind, wide)
    fits = fitting(wide, column)
    pick = fits.iloc[0] if len(fits) else None
    columns = shown_columns(kind, wide)
    simulated = wide[wide["error"] == ""]
    if len(simulated) > MAX_POINTS:  # only the pick is drawn point by point
        simulated = simulated.loc[[pick.name]] if pick is not None else simulated.iloc[:0]
    hover = pd.Series(_hover(simulated, axes, columns), index=simulated.index, dtype=object)
    figures = [metric_figure(wide, axes, c, hover, pick) for c in columns
               if ((wide["error"] == "") & wide[c.metric].notna()).any()]
    rows, more = shown_rows(tidy, axes, kind)
    refused = int((wide["error"] != "").sum())
    parts = [answer(grid_verdict(tidy, axes, kind)),
             f"<p>{len(wide)} point-variants over {html.escape(', '.join(axes))}: {len(fits)} fit in memory and "
             f"simulate, {int((wide['oom'] != '').sum())} do not fit, {refused} refused (their reason in the table and "
             "in results.csv). Every point's rows are in results.csv and results.parquet.</p>"]
    after = [f"<h2>Points{html.escape(f' ({more})' if more else '')}</h2>", rows.to_html(index=False, border=0)]
    return report_page(f"hetsim sweep: {title}", parts, figures, after)
