"""The search: every candidate configuration, pruned in closed form, the survivors simulated.

A **candidate** is a model, a cluster shape (device type(s), devices per host, hosts, the host
interconnect and the network from the catalog), a layout of the model on every device of it
(:mod:`sim.planning.layouts`: tensor parallelism, a pipeline, replicas; a device left idle would
be paid for and unused) and a variant (strategy and collective algorithms; a memory policy). Candidates are enumerated as a cartesian product, plus mixed
clusters (two hosts of two device types with as many devices each, when ``search.mixed``). Each
ends at one **stage**, cheapest test first:

1. ``layout``: the simulator refuses the layout (:class:`sim.parallel.ParallelPlan`: the degrees
   cannot shard the model; :func:`sim.replicas.split_batch`: fewer sequences than replicas;
   :func:`sim.scenario.check_pipeline_policy`: streamed weights in a pipeline;
   :func:`sim.serving.simulate.check_serving_layout`: a layout a server does not run), or a
   device lacks the dtype;
2. ``limits``: more devices than ``limits.max_devices`` or a price above ``limits.budget_per_hour``;
3. ``memory``: a lower bound of some rank's peak exceeds its capacity: its framework baseline
   (:mod:`sim.framework`), its weights (a pipeline stage's: its layers'; with a sliding window,
   the resident ones plus w+1 blocks) and the KV cache of the whole run (its stage's layers, its
   replica's sequences), all held at the last step; the simulated peak can only be higher;
4. ``bound``: a lower bound of TTFT or TPOT misses its objective (or an upper bound of decode
   tokens/s): on each rank, the sum of its compute ops priced by the simulator's own roofline
   (:class:`sim.cost.RooflineCompute`), which a step cannot beat since a rank runs its compute ops
   one at a time; TPOT at the shortest context; a pipeline's step also lasts at least one
   micro-batch's pass through every stage, and replicas' latency is the slowest one's
   (:meth:`Planner._bounds`; a serving load's TTFT bound is read at its SLO's percentile, see
   below); with streamed weights, a step also lasts at least each rank's loads
   of the pass, its streamed blocks past the window's first read from the host's storage at no
   more than its bandwidth (:meth:`Planner._loads_s`). Skipped under a calibration profile, whose
   compute may beat the roofline;
5. ``dominated``: not simulated because it can enter neither Pareto frontier nor the top 10: at
   least 10 cheaper clusters already meet every objective, and its bounds are no better
   than the best latency and throughput already simulated at a price no higher (candidates are
   simulated in order of price); a ``sliding_window`` layout is also dominated where every
   resident layout of its cluster fits (streaming only adds loads);
6. ``simulated``: priced by :func:`sim.simulate.simulate`, one scenario per cluster with its
   surviving variants, so they share the topology and the collective pricer.

A **serving** plan (``workload: {kind: serving, ...}``) tries the same layouts (replicas share the
request rate, each serving rate / R behind a round-robin balancer; a pipeline keeps an iteration
in flight per stage, :mod:`sim.serving.scheduler`) and prunes with the same stages, read for a
load of requests: ``memory`` when the KV cache left beside the weights (at the workload's
``memory_utilization``, as :func:`sim.serving.simulate.kv_capacity_tokens` sizes it) cannot hold
the longest request alone, which the serving simulator would refuse; ``bound`` when a lower bound
of TTFT at the SLO's percentile, or a single request's TPOT lower bound (one sequence decoding at
the shortest prompt, on the slowest replica, through every stage of a pipeline), misses its
objective: every decode iteration of a loaded server costs at least that pass.

The TTFT bound (:meth:`Planner._request_ttft_s`) holds for a request of N prompt tokens at any
load: the serving simulator prefills its prompt in chunks of n_c tokens ending at context k_c
(one chunk, or several under the token budget, :mod:`sim.serving.scheduler`), one iteration
each, the next launched after the last is back, and its first token comes out of the last, so
its TTFT is at least the sum of those iterations' times through every stage. An iteration costs
at least its chunk's prefill pass (:meth:`sim.serving.iteration.IterationCost.iteration_s` adds
the decode pass and the other chunks' passes beyond the smallest one, and passes grow with their
tokens and context), and a pass at least each
rank's compute ops priced one after another by the roofline (op overhead included). Per op,
the chunks' FLOPs sum to at least the whole prompt's (each token's causal attention pairs are
counted once; the LM head runs once per pass) and their bytes to at least its own (weights re-read, the KV cache of a longer context),
so the chunks' ``sum max(f_c / peak, b_c / bw)`` is at least the whole prompt's ``max(F / peak,
B / bw)``, and their overheads add. One term breaks this: the simulator interpolates a pass
linearly between chunks of :data:`sim.serving.iteration.CHUNK_STEP`-token grid points, and an
attention op's causal pairs ``n k - n (n - 1) / 2`` are concave in n, so a chunk between grid
points is priced up to ``(n - lo)(hi - n) / 2 <= CHUNK_STEP / 2 x n`` pairs short (the
interpolation over context is exact, attention being linear in it, and rounds up). Over the
chunks that is at most ``CHUNK_STEP / 2 x N`` of the whole prompt's ``N (N + 1) / 2`` pairs: the
bound drops that share, ``CHUNK_STEP / (N + 1)``, of each rank's attention FLOP time. Core
contention, collectives, pipeline hops, queueing and other requests only add. So a request's
TTFT is at least, on the fastest replica it may land on (round robin), the sum over a
pipeline's stages of each stage's busiest rank's compute for the whole prompt at batch 1 less
that share. The SLO's percentile over a run of any rate is bounded by that bound at the prompt
length :func:`sim.serving.simulate.percentile_floor_key` picks (the run's requests repeat the
workload's lengths in order to a count that grows with the rate; numpy's linear percentile),
so a candidate pruned by it misses at every rate, the target's included.

It has no ``dominated`` stage (no closed-form
bound of a maximum rate): every survivor is simulated by :func:`sim.serving.simulate.simulate_serving`,
whose rate search starts at the target rate (``workload.rate_per_s``) and stops at a bracket of
``search.rate_tolerance`` (relative), so a candidate meets the objectives iff its maximum rate is at
least the target (the target itself was simulated and met them). Each rate tried serves the
workload's requests, repeated as needed to keep them arriving for ``search.rate_horizon`` (default
:data:`RATE_HORIZON_TTFTS` x the TTFT objective), so that overload shows.

A **training** plan (``workload: {kind: training, ...}``) searches, on each cluster, data
parallelism over every device with tensor parallelism inside a host, each variant's training
settings (ZeRO, checkpointing), with the same stages read for one optimizer step
(:mod:`sim.planning.training` gives each rule): its memory stage is exact, its bound a roofline
lower bound of the step, and its ``dominated`` stage reads step time for latency and trained
tokens/s for throughput. Survivors are simulated by :func:`sim.training.simulate.simulate_training`.

The result is a tidy table, one row per candidate (:data:`PLAN_COLUMNS`, plus
:data:`SERVING_COLUMNS` in a serving plan, :data:`sim.planning.training.TRAINING_COLUMNS` in a
training plan).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property, lru_cache

import numpy as np
import pandas as pd

from models.accounting import layer_block_weight_bytes
from models.cache_formats import CacheFormat
from models.errors import ConfigError
from models.ops import OpKind
from models.spec import ModelSpec
from models.weight_formats import WeightFormat
from sim.context import profile_context
from sim.cost import RooflineCompute
from sim.devices import DEVICES
from sim.framework import default_runtime_memory
from sim.planning import training
from sim.planning.catalog import Catalog, price_text
from sim.planning.layouts import InferenceLayout, inference_layouts
from sim.planning.plan_config import PlanRequest
from sim.parallel import ParallelPlan, ShareBasis, rank_needs_bytes, workload_share_basis
from sim.pipeline import PipelinePlan, pipeline_stages
from sim.plan import Plan
from sim.program import Stage as ProgramStage
from sim.profile import Profile
from sim.replicas import split_batch
from sim.scenario import MemoryConfig, Variant, check_pipeline_policy, scenario_from_dict
from sim.serving.config import ServingSLO
from sim.serving.iteration import CHUNK_STEP
from sim.serving.simulate import (RateSearchSettings, ServingVariantResult, check_serving_layout,
                                  cost_per_million_tokens, percentile_floor_key, pipeline_bottleneck,
                                  simulate_serving)
from sim.simulate import simulate
from sim.training.metrics import bottleneck
from sim.training.simulate import simulate_training
from sim.strategies import StrategyChoice
from sim.topology import Device
from sim.vocabulary import Metric


class Stage(StrEnum):
    """Where a candidate's evaluation ended (the module docstring gives the order)."""

    LAYOUT = "layout"
    LIMITS = "limits"
    MEMORY = "memory"
    BOUND = "bound"
    DOMINATED = "dominated"
    SIMULATED = "simulated"
    ERROR = "error"


PLAN_COLUMNS = ["candidate", "model", "cluster", "device_types", "num_hosts", "devices_per_host", "num_devices",
                "interconnect", "network", "parallel", "variant", "strategy", "algorithms", "memory_policy", "price_per_hour",
                "stage", "reason", Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.E2E_LATENCY,
                Metric.LOADER_STALL_DECODE, Metric.MAX_PEAK_MEMORY, "fits", "meets_slo", "slo_miss",
                "ttft_lower_bound_s", "tpot_lower_bound_s", "profile_context"]
SLO_TTFT = "ttft_slo_percentile_s"
"""A serving plan's TTFT at the SLO's percentile over requests, at the target rate (s)."""
SLO_TPOT = "tpot_slo_percentile_s"
"""A serving plan's TPOT at the SLO's percentile over requests, at the target rate (s)."""
COST_PER_MILLION_TOKENS = "cost_per_million_tokens"
"""What a million output tokens cost at the maximum rate (catalog currency)."""
DECODE_BATCH = "decode_batch_at_max_rate"
"""A serving plan's mean number of requests one iteration decodes at the maximum rate (per
iteration in flight, per replica; :attr:`sim.serving.scheduler.ServingRun.mean_decode_batch`)."""
SERVING_COLUMNS = [Metric.MAX_REQUEST_RATE, COST_PER_MILLION_TOKENS, Metric.OUTPUT_TOKENS_PER_S, SLO_TTFT, SLO_TPOT,
                   DECODE_BATCH, "rate_search_runs"]
"""A serving plan's columns beyond :data:`PLAN_COLUMNS`: the maximum request rate (requests/s),
$/Mtok, output tokens/s and the decode batch there, the SLO's percentiles at the target rate,
and how many serving runs the rate search took."""
TOP_N = 10
RATE_HORIZON_TTFTS = 40
"""A serving plan's default rate horizon, in TTFT objectives. On the shipped serving plan's top 5
(``benchmarks/bench_plan.py --accuracy``), horizons of 10, 20 and 40 TTFTs put the maximum rates
16-22%, 12-18% and -1.2..+10.8% off a reference search's (200 s horizon, 14 bisections), for
about 19, 19 and 24-26 s of CPU time for the whole plan."""


@dataclass(frozen=True)
class HostGroup:
    """``count`` hosts of ``per_host`` devices of type ``device``, joined by ``interconnect``."""

    device: str
    per_host: int
    count: int
    interconnect: str | None


@dataclass(frozen=True)
class ClusterShape:
    """A cluster to rent or buy: host groups, and the ``network`` between hosts (None: one host)."""

    groups: tuple[HostGroup, ...]
    network: str | None

    @property
    def num_devices(self) -> int:
        return sum(g.per_host * g.count for g in self.groups)

    @property
    def num_hosts(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def device_types(self) -> tuple[str, ...]:
        """The device of each rank in placement order (host group by host group)."""
        return tuple(g.device for g in self.groups for _ in range(g.per_host * g.count))

    def label(self) -> str:
        """``2 x 4 rtx_4090 (pcie4) over eth10g``, ``1 x 4 h100_sxm + 1 x 4 a100_80gb over ...``."""
        parts = [f"{g.count} x {g.per_host} {g.device}" + (f" ({g.interconnect})" if g.interconnect else "")
                 for g in self.groups]
        return " + ".join(parts) + (f" over {self.network}" if self.network else "")

    def price_per_hour(self, catalog: Catalog) -> float:
        """Devices, their hosts, their interconnect and the network ($/h)."""
        price = 0.0
        for g in self.groups:
            devices = g.per_host * g.count
            offer = catalog.devices[g.device]
            price += devices * offer.price_per_hour + g.count * offer.host_price_per_hour
            if g.interconnect:
                price += devices * catalog.interconnects[g.interconnect].price_per_hour_per_device
            if self.network:
                network = catalog.networks[self.network]
                price += g.count * network.price_per_hour_per_host + devices * network.price_per_hour_per_device
        return price

    def cluster(self, catalog: Catalog) -> dict:
        """The scenario's ``cluster`` section (:mod:`sim.cluster_config`)."""
        hosts = []
        network = catalog.networks[self.network] if self.network else None
        for i, g in enumerate(self.groups):
            host: dict = {"name": f"g{i}h{{i}}", "count": g.count,
                          "devices": {"type": g.device, "count": g.per_host}}
            if g.interconnect:
                link = catalog.interconnects[g.interconnect]
                host["interconnect"] = {"bandwidth": link.bandwidth_bytes_per_s, "latency": link.latency_s,
                                        "shared": link.shared}
            if catalog.storage is not None:
                host["storage"] = {"bandwidth": catalog.storage.bandwidth_bytes_per_s,
                                   "latency": catalog.storage.latency_s}
            if network is not None:
                host |= {"parent": "sw", "nic_per_device": network.nic_per_device,
                         "nic": {"bandwidth": network.bandwidth_bytes_per_s, "latency": network.latency_s,
                                 "shared": network.shared}}
            hosts.append(host)
        return {"switches": [{"name": "sw"}] if network is not None else [], "hosts": hosts}


def cluster_shapes(request: PlanRequest) -> list[ClusterShape]:
    """Every cluster of the search space (before any limit), in a fixed order."""
    catalog, space = request.catalog, request.config.search
    types = space.devices or list(catalog.devices)
    networks = space.networks or list(catalog.networks)
    shapes = []

    def links(device: str, per_host: int) -> list[str | None]:
        return [None] if per_host == 1 else list(catalog.devices[device].interconnects)

    for device in types:
        for per_host in space.devices_per_host:
            if per_host > catalog.devices[device].max_per_host:
                continue
            for hosts, link in itertools.product(space.hosts, links(device, per_host)):
                served = [n for n in networks if catalog.networks[n].serves(device)] if hosts > 1 else [None]
                shapes += [ClusterShape((HostGroup(device, per_host, hosts, link),), net) for net in served]
    if space.mixed:
        for first, second in itertools.combinations(types, 2):
            for per_host in space.devices_per_host:
                if per_host > min(catalog.devices[first].max_per_host, catalog.devices[second].max_per_host):
                    continue
                served = [n for n in networks if catalog.networks[n].serves(first) and catalog.networks[n].serves(second)]
                for link_a, link_b, net in itertools.product(links(first, per_host)[:1], links(second, per_host)[:1],
                                                             served):
                    shapes.append(ClusterShape((HostGroup(first, per_host, 1, link_a),
                                                HostGroup(second, per_host, 1, link_b)), net))
    return shapes


@dataclass
class Bounds:
    """Closed-form bounds of one (model, ranks' devices, layout, strategy): lower bounds of TTFT
    (a serving load's: at its SLO's percentile) and TPOT (s), and an upper bound of decode tokens/s."""

    ttft_s: float
    tpot_s: float
    tokens_per_s: float


class Planner:
    """Runs one plan (see the module docstring): :meth:`candidates` then :meth:`run`."""

    def __init__(self, request: PlanRequest, profile: Profile | None = None):
        self.request = request
        self.profile = profile
        self.shapes = cluster_shapes(request)
        self.table: pd.DataFrame | None = None  # every candidate with its internals, after run()
        slo, search = request.config.slo, request.config.search
        self.rate_horizon_s = search.rate_horizon_s or (RATE_HORIZON_TTFTS * slo.ttft_s if slo.ttft_s else 0.0)
        """A serving plan's least arrival time per rate tried (s, :func:`sim.serving.simulate.max_request_rate`)."""

    # -- closed forms ---------------------------------------------------------------------------
    @lru_cache(maxsize=None)
    def _layout_plan(self, model_index: int, device_types: tuple[str, ...],
                     layout: InferenceLayout) -> tuple[str, ParallelPlan | None]:
        """Why the simulator would refuse ``layout`` of the model on devices of ``device_types``
        (rank order; '' if it would not), and its plan (None when refused)."""
        spec = self.request.models[model_index]
        for device in dict.fromkeys(device_types):
            if spec.dtype not in DEVICES[device].peak_flops_per_s:
                return f"{device} has no {spec.dtype} rate", None
        try:
            parallel = layout.plan(spec, _devices(device_types))
            if self.request.config.is_serving:
                check_serving_layout(parallel)
            else:
                split_batch(self.request.config.workload.batch_size, layout.replicas)
        except ConfigError as error:
            return error.message, None
        return "", parallel

    @lru_cache(maxsize=None)
    def _share_basis(self, model_index: int, device_types: tuple[str, ...]) -> ShareBasis:
        """The basis of the uneven split over devices of ``device_types`` (rank order): the one a
        scenario of the plan's workload without ``parallel.shares`` takes
        (:func:`sim.parallel.workload_share_basis`)."""
        spec = self.request.models[model_index]
        try:
            return workload_share_basis(self.request.config.workload, spec, _devices(device_types))[0]
        except ConfigError:  # a device without the dtype: _layout_plan refuses every layout, this one too
            return ShareBasis.COMPUTE

    @lru_cache(maxsize=None)
    def _memory_problem(self, model_index: int, devices: tuple[str, ...], layout: InferenceLayout,
                        policy_index: int) -> str:
        """A rank of ``layout`` on devices of types ``devices`` (rank order) whose lower bound of peak memory exceeds its capacity (a serving plan's: its share
        ``memory_utilization``, with the KV cache of the longest request), described; '' if none.
        Every rank of the layout is checked: a pipeline stage holds its layers' weights and KV
        cache (:func:`sim.parallel.rank_needs_bytes`), a replica its share of the batch."""
        config = self.request.config
        w = config.workload
        spec, policy = self.request.models[model_index], config.search.memory[policy_index].to_policy()
        parallel = self._layout_plan(model_index, devices, layout)[1]
        baseline = default_runtime_memory({r: DEVICES[d] for r, d in enumerate(devices)})
        if config.is_serving:
            usable, kv_tokens = w.memory_utilization, max(r.prompt_tokens + r.output_tokens for r in self.request.requests)
            batches = (1,) * parallel.replicas
        else:
            usable, kv_tokens = 1.0, w.prompt_tokens + w.output_tokens - 1
            batches = split_batch(w.batch_size, parallel.replicas)
        blocks = layer_block_weight_bytes(spec, parallel.tensor, shard=parallel.shards[0] if parallel.shards else None)
        for rank, (weights, kv) in rank_needs_bytes(spec, parallel, batches, kv_tokens).items():
            if policy.streams:  # at most every block streamed, each at most the largest
                blocks_total = 2 * spec.num_layers
                streamed = blocks_total - (blocks_total // policy.retain_every if policy.retain_every else 0)
                weights = max(0, weights - streamed * max(blocks.values()))
            need = baseline[rank] + weights + kv
            capacity = usable * DEVICES[devices[rank]].memory_capacity_bytes
            if need > capacity:
                role = "master" if rank == parallel.ranks[0] else "a worker"
                return (f"{role} on {devices[rank]} needs at least {need / 2**30:.1f} GiB "
                        f"(weights, KV cache, framework) of {capacity / 2**30:.0f} GiB")
        return ""

    def _bound_lengths(self) -> tuple[int, int, int]:
        """The batch, prompt and output tokens the bounds price: the batch itself, or a serving
        load's unloaded request with the shortest prompt (decoding if any request decodes)."""
        config = self.request.config
        w = config.workload
        if not config.is_serving:
            return w.batch_size, w.prompt_tokens, w.output_tokens
        requests = self.request.requests
        return 1, min(r.prompt_tokens for r in requests), 2 if any(r.output_tokens > 1 for r in requests) else 1

    @lru_cache(maxsize=None)
    def _bounds(self, model_index: int, device_types: tuple[str, ...], layout: InferenceLayout,
                strategy: str, policy_index: int = 0) -> Bounds:
        """Lower bounds of TTFT and TPOT and an upper bound of decode tokens/s of ``layout``: a rank
        runs its compute ops one at a time, each priced by the roofline, so a step lasts at least
        its busiest rank's compute; a pipeline's step also at least one micro-batch's pass through
        every stage in turn (each stage's busiest rank), as each micro-batch's next token needs its
        last one (GPipe, arXiv 1811.06965, section 2.2); replicas (a group each, or a pipeline
        each, on its share of the batch) run apart: the batch's latency is the slowest one's, its
        tokens/s the sum of theirs (:mod:`sim.replicas`). A serving
        load's TTFT bound is :meth:`_serving_ttft_s`'s. With streamed
        weights (memory policy ``policy_index``), a step also lasts at least each rank's loads
        (:meth:`_loads_s`)."""
        batch, prompt, output = self._bound_lengths()
        _, parallel = self._layout_plan(model_index, device_types, layout)
        loads = self._loads_s(model_index, device_types, layout, strategy, policy_index)

        def group_s(ranks: tuple[int, ...], sequences: int, stage: ProgramStage | None, shards) -> tuple:
            return self._group_s(model_index, tuple(device_types[r] for r in ranks), sequences, stage, shards, strategy,
                                 prompt, output)[:2]

        # a serving load's bound prices one request on each replica; a batch is split among them
        batches = (batch,) * parallel.replicas if self.request.config.is_serving else split_batch(
            batch, parallel.replicas)
        if parallel.pipeline > 1:
            pipelines = [PipelinePlan.of(parallel, b, prompt, output, StrategyChoice.library(strategy), replica=i)
                         for i, b in enumerate(batches)]
            copies = [([[group_s(ranks, size, stage, None) for size in pipeline.micro_batches]
                        for ranks, stage in zip(pipeline.stage_ranks, pipeline.stages)], b, 0.0)
                      for pipeline, b in zip(pipelines, batches)]
        else:
            copies = [([[group_s(ranks, b, None, shards)]], b, max(loads[r] for r in ranks))
                      for ranks, shards, b in zip(parallel.replica_ranks, parallel.replica_shards, batches)]

        def step_s(stages: list[list[tuple]], step: int) -> float:
            """``stages[s][j][step]``: each rank of stage s's compute (s) for micro-batch j."""
            busiest = max(sum(group[step][i] for group in micro) for micro in stages for i in range(len(micro[0][step])))
            passes = min(sum(max(micro[j][step]) for micro in stages) for j in range(len(stages[0])))
            return max(busiest, passes)

        serving = self.request.config.is_serving
        ttft_s = self._serving_ttft_s(model_index, device_types, layout, strategy) if serving else 0.0
        tpot_s = tokens_per_s = 0.0
        for stages, b, load_s in copies:
            if not serving:
                ttft_s = max(ttft_s, step_s(stages, 0), load_s)
            tpot = max(step_s(stages, 1), load_s) if output > 1 else 0.0
            tpot_s = max(tpot_s, tpot)
            tokens_per_s += b / tpot if tpot > 0 else math.inf
        return Bounds(ttft_s, tpot_s, tokens_per_s)

    def _serving_ttft_s(self, model_index: int, device_types: tuple[str, ...], layout: InferenceLayout,
                        strategy: str) -> float:
        """A lower bound of a serving load's TTFT at the SLO's percentile, at every rate the search
        tries (s): the per-request bound of :meth:`_request_ttft_s` at the prompt length
        :func:`sim.serving.simulate.percentile_floor_key` picks from the workload's requests (the
        bound grows with the prompt)."""
        return self._request_ttft_s(model_index, device_types, layout, strategy, self._ttft_prompt)

    @cached_property
    def _ttft_prompt(self) -> int:
        """The prompt length whose per-request TTFT bound bounds a serving load's percentile
        (:func:`sim.serving.simulate.percentile_floor_key`)."""
        return percentile_floor_key([r.prompt_tokens for r in self.request.requests], self.request.config.slo.percentile)

    def _request_ttft_s(self, model_index: int, device_types: tuple[str, ...], layout: InferenceLayout,
                        strategy: str, prompt: int) -> float:
        """A lower bound of the TTFT of any request of ``prompt`` tokens served by ``layout`` at any
        load (s): the serving simulator's prefill of its prompt, whole or in chunks, through every
        stage, on the fastest replica it may land on (the module docstring gives the argument)."""
        _, parallel = self._layout_plan(model_index, device_types, layout)
        # interpolating a chunk's cost over CHUNK_STEP-token grid points undercounts its attention FLOPs
        slack = min(1.0, CHUNK_STEP / (prompt + 1))

        def group_s(ranks: tuple[int, ...], stage: ProgramStage | None, shards) -> float:
            totals, _, attention = self._group_s(model_index, tuple(device_types[r] for r in ranks), 1, stage, shards,
                                                 strategy, prompt, 1)
            return max(total - slack * flops_s for total, flops_s in zip(totals, attention))

        if parallel.pipeline > 1:
            stages = pipeline_stages(parallel)
            return min(sum(group_s(ranks, stage, None) for ranks, stage in zip(replica, stages))
                       for replica in parallel.replica_stage_ranks)
        return min(group_s(ranks, None, shards) for ranks, shards in zip(parallel.replica_ranks,
                                                                         parallel.replica_shards))

    def _loads_s(self, model_index: int, device_types: tuple[str, ...], layout: InferenceLayout, strategy: str,
                 policy_index: int) -> dict[int, float]:
        """Each rank's least time (s) loading streamed weights in one step (prefill or decode
        step; 0 with resident weights). Every forward pass loads its streamed blocks past the
        window's first w (which the pass before preloads) before its last layer can run
        (:attr:`sim.plan.Plan.streamed_blocks`, :func:`sim.plan._stream_weights`), one after
        another on the rank's loader stream, each over the host's storage at no more than its
        bandwidth (:mod:`sim.loader`)."""
        policy = self.request.config.search.memory[policy_index].to_policy()
        _, parallel = self._layout_plan(model_index, device_types, layout)
        storage = self.request.catalog.storage
        loads = dict.fromkeys(parallel.ranks, 0.0)
        if not policy.streams or storage is None or parallel.pipeline > 1:  # the simulator refuses the last two
            return loads
        spec, (batch, prompt, output) = self.request.models[model_index], self._bound_lengths()
        for ranks, shards in zip(parallel.replica_ranks, parallel.replica_shards):
            plan = Plan(spec, ranks, batch, prompt, output, StrategyChoice.library(strategy), memory_policy=policy,
                        shards=shards)
            for rank, blocks in plan.streamed_blocks.items():
                loads[rank] = sum(b.size_bytes for b in blocks[policy.window:]) / storage.bandwidth_bytes_per_s
        return loads

    @lru_cache(maxsize=None)
    def _group_s(self, model_index: int, group_types: tuple[str, ...], sequences: int, stage: ProgramStage | None,
                 shards, strategy: str, prompt: int, output: int) -> tuple[tuple[float, ...], ...]:
        """Each rank's compute (s, roofline) in one tensor-parallel group of devices of
        ``group_types`` serving ``sequences`` of ``prompt`` and ``output`` tokens: in the prefill,
        in the first decode step (0 when there is none), and the FLOPs side of its prefill's
        attention ops (:meth:`sim.cost.RooflineCompute.flops_s`); ``stage``: a pipeline stage's
        layers (None: the whole model). A stage's lowering does not depend on where its layers
        start, so alike groups are priced once."""
        spec = self.request.models[model_index]
        settings = self.request.config.compute
        compute = RooflineCompute(spec.dtype, settings.flops_efficiency, settings.memory_efficiency,
                                  settings.op_overhead_s, accumulation=settings.accumulation)
        devices = _devices(group_types)
        ranks = tuple(range(len(group_types)))
        plan = Plan(spec, ranks, sequences, prompt, output, StrategyChoice.library(strategy), shards=shards,
                    stage=None if stage is None else ProgramStage(0, stage.num_layers, stage.embeds, stage.heads))

        def rank_s(step: int, price=compute.duration_s, kinds=None) -> tuple[float, ...]:
            totals = dict.fromkeys(ranks, 0.0)
            for segment in plan.phase(step).segments:
                for rank, ops in segment.programs.items():
                    totals[rank] += segment.repeat * sum(price(op, devices[rank]) for op in ops
                                                         if op.cost is not None and (kinds is None or op.kind in kinds))
            return tuple(totals[r] for r in ranks)

        return (rank_s(0), rank_s(1) if output > 1 else (0.0,) * len(ranks),
                rank_s(0, compute.flops_s, (OpKind.ATTENTION,)))

    def _misses_by_bound(self, bounds: Bounds) -> str:
        slo = self.request.config.slo
        if slo.ttft_s is not None and bounds.ttft_s > slo.ttft_s:
            at = f" p{slo.percentile:g}" if self.request.config.is_serving else ""
            return f"TTFT{at} at least {bounds.ttft_s:.3g} s > {slo.ttft_s:.3g} s"
        if slo.tpot_s is not None and bounds.tpot_s > slo.tpot_s:
            return f"TPOT at least {bounds.tpot_s * 1e3:.3g} ms > {slo.tpot_s * 1e3:.3g} ms"
        if slo.tokens_per_s is not None and bounds.tokens_per_s < slo.tokens_per_s:
            return f"at most {bounds.tokens_per_s:.3g} tokens/s < {slo.tokens_per_s:.3g}"
        return ""

    # -- the search -----------------------------------------------------------------------------
    def candidates(self) -> pd.DataFrame:
        """Every candidate with its price and the closed-form stages (1-4) applied."""
        config, catalog = self.request.config, self.request.catalog
        rows = []
        variants, policies = config.search.variants, config.search.memory
        algorithms = {} if config.is_training else {v.name: _algorithms(v) for v in variants}
        labels = {k: p.to_policy().label() for k, p in enumerate(policies)}
        for m, spec in enumerate(self.request.models):
            for shape in self.shapes:
                price = shape.price_per_hour(catalog)
                over = ""
                if shape.num_devices > config.limits.max_devices:
                    over = f"{shape.num_devices} devices > limits.max_devices {config.limits.max_devices}"
                elif config.limits.budget_per_hour is not None and price > config.limits.budget_per_hour:
                    over = f"${price_text(price)}/h > limits.budget_per_hour ${price_text(config.limits.budget_per_hour)}"
                if config.is_training:  # a training cluster's layouts are its own (sim.planning.training)
                    rows += self._training_candidates(m, spec, shape, price, over)
                    continue
                types = shape.device_types
                common = {"model": spec.name, "model_index": m, "shape": shape, "cluster": shape.label(),
                          "device_types": "+".join(dict.fromkeys(types)), "num_hosts": shape.num_hosts,
                          "devices_per_host": shape.groups[0].per_host, "num_devices": shape.num_devices,
                          "interconnect": "+".join(g.interconnect for g in shape.groups if g.interconnect),
                          "network": shape.network or "", "price_per_hour": price}
                uneven = self._share_basis(m, types) if len(set(types)) > 1 else None
                for layout in inference_layouts(shape.num_hosts, shape.groups[0].per_host, uneven=uneven):
                    problem, parallel = self._layout_plan(m, types, layout)
                    refused = {p: problem or _policy_problem(p, layout) for p in policies}
                    memory = {p: "" if refused[p] or over else self._memory_problem(m, types, layout, k)
                              for k, p in enumerate(policies)}
                    for variant, (k, policy) in itertools.product(variants, enumerate(policies)):
                        stage, reason, bounds = Stage.SIMULATED, "", None
                        if refused[policy]:
                            stage, reason = Stage.LAYOUT, refused[policy]
                        elif over:
                            stage, reason = Stage.LIMITS, over
                        elif memory[policy]:
                            stage, reason = Stage.MEMORY, memory[policy]
                        else:
                            bounds = self._bounds(m, types, layout, variant.strategy, k)
                            miss = self._misses_by_bound(bounds) if self.profile is None else ""
                            if miss:
                                stage, reason = Stage.BOUND, miss
                        rows.append(common | {
                            "parallel": layout.label(), "layout": layout, "variant_config": variant,
                            "variant": variant.name, "strategy": variant.strategy,
                            "algorithms": algorithms[variant.name], "memory_config": policy,
                            "memory_policy": labels[k], "stage": stage, "reason": reason,
                            "ttft_lower_bound_s": bounds.ttft_s if bounds else math.nan,
                            "tpot_lower_bound_s": bounds.tpot_s if bounds else math.nan,
                            "tokens_upper_bound": bounds.tokens_per_s if bounds else math.nan})
        table = pd.DataFrame(rows)
        table.insert(0, "candidate", np.arange(len(table)))
        return table

    def _training_candidates(self, m: int, spec: ModelSpec, shape: ClusterShape, price: float,
                             over: str) -> list[dict]:
        """A training plan's rows of one cluster: every layout (:func:`sim.planning.training.layouts`)
        and variant, stages 1-4 applied (``over``: the cluster's limits problem, '' if none)."""
        config = self.request.config
        w, slo = config.workload, config.slo
        types = set(shape.device_types)
        rows = []
        for layout in training.layouts(shape.num_devices, shape.groups[0].per_host):
            for variant in config.search.variants:
                settings = training.settings_of(config.training, variant)
                bound = math.nan
                row_stage, reason = Stage.LAYOUT, training.layout_problem(spec, layout, w, settings, types)
                if not reason and over:
                    row_stage, reason = Stage.LIMITS, over
                if not reason:
                    row_stage, reason = Stage.MEMORY, training.memory_problem(spec, layout, w, settings,
                                                                              shape.device_types)
                if not reason:
                    bound = self._step_bound(m, layout, variant.name, tuple(sorted(types)), shape.groups[0].per_host,
                                             shape.network)
                    row_stage, reason = Stage.BOUND, "" if self.profile is not None else training.misses(
                        bound, w.tokens_per_step / bound if bound > 0 else math.inf, slo, bound=True)
                if not reason:
                    row_stage = Stage.SIMULATED
                rows.append({"model": spec.name, "model_index": m, "shape": shape, "cluster": shape.label(),
                             "device_types": "+".join(dict.fromkeys(shape.device_types)),
                             "num_hosts": shape.num_hosts, "devices_per_host": shape.groups[0].per_host,
                             "num_devices": shape.num_devices,
                             "interconnect": "+".join(g.interconnect for g in shape.groups if g.interconnect),
                             "network": shape.network or "", "parallel": layout.label(), "layout": layout,
                             "variant_config": variant, "variant": variant.name, "strategy": "",
                             "algorithms": _training_algorithms(settings, variant, layout),
                             "memory_config": MemoryConfig(), "memory_policy": "", "price_per_hour": price,
                             "stage": row_stage, "reason": reason, "step_time_lower_bound_s": bound,
                             "ttft_lower_bound_s": math.nan, "tpot_lower_bound_s": math.nan})
        return rows

    @lru_cache(maxsize=None)
    def _step_bound(self, model_index: int, layout: training.TrainingLayout, variant: str,
                    device_types: tuple[str, ...], per_host: int, network: str | None) -> float:
        config = self.request.config
        chosen = next(v for v in config.search.variants if v.name == variant)
        egress = None
        if network is not None:
            link = self.request.catalog.networks[network]
            egress = link.bandwidth_bytes_per_s * (per_host if link.nic_per_device else 1)
        return training.step_time_bound_s(self.request.models[model_index], layout, config.workload,
                                          training.settings_of(config.training, chosen), set(device_types),
                                          config.compute, devices_per_host=per_host, host_egress_bytes_per_s=egress)

    def run(self, progress=None) -> pd.DataFrame:
        """Simulate the survivors in order of price (stage 5 decided on the way); the full table.

        Within a cluster, resident layouts go first, and the strategies' ``auto`` variants before
        the variants naming one allreduce algorithm: ``auto`` prices each call with the fastest
        algorithm, so its simulated latency bounds theirs. On one device every variant is the
        same program (no collectives), and so on every layout without tensor parallelism (a
        pipeline of single devices, replicas of one device each): one is simulated and its result copied.
        ``progress(done, total)``, if given, is called after each cluster.
        """
        config = self.request.config
        table = self.candidates()
        results: dict[int, dict] = {}
        # The loop reads plain records: a pandas row per candidate costs more than its closed forms.
        records = dict(zip(table.index, table.to_dict("records")))
        live = table[table["stage"] == Stage.SIMULATED]
        groups = sorted(live.groupby(["price_per_hour", "model_index", "cluster", "parallel"], sort=False).groups.items(),
                        key=lambda item: item[0])
        best = _Frontier(self.request)
        for done, ((price, _, _, _), index) in enumerate(groups, 1):
            rows = [records[i] for i in index]
            streams = {row["candidate"]: row["memory_config"].to_policy().streams for row in rows}
            resident_fit = True
            for streamed in (False, True):
                part = [row for row in rows if streams[row["candidate"]] == streamed]
                if not part:
                    continue
                if streamed and resident_fit and not all(streams.values()):
                    for row in part:
                        results[row["candidate"]] = {"stage": Stage.DOMINATED, "reason": "every resident layout fits: "
                                                                                          "streaming only adds loads"}
                    continue
                explicit = [_names_one_allreduce(row["variant_config"]) for row in part]
                for wave in ([r for r, e in zip(part, explicit) if not e], [r for r, e in zip(part, explicit) if e]):
                    keep = []
                    for row in wave:
                        i = row["candidate"]
                        if not config.is_serving and best.dominates(price, *self._optimistic(row, rows, results)):
                            results[i] = {"stage": Stage.DOMINATED, "reason": f"{TOP_N} cheaper configurations meet "
                                                                              "the objectives and it cannot be faster"}
                        else:
                            keep.append(row)
                    if keep and not config.is_training and keep[0]["layout"].tensor == 1:
                        self._simulate_rows(keep[:1], results)
                        for row in keep[1:]:
                            results[row["candidate"]] = dict(results[keep[0]["candidate"]], reason=(
                                f"tensor parallelism of 1, no collectives: as {keep[0]['variant']}"))
                    else:
                        self._simulate_rows(keep, results)
                    for row in keep if not config.is_serving else ():
                        done_row = results[row["candidate"]]
                        if done_row["stage"] == Stage.SIMULATED and done_row["fits"]:
                            best.add(price, done_row[self.latency_metric], done_row[self.throughput_metric],
                                     done_row["meets_slo"], (row["model"], row["cluster"]))
                if not streamed:
                    resident_fit = all(results[row["candidate"]].get("fits", False) for row in part
                                       if results[row["candidate"]]["stage"] == Stage.SIMULATED)
            if progress is not None:
                progress(done, len(groups))
        update = pd.DataFrame.from_dict(results, orient="index")
        for column in update.columns:
            table.loc[update.index, column] = update[column]
        # Columns only simulated candidates have: absent when none was simulated, empty elsewhere.
        for column, empty in (("fits", False), ("meets_slo", False), ("slo_miss", ""), ("profile_context", "")):
            values = table[column] if column in table else pd.Series(empty, index=table.index)
            table[column] = values.astype(object).where(values.notna(), empty).astype(type(empty))
        for column in self.columns:
            if column not in table:
                table[column] = math.nan
        self.table = table
        return table[self.columns].copy()

    @property
    def columns(self) -> list[str]:
        """The public columns of this plan's table (see the module docstring)."""
        config = self.request.config
        return PLAN_COLUMNS + (SERVING_COLUMNS if config.is_serving else
                               [c for c in training.TRAINING_COLUMNS if c not in PLAN_COLUMNS]
                               if config.is_training else [])

    @property
    def latency_metric(self) -> Metric:
        """What the plan ranks and draws as latency (s): a training step's time, else a batch's end to end."""
        return Metric.STEP_TIME if self.request.config.is_training else Metric.E2E_LATENCY

    @property
    def throughput_metric(self) -> Metric:
        """What the plan ranks and draws as throughput: trained tokens/s, else decode tokens/s."""
        return Metric.TOKENS_PER_S if self.request.config.is_training else Metric.DECODE_TOKENS_PER_S

    def _optimistic(self, row: dict, cluster_rows: list[dict], results: dict[int, dict]) -> tuple[float, float]:
        """The best e2e latency (s) and decode tokens/s ``row`` could reach: its compute bounds,
        tightened by its cluster's ``auto`` variant of the same strategy and memory policy if that
        was simulated (see :meth:`run`; rows are :meth:`candidates` records)."""
        w = self.request.config.workload
        if self.request.config.is_training:  # a replica's compute bound; every variant on its own
            bound = row["step_time_lower_bound_s"]
            return bound, w.tokens_per_step / bound if bound > 0 else math.inf
        e2e = row["ttft_lower_bound_s"] + (w.output_tokens - 1) * row["tpot_lower_bound_s"]
        tokens = row["tokens_upper_bound"]
        if _names_one_allreduce(row["variant_config"]):
            for other in cluster_rows:
                done = results.get(other["candidate"])
                if (done and done["stage"] == Stage.SIMULATED and other["strategy"] == row["strategy"]
                        and other["variant_config"].allreduce == "auto" and other["memory_policy"] == row["memory_policy"]):
                    e2e = max(e2e, done[Metric.E2E_LATENCY])
                    tokens = min(tokens, done[Metric.DECODE_TOKENS_PER_S])
        return e2e, tokens

    def scenario_dict(self, row: pd.Series | dict, name: str | None = None) -> dict:
        """The scenario of a candidate (one variant), ready for ``hetsim simulate`` or ``measure``."""
        config = self.request.config
        variant = row["variant_config"].model_dump(exclude_none=True, exclude={"memory"})
        memory = row["memory_config"].model_dump(mode="json", exclude_none=True)
        spec_name = config.models[int(row["model_index"])]
        if spec_name.endswith(".json") and self.request.source_path is not None:
            spec_name = str((self.request.source_path.parent / spec_name).resolve())
        data = {"name": name or f"{config.name}-{row['candidate']}", "model": spec_name,
                "attention": config.attention, "cluster": row["shape"].cluster(self.request.catalog),
                "workload": config.workload.model_dump(), "compute": config.compute.model_dump(mode="json", by_alias=True),
                "memory": memory, "variants": [variant]}
        data["parallel"] = row["layout"].parallel()
        if config.is_training:
            del data["memory"]
            data["variants"] = [row["variant_config"].model_dump(exclude_none=True, exclude_unset=True)]
            if config.training is not None:
                data["training"] = config.training.model_dump(mode="json", exclude_unset=True)
        if config.dtype:
            data["dtype"] = config.dtype
        if config.weights != WeightFormat.NATIVE:
            data |= {"weights": str(config.weights), "quantised_matmul": str(config.quantised_matmul)}
        if config.kv_cache != CacheFormat.NATIVE:
            data["kv_cache"] = str(config.kv_cache)
        if config.is_serving:
            data["workload"]["slo"] = config.slo.serving().model_dump(by_alias=True)
        return data

    def batch_scenario_dict(self, row: pd.Series | dict, name: str | None = None) -> dict | None:
        """A serving candidate's layout running, as a batch (an inference scenario for ``hetsim
        simulate`` and ``hetsim measure``), the requests it decodes at once at its maximum rate:
        ``decode_batch_at_max_rate`` rounded, per iteration in flight (a pipeline's stages) and
        per replica, at the requests' mean prompt and output lengths. None where no iteration
        decodes (every request has one output token, or nothing was served)."""
        batch = round(row[DECODE_BATCH]) if not pd.isna(row[DECODE_BATCH]) else 0
        if batch < 1:
            return None
        layout, requests = row["layout"], self.request.requests
        data = self.scenario_dict(row, name)
        data["workload"] = {"batch_size": batch * layout.pipeline * layout.replicas,
                            "prompt_tokens": round(np.mean([r.prompt_tokens for r in requests])),
                            "output_tokens": max(2, round(np.mean([r.output_tokens for r in requests])))}
        return data

    def _simulate_rows(self, rows: list[dict], results: dict[int, dict]) -> None:
        """Simulate the candidates ``rows`` (:meth:`candidates` records of one cluster and layout)
        as one scenario, or in halves where the simulator refuses so many variants at once
        (replicas multiply them); their results into ``results``, by candidate number."""
        if not rows:
            return
        config = self.request.config
        index = [row["candidate"] for row in rows]
        data = self.scenario_dict(rows[0])
        data["variants"] = [_named_variant(row, config.is_training) for row in rows]
        try:
            if config.is_training:
                simulated = simulate_training(scenario_from_dict(data), profile=self.profile)
                context = profile_context(simulated) if self.profile is not None else ""
                for row, vr in zip(rows, simulated.variants):
                    results[row["candidate"]] = self._training_result(row, vr, simulated, context)
                return
            if config.is_serving:
                served = simulate_serving(scenario_from_dict(data), profile=self.profile, rate_search=RateSearchSettings(
                    from_workload_rate=True, tolerance=config.search.rate_tolerance, horizon_s=self.rate_horizon_s))
                context = profile_context(served) if self.profile is not None else ""
                for row, vr in zip(rows, served.variants):
                    results[row["candidate"]] = self._serving_result(row["price_per_hour"], vr, context)
                return
            result = simulate(scenario_from_dict(data), profile=self.profile, expand_steps=())
        except ConfigError as error:
            if error.field == "variants" and len(rows) > 1:  # too large a job together: in halves
                self._simulate_rows(rows[:len(rows) // 2], results)
                self._simulate_rows(rows[len(rows) // 2:], results)
                return
            for i in index:
                results[i] = {"stage": Stage.ERROR, "reason": str(error)}
            return
        context = profile_context(result) if self.profile is not None else ""
        for i, vr in zip(index, result.variants):
            timing, fits = vr.timing, vr.overflow is None
            miss = slo_miss(timing, config.slo)
            results[i] = {"stage": Stage.SIMULATED, "reason": "",
                          **{metric: timing[metric] for metric in _TIMING},
                          Metric.MAX_PEAK_MEMORY: float(max(vr.peak_bytes.values())),
                          "fits": fits, "meets_slo": fits and not miss, "profile_context": context,
                          "slo_miss": miss if fits else vr.overflow.describe(
                              result.topology.devices[vr.overflow.rank].name)}


    def _training_result(self, row: pd.Series | dict, vr, simulated, context: str) -> dict:
        """A training candidate's row: its step's metrics, its peak memory (with the framework
        baseline of its backend where no profile measured one) and the objectives it misses."""
        metrics = vr.metrics
        capacity = {rank: simulated.topology.devices[rank].memory_capacity_bytes for rank in vr.memory}
        baseline = default_runtime_memory({rank: simulated.topology.devices[rank].spec for rank in vr.memory})
        peak = {rank: m.total + (baseline[rank] if not m.framework else 0) for rank, m in vr.memory.items()}
        over = [rank for rank in sorted(peak) if peak[rank] > capacity[rank]]
        miss = training.misses(metrics[Metric.STEP_TIME], metrics[Metric.TOKENS_PER_S], self.request.config.slo)
        if over:
            device = simulated.topology.devices[over[0]]
            miss = f"{device.name} needs {peak[over[0]] / 2**30:.1f} GiB of {capacity[over[0]] / 2**30:.0f} GiB"
        return {"stage": Stage.SIMULATED, "reason": "", "fits": not over, "meets_slo": not over and not miss,
                "slo_miss": miss, "profile_context": context, Metric.MAX_PEAK_MEMORY: float(max(peak.values())),
                **{m: metrics[m] for m in (Metric.STEP_TIME, Metric.TOKENS_PER_S, Metric.SAMPLES_PER_S,
                                           Metric.EXPOSED_COMMUNICATION)},
                "step_bottleneck": bottleneck(metrics)}

    def _serving_result(self, price_per_hour: float, vr: ServingVariantResult, context: str) -> dict:
        """A serving candidate's row: its metrics at the target rate, its maximum rate and $/Mtok
        there, a pipeline's busiest part there (:func:`sim.serving.simulate.pipeline_bottleneck`);
        it meets the objectives iff the maximum rate is at least the target; ``context``:
        how a profile priced it (:func:`sim.context.profile_context`)."""
        config = self.request.config
        slo, target = config.slo.serving(), config.workload.rate_per_s
        at_target = vr.search.start_metrics
        rate = vr.search.rate_per_s
        at_max = vr.search.run if vr.search.run is not None else vr.run  # none met the SLO: the workload's own run
        tokens_per_s = vr.search.metrics.get(Metric.OUTPUT_TOKENS_PER_S, 0.0)
        miss = "" if rate >= target else "; ".join(
            [f"max rate {rate:.3g}/s < {target:.3g}/s"] + serving_misses(at_target, slo))
        return {"stage": Stage.SIMULATED, "reason": "", "fits": True, "meets_slo": not miss, "slo_miss": miss,
                "profile_context": context, **{metric: at_target.get(metric, math.nan) for metric in _TIMING},
                SLO_TTFT: at_target[Metric.TTFT.percentile(slo.percentile)],
                SLO_TPOT: at_target[Metric.TPOT.percentile(slo.percentile)],
                Metric.MAX_REQUEST_RATE: rate, Metric.OUTPUT_TOKENS_PER_S: tokens_per_s,
                COST_PER_MILLION_TOKENS: cost_per_million_tokens(price_per_hour, tokens_per_s),
                "rate_search_runs": vr.search.runs, DECODE_BATCH: at_max.mean_decode_batch,
                "server_bottleneck": pipeline_bottleneck(at_max)}


def serving_misses(metrics: dict, slo: ServingSLO) -> list[str]:
    """The objectives of ``slo`` that a serving run's ``metrics`` (:func:`sim.serving.simulate.slo_metrics`)
    miss at its percentile, one phrase each."""
    q, misses = slo.percentile, []
    if slo.ttft_s is not None and not metrics[Metric.TTFT.percentile(q)] <= slo.ttft_s:
        misses.append(f"TTFT p{q} {metrics[Metric.TTFT.percentile(q)]:.3g} s > {slo.ttft_s:.3g} s")
    tpot = metrics[Metric.TPOT.percentile(q)]
    if slo.tpot_s is not None and not (math.isnan(tpot) or tpot <= slo.tpot_s):
        misses.append(f"TPOT p{q} {tpot * 1e3:.3g} ms > {slo.tpot_s * 1e3:.3g} ms")
    return misses


def slo_miss(timing: dict, slo) -> str:
    """The objectives ``timing`` misses, ``; ``-joined (empty: meets them all)."""
    misses = []
    if slo.ttft_s is not None and not timing[Metric.TTFT] <= slo.ttft_s:
        misses.append(f"TTFT {timing[Metric.TTFT]:.3g} s > {slo.ttft_s:.3g} s")
    if slo.tpot_s is not None and not timing[Metric.TPOT] <= slo.tpot_s:
        misses.append(f"TPOT {timing[Metric.TPOT] * 1e3:.3g} ms > {slo.tpot_s * 1e3:.3g} ms")
    if slo.tokens_per_s is not None and not timing[Metric.DECODE_TOKENS_PER_S] >= slo.tokens_per_s:
        misses.append(f"{timing[Metric.DECODE_TOKENS_PER_S]:.3g} tokens/s < {slo.tokens_per_s:.3g}")
    return "; ".join(misses)


class _Frontier:
    """What the simulated candidates so far achieve (ascending price): the best e2e latency and
    decode tokens/s, and the prices of those meeting every objective."""

    def __init__(self, request: PlanRequest):
        self.request = request
        self.best_e2e_s = math.inf
        self.best_tokens_per_s = 0.0
        self.feasible: dict[tuple[str, str], float] = {}  # (model, cluster) meeting every objective -> price

    def add(self, price: float, latency_s: float, tokens_per_s: float, meets: bool,
            configuration: tuple[str, str]) -> None:
        """A simulated configuration that fits: its latency (s; a training step's time), throughput
        (tokens/s) and whether it meets every objective."""
        self.best_e2e_s = min(self.best_e2e_s, latency_s)
        if not math.isnan(tokens_per_s):
            self.best_tokens_per_s = max(self.best_tokens_per_s, tokens_per_s)
        if meets:
            self.feasible[configuration] = price

    def dominates(self, price: float, e2e_lb_s: float, tokens_ub: float) -> bool:
        """Whether a candidate at ``price`` that can at best reach ``e2e_lb_s`` and ``tokens_ub``
        can enter neither the top ``TOP_N`` (clusters) nor a frontier."""
        if sum(p < price for p in self.feasible.values()) < TOP_N:
            return False
        return e2e_lb_s >= self.best_e2e_s and tokens_ub <= self.best_tokens_per_s


def _names_one_allreduce(variant: Variant) -> bool:
    """A variant whose strategy allreduces with one named algorithm (not ``auto``)."""
    return variant.allreduce is not None and variant.allreduce != "auto"


_TIMING = (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.E2E_LATENCY, Metric.LOADER_STALL_DECODE)


@lru_cache(maxsize=None)
def _devices(device_types: tuple[str, ...]) -> tuple[Device, ...]:
    """Devices of ``device_types`` by rank, at their datasheet capacity (the catalog's clusters')."""
    return tuple(Device(r, f"r{r}", f"r{r}", DEVICES[d], DEVICES[d].memory_capacity_bytes)
                 for r, d in enumerate(device_types))


def _policy_problem(policy: MemoryConfig, layout: InferenceLayout) -> str:
    """Why the simulator refuses ``policy`` with ``layout`` ('' if it does not)."""
    try:
        check_pipeline_policy(policy.to_policy(), layout.pipeline)
    except ConfigError as error:
        return error.message
    return ""


def _algorithms(variant: Variant) -> str:
    return ", ".join(f"{kind}={name}" for kind, name in sorted(variant.choice().algorithms.items()))


def _named_variant(row: pd.Series | dict, is_training: bool = False) -> dict:
    if is_training:  # a training variant has no memory policy: its settings say what it holds
        return row["variant_config"].model_dump(exclude_none=True, exclude_unset=True) | {"name": f"c{row['candidate']}"}
    variant = row["variant_config"].model_dump(exclude_none=True, exclude={"memory"})
    variant["name"] = f"c{row['candidate']}"
    variant["memory"] = row["memory_config"].model_dump(mode="json", exclude_none=True)
    return variant


def _training_algorithms(settings, variant: Variant, layout: training.TrainingLayout) -> str:
    """A training variant's collectives and the settings that tell its variants apart."""
    parts = [f"buckets={settings.allreduce}"] + ([f"allreduce={variant.allreduce or 'ring'}"] if layout.tensor > 1 else [])
    if settings.zero:
        parts.append(f"zero={settings.zero}")
    if settings.activation_checkpointing:
        parts.append(f"checkpoint every {settings.activation_checkpointing}")
    return ", ".join(parts)

