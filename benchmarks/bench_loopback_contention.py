"""Whether a machine's core contention shows on loopback: a tensor-parallel group of the calibrated
rank count in one loopback gloo process group, computing between 3 KiB calls as a decode step does
(reduce_ln_bcast's reduce then broadcast, then allreduce_ln's allreduce), against the same calls
timed in place on the emulated clusters without delay (issue 18).

Why: a calibration whose links all have a delay cannot show the cost of a message between ranks
that outnumber their cores (:func:`sim.calibrated.contention_floor`: the delay, slept through,
hides it), so its profile takes gloo/tcp's default, fitted on another machine; where this loopback
group reproduces the in-place calls of the clusters without delay, every calibration can measure
its own machine's floor this way, as it measures the memory bandwidth.

``--ranks`` processes (forked by :func:`runtime.launch.launch`, one gloo group over loopback), 1 intra-op thread each, each round: a
busy loop of ``--compute-ms`` of small matmuls, a 3 KiB ``reduce`` to rank 0 and a ``broadcast``
from it, the busy loop again, a 3 KiB ``all_reduce``; ``--rounds`` rounds. Prints rank 0's median and
mean per call (ms) per rank count and compute time.

Measured 2026-11-30 04:06 UTC on the project's 2-vCPU VM (AMD EPYC), nothing else running, 300 rounds:
4 ranks, 0.5 ms of compute: reduce median 3.19 ms (mean 3.82), broadcast 0.51 (0.80), allreduce 6.31
(6.57); 2 ms of compute: 3.76, 0.32, 7.51; 3 ranks: reduce 1.25-2.63, broadcast 0.22-0.24, allreduce
2.89-4.91; 2 ranks: reduce 0.29-0.76, broadcast 0.07-0.10, allreduce 0.36-0.89. In place, in session
29's fresh runs on the same machine, the 4-rank decode calls of 3 KiB: reduce 3.2 ms
(v2x2_bandwidth) and 2.7 ms (v4x1_bandwidth), broadcast 0.37 and 0.29 ms
(``validation/transfer-report/fresh-s29``, ``validation/layouts-report/fresh-s29`` profiles). Run
again at 04:30 UTC, 100 rounds: 4 ranks, reduce 3.29 ms, broadcast 0.17 ms, allreduce 6.05 ms.

Run: ``PYTHONPATH=. python benchmarks/bench_loopback_contention.py [--ranks 4 3 2] [--compute-ms 0.5 2] [--rounds 300]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime.launch import launch

SIZE_FLOATS = 768  # 3 KiB of fp32: GPT-2's hidden state of one token, a decode step's payload


def _busy(seconds: float, x: torch.Tensor, w: torch.Tensor) -> None:
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        x @ w


def _rank(rank: int, world: int, compute_s: float, rounds: int) -> dict[str, tuple[float, float]] | None:
    """One rank's rounds in the launched gloo group; rank 0 returns (median, mean) s per call."""
    torch.set_num_threads(1)
    x, w = torch.randn(1, SIZE_FLOATS), torch.randn(SIZE_FLOATS, SIZE_FLOATS // world)
    payload = torch.zeros(1, SIZE_FLOATS)
    calls: dict[OpKind, list[float]] = {OpKind.REDUCE: [], OpKind.BROADCAST: [], OpKind.ALLREDUCE: []}
    dist.barrier()
    for _ in range(rounds):
        _busy(compute_s, x, w)
        for kind, call in ((OpKind.REDUCE, lambda: dist.reduce(payload, dst=0)),
                           (OpKind.BROADCAST, lambda: dist.broadcast(payload, src=0))):
            began = time.perf_counter()
            call()
            calls[kind].append(time.perf_counter() - began)
        _busy(compute_s, x, w)
        began = time.perf_counter()
        dist.all_reduce(payload)
        calls[OpKind.ALLREDUCE].append(time.perf_counter() - began)
    dist.barrier()
    return {str(kind): (statistics.median(v), statistics.mean(v)) for kind, v in calls.items()} if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs")
    for world in args.ranks:
        for compute_ms in args.compute_ms:
            calls = launch(lambda rank, heartbeat: _rank(rank, world, compute_ms / 1e3, args.rounds), world)[0]
            cells = "; ".join(f"{name} median {m * 1e3:.3f} ms (mean {a * 1e3:.3f})" for name, (m, a) in calls.items())
            print(f"{world} ranks, {compute_ms} ms of compute between calls: {cells}")


if __name__ == "__main__":
    main()
