"""Benchmark: how much one case's measured TPOT moves between launches, on the testbed and on loopback.

The noise floor of validation on this machine. Measures one variant of a scenario (with the
scenario's baseline beside it, as the matrix does) in several launches of
:func:`runtime.measure.measure_scenario`, each with ``--repeats`` timed generations, and prints
per launch the median TPOT with its p10 / p90 over repeats, then the spread of the launch medians
(max / min - 1). ``--where testbed`` runs inside the scenario's emulated cluster (root,
iproute2; brought up and down here), ``--where loopback`` runs the same ranks in this namespace
with no shaping: if the two spread alike, the spread comes from the ranks sharing the cores, not
from the emulated links.

Run: ``.venv/bin/python benchmarks/bench_measurement_spread.py [SCENARIO] [--variant allreduce_library]
[--prompt 32] [--launches 3] [--repeats 10] [--where testbed,loopback]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

from sim.scenario import Scenario, load_scenario, scenario_from_dict
from sim.topology import build_topology

ROOT = Path(__file__).resolve().parent.parent


def _case(scenario: Scenario, variant: str, prompt_tokens: int) -> Scenario:
    """``scenario`` at ``prompt_tokens`` with only its baseline and ``variant``."""
    data = scenario.config.model_dump(by_alias=True)
    data["workload"]["prompt_tokens"] = prompt_tokens
    if not data["model"].endswith(".json"):
        data["model"] = scenario.model.name
    names = {variant, scenario.config.baseline or data["variants"][0]["name"]}
    data["variants"] = [v for v in data["variants"] if v["name"] in names]
    if not any(v["name"] == variant for v in data["variants"]):
        raise SystemExit(f"--variant: no variant named {variant!r} in {scenario.name}")
    return scenario_from_dict(data, base_dir=scenario.source_path.parent, source_path=scenario.source_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", default=str(ROOT / "scenarios" / "validation" / "v4x1_bandwidth.yaml"))
    parser.add_argument("--variant", default="allreduce_library")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--where", default="testbed,loopback")
    args = parser.parse_args()
    case = _case(load_scenario(args.scenario), args.variant, args.prompt)

    from runtime.measure import measure_scenario  # imports torch (10-15 s)
    from runtime.testbed import Testbed

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    print(f"case: {case.name}, prompt {args.prompt}, {args.launches} launches x {args.repeats} repeats")
    for where in args.where.split(","):
        bed = Testbed(case.name, build_topology(case.config.cluster)) if where == "testbed" else None
        if bed is not None:
            bed.down()
            bed.up()
        medians: dict[str, list[float]] = {}
        try:
            for launch in range(args.launches):
                result = measure_scenario(case, repeats=args.repeats, warmup=1, testbed=bed is not None)
                for variant in result.variants:
                    t = variant.timing
                    medians.setdefault(variant.name, []).append(t["tpot_s"])
                    print(f"  {where:8} launch {launch} {variant.name:28} TPOT {t['tpot_s'] * 1e3:7.1f} ms "
                          f"[p10 {t['tpot_p10_s'] * 1e3:.1f}, p90 {t['tpot_p90_s'] * 1e3:.1f}]", flush=True)
        finally:
            if bed is not None:
                bed.down()
        for name, values in medians.items():
            print(f"{where:8} {name:28} median of launch medians {statistics.median(values) * 1e3:7.1f} ms, "
                  f"launch spread (max/min - 1) {max(values) / min(values) - 1:6.1%}")


if __name__ == "__main__":
    main()
