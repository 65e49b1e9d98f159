"""Benchmark: grid sweep throughput (scenario-variants per minute) and the Dask speed-up.

Two measurements, each the median over repeats, with the machine, its load and its CPU steal
(from /proc/stat over the measurement: time the hypervisor gave another guest) printed beside:

1. **Throughput** of :func:`validation.sweep_runner.run_grid` on the local process pool (every
   core): a grid of 24 points over ``scenarios/two_hosts_rtx3060_llama2_13b.yaml`` (6 variants,
   8 ranks: 144 scenario-variants), from the parsed scenario to every point committed in a fresh
   SQLite store (point validation, keys, simulation, commits; not the imports). Target: >= 1000
   scenario-variants per minute on the 2-core development machine. Also printed: the rate per
   CPU minute of the sweeping process and its workers, which other sessions on a shared machine
   do not change (2 cores give at most twice it).
2. **Dask speed-up**: points of >= 1 s each (Llama-2-7B on 8 devices with weights streamed
   through a sliding window), simulated in-process one after another, then on a
   ``dask.distributed.LocalCluster`` of N single-threaded worker processes; speed-up = serial
   time / Dask time (cluster start-up and the workers' imports excluded). Target: >= 0.8 N for
   tasks of >= 1 s. The task size is checked, not assumed: before measuring, the points get
   more of the scenario's variants until the shortest takes :data:`CALIBRATED_TASK_S` on this
   machine as it is now, and every task of the measurement (serial and on the workers) must take
   at least :data:`MIN_TASK_S`, else the benchmark says so and exits with status 1 (its speed-up
   does not answer the target).
   Beside it, the machine's own speed-up on N processes (pure-Python loops), measured before and
   after: on a machine shared with other sessions N processes get far less than N cores, and
   Dask's share of what the machine gives is what the scheduler costs.

Measured on the project's 2-core machine shared with six other sessions, 5 repeats each, two
runs: at load average 10 to 13 (CPU steal 0.1 to 0.3%), 430 scenario-variants/min by the wall
clock, 1441 per CPU minute; Dask on 2 workers, tasks of 5.7 s, speed-up 1.28 (0.64 N) where
the machine itself gave 2 processes 1.10x one. At load average 6 to 8 (steal 0.1%): 729/min,
1835 per CPU minute (about 3,600/min on two uncontended cores); Dask, tasks of 2.7 s, speed-up
1.00 where the machine gave 0.88x. Neither target can be met nor refuted on a machine this busy
(N processes get no more than one); rerun it on an idle one.

On the idle machine (2026-11-23 16:39 UTC, nothing else running; load average 1.9, CPU steal
1.8-2.5%), 3 repeats: 2815 scenario-variants/min (min 2801, max 2923), 1541 per CPU minute; Dask
on 2 workers, tasks of 1.08 s, serial 4.32 s against 2.50 s: speed-up 1.74 (0.87 N; min 1.73,
max 1.77), where the machine gave 2 processes 1.78x one. Both targets are met.

Run: ``.venv/bin/python benchmarks/bench_sweep.py [--repeats 5] [--workers N] [--skip-dask]``
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

from models.input_files import load_yaml
from sim.grid import GridConfig, evaluate_point, grid_points
from sim.sweep_store import STORE_NAME, SweepStore
from validation.sweep_runner import default_workers, run_grid

ROOT = Path(__file__).resolve().parent.parent
THROUGHPUT_SCENARIO = ROOT / "scenarios" / "two_hosts_rtx3060_llama2_13b.yaml"
THROUGHPUT_GRID = GridConfig(axes={"workload.batch_size": [1, 2, 4, 8, 16, 32],
                                   "cluster.hosts[0].nic.bandwidth": ["1Gbit/s", "10Gbit/s", "25Gbit/s", "100Gbit/s"]})
SLOW_SCENARIO = ROOT / "scenarios" / "low_resource_llama2_7b.yaml"
MIN_TASK_S = 1.0
"""The issue's task size for the Dask speed-up: ">= 0.8 N speed-up on N local Dask workers for tasks of >= 1 s"."""
CALIBRATED_TASK_S = 1.3
"""What the shortest task is sized to take before the measurement: a margin over :data:`MIN_TASK_S`
for the machine's speed changing between calibration and measurement."""


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far (/proc/stat, man 5 proc)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[7], sum(fields[:8])


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    return 100 * (after[0] - before[0]) / max(after[1] - before[1], 1)


def cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the pool's workers) so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def throughput(repeats: int, workers: int) -> tuple[list[float], list[float]]:
    """Scenario-variants per minute of each repeat, by the wall clock and per CPU minute spent
    (the sweeping process and its workers together: what one uncontended core would do)."""
    base = load_yaml(THROUGHPUT_SCENARIO, "scenario")
    rates, per_cpu = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp, SweepStore(Path(tmp) / STORE_NAME) as store:
            start, cpu_start = time.perf_counter(), cpu_s()
            points = grid_points(base, THROUGHPUT_GRID, base_dir=THROUGHPUT_SCENARIO.parent)
            run_grid(points, store, workers=workers)
            elapsed, cpu = time.perf_counter() - start, cpu_s() - cpu_start
        variants = sum(len(p.scenario.config.variants) for p in points)
        rates.append(variants / elapsed * 60)
        per_cpu.append(variants / cpu * 60)
    return rates, per_cpu


def slow_points(count: int, variants: int):
    """``count`` points: the default scenario's first ``variants`` variants (a task's time grows
    with them; not with the output length, whose decode steps the simulator samples), weights streamed."""
    base = load_yaml(SLOW_SCENARIO, "scenario")
    base["variants"] = base["variants"][:variants]
    base["memory"] = {"policy": "sliding_window", "window": 2}
    grid = GridConfig(axes={"workload.prompt_tokens": [256 + 32 * i for i in range(count)]})
    return [p.scenario for p in grid_points(base, grid, base_dir=SLOW_SCENARIO.parent)]


def sized_points(count: int):
    """``count`` points whose shortest takes at least :data:`CALIBRATED_TASK_S` here and now
    (variants added from two until it does), and that time (s).

    Raises:
        SystemExit: even every variant of the scenario gives shorter tasks.
    """
    available = len(load_yaml(SLOW_SCENARIO, "scenario")["variants"])
    for variants in range(2, available + 1):
        scenarios = slow_points(count, variants)
        shortest = min(evaluate_point(s).seconds for s in scenarios)
        if shortest >= CALIBRATED_TASK_S:
            return scenarios, shortest
    raise SystemExit(f"no task of {available} variants takes {CALIBRATED_TASK_S} s here (shortest {shortest:.2f} s)")


def dask_speedup(repeats: int, workers: int) -> tuple[list[float], list[float], list[float], float]:
    """(serial s, Dask s, median seconds per task) of each repeat, and the shortest task of all (s),
    serial or on a worker."""
    from dask.distributed import Client, LocalCluster

    scenarios, _ = sized_points(2 * workers)
    serial, parallel, per_task, shortest = [], [], [], math.inf
    with LocalCluster(n_workers=workers, processes=True, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.run(lambda: __import__("sim.grid"))  # the workers' imports, once, as a long sweep pays them
        for _ in range(repeats):
            start = time.perf_counter()
            outcomes = [evaluate_point(s) for s in scenarios]
            serial.append(time.perf_counter() - start)
            per_task.append(statistics.median(o.seconds for o in outcomes))
            start = time.perf_counter()
            outcomes += client.gather(client.map(evaluate_point, scenarios, pure=False))
            parallel.append(time.perf_counter() - start)
            shortest = min(shortest, *(o.seconds for o in outcomes))
    return serial, parallel, per_task, shortest


def _burn(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def machine_speedup(workers: int, iterations: int = 4_000_000) -> float:
    """What N processes gain over one on this machine right now: 2N pure-Python loops serially,
    then on a pool of N (on a machine shared with other sessions this falls well short of N)."""
    start = time.perf_counter()
    for _ in range(2 * workers):
        _burn(iterations)
    serial = time.perf_counter() - start
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_burn, [iterations] * (2 * workers))
    return serial / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--skip-dask", action="store_true")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
          f"({default_workers()} usable), Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    before = cpu_times()
    rates, per_cpu = throughput(args.repeats, args.workers)
    print(f"throughput, {args.workers} local workers, {args.repeats} repeats of 144 scenario-variants: median "
          f"{statistics.median(rates):.0f} scenario-variants/min (min {min(rates):.0f}, max {max(rates):.0f}); "
          f"{statistics.median(per_cpu):.0f} per CPU minute; CPU steal {steal_pct(before, cpu_times()):.2f}%, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.skip_dask:
        return
    before = cpu_times()
    control = machine_speedup(args.workers)
    serial, parallel, per_task, shortest = dask_speedup(args.repeats, args.workers)
    control = statistics.median([control, machine_speedup(args.workers)])
    ratios = [s / p for s, p in zip(serial, parallel)]
    print(f"Dask, {args.workers} workers, {2 * args.workers} tasks of median {statistics.median(per_task):.2f} s "
          f"(shortest {shortest:.2f} s), "
          f"{args.repeats} repeats: serial median {statistics.median(serial):.2f} s, Dask median "
          f"{statistics.median(parallel):.2f} s, speed-up median {statistics.median(ratios):.2f} "
          f"({statistics.median(ratios) / args.workers:.2f} N; min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"CPU steal {steal_pct(before, cpu_times()):.2f}%, load average {os.getloadavg()[0]:.1f}")
    print(f"the machine's own speed-up on {args.workers} processes (pure-Python loops, before and after): "
          f"{control:.2f}; Dask's share of it {statistics.median(ratios) / control:.2f}")
    if shortest < MIN_TASK_S:
        raise SystemExit(f"a task took {shortest:.2f} s < {MIN_TASK_S:g} s: this speed-up does not answer the "
                         f"target's tasks of >= {MIN_TASK_S:g} s; rerun it")


if __name__ == "__main__":
    main()
