"""The master's wait for the last rank at a collective whose ranks share oversubscribed cores: an
expected maximum of arrival lags.

Ranks doing equal work on shared cores arrive together in the simulation (processor sharing,
:mod:`sim.cores`), but measured they do not: with ``n`` runnable ranks on ``c`` cores each rank
spends ``1 - c / n`` of a block between two collectives runnable but off a core, and where that
time falls differs from rank to rank and from call to call (the kernel's fair scheduler hands the
cores out in slices and picks the eligible task with the earliest virtual deadline,
``pick_eevdf`` in ``kernel/sched/fair.c``; a rank woken from a collective waits for a core
before it computes, and which rank gets one first changes from call to call: the local traces of
section "branch prefillwait" in ``validation/transfer-report/progress.md``). The last rank to
arrive is the latest of those lags and sets when the call starts; the group's first rank (the
master, whose steps TTFT and TPOT time) waits from its own arrival to it.

Model: each rank ``j``'s arrival lags the fair-share arrival by ``L_j``, independent and uniform
on ``[0, a_j]``, ``a_j = k x (1 - c / n) x min(B_j, T)``, ``B_j`` the rank's block (from its
previous collective's end to its arrival, s), ``T`` a scheduler turn (:data:`TURN_S`: a rank
ahead of a lagging one keeps its core for a turn at most) and ``k`` one coefficient per machine. The master's expected
wait is ``E[max_j L_j] - E[L_0]``, the expected maximum of independent uniforms (order
statistics: H. A. David and H. N. Nagaraja, "Order Statistics", 3rd ed., Wiley 2003, section
2.1: for ``m`` equal ranges ``a`` it is ``a m / (m + 1)``), so the term is deterministic and
grows with the block, with the ranks on the machine and with how far they outnumber its cores.

``k`` is fitted per calibrated machine on what the calibration measures (:func:`fit_lag_per_block`):
the master's wait per call in place (``collective_wait`` rows) against the master's compute per
block (``compute`` rows) in the calibrated prefills, with the calibrated ranks and cores. It is
fitted and applied on prefill blocks only: a decode step's measured wait is already in its
calibrated compute, which processor sharing stretches by about as much (section "branch skew"
of the progress notes: adding it there priced TPOT high).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.cores import SLICE_S, TICK_S
from sim.network import CollectiveTiming
from sim.profile import CHARGED
from sim.vocabulary import MeasurementKind

UNROOTED = frozenset({str(OpKind.ALLREDUCE)})
"""The calls whose wait is the ranks' arrival lag alone: an allreduce has no root, so no rank is
held back by a payload still arriving (a broadcast's leaves wait for it: section "branch
prefillwait", the first layer's wait)."""

TURN_S = SLICE_S + TICK_S / 2
"""The longest a lagging rank waits for a core, on average (s): a rank running ahead of it keeps
its core until the first scheduler tick after its slice (:class:`sim.cores.TakingTurns`; ticks
fall anywhere in the slice's last tick period, so half a tick past the slice on average,
``kernel/sched/fair.c``): a block longer than that lags no more than a turn does."""

DEFAULT_LAG_PER_BLOCK = 6.57
"""The coefficient ``k`` where no calibration of the machine fits one (the uncalibrated model, a
calibration whose rows do not say): the median of :func:`fit_lag_per_block` on the shipped
v2x2_bandwidth and v4x1_bandwidth profiles (7.52 and 5.62; 4 gloo ranks on 2 cores, the clusters
the gloo/tcp contention floor's default is fitted on, :data:`sim.transport.GLOO_CONTENTION_PER_TURN_S`)."""


def off_core_share(ranks: int, free_cores: float) -> float:
    """The share of a block a rank spends runnable but off a core, ``max(0, 1 - c / n)``, with
    ``ranks`` (n) sharing ``free_cores`` (c) fairly (processor sharing, :mod:`sim.cores`)."""
    return max(0.0, 1.0 - free_cores / ranks) if ranks > 0 else 0.0


def expected_lead_s(lag_ranges_s: Sequence[float], first: int = 0) -> float:
    """``E[max_j L_j] - E[L_first]`` (s) for independent ``L_j`` uniform on ``[0, a_j]``,
    ``a_j = lag_ranges_s[j]`` (>= 0): how long rank ``first`` waits, on average, for the last
    arrival. ``E[max] = integral of 1 - prod_j min(1, x / a_j)`` over ``[0, max a]``, exact
    piecewise between the sorted ranges (David and Nagaraja 2003, section 2.1)."""
    ranges = sorted(a for a in lag_ranges_s if a > 0)
    expected_max, below = 0.0, 0.0
    for index, upper in enumerate(ranges):
        open_ranges = ranges[index:]  # the uniforms not yet certain to lie below x on (below, upper]
        power = len(open_ranges)
        expected_max += (upper - below) - (upper ** (power + 1) - below ** (power + 1)) / (
            (power + 1) * float(np.prod(open_ranges)))
        below = upper
    return max(0.0, expected_max - max(0.0, lag_ranges_s[first]) / 2) if ranges else 0.0


def lagging_block_s(block_s: float) -> float:
    """The part of a block (s) over which a rank's arrival lag ranges: the block, at most a turn
    (:data:`TURN_S`)."""
    return min(max(0.0, block_s), TURN_S)


def waited(timing: CollectiveTiming, lag_s: float) -> CollectiveTiming:
    """``timing`` of a call whose last rank arrives ``lag_s`` (s, >= 0) after the simulated last
    arrival: every rank done that much later, the first rank's wait (``wait_s``) that much longer."""
    if lag_s <= 0:
        return timing
    return replace(timing, duration_s=timing.duration_s + lag_s,
                   finish_s={r: t + lag_s for r, t in timing.finish_s.items()}, wait_s=timing.wait_s + lag_s)


def fit_lag_per_block(rows: pd.DataFrame, ranks: int, cores: float) -> float | None:
    """The coefficient ``k`` of the module docstring fitted on one calibrated cluster's profile
    rows (:attr:`sim.profile.Profile.rows`) of ``ranks`` ranks on ``cores`` cores: the median,
    over its prefill phases (``new_tokens`` > 1) and the algorithms of its unrooted calls
    (:data:`UNROOTED`; per algorithm the least of its calls' medians: the first layer's call also
    waits for the embedding broadcast's leaves), of the master's wait per call at the phase's
    size over what ``k = 1`` gives for the phase's block (:func:`sim.concurrency.block_compute_s`). None where the ranks do not
    outnumber the cores or the rows do not say (no in-place waits, no prefill)."""
    from sim.concurrency import block_compute_s

    share = off_core_share(ranks, cores)
    if share <= 0:
        return None
    unit = expected_lead_s([share] * ranks)  # a block of 1 s, k = 1
    waits = rows[(rows["measurement"] == MeasurementKind.COLLECTIVE_WAIT) & rows["op"].isin(list(UNROOTED))]
    if waits.empty:
        return None
    one_token = waits["size_bytes"].min()
    ratios = []
    for new_tokens, block_s in block_compute_s(rows).items():
        if new_tokens <= 1 or not block_s > 0:
            continue
        at_size = waits[waits["size_bytes"] == one_token * new_tokens]
        wait_s = at_size.groupby(["algorithm", "call"])[CHARGED[MeasurementKind.COLLECTIVE_WAIT]].median()
        # per algorithm the least of its calls: the first layer's call also waits for the
        # embedding broadcast's leaves (section "branch prefillwait"), every block's does not
        wait_s = wait_s.groupby(level="algorithm").min()
        ratios.extend(float(w) / (unit * lagging_block_s(block_s)) for w in wait_s)
    return float(np.median(ratios)) if ratios else None
