"""Ranks sharing one machine: do k one-thread torch processes slow each other by more than the
cores say (issues 20/21: 4 one-rank GPT-2 replicas on the 2-vCPU testbed decode at 81 ms per
token where one alone takes 39 ms)?

For k = 1, 2, 4 processes at once, each times ``--ops`` back-to-back ops of one kind on its own
tensors, all starting together once all are ready (:mod:`runtime.stream_bandwidth`, which a
calibration calls for the machine's bandwidth at k streams: ``stream`` a 256 MiB matvec,
``decode`` GPT-2 small's decode weights, ``compute`` cache-resident matmuls).

Per (kind, k) it prints the median over ``--repeats`` rounds (interleaved) of the processes'
median wall and CPU ms per op, wall over CPU (the cores' share), the slowdown over k = 1, the
machine's aggregate streamed GB/s, and the CPU time other processes took meanwhile (``/proc/stat``
busy less ours, :mod:`runtime.cpu_steal`) and steal, in cores. Other work on the machine slows
the k = 2 case most (it takes a core the processes need): runs under load are upper bounds.

Measured quietly 2026-11-24 06:51-06:55 UTC on the project's 2-vCPU VM (AMD EPYC, 32 MiB L3),
nothing else running (other load 0.00-0.07 cores, steal 0), 5 rounds, k = 1 / 2 / 4:
``stream`` wall 11.3 / 15.9 / 26.4 ms, CPU 11.4 / 15.9 / 14.3 ms, 23.7 / 33.7 / 40.6 GB/s in
all; ``decode`` wall 26.9 / 32.1 / 58.4 ms, CPU 26.9 / 32.1 / 30.2 ms; ``compute`` wall
10.3 / 10.4 / 18.4 ms, CPU 10.3 / 10.4 / 10.3 ms. Two processes streaming on the two cores
each take 1.40 (stream) and 1.19 (decode) times as long, with CPU time growing as much: the
machine's memory bandwidth saturates (one process streams 23.7 GB/s, two 33.7); compute-bound
ops do not slow. An earlier run under 1.1-1.5 cores of other helpers' load (05:59-06:03) had
seen CPU time per op within 3-7% and concluded the opposite: the load took the cores, so the
processes seldom streamed at once.

Run: ``PYTHONPATH=. python benchmarks/bench_machine_sharing.py [--repeats 5] [--ops 20]``
(under ``flock /work/testbed.lock`` so no testbed measurement runs meanwhile).
"""

from __future__ import annotations

import argparse
import math
import statistics

from runtime.stream_bandwidth import COMPUTE_N, GPT2_BYTES, STREAM_BYTES, Kind, time_round

PROCESSES = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", type=int, default=20)
    parser.add_argument("--stream-bytes", type=int, default=STREAM_BYTES)
    parser.add_argument("--compute-n", type=int, default=COMPUTE_N)
    args = parser.parse_args()
    results: dict[tuple[Kind, int], list] = {}
    for _ in range(args.repeats):
        for kind in Kind:
            for k in PROCESSES:
                results.setdefault((kind, k), []).append(time_round(kind, k, args.ops, args.stream_bytes, args.compute_n))
    print("kind     k  wall ms/op  cpu ms/op  wall/cpu  slowdown  GB/s all  other load  steal (cores; medians)")
    for kind in Kind:
        base = statistics.median(r.wall_s for r in results[(kind, 1)])
        for k in PROCESSES:
            rows = results[(kind, k)]
            wall, cpu = statistics.median(r.wall_s for r in rows), statistics.median(r.cpu_s for r in rows)
            streamed = {Kind.STREAM: args.stream_bytes, Kind.DECODE: GPT2_BYTES}.get(kind, math.nan)
            print(f"{kind:8s} {k}  {wall * 1e3:10.3f}  {cpu * 1e3:9.3f}  {wall / cpu:8.2f}  {wall / base:8.2f}  "
                  f"{k * streamed / wall / 1e9:8.2f}  {statistics.median(r.other_cores for r in rows):10.2f}  "
                  f"{statistics.median(r.steal_cores for r in rows):5.2f}")


if __name__ == "__main__":
    main()
