"""The machine's speed when it measured against when it calibrated: a diagnosis of a testbed check.

A shared virtual machine's pace moves by 20-30% between stretches minutes to hours apart, with
nothing else running and no steal (issue 18: the replicas plan check's one-rank candidate measured
TPOT 92.0 ms at 08:55 against 71.9 predicted from a profile of the day before, 88.0 predicted from
one calibrated at 09:10). To tell that stretch from the model's error, ``hetsim calibrate`` and
the measurement harnesses time a fixed reference op set (:class:`ReferenceOp`, timed by
:mod:`runtime.reference_timing`) around their launches; the calibration's timing is kept in the
profile (:class:`sim.context.ContextTerm` ``speed``), the measurement's beside its CPU steal and
load. :func:`slowdown` sets the two against each other, and :func:`rescaled_profile` scales the
profile's compute by it, so a report can show, next to the raw error, the error the simulator
would have made on a machine as fast as the measurement's. That uses a timing made while
measuring: it is a diagnosis of where an error comes from, never a prediction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum

from sim.profile import Profile
from sim.vocabulary import MeasurementKind


class ReferenceOp(StrEnum):
    """An op of the reference set (:mod:`runtime.reference_timing` says what each computes)."""

    MATMUL = "matmul"  # compute-bound: a GPT-2 small MLP-up matmul over a 128-token prompt, batch 1
    STREAM = "stream"  # memory-bound: a matvec over fp32 weights far beyond the L3 cache


# The profile rows whose times are the machine's CPU work, scaled by rescaled_profile: compute ops
# timed in place and alone, and the framework's dispatch between ops (CPU work too). Collectives
# and point-to-point rows are the links' and the backend's, and are left as measured.
RESCALED_KINDS = (MeasurementKind.COMPUTE, MeasurementKind.COMPUTE_ISOLATED, MeasurementKind.OP_GAP)
_TIME_COLUMNS = ("median", "p10", "p90", "mean")


def slowdown(calibrated_s: Mapping[str, float], measured_s: Mapping[str, float]) -> float:
    """How many times slower the machine ran the reference op set when it measured than when it
    calibrated: the geometric mean, over the ops both timed, of measured / calibrated median time
    (above 1: slower while measuring). The geometric mean, so that one op twice as slow and another
    twice as fast make 1 (Fleming and Wallace, "How not to lie with statistics: the correct way to
    summarize benchmark results", CACM 29(3), 1986). NaN where they share no op (a profile written
    before the reference was recorded) or a time is not positive."""
    ratios = [measured_s[op] / calibrated_s[op] for op in sorted(set(calibrated_s) & set(measured_s))
              if calibrated_s[op] > 0 and measured_s[op] > 0]
    if not ratios:
        return math.nan
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def rescaled_profile(profile: Profile, factor: float) -> Profile:
    """``profile`` with the times of its :data:`RESCALED_KINDS` rows (median, p10, p90, mean)
    multiplied by ``factor``: the profile of a machine ``factor`` times as slow at compute.

    Raises:
        ValueError: ``factor`` not a positive finite number.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"a compute rescaling factor must be positive and finite (got {factor})")
    rows = profile.rows.copy()
    mask = rows["measurement"].isin([kind.value for kind in RESCALED_KINDS])
    for column in _TIME_COLUMNS:
        rows.loc[mask, column] = rows.loc[mask, column].astype(float) * factor
    return Profile(rows)


def describe(factor: float) -> str:
    """``factor`` (:func:`slowdown`) in words: ``machine x1.22 slower than at calibration``, or
    ``x1.05 faster``, or ``as fast as`` within half a percent (what two decimals cannot tell
    apart); ``machine speed at calibration not recorded`` where it is NaN."""
    if math.isnan(factor):
        return "machine speed at calibration not recorded"
    cell = speed_cell(factor)
    return f"machine {cell} {'as' if cell == 'as fast' else 'than'} at calibration"


def speed_cell(factor: float) -> str:
    """``factor`` (:func:`slowdown`) as a table cell: ``x1.22 slower``, ``x1.05 faster``,
    ``as fast`` (within half a percent), ``-`` where it is NaN."""
    if math.isnan(factor):
        return "-"
    if abs(factor - 1) < 0.005:
        return "as fast"
    return f"x{factor:.2f} slower" if factor > 1 else f"x{1 / factor:.2f} faster"
