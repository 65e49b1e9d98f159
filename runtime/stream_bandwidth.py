"""A machine's memory bandwidth as its ranks share it: k one-thread processes timing ops at once.

For k processes at once (forked after ``import torch``, 1 intra-op thread each, as
``runtime/launch.py`` runs a rank), each builds its own tensors, says it is ready, and on the
parent's start byte times ``ops`` back-to-back ops of one :class:`Kind`:

* ``stream``: a matvec ``W @ x`` over ``stream_bytes`` of fp32 weights (default 256 MiB, far
  beyond a server's L3), memory-bound: a decode step's linear layers;
* ``decode``: GPT-2 small's decode weights, one matvec per linear layer and the LM head (498 MB
  of fp32 in matrices of 2.4-154 MB): one token's pass over the weights as a one-rank decode step
  makes it, without the attention and norms;
* ``compute``: 64 square fp32 matmuls of ``compute_n`` (default 192: three matrices of 144 KiB,
  cache-resident in a 1 MiB L2), compute-bound.

Per op a process records its wall time and its CPU time (``time.thread_time``): a process that
waits for a core loses wall time but not CPU time; one whose loads wait for memory loses both (a
stalled load counts as CPU time). :func:`stream_bandwidth` is what a calibration records
(:class:`sim.context.ContextTerm` ``memory``): the aggregate bytes/s of ``stream`` at k = 1 .. n
processes, ``k x stream_bytes`` over the processes' median wall time per op, the memory
bandwidth :class:`sim.cores.CorePool` shares among the ranks computing at once. (STREAM's
definition of sustained bandwidth, bytes moved over wall time, McCalpin, IEEE TCCA newsletter,
1995; here one read stream per process, as a decode's matvec reads its weights.)
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from enum import StrEnum

import torch

from runtime import interrupt
from runtime.cpu_steal import cpu_sample


class Kind(StrEnum):
    """What each process times (see the module docstring)."""

    STREAM = "stream"
    DECODE = "decode"
    COMPUTE = "compute"


STREAM_BYTES = 256 * 2**20  # far beyond the testbed's 32 MiB L3: every op streams from memory
COMPUTE_N = 192
# GPT-2 small's decode weights (fp32, 498 MB): per layer QKV, attention out, MLP up, MLP down
# (out x in features), then the LM head (Radford et al. 2019; huggingface transformers' GPT2 config).
_GPT2_HIDDEN, _GPT2_VOCAB, _GPT2_LAYERS = 768, 50257, 12
_GPT2_LAYER_SHAPES = ((3 * _GPT2_HIDDEN, _GPT2_HIDDEN), (_GPT2_HIDDEN, _GPT2_HIDDEN),
                      (4 * _GPT2_HIDDEN, _GPT2_HIDDEN), (_GPT2_HIDDEN, 4 * _GPT2_HIDDEN))
_FLOAT_BYTES = 4
GPT2_BYTES = _FLOAT_BYTES * (_GPT2_LAYERS * sum(r * c for r, c in _GPT2_LAYER_SHAPES) + _GPT2_VOCAB * _GPT2_HIDDEN)
_COMPUTE_REPEATS = 64  # matmuls per compute op: an op of ~10 ms, many scheduler slices
_STREAM_COLUMNS = 4096
_WARMUP_OPS = 3


@dataclass(frozen=True)
class Round:
    """One round of k processes at once: the processes' median wall and CPU time per op (s),
    and the CPU time other processes took and the hypervisor stole meanwhile (cores)."""

    wall_s: float
    cpu_s: float
    other_cores: float
    steal_cores: float


def gpt2_decode_weights() -> list[torch.Tensor]:
    """GPT-2 small's decode weights, random: per layer (out x in features) QKV, attention out,
    MLP up and down, then the LM head (498 MB of fp32)."""
    layers = [torch.randn(rows, cols) for _ in range(_GPT2_LAYERS) for rows, cols in _GPT2_LAYER_SHAPES]
    return [*layers, torch.randn(_GPT2_VOCAB, _GPT2_HIDDEN)]


def _op(kind: Kind, stream_bytes: int, compute_n: int):
    """The op a process times, its tensors built."""
    if kind is Kind.STREAM:
        a, b = torch.randn(stream_bytes // (_FLOAT_BYTES * _STREAM_COLUMNS), _STREAM_COLUMNS), torch.randn(_STREAM_COLUMNS)
        return lambda: torch.mv(a, b)
    if kind is Kind.DECODE:
        layers = gpt2_decode_weights()
        x = {cols: torch.randn(cols) for _, cols in _GPT2_LAYER_SHAPES}

        def decode():
            for w in layers:
                torch.mv(w, x[w.shape[1]])
        return decode
    a, b = torch.randn(compute_n, compute_n), torch.randn(compute_n, compute_n)

    def compute():
        for _ in range(_COMPUTE_REPEATS):
            torch.mm(a, b)
    return compute


def _child(kind: Kind, ops: int, stream_bytes: int, compute_n: int, ready_fd: int, start_fd: int, out_fd: int) -> None:
    """One process: build its tensors, say so on ``ready_fd``, wait for the start byte, time the
    ops, write ``wall_s cpu_s`` medians per op to ``out_fd``."""
    torch.set_num_threads(1)
    op = _op(kind, stream_bytes, compute_n)
    for _ in range(_WARMUP_OPS):
        op()
    os.write(ready_fd, b"r")
    os.read(start_fd, 1)
    walls, cpus = [], []
    for _ in range(ops):
        wall, cpu = time.perf_counter(), time.thread_time()
        op()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    os.write(out_fd, f"{statistics.median(walls)!r} {statistics.median(cpus)!r}\n".encode())


def time_round(kind: Kind, processes: int, ops: int = 20, stream_bytes: int = STREAM_BYTES,
               compute_n: int = COMPUTE_N) -> Round:
    """``processes`` processes timing ``ops`` ops of ``kind`` at once, all started together once
    every one has built its tensors (see the module docstring)."""
    ready_r, ready_w = os.pipe()
    start_r, start_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for _ in range(processes):
        pid = interrupt.fork_worker()
        if pid == 0:
            for fd in (ready_r, start_w, out_r):
                os.close(fd)
            try:
                _child(kind, ops, stream_bytes, compute_n, ready_w, start_r, out_w)
            finally:
                os._exit(0)
        pids.append(pid)
    for fd in (ready_w, start_r, out_w):
        os.close(fd)
    ready = 0
    while ready < processes:
        got = os.read(ready_r, processes - ready)
        if not got:
            break  # a child died before it was ready: its line is missing below
        ready += len(got)
    before = cpu_sample(pids)
    os.write(start_w, b"x" * processes)
    with os.fdopen(out_r) as out:
        lines = [out.readline() for _ in range(processes)]
    span = cpu_sample(pids) - before
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(start_w)
    os.close(ready_r)
    if not all(lines):
        raise RuntimeError(f"a {kind} process of {processes} died before reporting its times")
    cores = os.cpu_count() or 1
    return Round(statistics.median(float(line.split()[0]) for line in lines),
                 statistics.median(float(line.split()[1]) for line in lines),
                 span.other_load * cores, span.steal_fraction * cores)


def stream_bandwidth(max_processes: int, rounds: int = 3, ops: int = 20,
                     stream_bytes: int = STREAM_BYTES) -> tuple[tuple[int, float], ...]:
    """The machine's aggregate streamed bandwidth with k = 1 .. ``max_processes`` one-thread
    processes streaming at once, as (k, bytes/s) pairs: ``k x stream_bytes`` over the median,
    over ``rounds`` rounds (counts interleaved), of the processes' median wall time per op.

    Raises:
        ValueError: ``max_processes`` or ``rounds`` below 1.
        RuntimeError: a process died.
    """
    if max_processes < 1 or rounds < 1:
        raise ValueError(f"stream_bandwidth needs max_processes >= 1 and rounds >= 1 (got {max_processes}, {rounds})")
    walls: dict[int, list[float]] = {k: [] for k in range(1, max_processes + 1)}
    for _ in range(rounds):
        for k in walls:
            walls[k].append(time_round(Kind.STREAM, k, ops, stream_bytes).wall_s)
    return tuple((k, k * stream_bytes / statistics.median(w)) for k, w in walls.items())
