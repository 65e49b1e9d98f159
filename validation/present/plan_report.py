"""What ``hetsim plan`` shows and writes: the terminal table, plan.csv / plan.parquet, report.html
and the pick's scenario file.

report.html says in one sentence what to use and why, then draws the Pareto frontiers of price
per hour against end-to-end latency and against decode tokens/s (a serving plan's: against the
maximum request rate; a training plan's: against step time and trained tokens/s; every simulated
configuration that fits, coloured by device type, hover for
its details), and how many candidates each stage of the search settled. Displayed units are $/h,
ms / s, tokens/s, requests/s, $ per million tokens and GiB; the files stay SI.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sim.outputs import write_files
from sim.planning.catalog import price_text
from sim.planning.outcome import PlanResult
from sim.planning.search import COST_PER_MILLION_TOKENS, SLO_TPOT, SLO_TTFT, Stage
from sim.units import duration_text
from sim.vocabulary import Metric
from validation.present.colors import category_colors
from validation.present.page import answer, report_page

_GIB = 2**30
PICK_FILE = "pick.yaml"
PICK_BATCH_FILE = "pick_batch.yaml"
"""A serving pick's layout at the batch it decodes at its maximum rate, for ``hetsim measure``."""


def _ms(value: float) -> str:
    return "" if pd.isna(value) else f"{value * 1e3:.1f}"


def _top_columns(result: PlanResult) -> dict[str, list[str]]:
    """The top 10's shown columns, by heading (SI figures in display units); a serving plan's
    give the maximum rate, $/Mtok and the SLO's percentiles at the target rate (named in
    their heading)."""
    top = result.top
    training = result.request.config.is_training
    columns = {"#": [str(int(r)) for r in top["rank"]], "cluster": list(top["cluster"]),
               "layout": list(top["parallel"] + ", " + top["variant"]) if training else
               list(top["parallel"] + ", " + top["variant"] + ", " + top["memory_policy"]),
               "$/h": [price_text(p) for p in top["price_per_hour"]]}
    if training:
        columns |= {"step": [duration_text(v) for v in top[Metric.STEP_TIME]],
                    "tokens/s": [f"{v:.3g}" for v in top[Metric.TOKENS_PER_S]],
                    "exposed comm.": [duration_text(v) for v in top[Metric.EXPOSED_COMMUNICATION]],
                    "peak GiB": [f"{v / _GIB:.1f}" for v in top[Metric.MAX_PEAK_MEMORY]],
                    "bottleneck": list(top["bottleneck"])}
    elif result.request.config.is_serving:
        q, target = result.request.config.slo.percentile, result.request.config.workload.rate_per_s
        # the percentiles are those at the target rate, not at the maximum rate beside them
        columns |= {"max req/s": [f"{r:.3g}" for r in top[Metric.MAX_REQUEST_RATE]],
                    "$/Mtok": [f"{c:.3g}" for c in top[COST_PER_MILLION_TOKENS]],
                    f"TTFT p{q} ms at {target:g}/s": [_ms(v) for v in top[SLO_TTFT]],
                    f"TPOT p{q} ms at {target:g}/s": [_ms(v) for v in top[SLO_TPOT]]}
        columns["bottleneck"] = list(top["bottleneck"])  # at the maximum rate
    else:
        columns |= {"TTFT ms": [_ms(v) for v in top[Metric.TTFT]], "TPOT ms": [_ms(v) for v in top[Metric.TPOT]],
                    "tokens/s": [f"{v:.0f}" for v in top[Metric.DECODE_TOKENS_PER_S]],
                    "peak GiB": [f"{v / _GIB:.1f}" for v in top[Metric.MAX_PEAK_MEMORY]],
                    "bottleneck": list(top["bottleneck"])}
    columns["versus the pick"] = [r["versus_pick"] or ("the pick" if r["meets_slo"] else f"misses {r['slo_miss']}")
                                  for _, r in top.iterrows()]
    return columns


def print_plan(result: PlanResult, console: Console, scenario_path: Path | None = None) -> None:
    """The top 10 as a table, the sentence, the stages and how to run the pick."""
    table = Table(title=f"hetsim plan {escape(result.request.name)}: top {len(result.top)} clusters, each with "
                        "its best layout")
    columns = _top_columns(result)
    for name in columns:
        table.add_column(name, justify="left" if name in ("cluster", "layout", "bottleneck", "versus the pick")
                         else "right")
    for row in zip(*columns.values()):
        table.add_row(*(escape(cell) for cell in row))
    if len(result.top):  # an empty table says nothing the sentence does not
        console.print(table)
    console.print(escape(result.recommendation))
    stages = result.table["stage"].value_counts()
    console.print(f"{len(result.table)} candidates in {result.elapsed_s:.1f} s: "
                  + ", ".join(f"{int(stages.get(stage, 0))} {stage}" for stage in Stage if stages.get(stage, 0)))
    for note in result.notes:
        console.print(f"  outside the profile's context: {escape(note)}")
    if scenario_path is not None:
        whose = "the pick's" if result.pick is not None else "the closest miss's (it meets no plan)"
        console.print(f"{whose} scenario: {escape(str(scenario_path))}; run it with:")
        for command in result.commands(scenario_path, scenario_path.with_name(PICK_BATCH_FILE)):
            console.print(f"  {escape(command)}")


def _hover(frame: pd.DataFrame) -> list[str]:
    return [f"<b>{html.escape(r['cluster'])}</b><br>{html.escape(r['parallel'])}, {html.escape(r['variant'])} "
            f"({html.escape(r['algorithms'])}), "
            f"{html.escape(r['memory_policy'])}<br>${price_text(r['price_per_hour'])}/h, {int(r['num_devices'])} devices<br>"
            + (f"maximum {r[Metric.MAX_REQUEST_RATE]:.3g} requests/s, ${r[COST_PER_MILLION_TOKENS]:.3g} per million "
               "output tokens; " if Metric.MAX_REQUEST_RATE in r else
               f"step {duration_text(r[Metric.STEP_TIME])}, "
               f"{r[Metric.TOKENS_PER_S]:.3g} tokens/s<br>peak {r[Metric.MAX_PEAK_MEMORY] / _GIB:.1f} GiB; "
               if Metric.STEP_TIME in r else
               f"TTFT {_ms(r[Metric.TTFT])} ms, TPOT {_ms(r[Metric.TPOT])} ms, "
               f"{r[Metric.DECODE_TOKENS_PER_S]:.0f} tokens/s<br>peak {r[Metric.MAX_PEAK_MEMORY] / _GIB:.1f} GiB; ")
            + ("meets every objective" if r["meets_slo"] else f"misses {html.escape(r['slo_miss'])}")
            for _, r in frame.iterrows()]


def pareto_figure(result: PlanResult, metric: str, frontier: str, title: str, axis: str, *,
                  log: bool = False) -> go.Figure:
    """Price per hour against ``metric`` of every simulated configuration that fits (``log``: on a
    logarithmic axis); the frontier as a line, the pick as a star."""
    table = result.table
    shown = table[(table["stage"] == Stage.SIMULATED) & table["fits"]]
    colors = category_colors(table["device_types"])
    fig = go.Figure()
    for device, group in shown.groupby("device_types", sort=True):
        for meets, marker in ((True, "circle"), (False, "circle-open")):
            part = group[group["meets_slo"] == meets]
            if part.empty:
                continue
            fig.add_trace(go.Scatter(
                x=part["price_per_hour"], y=part[metric], mode="markers",
                name=f"{device} ({'meets' if meets else 'misses'} the objectives)",
                marker={"color": colors[device], "symbol": marker, "size": 8},
                hovertext=_hover(part), hoverinfo="text"))
    line = shown[shown[frontier]].sort_values("price_per_hour")
    fig.add_trace(go.Scatter(x=line["price_per_hour"], y=line[metric], mode="lines",
                             line={"shape": "hv", "color": "black", "dash": "dot"}, name="Pareto frontier",
                             hoverinfo="skip"))
    if result.pick is not None:
        fig.add_trace(go.Scatter(x=[result.pick["price_per_hour"]], y=[result.pick[metric]],
                                 mode="markers", name="the pick",
                                 marker={"symbol": "star", "size": 18, "color": "gold",
                                         "line": {"color": "black", "width": 1}},
                                 hovertext=_hover(result.pick.to_frame().T), hoverinfo="text"))
    fig.update_layout(title=title, height=520, xaxis_title="price ($ per hour)", yaxis_title=axis,
                      legend={"title": "device types"}, yaxis_type="log" if log else "linear")
    return fig


def stages_figure(result: PlanResult) -> go.Figure:
    """How many candidates each stage of the search settled."""
    counts = result.table["stage"].value_counts()
    stages = [stage.value for stage in Stage if counts.get(stage, 0)]
    fig = go.Figure(go.Bar(x=stages, y=[int(counts[s]) for s in stages], marker_color="#6baed6",
                           hovertemplate="%{x}: %{y} candidates<extra></extra>"))
    fig.update_layout(title="Where the search settled each candidate", height=360,
                      xaxis_title="stage (cheapest test first)", yaxis_title="candidates (count)")
    return fig


def report_html(result: PlanResult) -> str:
    """The planning report page (plotly.js embedded, so it opens offline)."""
    config = result.request.config
    if config.is_serving:
        figures = [pareto_figure(result, Metric.MAX_REQUEST_RATE, "pareto_rate", "Price against maximum request rate",
                                 "maximum request rate meeting the objectives (requests/s)")]
        w = config.workload
        lengths = (f"prompt {w.prompt_tokens} tokens, {w.output_tokens} output tokens" if w.trace is None
                   else f"lengths from {html.escape(Path(w.trace).name)}")
        workload = (f"Requests at {w.rate_per_s:g}/s (Poisson), {lengths}, the SLO at p{config.slo.percentile}; "
                    "each rate tried was simulated, the maximum rate to within "
                    f"{100 * config.search.rate_tolerance:g}%")
    elif config.is_training:
        figures = [pareto_figure(result, Metric.STEP_TIME, "pareto_latency", "Price against step time",
                                 "time of one optimizer step (s, log scale)", log=True),
                   pareto_figure(result, Metric.TOKENS_PER_S, "pareto_throughput", "Price against throughput",
                                 "trained tokens per second (tokens/s)")]
        w = config.workload
        workload = (f"Training: global batch {w.global_batch_size} x {w.sequence_length} tokens, micro-batches of "
                    f"{w.micro_batch_size}")
    else:
        figures = [pareto_figure(result, Metric.E2E_LATENCY, "pareto_latency", "Price against end-to-end latency",
                                 "end-to-end latency of a request (s, log scale)", log=True),
                   pareto_figure(result, Metric.DECODE_TOKENS_PER_S, "pareto_throughput", "Price against throughput",
                                 "decode throughput (tokens/s)")]
        workload = (f"Workload: batch {config.workload.batch_size}, prompt {config.workload.prompt_tokens} tokens, "
                    f"{config.workload.output_tokens} output tokens")
    figures.append(stages_figure(result))
    shown = pd.DataFrame(_top_columns(result))
    if not (config.is_serving or config.is_training):
        shown.insert(len(shown.columns) - 1, "prefill bottleneck", list(result.top["prefill_bottleneck"]))
    parts = [
        answer(result.recommendation),
        f"<p>{html.escape(config.description)}</p>",
        f"<p>{workload}; {len(result.table)} candidate configurations searched in "
        f"{result.elapsed_s:.1f} s. Prices: {html.escape(result.request.catalog.currency)} per hour, catalog as of "
        f"{html.escape(result.request.catalog.as_of)}.</p>",
        "<h2>Top clusters, each with its best layout</h2>", shown.to_html(index=False, border=0, escape=True),
    ]
    if result.notes:
        parts.append("<h2>Outside the profile's context</h2><ul>"
                     + "".join(f"<li>{html.escape(n)}</li>" for n in result.notes) + "</ul>")
    return report_page(f"hetsim plan: {config.name}", parts, figures)


def write_plan_outputs(result: PlanResult, out_dir: Path) -> list[Path]:
    """plan.csv, plan.parquet, report.html and the pick's scenario (pick.yaml; a serving pick's also
    at its decode batch, pick_batch.yaml) into ``out_dir``."""
    table = result.table.copy()
    table["stage"] = table["stage"].astype(str)
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    files: dict[str, str | bytes] = {"plan.csv": table.to_csv(index=False), "plan.parquet": buffer.getvalue(),
                                     "report.html": report_html(result)}
    if result.pick_scenario is not None:
        files[PICK_FILE] = (f"# {result.recommendation}\n"
                            + yaml.safe_dump(result.pick_scenario, sort_keys=False))
    if result.pick_batch_scenario is not None:
        files[PICK_BATCH_FILE] = ("# The serving pick's layout at the batch it decodes at its maximum rate, for hetsim "
                                  "simulate and hetsim measure (hetsim's runtime does not serve request loads)\n"
                                  + yaml.safe_dump(result.pick_batch_scenario, sort_keys=False))
    return write_files(out_dir, files)
