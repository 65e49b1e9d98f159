"""Where a pipeline's decode step goes, simulated against a measured trace (issue 20: tp2_pp2's
TPOT predicted 26-35% fast): :func:`validation.stage_split.stage_split` of the scenario simulated
with a profile and of a ``hetsim measure`` trace of it (which holds its last repeat).

Run: ``PYTHONPATH=. python benchmarks/bench_stage_split.py SCENARIO.yaml --profile PROFILE.csv
--trace MEASURED/trace.json [--variant NAME]`` (a scenario with ``parallel: {pipeline: ...}``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.errors import ConfigError
from sim.outputs import read_chrome_trace
from sim.profile import load_profile
from sim.scenario import load_scenario
from sim.simulate import simulate
from validation.stage_split import stage_split


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--trace", type=Path, required=True, help="a measured trace.json (hetsim measure)")
    parser.add_argument("--variant", default=None, help="the variant (default: the scenario's first)")
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
        result = simulate(scenario, profile=load_profile(args.profile))
    except ConfigError as error:
        print(f"{error}", file=sys.stderr)
        return 2
    names = [v.variant.name for v in result.variants]
    name = args.variant or names[0]
    if name not in names:
        print(f"--variant: not a variant of {args.scenario} ({', '.join(names)}) (got {name!r})", file=sys.stderr)
        return 2
    try:
        measured_ops, measured_steps = read_chrome_trace(json.loads(args.trace.read_text()))
    except (OSError, ValueError, KeyError) as error:
        print(f"--trace: not a trace.json ({error}) (got {args.trace})", file=sys.stderr)
        return 2
    trace = result.variants[names.index(name)].trace
    try:
        table = stage_split(trace.ops, trace.steps, measured_ops, measured_steps)
    except ValueError as error:
        print(f"--trace: {error} (got {args.trace})", file=sys.stderr)
        return 2
    print(f"{scenario.name} / {name} (ms; measured: decode steps of {args.trace} but the first)")
    print("| term | simulated | measured median | measured mean | mean - simulated |")
    print("|---|---|---|---|---|")
    for row in table.itertuples(index=False):
        print(f"| {row.term} | {row.simulated_s * 1e3:.2f} | {row.measured_median_s * 1e3:.2f} | "
              f"{row.measured_mean_s * 1e3:.2f} | {(row.measured_mean_s - row.simulated_s) * 1e3:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
