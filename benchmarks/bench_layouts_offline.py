"""Offline re-simulation of a layouts validation report (issue 20): every layout of every cluster
simulated with the current simulator from the report's shipped profiles, against its measured
medians; no testbed.

A layouts matrix (``validation/layouts-report/matrix.yaml``) calibrates each cluster in its own
layout and measures the others in launches of their own (:func:`validation.validate.validate`).
Here each case is rebuilt as ``hetsim validate`` builds it (:func:`validation.matrix.with_layout`)
and simulated with its cluster's profile (``profiles/<cluster>.csv``); its error is
``simulated / measured - 1`` against the report's ``errors.csv``. The calibrated layout (no
``parallel``) is a **replay**, every other layout a **prediction** of a layout the profile never
measured. Prints median and p90 |error| per (replay | prediction) and metric, and the signed
errors per layout and how many layout pairs it ranks as measured
(:func:`validation.validate.ranking_agreement`); writes ``errors.csv`` and ``summary.md`` under
``--out``. A few seconds per
cluster on the project's 2-core machine.

The same for a plan check (``--plan-check``, default ``validation/plan-check-report``,
:mod:`validation.plan_check`): each measured candidate's scenario (``scenarios/c<n>.yaml``)
simulated with the plan's profile (``--plan-check-profile``) against its measured medians
(``candidates.csv``), labelled replay or prediction as the check labelled it.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_layouts_offline.py [--report validation/layouts-report] [--out DIR] [--no-token-buckets] [--no-arrival-lags] [--no-gloo-tree] [--core-turns] [--no-by-shape]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from sim.outputs import write_files
from sim.profile import Profile, load_profile
from sim.scenario import load_scenario
from sim.simulate import simulate
from sim.vocabulary import Metric
from validation.matrix import load_matrix, with_layout
from validation.pricing_options import add_pricing_options, apply_pricing_options
from validation.validate import ranking_agreement

ROOT = Path(__file__).resolve().parent.parent
METRICS = (Metric.TTFT, Metric.TPOT)
REPLAY, PREDICTION = "replay", "prediction"
COLUMNS = ["scenario", "prompt_tokens", "variant", "kind", "metric", "simulated", "measured", "error"]


def layout_errors(report: Path, on_progress=lambda text: None) -> pd.DataFrame:
    """Every (cluster, layout, prompt, metric) of ``report`` re-simulated; columns :data:`COLUMNS`
    (``kind``: :data:`REPLAY` for the calibrated layout, :data:`PREDICTION` for the others).

    Raises:
        ConfigError: a matrix, scenario or profile that does not load.
    """
    matrix, scenarios = load_matrix(report / "matrix.yaml")
    measured = pd.read_csv(report / "errors.csv")
    measured = measured[measured["metric"].isin(METRICS)].set_index(
        ["scenario", "prompt_tokens", "variant", "metric"])["measured"]
    rows = []
    for scenario in scenarios:
        profile = load_profile(report / "profiles" / f"{scenario.name}.csv")
        for layout in matrix.layouts:
            for prompt in matrix.prompt_tokens:
                on_progress(f"{scenario.name} {layout.name} at prompt {prompt}")
                results = simulate(with_layout(scenario, layout, prompt), profile=profile).results
                simulated = results[results["device"].isna() | (results["device"] == "")].set_index("metric")["value"]
                for metric in METRICS:
                    key = (scenario.name, prompt, layout.name, metric)
                    if key not in measured.index:
                        continue
                    value, truth = float(simulated[metric]), float(measured[key])
                    rows.append({"scenario": scenario.name, "prompt_tokens": prompt, "variant": layout.name,
                                 "kind": REPLAY if layout.parallel is None else PREDICTION, "metric": str(metric),
                                 "simulated": value, "measured": truth, "error": value / truth - 1})
    return pd.DataFrame(rows, columns=COLUMNS)


def plan_check_errors(report: Path, profile: Profile) -> pd.DataFrame:
    """Every candidate of a plan-check ``report`` re-simulated with ``profile``; columns
    :data:`COLUMNS` (``variant``: ``c<candidate>``; ``kind``: the check's source label).

    Raises:
        ConfigError: a scenario that does not load.
    """
    rows = []
    for row in pd.read_csv(report / "candidates.csv").itertuples(index=False):
        scenario = load_scenario(report / "scenarios" / f"c{row.candidate}.yaml")
        results = simulate(scenario, profile=profile, expand_steps=()).results
        simulated = results[results["device"].isna() | (results["device"] == "")].set_index("metric")["value"]
        for metric in METRICS:
            value, truth = float(simulated[metric]), float(getattr(row, f"measured_{metric}"))
            rows.append({"scenario": row.cluster, "prompt_tokens": int(scenario.config.workload.prompt_tokens),
                         "variant": f"c{row.candidate}", "kind": row.source, "metric": str(metric),
                         "simulated": value, "measured": truth, "error": value / truth - 1})
    return pd.DataFrame(rows, columns=COLUMNS)


def plan_check_markdown(errors: pd.DataFrame) -> str:
    """Per candidate: simulated against measured TTFT and TPOT, and the error."""
    lines = ["## Plan check, re-simulated offline", "", "| candidate | cluster | kind | metric | simulated ms | "
             "measured ms | error |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.variant} | {r.scenario} | {r.kind} | {r.metric} | {r.simulated * 1e3:.1f} | "
              f"{r.measured * 1e3:.1f} | {r.error:+.1%} |" for r in errors.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def overall(errors: pd.DataFrame) -> pd.DataFrame:
    """Per kind (replay, prediction) and metric: cases, median and p90 |error|."""
    rows = []
    for kind in (REPLAY, PREDICTION):
        for metric in METRICS:
            chosen = np.abs(errors[(errors["kind"] == kind) & (errors["metric"] == metric)]["error"].to_numpy(float))
            if len(chosen):
                rows.append({"kind": kind, "metric": str(metric), "cases": len(chosen),
                             "median_abs_error": float(np.median(chosen)),
                             "p90_abs_error": float(np.percentile(chosen, 90))})
    return pd.DataFrame(rows, columns=["kind", "metric", "cases", "median_abs_error", "p90_abs_error"])


def summary_markdown(errors: pd.DataFrame, command: str) -> str:
    """The overall table and the signed errors per layout, in cluster order."""
    lines = ["# Layouts report, re-simulated offline", "", f"Regenerate: `{command}`", "",
             "| case | metric | cases | median abs error | p90 abs error |", "|---|---|---|---|---|"]
    for row in overall(errors).itertuples(index=False):
        label = "calibrated layout, replay" if row.kind == REPLAY else "new layouts, prediction"
        lines.append(f"| {label} | {row.metric} | {row.cases} | {row.median_abs_error:.1%} | "
                     f"{row.p90_abs_error:.1%} |")
    ranked = ranking_agreement(errors)
    lines += ["", f"Ranking: {int(ranked['simulator_agrees'].sum())} of the {len(ranked)} layout pairs whose measured "
              "TTFT or TPOT differ by more than 10% ordered as measured."]
    clusters = list(dict.fromkeys(errors["scenario"]))
    lines += ["", f"Signed errors per layout ({', '.join(clusters)}):", "", "| layout | kind | TTFT | TPOT |",
              "|---|---|---|---|"]
    for variant, group in errors.groupby("variant", sort=False):
        cells = [" ".join(f"{e:+.0%}" for e in group[group["metric"] == m].set_index("scenario")
                          .reindex(clusters)["error"].dropna()) for m in METRICS]
        lines.append(f"| {variant} | {group['kind'].iloc[0]} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=ROOT / "validation" / "layouts-report",
                        help="a layouts validation report: matrix.yaml, errors.csv, profiles/")
    parser.add_argument("--plan-check", type=Path, default=ROOT / "validation" / "plan-check-report",
                        help="a plan-check report: candidates.csv, scenarios/")
    parser.add_argument("--plan-check-profile", type=Path,
                        default=ROOT / "validation" / "plan-check" / "profile_v2x2_bandwidth.csv",
                        help="the profile the plan was made with")
    parser.add_argument("--out", type=Path, default=None, help="write errors.csv and summary.md here")
    add_pricing_options(parser)
    args = parser.parse_args()
    flags = apply_pricing_options(args)
    started = time.perf_counter()
    errors = layout_errors(args.report, on_progress=lambda text: print(text, file=sys.stderr))
    command = " ".join(["PYTHONPATH=. python benchmarks/bench_layouts_offline.py --report", str(args.report), *flags])
    text = summary_markdown(errors, command) + "\n" + plan_check_markdown(
        plan_check_errors(args.plan_check, load_profile(args.plan_check_profile)))
    print(text)
    if args.out is not None:
        written = write_files(args.out, {"errors.csv": errors.to_csv(index=False, lineterminator="\n"),
                                         "summary.md": text})
        print("wrote " + ", ".join(str(p) for p in written))
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
