"""A serving scenario's variants: requests served by continuous batching, latency percentiles over
requests, throughput, and the highest Poisson request rate meeting the SLO.

Metrics (rows of the tidy result table, :mod:`sim.metrics`), over the requests of one run:
``ttft_s`` and ``tpot_s`` are means, ``ttft_p50_s`` ... ``tpot_p99_s`` percentiles (numpy's
linear interpolation), ``e2e_latency_s`` the mean arrival-to-last-token time;
``output_tokens_per_s`` and ``requests_per_s`` are what the server delivered from the first arrival
to the last token; ``slo_attained_fraction`` the share of requests meeting every objective of the
SLO (goodput's fraction, Zhong et al. 2024, DistServe, arXiv 2401.09670); ``max_request_rate_per_s``
the highest Poisson rate whose SLO percentiles hold (:func:`max_request_rate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from models.accounting import kv_cache_bytes_per_token, rank_weight_bytes
from models.errors import ConfigError
from sim.metrics import result_rows
from sim.parallel import ParallelPlan
from sim.profile import Profile
from sim.scenario import Scenario, Variant
from sim.serving.config import ServingSLO, ServingWorkload
from sim.serving.iteration import IterationCost
from sim.serving.requests import Request, at_rate, workload_requests
from sim.serving.scheduler import ServingRun, serve
from sim.simulate import build_pricing
from sim.topology import Topology, build_topology
from sim.vocabulary import Metric, WorkloadKind

PERCENTILES = (50, 90, 99)
_SEARCH_STEPS = 14  # bisection halvings after bracketing: the rate to within 2^-14 of the bracket
_MAX_DOUBLINGS = 40


@dataclass(frozen=True)
class RateSearch:
    """The highest request rate meeting the SLO: ``rate_per_s`` (0 when even an unloaded server
    misses it), the metrics of the run at that rate, and how many runs the search took."""

    rate_per_s: float
    metrics: dict[str, float]
    runs: int


@dataclass(frozen=True)
class ServingVariantResult:
    """One variant: its run at the workload's rate, the metrics, and the rate search (None without
    an SLO naming TTFT)."""

    variant: Variant
    run: ServingRun
    metrics: dict[str, float]
    search: RateSearch | None


@dataclass(frozen=True)
class ServingResult:
    """Every variant of a serving scenario and the tidy result table."""

    scenario: Scenario
    topology: Topology
    ranks: tuple[int, ...]
    variants: tuple[ServingVariantResult, ...]
    results: pd.DataFrame
    calibrated: bool = False

    def variant_result(self, name: str) -> ServingVariantResult:
        """The result of the variant named ``name``."""
        return next(v for v in self.variants if v.variant.name == name)


def kv_capacity_tokens(scenario: Scenario, topology: Topology, ranks: tuple[int, ...], utilization: float,
                       runtime_memory: dict[int, int] | None = None) -> int:
    """Tokens the KV cache holds: per rank, ``utilization`` x capacity less the weight shard and the
    runtime's own memory, over the rank's KV bytes per token; the smallest over ranks (vLLM sizes
    its cache the same way from ``gpu_memory_utilization``, ``vllm/v1/worker/gpu_worker.py``).

    Raises:
        ConfigError: on ``workload.memory_utilization`` when the weights leave no room for a token.
    """
    model, tp = scenario.model, len(ranks)
    per_token = kv_cache_bytes_per_token(model, tp)
    free = {r: utilization * topology.devices[r].memory_capacity_bytes
            - rank_weight_bytes(model, tp, is_master=r == ranks[0]) - (runtime_memory or {}).get(r, 0) for r in ranks}
    tightest = min(free, key=free.get)
    if free[tightest] < per_token:
        raise ConfigError("workload.memory_utilization",
                          f"{topology.devices[tightest].name}'s weights leave no memory for the KV cache at "
                          f"{utilization:g} of its {topology.devices[tightest].memory_capacity_bytes / 2**30:.1f} GiB "
                          f"(got {utilization:g})")
    return int(free[tightest] // per_token)


def serving_metrics(run: ServingRun, slo: ServingSLO | None) -> dict[str, float]:
    """The metrics of the module docstring for one run (SI units)."""
    served = run.served
    ttft = np.array([s.ttft_s for s in served])
    tpot = np.array([s.tpot_s for s in served if s.request.output_tokens > 1])
    span = max(s.finish_s for s in served) - min(s.request.arrival_s for s in served)
    metrics = {Metric.TTFT: float(ttft.mean()),
               Metric.TPOT: float(tpot.mean()) if tpot.size else math.nan,
               Metric.E2E_LATENCY: float(np.mean([s.e2e_s for s in served]))}
    for q in PERCENTILES:
        metrics[Metric.TTFT.percentile(q)] = float(np.percentile(ttft, q))
        metrics[Metric.TPOT.percentile(q)] = float(np.percentile(tpot, q)) if tpot.size else math.nan
    metrics[Metric.OUTPUT_TOKENS_PER_S] = sum(s.request.output_tokens for s in served) / span
    metrics[Metric.REQUESTS_PER_S] = len(served) / span
    if slo is not None:
        metrics[Metric.SLO_ATTAINED] = float(np.mean([_meets(s.ttft_s, slo.ttft_s) and _meets(s.tpot_s, slo.tpot_s)
                                                      for s in served]))
    return metrics


def _meets(value: float, bound: float | None) -> bool:
    return bound is None or math.isnan(value) or value <= bound


def meets_slo(metrics: dict[str, float], slo: ServingSLO) -> bool:
    """Whether the SLO's percentile of TTFT and of TPOT (those it names) are within bounds."""
    q = slo.percentile
    checks = [(slo.ttft_s, Metric.TTFT), (slo.tpot_s, Metric.TPOT)]
    return all(_meets(metrics[metric.percentile(q)], bound) for bound, metric in checks if bound is not None)


def _slo_metrics(run: ServingRun, slo: ServingSLO) -> dict[str, float]:
    metrics = serving_metrics(run, slo)
    if slo.percentile not in PERCENTILES:
        for metric, values in ((Metric.TTFT, [s.ttft_s for s in run.served]),
                               (Metric.TPOT, [s.tpot_s for s in run.served if s.request.output_tokens > 1])):
            metrics[metric.percentile(slo.percentile)] = float(np.percentile(values, slo.percentile)) \
                if values else math.nan
    return metrics


def max_request_rate(requests: list[Request], run_at, slo: ServingSLO, seed: int) -> RateSearch:
    """The highest Poisson arrival rate (requests/s) at which the SLO's percentiles hold.

    The same request lengths arrive at each rate tried (same ``seed``); rates are bracketed by
    doubling from the rate one unloaded request sets (1 / its end-to-end time), then bisected
    :data:`_SEARCH_STEPS` times. Queueing shows in TTFT only, so the SLO must name ``ttft``.

    Args:
        requests: the workload's requests (their lengths are kept, their arrivals redrawn).
        run_at: ``run_at(requests) -> ServingRun`` serves a list of requests.

    Raises:
        ConfigError: on ``workload.slo.ttft`` when the SLO does not name it.
    """
    if slo.ttft_s is None:
        raise ConfigError("workload.slo.ttft", "the maximum request rate needs a TTFT objective: an overloaded "
                                               "server's queue shows in TTFT only (got tpot alone)")
    runs = 0

    def trial(rate: float) -> tuple[bool, dict[str, float]]:
        nonlocal runs
        runs += 1
        metrics = _slo_metrics(run_at(at_rate(requests, rate, seed)), slo)
        return meets_slo(metrics, slo), metrics

    alone = run_at([Request(0, 0.0, requests[0].prompt_tokens, requests[0].output_tokens)]).served[0].e2e_s
    rate = 1.0 / alone
    ok, metrics = trial(rate)
    best: tuple[float, dict[str, float]] = (rate, metrics) if ok else (0.0, {})
    lo, hi = (rate, None) if ok else (0.0, rate)
    for _ in range(_MAX_DOUBLINGS):
        if hi is not None:
            break
        rate *= 2
        ok, metrics = trial(rate)
        if ok:
            lo, best = rate, (rate, metrics)
        else:
            hi = rate
    if hi is None:
        return RateSearch(best[0], best[1], runs)
    for _ in range(_SEARCH_STEPS):
        mid = (lo + hi) / 2
        ok, metrics = trial(mid)
        if ok:
            lo, best = mid, (mid, metrics)
        else:
            hi = mid
    return RateSearch(best[0], best[1], runs)


def simulate_serving(scenario: Scenario, *, profile: Profile | None = None) -> ServingResult:
    """Serve the workload's requests with every variant of a ``kind: serving`` scenario.

    Raises:
        ConfigError: a scenario of another kind, an inconsistent cluster or layout (as
            :func:`sim.simulate.simulate`), a request that does not fit the KV cache, an SLO
            without TTFT when a rate search is implied.
    """
    config = scenario.config
    if config.workload_kind is not WorkloadKind.SERVING:
        raise ConfigError("workload.kind", f"simulate_serving takes serving workloads (got {config.workload_kind})")
    workload: ServingWorkload = config.workload
    topology = build_topology(config.cluster)
    ranks = ParallelPlan.of(scenario, topology).tensor_ranks
    pricing = build_pricing(scenario, topology, ranks, profile)
    base_dir = scenario.source_path.parent if scenario.source_path else None
    requests = workload_requests(workload, scenario.model, *(() if base_dir is None else (base_dir,)))
    capacity = kv_capacity_tokens(scenario, topology, ranks, workload.memory_utilization, pricing.runtime_memory)
    results, tables = [], []
    for variant in config.variants:
        cost = IterationCost(scenario.model, ranks, variant.choice(), pricing.engine)

        def run_at(batch: list[Request], cost: IterationCost = cost) -> ServingRun:
            return serve(batch, cost, max_batch_tokens=workload.max_batch_tokens, max_num_seqs=workload.max_num_seqs,
                         kv_capacity_tokens=capacity)

        run = run_at(requests)
        metrics = serving_metrics(run, workload.slo)
        search = None
        if workload.slo is not None and workload.slo.ttft_s is not None:
            search = max_request_rate(requests, run_at, workload.slo, workload.seed)
            metrics[Metric.MAX_REQUEST_RATE] = search.rate_per_s
        results.append(ServingVariantResult(variant, run, metrics, search))
        tables.append(result_rows(config.name, variant.name, "simulated", metrics, {}))
    return ServingResult(scenario, topology, ranks, tuple(results), pd.concat(tables, ignore_index=True),
                         calibrated=profile is not None)


def cost_per_million_tokens(price_per_hour: float, output_tokens_per_s: float) -> float:
    """What a million output tokens cost at ``price_per_hour`` (any currency per hour) when the
    configuration delivers ``output_tokens_per_s``: ``price / 3600 / rate x 1e6``."""
    if output_tokens_per_s <= 0:
        return math.inf
    return price_per_hour / 3600.0 / output_tokens_per_s * 1e6
