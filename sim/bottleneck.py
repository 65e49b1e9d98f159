"""What bounds a step: the term that takes most of the master rank's time in one forward pass.

The master rank (rank 0 of the group) is the one whose steps TTFT and TPOT time. Its ops in the
step are summed by term: compute ops bound by arithmetic (``compute``) or by memory traffic
(``memory bandwidth``), whichever side of the roofline prices them (Williams, Waterman, Patterson,
CACM 2009; :mod:`sim.cost`, with the scenario's efficiencies); each collective kind
(``allreduce``, ``broadcast``, ``reduce``: the master's time in it, waits included); and the wait
for streamed weights (``loader``: the step's loader stall).
"""

from __future__ import annotations

import numpy as np

from models.ops import OpKind
from sim.simulate import SimulationResult, VariantResult
from sim.vocabulary import Metric

_COLLECTIVES = {OpKind.ALLREDUCE.value, OpKind.REDUCE.value, OpKind.BROADCAST.value}


def bottleneck(result: SimulationResult, vr: VariantResult, step: int) -> str:
    """The term taking most of the master rank's step ``step`` (0: prefill, 1: first decode step)
    of variant ``vr``, with its share: ``memory bandwidth (72% of the decode step)``; '' when the
    trace does not hold that step's ops (see ``expand_steps`` of :func:`sim.simulate.simulate`).
    """
    master = result.ranks[0]
    ops = vr.trace.ops
    ops = ops[(ops["rank"] == master) & (ops["step"] == step)]
    if ops.empty:
        return ""
    device = result.topology.devices[master].spec
    settings = result.scenario.config.compute
    peak = device.peak_flops(result.scenario.model.dtype) * settings.flops_efficiency
    bandwidth = device.memory_bandwidth_bytes_per_s * settings.memory_efficiency
    duration = ops["end_s"] - ops["start_s"]
    kinds = ops["kind"]
    term = np.where(kinds.isin(_COLLECTIVES), kinds,
                    np.where(kinds == OpKind.WEIGHT_LOAD.value, "loader",
                             np.where(ops["flops"] / peak >= ops["bytes"] / bandwidth, "compute", "memory bandwidth")))
    totals = duration.groupby(term).sum()
    stall = vr.timing[Metric.LOADER_STALL_DECODE if step else Metric.LOADER_STALL_PREFILL]
    totals = totals.drop("loader", errors="ignore")
    if stall > 0:
        totals["loader"] = stall
    steps = vr.trace.steps
    span = float((steps["end_s"] - steps["start_s"])[steps["step"] == step].iloc[0])
    name = totals.idxmax()
    return f"{name} ({100 * totals[name] / span:.0f}% of the {'decode step' if step else 'prefill'})"
