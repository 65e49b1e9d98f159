"""Offline per-call check of the allreduce pricing behind the transfer errors (issue 18): every
allreduce a shipped cluster called in its measured runs, priced as one call on its cluster with
every profile (its own, each other cluster's, none, the others pooled), against its measured time.

A transfer case's ``collective:allreduce`` term (``bench_transfer_offline.py``) is many calls
inside a run, where arrival skew, cores shared with compute and the links' idle time between calls
play in. Here each call is priced alone, every rank arriving at once, by the network model that
:func:`sim.simulate.build_pricing` gives the scenario for that profile, and compared with the
target's own profile's medians at the same algorithm and size:

* ``in_place``: its ``collective_in_place`` rows (the calls of real generations, last rank's start
  to the master's end; pooled over calls: the median of their medians);
* ``isolated``: its ``collective`` and ``collective_held_out`` rows (calls started together,
  last rank's start to last rank's end).

``predicted_master_s`` is the master's (the group's first rank's) finish, which ``in_place``
measures; ``predicted_s`` the last rank's, which ``isolated`` measures; both less the calibrated
arrival wait a replay adds (``CollectiveTiming.wait_s``, which neither measurement includes).
Sizes are the target's in-place ones: one token's activations (decode) and the prompt's
(prefill). ``cross_steps`` counts the schedule's steps with a transfer between hosts (the slow
links). The shipped clusters use every rank of their cluster, so the group is every rank.

Writes ``calls.csv`` under ``--out`` and prints the median signed error of the prediction against
``in_place`` and ``isolated`` per kind of pair, algorithm and size. A source's figure for a target
is a **replay** (``same``) or a **prediction** (``other``, ``pooled``, ``none``).
About two minutes on the project's 2-core machine.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_allreduce_calls.py [--out DIR] [--also MATRIX REPORT]``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from models.ops import OpKind
from sim.collectives.registry import build_schedule
from sim.simulate import build_pricing
from sim.topology import build_topology
from sim.vocabulary import MeasurementKind
from validation.transfer import SHIPPED, kind_of_pair, shipped_clusters, transfer_sources

ISOLATED_KINDS = (MeasurementKind.COLLECTIVE, MeasurementKind.COLLECTIVE_HELD_OUT)


def _median_at(rows: pd.DataFrame, algorithm: str, size_bytes: int) -> float:
    """The median of the rows' medians of ``algorithm`` at ``size_bytes`` (s; NaN where none)."""
    at = rows[(rows["algorithm"] == algorithm) & (rows["size_bytes"] == size_bytes)]
    return float(at["median"].median()) if len(at) else float("nan")


def call_errors(clusters) -> pd.DataFrame:
    """One row per (target, source, algorithm, size): the predicted call (s) and the target's
    measured in-place and isolated medians (s); see the module docstring."""
    rows = []
    for target in clusters:
        profile_rows = target.profile.rows
        allreduces = profile_rows[profile_rows["op"] == str(OpKind.ALLREDUCE)]
        in_place = allreduces[allreduces["measurement"] == MeasurementKind.COLLECTIVE_IN_PLACE]
        isolated = allreduces[allreduces["measurement"].isin(ISOLATED_KINDS)]
        calls = sorted({(str(a), int(s)) for a, s in zip(in_place["algorithm"], in_place["size_bytes"])})
        topology = build_topology(target.scenario.config.cluster)
        group = tuple(range(topology.num_ranks))
        isolated = isolated[isolated["group_size"] == len(group)]  # not the sweep over one host's ranks
        schedules = {(a, s): build_schedule(OpKind.ALLREDUCE, a, group, s, host_groups=topology.host_groups(group))
                     for a, s in calls}
        for source, profile in transfer_sources(target.name, {c.name: c.profile for c in clusters}):
            network = build_pricing(target.scenario, topology, group, profile).network
            for (algorithm, size_bytes), schedule in schedules.items():
                timing = network.time(schedule)
                rows.append({
                    "target": target.name, "source": source, "pairs": kind_of_pair(source, target.name),
                    "algorithm": algorithm, "size_bytes": size_bytes,
                    "cross_steps": sum(any(topology.devices[t.src].host != topology.devices[t.dst].host for t in step)
                                       for step in schedule.steps),
                    "predicted_master_s": timing.finish_s[group[0]] - timing.wait_s,
                    "predicted_s": timing.duration_s - timing.wait_s,
                    "in_place_s": _median_at(in_place, algorithm, size_bytes),
                    "isolated_s": _median_at(isolated, algorithm, size_bytes)})
    calls = pd.DataFrame(rows)
    return calls.assign(in_place_error=calls["predicted_master_s"] / calls["in_place_s"] - 1,
                        isolated_error=calls["predicted_s"] / calls["isolated_s"] - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/allreduce-calls"))
    parser.add_argument("--also", nargs=2, action="append", type=Path, default=[], metavar=("MATRIX", "REPORT"),
                        help="a further validation report (its matrix file and output directory)")
    args = parser.parse_args()
    started = time.perf_counter()
    calls = call_errors(shipped_clusters((*SHIPPED, *(tuple(pair) for pair in args.also))))
    args.out.mkdir(parents=True, exist_ok=True)
    calls.to_csv(args.out / "calls.csv", index=False)
    table = calls.groupby(["pairs", "algorithm", "size_bytes"])[["in_place_error", "isolated_error"]].median()
    print(table.unstack("pairs").to_string(float_format=lambda v: f"{v:+.1%}"))
    print(f"{time.perf_counter() - started:.0f} s; wrote {args.out / 'calls.csv'}")


if __name__ == "__main__":
    main()
