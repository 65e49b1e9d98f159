"""hetsim against published measurements: simulate every case of validation/published/cases.yaml
without a calibration profile (predictions) and write the comparison (issues 18 item 5, 19, 20).

Writes ``published.csv`` (one row per case: source, setup, metric, published value, hetsim value,
error = simulated / published - 1, what dominates the simulated step) and ``report.md`` under
``--out`` (default ``validation/published``). The logic is :mod:`validation.published_check`.
About 10 s on the project's 2-core machine (2026-11-29); a minute and a half before the
Megatron-LM TP 2 and TP 4 rows' data-parallel rings, which cross the tensor-parallel groups'
NVLink ports but reduce after the backward, kept their priced timing instead of running every
replica on the shared fabric (:mod:`sim.engine`, :mod:`sim.training.symmetry`).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_published.py [--cases FILE] [--out DIR]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.errors import ConfigError
from sim.outputs import write_files
from validation.published_check import CASES_FILE, compare, load_cases, report_markdown

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=CASES_FILE)
    parser.add_argument("--out", type=Path, default=CASES_FILE.parent)
    args = parser.parse_args()
    try:
        cases, not_represented = load_cases(args.cases)
        table = compare(cases)
    except ConfigError as error:  # bad input: one line naming the field, exit code 2 as hetsim's
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    command = "PYTHONPATH=. python benchmarks/bench_published.py"
    text = report_markdown(table, not_represented, command)
    written = write_files(args.out, {"published.csv": table.to_csv(index=False, lineterminator="\n"),
                                     "report.md": text})
    print(text)
    print("wrote " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
