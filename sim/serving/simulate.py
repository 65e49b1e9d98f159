"""A serving scenario's variants: requests served by continuous batching, latency percentiles over
requests, throughput, and the highest Poisson request rate meeting the SLO.

Metrics (rows of the tidy result table, :mod:`sim.metrics`), over the requests of one run:
``ttft_s`` and ``tpot_s`` are means, ``ttft_p50_s`` ... ``tpot_p99_s`` percentiles (numpy's
linear interpolation), ``e2e_latency_s`` the mean arrival-to-last-token time;
``output_tokens_per_s`` and ``requests_per_s`` are what the server delivered from the first arrival
to the last token; ``slo_attained_fraction`` the share of requests meeting every objective of the
SLO (goodput's fraction, Zhong et al. 2024, DistServe, arXiv 2401.09670); ``max_request_rate_per_s``
the highest Poisson rate whose SLO percentiles hold (:func:`max_request_rate`).

Layouts (:func:`check_serving_layout`): one tensor-parallel group, its heads and MLP columns split
evenly or unevenly (``parallel.shares``), or ``parallel.replicas`` copies of it. Replicas stand
behind a round-robin load balancer (nginx's default, ``ngx_http_upstream_module``: "requests are
distributed between the servers using a weighted round-robin balancing method", all weights
equal): request i goes to replica i mod R, so at an offered rate r each replica serves r / R, and
each runs its own continuous batching in its own memory (:func:`serve_replicas`). The metrics are
over every request of every replica. Replicas whose ranks share one machine's cores (the emulated
cluster, ``cluster.cores``) slow each other only while they compute at once, and they are not in
lockstep: an iteration launched while k replicas are in one (itself included) is priced with k
of them on the cores, each on its share (:func:`sim.replicas.replica_pools`, as the inference
simulator prices its replicas, all R at once) and its collectives' messages contending with the
k replicas' ranks (:meth:`sim.transport._TransportLinks.floor_s`); the replicas' clocks run
together (:func:`sim.serving.scheduler.serve_together`). Exact for a request alone (k = 1) and
for a loaded server whose replicas are all in an iteration (k = R), where the rate search's SLO
percentiles are decided. In between, an iteration keeps the price it started with: another
replica starting one meanwhile slows it in fact (priced too fast), one ending lets it speed up
(priced too slow); each replica starting or ending one meanwhile is worth at most the ratio of
a rank's core share at the two counts, ``min(1, c / (k n)) / min(1, c / ((k + 1) n))`` for
replicas of n ranks on c cores (at most (k + 1) / k), on the iteration's compute, plus the
contention floor of the other replica's messages. Pricing every iteration with all R replicas at
once instead (as the inference simulator does) over-prices a lone request: GPT-2 on 2 x 2 CPU
ranks sharing 2 cores, tensor-parallel 2 x 2 replicas, TTFT 234 against 134 ms, TPOT 126 against
50 ms (calibrated on v2x2_bandwidth; a prediction). A pipeline of tensor-parallel groups (``parallel.pipeline``)
is one server keeping an iteration in flight per stage (:mod:`sim.serving.scheduler`), each stage
holding its layers' weights and KV cache; with ``parallel.replicas``, each replica is such a
pipeline on its own block of devices, behind the same round-robin balancer. Where replicas' hops
between stages cross a link in common (:func:`shared_hops`: two pipelines over the same two
hosts, their activations crossing one NIC), an iteration launched while k replicas are in one
prices each of its hops at once with the same hop of k - 1 other replicas, sharing the links
they cross (:class:`sim.serving.iteration.ServerCost`, as the inference simulator shares the
replicas' hops, :mod:`sim.pipeline_run`), under the same lockstep reading as the cores above:
exact for a lone request (alone on the links) and for a loaded server whose replicas all run at
once; elsewhere hops of different replicas are priced alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from models.errors import ConfigError
from sim.context import shared_calibration
from sim.metrics import result_rows
from sim.parallel import ParallelPlan, rank_needs_bytes
from sim.pipeline import pipeline_stages
from sim.alike import group_shape
from sim.pipeline_run import AlikeGroups
from sim.profile import Profile
from sim.replicas import replica_pools
from sim.scenario import Scenario, Variant
from sim.serving.config import MAX_REQUESTS, ServingSLO, ServingWorkload
from sim.serving.iteration import IterationCost, ServerCost
from sim.serving.requests import Request, at_rate, workload_requests
from sim.serving.scheduler import LateLimit, ServingRun, serve_together
from sim.simulate import build_pricing
from sim.topology import Topology, build_topology
from sim.vocabulary import Calibration, Metric, WorkloadKind

PERCENTILES = (50, 90, 99)
_SEARCH_STEPS = 14  # bisection halvings after bracketing: the rate to within 2^-14 of the bracket
_MAX_DOUBLINGS = 40


@dataclass(frozen=True)
class RateSearch:
    """The highest request rate meeting the SLO: ``rate_per_s`` (0 when even an unloaded server
    misses it), the metrics of the run at that rate, how many runs the search took, the metrics of
    its first run (at the start rate), and the run at that rate (None at rate 0)."""

    rate_per_s: float
    metrics: dict[str, float]
    runs: int
    start_metrics: dict[str, float] = field(default_factory=dict)
    run: ServingRun | None = None


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
    layout: str = ""
    """The layout served (:meth:`sim.parallel.ParallelPlan.label`), and for an uneven split
    what its shares follow (:attr:`sim.parallel.ParallelPlan.shares_note`)."""
    parallel: ParallelPlan | None = None
    """The layout served (:meth:`sim.parallel.ParallelPlan.of`)."""
    network: object = None
    """How a profile priced the collectives (:class:`sim.calibrated.NetworkChoice`; None uncalibrated)."""
    extrapolated: tuple[str, ...] = ()
    """The predictions a profile did not cover (as :attr:`sim.simulate.SimulationResult.extrapolated`)."""

    @property
    def calibrations(self) -> dict[str, Calibration]:
        """How each variant was priced (variant name -> mode): every variant alike, one network
        for all (:func:`sim.context.shared_calibration`)."""
        return shared_calibration((v.variant.name for v in self.variants), self.network)

    @property
    def sources(self) -> tuple[str, ...]:
        """The scenario's terms against the profile's context and where the calibrated prediction's
        terms come from, one line each (:meth:`sim.calibrated.NetworkChoice.lines`); none uncalibrated."""
        return () if self.network is None else self.network.lines()

    def variant_result(self, name: str) -> ServingVariantResult:
        """The result of the variant named ``name``."""
        return next(v for v in self.variants if v.variant.name == name)


def kv_capacity_tokens(scenario: Scenario, topology: Topology, parallel: ParallelPlan, utilization: float,
                       runtime_memory: dict[int, int] | None = None) -> list[int]:
    """Tokens the KV cache of each replica holds: per rank, ``utilization`` x capacity less its
    weights and the runtime's own memory, over the rank's KV bytes per token; the smallest over
    the replica's ranks (vLLM sizes its cache the same way from ``gpu_memory_utilization``,
    ``vllm/v1/worker/gpu_worker.py``). A rank's weights and KV heads are its shard's where the split
    is uneven (:mod:`models.shards`), its stage's layers' in a pipeline
    (:func:`sim.parallel.rank_needs_bytes`).

    Raises:
        ConfigError: on ``workload.memory_utilization`` when the weights leave no room for a token.
    """
    needs = rank_needs_bytes(scenario.model, parallel, (1,) * len(parallel.replica_ranks), 1)
    capacities = []
    for ranks in parallel.replica_ranks:
        # a rank holding no KV cache (a first stage without layers) does not bound the tokens
        tokens = {r: (utilization * topology.devices[r].memory_capacity_bytes - needs[r][0]
                      - (runtime_memory or {}).get(r, 0)) // needs[r][1] for r in ranks if needs[r][1]}
        tightest = min(tokens, key=tokens.get)
        if tokens[tightest] < 1:
            device = topology.devices[tightest]
            raise ConfigError("workload.memory_utilization",
                              f"{device.name}'s weights leave no memory for the KV cache at {utilization:g} of its "
                              f"{device.memory_capacity_bytes / 2**30:.1f} GiB (got {utilization:g})")
        capacities.append(int(tokens[tightest]))
    return capacities


def check_serving_layout(parallel: ParallelPlan) -> None:
    """Whether the serving simulator runs ``parallel`` (see the module docstring).

    Raises:
        ConfigError: on ``variants`` where variants set layouts of their own (a server runs one
            layout).
    """
    if parallel.variant_layouts:
        raise ConfigError("variants", "serving variants with their own parallel layouts is not supported; give the "
                                      "layout in the scenario's parallel section")


def shared_hops(masters: list[tuple[int, ...]], links) -> bool:
    """Whether the hops between the stages of two of these pipelines (each's stage masters, in
    stage order: stage s to s + 1, the last back to the first) cross a link in common
    (:class:`sim.network.Links` routes), so that hops going at once share it."""
    if len(masters) < 2 or len(masters[0]) < 2:
        return False
    seen: dict[int, int] = {}
    for replica, stages in enumerate(masters):
        for s, src in enumerate(stages):
            for channel in links.get(src, stages[(s + 1) % len(stages)]).channels:
                if seen.setdefault(channel, replica) != replica:
                    return True
    return False


@dataclass(frozen=True)
class ReplicaServer:
    """One replica's server: its iteration costs with 1, 2, ... replicas in an iteration at once
    (one: replicas that share nothing; :func:`sim.serving.scheduler.serve_together`) and the
    tokens its KV cache holds."""

    costs: tuple[ServerCost, ...]
    kv_capacity_tokens: int


def serve_replicas(requests: list[Request], servers: list[ReplicaServer], *, max_batch_tokens: int,
                   max_num_seqs: int, late_limit: LateLimit | None = None) -> ServingRun | None:
    """Serve ``requests`` on replicas behind a round-robin balancer (request i on replica i mod R,
    see the module docstring), each by continuous batching, their clocks together
    (:func:`sim.serving.scheduler.serve_together`); the runs together: every request's times (in
    request order), iterations and busy time summed over replicas, each pipeline stage's and link's
    busy time the busiest replica's (what :func:`pipeline_bottleneck` reads), ``max_running`` the sum of the
    replicas' peaks (an upper bound of the requests running at once), ``kv_capacity_tokens`` the
    replicas' total; None where ``late_limit`` stopped the run (:func:`~sim.serving.scheduler.serve_together`).

    Raises:
        ConfigError: as :func:`~sim.serving.scheduler.serve`, for a request that does not fit its
            replica's KV cache.
    """
    runs = serve_together([requests[i::len(servers)] for i in range(len(servers))],
                          [server.costs for server in servers], max_batch_tokens=max_batch_tokens,
                          max_num_seqs=max_num_seqs, kv_capacity_tokens=[s.kv_capacity_tokens for s in servers],
                          late_limit=late_limit)
    if runs is None:
        return None
    if len(servers) == 1:
        return runs[0]
    served = sorted((s for run in runs for s in run.served), key=lambda s: s.request.index)
    return ServingRun(served, sum(r.iterations for r in runs), sum(r.busy_s for r in runs),
                      sum(r.max_running for r in runs), sum(s.kv_capacity_tokens for s in servers),
                      [tokens for r in runs for tokens in r.batch_tokens],
                      stage_busy_s=tuple(map(max, *(r.stage_busy_s for r in runs))),
                      link_busy_s=tuple(map(max, *(r.link_busy_s for r in runs))),
                      decode_batches=[n for r in runs for n in r.decode_batches])


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


def slo_metrics(run: ServingRun, slo: ServingSLO) -> dict[str, float]:
    """:func:`serving_metrics`, with TTFT and TPOT also at the SLO's percentile where it is not one
    of :data:`PERCENTILES`."""
    metrics = serving_metrics(run, slo)
    if slo.percentile not in PERCENTILES:
        for metric, values in ((Metric.TTFT, [s.ttft_s for s in run.served]),
                               (Metric.TPOT, [s.tpot_s for s in run.served if s.request.output_tokens > 1])):
            metrics[metric.percentile(slo.percentile)] = float(np.percentile(values, slo.percentile)) \
                if values else math.nan
    return metrics


def max_request_rate(requests: list[Request], run_at, slo: ServingSLO, seed: int, *,
                     start_rate_per_s: float | None = None, tolerance: float = 0.0,
                     horizon_s: float = 0.0) -> RateSearch:
    """The highest Poisson arrival rate (requests/s) at which the SLO's percentiles hold.

    The same request lengths arrive at each rate tried (same ``seed``); rates are bracketed by
    doubling from ``start_rate_per_s`` (default: the rate one unloaded request sets, 1 / its
    end-to-end time; when the start misses, the bracket is 0 to it), then bisected until the
    bracket's width is at most ``tolerance`` times its lower end (0: always), at most
    :data:`_SEARCH_STEPS` times. The rate returned was simulated and met the SLO; so does the start
    rate iff the rate returned is at least it. Queueing shows in TTFT only, so the SLO must name
    ``ttft``. A rate after the start one is simulated only until its verdict is decided: once so
    many requests are certainly late that the SLO's percentile of TTFT exceeds its objective
    (:func:`late_requests_to_miss`), it misses; its metrics are not kept (only the start's and the
    best's are), so the search's answer is the same as with every run to its end.

    A fixed number of requests understates overload: above the server's capacity the queue grows
    with the time requests keep arriving, so a short run's burst may still meet a TTFT objective
    at any rate. With ``horizon_s``, each rate r serves at least ``r x horizon_s`` requests (the
    lengths repeated, at most :data:`~sim.serving.config.MAX_REQUESTS`): at an offered rate r above
    the capacity c the queue then holds about ``(r - c) x horizon_s`` requests at the end, so the
    longer the horizon, the closer the rate found comes to the long-run one (from above; measured
    in :data:`sim.planning.search.RATE_HORIZON_TTFTS`). The bisection adds up to ``tolerance``.

    Args:
        requests: the workload's requests (their lengths are kept, their arrivals redrawn).
        run_at: ``run_at(requests, late_limit=None) -> ServingRun | None`` serves a list of
            requests (None: stopped by ``late_limit``, :func:`~sim.serving.scheduler.serve_together`).
        start_rate_per_s: the first rate tried (requests/s, > 0).
        tolerance: the bracket's relative width at which the bisection stops (>= 0).
        horizon_s: the least time over which requests arrive at each rate tried (s, >= 0).

    Raises:
        ConfigError: on ``workload.slo.ttft`` when the SLO does not name it.
    """
    if slo.ttft_s is None:
        raise ConfigError("workload.slo.ttft", "the maximum request rate needs a TTFT objective: an overloaded "
                                               "server's queue shows in TTFT only (got tpot alone)")
    runs = 0

    def trial(rate: float, decide_early: bool = True) -> tuple[bool, tuple[float, dict[str, float], ServingRun]]:
        nonlocal runs
        runs += 1
        count = min(MAX_REQUESTS, max(len(requests), math.ceil(rate * horizon_s)))
        limit = LateLimit(slo.ttft_s, late_requests_to_miss(count, slo.percentile)) if decide_early else None
        run = run_at(at_rate(requests, rate, seed, count), late_limit=limit)
        if run is None:
            return False, (rate, {}, None)
        metrics = slo_metrics(run, slo)
        return meets_slo(metrics, slo), (rate, metrics, run)

    if start_rate_per_s is None:
        alone = run_at([Request(0, 0.0, requests[0].prompt_tokens, requests[0].output_tokens)]).served[0].e2e_s
        start_rate_per_s = 1.0 / alone
    rate = start_rate_per_s
    ok, tried = trial(rate, decide_early=False)  # its metrics are reported, missed or met
    start_metrics = tried[1]
    best: tuple[float, dict[str, float], ServingRun | None] = tried if ok else (0.0, {}, None)
    lo, hi = (rate, None) if ok else (0.0, rate)
    for _ in range(_MAX_DOUBLINGS):
        if hi is not None:
            break
        rate *= 2
        ok, tried = trial(rate)
        if ok:
            lo, best = rate, tried
        else:
            hi = rate
    if hi is None:
        return RateSearch(best[0], best[1], runs, start_metrics, best[2])
    for _ in range(_SEARCH_STEPS):
        if tolerance and hi - lo <= tolerance * lo:
            break
        mid = (lo + hi) / 2
        ok, tried = trial(mid)
        if ok:
            lo, best = mid, tried
        else:
            hi = mid
    return RateSearch(best[0], best[1], runs, start_metrics, best[2])


def late_requests_to_miss(count: int, percentile: float) -> int:
    """How many of ``count`` requests taking longer than a TTFT objective make the run miss it at
    ``percentile`` for certain. numpy's linear percentile interpolates between the sorted values
    at ranks ``floor(p)`` and ``floor(p) + 1`` (0-based), ``p = percentile / 100 x (count - 1)``,
    and lies between them: once ``count - floor(p) + 1`` values exceed the objective, those at
    ``floor(p) - 1`` and above do, so the percentile does, whichever way ``p``'s rounding falls."""
    return count - math.floor(percentile / 100 * (count - 1)) + 1


def percentile_floor_key(keys: list[int], percentile: float) -> int:
    """The largest of ``keys`` (one per request, in request order) below which the SLO's percentile
    cannot fall at any rate the search tries: for any per-request quantity at least ``g(key)``, g
    nondecreasing (a TTFT lower bound by prompt length), numpy's linear ``percentile`` of the
    quantity over a rate search's run is at least ``g`` of the key returned.

    A run at any rate serves ``M >= L`` requests (L = ``len(keys)``), request i with the lengths of
    request ``i mod L`` (:func:`sim.serving.requests.at_rate`, :func:`max_request_rate`); write
    ``M = k L + r``, ``k >= 1``, ``0 <= r < L``. numpy's linear percentile lies between the sorted
    values at 0-based ranks ``floor(a (M - 1))`` and the one above (``a = percentile / 100``), so
    it is at least v once at most ``floor(a (M - 1))`` values are below v. With ``c`` of the keys
    below a key K and ``c_r`` of the first r, at most ``k c + c_r`` of the run's requests have a
    key below K, hence a bound below g(K) (the others have at least g(K)). The key K is taken
    when ``k c + c_r <= a (M - 1)`` for every such M; at k = 1 that reads ``c + c_r <= a (L + r - 1)``
    for every r, and each further k adds ``c - a L``, negative once the case r = 0 holds. A
    relative margin of 1e-12 below ``a (M - 1)`` keeps numpy's rounding of that product (relative
    1e-16) from lowering its floor past the counts allowed.
    Keys taken form a prefix of the sorted keys (counts grow with K): bisected over the distinct
    keys; the smallest key is always taken (no key below it)."""
    order = np.asarray(keys)
    distinct = np.unique(order)
    a = percentile / 100
    limits = a * (len(order) + np.arange(len(order)) - 1) * (1 - 1e-12)  # a (L + r - 1), r = 0 .. L - 1

    def taken(key: int) -> bool:
        below = order < key
        prefix = np.concatenate(([0], np.cumsum(below)[:-1]))  # c_r: below among the first r
        return bool(np.all(below.sum() + prefix <= limits))

    lo, hi = 0, len(distinct) - 1  # distinct[lo] is taken
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if taken(int(distinct[mid])) else (lo, mid - 1)
    return int(distinct[lo])


@dataclass(frozen=True)
class RateSearchSettings:
    """How :func:`simulate_serving` searches each variant's maximum rate: from the workload's own
    ``rate_per_s`` (``from_workload_rate``, else from an unloaded request's rate) to a relative
    ``tolerance`` (0: :data:`_SEARCH_STEPS` bisections), requests arriving over at least
    ``horizon_s`` seconds at each rate (:func:`max_request_rate`)."""

    from_workload_rate: bool = False
    tolerance: float = 0.0
    horizon_s: float = 0.0


def simulate_serving(scenario: Scenario, *, profile: Profile | None = None,
                     rate_search: RateSearchSettings = RateSearchSettings()) -> ServingResult:
    """Serve the workload's requests with every variant of a ``kind: serving`` scenario, and search
    each variant's maximum rate as ``rate_search`` says when the SLO names TTFT.

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
    parallel = ParallelPlan.of(scenario, topology)
    check_serving_layout(parallel)
    ranks = parallel.ranks
    pricings = [build_pricing(scenario, topology, ranks, profile, context_group=parallel.replica_ranks[0],
                              layout=parallel.uncalibrated_layout, pipelined=parallel.pipeline > 1)]
    if parallel.replicas > 1 and pricings[0].cores:
        # Replicas sharing a machine's cores: priced with 1, 2, ... of them in an iteration at
        # once, each on its share of the cores and its messages contending with theirs (module docstring).
        pricings += [build_pricing(scenario, topology, ranks, profile, context_group=parallel.replica_ranks[0],
                                   layout=parallel.uncalibrated_layout, copies=busy)
                     for busy in range(2, parallel.replicas + 1)]
        for busy, priced in enumerate(pricings, 1):
            priced.engine.cores = tuple(pool for group in parallel.replica_ranks for pool in
                                        replica_pools(priced.cores, parallel.replica_ranks, group, computing=busy))
    pricing = pricings[0]
    if parallel.pipeline > 1:  # alike stages: their collectives priced once (as sim.simulate.simulate does)
        pricing.engine.pricer = AlikeGroups(pricing.engine.pricer, topology, pricing.engine.links)
    base_dir = scenario.source_path.parent if scenario.source_path else None
    requests = workload_requests(workload, scenario.model, *(() if base_dir is None else (base_dir,)))
    capacities = kv_capacity_tokens(scenario, topology, parallel, workload.memory_utilization, pricing.runtime_memory)
    # Groups laid out alike (sim.alike.group_shape) running the same part of the model with
    # the same shards price every pass alike (replicas; a pipeline's middle stages): they share
    # one group's iteration costs, each pass simulated once.
    if parallel.pipeline > 1:  # each replica a pipeline: its stages' groups
        groups = [tuple(zip(stage_ranks, pipeline_stages(parallel))) for stage_ranks in parallel.replica_stage_ranks]
    else:
        groups = [((ranks, None),) for ranks in parallel.replica_ranks]
    parts = [[(group, (group_shape(topology, pricing.engine.links, group), shards,
                       stage and (stage.num_layers, stage.embeds, stage.heads)), stage) for group, stage in server]
             for server, shards in zip(groups, parallel.replica_shards)]
    masters = [tuple(group[0] for group, _, _ in replica) for replica in parts]
    hops_shared = shared_hops(masters, pricing.engine.links)
    # Iteration costs with 1 .. k replicas in an iteration at once, where they share cores or links.
    levels = parallel.replicas if hops_shared else len(pricings)
    results, tables = [], []
    for variant in config.variants:
        costs: dict[tuple, IterationCost] = {}
        servers = []
        for index, (replica, shards, capacity) in enumerate(zip(parts, parallel.replica_shards, capacities)):
            server = []
            for busy in range(1, levels + 1):
                level = min(busy, len(pricings))
                priced = pricings[level - 1]
                for group, key, stage in replica:
                    if (level, key) not in costs:  # the first group of each shape builds the costs the others share
                        costs[level, key] = IterationCost(scenario.model, group, variant.choice(), priced.engine,
                                                          shards, stage)
                beside = tuple(masters[(index + k) % len(masters)] for k in range(1, busy)) if hops_shared else ()
                server.append(ServerCost(scenario.model, tuple(costs[level, key] for _, key, _ in replica),
                                         masters[index], priced.engine, beside))
            servers.append(ReplicaServer(tuple(server), capacity))

        def run_at(batch: list[Request], servers: list[ReplicaServer] = servers,
                   late_limit: LateLimit | None = None) -> ServingRun | None:
            return serve_replicas(batch, servers, max_batch_tokens=workload.max_batch_tokens,
                                  max_num_seqs=workload.max_num_seqs, late_limit=late_limit)

        run = run_at(requests)
        metrics = serving_metrics(run, workload.slo)
        search = None
        if workload.slo is not None and workload.slo.ttft_s is not None:
            start = workload.rate_per_s if rate_search.from_workload_rate else None
            search = max_request_rate(requests, run_at, workload.slo, workload.seed, start_rate_per_s=start,
                                      tolerance=rate_search.tolerance, horizon_s=rate_search.horizon_s)
            metrics[Metric.MAX_REQUEST_RATE] = search.rate_per_s
        results.append(ServingVariantResult(variant, run, metrics, search))
        tables.append(result_rows(config.name, variant.name, "simulated", metrics, {}))
    extrapolated = tuple(sorted(set().union(*(p.compute.extrapolated | p.network.extrapolated for p in pricings)))) \
        if profile else ()
    layout = ", ".join(filter(None, (parallel.label, parallel.shares_note)))
    return ServingResult(scenario, topology, ranks, tuple(results), pd.concat(tables, ignore_index=True),
                         calibrated=profile is not None, layout=layout, parallel=parallel, network=pricing.choice,
                         extrapolated=extrapolated)


def pipeline_bottleneck(run: ServingRun) -> str:
    """A pipeline's busiest part over ``run``: the stage (its compute) or the link after a stage
    (its messages) busy the longest, with its share of the run's span (first arrival to last
    token), e.g. ``stage 2 of 2, busy 97%`` (with replicas of a pipeline, the busiest replica's,
    :func:`serve_replicas`); '' for a single stage. Under load the busiest part
    sets the rate of iterations (:mod:`sim.serving.scheduler`)."""
    stages = len(run.stage_busy_s)
    if stages < 2:
        return ""
    span = max(s.finish_s for s in run.served) - min(s.request.arrival_s for s in run.served)
    parts = [(busy, f"stage {s + 1} of {stages}") for s, busy in enumerate(run.stage_busy_s)]
    parts += [(busy, f"link from stage {s + 1} to {(s + 1) % stages + 1}") for s, busy in enumerate(run.link_busy_s)]
    busy, name = max(parts, key=lambda part: part[0])  # the first of equals: stages before links
    return f"{name}, busy {100 * busy / span:.0f}%"


def cost_per_million_tokens(price_per_hour: float, output_tokens_per_s: float) -> float:
    """What a million output tokens cost at ``price_per_hour`` (any currency per hour) when the
    configuration delivers ``output_tokens_per_s``: ``price / 3600 / rate x 1e6``."""
    if output_tokens_per_s <= 0:
        return math.inf
    return price_per_hour / 3600.0 / output_tokens_per_s * 1e6
