"""A pipeline's decode relay as measured, stage by stage, against the simulator's hops (issue 20).

Reads measured traces of a batch-1 pipeline (``hetsim measure SCENARIO --testbed``, whose
``trace.json`` may be gzipped) and prints, as medians over the decode steps (the first two and
the last left out): each stage's compute span (its first compute op's start to its last's end, s)
and the gap from one stage's last compute op to the next stage's first, which is the hop between
them (send, wire, receive); the gap from the last stage back to the first is the token's return.
With ``--profile``, also each hop of the scenario as the simulator prices it (its decode trace,
``send`` ops) calibrated by that profile.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_pipeline_hops.py TRACE [TRACE ...]
[--scenario S --profile P]``; e.g. the traces kept in ``validation/layouts-report/pp4-hops-s28``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
from collections import defaultdict
from pathlib import Path

from models.ops import OpKind
from sim.trace import COLLECTIVE_KINDS
from sim.vocabulary import PhaseKind


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def relay(path: Path) -> dict[str, float]:
    """Median (ms) over the decode steps of each stage's compute span and each hop's gap."""
    spans = defaultdict(dict)  # step -> pid -> (start, end) of its compute
    for event in _events(path):
        args = event.get("args", {})
        if event.get("ph") != "X" or args.get("phase") != PhaseKind.DECODE or event["cat"] in COLLECTIVE_KINDS:
            continue
        start, end = event["ts"] / 1e3, (event["ts"] + event["dur"]) / 1e3
        old = spans[args["step"]].get(event["pid"], (start, end))
        spans[args["step"]][event["pid"]] = (min(old[0], start), max(old[1], end))
    steps = sorted(spans)[2:-1]
    stages = sorted(spans[steps[0]])
    out = {}
    for i, pid in enumerate(stages):
        out[f"stage {i} compute"] = statistics.median(spans[s][pid][1] - spans[s][pid][0] for s in steps)
        if i + 1 < len(stages):
            out[f"hop {i}->{i + 1}"] = statistics.median(spans[s][stages[i + 1]][0] - spans[s][pid][1] for s in steps)
    out[f"hop {len(stages) - 1}->0 (token)"] = statistics.median(
        spans[b][stages[0]][0] - spans[a][stages[-1]][1] for a, b in zip(steps, steps[1:]))
    out["period"] = statistics.median(spans[b][stages[0]][0] - spans[a][stages[0]][0] for a, b in zip(steps, steps[1:]))
    return out


def simulated_hops(scenario: Path, profile: Path) -> list[tuple[int, int, float]]:
    """(src rank, dst rank, ms) of each hop of the simulated decode step 1."""
    from sim.profile import load_profile
    from sim.scenario import load_scenario
    from sim.simulate import simulate

    ops = simulate(load_scenario(scenario), profile=load_profile(profile)).variants[0].trace.ops
    sends = ops[(ops["step"] == 1) & (ops["kind"] == OpKind.SEND.value)].sort_values(["start_s", "rank"])
    hops = []
    for _, pair in sends.groupby("start_s", sort=True):  # a hop's sender and receiver share its span
        ranks = sorted(pair["rank"])
        hops.append((ranks[0], ranks[-1], float((pair["end_s"] - pair["start_s"]).iloc[0]) * 1e3))
    return hops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--scenario", type=Path)
    parser.add_argument("--profile", type=Path)
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}")
    for path in args.traces:
        print(f"{path}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in relay(path).items()))
    if args.scenario and args.profile:
        for src, dst, ms in simulated_hops(args.scenario, args.profile):
            print(f"simulated hop rank {src}<->{dst}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
