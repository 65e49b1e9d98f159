"""Benchmark: wall time of simulating a Llama-3.1-70B pipeline of 8 stages x TP 8 on 64 H100s.

The speed case of the pipeline issue: ``scenarios/h100_2x8_llama31_70b.yaml`` grown to 8 nodes of
8 H100 SXM (NVLink inside, one 400 Gbit/s NIC per GPU), tensor parallelism over each node's 8
GPUs and a pipeline of 8 stages over the nodes, 1024-token prompt, 256 output tokens, every
variant of the scenario; ``--batch`` sets the batch (the micro-batches default to
min(stages, batch)). Reports the median of repeats of ``sim.simulate.simulate`` (topology,
plans, engine, traces, metrics; not file writing), each from a freshly loaded scenario, and the
median CPU time of the process (on a shared machine the wall time also counts waiting for a core).

Measured on the project's 2-core machine at a quiet moment (load average 2.2; CPU time equal to
wall time), 7 repeats, at 6ebc787: 6 variants median 0.455 s (min 0.423 s), one variant
0.106 s, against ``bench_simulate.py``'s 16-device TP case in the same minute, 0.343 s. Under
the load of six other sessions (wall 2-3x CPU): 6 variants 1.35 s wall / 0.53 s CPU, the TP case
1.11 s / 0.44 s; batch 8 in 8 micro-batches, 2 variants, 0.79 s / 0.39 s.
Stages whose groups are laid out alike share one priced pass and one pricing of their
collectives (:func:`sim.alike.group_shape`), which took the 6 variants from 2.3 s to
0.53 s of CPU. On 2026-11-29 (06481db measured 0.56 s quietly) the trace was built as one
DataFrame per table with its strings from codes, a tensor-parallel group's ranks shared one memory
ledger and the peaks were one grouped max: interleaved against 06481db, 4 rounds of 5 repeats on
the shared machine (load average 5.4-6.2, steal 0.5%), CPU median of rounds 0.683 -> 0.418 s
(wall 1.36 -> 0.70 s), results byte-identical.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py [--repeats 7] [--batch 1] [--variants N]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_simulate import time_simulate
from models.input_files import load_yaml
from sim.scenario import scenario_from_dict

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "scenarios" / "h100_2x8_llama31_70b.yaml"


def pipeline_scenario(batch_size: int, variants: int | None = None):
    """The 8 x 8 pipeline case (see the module docstring), with its first ``variants`` variants."""
    data = load_yaml(BASE, "scenario")
    data["variants"] = data["variants"][:variants]
    if data["baseline"] not in {v["name"] for v in data["variants"]}:
        data["baseline"] = data["variants"][0]["name"]
    data["name"] = "h100_8x8_llama31_70b_pp8_tp8"
    data["cluster"]["hosts"][0]["count"] = 8
    data["parallel"] = {"tensor": 8, "pipeline": 8}
    data["workload"]["batch_size"] = batch_size
    return scenario_from_dict(data, base_dir=BASE.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", type=int, default=None, help="simulate the first N variants only")
    args = parser.parse_args()
    time_simulate(lambda: pipeline_scenario(args.batch, args.variants), args.repeats)


if __name__ == "__main__":
    main()
