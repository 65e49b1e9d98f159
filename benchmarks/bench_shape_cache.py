"""Why the isolated op timings call the layers in turn: one layer's decode ops called over and over
against the layers of the model called in turn (``runtime/shape_bench.py``, ``compute_isolated``
rows).

A generation reads the model layer after layer, so when a layer comes round again its weights
are gone from the last-level cache (and the ranks of a machine share that cache). A bench that
calls one layer's op over and over keeps that layer's shard in the cache once the shard fits,
and times a memory-bound decode op at the cache's bandwidth, not memory's: the pipeline and TP x
PP layouts, priced from those rows, were predicted fast (session 29's layouts run on a 32 MiB L3:
tp2_pp2's TPOT -35 to -40%).

One process, 1 intra-op thread (as ``runtime/launch.py`` runs a rank), GPT-2 small in fp32, a decode
step (1 new token over 33) at each tensor-parallel width 1, 2, 4: rank 0's shard of every op, in
``--repeats`` rounds of :func:`runtime.shape_bench.time_layer_ops` each, one layer against
:func:`runtime.shape_bench.cycled_layers` layers in turn; prints per width and op the median over
rounds of the median thread CPU time (ms), and the machine's last-level cache and CPU model.

Measured 2026-11-30 02:45 UTC on the project's 2-vCPU VM (AMD EPYC, 32 MiB L3), nothing else
running, 3 rounds: ``qkv_proj`` at width 1 0.307 ms on one layer, 0.420 on 4 in turn; width 2
0.064 / 0.222 (6 layers); width 4 0.033 / 0.119 (11 layers): on one layer, width 2 and 4 at 0.21
and 0.11 of width 1's; in turn, 0.53 and 0.28, about the shards' share of the weights.

Run: ``PYTHONPATH=. python benchmarks/bench_shape_cache.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from models.catalog import get_model
from runtime.model import RankModel
from runtime.shape_bench import cache_bytes, cycled_layers, time_layer_ops
from sim.program import Stage

WIDTHS = (1, 2, 4)
CONTEXT = 33


def _round_ms(spec, width: int, layers: int) -> dict[str, float]:
    """One round at ``width`` over ``layers`` layers in turn, timed as the calibration times them
    (:func:`runtime.shape_bench.time_layer_ops`): median ms per op kind."""
    model = RankModel(spec, width, 0, seed=0, batch_size=1, max_tokens=CONTEXT + 8, device=torch.device("cpu"),
                      dtype=torch.float32, stage=Stage(0, layers, embeds=False, heads=False))
    times, _ = time_layer_ops(model, 1, 1, CONTEXT - 1)
    return {str(kind): statistics.median(values) * 1e3 for kind, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = get_model("gpt2")
    cache = cache_bytes(torch.device("cpu"))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, "
          f"last-level cache {cache / 2**20:.0f} MiB")
    for width in WIDTHS:
        cycled = cycled_layers(spec, width, cache)
        rounds = {layers: [] for layers in (1, cycled)}
        for _ in range(args.repeats):
            for layers in rounds:  # interleaved: both sample the same stretch of the machine
                rounds[layers].append(_round_ms(spec, width, layers))
        for layers, samples in rounds.items():
            cells = ", ".join(f"{name} {statistics.median(s[name] for s in samples):.3f}" for name in samples[0])
            print(f"width {width}, {layers:2d} layer(s) in turn: {cells} ms")


if __name__ == "__main__":
    main()
