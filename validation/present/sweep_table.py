"""What a grid sweep shows of its points (:mod:`validation.sweep_runner`'s tidy table): the metrics
of its workload kind (:data:`GRID_COLUMNS`), the one its verdict ranks by (:func:`objective`), and
the terminal table.

A row per point and variant: the axis values, the kind's metrics (a generation's TTFT, TPOT,
decode tokens/s and largest per-device peak memory; a training job's step time, trained tokens/s,
exposed communication and peak memory; a serving run's p90 TTFT and TPOT, output tokens/s and
maximum request rate), and whether it fits (or why the point was refused); past 40 rows, the 40
that fit that rank best. Each time column has one unit chosen for its values (s, ms or us,
:func:`sim.units.time_unit`), written in its header, with three significant digits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
from rich.markup import escape
from rich.table import Table

from models.errors import shorten
from sim.units import duration_text, significant, time_unit
from sim.vocabulary import Metric, WorkloadKind

MAX_SHOWN_ROWS = 40


@dataclass(frozen=True)
class GridColumn:
    """A metric a grid sweep shows: ``name`` heads its table column (``TPOT ms``), ``long`` names
    it on a figure's axis and in a sentence (``TPOT (ms)``, ``the lowest TPOT``); ``unit`` and
    ``scale`` (SI per unit) display it, a duration (``unit`` empty) in the unit its values suit;
    ``lower_wins``: whether less is better."""

    metric: str
    name: str
    long: str
    unit: str = ""
    scale: float = 1.0
    lower_wins: bool = True

    def display(self, values_si: Iterable[float]) -> tuple[float, str]:
        """(SI per displayed unit, unit) for showing ``values_si``."""
        return time_unit(values_si) if not self.unit else (self.scale, self.unit)

    def text(self, value_si: float) -> str:
        """One value for people: ``509 ms``, ``1.66 req/s``."""
        return duration_text(value_si) if not self.unit else f"{significant(value_si / self.scale)} {self.unit}"

    @property
    def best(self) -> str:
        """``the lowest TPOT``, ``the highest maximum request rate``."""
        return f"the {'lowest' if self.lower_wins else 'highest'} {self.long}"


_PEAK = GridColumn(Metric.MAX_PEAK_MEMORY, "max peak", "max peak memory per device", "GiB", 2**30)
GRID_COLUMNS: dict[WorkloadKind, tuple[GridColumn, ...]] = {
    WorkloadKind.INFERENCE: (
        GridColumn(Metric.TTFT, "TTFT", "TTFT"), GridColumn(Metric.TPOT, "TPOT", "TPOT"),
        GridColumn(Metric.DECODE_TOKENS_PER_S, "decode", "decode throughput", "tok/s", lower_wins=False), _PEAK),
    WorkloadKind.TRAINING: (
        GridColumn(Metric.STEP_TIME, "step", "step time"),
        GridColumn(Metric.TOKENS_PER_S, "trained", "trained throughput", "tok/s", lower_wins=False),
        GridColumn(Metric.EXPOSED_COMMUNICATION, "exposed comm", "exposed communication"), _PEAK),
    WorkloadKind.SERVING: (
        GridColumn(Metric.TTFT.percentile(90), "TTFT p90", "p90 TTFT"),
        GridColumn(Metric.TPOT.percentile(90), "TPOT p90", "p90 TPOT"),
        GridColumn(Metric.OUTPUT_TOKENS_PER_S, "output", "output throughput", "tok/s", lower_wins=False),
        GridColumn(Metric.MAX_REQUEST_RATE, "max rate", "maximum request rate", "req/s", lower_wins=False)),
}
"""The metrics a grid sweep shows per workload kind, in their table's order."""


def objective(kind: WorkloadKind, wide: pd.DataFrame) -> GridColumn:
    """The column a sweep's points rank by: a generation's TPOT, a training job's step time, a
    serving run's maximum request rate under its SLO (its p90 TTFT where no rate was searched)."""
    columns = {c.metric: c for c in GRID_COLUMNS[kind]}
    if kind is WorkloadKind.TRAINING:
        return columns[Metric.STEP_TIME]
    if kind is WorkloadKind.SERVING:
        searched = wide[Metric.MAX_REQUEST_RATE].notna().any()
        return columns[Metric.MAX_REQUEST_RATE if searched else Metric.TTFT.percentile(90)]
    return columns[Metric.TPOT]


def shown_columns(kind: WorkloadKind, wide: pd.DataFrame) -> list[GridColumn]:
    """The kind's columns that hold a value (a serving grid without an SLO has no maximum rate)."""
    return [c for c in GRID_COLUMNS[kind] if wide[c.metric].notna().any() or c is objective(kind, wide)]


def wide_results(tidy: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """One row per point and variant (grid order): the axes, ``variant``, the scalar metrics
    (those of every :data:`GRID_COLUMNS`, NaN where the kind has none), the largest peak memory of
    its devices (:data:`Metric.MAX_PEAK_MEMORY`), ``oom`` and ``error``."""
    keys = [*axes, "variant"]
    tidy = tidy.assign(_order=range(len(tidy)))
    first = tidy.groupby(keys, sort=False, dropna=False).agg(_order=("_order", "min"), oom=("oom", "first"),
                                                             error=("error", "first"))
    timing = tidy[tidy["device"] == ""].pivot_table(index=keys, columns="metric", values="value", aggfunc="first",
                                                     dropna=False, sort=False)
    peaks = tidy[tidy["metric"] == Metric.PEAK_MEMORY].groupby(keys, sort=False, dropna=False)["value"].max()
    wide = first.join(timing, how="left").join(peaks.rename(Metric.MAX_PEAK_MEMORY), how="left")
    for column in {c.metric for columns in GRID_COLUMNS.values() for c in columns}:
        if column not in wide:
            wide[column] = math.nan
    return wide.sort_values("_order").drop(columns="_order").reset_index()


def fitting(wide: pd.DataFrame, column: GridColumn) -> pd.DataFrame:
    """The rows that simulated, fit in memory and have ``column``, best first (grid order breaks
    ties)."""
    fits = wide[(wide["error"] == "") & (wide["oom"] == "") & wide[column.metric].notna()]
    return fits.sort_values(column.metric, ascending=column.lower_wins, kind="stable")


def shown_rows(tidy: pd.DataFrame, axes: list[str], kind: WorkloadKind) -> tuple[pd.DataFrame, str]:
    """The table of a sweep as text cells (see the module docstring): every row in grid order,
    or, past :data:`MAX_SHOWN_ROWS`, that many of the rows that fit, best first; and the note
    saying so ('' when every row is shown). A refused row's ``fits`` cell is its error."""
    wide = wide_results(tidy, axes)
    columns = shown_columns(kind, wide)
    units = {c.metric: c.display(wide[c.metric]) for c in columns}
    more = ""
    if len(wide) > MAX_SHOWN_ROWS:
        column = objective(kind, wide)
        fits = fitting(wide, column)
        more = (f"the {min(len(fits), MAX_SHOWN_ROWS)} of {len(wide)} rows that fit with {column.best}; "
                f"all in results.csv")
        wide = fits.head(MAX_SHOWN_ROWS)
    cells = {a: wide[a].astype(str).tolist() for a in [*axes, "variant"]}
    for c in columns:
        size, unit = units[c.metric]
        cells[f"{c.name} {unit}"] = [("" if error else significant(v / size)) for v, error in
                                     zip(wide[c.metric], wide["error"])]
    cells["fits"] = [error or ("no" if oom else "yes") for error, oom in zip(wide["error"], wide["oom"])]
    return pd.DataFrame(cells), more


def grid_table(tidy: pd.DataFrame, axes: list[str], title: str, kind: WorkloadKind = WorkloadKind.INFERENCE) -> Table:
    """The rich table of a sweep of ``kind`` (:func:`shown_rows`); a point that does not fit says
    so in red, a refused one its reason."""
    rows, more = shown_rows(tidy, axes, kind)
    table = Table(title=escape(title + (f" ({more})" if more else "")))
    for column in rows.columns:
        if column == "fits":
            table.add_column(column, no_wrap=True)  # or, in red, why the point was refused
        else:
            table.add_column(escape(column), justify="left" if column in (*axes, "variant") else "right")
    for row in rows.itertuples(index=False):
        *cells, fits = row
        if fits not in ("yes", "no"):
            fits = f"[red]{escape(shorten(fits, 50, quote=False))}[/red]"
        table.add_row(*(escape(cell) for cell in cells), "[red]no[/red]" if fits == "no" else fits)
    return table
