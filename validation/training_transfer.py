"""The calibration-transfer figure of a training validation, as the transfer issue defines it
for inference (:mod:`validation.transfer`): for every ordered pair of distinct clusters, the
target's cases simulated from the source's calibration alone; also from the calibrations of all
clusters but the target pooled (leave-one-out, :func:`validation.transfer.pooled_profile`), from
none, and from the target's own (the diagonal, the replay).

The simulations are :func:`validation.training_validation.compare_clusters`'s with ``transfer``
(its sources are :func:`validation.transfer.transfer_sources`, the inference transfer's); here its
error table becomes the transfer's case table (:func:`transfer_cases`: ``source``, ``target``,
``variant``, ``device``, ``metric``, ``simulated``, ``measured``, ``error``, ``term``,
``term_contribution``) and is summarised by the inference transfer's tables
(:func:`validation.transfer.transfer_table`, ``overall_table``, ``matrix_table``,
``behind_table``) and heat map (:func:`validation.present.transfer_report.transfer_heatmap`).

The term behind a step time or peak memory off by more than
:data:`validation.transfer.TERM_THRESHOLD`: of the parts the runtime measures beside it (:data:`SPLITS`:
the step's forward, backward, optimizer and exposed communication, ``other`` the rest of the
measured step; the peak's memory categories, which add up to it), the one contributing most in
the error's direction (:func:`validation.terms.term_behind`), each part's contribution being
its simulated less its measured value over the measured step (or peak), so that a case's parts
add up to its error.

A pooled profile is what the simulator makes of several calibrations' rows together; not every
term of it is a pool (:data:`POOLED_TERMS`, said in the report).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.training.simulate import MEMORY_CATEGORIES
from sim.vocabulary import Metric
from validation.terms import term_behind
from validation.transfer import (NO_PROFILE, PAIR_KINDS, POOLED, TERM_THRESHOLD, behind_lines, kind_of_pair,
                                 matrix_lines, overall_lines, overall_table, transfer_table)

SPLITS = {Metric.STEP_TIME: (Metric.FORWARD_TIME, Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME,
                             Metric.EXPOSED_COMMUNICATION),
          Metric.PEAK_MEMORY: MEMORY_CATEGORIES}
"""Each headline metric and the parts measured beside it (the step's phases; the peak's memory
categories), whose errors say where a case's error comes from."""
HEADLINE = tuple(SPLITS)
TRANSFER_METRICS = (*HEADLINE, *SPLITS[Metric.STEP_TIME])
"""The metrics of ``transfer.csv``: the headline ones and the step's phases."""
CASE_COLUMNS = ["source", "target", "variant", "device", "metric", "simulated", "measured", "error", "term",
                "term_contribution"]
OTHER = "other"  # the part of a measured step outside its measured phases
POOLED_TERMS = (
    ("forward and backward ops, optimizer step (compute, backward_input, backward_weight, optimizer_step rows)",
     "pooled", "the median over the calibrations of each shape's time (sim.calibrated.CalibratedCompute)"),
    ("whole passes (training_pass rows)", "pooled",
     "the median over the calibrations of each pass's time, set against the pooled ops "
     "(sim.training.step_compute.pass_factors)"),
    ("framework memory (memory_baseline rows)", "pooled", "the median over the calibrations (sim.framework)"),
    ("precision", "pooled",
     "each variant from the rows of its own precision across the pool; a calibration that timed only "
     "another precision of the same dtype adds none where another timed it (sim.profile.Profile.of_precision)"),
    ("core contention per core turn", "pooled",
     "the median over the calibrations whose links let it show, else gloo's default "
     "(sim.calibrated.contention_floor)"),
    ("bucket allreduces (collective rows: the transport terms)", "not pooled",
     "the first calibration (by cluster name) whose sweep fits the algorithm, alone: sweeps over other links "
     "are not fitted together (sim.calibrated.calibrated_network)"),
    ("cores shared and the factor taking contention out of compute (context rows)", "not pooled",
     "the first calibration that records its cores (sim.context.core_contention)"),
)
"""How a pooled profile prices each term of a training step: ``pooled`` where the calibrations'
rows are combined, ``not pooled`` where one calibration of the pool prices it alone (the source
of each statement in parentheses; ``tests/test_training_transfer.py`` checks the last two)."""


def transfer_cases(errors: pd.DataFrame) -> pd.DataFrame:
    """The transfer's case table (:data:`CASE_COLUMNS`, rows of :data:`TRANSFER_METRICS`) from a
    training validation's error table (:data:`validation.training_validation.ERROR_COLUMNS`),
    each headline case off by more than :data:`validation.transfer.TERM_THRESHOLD` given the
    part behind it (see the module docstring); ``term`` empty and ``term_contribution`` NaN
    elsewhere."""
    table = errors.rename(columns={"calibrated_on": "source", "cluster": "target", "case": "variant"})
    table = table.assign(device=table["device"].fillna(""))
    keys = ["source", "target", "variant", "device"]
    values = table.set_index([*keys, "metric"])[["simulated", "measured"]]
    cases = table[table["metric"].isin([str(m) for m in TRANSFER_METRICS])].reset_index(drop=True)
    terms, contributions = [""] * len(cases), [np.nan] * len(cases)
    for index, row in cases.iterrows():
        if row["metric"] not in [str(m) for m in HEADLINE] or not abs(row["error"]) > TERM_THRESHOLD:
            continue
        parts = [str(m) for m in SPLITS[Metric(row["metric"])]]
        at = tuple(row[key] for key in keys)
        present = [part for part in parts if (*at, part) in values.index]
        split = values.loc[[(*at, part) for part in present]].set_axis(present)
        split.loc[OTHER] = (row["simulated"] - split["simulated"].sum(), row["measured"] - split["measured"].sum())
        split = split.assign(contribution=(split["simulated"] - split["measured"]) / row["measured"])
        behind = term_behind(split.rename_axis("term").reset_index(), row["error"])
        terms[index], contributions[index] = str(behind["term"]), float(behind["contribution"])
    return cases.assign(term=terms, term_contribution=contributions)[CASE_COLUMNS]


def ranking_by_pairs(ranking: pd.DataFrame) -> pd.DataFrame:
    """Per kind of pair (:func:`validation.transfer.kind_of_pair`): of the pairs of cases of a
    target whose measured step times differ by more than 10%
    (:func:`validation.training_validation.ranking`), how many the source's simulation orders as
    measured. Columns ``pairs, compared, agreeing``."""
    kinds = [kind_of_pair(source, target) for source, target in zip(ranking["calibrated_on"], ranking["cluster"])]
    grouped = ranking.assign(pairs=kinds).groupby("pairs", sort=True)["right"]
    table = pd.DataFrame({"compared": grouped.size(), "agreeing": grouped.sum().astype(int)})
    return table.reindex([kind for kind in PAIR_KINDS if kind in table.index]).rename_axis("pairs").reset_index()


def pool_lines(clusters: list[str]) -> list[str]:
    """What the leave-one-out pool holds with these clusters, and how it prices each term
    (:data:`POOLED_TERMS`), as markdown lines."""
    size = len(clusters) - 1
    if size == 0:
        return ["No pooled profile: the matrix has one cluster."]
    if size == 1:
        held = ("With two clusters, the pooled profile of a target is the other cluster's alone: `pooled` is "
                "`other` (a pool prices as below from three clusters' calibrations on the full matrix).")
    else:
        held = f"The pooled profile of a target holds the calibrations of the {size} other clusters of the matrix."
    lines = [held, "", "A pooled profile is what the simulator makes of the calibrations' rows together, term by term:",
             ""]
    lines += [f"- {term}: **{verdict}**: {how}" for term, verdict, how in POOLED_TERMS]
    return lines


def summary_markdown(cases: pd.DataFrame, ranking: pd.DataFrame, name: str, command: str) -> str:
    """The transfer's summary.md: how it was made, the overall figures of step time and peak
    memory per kind of pair, the ranking, the terms behind the cases off by more than
    :data:`validation.transfer.TERM_THRESHOLD`, the source x target tables and what the pool is."""
    headline = [str(m) for m in HEADLINE]
    lines = [f"# Calibration transfer: training matrix {name}", "",
             f"Regenerate: `{command}`.", "",
             "Signed error = simulated / measured - 1, of every case's step time and peak memory (per device). "
             "Pairs: `same` = a cluster with its own profile (replay); `other` = another cluster's profile "
             "(prediction, true transfer); `pooled` = the profiles of all clusters but the target (prediction); "
             "`none` = no profile (the uncalibrated models).", "",
             *overall_lines(overall_table(cases, metrics=headline, both=False).drop(columns="scope"))]
    lines += ["", "Ranking: of the pairs of cases of a target whose measured step times differ by more than 10%, "
              "those the source's simulation orders as measured:", ""]
    lines += [f"- {row.pairs}: {row.agreeing} of {row.compared}" for row in ranking_by_pairs(ranking).itertuples()]
    lines += ["", f"The part behind every case off by more than {TERM_THRESHOLD:.0%} (`term` and `term_contribution` "
              "in `errors.csv`): of the parts measured beside it (a step's phases, `other` the rest of the measured "
              "step; a peak's memory categories), the one contributing most in the error's direction. Per kind of "
              "pair:", "", *behind_lines(cases[cases["metric"].isin(headline)])]
    for metric in headline:
        lines += ["", *matrix_lines(cases[cases["metric"] == metric], f"of {metric}")]
    lines += ["", *pool_lines(list(dict.fromkeys(cases["target"])))]
    return "\n".join(lines) + "\n"


def write_training_transfer(errors: pd.DataFrame, ranking: pd.DataFrame, out_dir: Path, name: str,
                            command: str) -> list[Path]:
    """Write ``errors.csv`` (the case table, :func:`transfer_cases`), ``transfer.csv`` (per
    source, target and metric of :data:`TRANSFER_METRICS`), ``overall.csv``, ``summary.md`` and
    ``report.html`` (the source x target heat maps of step time and peak memory) under
    ``out_dir`` from a training validation's ``errors`` and ``ranking`` tables made with the
    transfer's sources; returns the paths.

    Raises:
        ValueError: ``errors`` without the pooled or uncalibrated sources (made without transfer).
    """
    from sim.outputs import write_files
    from validation.present.transfer_report import training_transfer_html

    if not {POOLED, NO_PROFILE} & set(errors["calibrated_on"]):
        raise ValueError("the training errors hold no pooled or uncalibrated source: compare_clusters(transfer=True)")
    cases = transfer_cases(errors)
    headline = [str(m) for m in HEADLINE]
    return write_files(out_dir, {
        "errors.csv": cases.to_csv(index=False, lineterminator="\n"),
        "transfer.csv": transfer_table(cases).to_csv(index=False, lineterminator="\n"),
        "overall.csv": overall_table(cases, metrics=headline, both=False).to_csv(index=False, lineterminator="\n"),
        "summary.md": summary_markdown(cases, ranking, name, command),
        "report.html": training_transfer_html(cases[cases["metric"].isin(headline)], pool_lines(
            list(dict.fromkeys(cases["target"])))),
    })
