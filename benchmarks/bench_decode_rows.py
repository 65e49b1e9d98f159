"""What a decode step's linear layers cost per batch row on one torch CPU thread (issue 20/21: two
one-rank GPT-2 replicas of 2 sequences each decode at 78.8 ms per token where 51.2 ms is
predicted, from a profile whose decode rows are all of batch 1).

One process, 1 intra-op thread (as ``runtime/launch.py`` runs a rank): GPT-2 small's decode
linear layers (12 x QKV, attention out, MLP up and down, then the LM head; 498 MB of fp32, the
weights of :mod:`benchmarks.bench_machine_sharing`'s ``decode``) applied with
``torch.nn.functional.linear`` to ``rows`` = 1, 2, 4, 8 new tokens (a decode step of that batch).
In ``--repeats`` rounds, interleaved over the row counts, times ``--passes`` passes each; prints
per row count the median over rounds of the median ms per pass, and its ratio to one row's.

A pass of one row streams the weights once (a matrix-vector product); more rows read them once
too, so a memory-bound pass should cost about what one row's does. Where it costs more, the
kernel for more than one row (a matrix-matrix product) streams the weights more slowly than the
one-row kernel: a profile timed at batch 1 prices a larger batch's decode too low. Other
processes on the machine slow every row count alike within a round; the ratios are what to read.

Measured 2026-11-24 06:04 UTC on the project's 2-vCPU VM under other helpers' load (no idle time
during the run), 5 rounds: 1 row 63.6 ms per pass, 2 rows x1.89, 4 rows x2.44, 8 rows x2.86
(one rank's runtime decode, ``hetsim measure`` of one GPT-2 rank, batch 2 over batch 1 in three
interleaved pairs under the same load: x2.9, x2.0, x2.1).

Run: ``PYTHONPATH=. python benchmarks/bench_decode_rows.py [--repeats 5] [--passes 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_machine_sharing import gpt2_decode_weights

ROWS = (1, 2, 4, 8)


def _pass_s(weights: list[tuple[torch.Tensor, torch.Tensor]], rows: int, passes: int) -> float:
    """Median seconds of one pass of ``rows`` rows through every layer."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in weights}
    F.linear(inputs[weights[0][0].shape[1]], *weights[0])  # touch the kernel once
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for weight, bias in weights:
            F.linear(inputs[weight.shape[1]], weight, bias)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    weights = [(w, torch.randn(w.shape[0])) for w in gpt2_decode_weights()]
    results: dict[int, list[float]] = {rows: [] for rows in ROWS}
    for _ in range(args.repeats):
        for rows in ROWS:
            results[rows].append(_pass_s(weights, rows, args.passes))
    one = statistics.median(results[1])
    print("rows  ms/pass  x one row (medians over rounds)")
    for rows in ROWS:
        ms = statistics.median(results[rows])
        print(f"{rows:4d}  {ms * 1e3:7.1f}  {ms / one:6.2f}")


if __name__ == "__main__":
    main()
