"""Benchmark: simulating R alike replicas once (``sim.alike.replica_twins``) against every one.

Qwen2.5-7B (bf16) on 2 hosts x 4 RTX 4090 (PCIe inside, 10 Gbit/s between), 512-token prompts,
128 output tokens, one sequence per replica: 8 replicas of TP 1 (``--tensor 1``, the default) or
4 of TP 2. Each repeat simulates a freshly loaded scenario with the shortcut
(``sim.simulate.REUSE_ALIKE_REPLICAS``) and without it, in turn, so that a change in the machine's
load falls on both alike; reports the median wall and CPU time of ``sim.simulate.simulate``
(topology, plans, engine, traces, metrics; not file writing) of each, and checks that both give
the same result files.

Measured on the project's 2-core machine shared with other sessions (load average 2.9), 5
repeats, at 83cc90b: 8 x TP 1, every replica simulated 0.124 s wall / 0.092 s CPU, alike
replicas once 0.041 s / 0.022 s; 4 x TP 2, 0.096 s / 0.066 s against 0.035 s / 0.023 s; the
result files identical. ``hetsim plan scenarios/plan_llama31_8b.yaml``, 5 runs each interleaved
with the parent commit's (load average 4-5): median wall 48.4 -> 35.5 s, CPU 33.1 -> 28.5 s,
``plan.csv`` identical.

Run: ``.venv/bin/python benchmarks/bench_replicas.py [--repeats 5] [--tensor 1]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import sim.simulate
from sim.outputs import simulation_files
from sim.scenario import scenario_from_dict

CLUSTER = {"switches": [{"name": "lan"}],
           "hosts": [{"name": "pc{i}", "count": 2, "parent": "lan",
                      "nic": {"bandwidth": "10Gbit/s", "latency": "50us"},
                      "interconnect": {"bandwidth": "25GB/s", "latency": "5us"},
                      "devices": {"type": "rtx_4090", "count": 4}}]}


def replicas_scenario(tensor: int):
    """8 / ``tensor`` replicas of TP ``tensor`` over the 8 GPUs (see the module docstring)."""
    replicas = 8 // tensor
    return scenario_from_dict({
        "name": f"replicas_{replicas}x_tp{tensor}", "model": "qwen2.5-7b", "dtype": "bf16", "cluster": CLUSTER,
        "workload": {"batch_size": replicas, "prompt_tokens": 512, "output_tokens": 128}, "network_model": "flow",
        "parallel": {"tensor": tensor, "replicas": replicas},
        "variants": [{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensor", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    files = {}
    for _ in range(args.repeats):
        for reuse in (False, True):
            sim.simulate.REUSE_ALIKE_REPLICAS = reuse
            scenario = replicas_scenario(args.tensor)
            start, cpu = time.perf_counter(), time.process_time()
            result = sim.simulate.simulate(scenario)
            times[reuse].append((time.perf_counter() - start, time.process_time() - cpu))
            files[reuse] = simulation_files(result)
    print(f"scenario: {scenario.config.name}, {args.repeats} repeats, interleaved")
    for reuse, label in ((False, "every replica simulated"), (True, "alike replicas simulated once")):
        wall, cpu = zip(*times[reuse])
        print(f"{label}: wall median {statistics.median(wall):.3f} s, CPU median {statistics.median(cpu):.3f} s")
    print("result files identical:", files[True] == files[False])


if __name__ == "__main__":
    main()
