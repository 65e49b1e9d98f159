"""What ``hetsim plan`` shows and writes: the terminal table, plan.csv / plan.parquet, report.html
and the pick's scenario file.

report.html says in one sentence what to use and why, then draws the Pareto frontiers of price
per hour against end-to-end latency and against decode tokens/s (every simulated configuration
that fits, coloured by device type, hover for its details), and how many candidates each stage
of the search settled. Displayed units are $/h, ms / s, tokens/s and GiB; the files stay SI.
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
from sim.planning.outcome import PlanResult
from sim.planning.search import Stage
from sim.vocabulary import Metric
from validation.present.colors import category_colors

_GIB = 2**30
PICK_FILE = "pick.yaml"


def _ms(value: float) -> str:
    return "" if pd.isna(value) else f"{value * 1e3:.1f}"


def print_plan(result: PlanResult, console: Console, scenario_path: Path | None = None) -> None:
    """The top 10 as a table, the sentence, the stages and how to run the pick."""
    table = Table(title=f"hetsim plan {escape(result.request.name)}: top {len(result.top)} clusters, each with "
                        "its best layout")
    for name in ("#", "cluster", "layout", "$/h", "TTFT ms", "TPOT ms", "tokens/s", "peak GiB", "bottleneck",
                 "versus the pick"):
        table.add_column(name, justify="right" if name in ("#", "$/h", "TTFT ms", "TPOT ms", "tokens/s",
                                                            "peak GiB") else "left")
    for _, row in result.top.iterrows():
        table.add_row(str(int(row["rank"])), escape(row["cluster"]),
                      escape(f"{row['variant']}, {row['memory_policy']}"), f"{row['price_per_hour']:.2f}",
                      _ms(row[Metric.TTFT]), _ms(row[Metric.TPOT]), f"{row[Metric.DECODE_TOKENS_PER_S]:.0f}",
                      f"{row[Metric.MAX_PEAK_MEMORY] / _GIB:.1f}", escape(row["bottleneck"]),
                      escape(row["versus_pick"] or ("the pick" if row["meets_slo"] else f"misses {row['slo_miss']}")))
    console.print(table)
    console.print(escape(result.recommendation))
    stages = result.table["stage"].value_counts()
    console.print(f"{len(result.table)} candidates in {result.elapsed_s:.1f} s: "
                  + ", ".join(f"{int(stages.get(stage, 0))} {stage}" for stage in Stage if stages.get(stage, 0)))
    for note in result.notes:
        console.print(f"  outside the profile's context: {escape(note)}")
    if scenario_path is not None:
        console.print(f"the pick's scenario: {escape(str(scenario_path))}; run it with:")
        for command in result.commands(scenario_path):
            console.print(f"  {escape(command)}")


def _hover(frame: pd.DataFrame) -> list[str]:
    return [f"<b>{html.escape(r['cluster'])}</b><br>{html.escape(r['variant'])} ({html.escape(r['algorithms'])}), "
            f"{html.escape(r['memory_policy'])}<br>${r['price_per_hour']:.2f}/h, {int(r['num_devices'])} devices<br>"
            f"TTFT {_ms(r[Metric.TTFT])} ms, TPOT {_ms(r[Metric.TPOT])} ms, "
            f"{r[Metric.DECODE_TOKENS_PER_S]:.0f} tokens/s<br>peak {r[Metric.MAX_PEAK_MEMORY] / _GIB:.1f} GiB; "
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
    figures = [
        pareto_figure(result, Metric.E2E_LATENCY, "pareto_latency", "Price against end-to-end latency",
                      "end-to-end latency of a request (s, log scale)", log=True),
        pareto_figure(result, Metric.DECODE_TOKENS_PER_S, "pareto_throughput", "Price against throughput",
                      "decode throughput (tokens/s)"),
        stages_figure(result),
    ]
    top = result.top
    shown = pd.DataFrame({
        "#": top["rank"].astype(int), "cluster": top["cluster"],
        "layout": top["variant"] + ", " + top["memory_policy"], "$/h": top["price_per_hour"].map("{:.2f}".format),
        "TTFT (ms)": top[Metric.TTFT].map(_ms), "TPOT (ms)": top[Metric.TPOT].map(_ms),
        "tokens/s": top[Metric.DECODE_TOKENS_PER_S].map("{:.0f}".format),
        "peak (GiB)": (top[Metric.MAX_PEAK_MEMORY] / _GIB).map("{:.1f}".format),
        "decode bottleneck": top["bottleneck"], "prefill bottleneck": top["prefill_bottleneck"],
        "versus the pick": top["versus_pick"]})
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>hetsim plan: {html.escape(config.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
        "td,th{padding:4px 10px;text-align:left} th{border-bottom:1px solid #888} "
        ".answer{font-size:1.2em;background:#fff7d6;padding:0.6em;border-left:4px solid gold}</style></head><body>",
        f"<h1>hetsim plan: {html.escape(config.name)}</h1>",
        f"<p class='answer'>{html.escape(result.recommendation)}</p>",
        f"<p>{html.escape(config.description)}</p>",
        f"<p>Workload: batch {config.workload.batch_size}, prompt {config.workload.prompt_tokens} tokens, "
        f"{config.workload.output_tokens} output tokens; {len(result.table)} candidate configurations searched in "
        f"{result.elapsed_s:.1f} s. Prices: {html.escape(result.request.catalog.currency)} per hour, catalog as of "
        f"{html.escape(result.request.catalog.as_of)}.</p>",
        "<h2>Top clusters, each with its best layout</h2>", shown.to_html(index=False, border=0, escape=True),
    ]
    if result.notes:
        parts.append("<h2>Outside the profile's context</h2><ul>"
                     + "".join(f"<li>{html.escape(n)}</li>" for n in result.notes) + "</ul>")
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=f"figure-{i}"))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_plan_outputs(result: PlanResult, out_dir: Path) -> list[Path]:
    """plan.csv, plan.parquet, report.html and the pick's scenario (pick.yaml) into ``out_dir``."""
    table = result.table.copy()
    table["stage"] = table["stage"].astype(str)
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    files: dict[str, str | bytes] = {"plan.csv": table.to_csv(index=False), "plan.parquet": buffer.getvalue(),
                                     "report.html": report_html(result)}
    if result.pick_scenario is not None:
        files[PICK_FILE] = (f"# {result.recommendation}\n"
                            + yaml.safe_dump(result.pick_scenario, sort_keys=False))
    return write_files(out_dir, files)
