"""Files of a validation run: error tables (CSV), a short summary (Markdown) and plots (HTML)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.machine_speed import speed_cell
from sim.outputs import write_files
from sim.vocabulary import Metric
from validation.terms import PHASE_METRIC, term_behind, term_summary
from validation.validate import ValidationReport

_SCALE = {Metric.TTFT: (1e3, "ms"), Metric.TPOT: (1e3, "ms"), Metric.DECODE_TOKENS_PER_S: (1, "tokens/s"),
          Metric.PEAK_MEMORY: (2**-20, "MiB"), Metric.COLLECTIVE: (1e3, "ms"),
          Metric.COLLECTIVE_IN_RUN: (1e3, "ms")}


def _scatter(report: ValidationReport) -> go.Figure:
    panels = [(m, g) for m, g in report.errors.groupby("metric", sort=True)]
    if len(report.collectives):
        panels.append((Metric.COLLECTIVE, report.collectives))
    if len(report.in_run):
        panels.append((Metric.COLLECTIVE_IN_RUN, report.in_run))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[
        f"{m} ({_SCALE[m][1]})" for m, _ in panels])
    for col, (metric, group) in enumerate(panels, 1):
        scale = _SCALE[metric][0]
        labels = [" / ".join(str(v) for v in row) for row in
                  group[[c for c in ("scenario", "prompt_tokens", "variant", "phase", "op", "algorithm", "size_bytes",
                                   "device")
                         if c in group.columns]].itertuples(index=False)]
        fig.add_trace(go.Scatter(x=group["measured"] * scale, y=group["simulated"] * scale, mode="markers",
                                 text=labels, name=metric, showlegend=False,
                                 hovertemplate="%{text}<br>measured %{x:.4g}<br>simulated %{y:.4g}"), row=1, col=col)
        low, high = (min(group["measured"].min(), group["simulated"].min()) * scale,
                     max(group["measured"].max(), group["simulated"].max()) * scale)
        for factor, dash in ((1.0, "solid"), (1.1, "dot"), (0.9, "dot")):
            fig.add_trace(go.Scatter(x=[low, high], y=[low * factor, high * factor], mode="lines", showlegend=False,
                                     line={"color": "grey", "dash": dash, "width": 1}), row=1, col=col)
        fig.update_xaxes(type="log", title_text="measured", row=1, col=col)
        fig.update_yaxes(type="log", title_text="simulated", row=1, col=col)
    fig.update_layout(title="Predicted against measured (lines: equal, +-10%)", height=480)
    return fig


def _terms_markdown(report: ValidationReport) -> list[str]:
    """Which term of the model the TTFT and TPOT errors come from (:mod:`validation.terms`)."""
    terms = report.terms
    if terms.empty:
        return []
    lines = ["", "## Where the TTFT and TPOT errors come from", "",
             "The master rank's step in the compared traces, split into terms (`validation/terms.py`): compute per "
             "op kind; collectives per kind, from the last rank's arrival; `wait`, for the last rank inside a "
             "collective; `other`, the rest of the metric. Measured terms are medians over every timed repeat, and "
             "a term's contribution is (simulated - measured) / measured TTFT or TPOT, so a case's contributions "
             "add up to its error.", "",
             "| phase | term | share of step | median abs contribution | p90 abs contribution | median signed |",
             "|---|---|---|---|---|---|"]
    for row in term_summary(terms).itertuples(index=False):
        lines.append(f"| {row.phase} | {row.term} | {row.share:.1%} | {row.median_abs_contribution:.1%} | "
                     f"{row.p90_abs_contribution:.1%} | {row.median_contribution:+.1%} |")
    errors = report.errors[report.errors["metric"].isin(PHASE_METRIC.values())]
    worst = errors[errors["error"].abs() > 0.10]
    if len(worst):
        lines += ["", "Cases off by more than 10%, and the term behind each (the largest contribution in the error's "
                  "direction):"]
    for case in worst.sort_values("error", key=abs, ascending=False).itertuples(index=False):
        phase = next(p for p, m in PHASE_METRIC.items() if m == case.metric)
        mine = terms[(terms["scenario"] == case.scenario) & (terms["prompt_tokens"] == case.prompt_tokens)
                     & (terms["variant"] == case.variant) & (terms["phase"] == phase)]
        if mine.empty:
            continue
        top = term_behind(mine, case.error)
        lines.append(f"- {case.scenario} prompt {case.prompt_tokens} {case.variant} {case.metric} {case.error:+.0%}: "
                     f"{top.term} {top.contribution:+.0%} of the step (simulated {top.simulated_s * 1e3:.1f} ms, "
                     f"measured {top.measured_s * 1e3:.1f} ms; all terms {mine['contribution'].sum():+.0%})")
    return lines


def _layouts_markdown(errors: pd.DataFrame) -> list[str]:
    """A layouts matrix's errors split by whether the profile measured the case's layout
    (``layout_seen``: the calibrated layout, replayed) or not (a prediction of a new layout), and
    per case; nothing for another matrix."""
    if "layout_seen" not in errors:
        return []
    timing = errors[errors["metric"].isin((Metric.TTFT, Metric.TPOT))]
    lines = ["", "## Layouts: the calibrated layout (replay) against layouts the profile never measured (prediction)", "",
             "| case | metric | cases | median abs error | p90 abs error | median signed error |", "|---|---|---|---|---|---|"]
    for (unseen, metric), group in timing.groupby([~timing["layout_seen"].astype(bool), "metric"], sort=True):
        seen = not unseen
        magnitude = group["error"].abs()
        lines.append(f"| {'calibrated layout (replay)' if seen else 'new layout (prediction)'} | {metric} | "
                     f"{len(group)} | {magnitude.median():.1%} | {magnitude.quantile(0.9):.1%} | "
                     f"{group['error'].median():+.1%} |")
    lines += ["", "| scenario | prompt | layout | profile measured it | metric | simulated ms | measured ms | error | "
                  "split half | steal | other load | machine vs calibration | error, compute rescaled (diagnosis) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in timing.itertuples(index=False):
        rescaled = getattr(row, "error_compute_rescaled", float("nan"))
        lines.append(f"| {row.scenario} | {row.prompt_tokens} | {row.variant} | {'yes' if row.layout_seen else 'no'} | "
                     f"{row.metric} | {row.simulated * 1e3:.1f} | {row.measured * 1e3:.1f} | {row.error:+.1%} | "
                     f"{row.split_half:.1%} | {row.cpu_steal:.1%} | {row.other_load:.1%} | "
                     f"{speed_cell(getattr(row, 'machine_slowdown', float('nan')))} | "
                     f"{'-' if pd.isna(rescaled) else f'{rescaled:+.1%}'} |")
    lines += ["", "Machine vs calibration: a reference op set (runtime.reference_timing) timed around the layout's "
                  "launch against its timing around the calibrating launch (the calibrated layout shares that "
                  "launch: as fast). Error, compute rescaled: the simulation with the profile's compute times "
                  "multiplied by that factor; it uses a timing made while measuring, so it is a diagnosis of the "
                  "machine's stretch, not a prediction."]
    return lines


def summary_markdown(report: ValidationReport, title: str) -> str:
    """The short summary kept beside the CSV tables."""
    lines = [f"# Validation: {title}", "", "Signed error = simulated / measured - 1. `collective_s`: collectives "
             "alone, at least 1 MiB or over links with injected delay (`collective_s_all`: every size); "
             "`collective_in_run_s`: the collective calls inside the runs, per variant, phase and size. "
             "Split half: the measurement against itself, the median of its even rounds against its odd "
             "rounds' (|even / odd - 1|), the noise under any simulator's error on this machine.", "",
             "| metric | cases | median abs error | p90 abs error | median signed error | split half median / p90 |",
             "|---|---|---|---|---|---|"]

    def percent(value) -> str:
        return f"{value:.1%}" if pd.notna(value) else ""

    for row in report.summary.itertuples(index=False):
        halves = (f"{percent(row.split_half_median)} / {percent(row.split_half_p90)}"
                  if pd.notna(getattr(row, "split_half_median", float("nan"))) else "")
        lines.append(f"| {row.metric} | {row.cases} | {row.median_abs_error:.1%} | {row.p90_abs_error:.1%} | "
                     f"{row.median_signed_error:+.1%} | {halves} |")
    ranking = report.ranking
    agreed = int(ranking["simulator_agrees"].sum()) if len(ranking) else 0
    lines += ["", f"Strategy ranking: the simulator orders {agreed} of {len(ranking)} pairs whose measured "
                  f"TTFT or TPOT differ by more than 10% as the measurement does."]
    wrong = ranking[~ranking["simulator_agrees"]] if len(ranking) else ranking
    for row in wrong.itertuples(index=False):
        lines.append(f"- wrong: {row.scenario} prompt {row.prompt_tokens} {row.metric}: {row.faster} measured "
                     f"{row.measured_difference:.0%} faster than {row.slower}")
    if "cpu_steal" in report.errors and report.errors["cpu_steal"].notna().any():
        steal = report.errors.drop_duplicates("scenario").set_index("scenario")
        lines += ["", "CPU time stolen by the hypervisor (/proc/stat), while each cluster's cases were measured: "
                      + ", ".join(f"{name} {value:.1%}" for name, value in steal["cpu_steal"].items()) + "."]
        if "calibration_cpu_steal" in steal:
            lines[-1] += (" While each cluster was calibrated: " + ", ".join(
                f"{name} {value:.1%}" for name, value in steal["calibration_cpu_steal"].items()) + ".")
        if "other_load" in steal and steal["other_load"].notna().any():
            lines += ["", "CPU time other processes on the machine took (/proc/stat less the ranks' /proc/<pid>/stat), "
                          "while each cluster's cases were measured: "
                          + ", ".join(f"{name} {value:.1%}" for name, value in steal["other_load"].items()) + "."]
            if "calibration_other_load" in steal:
                lines[-1] += (" While each cluster was calibrated: " + ", ".join(
                    f"{name} {value:.1%}" for name, value in steal["calibration_other_load"].items()) + ".")
    lines += _layouts_markdown(report.errors)
    lines += _terms_markdown(report)
    regimes = report.regimes
    if len(regimes):
        lines += ["", f"Memory regimes: the simulator's verdicts (fits in memory; decode stalls on weight loads, "
                      f"over 10% of TPOT) match the measurement in {int(regimes['agrees'].sum())} of "
                      f"{len(regimes)} cases."]
    # The table only when some case streams weights or overflows: otherwise every row is "fits, 0 ms".
    streaming = (regimes["stall_simulated_s"] > 0) | (regimes["stall_measured_s"] > 0) | ~regimes["fits_simulated"]
    if len(regimes) and streaming.any():
        lines += ["", "| scenario | prompt | variant | fits sim | fits meas | stall sim ms | stall meas ms |",
                  "|---|---|---|---|---|---|---|"]
        for row in regimes.itertuples(index=False):
            lines.append(f"| {row.scenario} | {row.prompt_tokens} | {row.variant} | {row.fits_simulated} | "
                         f"{row.fits_measured} | {row.stall_simulated_s * 1e3:.0f} | {row.stall_measured_s * 1e3:.0f} |")
    if len(report.claim):
        lines += ["", "## The seed's claim: allreduce_ln (best algorithm) against reduce_ln_bcast", "",
                  "| scenario | prompt | source | best allreduce | TTFT rlb ms | TTFT ar ms | tok/s rlb | tok/s ar |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in report.claim.itertuples(index=False):
            lines.append(f"| {row.scenario} | {row.prompt_tokens} | {row.source} | {row.best_allreduce} | "
                         f"{row.ttft_reduce_ln_bcast_s * 1e3:.1f} | {row.ttft_allreduce_ln_s * 1e3:.1f} | "
                         f"{row.tokens_per_s_reduce_ln_bcast:.2f} | {row.tokens_per_s_allreduce_ln:.2f} |")
    return "\n".join(lines) + "\n"


def write_validation(report: ValidationReport, out_dir: Path, title: str) -> list[Path]:
    """Write errors.csv, collectives.csv, in_run_collectives.csv, terms.csv, summary.csv, ranking.csv,
    claim.csv, regimes.csv, summary.md, report.html."""
    def csv(frame: pd.DataFrame) -> str:
        return frame.to_csv(index=False, lineterminator="\n")

    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>hetsim validation</title></head><body>"
            f"<h1>hetsim validate: {title}</h1>" + report.summary.to_html(index=False, border=0)
            + _scatter(report).to_html(full_html=False, include_plotlyjs=True, div_id="scatter")
            + "<h2>Where the TTFT and TPOT errors come from</h2>"
            + term_summary(report.terms).to_html(index=False, border=0)
            + "<h2>Ranking</h2>" + report.ranking.to_html(index=False, border=0)
            + "<h2>Errors</h2>" + report.errors.to_html(index=False, border=0) + "</body></html>")
    return write_files(out_dir, {
        "errors.csv": csv(report.errors), "collectives.csv": csv(report.collectives),
        "in_run_collectives.csv": csv(report.in_run), "terms.csv": csv(report.terms),
        "summary.csv": csv(report.summary), "ranking.csv": csv(report.ranking), "claim.csv": csv(report.claim),
        "regimes.csv": csv(report.regimes),
        "summary.md": summary_markdown(report, title), "report.html": page})
