"""The ``hetsim`` command line. Thin: it parses, calls the library, prints and writes outputs.

User errors (:class:`models.errors.ConfigError`, and click's usage errors) print one line on
stderr and exit with code 2, before anything is written.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from models.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = REPO_ROOT / "scenarios" / "low_resource_llama2_7b.yaml"
_GIB = 2**30


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
def simulate(scenario: Path | None, out_dir: Path | None) -> None:
    """Predict TTFT, TPOT, decode tokens/s and peak memory for each variant of SCENARIO.

    Without SCENARIO, runs the default scenario (scenarios/low_resource_llama2_7b.yaml).
    """
    from sim.outputs import write_outputs
    from sim.scenario import load_scenario
    from sim.simulate import simulate as run_simulation

    loaded = load_scenario(scenario or DEFAULT_SCENARIO)
    result = run_simulation(loaded)
    console = Console(width=None if sys.stdout.isatty() else 160)
    print_summary(result, console)
    written = write_outputs(result, out_dir or Path("out") / loaded.name)
    console.print("wrote " + ", ".join(str(p) for p in written))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hetsim`` console script."""
    try:
        cli.main(args=argv, prog_name="hetsim", standalone_mode=False)
    except ConfigError as error:
        click.echo(f"hetsim: error: {error}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("hetsim: aborted", err=True)
        sys.exit(130)
    except click.ClickException as error:
        click.echo(f"hetsim: error: {error.format_message()}", err=True)
        sys.exit(error.exit_code)
