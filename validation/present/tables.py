"""Terminal tables (rich) of the command line: a simulation's variants, a measurement, a sweep.

Displayed units are GiB, tokens/s and, for a simulation's durations, the unit that suits each
(``138 ms``, ``19.3 s``: :func:`sim.units.duration_text`); the tables they are built from stay SI.
"""

from __future__ import annotations

import math

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from models.weight_formats import WeightFormat
from sim.layout_compare import compare_layouts, layouts_differ
from sim.parallel import UNEVEN_SHARES
from sim.simulate import SimulationResult
from sim.units import duration_text, significant
from sim.vocabulary import Metric
from validation.present.layout import idle_warnings, layout_label, layout_lines
from validation.present.sweep_report import labels

_GIB = 2**30
_COMPARED = (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S)


def change_column(metric: Metric) -> str:
    """The column of :func:`summary_table` with ``metric``'s change against the baseline (%)."""
    return f"{metric}_change_pct"


def summary_table(result: SimulationResult) -> pd.DataFrame:
    """One row per variant: its layout and the devices it uses (``2 of 6``), TTFT, TPOT, decode
    tokens/s, the largest per-device peak memory, whether it fits, and the change of each timing
    against the baseline (%; negative TTFT/TPOT = faster)."""
    baseline = result.variant(result.scenario.baseline)
    rows = []
    for vr in result.variants:
        row = {"variant": vr.variant.name, "algorithms": ", ".join(vr.algorithms), "layout": vr.layout.label,
               "devices": f"{len(vr.layout.ranks)} of {len(result.topology.devices)}"}
        for metric in _COMPARED:
            value, base = vr.timing[metric], baseline.timing[metric]
            row[metric] = value
            row[change_column(metric)] = (value / base - 1) * 100 if base and not math.isnan(base) else math.nan
        row[Metric.MAX_PEAK_MEMORY] = max(vr.peak_bytes.values())
        row["fits_in_memory"] = vr.overflow is None
        rows.append(row)
    return pd.DataFrame(rows)


def _change(pct: float) -> str:
    return "" if math.isnan(pct) else f"{pct:+.1f}%"


def print_summary(result: SimulationResult, console: Console) -> None:
    """The per-variant table (with each variant's layout and devices where the layouts differ,
    then which layout wins each metric and why: :mod:`sim.layout_compare`) and the per-device
    peak memory table."""
    config = result.scenario.config
    model = result.scenario.model
    stored = f" ({model.weights} weights)" if model.weights != WeightFormat.NATIVE else ""
    table = Table(title=f"{config.name}: {model.name}{stored}, {layout_label(result)}, "
                        f"batch {config.workload.batch_size}, prompt {config.workload.prompt_tokens}, "
                        f"output {config.workload.output_tokens} (baseline {result.scenario.baseline})")
    compared = layouts_differ(result)
    layout_columns = ("layout", "devices") if compared else ()
    for column in ("variant", *layout_columns, "TTFT", "Δ", "TPOT", "Δ", "decode tok/s", "Δ", "max peak GiB",
                   "fits"):
        table.add_column(column, justify="left" if column in ("variant", "layout") else "right")
    summary = summary_table(result)
    for row in summary.to_dict("records"):
        table.add_row(row["variant"], *(row[c] for c in layout_columns),
                      duration_text(row[Metric.TTFT]), _change(row[change_column(Metric.TTFT)]),
                      duration_text(row[Metric.TPOT]), _change(row[change_column(Metric.TPOT)]),
                      f"{row[Metric.DECODE_TOKENS_PER_S]:.1f}",
                      _change(row[change_column(Metric.DECODE_TOKENS_PER_S)]),
                      f"{row[Metric.MAX_PEAK_MEMORY] / _GIB:.2f}",
                      "yes" if row["fits_in_memory"] else "[red]no[/red]")
    console.print(table)
    for row in summary.itertuples(index=False):
        console.print(f"  {row.variant}: {row.algorithms}")
    if compared:
        console.print("[bold]Layouts compared[/bold] (the term: where the runner-up's devices spend more time, "
                      "mean over its devices, prefill or first decode step):")
        for sentence in compare_layouts(result).sentences():
            console.print(f"  {escape(sentence)}")
    memory = Table(title="Peak memory per device (GiB)")
    memory.add_column("device")
    memory.add_column("capacity", justify="right")
    for vr in result.variants:
        memory.add_column(vr.variant.name, justify="right")
    for rank in result.ranks:
        device = result.topology.devices[rank]
        memory.add_row(device.name, f"{device.memory_capacity_bytes / _GIB:.2f}",
                       *(f"{vr.peak_bytes[rank] / _GIB:.2f}" if rank in vr.peak_bytes else "unused"
                         for vr in result.variants))
    console.print(memory)
    for line in layout_lines(result):
        console.print(escape(line))
    for warning in idle_warnings(result):
        console.print(f"[yellow]{escape(warning)}[/yellow]")
    for vr in result.variants:
        if vr.overflow is not None:
            device = result.topology.devices[vr.overflow.rank].name
            console.print(f"[red]{vr.variant.name}: {vr.overflow.describe(device)}[/red]")


def measured_table(name: str, repeats: int, variants) -> Table:
    """A measured run's timing per variant, median [p10, p90] over ``repeats``.

    Args:
        variants: :class:`runtime.measure.MeasuredVariant` objects (``name``, ``timing``).
    """
    table = Table(title=escape(f"{name} measured ({repeats} repeats; median [p10, p90])"))
    for column in ("variant", "TTFT ms", "TPOT ms", "decode tok/s"):
        table.add_column(column, justify="left" if column == "variant" else "right")

    def spread_ms(timing: dict, metric: Metric) -> str:
        return escape(f"{timing[metric] * 1e3:.2f} [{timing[metric.percentile(10)] * 1e3:.2f}, "
                      f"{timing[metric.percentile(90)] * 1e3:.2f}]")

    for v in variants:
        table.add_row(v.name, spread_ms(v.timing, Metric.TTFT), spread_ms(v.timing, Metric.TPOT),
                      f"{v.timing[Metric.DECODE_TOKENS_PER_S]:.1f}")
    return table


def measured_training_table(name: str, repeats: int, variants) -> Table:
    """A measured training run per variant: step time median [p10, p90] over ``repeats``, its
    parts, tokens/s and how much communication stayed exposed.

    Args:
        variants: :class:`runtime.measure.MeasuredVariant` objects (``name``, ``timing``).
    """
    table = Table(title=escape(f"{name} measured training ({repeats} repeats; median [p10, p90])"))
    columns = ("variant", "step ms", "forward ms", "backward ms", "optimizer ms", "exposed comm ms", "overlap",
               "tokens/s")
    for column in columns:
        table.add_column(column, justify="left" if column == "variant" else "right")
    for v in variants:
        t = v.timing
        step = escape(f"{t[Metric.STEP_TIME] * 1e3:.1f} [{t[Metric.STEP_TIME.percentile(10)] * 1e3:.1f}, "
                      f"{t[Metric.STEP_TIME.percentile(90)] * 1e3:.1f}]")
        overlap = f"{t[Metric.OVERLAP_RATIO]:.0%}" if Metric.OVERLAP_RATIO in t else "-"
        table.add_row(v.name, step, *(f"{t[m] * 1e3:.1f}" for m in (Metric.FORWARD_TIME, Metric.BACKWARD_TIME,
                                                                  Metric.OPTIMIZER_TIME, Metric.EXPOSED_COMMUNICATION)),
                      overlap, f"{t[Metric.TOKENS_PER_S]:.0f}")
    return table


def sweep_tables(sweep: pd.DataFrame) -> list[Table]:
    """One rich table per model of a sweep (:mod:`sim.sweep`): a row per policy, a column per
    device count, each cell ``peak GiB · TPOT ms · TTFT s`` (red when it does not fit, ``n/a`` when
    the point cannot run); a count split unevenly (its note begins :data:`sim.parallel.UNEVEN_SHARES`)
    is headed ``N devices, uneven``."""
    sweep = sweep.assign(label=labels(sweep))
    tables = []
    for model, rows in sweep.groupby("model", sort=False):
        devices = sorted(rows["devices"].unique())
        capacity = rows[Metric.MEMORY_CAPACITY].dropna()
        cap = f", {capacity.min() / _GIB:.0f} GiB per device" if len(capacity) else ""
        table = Table(title=f"{model}: max peak memory per device (GiB) · TPOT (ms) · TTFT (s){cap}")
        table.add_column("memory policy")
        for n in devices:
            uneven = rows.loc[rows["devices"] == n, "note"].str.startswith(UNEVEN_SHARES).any()
            table.add_column(f"{n} devices" + (", uneven" if uneven else ""), justify="right")
        for label, by_label in rows.groupby("label", sort=False):
            cells = []
            for n in devices:
                r = by_label[by_label["devices"] == n].iloc[0]
                if not r["feasible"]:
                    cells.append("[dim]n/a[/dim]")
                    continue
                text = (f"{r[Metric.MAX_PEAK_MEMORY] / _GIB:.2f} · {significant(r[Metric.TPOT] * 1e3)} · "
                        f"{significant(r[Metric.TTFT])}")
                cells.append(text if r["fits"] else f"[red]{text} OOM[/red]")
            table.add_row(label, *cells)
        tables.append(table)
    return tables
