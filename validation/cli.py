"""The ``hetsim`` command line. Thin: it parses, calls the library, prints and writes outputs.

User errors (:class:`models.errors.ConfigError`, and click's usage errors) print one line on
stderr and exit with code 2, before anything is written. A run whose rank fails, dies or hangs
(:class:`runtime.errors.LaunchError`) prints one line naming the rank and exits with code 1. SIGTERM,
SIGINT or SIGHUP ends any command cleanly (:func:`main`), with code 128 + the signal's number.
Numeric options are bounded and finite, as scenario fields are; ``measure`` and ``calibrate``
check that the plan fits in memory before any rank starts (:mod:`validation.memory_fit`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from models.errors import ConfigError, shorten
from runtime import interrupt
from runtime.errors import LaunchError
from sim.vocabulary import WorkloadKind
from validation.limits import MAX_REPEATS, MAX_TIMED_S, MAX_TIMEOUT_S

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = REPO_ROOT / "scenarios" / "low_resource_llama2_7b.yaml"
NO_PICK_EXIT_CODE = 3
"""``hetsim plan``'s exit code when it ran but no configuration meets every objective (its table,
report and the closest miss are written; 2 stays bad input)."""


_ALLOW_OVERCOMMIT = click.option(
    "--allow-overcommit", is_flag=True,
    help="Run on this machine's CPU even when the plan's simulated peak exceeds a device's capacity "
         "(never past the machine's available memory).")


class FiniteFloatRange(click.FloatRange):
    """A float option within ``[min, max]`` that is also finite: click's FloatRange lets ``nan``
    (every comparison with it is false) and ``inf`` through."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        converted = super().convert(value, param, ctx)
        if not math.isfinite(converted):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return converted


def _console() -> Console:
    """Stdout, wide enough for the tables when it is not a terminal (a log, a pipe)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def _warn_loaded(profile, console: Console) -> None:
    """One yellow line where ``profile`` (a :class:`sim.profile.Profile`, or None) was calibrated
    while other processes took much of the machine (:func:`sim.context.load_warning`)."""
    from sim.context import load_warning, profile_contexts

    warning = "" if profile is None else load_warning(profile_contexts(profile.rows))
    if warning:
        console.print(f"[yellow]{escape(warning)}[/yellow]")


def _print_came_from(console: Console, name: str, sources, calibrations) -> None:
    """What came from where: the profile's context against scenario ``name`` term by term and
    the source of each fitted term (``sources``, none to print uncalibrated), then which variants
    each calibration mode priced (:func:`validation.present.page.calibration_line`)."""
    from validation.present.page import calibration_line

    if sources:
        console.print(f"what came from where (the profile's context against {escape(name)}):")
        for line in sources:
            console.print(f"  {escape(line)}")
    console.print(escape(calibration_line(calibrations)))


def _calibration_load(profile) -> str:
    """The load a fresh profile table's calibration ran under and the machine's speed around it
    (:mod:`runtime.reference_timing`), for ``hetsim calibrate``'s summary."""
    from sim.context import profile_contexts

    contexts = profile_contexts(profile)
    loaded = [c for c in contexts if c.other_load is not None]
    parts = [f"machine load over the calibration: steal {c.cpu_steal:.1%}, other processes {c.other_load:.1%} "
             "of its CPU time" for c in loaded] or ["machine load not recorded (/proc/stat unreadable)"]
    parts += ["machine speed (reference op set, median): " + ", ".join(f"{op} {seconds * 1e3:.2f} ms"
                                                                      for op, seconds in c.reference_s)
              for c in contexts if c.reference_s]
    return "; ".join(parts)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """hetsim: simulate LLM inference on clusters with non-uniform bandwidth."""


@cli.command()
@click.argument("scenario", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for results.csv, trace.json and report.html (default: out/<scenario name>).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration profile from hetsim calibrate: price ops from measurements.")
def simulate(scenario: Path | None, out_dir: str | None, profile_path: Path | None) -> None:
    """Predict TTFT, TPOT, decode tokens/s and peak memory for each variant of SCENARIO.

    Without SCENARIO, runs the default scenario (scenarios/low_resource_llama2_7b.yaml).
    """
    from sim.scenario import load_scenario
    from sim.simulate import simulate as run_simulation
    from validation.present.simulate_report import recommendation, write_outputs
    from validation.present.tables import print_summary

    from sim.profile import load_profile

    if out_dir == "":  # an unset variable in --out "$DIR"; Path("") would be the current directory
        raise ConfigError("--out", "empty path; write --out . for the current directory (got '')")
    loaded = load_scenario(scenario or DEFAULT_SCENARIO)
    out_dir = Path(out_dir) if out_dir is not None else Path("out") / loaded.name
    check_out_dir(out_dir)
    console = _console()
    if loaded.config.is_training:
        _simulate_training(loaded, out_dir, profile_path, console)
        return
    profile = load_profile(profile_path) if profile_path else None
    _warn_loaded(profile, console)
    if loaded.config.sweep is not None:
        _simulate_sweep(loaded, out_dir, console, profile)
        return
    if loaded.config.workload_kind is WorkloadKind.SERVING:
        _simulate_serving(loaded, out_dir, profile, console)
        return
    with console.status(f"simulating {len(loaded.config.variants)} variants"):  # a terminal sees it is busy
        result = run_simulation(loaded, profile=profile)
    print_summary(result, console)
    console.print(escape(recommendation(result)))
    if profile is None:
        console.print("uncalibrated: roofline compute and datasheet links (hetsim calibrate makes a profile)"
                      + ("; transport terms from documented defaults:" if result.sources else ""))
        for line in result.sources:
            console.print(f"  {escape(line)}")
    elif result.extrapolated:
        console.print(f"[yellow]{len(result.extrapolated)} predictions extrapolated outside the calibrated range:[/yellow]")
        for line in result.extrapolated:
            console.print(f"  {escape(line)}")
    elif result.network is not None and not result.network.same_cluster:
        console.print(f"calibrated from {profile_path}, measured on another cluster: its terms are rescaled to "
                      "this one and none of its timings is replayed (what came from where: below)")
    else:
        console.print(f"calibrated from {profile_path}; no prediction outside the calibrated range")
    _print_came_from(console, loaded.name, result.sources if profile is not None else (), result.calibrations)
    with interrupt.deferred():
        written = write_outputs(result, out_dir)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _simulate_training(loaded, out_dir: Path, profile_path: Path | None, console: Console) -> None:
    """``hetsim simulate`` of a training scenario (:mod:`sim.training.simulate`)."""
    from sim.training.simulate import simulate_training
    from validation.present.training_report import print_training_summary, write_training_outputs

    from sim.profile import load_profile

    profile = load_profile(profile_path) if profile_path else None
    _warn_loaded(profile, console)
    with console.status(f"simulating {len(loaded.config.variants)} training variants"):
        result = simulate_training(loaded, profile)
    print_training_summary(result, console)
    if profile is None:
        console.print("uncalibrated: roofline compute and datasheet links, one optimizer step per variant")
    else:
        console.print(f"calibrated from {profile_path}: from the profile: "
                      + (", ".join(result.calibrated_terms) or "no compute term"))
        if result.extrapolated:
            console.print(f"[yellow]{len(result.extrapolated)} terms modelled, not calibrated, or outside the "
                          "calibrated range:[/yellow]")
            for line in result.extrapolated:
                console.print(f"  {escape(line)}")
    _print_came_from(console, loaded.name, result.sources if profile is not None else (), result.calibrations)
    with interrupt.deferred():
        written = write_training_outputs(result, out_dir)
    console.print("wrote " + ", ".join(str(p) for p in written))


_SYSTEM_TREES = (Path("/proc"), Path("/sys"), Path("/dev"))


def check_out_dir(out_dir: Path) -> None:
    """Raise ConfigError on ``--out`` unless ``out_dir`` is, or can be made, a writable directory.

    Checked before any work, and without creating anything: the nearest existing ancestor must be
    a directory we may write into, and nothing on the way may be a file; kernel trees (/proc, /sys,
    /dev) are refused outright.
    """
    shown = shorten(str(out_dir), keep_end=True)
    try:
        resolved = out_dir.resolve()
    except (OSError, RuntimeError) as error:
        raise ConfigError("--out", f"not a usable directory: {error} (got {shown})") from None
    if any(resolved == tree or tree in resolved.parents for tree in _SYSTEM_TREES):
        raise ConfigError("--out", f"a kernel file system, not a place for results (got {shown})")
    existing = resolved
    while not existing.exists():
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            raise ConfigError("--out", f"a dangling symbolic link on the way (got {shown})")
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("--out", f"{shorten(str(existing), keep_end=True)} is a file, not a directory (got {shown})")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"no permission to write in {shorten(str(existing), keep_end=True)} (got {shown})")


def _simulate_serving(scenario, out_dir: Path, profile, console: Console) -> None:
    """Serve a ``kind: serving`` scenario's requests with each variant; print the table, write
    results.csv, requests.csv and report.html."""
    from sim.serving.simulate import simulate_serving
    from validation.present.serving import print_serving, write_serving

    with console.status(f"serving {len(scenario.config.variants)} variants"):
        result = simulate_serving(scenario, profile=profile)
    print_serving(result, console)
    _print_came_from(console, scenario.name, result.sources, result.calibrations)
    with interrupt.deferred():
        written = write_serving(result, out_dir)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _simulate_sweep(scenario, out_dir: Path, console: Console, profile) -> None:
    """Simulate every point of the scenario's sweep (calibrated by ``profile``, if any); print the
    tables, write sweep.csv and memory_report.html."""
    from rich.progress import Progress

    from sim.context import outside
    from sim.outputs import results_csv, write_files
    from sim.sweep import run_sweep, sweep_points
    from validation.present.sweep_report import memory_verdict, sweep_html
    from validation.present.tables import sweep_tables
    from validation.sweep_runner import LocalExecutor, default_workers

    points = sweep_points(scenario)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(points))

        def advance(point) -> None:
            progress.update(task, advance=1, description=f"{point.model} on {point.devices} devices")

        pool = LocalExecutor(profile, default_workers())
        table = run_sweep(scenario, profile=profile, on_point=advance, imap=pool.imap_unordered)
    for rich_table in sweep_tables(table):
        console.print(rich_table)
    for point in points:
        if point.split:
            console.print(escape(f"{point.model} on {point.devices} devices: {point.split}"))
    console.print("cells: max peak memory per device (GiB) · TPOT (ms) · TTFT (s); uneven: heads and MLP columns "
                  "split unevenly, by the basis above; n/a: the point cannot run (the note in sweep.csv says why)"
                  + ("" if profile is None else f"; calibrated by the profile, "
                     f"{table['profile_context'].map(outside).sum()} of {int(table['feasible'].sum())} "
                     f"points outside its calibration context (profile_context in sweep.csv)"))
    console.print(escape(memory_verdict(table)))
    written = write_files(out_dir, {"sweep.csv": results_csv(table),
                                    "memory_report.html": sweep_html(scenario.name, scenario.config.description,
                                                                     table)})
    console.print("wrote " + ", ".join(str(p) for p in written))


@cli.command()
@click.argument("plan_file", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for plan.csv, plan.parquet, report.html, pick.yaml and a serving pick's "
                   "pick_batch.yaml (default: out/<plan name>).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration profile: price the candidates from it and name those outside its context.")
def plan(plan_file: Path, out_dir: str | None, profile_path: Path | None) -> None:
    """The cheapest cluster and layout meeting PLAN's objectives, the top 10 and the Pareto frontiers.

    Exits with code 3 (its outputs written) when no configuration meets every objective."""
    from rich.progress import Progress

    from sim.planning.outcome import plan as run_plan
    from sim.planning.plan_config import load_plan
    from sim.profile import load_profile
    from validation.present.plan_report import PICK_FILE, print_plan, write_plan_outputs

    if out_dir == "":
        raise ConfigError("--out", "empty path; write --out . for the current directory (got '')")
    request = load_plan(plan_file)
    out = Path(out_dir) if out_dir is not None else Path("out") / request.name
    check_out_dir(out)
    profile = load_profile(profile_path) if profile_path else None
    console = _console()
    _warn_loaded(profile, console)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating clusters", total=None)
        result = run_plan(request, profile=profile,
                          progress=lambda done, total: progress.update(task, completed=done, total=total))
    with interrupt.deferred():
        written = write_plan_outputs(result, out)
    print_plan(result, console, out / PICK_FILE if result.pick_scenario is not None else None)
    console.print("wrote " + ", ".join(str(p) for p in written))
    if result.pick is None:  # a script must not take the closest miss for an answer
        sys.exit(NO_PICK_EXIT_CODE)


@cli.command("plan-check")
@click.argument("plan_file", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for candidates.csv, generations.csv, summary.md, the scenarios measured and the plan.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration profile the plan prices its candidates with.")
@click.option("--top", type=click.IntRange(1, 10), default=5, show_default=True,
              help="How many of the plan's top configurations to measure.")
@click.option("--rounds", type=click.IntRange(1, MAX_REPEATS), default=3, show_default=True,
              help="Rounds: each measures every candidate once, in plan order then reversed.")
@click.option("--repeats", type=click.IntRange(1, MAX_REPEATS), default=3, show_default=True,
              help="Timed generations per candidate and round.")
@click.option("--warmup", type=click.IntRange(0, MAX_REPEATS), default=1, show_default=True,
              help="Untimed generations per candidate and round.")
def plan_check(plan_file: Path, out_dir: Path, profile_path: Path | None, top: int, rounds: int, repeats: int,
               warmup: int) -> None:
    """Plan PLAN, measure its top configurations on the emulated cluster and check the plan: the
    pick against the best measured, its SLO verdict, predicted against measured, rank agreement.
    Where HETSIM_TESTBED_LOCK names a file, a candidate's testbed is up only while this command
    holds a flock on it, so that runs sharing the machine's testbed take turns."""
    from sim.planning.outcome import plan as run_plan
    from sim.planning.plan_config import load_plan
    from sim.profile import load_profile
    from validation.plan_check import check_plan, summary_markdown, top_candidates, write_plan_check
    from validation.present.plan_report import write_plan_outputs

    check_out_dir(out_dir)
    request = load_plan(plan_file)
    profile = load_profile(profile_path) if profile_path else None
    console = _console()
    command = " ".join(["hetsim plan-check", str(plan_file), "--out", str(out_dir)]
                       + (["--profile", str(profile_path)] if profile_path else [])
                       + [f"--top {top} --rounds {rounds} --repeats {repeats} --warmup {warmup}"])
    with console.status("planning") as status:
        result = run_plan(request, profile=profile)
        try:
            top_candidates(result, top)
        except ValueError as error:
            raise ConfigError("plan", f"{error} (got {shorten(str(plan_file), keep_end=True)})") from None
        _require_torch("plan-check")
        checked = check_plan(result, profile, n=top, rounds=rounds, repeats=repeats, warmup=warmup,
                             command=command, on_progress=status.update)
    with interrupt.deferred():
        written = write_plan_outputs(result, out_dir / "plan") + write_plan_check(checked, out_dir)
    console.print(escape(summary_markdown(checked)))
    console.print("wrote " + ", ".join(str(p) for p in written))


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--grid", "grid_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="YAML of axes (dotted scenario fields, each with a list of values) and exclusions.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for sweep.sqlite, results.csv and results.parquet (default: out/<scenario "
                   "name>-sweep); a rerun into it simulates only the points it lacks.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration profile from hetsim calibrate, applied to every point.")
@click.option("--workers", type=click.IntRange(1, 1024), default=None,
              help="Local worker processes (default: the cores this process may use).")
@click.option("--scheduler", default=None,
              help="Address of a Dask distributed scheduler (tcp://host:8786): the points run there.")
def sweep(scenario: Path, grid_path: Path, out_dir: str | None, profile_path: Path | None, workers: int | None,
          scheduler: str | None) -> None:
    """Simulate SCENARIO at every point of the grid GRID (a cartesian product of scenario fields),
    in parallel and resumably; writes results.csv and results.parquet (tidy, one column per axis)."""
    from sim.scenario import load_scenario
    from validation.sweep_runner import default_workers, sweep_command

    if out_dir == "":
        raise ConfigError("--out", "empty path; write --out . for the current directory (got '')")
    out = Path(out_dir) if out_dir is not None else Path("out") / f"{load_scenario(scenario).name}-sweep"
    check_out_dir(out)
    sweep_command(scenario, grid_path, out, profile_path=profile_path, workers=workers or default_workers(),
                  scheduler=scheduler, console=_console())


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for results.csv and trace.json (default: out/<scenario name>-measured).")
@click.option("--testbed", is_flag=True, help="Run each rank inside its host's namespace (hetsim testbed up first).")
@click.option("--repeats", type=click.IntRange(1, MAX_REPEATS), default=5, show_default=True,
              help="Timed generations per variant (training: timed runs of workload.steps optimizer steps).")
@click.option("--warmup", type=click.IntRange(0, MAX_REPEATS), default=1, show_default=True,
              help="Untimed generations first (training: untimed optimizer steps).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seed of the weights and the prompt.")
@click.option("--hang-timeout", "hang_timeout_s", type=FiniteFloatRange(1, MAX_TIMEOUT_S), default=120.0,
              show_default=True, help="Seconds without progress after which the run fails, naming the stalled rank.")
@click.option("--interleave", is_flag=True,
              help="Training: time the variants one step of each in turn, on one clock (every variant's "
                   "trainer alive at once), instead of one after the other.")
@_ALLOW_OVERCOMMIT
def measure(scenario: Path, out_dir: Path | None, testbed: bool, repeats: int, warmup: int, seed: int,
            hang_timeout_s: float, interleave: bool, allow_overcommit: bool) -> None:
    """Run SCENARIO's variants for real (torch.distributed, one process per device) and measure
    TTFT, TPOT, decode tokens/s and peak memory; writes results.csv (source=measured), trace.json."""
    from sim.scenario import load_scenario

    from validation.memory_fit import check_memory_fits

    loaded = load_scenario(scenario)
    if interleave and not loaded.config.is_training:
        raise ConfigError("--interleave", "times a training scenario's variants in turn; this scenario's "
                                          "workload is inference (got --interleave)")
    check_memory_fits(loaded, allow_overcommit=allow_overcommit)
    _require_torch("measure")
    from runtime.measure import measure_scenario, write_measured_outputs
    from runtime.training.measure import measure_training

    training = loaded.config.is_training
    options = {"interleave": interleave} if training else {}
    result = (measure_training if training else measure_scenario)(
        loaded, repeats=repeats, warmup=warmup, seed=seed, testbed=testbed, hang_timeout_s=hang_timeout_s, **options)
    from sim.parallel import ParallelPlan
    from validation.present.layout import idle_line
    from validation.present.tables import measured_table, measured_training_table

    console = _console()
    console.print((measured_training_table if training else measured_table)(loaded.name, repeats, result.variants))
    layout = None if training else ParallelPlan.of(loaded, result.topology)
    if layout is not None and layout.shares_note:
        console.print(escape(layout.shares_note))
    if layout is not None and (warning := idle_line(result.idle_devices, len(result.topology.devices), layout.label)):
        console.print(f"[yellow]{escape(warning)}[/yellow]")
    with interrupt.deferred():  # both files or neither
        written = write_measured_outputs(result, out_dir or Path("out") / f"{loaded.name}-measured")
    console.print("wrote " + ", ".join(str(p) for p in written))


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "profile_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the calibration profile (CSV).")
@click.option("--testbed", is_flag=True, help="Measure inside the scenario's testbed (hetsim testbed up first).")
@click.option("--repeats", type=click.IntRange(1, MAX_REPEATS), default=5, show_default=True,
              help="Repeats per measurement.")
@click.option("--max-call", "max_call_s", type=FiniteFloatRange(0.01, MAX_TIMED_S), default=1.0,
              show_default=True,
              help="Stop growing a collective's size once one call takes longer than this (s).")
@_ALLOW_OVERCOMMIT
def calibrate(scenario: Path, profile_path: Path, testbed: bool, repeats: int, max_call_s: float,
              allow_overcommit: bool) -> None:
    """Measure SCENARIO's cluster (links, every collective algorithm, compute per op, framework
    overhead, memory baseline) and write a calibration profile for hetsim simulate --profile."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from sim.outputs import write_atomic
    from sim.scenario import load_scenario

    from validation.memory_fit import check_memory_fits

    loaded = load_scenario(scenario)
    check_memory_fits(loaded, allow_overcommit=allow_overcommit)
    _require_torch("calibrate")
    from runtime.calibrate import calibrate_scenario
    from runtime.training.calibrate import calibrate_training

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  transient=not sys.stdout.isatty()) as progress:
        task = progress.add_task("starting ranks", total=None)

        def on_beat(rank: int, label: str) -> None:
            if rank == 0:
                progress.update(task, description=f"calibrating: {label}")

        if loaded.config.is_training:
            profile = calibrate_training(loaded, testbed=testbed, repeats=repeats, max_call_s=max_call_s,
                                         on_beat=on_beat)
        else:
            profile = calibrate_scenario(loaded, testbed=testbed, repeats=repeats, max_call_s=max_call_s,
                                         on_beat=on_beat)
    write_atomic(profile_path, profile.to_csv(index=False, lineterminator="\n"))
    counts = profile["measurement"].value_counts().to_dict()
    click.echo(f"wrote {profile_path}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
               + f"; {_calibration_load(profile)}")


@cli.command()
@click.argument("matrix", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the error report (CSV tables, summary.md, report.html) and profiles.")
@_ALLOW_OVERCOMMIT
def validate(matrix: Path, out_dir: Path, allow_overcommit: bool) -> None:
    """Run MATRIX both ways (calibrated simulation; measurement on the testbed) and report the
    simulator's error per case and metric, its ranking of strategies, and the seed's claim.
    A training matrix (kind: training) calibrates each cluster once and reports step time,
    peak memory, ranking and overlap gain, replay and prediction apart."""
    from validation.matrix import load_matrix
    from validation.training_validation import is_training_matrix

    if matrix.is_file() and is_training_matrix(matrix):
        _validate_training(matrix, out_dir, allow_overcommit)
        return
    loaded, scenarios = load_matrix(matrix)
    _require_torch("validate")
    from validation.present.validation_report import summary_markdown, write_validation
    from validation.validate import validate as run_validation

    console = _console()
    with console.status("validating") as status:
        report = run_validation(loaded, scenarios, out_dir, on_progress=lambda text: status.update(text),
                                allow_overcommit=allow_overcommit)
    with interrupt.deferred():  # the report's files together, or none
        written = write_validation(report, out_dir, loaded.name)
    console.print(summary_markdown(report, loaded.name))
    if loaded.transfer:
        written += _transfer(matrix, out_dir, console)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _validate_training(matrix: Path, out_dir: Path, allow_overcommit: bool) -> None:
    """``hetsim validate`` of a training matrix (:mod:`validation.training_validation`)."""
    from validation.training_validation import (load_training_matrix, summary_markdown, validate_training,
                                                write_training_validation)

    loaded, scenarios = load_training_matrix(matrix)
    _require_torch("validate")
    console = _console()
    with console.status("validating training") as status:
        report = validate_training(loaded, scenarios, out_dir, on_progress=lambda text: status.update(text),
                                   allow_overcommit=allow_overcommit)
    command = f"hetsim validate {matrix} --out {out_dir}" if loaded.transfer else None
    with interrupt.deferred():
        written = write_training_validation(report, out_dir, loaded.name, transfer_command=command)
    console.print(summary_markdown(report, loaded.name))
    if loaded.transfer:
        console.print((out_dir / "transfer" / "summary.md").read_text())
    console.print("wrote " + ", ".join(str(p) for p in written))


def _transfer(matrix: Path, out_dir: Path, console: Console) -> list[Path]:
    """The transfer step of a matrix with ``transfer: true``: every cluster just calibrated and
    measured, predicted from every other cluster's profile, from all others pooled and from none
    (:mod:`validation.transfer`), written under ``out_dir/transfer``."""
    from validation.present.transfer_report import transfer_html
    from sim.outputs import write_files
    from validation.transfer import matrix_cluster_names, shipped_clusters, transfer_errors, write_transfer_report

    clusters = shipped_clusters([(matrix, out_dir)])
    with console.status("predicting every cluster from every other's profile") as status:
        errors = transfer_errors(clusters, on_progress=lambda text: status.update(text))
    # the summary's `matrix` scope: the shipped matrix's clusters among the run's (all of a
    # matrix.yaml run; the 4 of validation/transfer.yaml's 9)
    names = {c.name for c in clusters}
    among = [name for name in matrix_cluster_names() if name in names]
    with interrupt.deferred():
        written = write_transfer_report(errors, out_dir / "transfer", f"hetsim validate {matrix} --out {out_dir}",
                                        among, clusters)
        written += write_files(out_dir / "transfer", {"report.html": transfer_html(errors)})
    console.print((out_dir / "transfer" / "summary.md").read_text())
    return written


def _require_torch(command: str) -> None:
    # c10d warns on every rendezvous that a testbed address has no host name; only errors matter.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        import torch  # noqa: F401  (10-15 s, once, before the ranks fork)
    except ImportError:
        raise ConfigError("runtime", f"hetsim {command} needs torch: pip install -e '.[runtime]' "
                                     "(torch==2.13.0) (got no torch)") from None


@cli.command()
@click.argument("action", type=click.Choice(["up", "down", "status"]))
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
def testbed(action: str, scenario: Path) -> None:
    """Build (up), remove (down) or inspect (status) SCENARIO's emulated cluster: one network
    namespace per host, links shaped to the scenario's rates and delays. Needs root and iproute2."""
    from runtime.testbed import Testbed, require_privileges
    from sim.scenario import load_scenario
    from sim.topology import build_topology

    loaded = load_scenario(scenario)
    require_privileges()
    bed = Testbed(loaded.name, build_topology(loaded.config.cluster))
    if action == "up":
        bed.up()
        click.echo(f"testbed {loaded.name} is up")
    elif action == "down":
        bed.down()
        click.echo(f"testbed {loaded.name} is down")
    click.echo(json.dumps(bed.status(), indent=2) if action == "status" else "", nl=action == "status")


# What an interrupted command leaves, by command (the cleanup in runtime.launch, validate and Testbed.up).
_INTERRUPTED = {"measure": "its ranks are stopped, nothing written",
                "calibrate": "its ranks are stopped, no profile written",
                "validate": "its ranks are stopped and its testbeds removed, nothing written",
                "plan-check": "its ranks are stopped and its testbeds removed, nothing written",
                "testbed up": "what it built is removed",
                "sweep": "the points it finished stay in its sweep.sqlite; run it again for the rest"}


def _command(args: list[str]) -> str:
    """The subcommand named on the command line (``measure``, ``testbed up``), for messages."""
    words = [arg for arg in args if not arg.startswith("-")]
    return " ".join(words[:2] if words[:1] == ["testbed"] else words[:1]) or "hetsim"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hetsim`` console script.

    SIGTERM, SIGINT and SIGHUP end a command as an error does (:mod:`runtime.interrupt`): its
    ranks are killed and reaped, a testbed it built is removed, nothing is written; one line names
    the command and the signal, and the exit code is 128 + the signal's number.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with interrupt.catching():
            cli.main(args=args, prog_name="hetsim", standalone_mode=False)
    except interrupt.Interrupted as error:
        command = _command(args)
        click.echo(f"hetsim: {command} interrupted by {error.signum.name}; "
                   f"{_INTERRUPTED.get(command, 'nothing written')}", err=True)
        sys.exit(error.exit_code)
    except ConfigError as error:
        click.echo(f"hetsim: error: {error}", err=True)
        sys.exit(2)
    except LaunchError as error:
        click.echo(f"hetsim: run failed: {error}; nothing written", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("hetsim: aborted", err=True)
        sys.exit(130)
    except click.ClickException as error:
        click.echo(f"hetsim: error: {error.format_message()}", err=True)
        sys.exit(error.exit_code)
