"""Benchmark: a seeded fuzz run of ``hetsim simulate`` over thousands of hostile inputs (issue 17).

Mutations of every shipped scenario and model config (:mod:`validation.fuzz`: wrong types;
huge, tiny, zero, negative, NaN and inf numbers; unit garbage; deep nesting; bad bytes and
encodings; duplicate keys; unknown fields; overlong strings; path-like names; Hugging Face config
corruptions), each run in a child forked after the imports, with a 30 s wall-clock limit and a
4 GiB address-space limit, classified as clean error, success, traceback, hang, memory blow-up,
accepted nonsense, partial write or messy error. Target: no outcome but the first two.

Writes ``validation/fuzz-report/cases.csv`` (one row per case) and ``summary.md`` (the counts, the
machine, the command). Exit code 1 if any case had a bad outcome.

Run: ``.venv/bin/python benchmarks/bench_fuzz.py [--cases 2000] [--seed 17] [--workers 2]``
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from validation import fuzz  # noqa: E402

REPORT_DIR = ROOT / "validation" / "fuzz-report"


def _run(case: fuzz.Case) -> tuple[fuzz.Case, fuzz.Outcome]:
    workdir = Path(tempfile.mkdtemp(prefix=f"fuzz{case.index}-"))
    try:
        return case, fuzz.run_case(case, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPORT_DIR)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    seeds, configs = fuzz.seed_scenarios(), fuzz.seed_configs()
    cases = [fuzz.make_case(i, rng, seeds, configs) for i in range(args.cases)]
    fuzz.warm_imports()
    start = time.monotonic()
    results: list[tuple[fuzz.Case, fuzz.Outcome]] = []
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for n, (case, outcome) in enumerate(pool.imap_unordered(_run, cases), 1):
            results.append((case, outcome))
            if outcome.outcome in fuzz.BAD_OUTCOMES:
                print(f"[{n}/{len(cases)}] case {case.index} {case.mutation} {case.label}: {outcome.outcome} "
                      f"({outcome.stderr_line[:120]})", flush=True)
            elif n % 100 == 0:
                print(f"[{n}/{len(cases)}] {time.monotonic() - start:.0f} s", flush=True)
    wall_s = time.monotonic() - start
    results.sort(key=lambda pair: pair[0].index)
    _write_report(args, results, wall_s)
    bad = sum(outcome.outcome in fuzz.BAD_OUTCOMES for _, outcome in results)
    print(f"{len(results)} cases in {wall_s:.0f} s: " + ", ".join(
        f"{n} {name}" for name, n in Counter(o.outcome for _, o in results).most_common()))
    sys.exit(1 if bad else 0)


def _commit() -> str:
    """The checkout's commit (with "+changes" when the work tree differs), or "unknown"."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!validation/fuzz-report"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def _write_report(args: argparse.Namespace, results: list, wall_s: float) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "cases.csv", "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["case", "seed", "mutation", "label", "outcome", "exit_code", "wall_s", "stderr_first_line"])
        for case, outcome in results:
            writer.writerow([case.index, case.seed, case.mutation, case.label, outcome.outcome, outcome.exit_code,
                             outcome.wall_s, outcome.stderr_line])
    counts = Counter(outcome.outcome for _, outcome in results)
    by_mutation: dict[str, Counter] = {}
    for case, outcome in results:
        by_mutation.setdefault(case.mutation, Counter())[outcome.outcome] += 1
    walls = sorted(outcome.wall_s for _, outcome in results)
    lines = [
        "# Fuzz report: hetsim simulate on hostile input",
        "",
        f"Command: `python benchmarks/bench_fuzz.py --cases {args.cases} --seed {args.seed} --workers {args.workers}`"
        f" at commit {_commit()}",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}",
        f"Cases: {len(results)} in {wall_s:.0f} s wall ({args.workers} workers); per case median "
        f"{walls[len(walls) // 2]:.2f} s, max {walls[-1]:.1f} s; limits {fuzz.TIME_LIMIT_S:.0f} s and "
        f"{fuzz.MEMORY_LIMIT_BYTES >> 30} GiB address space per case",
        "",
        "| outcome | cases |",
        "| --- | ---: |",
        *(f"| {name} | {counts.get(name, 0)} |" for name in fuzz.OUTCOMES),
        "",
        "Bad outcomes (traceback, hang, memory, nonsense, partial_write, messy_error): "
        f"{sum(counts.get(name, 0) for name in fuzz.BAD_OUTCOMES)}",
        "",
        "| mutation | " + " | ".join(fuzz.OUTCOMES) + " |",
        "| --- |" + " ---: |" * len(fuzz.OUTCOMES),
        *(f"| {m} | " + " | ".join(str(c.get(name, 0)) for name in fuzz.OUTCOMES) + " |"
          for m, c in sorted(by_mutation.items())),
        "",
    ]
    (args.out / "summary.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
