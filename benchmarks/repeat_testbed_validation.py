"""How often the testbed validation test's ranking assertion fails: the body of
``tests/test_validation_testbed.py::test_calibrated_simulation_predicts_the_testbed`` (one
interleaved calibrate-and-measure launch on the emulated 2-host cluster, then a replay: the
cluster simulated with its own calibration) run ``--runs`` times, the testbed lock taken for each
run and released between runs so that others can use the testbed.

Each run's profile, measured and simulated results, errors, ranking, the per-round TTFT and TPOT
(``rounds.csv``) and the machine's load (``meta.json``: CPU stolen, other processes' share) go to
``OUT/run<i>/``; ``OUT/runs.csv`` lists the verdicts. Needs root and iproute2; about 90 s a run.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/repeat_testbed_validation.py --runs 8 --out /tmp/flaky
--lock /work/testbed.lock``
"""

from __future__ import annotations

import argparse
import fcntl
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd


def one_run(out: Path) -> dict:
    """One launch, replayed and judged as the test judges it; its files written to ``out``."""
    from runtime.interleaved import launch_interleaved
    from runtime.measure import measured_result, repeat_timings
    from runtime.testbed import Testbed
    from sim.profile import Profile
    from sim.simulate import simulate
    from sim.topology import build_topology
    from tests.test_validation_testbed import LAUNCH, clear_pairs, validation_scenario
    from validation.validate import case_errors

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as directory:
        scenario = validation_scenario(Path(directory))
        topology = build_topology(scenario.config.cluster)
        bed = Testbed(scenario.name, topology)
        bed.down()
        bed.up()
        try:
            run = launch_interleaved(scenario, [scenario], **LAUNCH)
        finally:
            bed.down()
        measured = measured_result(scenario, topology, run.measurements[0]).results
        simulated = simulate(scenario, profile=Profile(run.profile)).results
    errors = case_errors(scenario.name, 8, simulated, measured)
    ranking, clear = clear_pairs(scenario, run.measurements[0], errors)
    rounds = pd.DataFrame([{"variant": case.name, "round": i, **timing}
                           for v, case in enumerate(scenario.config.variants)
                           for i, timing in enumerate(repeat_timings([r[v] for r in run.measurements[0]], 0, 1))])
    files = {"profile.csv": run.profile, "measured.csv": measured, "simulated.csv": simulated, "errors.csv": errors,
             "ranking.csv": ranking, "rounds.csv": rounds}
    for name, frame in files.items():
        frame.to_csv(out / name, index=False)
    timing = errors[errors.metric.isin(["ttft_s", "tpot_s"])]
    verdict = {"median_abs_error": float(np.median(np.abs(timing.error))), "clear_pairs": len(clear),
               "ranking_holds": bool(len(clear) >= 2 and clear.simulator_agrees.all()),
               "cpu_steal": run.measurement_cpu_steal, "other_load": run.measurement_other_load,
               "calibration_other_load": run.calibration_other_load}
    (out / "meta.json").write_text(json.dumps(verdict, indent=1))
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lock", type=Path, required=True, help="the testbed's lock file, held for each run")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs: {args.runs} (at least 1)")
    verdicts = []
    for i in range(1, args.runs + 1):
        with open(args.lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, between runs
            verdicts.append({"run": i, **one_run(args.out / f"run{i}")})
        print(verdicts[-1], flush=True)
    pd.DataFrame(verdicts).to_csv(args.out / "runs.csv", index=False)


if __name__ == "__main__":
    main()
