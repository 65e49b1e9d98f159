"""The terminal table of a grid sweep (:mod:`validation.sweep_runner`'s tidy table).

A row per point and variant: the axis values, TTFT, TPOT, decode tokens/s, the largest per-device
peak memory, and whether it fits (or why the point was refused); past 40 rows, the 40 that fit
with the lowest TPOT. Each time column has one unit
chosen for its values (s, ms or us), written in its header, with three significant digits.
"""

from __future__ import annotations

import math

import pandas as pd
from rich.markup import escape
from rich.table import Table

from models.errors import shorten
from sim.units import significant
from sim.vocabulary import Metric

_GIB = 2**30
_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))
MAX_SHOWN_ROWS = 40


def time_unit(values_s: pd.Series) -> tuple[float, str]:
    """(seconds per unit, unit name) that shows the median of ``values_s`` (seconds) as at least 1."""
    finite = values_s[values_s.map(lambda v: isinstance(v, float) and math.isfinite(v) and v > 0)]
    median = finite.median() if len(finite) else 1.0
    return next(((size, name) for size, name in _TIME_UNITS if median >= size), _TIME_UNITS[-1])


def wide_results(tidy: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """One row per point and variant (grid order): the axes, ``variant``, the timing metrics, the
    largest peak memory of its devices (:data:`Metric.MAX_PEAK_MEMORY`), ``oom`` and ``error``."""
    keys = [*axes, "variant"]
    tidy = tidy.assign(_order=range(len(tidy)))
    first = tidy.groupby(keys, sort=False, dropna=False).agg(_order=("_order", "min"), oom=("oom", "first"),
                                                             error=("error", "first"))
    timing = tidy[tidy["device"] == ""].pivot_table(index=keys, columns="metric", values="value", aggfunc="first",
                                                     dropna=False, sort=False)
    peaks = tidy[tidy["metric"] == Metric.PEAK_MEMORY].groupby(keys, sort=False, dropna=False)["value"].max()
    wide = first.join(timing, how="left").join(peaks.rename(Metric.MAX_PEAK_MEMORY), how="left")
    for metric in (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.MAX_PEAK_MEMORY):
        if metric not in wide:
            wide[metric] = math.nan
    return wide.sort_values("_order").drop(columns="_order").reset_index()


def grid_table(tidy: pd.DataFrame, axes: list[str], title: str) -> Table:
    """The rich table of a sweep (see the module docstring): every row in grid order, or, past
    :data:`MAX_SHOWN_ROWS`, that many of the rows that fit, lowest TPOT first."""
    wide = wide_results(tidy, axes)
    ttft_size, ttft_unit = time_unit(wide[Metric.TTFT])
    tpot_size, tpot_unit = time_unit(wide[Metric.TPOT])
    more = ""
    if len(wide) > MAX_SHOWN_ROWS:
        fits = wide[(wide["error"] == "") & (wide["oom"] == "")]
        more = (f" (the {min(len(fits), MAX_SHOWN_ROWS)} of {len(wide)} rows that fit with the lowest TPOT; "
                f"all in results.csv)")
        wide = fits.sort_values(Metric.TPOT, kind="stable").head(MAX_SHOWN_ROWS)
    table = Table(title=escape(title + more))
    for column in (*axes, "variant"):
        table.add_column(escape(column))
    for column in (f"TTFT {ttft_unit}", f"TPOT {tpot_unit}", "decode tok/s", "max peak GiB"):
        table.add_column(column, justify="right")
    table.add_column("fits", no_wrap=True)  # or, in red, why the point was refused
    for row in wide.to_dict("records"):
        cells = [escape(str(row[a])) for a in axes] + [escape(str(row["variant"]))]
        if row["error"]:
            table.add_row(*cells, "", "", "", "", f"[red]{escape(shorten(row['error'], 50, quote=False))}[/red]")
            continue
        table.add_row(*cells, significant(row[Metric.TTFT] / ttft_size), significant(row[Metric.TPOT] / tpot_size),
                      significant(row[Metric.DECODE_TOKENS_PER_S]), f"{row[Metric.MAX_PEAK_MEMORY] / _GIB:.2f}",
                      "yes" if not row["oom"] else "[red]no[/red]")
    return table


def best_line(tidy: pd.DataFrame, axes: list[str]) -> str:
    """One sentence: the point and variant with the lowest TPOT among those that fit, and its figures."""
    wide = wide_results(tidy, axes)
    fits = wide[(wide["error"] == "") & (wide["oom"] == "") & wide[Metric.TPOT].notna()]
    if fits.empty:
        return "no point fits in memory and simulates: see the oom and error columns of results.csv"
    best = fits.loc[fits[Metric.TPOT].idxmin()]
    where = ", ".join(f"{a} = {best[a]}" for a in axes)
    tpot = _with_unit(best[Metric.TPOT])
    return (f"lowest TPOT that fits: {where}, variant {best['variant']}: {tpot} per token, TTFT "
            f"{_with_unit(best[Metric.TTFT])} ({len(fits)} of {len(wide)} point-variants fit)")


def _with_unit(seconds: float) -> str:
    size, unit = time_unit(pd.Series([seconds]))
    return f"{significant(seconds / size)} {unit}"
