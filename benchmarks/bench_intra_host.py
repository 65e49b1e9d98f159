"""TP-2 inside a host, predicted from each cluster's TP-4 profile, against quiet measurements
(issues 18, 20): the lone pair (``parallel: {tensor: 2}``, ranks 0 and 1 on host n0) and tp2_pp2,
each simulated with its cluster's profile of ``validation/layouts-report/profiles`` (a
**prediction**: the profiles timed TP-4 over 2 hosts), links' token buckets off and priced,
against ``validation/layouts-report/quiet-tp2pp2/results_*.csv`` (measured on a quiet machine,
session 16, progress.md says how). Then what each profile charges a collective inside a host
(:func:`sim.transport.fit_intra_host`).

Run: ``PYTHONPATH=. python benchmarks/bench_intra_host.py`` (a few seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from sim import token_bucket
from sim.profile import load_profile
from sim.scenario import load_scenario
from sim.simulate import simulate
from sim.vocabulary import Metric

ROOT = Path(__file__).resolve().parent.parent
QUIET = ROOT / "validation" / "layouts-report" / "quiet-tp2pp2"
PROFILES = ROOT / "validation" / "layouts-report" / "profiles"
CASES = (("alone tp2", "v2x2_bandwidth", "_alone"), ("alone tp2", "v2x2_latency", "_alone"),
         ("tp2_pp2", "v2x2_bandwidth", ""), ("tp2_pp2", "v4x1_bandwidth", ""), ("tp2_pp2", "v2x2_latency", ""))


def _medians(results: pd.DataFrame, source: str) -> pd.Series:
    rows = results[(results["source"] == source) & (results["variant"] == results["variant"].iloc[0])]
    return rows.set_index("metric")["value"]


def main() -> int:
    print("| layout | cluster | measured TTFT / TPOT ms | buckets off: simulated (error) | buckets priced |")
    print("|---|---|---|---|---|")
    sources: dict[str, list[str]] = {}
    for layout, cluster, suffix in CASES:
        measured = _medians(pd.read_csv(QUIET / f"results_{cluster}{suffix}.csv"), "measured")
        cells = []
        for priced in (False, True):
            token_bucket.PRICED = priced
            result = simulate(load_scenario(QUIET / f"{cluster}{suffix}.yaml"),
                              profile=load_profile(PROFILES / f"{cluster}.csv"))
            simulated = _medians(result.results, "simulated")
            cells.append(" / ".join(f"{simulated[m] * 1e3:.1f} ({simulated[m] / measured[m] - 1:+.0%})"
                                    for m in (Metric.TTFT, Metric.TPOT)))
            if not priced:
                sources[cluster] = [line for line in result.sources if "inside a host" in line]
        token_bucket.PRICED = False
        print(f"| {layout} | {cluster} | {measured[Metric.TTFT] * 1e3:.1f} / {measured[Metric.TPOT] * 1e3:.1f} | "
              + " | ".join(cells) + " |")
    for cluster, lines in sources.items():
        print(f"\n{cluster} (buckets off), inside a host:" + "".join(f"\n  {line}" for line in lines or ["none"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
