"""What ``hetsim simulate`` shows and writes for a serving scenario (:mod:`sim.serving`): a terminal
table per variant, ``results.csv`` (the tidy table), ``requests.csv`` (every request's times) and
``report.html`` (TTFT and TPOT distributions over requests per variant)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sim.outputs import results_csv, write_files
from sim.serving.simulate import ServingResult
from sim.vocabulary import Metric


def print_serving(result: ServingResult, console: Console) -> None:
    """The per-variant table (ms, tokens/s, requests/s) and one sentence naming the best variant."""
    w = result.scenario.config.workload
    lengths = f"prompt {w.prompt_tokens}, output {w.output_tokens}" if w.trace is None else f"trace {w.trace}"
    table = Table(title=escape(f"{result.scenario.name}: {result.scenario.model.name}, {result.layout}, "
                               f"{len(result.variants[0].run.served)} requests at {w.rate_per_s:g}/s, {lengths}"))
    columns = ["variant", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms",
               "output tok/s", "max running"]
    if w.slo is not None:
        columns += ["SLO met", "max rate req/s"]
    for column in columns:
        table.add_column(column, justify="left" if column == "variant" else "right")
    for vr in result.variants:
        m = vr.metrics
        cells = [vr.variant.name, *(f"{m[Metric.TTFT.percentile(q)] * 1e3:.1f}" for q in (50, 90, 99)),
                 *(f"{m[Metric.TPOT.percentile(q)] * 1e3:.1f}" for q in (50, 90, 99)),
                 f"{m[Metric.OUTPUT_TOKENS_PER_S]:.1f}", str(vr.run.max_running)]
        if w.slo is not None:
            cells += [f"{m[Metric.SLO_ATTAINED] * 100:.0f}%",
                      f"{m[Metric.MAX_REQUEST_RATE]:.3g}" if Metric.MAX_REQUEST_RATE in m else "n/a"]
        table.add_row(*cells)
    console.print(table)
    console.print(escape(verdict(result)))


def verdict(result: ServingResult) -> str:
    """One sentence: which variant to use and why (the highest sustainable rate under the SLO, else
    the lowest p90 TTFT)."""
    w = result.scenario.config.workload
    if w.slo is not None and w.slo.ttft_s is not None:
        best = max(result.variants, key=lambda v: v.metrics[Metric.MAX_REQUEST_RATE])
        return (f"use {best.variant.name}: it sustains {best.metrics[Metric.MAX_REQUEST_RATE]:.3g} requests/s with "
                f"p{w.slo.percentile} TTFT and TPOT within the SLO, the most of {len(result.variants)} variants")
    best = min(result.variants, key=lambda v: v.metrics[Metric.TTFT.percentile(90)])
    return (f"use {best.variant.name}: the lowest p90 TTFT at {w.rate_per_s:g} requests/s "
            f"({best.metrics[Metric.TTFT.percentile(90)] * 1e3:.1f} ms)")


def requests_frame(result: ServingResult) -> pd.DataFrame:
    """Every served request of every variant: arrival, first token and finish (s), TTFT, TPOT."""
    rows = [(vr.variant.name, s.request.index, s.request.arrival_s, s.request.prompt_tokens,
             s.request.output_tokens, s.first_token_s, s.finish_s, s.ttft_s, s.tpot_s)
            for vr in result.variants for s in vr.run.served]
    return pd.DataFrame(rows, columns=["variant", "request", "arrival_s", "prompt_tokens", "output_tokens",
                                       "first_token_s", "finish_s", Metric.TTFT, Metric.TPOT])


def serving_html(result: ServingResult) -> str:
    """Plotly page: the distribution (ECDF) of TTFT and of TPOT over requests, one line per variant."""
    frame = requests_frame(result)
    figure = make_subplots(rows=1, cols=2, subplot_titles=("TTFT over requests", "TPOT over requests"))
    for i, (name, rows) in enumerate(frame.groupby("variant", sort=False)):
        for col, metric in ((1, Metric.TTFT), (2, Metric.TPOT)):
            values = rows[metric].dropna().sort_values() * 1e3
            share = [(k + 1) / len(values) for k in range(len(values))]
            figure.add_trace(go.Scatter(x=values, y=share, mode="lines", name=name, legendgroup=name,
                                        showlegend=col == 1, line={"color": _COLOURS[i % len(_COLOURS)]}),
                             row=1, col=col)
    figure.update_xaxes(title_text="TTFT (ms)", row=1, col=1)
    figure.update_xaxes(title_text="TPOT (ms)", row=1, col=2)
    figure.update_yaxes(title_text="share of requests", range=[0, 1])
    figure.update_layout(title=f"{result.scenario.name}: {verdict(result)}", template="plotly_white")
    return figure.to_html(include_plotlyjs=True, full_html=True)


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def write_serving(result: ServingResult, out_dir: Path) -> list[Path]:
    """Write results.csv, requests.csv and report.html into ``out_dir``; returns the paths."""
    return write_files(out_dir, {"results.csv": results_csv(result.results),
                                 "requests.csv": requests_frame(result).to_csv(index=False),
                                 "report.html": serving_html(result)})
