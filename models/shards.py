"""Which slice of each decoder layer a tensor-parallel rank holds: query heads, KV heads, MLP columns.

Tensor parallelism splits the attention by heads and the MLP by its intermediate features
(Megatron-LM, arXiv 1909.08053, section 3). Every rank holds every layer's slice, and the collectives
always carry the full hidden size (row-parallel partial sums are full-size on every rank), so only
the compute, the weights and the KV cache of a rank depend on its slice.

**Even** (no weights): ``T`` ranks take ``H / T`` query heads and ``I / T`` MLP columns each; the
degree must divide the heads and the intermediate size, and divide or be a multiple of the KV
heads (:func:`check_tensor_parallel`), the rule of vLLM's ``QKVParallelLinear``
(vllm/model_executor/layers/linear.py), which replicates KV heads when the degree exceeds them.

**Uneven** (a positive weight per rank, e.g. its peak FLOP/s or its memory): each rank's share of
heads and columns follows its weight, and the degree need divide nothing. What is valid, with
``H`` query heads sharing ``K`` KV heads in groups of ``G = H / K`` (grouped-query attention,
Ainslie et al., arXiv 2305.13245):

- A rank's query heads are one contiguous range and it holds the KV heads they read; no rank holds
  parts of two groups, so each of its KV heads serves the same number of its query heads.
- ``T <= K``: whole KV-head groups. The ``K`` groups are apportioned by weight, at least one per
  rank; a rank holds its groups' KV heads and all their query heads, nothing replicated.
- ``T > K``: each rank holds query heads of one group and a replica of that group's KV head, as
  vLLM does when the degree exceeds the KV heads (``num_kv_head_replicas``). The ranks go to the
  groups as contiguous runs of 1 to ``G`` ranks, and each group's ``G`` query heads are
  apportioned by the weights of its ranks, at least one each. The runs are the ones whose ranks'
  query heads per unit of weight, sorted from the most loaded down, are smallest (leximax: first
  the most loaded rank, then the next; so a weak device shares a group with a strong one rather
  than with another weak one); among equals, earlier groups take more ranks. For equal weights
  and a degree that divides, that is the even split. So ``T <= H``.
- MLP columns: ``I`` apportioned by weight, at least one per rank.

Apportionment is by largest remainder (Hamilton's method) with at least one unit each, ties to
the lower rank; with equal weights and a degree that divides, it is the even split exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from models.errors import ConfigError
from models.spec import ModelSpec

_MAX_SEARCH = 100_000  # a few seconds at most (64 ranks over 8 groups of 8 heads: 4,096, 0.05 s)
SHARES_HINT = "set parallel.shares (compute, memory or a weight per device) to split them unevenly"
"""What an even split the degree cannot make suggests. A scenario's layout never meets it for a
single group: :meth:`sim.parallel.ParallelPlan.of` then takes a default basis; a pipeline's
stages (even splits only) and direct callers still do."""


@dataclass(frozen=True)
class TensorShard:
    """One rank's slice of every decoder layer: ``query_heads`` and ``kv_heads`` (head indices of
    the whole model; a KV head may be replicated on several ranks) and ``mlp_columns`` (indices of
    the intermediate features)."""

    query_heads: range
    kv_heads: range
    mlp_columns: range

    def label(self) -> str:
        """``q 0-6 kv 0-0 mlp 0-3455``: the ranges, inclusive, for messages and traces."""
        return " ".join(f"{name} {r.start}-{r.stop - 1}" for name, r in
                        (("q", self.query_heads), ("kv", self.kv_heads), ("mlp", self.mlp_columns)))


def kv_heads_per_rank(spec: ModelSpec, tp_degree: int) -> int:
    """Key-value heads one rank holds under an even tensor parallelism of degree ``tp_degree``.

    ``num_kv_heads / tp_degree`` when that divides; 1 when ``tp_degree`` is a multiple of the KV
    heads, which are then replicated (each rank keeps the one its query heads use, as vLLM does).
    Raises :class:`ConfigError` on ``parallel.tensor`` otherwise, or if ``tp_degree`` < 1.
    """
    _check_degree(tp_degree)
    if spec.num_kv_heads % tp_degree == 0:
        return spec.num_kv_heads // tp_degree
    if tp_degree % spec.num_kv_heads == 0:
        return 1
    raise ConfigError(
        "parallel.tensor",
        f"tensor-parallel degree {tp_degree} and {spec.num_kv_heads} key-value heads: "
        f"neither divides the other; {SHARES_HINT} (got {tp_degree})",
    )


def check_tensor_parallel(spec: ModelSpec, tp_degree: int) -> None:
    """Raise :class:`ConfigError` on ``parallel.tensor`` unless ``tp_degree`` shards ``spec`` evenly.

    It must divide the attention heads and the intermediate size, and be compatible with the KV
    heads (see :func:`kv_heads_per_rank`); the message suggests ``parallel.shares`` otherwise.
    """
    _check_degree(tp_degree)
    for count, what in (
        (spec.num_attention_heads, f"{spec.num_attention_heads} attention heads"),
        (spec.intermediate_size, f"the intermediate size {spec.intermediate_size}"),
    ):
        if count % tp_degree:
            raise ConfigError(
                "parallel.tensor",
                f"tensor-parallel degree {tp_degree} does not divide {what}; {SHARES_HINT} (got {tp_degree})",
            )
    kv_heads_per_rank(spec, tp_degree)


def fits_evenly(spec: ModelSpec, tp_degree: int) -> bool:
    """Whether ``tp_degree`` ranks can split ``spec`` evenly (:func:`check_tensor_parallel` passes);
    where not, only an uneven split (weights per rank) can run the degree."""
    try:
        check_tensor_parallel(spec, tp_degree)
    except ConfigError:
        return False
    return True


def tensor_shards(spec: ModelSpec, tp_degree: int, weights: Sequence[float] | None = None
                  ) -> tuple[TensorShard, ...]:
    """The slice of each of ``tp_degree`` ranks (in group order), by the rules of the module docstring.

    ``weights``: one positive, finite weight per rank (only their ratios matter); None for the
    even split.

    Raises:
        ConfigError: on ``parallel.tensor`` for an even split the degree cannot make
            (:func:`check_tensor_parallel`) or more ranks than query heads; on ``parallel.shares``
            for a weight count other than the degree or a weight that is not positive and finite.
    """
    _check_degree(tp_degree)
    if weights is None:
        check_tensor_parallel(spec, tp_degree)
        weights = (1.0,) * tp_degree
    weights = tuple(weights)
    if len(weights) != tp_degree:
        raise ConfigError("parallel.shares", f"needs one weight per tensor-parallel rank, {tp_degree} "
                                             f"(got {len(weights)})")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w > 0):
            raise ConfigError("parallel.shares", f"every weight must be a positive finite number (got {w!r})")
    heads, kv, group = spec.num_attention_heads, spec.num_kv_heads, spec.num_attention_heads // spec.num_kv_heads
    for count, what in ((heads, f"{heads} attention heads"), (spec.intermediate_size,
                                                             f"{spec.intermediate_size} MLP columns")):
        if tp_degree > count:
            raise ConfigError("parallel.tensor", f"{tp_degree} ranks but only {what}: every rank needs at "
                                                 f"least one (got {tp_degree})")
    if tp_degree <= kv:
        query = [range(g.start * group, g.stop * group) for g in _ranges(apportion(kv, weights))]
    else:
        query = []
        # Equal weights: the most even runs are the search's answer; no need to search.
        runs = apportion(tp_degree, (1.0,) * kv) if len(set(weights)) == 1 else _balanced_runs(weights, kv, group)
        first = 0
        for g, run in enumerate(runs):
            query += [range(g * group + r.start, g * group + r.stop)
                      for r in _ranges(apportion(group, weights[first:first + run]))]
            first += run
    return tuple(TensorShard(q, range(q.start // group, (q.stop - 1) // group + 1), mlp)
                 for q, mlp in zip(query, _ranges(apportion(spec.intermediate_size, weights))))


def apportion(units: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``units`` split in proportion to ``weights`` by largest remainder, at least one each, ties to
    the lower index. Needs ``units >= len(weights) >= 1`` and positive weights (the caller checks)."""
    total = sum(weights)
    quotas = [units * w / total for w in weights]
    counts = [max(1, math.floor(q)) for q in quotas]
    order = sorted(range(len(counts)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:max(0, units - sum(counts))]:
        counts[i] += 1
    while sum(counts) > units:  # the floor of 1 overshot: take from the most over-served rank
        i = min((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: (quotas[i] - counts[i], -i))
        counts[i] -= 1
    return tuple(counts)


def _balanced_runs(weights: Sequence[float], groups: int, group_size: int) -> tuple[int, ...]:
    """Ranks per group (contiguous runs of 1 to ``group_size``, covering every rank) whose ranks'
    query heads per unit of weight, sorted descending, are lexicographically smallest; ties to
    longer runs first. Dynamic programming over (first rank, group), valid because adding the
    same loads to two sorted vectors keeps their order. Past :data:`_MAX_SEARCH` (ranks x groups
    x group size) the runs are as even as the counts allow, earlier groups taking the extra rank,
    so that no input makes this search run for long."""
    ranks = len(weights)
    if ranks * groups * group_size > _MAX_SEARCH:
        return apportion(ranks, (1.0,) * groups)

    def loads(first: int, count: int) -> tuple[float, ...]:
        heads = apportion(group_size, weights[first:first + count])
        return tuple(h / w for h, w in zip(heads, weights[first:first + count]))

    best: dict[tuple[int, int], tuple[tuple[float, ...], tuple[int, ...]]] = {(ranks, groups): ((), ())}
    for g in range(groups - 1, -1, -1):
        left = groups - g - 1  # groups after this one, each needing 1 to group_size ranks
        for first in range(ranks - 1, -1, -1):
            options = []
            for count in range(min(group_size, ranks - first), 0, -1):
                rest = ranks - first - count
                if (first + count, g + 1) in best and left <= rest <= left * group_size:
                    cost, runs = best[first + count, g + 1]
                    merged = tuple(sorted(loads(first, count) + cost, reverse=True))
                    options.append((merged, tuple(-c for c in (count, *runs)), (count, *runs)))
            if options:
                cost, _, runs = min(options)
                best[first, g] = (cost, runs)
    return best[0, 0][1]


def _ranges(counts: Sequence[int]) -> list[range]:
    """Consecutive ranges of the given lengths, from 0."""
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return out


def _check_degree(tp_degree: int) -> None:
    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ConfigError("parallel.tensor", f"tensor-parallel degree must be a positive integer (got {tp_degree!r})")
