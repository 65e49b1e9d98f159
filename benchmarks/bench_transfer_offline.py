"""Offline calibration transfer (issue 18): every shipped cluster predicted with every shipped
profile, with none, and with the pooled profiles of the others; see :mod:`validation.transfer`.

Re-simulates the shipped reports (``validation/report``, ``validation/holdout-report``) against
their measured medians; no testbed. About a minute on the project's 2-core machine. Writes
``errors.csv``, ``transfer.csv``, ``overall.csv``, ``summary.md`` and ``report.html`` (the source x
target heat map). ``--also MATRIX REPORT`` adds the clusters of another validation run;
``--only`` leaves the shipped reports out (a run on another machine, whose compute the shipped
profiles did not time).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_transfer_offline.py [--out validation/transfer-report] [--also MATRIX REPORT [--only]] [--no-token-buckets] [--no-arrival-lags] [--no-gloo-tree] [--core-turns] [--no-by-shape]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sim.outputs import write_files
from validation.present.transfer_report import transfer_html
from validation.pricing_options import add_pricing_options, apply_pricing_options
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
    parser.add_argument("--only", action="store_true",
                        help="only the --also reports' clusters, without the shipped ones (a run on another machine)")
    add_pricing_options(parser)
    args = parser.parse_args()
    if args.only and not args.also:
        parser.error("--only needs --also MATRIX REPORT")
    flags = apply_pricing_options(args)
    started = time.perf_counter()
    reports = (*(() if args.only else SHIPPED), *(tuple(pair) for pair in args.also))
    clusters = shipped_clusters(reports)
    errors = transfer_errors(clusters, on_progress=lambda text: print(text, file=sys.stderr))
    matrix = matrix_cluster_names()
    command = COMMAND if not args.also and not flags else " ".join(
        ["PYTHONPATH=. python benchmarks/bench_transfer_offline.py", "--out", str(args.out),
         *(f"--also {m} {r}" for m, r in args.also), *(["--only"] if args.only else []), *flags])
    written = write_transfer_report(errors, args.out, command, matrix, clusters)
    written += write_files(args.out, {"report.html": transfer_html(errors)})
    print(overall_table(errors, matrix).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"{time.perf_counter() - started:.0f} s; wrote " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
