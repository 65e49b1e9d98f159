"""What ``hetsim simulate`` shows and writes for a serving scenario (:mod:`sim.serving`): a terminal
table per variant and the sentence saying which to use and why (:func:`verdict`), ``results.csv``
(the tidy table), ``requests.csv`` (every request's times) and ``report.html`` (the sentence, the
table, and the TTFT and TPOT distributions over requests, a variant in its colour of every report:
:mod:`validation.present.colors`)."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sim.metrics import with_calibration
from sim.outputs import results_csv, write_files
from sim.serving.simulate import ServingResult
from sim.units import duration_text
from sim.vocabulary import Metric
from validation.present.colors import category_colors
from validation.present.page import answer, came_from_html, priced_by, report_page


def serving_summary(result: ServingResult) -> pd.DataFrame:
    """One row per variant, as shown (text): TTFT and TPOT percentiles (ms), output tokens/s, the
    most requests running at once and, under an SLO, the share of requests within it and the
    highest rate that meets it (requests/s)."""
    slo = result.scenario.config.workload.slo
    rows = []
    for vr in result.variants:
        m = vr.metrics
        row = {"variant": vr.variant.name,
               **{f"TTFT p{q} ms": f"{m[Metric.TTFT.percentile(q)] * 1e3:.1f}" for q in (50, 90, 99)},
               **{f"TPOT p{q} ms": f"{m[Metric.TPOT.percentile(q)] * 1e3:.1f}" for q in (50, 90, 99)},
               "output tok/s": f"{m[Metric.OUTPUT_TOKENS_PER_S]:.1f}", "max running": str(vr.run.max_running)}
        if slo is not None:
            row |= {"SLO met": f"{m[Metric.SLO_ATTAINED] * 100:.0f}%",
                    "max rate req/s": f"{m[Metric.MAX_REQUEST_RATE]:.3g}" if Metric.MAX_REQUEST_RATE in m else "n/a"}
        rows.append(row)
    return pd.DataFrame(rows)


def _title(result: ServingResult) -> str:
    w = result.scenario.config.workload
    lengths = f"prompt {w.prompt_tokens}, output {w.output_tokens}" if w.trace is None else f"trace {w.trace}"
    return (f"{result.scenario.name}: {result.scenario.model.name}, {result.layout}, "
            f"{len(result.variants[0].run.served)} requests at {w.rate_per_s:g}/s, {lengths}")


def print_serving(result: ServingResult, console: Console) -> None:
    """The per-variant table (ms, tokens/s, requests/s) and one sentence naming the best variant."""
    summary = serving_summary(result)
    table = Table(title=escape(_title(result)))
    for column in summary.columns:
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in summary.itertuples(index=False):
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)
    console.print(escape(verdict(result)))


def verdict(result: ServingResult) -> str:
    """One sentence: which variant to use and why: the highest rate it sustains within the SLO
    (where the scenario sets a TTFT objective, which the rate search needs), else the lowest p90
    TTFT at the scenario's rate; against the runner-up."""
    w = result.scenario.config.workload
    ranked = sorted(result.variants, key=lambda v: v.variant.name)
    if Metric.MAX_REQUEST_RATE in ranked[0].metrics:
        ranked.sort(key=lambda v: -v.metrics[Metric.MAX_REQUEST_RATE])
        best = ranked[0]
        runner = (f"; the runner-up {ranked[1].variant.name} sustains "
                  f"{ranked[1].metrics[Metric.MAX_REQUEST_RATE]:.3g}" if len(ranked) > 1 else "")
        return (f"Use {best.variant.name}: it sustains {best.metrics[Metric.MAX_REQUEST_RATE]:.3g} requests/s "
                f"with p{w.slo.percentile} TTFT and TPOT within the SLO, the most of the {len(ranked)} "
                f"variants{runner}.")
    p90 = Metric.TTFT.percentile(90)
    ranked.sort(key=lambda v: v.metrics[p90])
    best = ranked[0]
    runner = (f"; the runner-up {ranked[1].variant.name} takes {duration_text(ranked[1].metrics[p90])}"
              if len(ranked) > 1 else "")
    return (f"Use {best.variant.name}: the lowest p90 TTFT at {w.rate_per_s:g} requests/s "
            f"({duration_text(best.metrics[p90])}) of the {len(ranked)} variants{runner}.")


def requests_frame(result: ServingResult) -> pd.DataFrame:
    """Every served request of every variant: arrival, first token and finish (s), TTFT, TPOT."""
    rows = [(vr.variant.name, s.request.index, s.request.arrival_s, s.request.prompt_tokens,
             s.request.output_tokens, s.first_token_s, s.finish_s, s.ttft_s, s.tpot_s)
            for vr in result.variants for s in vr.run.served]
    return pd.DataFrame(rows, columns=["variant", "request", "arrival_s", "prompt_tokens", "output_tokens",
                                       "first_token_s", "finish_s", Metric.TTFT, Metric.TPOT])


def serving_html(result: ServingResult) -> str:
    """The report page: the sentence, the table, and the distribution (ECDF) of TTFT and of TPOT
    over requests, one line per variant."""
    frame = requests_frame(result)
    colors = category_colors(frame["variant"])
    figure = make_subplots(rows=1, cols=2, subplot_titles=("TTFT over requests", "TPOT over requests"))
    for name, rows in frame.groupby("variant", sort=False):
        for col, metric in ((1, Metric.TTFT), (2, Metric.TPOT)):
            values = rows[metric].dropna().sort_values() * 1e3
            share = [(k + 1) / len(values) for k in range(len(values))]
            figure.add_trace(go.Scatter(x=values, y=share, mode="lines", name=name, legendgroup=name,
                                        showlegend=col == 1, line={"color": colors[name]}),
                             row=1, col=col)
    figure.update_xaxes(title_text="TTFT (ms)", row=1, col=1)
    figure.update_xaxes(title_text="TPOT (ms)", row=1, col=2)
    figure.update_yaxes(title_text="share of requests at or below (fraction)", range=[0, 1])
    figure.update_layout(title="TTFT and TPOT over the requests, per variant", template="plotly_white",
                         legend={"title": "variant"})
    config = result.scenario.config
    parts = [answer(verdict(result)), f"<p>{html.escape(config.description)}</p>",
             f"<p>{html.escape(_title(result))}; {priced_by(result.calibrated)}. Every request's times are in requests.csv.</p>",
             serving_summary(result).to_html(index=False, border=0),
             came_from_html(result.calibrations, result.sources)]
    return report_page(f"hetsim simulate: {config.name} (serving)", parts, [figure])


def write_serving(result: ServingResult, out_dir: Path) -> list[Path]:
    """Write results.csv, requests.csv and report.html into ``out_dir``; returns the paths."""
    return write_files(out_dir, {"results.csv": results_csv(with_calibration(result.results, result.calibrations)),
                                 "requests.csv": requests_frame(result).to_csv(index=False),
                                 "report.html": serving_html(result)})
