"""Where a step's time goes, simulated and measured: the terms of the model behind an error.

A TTFT or TPOT error says that the simulator is off, not where. Both traces share one schema
(:mod:`sim.trace`), so a step of either splits the same way. The split is the master rank's (the
lowest rank of the trace): its steps are the steps that TTFT and TPOT time, and the other ranks
start a decode step as soon as they are done with the last one, so their own time does not fit
the master's step boundaries. The master's step is:

* ``compute:<kind>``: its compute ops, per op kind (priced from the profile's ``compute`` rows);
* ``collective:<kind>``: its collective calls from the last rank's arrival to its own end
  (priced from ``collective_in_place`` / ``collective`` rows: the same charge);
* ``wait``: inside collective calls, waiting for the last rank to arrive (skew between ranks: a
  rank with more work, a core shared with another rank, a broadcast's leaves still receiving
  after its root left; priced from ``collective_wait`` rows, which a simulated trace shows as the
  other ranks arriving late);
* ``other``: the rest, between ops (the framework's gaps, priced by ``op_gap``).

The simulator charges the gap inside each op (:class:`sim.calibrated.CalibratedCompute`,
:class:`sim.calibrated.CalibratedNetwork`), where a measured trace shows it between ops, so a
simulated trace's gaps are moved to ``other``.

The split answers for the error it explains: each phase's terms add up to the metric the error
tables compare (TTFT for the prefill, TPOT for decode), the simulated run's on one side and the
measured median over the timed repeats on the other. A measured term is its median over every
timed repeat's trace (:attr:`runtime.measure.MeasuredVariant.rounds`; the last repeat's alone
where the rounds were not kept), and ``other`` is what the metric leaves beyond the named terms
(on the simulated side too: the decode steps it interpolates between the traced ones). Each
term's ``contribution`` is ``(simulated - measured) / measured metric``, so a case's
contributions add up to its signed error exactly, and :func:`term_behind` names the term that
carries most of it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.trace import COLLECTIVE_KINDS
from sim.vocabulary import Metric, PhaseKind

TERM_COLUMNS = ["scenario", "prompt_tokens", "variant", "phase", "term", "simulated_s", "measured_s", "contribution"]
PHASE_METRIC = {PhaseKind.PREFILL: Metric.TTFT, PhaseKind.DECODE: Metric.TPOT}


def step_terms(ops: pd.DataFrame, steps: pd.DataFrame, gap_s: float = 0.0) -> pd.DataFrame:
    """Seconds per step of the master rank in each term (see the module docstring), per phase,
    averaged over the steps that ``ops`` holds, ``other`` the rest of their mean duration.

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
    # Row by row over plain arrays: a split runs per case and source in the transfer report, and
    # pandas' per-call overhead was most of its cost. The wait and call split is master_calls'.
    kind, phase, name = (ops[c].astype(str).to_numpy() for c in ("kind", "phase", "name"))
    rank, step, layer = (ops[c].to_numpy() for c in ("rank", "step", "layer"))
    start, end = ops["start_s"].to_numpy(dtype=float), ops["end_s"].to_numpy(dtype=float)
    is_call = np.isin(kind, list(COLLECTIVE_KINDS))
    last_start: dict[tuple, float] = {}
    for i in np.flatnonzero(is_call):
        key = (step[i], layer[i], name[i])
        last_start[key] = max(last_start.get(key, -np.inf), start[i])
    master = rank.min()
    sums: dict[str, dict[str, float]] = {}
    steps_of: dict[str, set] = {}
    for i in np.flatnonzero(rank == master):
        terms = sums.setdefault(phase[i], {})
        steps_of.setdefault(phase[i], set()).add(step[i])
        if is_call[i]:
            wait = max(0.0, min(end[i], last_start[(step[i], layer[i], name[i])]) - start[i])
            items = ((f"collective:{kind[i]}", max(0.0, end[i] - start[i] - wait - gap_s)), ("wait", wait))
        else:
            items = ((f"compute:{kind[i]}", max(0.0, end[i] - start[i] - gap_s)),)
        for term, seconds in items:
            terms[term] = terms.get(term, 0.0) + seconds
    duration = steps.set_index("step")["end_s"] - steps.set_index("step")["start_s"]
    rows = []
    for phase_name, terms in sums.items():
        count = len(steps_of[phase_name])
        rows += [{"phase": phase_name, "term": t, "seconds": terms[t] / count} for t in sorted(terms)]
        step_s = float(duration.reindex(sorted(steps_of[phase_name])).mean())
        rows.append({"phase": phase_name, "term": "other", "seconds": step_s - sum(terms.values()) / count})
    return pd.DataFrame(rows)


def named_terms(traces, gap_s: float = 0.0) -> pd.DataFrame:
    """Per phase and named term (every term of :func:`step_terms` but ``other``), the median over
    ``traces`` (each with ``ops`` and ``steps`` tables: the repeats of one case) of its seconds per
    step; a term missing from a trace counts 0 there. Columns ``phase, term, seconds``."""
    splits = [step_terms(t.ops, t.steps, gap_s).set_index(["phase", "term"])["seconds"] for t in traces]
    table = pd.concat(splits, axis=1).fillna(0.0) if splits else pd.DataFrame()
    if table.empty:
        return pd.DataFrame(columns=["phase", "term", "seconds"])
    table = table[table.index.get_level_values("term") != "other"]
    return table.median(axis=1).rename("seconds").reset_index()


def metric_terms(traces, phase_s: dict, gap_s: float = 0.0) -> pd.Series:
    """The split of each phase's metric: :func:`named_terms` over ``traces``, and ``other``, the
    rest of ``phase_s[phase]`` (s: the metric the error compares, TTFT or TPOT), for every phase
    in both. Indexed by (phase, term), seconds; per phase the terms add up to ``phase_s[phase]``."""
    named = named_terms(traces, gap_s)
    rows = []
    for phase, of_phase in named.groupby("phase", sort=False):
        if phase not in phase_s:
            continue
        rows += [(phase, row.term, float(row.seconds)) for row in of_phase.itertuples(index=False)]
        rows.append((phase, "other", float(phase_s[phase]) - float(of_phase["seconds"].sum())))
    return pd.DataFrame(rows, columns=["phase", "term", "seconds"]).set_index(["phase", "term"])["seconds"]


def phase_metrics(timing: dict) -> dict:
    """Per phase, the metric its terms add up to (s), from a run's timing metrics."""
    return {phase: float(timing[metric]) for phase, metric in PHASE_METRIC.items() if metric in timing}


def term_errors(scenario: str, prompt_tokens: int, simulated, measured, gap_s: float = 0.0) -> pd.DataFrame:
    """Per variant, phase and term: simulated and measured seconds per step and the term's
    contribution to the metric's error (see the module docstring).

    Args:
        simulated: a :class:`sim.simulate.SimulationResult`; measured: a
            :class:`runtime.measure.MeasuredResult`, variants in the same order (each measured
            variant's repeats from ``rounds`` where kept, else its last repeat's ``trace``).
        gap_s: the gap the simulator charged inside each op (see :func:`step_terms`).
    """
    frames = []
    for sim_variant, meas_variant in zip(simulated.variants, measured.variants):
        measured_s = phase_metrics(meas_variant.timing)
        sim = metric_terms([sim_variant.trace], phase_metrics(sim_variant.timing), gap_s)
        meas = metric_terms(getattr(meas_variant, "rounds", ()) or [meas_variant.trace], measured_s)
        both = pd.DataFrame({"simulated_s": sim, "measured_s": meas}).fillna(0.0)
        both = both[both.index.get_level_values("phase").isin(meas.index.get_level_values("phase"))]
        metric = pd.Series([measured_s[p] for p in both.index.get_level_values("phase")], index=both.index)
        frames.append(both.assign(contribution=(both["simulated_s"] - both["measured_s"]) / metric,
                                  scenario=scenario, prompt_tokens=prompt_tokens, variant=meas_variant.name)
                      .reset_index())
    return (pd.concat(frames, ignore_index=True)[TERM_COLUMNS] if frames
            else pd.DataFrame(columns=TERM_COLUMNS))


def profile_gap_s(profile, device_class: str) -> float:
    """The framework gap (s) a profile charges inside each op on ``device_class``, as
    :class:`sim.calibrated.CalibratedCompute` does (the last ``op_gap`` row of the class: one per
    calibrated cluster in a pool); 0 without a profile or a row."""
    from sim.profile import CHARGED
    from sim.profile import MeasurementKind

    if profile is None:
        return 0.0
    rows = profile.of(MeasurementKind.OP_GAP)
    rows = rows[rows["device_class"] == device_class]
    return float(rows[CHARGED[MeasurementKind.OP_GAP]].iloc[-1]) if len(rows) else 0.0


def term_behind(terms: pd.DataFrame, error: float) -> pd.Series:
    """The term behind a case's ``error``: of its terms (rows of :data:`TERM_COLUMNS`, one
    phase), the one contributing most in the error's direction (the largest by magnitude where
    none does)."""
    signed = terms["contribution"] * (1.0 if error >= 0 else -1.0)
    return terms.loc[signed.idxmax() if (signed > 0).any() else terms["contribution"].abs().idxmax()]


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
