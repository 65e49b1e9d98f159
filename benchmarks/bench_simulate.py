"""Benchmark: wall time of simulating Llama-3.1-70B / Llama-2-70B-class inference on 16 devices.

The case of the simulate issue: a 70B model tensor-parallel over 2 hosts x 8 devices (two levels:
NVLink inside, one NIC per GPU between), 1024-token prompt, 256 output tokens, every strategy of
the scenario (``scenarios/h100_2x8_llama31_70b.yaml``). Reports the median of repeats of
``sim.simulate.simulate`` (topology, plans, engine, traces, metrics; not file writing), each in a
fresh process state except imports, and the median CPU time of the process (on a shared machine
the wall time also counts waiting for a core).

Measured on the project's 2-core machine (two other sessions thinking, CPU steal 0.05%), 3
interleaved rounds of 7 repeats each against 39bae59: 39bae59 median 0.61 / 0.51 / 0.44 s, now
0.47 / 0.33 / 0.32 s (median of rounds 0.51 s against 0.33 s, 0.65x). The uncalibrated
simulator now prices collectives with per-message transport terms (:mod:`sim.transport`), which
runs a fluid model of each schedule; the network alone had brought 0.68 s to 0.41 s (0.6x) on a
loaded machine. What is left: the trace's
DataFrames, the flow model's pricing of the 16 MiB double binary tree and the auto candidates,
plan lowering and the memory ledger.

Run: ``.venv/bin/python benchmarks/bench_simulate.py [--repeats 7] [SCENARIO]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

from sim.scenario import Scenario, load_scenario
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", default=str(ROOT / "scenarios" / "h100_2x8_llama31_70b.yaml"))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    time_simulate(lambda: load_scenario(args.scenario), args.repeats)


def time_simulate(load: Callable[[], Scenario], repeats: int) -> None:
    """Print the machine, the scenario ``load()`` returns and the median wall and CPU times of
    ``repeats`` simulations, each of a freshly loaded scenario (no cache carried over)."""
    times, cpu_times = [], []
    for _ in range(repeats):
        scenario = load()
        start, cpu_start = time.perf_counter(), time.process_time()
        result = simulate(scenario)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    config = scenario.config
    layout = "" if config.parallel.pipeline == 1 else (
        f"pipeline {config.parallel.pipeline} x tensor {config.parallel.tensor}, batch {config.workload.batch_size}, ")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    print(f"scenario: {config.name}: {scenario.model.name}, {len(result.ranks)} devices, {layout}"
          f"prompt {config.workload.prompt_tokens}, output {config.workload.output_tokens}, "
          f"{len(result.variants)} variants")
    print(f"simulate wall time over {repeats} repeats: median {statistics.median(times):.3f} s, "
          f"min {min(times):.3f} s, max {max(times):.3f} s")
    # On a shared machine the wall time includes waiting for a core; the process's CPU time does not.
    print(f"simulate CPU time over {repeats} repeats: median {statistics.median(cpu_times):.3f} s, "
          f"min {min(cpu_times):.3f} s")


if __name__ == "__main__":
    main()
