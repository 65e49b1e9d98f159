"""How many ranks of a calibration computed at once, per calibrated phase, from its profile's rows.

A calibration times every compute op in place, while the group's other ranks run too
(:mod:`sim.profile`); where the ranks outnumber the cores they share, an op's time holds the
ranks that computed beside it (processor sharing, :mod:`sim.cores`). How many did depends on the
phase. Tensor-parallel ranks run the same ops between two collectives, so they compute together
unless the collective before desynchronised them: a broadcast's or a reduce's payload reaches
the ranks one wire time apart, and a prefill's payload is ``prompt`` times a decode step's. The
profile measures that desynchronisation: the master's wait in a collective for the last rank to
arrive (``collective_wait`` rows), whose growth from a decode step's size (one token) to a
prefill's is the spread the larger payload added. A decode step's own wait is the contention
itself (ranks descheduled on shared cores arrive apart) and desynchronises nothing.

Per calibrated generation of ``P`` new tokens (a decode step: 1):

* ``s``: one rank's compute between two collectives: the per-layer compute of the op kinds every
  rank runs (those timed as often as ``attention``, which every rank runs once per layer), over
  the two blocks of a layer each closed by a collective (Megatron-LM's tensor parallelism:
  Shoeybi et al., 2019, section 3);
* ``d``: the spread the payload added: the largest growth, over a strategy's rooted calls
  (reduce, broadcast), of the wait at the phase's size (``P`` times the decode size) over the
  wait at the decode size (0 for a decode step). An allreduce adds none: every rank leaves it
  with the result at once, so it re-synchronises the ranks, and the growth of its wait with the
  payload is the contention of the longer compute before it (ranks descheduled arrive apart),
  as a decode step's wait is. Calls are told apart by plan op, kind and algorithm; a profile
  of several strategies (whose compute rows pool their generations, and charge their median)
  takes the median over its families of calls, one per algorithm and rooted or not (measured:
  the plan check's profile pools allreduce_ln over 4 algorithms with reduce_ln_bcast; counting
  the allreduces' growth as spread, 2.2-2.4 ranks of 4 computed at once in its prefills, and
  pipelines whose stages each computed alone were predicted 50-59% slow in TTFT; every rank at
  once, -12% to -6%, as the single rank of the same check, -10%:
  ``benchmarks/bench_layouts_offline.py``);
* each other rank's segment overlaps a rank's by ``max(0, 1 - d / (2 s))`` (their starts apart
  by half the spread on average), so ``1 + (ranks - 1) x overlap`` ranks compute at once.

Where the profile lacks the rows (no in-place calls, as in a calibration of isolated
collectives alone, or none at a phase's size), every calibrated rank is taken to have computed at
once: the contention of a decode step, and what a calibration without these rows assumed.
"""

from __future__ import annotations

import pandas as pd

from models.ops import OpKind
from sim.profile import CHARGED  # the statistics the simulator charges these rows
from sim.vocabulary import MeasurementKind

EVERY_RANK_KIND = OpKind.ATTENTION  # run once per layer by every rank of a tensor-parallel group
BLOCKS_PER_LAYER = 2  # attention and MLP, each closed by a collective
DESYNCHRONISING = frozenset({str(OpKind.REDUCE), str(OpKind.BROADCAST)})  # rooted: each rank leaves when its part is done


def calibrated_concurrency(rows: pd.DataFrame, ranks: int) -> dict[int, float]:
    """Per calibrated ``new_tokens`` (1: a decode step), how many of the calibration's ``ranks``
    computed at once (1 to ``ranks``), from a profile's ``compute`` and ``collective_wait`` rows
    (see the module docstring); ``ranks`` for every ``new_tokens`` the rows do not let it estimate.

    Args:
        rows: the rows of one calibrated cluster's profile (:attr:`sim.profile.Profile.rows`).
        ranks: the ranks of its calibrated group.
    """
    wait_statistic = CHARGED[MeasurementKind.COLLECTIVE_WAIT]
    compute = rows[rows["measurement"] == MeasurementKind.COMPUTE]
    waits = rows[rows["measurement"] == MeasurementKind.COLLECTIVE_WAIT]
    phases = sorted(int(n) for n in compute["new_tokens"].dropna().unique())
    every = compute[compute["op"] == str(EVERY_RANK_KIND)]
    if waits.empty or every.empty or ranks <= 1:
        return {n: float(ranks) for n in phases}
    blocks = block_compute_s(rows)
    one_token = waits["size_bytes"].min()
    calls = ["algorithm", "call", "op"]
    base = waits[waits["size_bytes"] == one_token].groupby(calls)[wait_statistic].median()
    out = {}
    for new_tokens in phases:
        if new_tokens == 1:
            out[new_tokens] = float(ranks)
            continue
        segment_s = blocks.get(new_tokens, 0.0)
        at_size = waits[waits["size_bytes"] == one_token * new_tokens].groupby(calls)[wait_statistic].median()
        growth = at_size - base.reindex(at_size.index).fillna(0.0)
        kinds = growth.index.get_level_values("op")
        rooted = kinds.isin(list(DESYNCHRONISING))
        growth = growth.where(rooted, 0.0)  # an allreduce leaves no rank ahead of the others
        family = pd.MultiIndex.from_arrays([growth.index.get_level_values("algorithm"), rooted])
        spread_s = growth.groupby(family).max().median() if len(growth) else float("nan")
        if not segment_s > 0 or pd.isna(spread_s):
            out[new_tokens] = float(ranks)
            continue
        overlap = max(0.0, 1.0 - max(0.0, float(spread_s)) / (2 * segment_s))
        out[new_tokens] = 1.0 + (ranks - 1) * overlap
    return out


def block_compute_s(rows: pd.DataFrame) -> dict[int, float]:
    """Per calibrated ``new_tokens``, one rank's compute between two collectives (s, ``s`` of the
    module docstring): the per-layer compute of the op kinds every rank runs, at the charged
    statistic, over :data:`BLOCKS_PER_LAYER`; {} where the rows time no :data:`EVERY_RANK_KIND`.

    Args:
        rows: the rows of one calibrated cluster's profile (:attr:`sim.profile.Profile.rows`).
    """
    statistic = CHARGED[MeasurementKind.COMPUTE]
    compute = rows[rows["measurement"] == MeasurementKind.COMPUTE]
    every = compute[compute["op"] == str(EVERY_RANK_KIND)]
    if every.empty:
        return {}
    per_layer = every["repeats"].max()  # ranks x layers x generations of one shape
    out = {}
    for new_tokens in sorted(int(n) for n in compute["new_tokens"].dropna().unique()):
        shapes = compute[compute["new_tokens"] == new_tokens]
        common = shapes[shapes["repeats"] >= per_layer]
        layer_s = float((common[statistic] * common["repeats"] / per_layer).sum()) / max(
            1, shapes["context_tokens"].nunique())
        out[new_tokens] = layer_s / BLOCKS_PER_LAYER
    return out
