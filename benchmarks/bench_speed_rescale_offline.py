"""Offline: how much of a plan check's error is the machine's stretch (issue 18)? A plan-check
report's candidates re-simulated three ways, against their measured medians; no testbed.

1. **as checked**: with the profile the check priced them with (``--profile``); what the report says;
2. **compute rescaled**: with that profile's compute times (:data:`sim.machine_speed.RESCALED_KINDS`)
   multiplied by a machine slowdown (:func:`sim.machine_speed.rescaled_profile`): each candidate's
   own ``machine_slowdown`` where the report has one (a reference op set timed around its
   launches, :mod:`runtime.reference_timing`); otherwise, for a report written before that was
   timed, one factor for all, **the proxy**: the geometric mean over the ``compute_isolated`` rows
   (the ops timed alone that price a candidate outside same-cluster mode) of the recalibrated
   profile's median over the checked profile's, matched by op and shape;
3. **recalibrated**: with a profile calibrated again later (``--recalibrated``), all its rows.

Each is a **diagnosis**, not a prediction: (2) uses a timing made while measuring (or, as the
proxy, a calibration made after the measurement), (3) a calibration made after it. The raw
prediction is (1).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_speed_rescale_offline.py
[--plan-check validation/plan-check-report/stretch-s19/pc10-0855]
[--profile validation/plan-check/profile_v2x2_bandwidth.csv]
[--recalibrated validation/plan-check-report/stretch-s19/profile_v2x2_bandwidth_0910.csv]``
(about 40 s on the project's 2-core machine).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from sim.machine_speed import describe, rescaled_profile
from sim.profile import Profile, load_profile
from sim.vocabulary import MeasurementKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layouts_offline import plan_check_errors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STRETCH = ROOT / "validation" / "plan-check-report" / "stretch-s19"
SHAPE = ["device_class", "op", "group_size", "batch_size", "new_tokens", "context_tokens", "dtype"]


def compute_ratio(checked: Profile, recalibrated: Profile) -> tuple[float, int]:
    """The proxy slowdown (see the module docstring) and how many op shapes it is over.

    Raises:
        ValueError: the two profiles share no ``compute_isolated`` op shape.
    """
    old, new = (p.of(MeasurementKind.COMPUTE_ISOLATED).set_index(SHAPE)["median"].astype(float)
                for p in (checked, recalibrated))
    both = old.index.intersection(new.index)
    if both.empty:
        raise ValueError("the two profiles share no compute_isolated op shape")
    ratios = new.loc[both] / old.loc[both]
    return float(np.exp(np.log(ratios).mean())), len(both)


def rescaled_errors(report: Path, profile: Profile, factors: dict[int, float]) -> pd.DataFrame:
    """:func:`bench_layouts_offline.plan_check_errors` per candidate, each with the profile's
    compute rescaled by its factor."""
    parts = []
    for candidate, factor in factors.items():
        errors = plan_check_errors(report, rescaled_profile(profile, factor))
        parts.append(errors[errors["variant"] == f"c{candidate}"])
    return pd.concat(parts, ignore_index=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-check", type=Path, default=STRETCH / "pc10-0855")
    parser.add_argument("--profile", type=Path, default=ROOT / "validation" / "plan-check" / "profile_v2x2_bandwidth.csv")
    parser.add_argument("--recalibrated", type=Path, default=STRETCH / "profile_v2x2_bandwidth_0910.csv")
    args = parser.parse_args()
    checked, recalibrated = load_profile(args.profile), load_profile(args.recalibrated)
    candidates = pd.read_csv(args.plan_check / "candidates.csv")
    proxy, shapes = compute_ratio(checked, recalibrated)
    timed = candidates.get("machine_slowdown", pd.Series(math.nan, index=candidates.index))
    factors = {int(c): (float(f) if pd.notna(f) else proxy) for c, f in zip(candidates["candidate"], timed)}
    source = "timed while measuring" if timed.notna().all() else f"proxy over {shapes} op shapes"
    print(f"compute_isolated of the recalibration against the checked profile: {describe(proxy)} "
          f"(proxy, {shapes} op shapes); factors used: {source}")
    ways = {"as checked": plan_check_errors(args.plan_check, checked),
            "compute rescaled": rescaled_errors(args.plan_check, checked, factors),
            "recalibrated": plan_check_errors(args.plan_check, recalibrated)}
    table = pd.concat([e.assign(way=way) for way, e in ways.items()], ignore_index=True)
    wide = table.pivot_table(index=["variant", "metric"], columns="way", values=["simulated", "error"], sort=False)
    measured = table.drop_duplicates(["variant", "metric"]).set_index(["variant", "metric"])["measured"]
    print("| candidate | metric | measured ms | " + " | ".join(f"{w} ms (error)" for w in ways) + " |")
    print("|---|---|---|" + "---|" * len(ways))
    for (variant, metric), row in wide.iterrows():
        print(f"| {variant} (x{factors[int(variant[1:])]:.3f}) | {metric} | {measured[(variant, metric)] * 1e3:.1f} | "
              + " | ".join(f"{row[('simulated', w)] * 1e3:.1f} ({row[('error', w)]:+.1%})" for w in ways) + " |")
    for way, errors in ways.items():
        magnitude = errors["error"].abs()
        print(f"{way}: median / max |error| of TTFT and TPOT {magnitude.median():.1%} / {magnitude.max():.1%}, "
              f"median signed {errors['error'].median():+.1%}")


if __name__ == "__main__":
    main()
