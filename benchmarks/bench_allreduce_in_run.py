"""Offline per-call check of the allreduces inside the transfer runs (issue 18): for every shipped
target, prompt and source profile, the simulated run's allreduce calls (per variant, phase and plan
op: the master's time from the last rank's arrival to its end, less the profile's op gap the
simulator charges inside each op, :mod:`validation.terms`) against the target's measured in-run
calls (its report's ``in_run_collectives.csv``: the mean over the measured trace's calls).

``bench_allreduce_calls.py`` prices each call alone, every rank arriving at once; this one reads
the calls as the transfer harness (``bench_transfer_offline.py``) simulates them in the runs, with
the arrivals the engine gives them, so a row's error is the per-call part of a case's
``collective:allreduce`` term. ``--no-token-buckets`` leaves out the links' token buckets
(:data:`sim.token_bucket.PRICED`, on by default). A source's figure for its own cluster is a **replay**, for any
other a **prediction**.

Writes ``calls.csv`` (target, source, prompt, variant, phase, call, size, simulated_s, measured_s,
error) under ``--out`` and prints the mean error per target, prompt, phase and algorithm (rows)
and source (columns). Two to five minutes on the project's 2-core machine.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_allreduce_in_run.py --out DIR [--no-token-buckets]
[--also MATRIX REPORT] [--core-turns]``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from models.ops import OpKind
from sim.simulate import simulate
from validation.matrix import with_prompt
from validation.terms import profile_gap_s
from validation.transfer import SHIPPED, shipped_clusters
from validation.pricing_options import add_pricing_options, apply_pricing_options
from validation.validate import call_durations

CALL_KEYS = ["target", "prompt", "variant", "phase", "call", "size"]


def measured_calls(reports) -> pd.DataFrame:
    """The measured allreduce calls of the reports' ``in_run_collectives.csv``, a later report's
    cluster replacing an earlier one's as :func:`validation.transfer.shipped_clusters` does;
    columns :data:`CALL_KEYS` and ``measured_s``."""
    tables = []
    for order, (_, report_dir) in enumerate(reports):
        table = pd.read_csv(Path(report_dir) / "in_run_collectives.csv")
        tables.append(table.assign(order=order))
    table = pd.concat(tables, ignore_index=True)
    table = table[table["order"] == table.groupby("scenario")["order"].transform("max")]
    table = table[table["op"] == OpKind.ALLREDUCE.value]
    return table.rename(columns={"scenario": "target", "prompt_tokens": "prompt", "size_bytes": "size",
                                 "measured": "measured_s"})[CALL_KEYS + ["measured_s"]]


def simulated_calls(clusters) -> pd.DataFrame:
    """Every target's allreduce calls as each cluster's profile simulates them in the target's runs
    (median over the calls of one plan op, s); columns ``source``, :data:`CALL_KEYS`, ``simulated_s``."""
    rows = []
    for target in clusters:
        for prompt in sorted(target.measured["prompt_tokens"].unique()):
            case = with_prompt(target.scenario, int(prompt))
            for source in clusters:
                result = simulate(case, profile=source.profile)
                gap_s = profile_gap_s(source.profile, result.topology.devices[result.ranks[0]].spec.name)
                for ran in result.variants:
                    calls = call_durations(ran.trace.ops)
                    calls = calls[calls["op"] == OpKind.ALLREDUCE.value]
                    for (phase, call, size), group in calls.groupby(["phase", "call", "size_bytes"], sort=True):
                        rows.append({"target": target.name, "source": source.name, "prompt": int(prompt),
                                     "variant": ran.variant.name, "phase": str(phase), "call": call,
                                     "size": int(size), "simulated_s": float(group["duration_s"].median()) - gap_s})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--also", nargs=2, action="append", type=Path, default=[], metavar=("MATRIX", "REPORT"))
    add_pricing_options(parser, ("--token-buckets", "--core-turns"))
    args = parser.parse_args()
    apply_pricing_options(args)
    started = time.perf_counter()
    reports = (*SHIPPED, *(tuple(pair) for pair in args.also))
    calls = simulated_calls(shipped_clusters(reports)).merge(measured_calls(reports), on=CALL_KEYS, how="inner")
    calls["error"] = calls["simulated_s"] / calls["measured_s"] - 1
    args.out.mkdir(parents=True, exist_ok=True)
    calls.to_csv(args.out / "calls.csv", index=False)
    table = calls.assign(algorithm=calls["variant"].str.replace("allreduce_", "", regex=False)).pivot_table(
        index=["target", "prompt", "phase", "algorithm"], columns="source", values="error", aggfunc="mean")
    print((table * 100).round(0).to_string())
    print(f"{time.perf_counter() - started:.0f} s; wrote {args.out / 'calls.csv'}")


if __name__ == "__main__":
    main()
