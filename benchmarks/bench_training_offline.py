"""Offline re-simulation of a training validation report (issue 19): every cluster's cases
simulated with every cluster's shipped profile, against its shipped measurement; no testbed.

``hetsim validate`` of a training matrix saves each cluster's calibration and measurement under
``REPORT/clusters/<cluster>/`` (``profile.csv``, ``measured.csv``, ``load.json``); here they are
read back and compared as the validation compares them
(:func:`validation.training_validation.compare_clusters`): a cluster's cases with its own
profile are a **replay**, with another cluster's a **prediction** (the transfer figure). Prints
the summary table (median, p90 and max |error| per mode and metric, the ranking, the overlap
gains) and the signed error of every case per phase; ``--out`` writes the report's tables
(``errors.csv``, ``overlap.csv``, ``summary.md``, ...) there. Depends on nothing but the stored
files, not on the machine's load. Under a minute on the project's 2-core machine.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_training_offline.py [--matrix validation/training-quick.yaml] [--report validation/training-report] [--out DIR]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from sim.vocabulary import Metric
from validation.training_validation import (compare_clusters, load_report_clusters, load_training_matrix,
                                            summary_markdown, write_training_validation)

ROOT = Path(__file__).resolve().parent.parent
PHASES = (Metric.STEP_TIME, Metric.FORWARD_TIME, Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME,
          Metric.EXPOSED_COMMUNICATION)
"""The per-case columns printed: the step and where its error comes from."""


def signed_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Per (cluster, profile, case): the signed error of each of :data:`PHASES`, in percent."""
    chosen = errors[errors["metric"].isin([str(m) for m in PHASES])]
    table = chosen.pivot_table(index=["cluster", "calibrated_on", "case"], columns="metric", values="error",
                               sort=False)
    return (100 * table[[str(m) for m in PHASES if str(m) in table.columns]]).round(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, default=ROOT / "validation" / "training-quick.yaml",
                        help="the training matrix file the report was run from")
    parser.add_argument("--report", type=Path, default=ROOT / "validation" / "training-report",
                        help="the report directory whose clusters/ hold the saved profiles and measurements")
    parser.add_argument("--out", type=Path, default=None, help="write the re-simulated report's tables here")
    args = parser.parse_args()
    started = time.perf_counter()
    matrix, scenarios = load_training_matrix(args.matrix)
    runs = load_report_clusters(scenarios, args.report)
    report = compare_clusters(scenarios, runs, on_progress=lambda text: print(text, file=sys.stderr))
    print(summary_markdown(report, matrix.name))
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print("Signed errors per case (%, simulated / measured - 1):")
        print(signed_table(report.errors).to_string())
    if args.out is not None:
        written = write_training_validation(report, args.out, matrix.name)
        print("wrote " + ", ".join(str(p) for p in written))
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
