"""What bounds a step, and where each device's time in it goes.

Every op of a step belongs to one :class:`StepTerm`: compute ops bound by arithmetic
(``compute``) or by memory traffic (``memory bandwidth``), whichever side of the roofline prices
them (Williams, Waterman, Patterson, CACM 2009; :mod:`sim.cost`, with the scenario's
efficiencies); each collective kind (``allreduce``, ``broadcast``, ``reduce``: the rank's time in
it, waits included); the pipeline's point-to-point hops (``send``); and the streamed weights
(``loader``).

:func:`bottleneck` names the term taking most of the master rank's step (the master, rank 0 of
the group, is the one whose steps TTFT and TPOT time). :func:`step_breakdown` splits a step of
every device the layout uses, ``idle`` included, so that its terms add up to the step.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.simulate import SimulationResult, VariantResult
from sim.vocabulary import Metric, PhaseKind


class StepTerm(StrEnum):
    """Where a device's time in a step goes (see the module docstring). ``idle``: nothing runs on
    the device: the pipeline bubble (stages waiting for their micro-batches), or a rank waiting
    for work only another rank does outside a collective."""

    COMPUTE = "compute"
    MEMORY = "memory bandwidth"
    ALLREDUCE = OpKind.ALLREDUCE.value
    REDUCE = OpKind.REDUCE.value
    BROADCAST = OpKind.BROADCAST.value
    SEND = OpKind.SEND.value
    LOADER = "loader"
    IDLE = "idle"


# Where a device runs ops of several terms at once (a hop sent while the next micro-batch
# computes, weights loaded beside the compute), the instant goes to the first of these: a load
# counts only while nothing else runs, which is the stall.
_PRIORITY = (StepTerm.COMPUTE, StepTerm.MEMORY, StepTerm.ALLREDUCE, StepTerm.REDUCE, StepTerm.BROADCAST,
             StepTerm.SEND, StepTerm.LOADER)
_COMMUNICATION = {StepTerm.ALLREDUCE.value, StepTerm.REDUCE.value, StepTerm.BROADCAST.value, StepTerm.SEND.value}


def op_terms(result: SimulationResult, ops: pd.DataFrame) -> np.ndarray:
    """The :class:`StepTerm` value of each row of ``ops`` (a trace's op table), the roofline of
    each op's own device deciding compute against memory bandwidth."""
    settings = result.scenario.config.compute
    dtype = result.scenario.model.dtype
    specs = {rank: result.topology.devices[rank].spec for rank in ops["rank"].unique()}
    peak = ops["rank"].map({r: s.peak_flops(dtype, accumulation=settings.accumulation) * settings.flops_efficiency
                            for r, s in specs.items()})
    bandwidth = ops["rank"].map({r: s.memory_bandwidth_bytes_per_s * settings.memory_efficiency
                                 for r, s in specs.items()})
    kinds = ops["kind"].astype(str)
    compute = np.where(ops["flops"] / peak >= ops["bytes"] / bandwidth, StepTerm.COMPUTE.value, StepTerm.MEMORY.value)
    return np.where(kinds.isin(_COMMUNICATION), kinds,
                    np.where(kinds == OpKind.WEIGHT_LOAD.value, StepTerm.LOADER.value, compute))


def bottleneck(result: SimulationResult, vr: VariantResult, step: int, step_name: str = "") -> str:
    """The term taking most of the master rank's step ``step`` (0: prefill, 1: first decode step)
    of variant ``vr``, with its share: ``memory bandwidth (72% of the decode step)`` (``step_name``
    replaces "the decode step" / "the prefill"); '' when the trace does not hold that step's ops
    (see ``expand_steps`` of :func:`sim.simulate.simulate`). The loader's term is the step's loader
    stall.
    """
    master = result.ranks[0]
    ops = vr.trace.ops
    ops = ops[(ops["rank"] == master) & (ops["step"] == step)]
    if ops.empty:
        return ""
    totals = (ops["end_s"] - ops["start_s"]).groupby(op_terms(result, ops)).sum()
    stall = vr.timing[Metric.LOADER_STALL_DECODE if step else Metric.LOADER_STALL_PREFILL]
    totals = totals.drop(StepTerm.LOADER.value, errors="ignore")
    if stall > 0:
        totals[StepTerm.LOADER.value] = stall
    steps = vr.trace.steps
    span = float((steps["end_s"] - steps["start_s"])[steps["step"] == step].iloc[0])
    name = totals.idxmax()
    return f"{name} ({100 * totals[name] / span:.0f}% of {step_name or ('the decode step' if step else 'the prefill')})"


def step_breakdown(result: SimulationResult, vr: VariantResult, step: int) -> dict[StepTerm, float]:
    """Seconds of step ``step`` (0: the prefill, 1: the first decode step) per :class:`StepTerm`,
    averaged over the devices of ``vr``'s run (with replicas, the one whose TTFT or TPOT the
    variant reports: the slowest); per device the terms, ``idle`` included, add up to the step's
    duration, so their sum is that duration. Empty when the trace does not hold the step's ops.

    Each instant of a device goes to one term (the first of :data:`_PRIORITY` running then;
    ``idle`` when none). The prefill counts what runs between its start and the first token. A
    decode step counts one round of the pipeline's steady state: a pipeline's traced round starts
    before the step (overlapping the step before), and each of its ops is folded into the step
    modulo the step's duration, as every step repeats it (:mod:`sim.pipeline_run`); a
    tensor-parallel step's ops lie inside it and stay as they are.
    """
    metric = Metric.TPOT if step else Metric.TTFT
    trace = max(vr.replicas, key=lambda r: r.timing[metric]).trace if vr.replicas else vr.trace
    ops = trace.ops[trace.ops["step"] == step]
    if ops.empty:
        return {}
    window = trace.steps[trace.steps["step"] == step].iloc[0]
    start, end = float(window["start_s"]), float(window["end_s"])
    duration = end - start
    terms = op_terms(result, ops)
    totals = dict.fromkeys(StepTerm, 0.0)
    ranks = ops["rank"].to_numpy()
    for rank in np.unique(ranks):
        mine = ranks == rank
        a, b = ops["start_s"].to_numpy()[mine], ops["end_s"].to_numpy()[mine]
        if PhaseKind.of_step(step) == PhaseKind.PREFILL:
            a, b, kept = np.clip(a, start, end), np.clip(b, start, end), terms[mine]
        else:
            a, b, kept = _folded(a, b, terms[mine], start, duration)
        claimed = _claimed(a, b, kept)
        for term, seconds in claimed.items():
            totals[term] += seconds
        totals[StepTerm.IDLE] += duration - sum(claimed.values())
    count = len(np.unique(ranks))
    return {term: seconds / count for term, seconds in totals.items() if seconds}


def _folded(a: np.ndarray, b: np.ndarray, terms: np.ndarray, start: float,
            period: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Intervals [a, b] moved into [start, start + period) modulo ``period``, one that wraps
    past the end split in two."""
    a2 = start + np.mod(a - start, period)
    b2 = a2 + (b - a)
    wraps = b2 > start + period
    return (np.concatenate([a2, np.full(wraps.sum(), start)]),
            np.concatenate([np.minimum(b2, start + period), b2[wraps] - period]),
            np.concatenate([terms, terms[wraps]]))


def _claimed(a: np.ndarray, b: np.ndarray, terms: np.ndarray) -> dict[StepTerm, float]:
    """Seconds each term holds of the union of the intervals [a, b] (``terms`` their terms), an
    instant covered by several terms going to the first of :data:`_PRIORITY`."""
    bounds = np.unique(np.concatenate([a, b]))
    if len(bounds) < 2:
        return {}
    lengths = np.diff(bounds)
    taken = np.zeros(len(lengths), dtype=bool)
    claimed = {}
    for term in _PRIORITY:
        mine = terms == term.value
        if not mine.any():
            continue
        cover = np.zeros(len(bounds), dtype=np.int64)
        np.add.at(cover, np.searchsorted(bounds, a[mine]), 1)
        np.add.at(cover, np.searchsorted(bounds, b[mine]), -1)
        held = (np.cumsum(cover)[:-1] > 0) & ~taken
        claimed[term] = float(lengths[held].sum())
        taken |= held
    return claimed
