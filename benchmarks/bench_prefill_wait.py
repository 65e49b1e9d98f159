"""Where the master's wait in a prefill comes from (issue 18), from the shipped reports alone: no
simulation, no testbed, a few seconds.

With the links' token buckets priced (:data:`sim.token_bucket.PRICED`) the prefill's collective
calls are priced right and the master's wait for the last rank to arrive is what the predicted
TTFT lacks: measured about 13% of TTFT, simulated 0 (``benchmarks/bench_bucket_terms.py``). A
tensor-parallel prefill of the allreduce strategies runs, per decoder layer, two blocks each
closed by an allreduce (``attn_allreduce``, ``mlp_allreduce``); the first layer's attention block
is preceded by the master's embedding broadcast (``embed_bcast``), whose root leaves once its
payload is in its sockets (gloo ``gloo/transport/tcp/pair.cc``: a send completes on ``writev``)
while the leaves are still receiving it. The profiles time both allreduces in place per call
(``collective_wait`` rows: the master's wait for the last rank's start, each repeat a
generation's mean over its layers), so the wait splits as:

* ``layer0_ms``: ``layers x (attn wait - mlp wait)``: what the attention allreduce waits beyond
  the MLP's, over a generation: the first layer's wait for the embedding broadcast's leaves
  (the two blocks are otherwise alike: each rank computes its shard and calls an allreduce).
  Compared with ``bcast_ms``, the same cluster's isolated broadcast at that size
  (``collective_held_out``: last rank's start to last rank's end).
* ``every_call_ms``: ``2 x layers x mlp wait``: the wait every block's call pays, ranks that left
  the previous allreduce together arriving apart; ``per_call / block`` its ratio to the master's
  measured compute per block (``terms.csv``).

Per case (shipped clusters, the allreduce strategies, each measured prompt), the measured prefill
wait (``terms.csv``), its share of TTFT, and the two parts at the prefill's payload
(``prompt x`` the decode call's size; interpolated linearly in size between timed sizes). The
calibration runs and the measured runs are different generations of the same cluster, so the
parts need not add up to the measured wait exactly.

With ``--trace``, a measured run's ``trace.json`` (``hetsim measure``: every rank's ops) is read
instead, per variant and over its prefill's collective calls: how often each rank arrived last,
the master's total wait, and each other rank's arrival after the master split into its later exit
from the previous call (woken, it waits for a core before its end is stamped: in no op's time)
and its longer compute in the block between.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_prefill_wait.py [--trace out/X-measured/trace.json]``
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.profile import CHARGED
from sim.trace import COLLECTIVE_KINDS
from sim.vocabulary import MeasurementKind, PhaseKind
from validation.transfer import REPO_ROOT, SHIPPED, shipped_clusters

NEW_CLUSTERS = ((REPO_ROOT / "validation" / "transfer-new.yaml", REPO_ROOT / "validation" / "transfer-new-report"),)
ALLREDUCE_PREFIX = "allreduce_"  # the allreduce strategies' variant names: allreduce_<algorithm>
BLOCK_KINDS = tuple(f"compute:{k}" for k in (OpKind.LAYERNORM, OpKind.QKV_PROJ, OpKind.ATTENTION,
                                               OpKind.OUT_PROJ, OpKind.MLP_UP, OpKind.MLP_DOWN))
BLOCKS_PER_LAYER = 2  # attention and MLP, each closed by an allreduce


def _at(rows: pd.DataFrame, size_bytes: float, statistic: str) -> float:
    """``statistic`` of ``rows`` interpolated linearly in size at ``size_bytes`` (s); NaN without rows."""
    if rows.empty:
        return float("nan")
    rows = rows.sort_values("size_bytes")
    return float(np.interp(size_bytes, rows["size_bytes"].astype(float), rows[statistic].astype(float)))


def wait_split(clusters) -> pd.DataFrame:
    """One row per (cluster, prompt, allreduce variant) with a measured prefill split; see the
    module docstring for the columns (ms, %, ratios)."""
    wait_stat = CHARGED[MeasurementKind.COLLECTIVE_WAIT]
    rows = []
    for cluster in clusters:
        if cluster.terms is None:
            continue
        profile = cluster.profile.rows
        waits = profile[profile["measurement"] == MeasurementKind.COLLECTIVE_WAIT]
        held = profile[(profile["measurement"] == MeasurementKind.COLLECTIVE_HELD_OUT)
                       & (profile["op"] == str(OpKind.BROADCAST))]
        layers = cluster.scenario.model.num_layers
        token_bytes = float(waits["size_bytes"].min())  # a decode call's payload: one token
        prefill = cluster.terms[cluster.terms["phase"] == str(PhaseKind.PREFILL)]
        for (prompt, variant), terms in prefill.groupby(["prompt_tokens", "variant"]):
            if not variant.startswith(ALLREDUCE_PREFIX):
                continue
            algorithm = variant[len(ALLREDUCE_PREFIX):]
            size = prompt * token_bytes
            attn = _at(waits[(waits["call"] == "attn_allreduce") & (waits["algorithm"] == algorithm)], size, wait_stat)
            mlp = _at(waits[(waits["call"] == "mlp_allreduce") & (waits["algorithm"] == algorithm)], size, wait_stat)
            measured = terms.set_index("term")["measured_s"]
            ttft_s, wait_s = float(measured.sum()), float(measured.get("wait", 0.0))
            block_s = float(sum(measured.get(k, 0.0) for k in BLOCK_KINDS)) / (BLOCKS_PER_LAYER * layers)
            rows.append({"cluster": cluster.name, "prompt": int(prompt), "algorithm": algorithm,
                         "wait_ms": wait_s * 1e3, "wait_pct_ttft": 100 * wait_s / ttft_s,
                         "layer0_ms": layers * (attn - mlp) * 1e3, "bcast_ms": _at(held, size, "median") * 1e3,
                         "every_call_ms": BLOCKS_PER_LAYER * layers * mlp * 1e3, "per_call_ms": mlp * 1e3,
                         "block_ms": block_s * 1e3, "per_call/block": mlp / block_s})
    return pd.DataFrame(rows)


PID_PER_VARIANT = 1000  # sim.outputs.chrome_trace: pid = 1000 x variant index + rank


def trace_arrivals(path: Path) -> pd.DataFrame:
    """Per variant of a measured ``trace.json``, over its prefill's collective calls (every rank
    recorded): ``last_counts`` (rank -> calls it arrived last at), ``master_wait_ms`` (summed),
    and over the other ranks and calls after the first, the mean ``arrival_lag_ms`` after the
    master, its ``exit_lag_ms`` (previous call's end) and ``compute_lag_ms`` (ops between)."""
    events = json.loads(path.read_text())["traceEvents"]
    variants = {e["pid"] // PID_PER_VARIANT: e["args"]["name"].split(" / rank ")[0]
                for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") != "step"
           and e["args"].get("phase") == str(PhaseKind.PREFILL)]
    rows = []
    for index, variant in sorted(variants.items()):
        calls: dict[tuple, dict[int, tuple[float, float, float]]] = {}  # call -> rank -> (start, end, compute before)
        for rank in sorted({e["pid"] % PID_PER_VARIANT for e in ops if e["pid"] // PID_PER_VARIANT == index}):
            compute_us = 0.0
            for e in sorted((e for e in ops if e["pid"] == index * PID_PER_VARIANT + rank), key=lambda e: e["ts"]):
                if e["cat"] in COLLECTIVE_KINDS:
                    calls.setdefault((e["args"]["layer"], e["name"]), {})[rank] = (e["ts"], e["ts"] + e["dur"], compute_us)
                    compute_us = 0.0
                else:
                    compute_us += e["dur"]
        ordered = sorted((c for c in calls.values() if 0 in c and len(c) == max(map(len, calls.values()))),
                         key=lambda c: c[0][0])
        last = Counter(max(c, key=lambda r: c[r][0]) for c in ordered)
        wait_us = sum(max(0.0, max(s for s, _, _ in c.values()) - c[0][0]) for c in ordered)
        lags = np.array([(c[r][0] - c[0][0], previous[r][1] - previous[0][1], c[r][2] - c[0][2])
                         for previous, c in zip(ordered, ordered[1:]) for r in c if r != 0]) / 1e3
        rows.append({"variant": variant, "calls": len(ordered), "last_counts": dict(sorted(last.items())),
                     "master_wait_ms": wait_us / 1e3, "arrival_lag_ms": lags[:, 0].mean(),
                     "exit_lag_ms": lags[:, 1].mean(), "compute_lag_ms": lags[:, 2].mean()})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=None, help="a measured trace.json to read instead")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    if args.trace is not None:
        print(trace_arrivals(args.trace).round(2).to_string(index=False))
        return
    table = wait_split(shipped_clusters(SHIPPED) + shipped_clusters(NEW_CLUSTERS))
    print("Measured prefill wait and its two parts, per case (ms):")
    print(table.round(2).to_string(index=False))
    print("\nMedian per cluster and prompt:")
    print(table.groupby(["cluster", "prompt"]).median(numeric_only=True).round(2).to_string())
    print(f"\nMedian share of the wait: first layer {np.median(table['layer0_ms'] / table['wait_ms']):.2f}, "
          f"every call {np.median(table['every_call_ms'] / table['wait_ms']):.2f}; "
          f"per call / block {table['per_call/block'].median():.2f}")


if __name__ == "__main__":
    main()
