"""Benchmark: wall and CPU time of ``hetsim plan``: a batch plan over more than 10,000 candidate
configurations, and the shipped serving plan; and the accuracy the serving plan's fast rate search
costs.

The issue's target: a plan over >= 10,000 candidates in <= 2 minutes. The ``batch`` case is the
shipped example (``scenarios/plan_llama31_8b.yaml``: the default catalog, every device type, mixed
pairs, 1-8 devices per host, networks, six variants, two memory policies, the layouts of
:mod:`sim.planning.layouts`, at most $40/h and 32 devices) asked for two models (Llama-3.1-8B and Qwen2.5-7B) over 1 to 16 hosts. The ``serving``
case is ``scenarios/plan_serving_llama31_8b.yaml`` as shipped (target: under a minute). Reports
the medians over repeats of :func:`sim.planning.outcome.plan` (search, simulation of the
survivors, frontiers, the top 10's bottlenecks; not file writing), in wall time and in the
process's CPU time (on a shared machine the wall time also counts waiting for a core), and how many
candidates each stage settled.

``--accuracy`` re-searches the serving plan's top configurations with a reference search (no
tolerance: 14 bisections; requests arriving over ``--reference-horizon`` seconds, default 200) and
prints the plan's maximum rate against the reference's.

Measured on the project's 2-core machine. Batch, searching tensor parallelism over every device
only (before the layouts; load average 1.3-4.7): 10,344 candidates (6,060 layout, 360 limits, 12
memory, 2,124 bound, 1,326 dominated, 462 simulated); median over 2 repeats 62.0 s wall (49.9 and
74.1), 24.0 s CPU. With the layouts (TP, uneven TP on mixed clusters, TP x PP, PP, replicas; load
average 1.1-2.2): 38,040 candidates (17,154 layout, 3,546 limits, 348 memory, 7,544 bound, 8,624
dominated, 824 simulated); median over 2 repeats 109.0 s wall (106.7 and 111.2), 86.9 s CPU
(82.8 min). The target (<= 2 minutes) holds in wall time, narrowly; the CPU time is the figure
that does not depend on the others' load. After the speed-ups of session 14 (the search loop on
plain records instead of a pandas row per candidate; lowered phases, :func:`sim.plan._lowered`,
and collective schedules, :func:`sim.collectives.registry._built`, shared across simulations; run
metrics, peak memory and the trace's sorts in numpy), with ``plan.csv`` byte-identical: the
batch case interleaved with the code before them (commit 2569f3b), load average 1.9-3.7 from other
sessions' work, 3 repeats each: before, median 87.8 s wall (80.6, 87.8, 101.6) and 84.2 s CPU
(78.2, 84.2, 86.3); after, median 49.1 s wall (45.3, 49.1, 63.9) and 46.4 s CPU (44.6, 46.4,
46.9): 1.8x. Re-measured with nothing else on the machine (load average 0.7, main after the
session's merges): median 44.2 s wall (44.9, 44.2, 36.3), 43.3 s CPU. Serving (same machine, load average 0.1-1.9):
24 candidates (22 simulated, 1 limits, 1 memory); median over 3 repeats 26.4 s wall (26.8, 26.4,
24.4), 25.7 s CPU; with ``--accuracy --accuracy-top 5`` the plan's maximum rates were -1.2% to
+10.8% off the reference's (4.51 to 11.6 requests/s). With pipelines served (an iteration in flight
per stage, session 15), the serving plan simulates its 26 pipeline candidates too: 58 simulated
of 64 (was 32 simulated, 28 refused as layouts), CPU 84.5 s before and 194.5 s after, one repeat
each, interleaved, load average 5.8-6.2 from other sessions' work (wall 327.8 and 340.5 s); the
batch case does not serve and stays as it was (CPU 53.0 and 60.6 s before, 53.6 and 52.2 s after,
same load, 38,040 candidates, the same pick). With replicas of a pipeline among the layouts
(``TP=G x PP=P x R replicas``, issue 21), one repeat each, main then this change, load average
2.1-2.3: before, 38,040 candidates (808 simulated), 32.9 s wall, 28.4 s CPU; after, 51,288
candidates (24,642 layout, 5,958 limits, 348 memory, 12,162 bound, 7,310 dominated, 868
simulated), 39.5 s wall, 39.2 s CPU, the same pick; the target holds. The shipped
``plan_llama31_8b.yaml`` alone, interleaved, 2 rounds: 15,036 candidates (624 simulated) in 36.7
and 26.4 s wall before, 17,796 (716 simulated) in 45.6 and 45.8 s after, the same pick and top 10.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_plan.py [--case serving] [--repeats 3] [--accuracy]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from models.input_files import load_yaml
from sim.planning.outcome import plan
from sim.planning.plan_config import load_plan, plan_from_dict
from sim.planning.search import Planner
from sim.scenario import scenario_from_dict
from sim.serving.simulate import RateSearchSettings, simulate_serving
from sim.vocabulary import Metric

ROOT = Path(__file__).resolve().parent.parent
SERVING_PLAN = ROOT / "scenarios" / "plan_serving_llama31_8b.yaml"


def batch_request():
    data = load_yaml(ROOT / "scenarios" / "plan_llama31_8b.yaml", "plan")
    data["models"] = ["llama-3.1-8b", "qwen2.5-7b"]
    data["search"]["hosts"] = [1, 2, 3, 4, 6, 8, 12, 16]
    return plan_from_dict(data, base_dir=ROOT / "scenarios")


CASES = {"batch": batch_request, "serving": lambda: load_plan(SERVING_PLAN)}


def time_case(name: str, repeats: int):
    """Plan case ``name`` ``repeats`` times (fresh caches each); print the medians; the last result."""
    times, cpu_times = [], []
    for _ in range(repeats):
        request = CASES[name]()
        start, cpu_start = time.perf_counter(), time.process_time()
        result = plan(request)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    stages = result.table["stage"].value_counts()
    print(f"[{name}] candidates: {len(result.table)} ({', '.join(f'{n} {s}' for s, n in stages.items())})")
    print(f"[{name}] plan wall time over {repeats} repeats: median {statistics.median(times):.1f} s, "
          f"min {min(times):.1f} s, max {max(times):.1f} s ({', '.join(f'{t:.1f}' for t in times)})")
    print(f"[{name}] plan CPU time over {repeats} repeats: median {statistics.median(cpu_times):.1f} s, "
          f"min {min(cpu_times):.1f} s")
    print(f"[{name}] {result.recommendation}")
    return result


def serving_accuracy(result, top: int, horizon_s: float) -> None:
    """The plan's maximum rate of its ``top`` configurations against a reference search's."""
    planner = Planner(result.request)
    rows = planner.candidates()
    for _, row in result.top.head(top).iterrows():
        scenario = scenario_from_dict(planner.scenario_dict(rows.loc[int(row["candidate"])]))
        reference = simulate_serving(scenario, rate_search=RateSearchSettings(from_workload_rate=True,
                                                                              horizon_s=horizon_s))
        exact = reference.variants[0].search
        print(f"[serving accuracy] {row['cluster']}, {row['variant']}: plan {row[Metric.MAX_REQUEST_RATE]:.3f}/s "
              f"({int(row['rate_search_runs'])} runs) vs reference {exact.rate_per_s:.3f}/s ({exact.runs} runs, "
              f"{horizon_s:g} s horizon): {100 * (row[Metric.MAX_REQUEST_RATE] / exact.rate_per_s - 1):+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy", action="store_true", help="compare the serving plan's top rates with a "
                                                                "reference search")
    parser.add_argument("--accuracy-top", type=int, default=3)
    parser.add_argument("--reference-horizon", type=float, default=200.0, help="seconds")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    for name in CASES if args.case == "all" else [args.case]:
        result = time_case(name, args.repeats)
        if name == "serving" and args.accuracy:
            serving_accuracy(result, args.accuracy_top, args.reference_horizon)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
