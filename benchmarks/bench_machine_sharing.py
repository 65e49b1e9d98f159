"""Ranks sharing one machine: do k one-thread torch processes slow each other by more than the
cores say (issues 20/21: 4 one-rank GPT-2 replicas on the 2-vCPU testbed decode at 81 ms per
token where one alone takes 39 ms)?

For k = 1, 2, 4 processes at once (forked after ``import torch``, 1 intra-op thread each, as
``runtime/launch.py`` runs a rank), each process times ``--ops`` back-to-back ops of one kind on
its own tensors, all starting together at a barrier:

* ``stream``: a matvec ``W @ x`` over ``--stream-bytes`` of fp32 weights (default 256 MiB, far
  beyond the 32 MiB L3), memory-bound: a decode step's linear layers;
* ``decode``: GPT-2 small's decode weights, one matvec per linear layer and the LM head (498 MB
  of fp32 in matrices of 2.4-154 MB): one token's pass over the weights as a one-rank decode step
  makes it, without the attention and norms;
* ``compute``: 64 ``--compute-n`` square fp32 matmuls (default 192: three matrices of 144 KiB,
  cache-resident in the 1 MiB L2), compute-bound.

Per op it reports the wall time and the process's CPU time (``time.thread_time``): a process
that waits for a core loses wall time but not CPU time; one whose loads wait for memory loses
both (a stalled load counts as CPU time). So CPU time per op growing with k is contention for
something beside the cores (memory bandwidth), wall over CPU growing is the cores' share. The
streamed bandwidth is ``--stream-bytes`` over the wall time per op, summed over the processes.

Prints per (kind, k) the median over ``--repeats`` rounds (interleaved) of the processes' median
wall and CPU ms per op, the machine's aggregate streamed GB/s, and the CPU time other processes
took meanwhile (``/proc/stat`` busy less ours, :mod:`runtime.cpu_steal`) and steal, in cores.
Other work on the machine slows the k = 2 case most (it takes a core the processes need): runs
under load are upper bounds of the slowdown.

Measured 2026-11-24 05:59-06:03 UTC on the project's 2-vCPU VM (AMD EPYC, 32 MiB L3), under
1.1-1.5 cores of other helpers' load, steal 0, 5 rounds: CPU ms per op for k = 1, 2, 4 ``stream``
11.1 / 12.0 / 11.6, ``decode`` 27.3 / 29.0 / 28.2, ``compute`` 10.6 / 10.5 / 10.6 (an earlier
3-round run: decode 27.1 / 28.2 / 28.7). Processes streaming at once keep their CPU time per op
within 3-7%, so they do not share a memory bandwidth that one of them saturates (a GPT-2 pass on
one core streams ~18 GB/s; its wall times there are the cores' share under that load).

Run: ``PYTHONPATH=. python benchmarks/bench_machine_sharing.py [--repeats 5] [--ops 20]``
(under ``flock /work/testbed.lock`` so no testbed measurement runs meanwhile).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from runtime.cpu_steal import cpu_sample

KINDS = ("stream", "decode", "compute")
# GPT-2 small's decode weights (fp32, 498 MB): per layer QKV, attention out, MLP up, MLP down
# (out x in features), then the LM head (Radford et al. 2019; huggingface transformers' GPT2 config).
_GPT2_HIDDEN, _GPT2_VOCAB, _GPT2_LAYERS = 768, 50257, 12
_GPT2_LAYER_SHAPES = ((3 * _GPT2_HIDDEN, _GPT2_HIDDEN), (_GPT2_HIDDEN, _GPT2_HIDDEN),
                      (4 * _GPT2_HIDDEN, _GPT2_HIDDEN), (_GPT2_HIDDEN, 4 * _GPT2_HIDDEN))
_GPT2_BYTES = 4 * (_GPT2_LAYERS * sum(r * c for r, c in _GPT2_LAYER_SHAPES) + _GPT2_VOCAB * _GPT2_HIDDEN)
_COMPUTE_REPEATS = 64  # matmuls per compute op: an op of ~10 ms, many scheduler slices
PROCESSES = (1, 2, 4)
_FLOAT_BYTES = 4


def gpt2_decode_weights() -> list[torch.Tensor]:
    """GPT-2 small's decode weights, random: per layer (out x in features) QKV, attention out,
    MLP up and down, then the LM head (498 MB of fp32)."""
    layers = [torch.randn(rows, cols) for _ in range(_GPT2_LAYERS) for rows, cols in _GPT2_LAYER_SHAPES]
    return [*layers, torch.randn(_GPT2_VOCAB, _GPT2_HIDDEN)]


def _child(kind: str, args: argparse.Namespace, start_fd: int, out_fd: int) -> None:
    """One process: build its tensors, wait for the start byte, time the ops, write
    ``wall_ms cpu_ms`` medians per op to ``out_fd``."""
    torch.set_num_threads(1)
    if kind == "stream":
        cols = 4096
        rows = args.stream_bytes // (_FLOAT_BYTES * cols)
        a, b = torch.randn(rows, cols), torch.randn(cols)
        op = lambda: torch.mv(a, b)  # noqa: E731
    elif kind == "decode":
        layers = gpt2_decode_weights()
        x = {cols: torch.randn(cols) for _, cols in _GPT2_LAYER_SHAPES}

        def op():
            for w in layers:
                torch.mv(w, x[w.shape[1]])
    else:
        a, b = torch.randn(args.compute_n, args.compute_n), torch.randn(args.compute_n, args.compute_n)

        def op():
            for _ in range(_COMPUTE_REPEATS):
                torch.mm(a, b)
    for _ in range(3):
        op()
    os.read(start_fd, 1)
    walls, cpus = [], []
    for _ in range(args.ops):
        wall, cpu = time.perf_counter(), time.thread_time()
        op()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    os.write(out_fd, f"{statistics.median(walls) * 1e3} {statistics.median(cpus) * 1e3}\n".encode())


def _round(kind: str, k: int, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """k processes at once: (median wall ms, median cpu ms per op over processes, other load
    cores, steal cores)."""
    start_r, start_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for _ in range(k):
        pid = os.fork()
        if pid == 0:
            os.close(start_w)
            os.close(out_r)
            try:
                _child(kind, args, start_r, out_w)
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(start_r)
    os.close(out_w)
    time.sleep(0.3 if kind == "compute" else 2.5 * k)  # the children build their tensors
    before = cpu_sample(pids)
    os.write(start_w, b"x" * k)
    with os.fdopen(out_r) as out:
        lines = [out.readline() for _ in range(k)]
    span = cpu_sample(pids) - before
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(start_w)
    walls = [float(line.split()[0]) for line in lines]
    cpus = [float(line.split()[1]) for line in lines]
    cores = os.cpu_count() or 1
    return (statistics.median(walls), statistics.median(cpus), span.other_load * cores,
            span.steal_fraction * cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", type=int, default=20)
    parser.add_argument("--stream-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--compute-n", type=int, default=192)
    args = parser.parse_args()
    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for _ in range(args.repeats):
        for kind in KINDS:
            for k in PROCESSES:
                results.setdefault((kind, k), []).append(_round(kind, k, args))
    print("kind     k  wall ms/op  cpu ms/op  wall/cpu  slowdown  GB/s all  other load  steal (cores; medians)")
    for kind in KINDS:
        base = statistics.median(r[0] for r in results[(kind, 1)])
        for k in PROCESSES:
            rows = results[(kind, k)]
            wall, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
            streamed = {"stream": args.stream_bytes, "decode": _GPT2_BYTES}.get(kind, math.nan)
            rate = k * streamed / (wall * 1e-3) / 1e9
            print(f"{kind:8s} {k}  {wall:10.3f}  {cpu:9.3f}  {wall / cpu:8.2f}  {wall / base:8.2f}  {rate:8.2f}  "
                  f"{statistics.median(r[2] for r in rows):10.2f}  {statistics.median(r[3] for r in rows):5.2f}")


if __name__ == "__main__":
    main()
