"""The machine's speed now: a fixed reference op set (:class:`sim.machine_speed.ReferenceOp`) timed
on one torch thread, as a rank computes (``runtime/launch.py`` gives each one).

* ``matmul``: GPT-2 small's MLP-up linear layer over a 128-token prompt at batch 1,
  ``(128 x 768) @ (768 x 3072)`` in fp32, 0.6 GFLOP on 9 MiB of weights: a prefill's
  compute-bound op (Radford et al. 2019; huggingface transformers' GPT2 config);
* ``stream``: a matvec over 64 MiB of fp32 weights, twice the testbed's 32 MiB L3: a decode
  step's memory-bound pass over its weights.

In a forked child, each op is timed ``repeats`` times, the two in turns, after one untimed call
each; its figure is the median (a shared machine only ever adds time, and a median ignores a
stray slice). The inputs are drawn from a seeded generator, so every run computes the same
numbers. About 0.4 s for the default 15 repeats on the testbed's VM when quiet (under 2 s, the
budget of issue 18, when loaded).
:func:`timed_around` times the set before and after a launch, and pools both.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from runtime import interrupt
from sim.machine_speed import ReferenceOp

MATMUL_SHAPE = (128, 768, 3072)  # (tokens, GPT-2 small hidden, its MLP width)
STREAM_BYTES = 64 * 2**20
_STREAM_COLUMNS = 4096
_FLOAT_BYTES = 4
REPEATS = 15

T = TypeVar("T")


def _ops() -> dict[ReferenceOp, Callable[[], object]]:
    """Each reference op, its inputs built (seeded: the same numbers on every run)."""
    generator = torch.Generator().manual_seed(0)
    tokens, hidden, width = MATMUL_SHAPE
    x, w = torch.randn(tokens, hidden, generator=generator), torch.randn(hidden, width, generator=generator)
    a = torch.randn(STREAM_BYTES // (_FLOAT_BYTES * _STREAM_COLUMNS), _STREAM_COLUMNS, generator=generator)
    v = torch.randn(_STREAM_COLUMNS, generator=generator)
    return {ReferenceOp.MATMUL: lambda: torch.mm(x, w), ReferenceOp.STREAM: lambda: torch.mv(a, v)}


def _time_ops(repeats: int) -> dict[str, list[float]]:
    """The timing itself, in this process (see :func:`reference_samples`)."""
    torch.set_num_threads(1)
    ops = _ops()
    for op in ops.values():  # untimed: first-touch page faults, the kernels' dispatch caches
        op()
    samples: dict[str, list[float]] = {op.value: [] for op in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            samples[name.value].append(time.perf_counter() - start)
    return samples


def reference_samples(repeats: int = REPEATS) -> dict[str, list[float]]:
    """``repeats`` wall times (s) of each reference op, on one torch thread, in a forked child:
    this process's thread settings stay as they are, and it runs no torch op before it forks the
    ranks of a launch (an OpenMP pool is not safe to fork; ``runtime.stream_bandwidth`` times
    its rounds in children too).

    Raises:
        ValueError: ``repeats`` below 1.
        RuntimeError: the child died before reporting its times.
    """
    if repeats < 1:
        raise ValueError(f"reference timing needs repeats >= 1 (got {repeats})")
    read_fd, write_fd = os.pipe()
    pid = interrupt.fork_worker()
    if pid == 0:
        os.close(read_fd)
        try:
            os.write(write_fd, json.dumps(_time_ops(repeats)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    if not text:
        raise RuntimeError("the reference timing's process died before reporting its times")
    return json.loads(text)


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each op's median time (s) over its samples."""
    return {op: statistics.median(times) for op, times in samples.items()}


def pooled(*parts: dict[str, list[float]]) -> dict[str, list[float]]:
    """Several timings' samples, op by op, in one."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for op, times in part.items():
            out.setdefault(op, []).extend(times)
    return out


def timed_around(run: Callable[[], T], repeats: int = REPEATS) -> tuple[T, dict[str, list[float]]]:
    """``run()`` and the reference op set's samples timed just before and just after it, pooled:
    the machine's speed over a launch (a stretch lasts minutes, a launch a few)."""
    before = reference_samples(repeats)
    result = run()
    return result, pooled(before, reference_samples(repeats))
