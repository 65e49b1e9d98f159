"""The uneven TP-3 split's collectives (issue 20, layout ``tp3_uneven``): per call in a measured
trace, from the ranks' arrivals, against the simulator's price of the same calls.

Reads the traces of ``validation/layouts-report/tp3-traces-s19`` (``trace_<cluster>.json.gz``: the
traced last repeat of ``hetsim measure`` of the scenario beside it, GPT-2 ``reduce_ln_bcast`` in
``parallel: {tensor: 3, shares: [2, 1, 1]}``, 24 output tokens; measured with other helpers' load
on the machine, so for the mechanism, not for error figures) and simulates the same scenario with
the cluster's TP-4 profile of ``validation/layouts-report/quiet-s17`` (a prediction). Per phase
(prefill: 96 KiB calls; decode: 3 KiB, steps but the first) and collective, the median and mean
over the calls (ms) of:

* ``wait0``: how long the root (rank 0) waited for the last rank to arrive;
* ``root_from_last``: the root's end from the last arrival;
* ``end1``, ``end2``: ranks 1 and 2's ends from the root's start (a broadcast: when each
  receiver had the payload).

Offline, a few seconds. Run: ``PYTHONPATH=. python benchmarks/bench_uneven_calls.py [--[no-]token-buckets] [--[no-]gloo-tree]``
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pandas as pd

from sim.outputs import read_chrome_trace
from sim.profile import load_profile
from sim.scenario import load_scenario
from sim.simulate import simulate
from validation.pricing_options import add_pricing_options, apply_pricing_options

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "validation" / "layouts-report" / "tp3-traces-s19"
PROFILES = ROOT / "validation" / "layouts-report" / "quiet-s17" / "profiles"
CLUSTERS = ("v2x2_bandwidth", "v4x1_bandwidth")
COLLECTIVES = ("reduce", "broadcast")
ROOT_RANK = 0


def calls(ops: pd.DataFrame) -> pd.DataFrame:
    """One row per collective call of the trace's ``ops`` (times in s): ``phase, kind`` and the
    module docstring's columns (ms). Decode's first step is left out (its ranks start apart)."""
    ops = ops[ops["kind"].isin(COLLECTIVES)]
    first_decode = ops.loc[ops["phase"] == "decode", "step"].min()
    ops = ops[(ops["phase"] == "prefill") | (ops["step"] > first_decode)]
    rows = []
    for (phase, kind, _, _, _), call in ops.groupby(["phase", "kind", "step", "layer", "name"]):
        call = call.set_index("rank")
        if ROOT_RANK not in call.index or len(call) < 2:
            continue
        last, root = call["start_s"].max(), call.loc[ROOT_RANK]
        row = {"phase": phase, "kind": kind, "wait0": last - root["start_s"], "root_from_last": root["end_s"] - last}
        row.update({f"end{rank}": call.loc[rank, "end_s"] - root["start_s"] for rank in call.index if rank != ROOT_RANK})
        rows.append(row)
    frame = pd.DataFrame(rows)
    columns = [c for c in frame.columns if c not in ("phase", "kind")]
    frame[columns] *= 1e3
    return frame


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """Median and mean of every column per (phase, kind)."""
    return frame.groupby(["phase", "kind"]).agg(["median", "mean"]).round(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pricing_options(parser, ("--token-buckets", "--gloo-tree"))
    apply_pricing_options(parser.parse_args())
    pd.set_option("display.width", 200)
    for cluster in CLUSTERS:
        with gzip.open(TRACES / f"trace_{cluster}.json.gz", "rt") as handle:
            measured, _ = read_chrome_trace(json.load(handle))
        scenario = load_scenario(TRACES / f"{cluster}.yaml")
        result = simulate(scenario, profile=load_profile(PROFILES / f"{cluster}.csv"), expand_steps=(0, 1, 2))
        simulated = result.variants[0].trace.ops
        print(f"## {cluster}: measured (trace)\n{table(calls(measured)).to_string()}\n")
        print(f"## {cluster}: simulated (prediction from its TP-4 profile)\n{table(calls(simulated)).to_string()}\n")


if __name__ == "__main__":
    main()
