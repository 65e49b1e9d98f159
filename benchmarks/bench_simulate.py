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
loaded machine. On 2026-11-29 (06481db: 0.45 s quietly) the trace's DataFrames were built once
per table with their strings from codes and a tensor-parallel group's ranks shared one memory
ledger (see ``bench_pipeline.py``): interleaved against 06481db, 4 rounds of 5 repeats (load
average 4.0-5.4, steal 0.6%), CPU median of rounds 0.453 -> 0.360 s (wall 0.52 -> 0.45 s). What
is left: the flow model's pricing of the 16 MiB double binary tree and the auto candidates
(about a third of the time), the trace's op rows and sort, plan lowering and the memory ledger.

A training scenario (issue 19 item 7) times ``sim.training.simulate.simulate_training``
instead (lowering, pricing, engine, metrics; not the trace, which is built when written):
``benchmarks/training_llama2_7b_64.yaml`` is one training step of Llama-2-7B on 8 hosts x 8 H100
(NVLink inside, one 400 Gbit/s NIC per GPU), TP 8 inside each host and DP 8 across them, goal
<= 0.5 s. Measured on the project's 2-core machine shared by seven sessions (7 repeats each):
CPU time median 0.135 to 0.25 s; wall time median 0.43 s (min 0.35 s) at a load average of
about 6, 1.03 s (min 0.69 s) at a load average of 12 (the wall time then mostly waits for a core). What makes it fast, exactly: the eight replicas run
identically (same devices per position, every collective across replicas releasing its ranks
together, no two groups' calls carrying bytes on a common channel at once:
:mod:`sim.training.symmetry`), so replica 0 alone is
simulated; the forward pass is one decoder layer repeated 32 times; a segment whose ops wait on
other streams runs without simpy (``Engine._run_dag``, the same bits). Before those, 28 s. With
one NIC per host the DP groups share it and every replica runs on the shared fabric (seconds).
Where two TP groups share a host and the DP rings cross their NVLink ports but reduce after the
backward (Megatron-LM's GPT 7.5B, ``validation/published/megatron_a100_gpt_7_5b.yaml``, TP 4 x
DP 32 on 16 x 8 A100, overlap off), the rings never carry bytes while a TP allreduce does, so
the collectives keep their priced timings and replica 0 stands for all: CPU time median of 3,
11.75 s -> 0.53 s (2026-11-29, against 80715ce; the 1.7B case, TP 1, 0.43 -> 0.40 s; this
scenario 0.27 -> 0.22 s).

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
from sim.training.simulate import simulate_training

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
        scenario = load()  # fresh caches each repeat: nothing carried over
        run = simulate_training if scenario.config.is_training else simulate
        start, cpu_start = time.perf_counter(), time.process_time()
        result = run(scenario)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    config = scenario.config
    layout = "" if config.parallel.pipeline == 1 else (
        f"pipeline {config.parallel.pipeline} x tensor {config.parallel.tensor}, batch {config.workload.batch_size}, ")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    if config.is_training:
        mirrored = bool(result.variants[0].steps[0].mirrors)
        print(f"scenario: {config.name}: {scenario.model.name}, TP {result.plan.tensor} x DP {result.plan.data} = "
              f"{len(result.ranks)} devices, {len(result.variants)} variant(s), one training step; replicas "
              f"simulated: {'1 (the others identical)' if mirrored else result.plan.data}")
    else:
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
