"""The calibration-transfer report page: a source x target heat map of the prediction error.

Reads the case table of :func:`validation.transfer.transfer_errors` (one row per source profile,
target cluster, prompt, variant and metric) and shows, per target (rows) and source (columns: each
cluster's profile, the others pooled, none), the median |error| of TTFT and TPOT, with the overall
figures above it.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from validation.transfer import TERM_THRESHOLD, behind_table, matrix_table, overall_table


def transfer_heatmap(errors: pd.DataFrame) -> go.Figure:
    """Median |error| (TTFT and TPOT) per target (y) and source profile (x), in percent; the
    diagonal is the same-cluster figure."""
    table = matrix_table(errors)
    percent = table.to_numpy(dtype=float) * 100
    text = [["" if np.isnan(v) else f"{v:.1f}%" for v in row] for row in percent]
    figure = go.Figure(go.Heatmap(z=percent, x=list(table.columns), y=list(table.index), text=text,
                                  texttemplate="%{text}", colorscale="Reds", zmin=0,
                                  colorbar={"title": "median |error| (%)"},
                                  hovertemplate="target %{y}<br>source %{x}<br>median |error| %{text}<extra></extra>"))
    figure.update_layout(title="Prediction error by source profile (columns) and target cluster (rows)",
                         xaxis_title="source profile", yaxis_title="target cluster", yaxis_autorange="reversed",
                         height=120 + 45 * len(table.index))
    return figure


_LEGEND = ("Signed error = simulated / measured - 1. Pairs: same = a cluster with its own profile; other = "
           "another cluster's profile; pooled = all other clusters' profiles; none = no profile.")


_TERMS = ("Per kind of pair and term: the cases that term is behind (of the simulated run's split of the metric "
          "against the target's measured split, the term contributing most in the error's direction; the terms of a "
          "case add up to its error), the median of its contribution and of their error. Every case's term is in "
          "the table below.")


def transfer_html(errors: pd.DataFrame) -> str:
    """The whole page: overall figures, the heat map, the terms behind the cases off by more than
    :data:`validation.transfer.TERM_THRESHOLD`, the per-case table."""
    overall = overall_table(errors).copy()
    for column in ("median_abs_error", "p90_abs_error", "median_signed_error"):
        overall[column] = overall[column].map(lambda v: f"{v:+.1%}" if column.endswith("signed_error") else f"{v:.1%}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>hetsim calibration transfer</title></head><body>"
            "<h1>Calibration transfer</h1>"
            "<p>" + html.escape(_LEGEND) + "</p>"
            + overall.to_html(index=False, border=0)
            + transfer_heatmap(errors).to_html(full_html=False, include_plotlyjs=True, div_id="transfer-heatmap")
            + f"<h2>The term behind each case off by more than {TERM_THRESHOLD:.0%}</h2>"
            + "<p>" + html.escape(_TERMS) + "</p>" + behind_table(errors).to_html(index=False, border=0,
                                                                                 float_format=lambda v: f"{v:+.1%}")
            + "<h2>Cases</h2>" + errors.to_html(index=False, border=0) + "</body></html>")
