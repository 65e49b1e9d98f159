"""Offline calibration transfer (issue 18): every shipped cluster predicted with every shipped
profile, with none, and with the pooled profiles of the others; see :mod:`validation.transfer`.

Re-simulates the shipped reports (``validation/report``, ``validation/holdout-report``) against
their measured medians; no testbed. About a minute on the project's 2-core machine. Writes
``errors.csv``, ``transfer.csv``, ``overall.csv``, ``summary.md`` and ``report.html`` (the source x
target heat map). ``--also MATRIX REPORT`` adds the clusters of another validation run.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_transfer_offline.py [--out validation/transfer-report] [--core-turns] [--arrival-lags]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sim import arrival_skew, cores, token_bucket
from sim.outputs import write_files
from validation.present.transfer_report import transfer_html
from validation.transfer import (SHIPPED, matrix_cluster_names, overall_table, shipped_clusters, transfer_errors,
                                 write_transfer_report)

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "PYTHONPATH=. python benchmarks/bench_transfer_offline.py --out validation/transfer-report"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "validation" / "transfer-report")
    parser.add_argument("--also", nargs=2, action="append", type=Path, default=[], metavar=("MATRIX", "REPORT"),
                        help="a further validation report (its matrix file and output directory) whose clusters "
                             "join the shipped ones, as sources and targets")
    parser.add_argument("--token-buckets", action="store_true",
                        help="price the links' declared token buckets (sim.token_bucket.PRICED, off by default)")
    parser.add_argument("--arrival-lags", action="store_true",
                        help="the master's expected wait for the last rank on shared cores in a prefill "
                             "(sim.arrival_skew.PRICED, off by default)")
    parser.add_argument("--core-turns", action="store_true",
                        help="ranks sharing cores take turns on them (sim.cores.TakingTurns) instead of sharing them fluidly")
    args = parser.parse_args()
    token_bucket.PRICED = args.token_buckets
    arrival_skew.PRICED = args.arrival_lags
    cores.SCHEDULING = cores.CoreScheduling.TURNS if args.core_turns else cores.SCHEDULING
    started = time.perf_counter()
    reports = (*SHIPPED, *(tuple(pair) for pair in args.also))
    clusters = shipped_clusters(reports)
    errors = transfer_errors(clusters, on_progress=lambda text: print(text, file=sys.stderr))
    matrix = matrix_cluster_names()
    command = COMMAND if not args.also and not args.token_buckets and not args.core_turns and not args.arrival_lags \
        else " ".join(
        ["PYTHONPATH=. python benchmarks/bench_transfer_offline.py", "--out", str(args.out),
         *(f"--also {m} {r}" for m, r in args.also), *(["--token-buckets"] if args.token_buckets else []),
         *(["--core-turns"] if args.core_turns else []), *(["--arrival-lags"] if args.arrival_lags else [])])
    written = write_transfer_report(errors, args.out, command, matrix, clusters)
    written += write_files(args.out, {"report.html": transfer_html(errors)})
    print(overall_table(errors, matrix).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"{time.perf_counter() - started:.0f} s; wrote " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
