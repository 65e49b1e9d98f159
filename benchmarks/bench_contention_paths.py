"""The core contention of a message by the path it takes: the calibration's loopback group
(:mod:`runtime.loopback_contention`) run once over the loopback interface and once inside an
emulated cluster's host namespaces (veth pairs and a bridge between hosts, the links' shaping
irrelevant at 3 KiB), the same calls, ranks and compute (issue 18).

Why: with 4 ranks on 2 cores, calls timed in place cost 0.28 ms a point-to-point core turn on 4
hosts of 1 rank (v4x1_bandwidth) and 0.51 on 2 hosts of 2 (v2x2_bandwidth), where the loopback
group gives 0.54-0.62 (``validation/transfer-report/progress.md``, session 30): if the path decides
it, the contention floor is a term per link class, not one per machine.

Measured 2026-11-30 06:47 UTC on the project's 2-vCPU VM (AMD EPYC), nothing else running, the
calls of the session-29 v2x2_bandwidth profile, medians in ms (allreduce gloo's / Rabenseifner /
recursive doubling / two-level tree; reduce; broadcast):

- v4x1_bandwidth's namespaces (every message over veth): 3.27 / 4.25 / 1.67 / 5.88; 1.87; 0.51
- loopback, same launch: 4.94 / 8.44 / 3.20 / 10.56; 2.83; 0.61
- v2x2_bandwidth's namespaces (half the messages inside a host): 3.59 / 5.32 / 2.32 / 2.69; 1.87; 0.38
  (its in-place decode calls: 4.57 / 5.16 / 2.09 / 2.03; 2.86; 0.39)
- loopback, same launch: 4.57 / 7.73 / 3.29 / 3.18; 3.14; 0.58

Again at 06:48: v4x1_bandwidth's namespaces 3.60 / 4.65 / 1.95 / 7.24; 1.90; 0.38, loopback 4.63 /
7.94 / 2.85 / 10.13; 2.69; 0.72; v2x2_bandwidth's 3.66 / 5.10 / 2.12 / 2.80; 1.94; 0.44, loopback
5.04 / 7.44 / 2.88 / 3.51; 3.03; 0.54.

So a message between namespaces costs about half the core time of one over loopback, and the
namespaces reproduce the in-place point-to-point calls; the path, not the machine alone, sets the
floor.

Run (root; brings each scenario's testbed up and down):
``PYTHONPATH=. python benchmarks/bench_contention_paths.py [--profile CSV] [SCENARIO ...]``
"""

from __future__ import annotations

import argparse
import os
import platform

from runtime.comm_timing import in_place_rows
from runtime.loopback_contention import loopback_calls, time_calls
from runtime.measure import launch_scenario
from runtime.testbed import Testbed, require_privileges
from sim.profile import load_profile
from sim.scenario import load_scenario
from sim.topology import build_topology
from sim.vocabulary import MeasurementKind

DEFAULT_PROFILE = "validation/transfer-report/fresh-s29/profiles/v2x2_bandwidth.csv"
DEFAULT_SCENARIOS = ["scenarios/validation/v4x1_bandwidth.yaml", "scenarios/validation/v2x2_bandwidth.yaml"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("scenarios", nargs="*", default=DEFAULT_SCENARIOS)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    profile = load_profile(args.profile)
    require_privileges()
    for path in args.scenarios:
        scenario = load_scenario(path)

        def body(topology, rank, heartbeat):
            calls = loopback_calls(profile.rows, tuple(range(topology.num_ranks)))
            return time_calls(rank, calls, topology.host_groups, topology.num_ranks)

        bed = Testbed(scenario.name, build_topology(scenario.config.cluster))
        bed.up()
        try:
            for testbed in (True, False):
                spans = launch_scenario(scenario, body, testbed=testbed, hang_timeout_s=120.0)
                ranks = len({s.rank for s in spans})
                rows = [r for r in in_place_rows(spans, ranks, ranks, master=0)
                        if r["measurement"] == MeasurementKind.COLLECTIVE_IN_PLACE]
                cells = "; ".join(f"{r['op']} {r['algorithm']} {r['median'] * 1e3:.2f}" for r in rows)
                print(f"{scenario.name}, {'its namespaces' if testbed else 'loopback'}: {cells}", flush=True)
        finally:
            bed.down()


if __name__ == "__main__":
    main()
