"""The calibration-transfer report page: a source x target heat map of the prediction error.

Reads the case table of :func:`validation.transfer.transfer_errors` (one row per source profile,
target cluster, prompt, variant and metric) and shows, per target (rows) and source (columns: each
cluster's profile, the others pooled, none), the median |error| of TTFT and TPOT, with the overall
figures above it; a training validation's (:func:`validation.training_transfer.transfer_cases`)
gets the same page with a heat map of its step time and one of its peak memory.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from validation.transfer import TERM_THRESHOLD, behind_table, matrix_table, overall_table


def transfer_heatmap(errors: pd.DataFrame, what: str = "") -> go.Figure:
    """Median |error| (of every case of ``errors``: TTFT and TPOT of an inference transfer; one
    metric, named by ``what``, of a training one) per target (y) and source profile (x), in
    percent; the diagonal is the same-cluster figure."""
    table = matrix_table(errors)
    percent = table.to_numpy(dtype=float) * 100
    text = [["" if np.isnan(v) else f"{v:.1f}%" for v in row] for row in percent]
    figure = go.Figure(go.Heatmap(z=percent, x=list(table.columns), y=list(table.index), text=text,
                                  texttemplate="%{text}", colorscale="Reds", zmin=0,
                                  colorbar={"title": "median |error| (%)"},
                                  hovertemplate="target %{y}<br>source %{x}<br>median |error| %{text}<extra></extra>"))
    figure.update_layout(title=f"Prediction error{' of ' + what if what else ''} by source profile (columns) and "
                               "target cluster (rows)",
                         xaxis_title="source profile", yaxis_title="target cluster", yaxis_autorange="reversed",
                         height=120 + 45 * len(table.index))
    return figure


_LEGEND = ("Signed error = simulated / measured - 1. Pairs: same = a cluster with its own profile; other = "
           "another cluster's profile; pooled = all other clusters' profiles; none = no profile.")


_TERMS = ("Per kind of pair and term: the cases that term is behind (of the simulated run's split of the metric "
          "against the target's measured split, the term contributing most in the error's direction; the terms of a "
          "case add up to its error), the median of its contribution and of their error. Every case's term is in "
          "the table below.")


def transfer_page(title: str, legend: str, overall: pd.DataFrame, heatmaps: dict[str, go.Figure],
                  errors: pd.DataFrame, notes: str = "", terms: str = _TERMS) -> str:
    """A transfer page: ``title``, the ``legend`` paragraph, the ``overall`` table
    (:func:`validation.transfer.overall_table`), each heat map (by its div id; the first loads
    plotly.js), ``notes`` (HTML, already escaped), the terms behind the cases of ``errors`` off by
    more than :data:`validation.transfer.TERM_THRESHOLD` (:func:`validation.transfer.behind_table`,
    explained by ``terms``) and the per-case table."""
    overall = overall.copy()
    for column in ("median_abs_error", "p90_abs_error", "median_signed_error"):
        overall[column] = overall[column].map(lambda v: f"{v:+.1%}" if column.endswith("signed_error") else f"{v:.1%}")
    figures = "".join(figure.to_html(full_html=False, include_plotlyjs=index == 0, div_id=div_id)
                      for index, (div_id, figure) in enumerate(heatmaps.items()))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>hetsim {html.escape(title.lower())}</title>"
            f"</head><body><h1>{html.escape(title)}</h1>"
            "<p>" + html.escape(legend) + "</p>"
            + overall.to_html(index=False, border=0) + figures + notes
            + f"<h2>The term behind each case off by more than {TERM_THRESHOLD:.0%}</h2>"
            + "<p>" + html.escape(terms) + "</p>" + behind_table(errors).to_html(index=False, border=0,
                                                                                float_format=lambda v: f"{v:+.1%}")
            + "<h2>Cases</h2>" + errors.to_html(index=False, border=0) + "</body></html>")


def transfer_html(errors: pd.DataFrame) -> str:
    """The inference transfer's page (:func:`transfer_page`): overall figures, the heat map of
    TTFT and TPOT, the terms behind the cases off by more than
    :data:`validation.transfer.TERM_THRESHOLD`, the per-case table."""
    return transfer_page("Calibration transfer", _LEGEND, overall_table(errors),
                         {"transfer-heatmap": transfer_heatmap(errors)}, errors)


_TRAINING_LEGEND = ("Signed error = simulated / measured - 1, of every case's step time and peak memory (per device). "
                    "Pairs: same = a cluster with its own profile (replay); other = another cluster's profile "
                    "(prediction); pooled = all other clusters' profiles (prediction); none = no profile.")
_TRAINING_TERMS = ("Per kind of pair and part: the cases that part is behind (of the parts measured beside a step "
                   "time, its phases and the rest of the step, or beside a peak, its memory categories, the one "
                   "contributing most in the error's direction; a case's parts add up to its error), the median of "
                   "its contribution and of their error.")


def training_transfer_html(cases: pd.DataFrame, pool: list[str]) -> str:
    """A training validation's transfer page (:func:`transfer_page`, from the case table of
    :func:`validation.training_transfer.transfer_cases`, step time and peak memory rows): the
    overall figures, a heat map per metric, what the pool is (``pool``: markdown lines of
    :func:`validation.training_transfer.pool_lines`), the parts behind the cases off by more than
    :data:`validation.transfer.TERM_THRESHOLD`, the per-case table."""
    metrics = list(dict.fromkeys(cases["metric"]))
    heatmaps = {f"transfer-heatmap-{metric}": transfer_heatmap(cases[cases["metric"] == metric], metric)
                for metric in metrics}
    notes = "<h2>The pooled profile</h2>" + "".join(
        f"<p>{html.escape(line.lstrip('- ').replace('**', ''))}</p>" for line in pool if line)
    return transfer_page("Calibration transfer: training", _TRAINING_LEGEND,
                         overall_table(cases, metrics=metrics, both=False), heatmaps, cases, notes, _TRAINING_TERMS)
