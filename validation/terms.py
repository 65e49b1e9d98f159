"""Where a step's time goes, simulated and measured: the terms of the model behind an error.

A TTFT or TPOT error says that the simulator is off, not where. Both traces share one schema
(:mod:`sim.trace`), so a step of either splits the same way, per rank: the time spent in each
compute op kind (``compute:<kind>``, priced by the compute model from the profile's ``compute``
rows), in each collective kind (``collective:<kind>``, the rank's own span, its wait for the
last rank included, priced from ``collective_in_place`` / ``collective`` rows), and the rest
(``other``: the framework's gaps between ops, priced by ``op_gap``, and idle time). The terms of
one rank add up to the step; averaged over the ranks they still do. The simulator charges the
gap inside each op (:class:`sim.calibrated.CalibratedCompute`, :class:`sim.calibrated.CalibratedNetwork`),
where a measured trace shows it between ops, so a simulated trace's gaps are moved to ``other``.

Each term's ``contribution`` is ``(simulated - measured) / measured step``: the contributions of a
case add up to the step's signed error on the two traces compared (the trace's repeat, not the
median over repeats that the error tables report), so the term with the largest contribution is
the one to look at.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from models.ops import OpKind

TERM_COLUMNS = ["scenario", "prompt_tokens", "variant", "phase", "term", "simulated_s", "measured_s", "contribution"]
PHASE_METRIC = {"prefill": "ttft_s", "decode": "tpot_s"}
_COLLECTIVES = {str(kind) for kind in OpKind if kind.is_communication}


def step_terms(ops: pd.DataFrame, steps: pd.DataFrame, gap_s: float = 0.0) -> pd.DataFrame:
    """Seconds per step in each term, per phase, averaged over the ranks and the steps that
    ``ops`` holds.

    Args:
        ops, steps: a trace's op and step tables (:data:`sim.trace.OP_COLUMNS`,
            :data:`sim.trace.STEP_COLUMNS`); only steps with op rows are split.
        gap_s: the framework gap each op of the trace carries inside its span (a simulated
            trace: the profile's ``op_gap``), in seconds; moved from the op's term to ``other``.

    Returns:
        Columns ``phase, term, seconds``; per phase the seconds add up to the mean step time.
        Weight loads run on the loader's stream beside the compute and are left out (a decode
        step that waits for them shows the wait in ``other``).
    """
    ops = ops[ops["kind"] != str(OpKind.WEIGHT_LOAD)]
    if ops.empty:
        return pd.DataFrame(columns=["phase", "term", "seconds"])
    term = np.where(ops["kind"].isin(_COLLECTIVES), "collective:", "compute:") + ops["kind"].astype(str)
    busy = (ops.assign(term=term, seconds=ops["end_s"] - ops["start_s"] - gap_s)
            .groupby(["phase", "step", "rank", "term"], sort=False)["seconds"].sum())
    duration = steps.set_index("step")["end_s"] - steps.set_index("step")["start_s"]
    rows = []
    for phase, per_phase in busy.groupby(level="phase", sort=False):
        step_ids = per_phase.index.get_level_values("step").unique()
        ranks = per_phase.index.get_level_values("rank").unique()
        count = len(step_ids) * len(ranks)
        terms = per_phase.groupby(level="term", sort=True).sum() / count
        step_s = float(duration.reindex(step_ids).mean())
        rows += [{"phase": phase, "term": t, "seconds": float(s)} for t, s in terms.items()]
        rows.append({"phase": phase, "term": "other", "seconds": step_s - float(terms.sum())})
    return pd.DataFrame(rows)


def term_errors(scenario: str, prompt_tokens: int, simulated, measured, gap_s: float = 0.0) -> pd.DataFrame:
    """Per variant, phase and term: simulated and measured seconds per step and the term's
    contribution to the step's error (see the module docstring).

    Args:
        simulated: a :class:`sim.simulate.SimulationResult`; measured: a
            :class:`runtime.measure.MeasuredResult`, variants in the same order.
        gap_s: the gap the simulator charged inside each op (see :func:`step_terms`).
    """
    frames = []
    for sim_variant, meas_variant in zip(simulated.variants, measured.variants):
        sim = step_terms(sim_variant.trace.ops, sim_variant.trace.steps, gap_s).set_index(["phase", "term"])["seconds"]
        meas = step_terms(meas_variant.trace.ops, meas_variant.trace.steps).set_index(["phase", "term"])["seconds"]
        both = pd.DataFrame({"simulated_s": sim, "measured_s": meas}).fillna(0.0)
        both = both[both.index.get_level_values("phase").isin(meas.index.get_level_values("phase"))]
        step = both.groupby(level="phase")["measured_s"].transform("sum")
        frames.append(both.assign(contribution=(both["simulated_s"] - both["measured_s"]) / step,
                                  scenario=scenario, prompt_tokens=prompt_tokens, variant=meas_variant.name)
                      .reset_index())
    return (pd.concat(frames, ignore_index=True)[TERM_COLUMNS] if frames
            else pd.DataFrame(columns=TERM_COLUMNS))


def term_summary(terms: pd.DataFrame) -> pd.DataFrame:
    """Per phase and term over the cases: the median share of the measured step, the median
    and p90 of |contribution| and the median signed contribution. Columns ``phase, term, cases,
    share, median_abs_contribution, p90_abs_contribution, median_contribution``."""
    columns = ["phase", "term", "cases", "share", "median_abs_contribution", "p90_abs_contribution",
               "median_contribution"]
    if terms.empty:
        return pd.DataFrame(columns=columns)
    step = terms.groupby(["scenario", "prompt_tokens", "variant", "phase"])["measured_s"].transform("sum")
    grouped = terms.assign(share=terms["measured_s"] / step, magnitude=terms["contribution"].abs()).groupby(
        ["phase", "term"], sort=True)
    return pd.DataFrame({
        "cases": grouped.size(), "share": grouped["share"].median(),
        "median_abs_contribution": grouped["magnitude"].median(),
        "p90_abs_contribution": grouped["magnitude"].quantile(0.9),
        "median_contribution": grouped["contribution"].median(),
    }).reset_index()[columns]
