"""The ``hetsim`` command line. Thin: it parses, calls the library, prints and writes outputs.

User errors (:class:`models.errors.ConfigError`, and click's usage errors) print one line on
stderr and exit with code 2, before anything is written. A run whose rank fails, dies or hangs
(:class:`runtime.errors.LaunchError`) prints one line naming the rank and exits with code 1.
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
from rich.table import Table

from models.errors import ConfigError
from runtime.errors import LaunchError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = REPO_ROOT / "scenarios" / "low_resource_llama2_7b.yaml"
_GIB = 2**30


def _console() -> Console:
    """Stdout, wide enough for the tables when it is not a terminal (a log, a pipe)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def _change(pct: float) -> str:
    return "" if math.isnan(pct) else f"{pct:+.1f}%"


def print_summary(result, console: Console) -> None:
    """The per-variant table and the per-device peak memory table."""
    from sim.outputs import summary_table

    config = result.scenario.config
    table = Table(title=f"{config.name}: {result.scenario.model.name}, TP={len(result.ranks)}, "
                        f"batch {config.workload.batch_size}, prompt {config.workload.prompt_tokens}, "
                        f"output {config.workload.output_tokens} (baseline {result.scenario.baseline})")
    for column in ("variant", "TTFT ms", "Δ", "TPOT ms", "Δ", "decode tok/s", "Δ", "max peak GiB", "fits"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    summary = summary_table(result)
    for row in summary.itertuples(index=False):
        table.add_row(row.variant, f"{row.ttft_s * 1e3:.3f}", _change(row.ttft_s_change_pct),
                      f"{row.tpot_s * 1e3:.3f}", _change(row.tpot_s_change_pct), f"{row.decode_tokens_per_s:.1f}",
                      _change(row.decode_tokens_per_s_change_pct), f"{row.max_peak_memory_bytes / _GIB:.2f}",
                      "yes" if row.fits_in_memory else "[red]no[/red]")
    console.print(table)
    for row in summary.itertuples(index=False):
        console.print(f"  {row.variant}: {row.algorithms}")
    memory = Table(title="Peak memory per device (GiB)")
    memory.add_column("device")
    memory.add_column("capacity", justify="right")
    for vr in result.variants:
        memory.add_column(vr.variant.name, justify="right")
    for rank in result.ranks:
        device = result.topology.devices[rank]
        memory.add_row(device.name, f"{device.memory_capacity_bytes / _GIB:.2f}",
                       *(f"{vr.run.peak_bytes[rank] / _GIB:.2f}" for vr in result.variants))
    console.print(memory)
    for vr in result.variants:
        if vr.overflow is not None:
            device = result.topology.devices[vr.overflow.rank].name
            console.print(f"[red]{vr.variant.name}: {vr.overflow.describe(device)}[/red]")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """hetsim: simulate LLM inference on clusters with non-uniform bandwidth."""


@cli.command()
@click.argument("scenario", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for results.csv, trace.json and report.html (default: out/<scenario name>).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration profile from hetsim calibrate: price ops from measurements.")
def simulate(scenario: Path | None, out_dir: Path | None, profile_path: Path | None) -> None:
    """Predict TTFT, TPOT, decode tokens/s and peak memory for each variant of SCENARIO.

    Without SCENARIO, runs the default scenario (scenarios/low_resource_llama2_7b.yaml).
    """
    from sim.outputs import write_outputs
    from sim.scenario import load_scenario
    from sim.simulate import simulate as run_simulation

    from sim.profile import load_profile

    loaded = load_scenario(scenario or DEFAULT_SCENARIO)
    profile = load_profile(profile_path) if profile_path else None
    console = _console()
    if loaded.config.sweep is not None:
        _simulate_sweep(loaded, out_dir or Path("out") / loaded.name, console)
        return
    result = run_simulation(loaded, profile=profile)
    print_summary(result, console)
    if profile is None:
        console.print("uncalibrated: roofline compute and datasheet links (hetsim calibrate makes a profile)"
                      + ("; transport terms from documented defaults:" if result.sources else ""))
        for line in result.sources:
            console.print(f"  {escape(line)}")
    elif result.extrapolated:
        console.print(f"[yellow]{len(result.extrapolated)} predictions extrapolated outside the calibrated range:[/yellow]")
        for line in result.extrapolated:
            console.print(f"  {escape(line)}")
    else:
        console.print(f"calibrated from {profile_path}; no prediction outside the calibrated range")
    if profile is not None:
        console.print(f"what came from where (the profile's context against {escape(loaded.name)}):")
        for line in result.sources:
            console.print(f"  {escape(line)}")
    written = write_outputs(result, out_dir or Path("out") / loaded.name)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _simulate_sweep(scenario, out_dir: Path, console: Console) -> None:
    """Simulate every point of the scenario's sweep; print the tables, write sweep.csv and
    memory_report.html."""
    from rich.progress import Progress

    from sim.outputs import results_csv, write_files
    from sim.sweep import run_sweep, sweep_points
    from sim.sweep_report import sweep_html, sweep_tables

    total = len(sweep_points(scenario))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=total)

        def advance(point) -> None:
            progress.update(task, advance=1, description=f"{point.model} on {point.devices} devices")

        table = run_sweep(scenario, on_point=advance)
    for rich_table in sweep_tables(table):
        console.print(rich_table)
    console.print("cells: max peak memory per device (GiB) · TPOT (s) · TTFT (s); n/a: the degree does not "
                  "divide the model's attention heads")
    written = write_files(out_dir, {"sweep.csv": results_csv(table),
                                    "memory_report.html": sweep_html(scenario.config.description or scenario.name,
                                                                     table)})
    console.print("wrote " + ", ".join(str(p) for p in written))


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for results.csv and trace.json (default: out/<scenario name>-measured).")
@click.option("--testbed", is_flag=True, help="Run each rank inside its host's namespace (hetsim testbed up first).")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Timed generations per variant.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed generations first.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the weights and the prompt.")
@click.option("--hang-timeout", "hang_timeout_s", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds without progress after which the run fails, naming the stalled rank.")
def measure(scenario: Path, out_dir: Path | None, testbed: bool, repeats: int, warmup: int, seed: int,
            hang_timeout_s: float) -> None:
    """Run SCENARIO's variants for real (torch.distributed, one process per device) and measure
    TTFT, TPOT, decode tokens/s and peak memory; writes results.csv (source=measured), trace.json."""
    from sim.scenario import load_scenario

    loaded = load_scenario(scenario)
    _require_torch("measure")
    from runtime.measure import measure_scenario, write_measured_outputs

    result = measure_scenario(loaded, repeats=repeats, warmup=warmup, seed=seed, testbed=testbed,
                              hang_timeout_s=hang_timeout_s)
    console = _console()
    table = Table(title=escape(f"{loaded.name} measured ({repeats} repeats; median [p10, p90])"))
    for column in ("variant", "TTFT ms", "TPOT ms", "decode tok/s"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for v in result.variants:
        t = v.timing
        table.add_row(v.name, escape(f"{t['ttft_s'] * 1e3:.2f} [{t['ttft_p10_s'] * 1e3:.2f}, {t['ttft_p90_s'] * 1e3:.2f}]"),
                      escape(f"{t['tpot_s'] * 1e3:.2f} [{t['tpot_p10_s'] * 1e3:.2f}, {t['tpot_p90_s'] * 1e3:.2f}]"),
                      f"{t['decode_tokens_per_s']:.1f}")
    console.print(table)
    written = write_measured_outputs(result, out_dir or Path("out") / f"{loaded.name}-measured")
    console.print("wrote " + ", ".join(str(p) for p in written))


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "profile_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the calibration profile (CSV).")
@click.option("--testbed", is_flag=True, help="Measure inside the scenario's testbed (hetsim testbed up first).")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Repeats per measurement.")
@click.option("--max-call", "max_call_s", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Stop growing a collective's size once one call takes longer than this (s).")
def calibrate(scenario: Path, profile_path: Path, testbed: bool, repeats: int, max_call_s: float) -> None:
    """Measure SCENARIO's cluster (links, every collective algorithm, compute per op, framework
    overhead, memory baseline) and write a calibration profile for hetsim simulate --profile."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from sim.outputs import write_atomic
    from sim.scenario import load_scenario

    loaded = load_scenario(scenario)
    _require_torch("calibrate")
    from runtime.calibrate import calibrate_scenario

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  transient=not sys.stdout.isatty()) as progress:
        task = progress.add_task("starting ranks", total=None)

        def on_beat(rank: int, label: str) -> None:
            if rank == 0:
                progress.update(task, description=f"calibrating: {label}")

        profile = calibrate_scenario(loaded, testbed=testbed, repeats=repeats, max_call_s=max_call_s,
                                     on_beat=on_beat)
    write_atomic(profile_path, profile.to_csv(index=False, lineterminator="\n"))
    counts = profile["measurement"].value_counts().to_dict()
    click.echo(f"wrote {profile_path}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())))


@cli.command()
@click.argument("matrix", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the error report (CSV tables, summary.md, report.html) and profiles.")
def validate(matrix: Path, out_dir: Path) -> None:
    """Run MATRIX both ways (calibrated simulation; measurement on the testbed) and report the
    simulator's error per case and metric, its ranking of strategies, and the seed's claim."""
    from validation.matrix import load_matrix

    loaded, scenarios = load_matrix(matrix)
    _require_torch("validate")
    from validation.report import summary_markdown, write_validation
    from validation.validate import validate as run_validation

    console = _console()
    with console.status("validating") as status:
        report = run_validation(loaded, scenarios, out_dir, on_progress=lambda text: status.update(text))
    written = write_validation(report, out_dir, loaded.name)
    console.print(summary_markdown(report, loaded.name))
    console.print("wrote " + ", ".join(str(p) for p in written))


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


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hetsim`` console script."""
    try:
        cli.main(args=argv, prog_name="hetsim", standalone_mode=False)
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
