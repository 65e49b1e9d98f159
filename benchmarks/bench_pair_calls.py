"""A TP-2 pair's collectives inside one host: in a run (quiet traces) against the calibration's
isolated sweep over one host's ranks and the simulator's price of them (issue 20: tp2_pp2's
TTFT over-priced once the one-host sweep prices the pair; its in-run reduce on v2x2_latency
dearer than the lone pair's).

Reads the quiet traces of ``validation/layouts-report/quiet-tp2pp2`` (``trace_<case>.json.gz``:
the traced last repeat of ``hetsim measure`` of each scenario there, session 16, progress.md says
how) and the profiles of ``validation/layouts-report/quiet-s17`` (calibrated with the one-host
sweep, session 17). Offline, a few seconds; prints three tables:

1. Per trace and phase (prefill: 96 KiB calls; decode: 3 KiB, steps but the first), the pair's
   calls in the run: reduce from the last arrival to the root's end (median, mean), the root's
   wait for the other rank (mean); broadcast from the last arrival to the receiver's end.
2. Decode reduces over :data:`SLOW_S`: their share, whether they end on the kernel's
   scheduler tick: the phase coherence ``|mean(exp(2 pi i t / tick))|`` of their ends, against
   their starts' and the other calls' ends (about ``1 / sqrt(n)`` for times unrelated to the
   tick), and how long the other stage's ranks computed inside them (tp2_pp2).
3. Per cluster with one-host rows, what calibration and the simulator say of the same calls: the
   sweep's medians (1 KiB to 256 KiB), its intra-host ping-pong (half a round trip, 1 KiB), and
   the price of a 2-rank call at 3 and 96 KiB with the intra-host terms fitted on those rows
   (:func:`sim.transport.fit_intra_host`), links' token buckets off and priced.

Run: ``PYTHONPATH=. python benchmarks/bench_pair_calls.py``
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from sim import token_bucket
from sim.collectives.registry import build_schedule
from sim.context import LinkClass, profile_contexts
from sim.outputs import read_chrome_trace
from sim.profile import load_profile
from sim.transport import context_topology, fit_intra_host, fit_profile, price
from sim.vocabulary import MeasurementKind

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "validation" / "layouts-report" / "quiet-tp2pp2"
PROFILES = ROOT / "validation" / "layouts-report" / "quiet-s17" / "profiles"
CASES = ("v2x2_bandwidth_alone", "v2x2_bandwidth", "v2x2_latency_alone", "v2x2_latency", "v4x1_bandwidth")
TICK_S = 4e-3  # this VM's kernel timer tick: CONFIG_HZ=250 (/boot/config-6.18.44-fc-v657)
SLOW_S = 1.5e-3  # a 3 KiB reduce's median in the run is 0.64-0.85 ms from the last arrival
PAIR = (0, 1)
COLLECTIVES = ("reduce", "broadcast")


def pair_calls(trace: dict) -> pd.DataFrame:
    """One row per collective call of a 2-rank group (ranks 2k and 2k + 1, the root the even one)
    in a measured ``trace``: ``phase, step, kind, start_last_s`` (the last arrival),
    ``root_end_s, other_end_s, root_wait_s`` (how long the root waited for the other rank),
    ``other_stage_compute_s`` (the other group's ranks' compute ops inside the call, summed)."""
    ops, _ = read_chrome_trace(trace)
    ops = ops.assign(group=ops["rank"] // 2)
    calls = ops[ops["kind"].isin(COLLECTIVES)]
    compute = ops[~ops["kind"].isin((*COLLECTIVES, "send"))]  # a hop's send/recv is its ranks waiting
    rows = []
    for (group, phase, step, _, _), call in calls.groupby(["group", "phase", "step", "layer", "name"]):
        if len(call) != 2:
            continue
        root, other = call[call["rank"] % 2 == 0].iloc[0], call[call["rank"] % 2 == 1].iloc[0]
        start, end = call["start_s"].max(), root["end_s"]
        others = compute[(compute["group"] != group) & (compute["start_s"] < end) & (compute["end_s"] > start)]
        rows.append({"phase": phase, "step": step, "kind": root["kind"], "start_last_s": start,
                     "root_end_s": end, "other_end_s": other["end_s"],
                     "root_wait_s": max(0.0, other["start_s"] - root["start_s"]),
                     "other_stage_compute_s": float((np.minimum(others["end_s"], end)
                                                     - np.maximum(others["start_s"], start)).sum())})
    frame = pd.DataFrame(rows)
    first_decode = frame.loc[frame["phase"] == "decode", "step"].min()
    return frame[(frame["phase"] == "prefill") | (frame["step"] > first_decode)]


def coherence(times_s) -> float:
    """How much ``times_s`` (s) keep one phase of the :data:`TICK_S` tick (0: none, 1: all)."""
    times = np.asarray(times_s, dtype=float)
    return float(abs(np.exp(2j * np.pi * times / TICK_S).mean())) if len(times) else float("nan")


def sweep_and_price(cluster: str) -> list[str]:
    """Table 3's lines for ``cluster`` (empty where its profile has no one-host rows)."""
    profile = load_profile(PROFILES / f"{cluster}.csv")
    context = profile_contexts(profile.rows)[0]
    rows, pings = profile.of(MeasurementKind.COLLECTIVE), profile.of(MeasurementKind.P2P)
    one_host = rows[(rows["num_hosts"] == 1) & (rows["group_size"] == 2)]
    if one_host.empty:
        return []
    intra = pings[(pings["device_class"] == LinkClass.INTRA_HOST.value)].sort_values("size_bytes")
    topology = context_topology(context)
    prices = {}
    for priced in (False, True):
        token_bucket.PRICED = priced
        terms = fit_intra_host(rows, pings, context, fit_profile(rows, context, None, pings))
        for kind in ("reduce", "broadcast"):
            for size in (3072, 98304):
                schedule = build_schedule(kind, "library", PAIR, size, root=0, host_groups=topology.host_groups(PAIR))
                prices[(priced, kind, size)] = price(schedule, topology, terms[(kind, "library")], None,
                                                     context.cores).duration_s
    token_bucket.PRICED = False
    lines = []
    for kind in ("reduce", "broadcast"):
        sweep = one_host[(one_host["op"] == kind) & (one_host["size_bytes"] <= 262144)].sort_values("size_bytes")
        cells = " ".join(f"{int(n) // 1024}K {t * 1e3:.2f}" for n, t in zip(sweep["size_bytes"], sweep["median"]))
        priced = " / ".join(f"{prices[(p, kind, 3072)] * 1e3:.2f}, {prices[(p, kind, 98304)] * 1e3:.2f}"
                            for p in (False, True))
        lines.append(f"| {cluster} | {kind} | {cells} | {float(intra['median'].iloc[0]) * 1e3:.2f} | {priced} |")
    return lines


def main() -> int:
    calls = {case: pair_calls(json.loads(gzip.decompress((TRACES / f"trace_{case}.json.gz").read_bytes())))
             for case in CASES}
    print("1. The pair's calls in the run (ms): reduce from the last arrival to the root's end, the root's wait; "
          "broadcast from the last arrival to the receiver's end")
    print("| case | phase | reduce median / mean | root's wait mean | broadcast median / mean | calls |")
    print("|---|---|---|---|---|---|")
    for case, frame in calls.items():
        for phase in ("prefill", "decode"):
            of = frame[frame["phase"] == phase]
            reduce, bcast = of[of["kind"] == "reduce"], of[of["kind"] == "broadcast"]
            spans = (reduce["root_end_s"] - reduce["start_last_s"]) * 1e3
            to_receiver = (bcast["other_end_s"] - bcast["start_last_s"]) * 1e3
            print(f"| {case} | {phase} | {spans.median():.2f} / {spans.mean():.2f} | "
                  f"{reduce['root_wait_s'].mean() * 1e3:.2f} | {to_receiver.median():.2f} / {to_receiver.mean():.2f} | "
                  f"{len(of)} |")
    print(f"\n2. Decode reduces over {SLOW_S * 1e3:g} ms (from the last arrival to the root's end), "
          f"and their phase coherence with the {TICK_S * 1e3:g} ms tick")
    print("| case | reduces | slow | slow ends | slow starts | other ends | 1/sqrt(slow) | other stage's compute "
          "inside slow calls ms |")
    print("|---|---|---|---|---|---|---|---|")
    for case, frame in calls.items():
        reduce = frame[(frame["phase"] == "decode") & (frame["kind"] == "reduce")]
        slow = reduce["root_end_s"] - reduce["start_last_s"] > SLOW_S
        print(f"| {case} | {len(reduce)} | {slow.mean():.0%} | {coherence(reduce.loc[slow, 'root_end_s']):.2f} | "
              f"{coherence(reduce.loc[slow, 'start_last_s']):.2f} | {coherence(reduce.loc[~slow, 'root_end_s']):.2f} | "
              f"{1 / np.sqrt(max(1, slow.sum())):.2f} | {reduce.loc[slow, 'other_stage_compute_s'].sum() * 1e3:.2f} |")
    print("\n3. Calibration's one-host sweep (2 ranks, medians, ms), its intra-host ping-pong at 1 KiB, and the "
          "simulated 2-rank call at 3 KiB, 96 KiB from the intra-host terms (buckets off / priced)")
    print("| cluster | op | sweep | ping-pong | simulated 3K, 96K: off / priced |")
    print("|---|---|---|---|---|")
    for cluster in dict.fromkeys(case.removesuffix("_alone") for case in CASES):
        for line in sweep_and_price(cluster):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
