"""hetsim's uncalibrated NCCL defaults against published small-message allreduce latencies.

Prices every row of ``validation/published/nccl_tests/rows.yaml`` (nccl-tests ``all_reduce_perf`` at
8-128 bytes on one host) by hetsim's uncalibrated transport defaults (predictions) and by NCCL's
own tuning model, and writes ``nccl_tests.csv`` and ``nccl_tests.md`` under ``--out`` (default
``validation/published/nccl_tests``). The logic is :mod:`validation.nccl_tests_check`. A few seconds.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_nccl_tests.py [--rows FILE] [--out DIR]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.errors import ConfigError
from sim.outputs import write_files
from validation.nccl_tests_check import ROWS_FILE, compare, load_rows, report_markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, default=ROWS_FILE)
    parser.add_argument("--out", type=Path, default=ROWS_FILE.parent)
    args = parser.parse_args()
    try:
        table = compare(load_rows(args.rows))
    except ConfigError as error:  # bad input: one line naming the field, exit code 2 as hetsim's
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    text = report_markdown(table, "PYTHONPATH=. python benchmarks/bench_nccl_tests.py")
    written = write_files(args.out, {"nccl_tests.csv": table.to_csv(index=False, lineterminator="\n"),
                                     "nccl_tests.md": text})
    print(text)
    print("wrote " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
