"""Running a grid sweep (:mod:`sim.grid`) in parallel, resumably, and its tidy output.

``run_grid`` computes the points whose content key the store (:mod:`sim.sweep_store`) lacks,
on a local process pool or a Dask distributed cluster, and commits each point's outcome as it
arrives, one transaction per point, in the one process that runs the sweep. A sweep killed at
any instant and run again computes only what is missing.

* **Local pool** (``workers`` processes): forked after every import and after the points are
  validated in the parent, so a worker neither imports nor parses anything; a task is an index
  into the parent's list of scenarios (copied into the workers by the fork). Workers die with the
  parent, whatever kills it (:func:`runtime.interrupt.as_worker`). One worker runs in-process.
* **Dask** (``scheduler`` an address such as ``tcp://10.0.0.1:8786``): each point is a task
  (``dask.distributed.Client.map``, results in completion order by ``as_completed``), the
  validated scenario its argument; the profile is scattered to every worker once. A cluster without a worker,
  or with a worker that runs another hetsim (:func:`sim.grid.hetsim_version`, which is part of
  every key), is refused before any task.

The tidy table (:func:`tidy_table`) is the results.csv schema of ``hetsim simulate``
(:data:`sim.metrics.RESULT_COLUMNS`), preceded by one column per axis and followed by ``oom``
(the first op that does not fit, for a variant that overflows), ``error`` (why a point was
refused: by the schema, or by the simulator; its row has no metric) and ``profile_context``
(with ``--profile``: how the profile priced the point, ``replay`` or ``prediction`` and, after
``; outside: ``, the terms outside its calibration context, as ``hetsim plan`` says it,
:func:`sim.context.profile_context`; empty uncalibrated) and ``shares_note`` (a point whose
tensor-parallel degree does not divide the heads: that its split is uneven and by which basis,
:attr:`sim.parallel.ParallelPlan.shares_note`; empty for the even split). The
summary line counts the points outside the context (:func:`outside_context`).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from models.errors import ConfigError, shorten
from runtime import interrupt
from sim.context import outside
from sim.grid import GridPoint, PointOutcome, evaluate_point, hetsim_version
from sim.metrics import RESULT_COLUMNS
from sim.outputs import results_csv, write_files
from sim.profile import Profile
from sim.scenario import Scenario
from sim.sweep_store import ADDED_POINT_COLUMNS, SweepStore

TIDY_EXTRA_COLUMNS = ["oom", "error", *ADDED_POINT_COLUMNS]
SCHEDULER_TIMEOUT_S = 10


@dataclass(frozen=True)
class GridRun:
    """What one invocation did: ``computed`` points simulated now, ``reused`` found in the store,
    ``invalid`` refused by the schema (never stored: refusing is cheaper than storing)."""

    computed: int
    reused: int
    invalid: int


def default_workers() -> int:
    """The cores this process may run on (all of the machine's where the OS does not say)."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def run_grid(points: Sequence[GridPoint], store: SweepStore, *, profile: Profile | None = None, workers: int = 1,
             scheduler: str | None = None, on_start: Callable[[int], None] = lambda total: None,
             on_done: Callable[[GridPoint, PointOutcome], None] = lambda point, outcome: None) -> GridRun:
    """Compute and store every valid point of ``points`` that ``store`` lacks.

    ``on_start(n)`` is called with the number of points to compute, before the first;
    ``on_done(point, outcome)`` after each is committed (in completion order).

    Raises:
        ConfigError: on ``--scheduler`` when no Dask scheduler answers at ``scheduler``, it has no
            worker, or a worker runs another hetsim.
    """
    valid = [p for p in points if p.scenario is not None]
    unique = {p.key: p for p in valid}  # two combinations may validate to the same scenario
    stored = store.stored(unique)
    todo = [p for key, p in unique.items() if key not in stored]
    store.start_run(len(todo))
    executor = (DaskExecutor(scheduler, profile) if scheduler is not None
                else LocalExecutor(profile, workers))
    on_start(len(todo))
    with executor:
        for index, outcome in executor.imap_unordered([p.scenario for p in todo]):
            point = todo[index]
            store.commit(point.key, axes_json(point.axes), outcome)
            on_done(point, outcome)
    return GridRun(len(todo), len(unique) - len(todo), len(points) - len(valid))


# The points of the local pool, set in the parent before it forks (the workers inherit them).
_FORKED: tuple[list[Scenario], Profile | None] = ([], None)


def _evaluate_forked(index: int) -> tuple[int, PointOutcome]:
    scenarios, profile = _FORKED
    return index, evaluate_point(scenarios[index], profile)


class LocalExecutor:
    """``workers`` forked processes (in-process for one); see the module docstring."""

    def __init__(self, profile: Profile | None, workers: int):
        self.profile, self.workers = profile, workers

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def imap_unordered(self, scenarios: list[Scenario]) -> Iterator[tuple[int, PointOutcome]]:
        """(index into ``scenarios``, outcome) as each point finishes."""
        if self.workers == 1 or len(scenarios) <= 1:
            for index, scenario in enumerate(scenarios):
                yield index, evaluate_point(scenario, self.profile)
            return
        global _FORKED
        _FORKED = (scenarios, self.profile)
        try:
            context = multiprocessing.get_context("fork")
            with interrupt.deferred():  # a signal in the forks' at-fork callbacks would be lost (interrupt.fork_worker)
                pool = context.Pool(min(self.workers, len(scenarios)), initializer=interrupt.as_worker,
                                    initargs=(os.getpid(),))
            with pool:  # __exit__ terminates the workers
                yield from pool.imap_unordered(_evaluate_forked, range(len(scenarios)))
        finally:
            _FORKED = ([], None)


def _worker_version() -> str:
    """A Dask worker's hetsim version (run there; looked up in its own sim.grid)."""
    from sim import grid

    return grid.hetsim_version()


class DaskExecutor:
    """The points as tasks of a Dask distributed cluster; see the module docstring."""

    def __init__(self, address: str, profile: Profile | None):
        try:
            from dask.distributed import Client
        except ImportError:
            raise ConfigError("--scheduler", "needs Dask: pip install 'dask[distributed]' "
                                             f"(got {shorten(address)})") from None
        try:
            self.client = Client(address, timeout=SCHEDULER_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError, TypeError) as error:
            raise ConfigError("--scheduler", f"no Dask scheduler answers there within {SCHEDULER_TIMEOUT_S} s: "
                                             f"{shorten(str(error), 120, quote=False)} (got {shorten(address)})") from None
        try:
            self._check_workers(address)
        except BaseException:
            self.client.close()
            raise
        self.profile = profile

    def _check_workers(self, address: str) -> None:
        """Refuse a cluster without workers (its tasks would wait forever) or whose workers run
        another hetsim (their results would be stored under this one's keys)."""
        try:
            self.client.wait_for_workers(1, timeout=SCHEDULER_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError("--scheduler", f"the scheduler has no worker after {SCHEDULER_TIMEOUT_S} s "
                                             f"(got {shorten(address)})") from None
        try:
            versions = self.client.run(_worker_version)
        except Exception as error:  # noqa: BLE001  (whatever a worker raised: it cannot run hetsim)
            raise ConfigError("--scheduler", f"a worker cannot import hetsim: {shorten(str(error), 120, quote=False)} "
                                             f"(got {shorten(address)})") from None
        other = {worker: v for worker, v in versions.items() if v != hetsim_version()}
        if other:
            worker, version = sorted(other.items())[0]
            raise ConfigError("--scheduler", f"{len(other)} of {len(versions)} workers run another hetsim ({worker}: "
                                             f"{version}, here {hetsim_version()}); start them from this checkout "
                                             f"(got {shorten(address)})")

    def __enter__(self) -> DaskExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def imap_unordered(self, scenarios: list[Scenario]) -> Iterator[tuple[int, PointOutcome]]:
        """(index into ``scenarios``, outcome) as each task finishes."""
        from dask.distributed import as_completed

        if not scenarios:
            return
        profile = self.client.scatter(self.profile, broadcast=True) if self.profile is not None else None
        keys = [f"hetsim-point-{i}-{id(self)}" for i in range(len(scenarios))]
        index = {key: i for i, key in enumerate(keys)}
        futures = self.client.map(evaluate_point, scenarios, key=keys, profile=profile)
        try:
            for future, outcome in as_completed(futures, with_results=True):
                yield index[future.key], outcome
        finally:
            self.client.cancel(futures)


def axes_json(axes: dict) -> str:
    """A point's axis values as compact JSON (what the store keeps)."""
    return json.dumps(axes, separators=(",", ":"), default=str)


def tidy_table(points: Sequence[GridPoint], outcomes: dict[str, PointOutcome]) -> pd.DataFrame:
    """One row per result row of every point, in grid order: the axes, :data:`RESULT_COLUMNS`,
    ``oom``, ``error``, ``profile_context`` and ``shares_note``; a refused point is one row with its ``error`` and no
    metric. An axis
    whose values are mappings, lists or of several types is written as JSON text."""
    axis_names = list(points[0].axes) if points else []
    rows = []
    for point in points:
        outcome = outcomes.get(point.key) if point.scenario is not None else None
        error = point.error or (outcome.error if outcome is not None else "not computed")
        if outcome is None or outcome.error:
            name = point.scenario.name if point.scenario is not None else ""
            rows.append((*point.axes.values(), name, "", "", "", float("nan"), "", "", "", error, "", ""))
            continue
        rows += [(*point.axes.values(), *row, outcome.oom.get(row[1], ""), "", outcome.profile_context,
                  outcome.shares_note) for row in outcome.rows]
    table = pd.DataFrame(rows, columns=[*axis_names, *RESULT_COLUMNS, *TIDY_EXTRA_COLUMNS])
    for name in axis_names:
        values = [v for v in table[name] if v is not None]
        if len({type(v) for v in values}) > 1 or any(isinstance(v, dict | list) for v in values):
            table[name] = [json.dumps(v, separators=(",", ":")) for v in table[name]]
    return table


def outside_context(points: Sequence[GridPoint], outcomes: dict[str, PointOutcome]) -> int:
    """How many simulated points a profile priced outside its calibration context."""
    return sum(1 for p in points if p.key in outcomes and outside(outcomes[p.key].profile_context))


def parquet_bytes(table: pd.DataFrame) -> bytes:
    """``table`` as Parquet (pyarrow), without the pandas index."""
    buffer = io.BytesIO()
    table.to_parquet(buffer, engine="pyarrow", index=False)
    return buffer.getvalue()


def write_grid_outputs(table: pd.DataFrame, out_dir: Path, report: str) -> list[Path]:
    """``results.csv``, ``results.parquet`` and ``report.html`` (the page ``report``) of a sweep,
    each written atomically."""
    return write_files(out_dir, {"results.csv": results_csv(table), "results.parquet": parquet_bytes(table),
                                 "report.html": report})


def sweep_command(scenario_path: Path, grid_path: Path, out_dir: Path, *, profile_path: Path | None,
                  workers: int, scheduler: str | None, console) -> None:
    """``hetsim sweep``: validate the grid's points, compute the missing ones with a progress bar,
    print the table and the verdict, write results.csv, results.parquet and report.html
    (:mod:`validation.present.grid_report`, from the store's rows) beside the store in ``out_dir``.

    Raises:
        ConfigError: a bad scenario, grid, profile, ``--out`` or ``--scheduler``.
    """
    import sqlite3

    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.markup import escape
    from rich.text import Text

    from models.input_files import load_yaml
    from sim.grid import grid_points, load_grid, profile_digest
    from sim.profile import load_profile
    from sim.scenario import load_scenario
    from sim.sweep_store import STORE_NAME
    from validation.present.grid_report import grid_html, grid_verdict
    from validation.present.sweep_table import grid_table

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed * 60:.0f} points/min" if task.speed else "", style="progress.data.speed")

    base = load_scenario(scenario_path)
    grid = load_grid(grid_path)
    profile = load_profile(profile_path) if profile_path is not None else None
    digest = profile_digest(profile_path)
    with console.status("validating the grid's points"):
        points = grid_points(load_yaml(scenario_path, "scenario"), grid, base_dir=scenario_path.parent,
                             source_path=scenario_path, profile_digest=digest)
    try:
        store = SweepStore(out_dir / STORE_NAME)
    except sqlite3.DatabaseError as error:
        raise ConfigError("--out", f"{out_dir / STORE_NAME} is not a sweep store: {error} (got {out_dir})") from None
    with store, Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), RateColumn(),
                         TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                         transient=True) as progress:
        task = progress.add_task("simulating", total=None)
        run = run_grid(points, store, profile=profile, workers=workers, scheduler=scheduler,
                       on_start=lambda total: progress.update(task, total=total),
                       on_done=lambda point, outcome: progress.advance(task))
        outcomes = store.outcomes(p.key for p in points if p.scenario is not None)
    table = tidy_table(points, outcomes)
    axes, kind = list(grid.axes), base.config.workload_kind
    title = f"{base.name} swept over {', '.join(axes)}"
    console.print(grid_table(table, axes, title, kind))
    console.print(escape(grid_verdict(table, axes, kind)))
    where = f"Dask at {scheduler}" if scheduler else f"{workers} local worker{'s' * (workers > 1)}"
    console.print(f"{len(points)} points: {run.computed} simulated now ({where}), {run.reused} from "
                  f"{out_dir / STORE_NAME}, {run.invalid} refused by the scenario schema"
                  + (f"; calibrated from {profile_path}, {outside_context(points, outcomes)} of "
                     f"{sum(1 for p in points if p.key in outcomes and not outcomes[p.key].error)} simulated points "
                     f"outside its calibration context (profile_context in results.csv)"
                     if profile_path else "; uncalibrated"))
    with interrupt.deferred():
        written = write_grid_outputs(table, out_dir, grid_html(table, axes, kind, title))
    console.print("wrote " + ", ".join(str(p) for p in written))
