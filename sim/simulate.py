"""``simulate(scenario)``: the simulator's main job as a library call.

For each variant of the scenario: lower the plan, price it with the engine over the scenario's
topology, build the trace and compute the metrics. The topology, compute model and collective
pricer are built once and shared by the variants, so a collective two variants both use is priced
once. The CLI only parses arguments, calls this and writes what it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from models.cache_formats import quantised
from models.cache_formats import source_lines as cache_lines
from models.errors import ConfigError
from models.weight_formats import source_lines
from sim.alike import relabel_run, relabel_trace, replica_twins
from sim.budget import check_job_size
from sim.calibrated import CalibratedCompute, NetworkChoice, calibrated_network
from sim.context import calibration_mode, scenario_context
from sim.transport import DEFAULT_TRANSPORT_MODEL, DefaultTransportNetwork, Transport, group_transport
from sim.arrival_skew import DEFAULT_LAG_PER_BLOCK
from sim.cores import CorePool
from sim.cost import RooflineCompute
from sim.engine import Engine
from sim.framework import framework_memory
from sim.loader import check_loader_paths
from sim.memory import Overflow
from sim.metrics import peak_memory_bytes, result_rows, run_metrics
from sim.network import NETWORK_MODELS, CollectivePricer, reduction_costs
from sim.parallel import ParallelPlan
from sim.profile import Profile
from sim.pipeline_run import AlikeGroups, simulate_pipeline_run
from sim.replicas import ReplicaRun, combined_timing, idle_rows, replica_pools, replica_rows, split_batch
from sim.scenario import Scenario, Variant, pipeline_plan
from sim.timeline import RunResult, simulate_run
from sim.topology import Topology, build_topology
from sim.trace import Trace, build_trace
from sim.vocabulary import DECODE_METRICS, Calibration, Metric


REUSE_ALIKE_REPLICAS = True
"""Replicas that run exactly as an earlier one get a copy of its run (:func:`sim.alike.replica_twins`)
instead of a simulation of their own; False simulates every replica (to check the copies)."""

BY_SHAPE = True
"""Outside same-cluster mode, forward ops are priced by the profile's ``compute_isolated`` rows where
it has them (:meth:`sim.calibrated.CalibratedCompute._by_shape`); False prices them from the in-place
``compute`` rows as a profile without isolated rows is (to compare the two on one profile)."""


@dataclass(frozen=True)
class VariantResult:
    """One variant's run, trace, timing metrics, the algorithms its collectives resolved to
    (``"allreduce=ring"``, sorted), its parallel layout (the scenario's, or its own) and how it
    was priced (``calibration``: a profile's timings replayed, predicted from a profile, or
    uncalibrated; :func:`sim.context.calibration_mode`).

    With several replicas (:mod:`sim.replicas`), ``replicas`` holds each one's run (``run`` and
    ``trace`` are the first's) and ``timing`` is theirs combined; empty with one."""

    variant: Variant
    run: RunResult
    trace: Trace
    timing: dict[str, float]
    algorithms: tuple[str, ...]
    layout: ParallelPlan
    replicas: tuple[ReplicaRun, ...] = ()
    calibration: Calibration = Calibration.UNCALIBRATED

    @property
    def runs(self) -> tuple[RunResult, ...]:
        """Every replica's run (the one run without replicas)."""
        return tuple(r.run for r in self.replicas) or (self.run,)

    @property
    def overflow(self) -> Overflow | None:
        """The first op that does not fit, in the first replica where one does not, or None."""
        return next((run.overflow for run in self.runs if run.overflow is not None), None)

    @property
    def peak_bytes(self) -> dict[int, int]:
        """Per rank of every replica, its highest memory over the run (bytes)."""
        return {rank: peak for run in self.runs for rank, peak in run.peak_bytes.items()}

    def traces(self) -> tuple[tuple[str, Trace], ...]:
        """(label, trace) of each replica, labelled ``<variant>`` alone or ``<variant> replica i``."""
        if not self.replicas:
            return ((self.variant.name, self.trace),)
        return tuple((f"{self.variant.name} replica {i}", r.trace) for i, r in enumerate(self.replicas))


@dataclass(frozen=True)
class SimulationResult:
    """Everything ``hetsim simulate`` reports: per-variant results and the tidy result table.

    ``calibrated``: priced from a calibration profile; ``extrapolated``: the predictions that fell
    outside what the profile measured (priced by the uncalibrated models, scaled), one line each;
    ``network``: how the profile priced the collectives (same-cluster replay or transferred terms).
    ``ranks``: the devices the variants run on (every replica's ranks in turn; with variants of
    their own layouts, every device some variant uses); ``parallel``: the scenario's layout.
    ``layout_networks``: with a profile, how it priced each further layout of the variants
    (labelled), ``network`` being the scenario's own layout's.
    """

    scenario: Scenario
    topology: Topology
    ranks: tuple[int, ...]
    variants: tuple[VariantResult, ...]
    results: pd.DataFrame
    calibrated: bool = False
    extrapolated: tuple[str, ...] = ()
    network: "NetworkChoice | None" = None
    parallel: ParallelPlan | None = None
    layout_networks: tuple[tuple[str, NetworkChoice], ...] = ()

    @property
    def idle_devices(self) -> tuple[str, ...]:
        """The devices no variant uses, in topology order."""
        used = set(self.ranks)
        return tuple(d.name for d in self.topology.devices if d.rank not in used)

    @property
    def sources(self) -> tuple[str, ...]:
        """Where the calibrated prediction's terms come from (:mod:`sim.context`), one line each."""
        if self.network is None:
            return ()
        lines = list(self.network.lines())
        for label, choice in self.layout_networks:
            lines += [f"[{label}] {line}" for line in choice.lines()]
        return tuple(lines)

    @property
    def calibrations(self) -> dict[str, Calibration]:
        """How each variant was priced (variant name -> mode, :attr:`VariantResult.calibration`)."""
        return {v.variant.name: v.calibration for v in self.variants}

    def variant(self, name: str) -> VariantResult:
        return next(v for v in self.variants if v.variant.name == name)


def check_finite(timing: dict[str, float], field: str, *, decodes: bool) -> None:
    """Raise ConfigError on ``field`` if a metric came out inf or NaN: a result row must never be
    one. The inputs are bounded (:mod:`sim.units`) so that this should not happen; it is the last
    check before anything is written. Without decode steps (``decodes`` false: one output token)
    the per-decode-step metrics are NaN by definition."""
    for metric, value in timing.items():
        if math.isfinite(value) or (math.isnan(value) and not decodes and metric in DECODE_METRICS):
            continue
        raise ConfigError(field, f"the simulated {metric} is not a finite number; the scenario's magnitudes "
                                 f"(latencies, bandwidths, sizes) are out of any useful range (got {value})")


def model_network(name: str, topology: Topology, compute):
    """The network model ``name`` (:data:`sim.network.NETWORK_MODELS`) over ``topology``, with
    the gamma of ``compute``. Raises ConfigError on ``network_model`` for an unknown name."""
    if name not in NETWORK_MODELS:
        raise ConfigError("network_model", f"unknown network model; known: {', '.join(NETWORK_MODELS)} "
                                           f"(got {name!r})")
    return NETWORK_MODELS[name](topology, reduction_costs(compute, topology.devices))


def uncalibrated_network(name: str, topology: Topology, compute, pool: CorePool | None = None, copies: int = 1):
    """The network an uncalibrated simulation prices collectives with: for the default model,
    the flow model with each transport's documented terms
    (:class:`sim.transport.DefaultTransportNetwork`), its gloo ranks sharing ``pool``'s cores
    where given (:func:`declared_cores`), ``copies`` replicas running each group's steps at once
    there, else :func:`model_network`."""
    if name == DEFAULT_TRANSPORT_MODEL:
        model_network(name, topology, compute)  # the name's check
        return DefaultTransportNetwork(topology, reduction_costs(compute, topology.devices),
                                       cores=None if pool is None else int(pool.cores),
                                       ranks=0 if pool is None else len(pool.ranks), copies=copies)
    return model_network(name, topology, compute)


def declared_cores(scenario: Scenario, topology: Topology, ranks: tuple[int, ...]) -> CorePool | None:
    """The cores the scenario's gloo (CPU) ``ranks`` share, as a pool for the engine
    (:mod:`sim.cores`), where the cluster declares them (``cluster.cores``) and those ranks
    outnumber them, their prefill arrival lags the default's (:data:`sim.arrival_skew.DEFAULT_LAG_PER_BLOCK`);
    None elsewhere (ranks with cores of their own: nothing changes)."""
    cores = scenario.config.cluster.cores
    gloo = frozenset(r for r in ranks if group_transport(topology, (r,)) is Transport.GLOO_TCP)
    if cores is None or len(gloo) <= cores:
        return None
    return CorePool(gloo, cores, lag_per_block=DEFAULT_LAG_PER_BLOCK)


@dataclass(frozen=True)
class Pricing:
    """How a scenario's forward passes are priced on its cluster: the compute model (roofline, or
    calibrated), the network model, the engine built on them, how a profile's network terms were
    used (None without a profile), the runtime's own memory per rank (bytes, from a profile) and
    the machines whose cores the ranks share (:mod:`sim.cores`; empty: a core each)."""

    compute: object
    network: object
    engine: Engine
    choice: NetworkChoice | None
    runtime_memory: dict[int, int]
    cores: tuple = ()


def build_pricing(scenario: Scenario, topology: Topology, ranks: tuple[int, ...],
                  profile: Profile | None = None, context_group: tuple[int, ...] | None = None,
                  layout: str | None = None, dtype: str | None = None, pipelined: bool = False,
                  copies: int = 1, reduce_dtype: str | None = None, reduce_dtypes: tuple[str, ...] = ()) -> Pricing:
    """The compute model, network model and engine that price ``scenario`` on ``ranks`` of
    ``topology``: the roofline and the scenario's network model (with each transport's documented
    per-message terms for the default one), or a calibration ``profile`` compared with the
    scenario's context (:mod:`sim.calibrated`) of one copy's ranks, ``context_group`` (default
    ``ranks``), run in ``layout`` (:attr:`sim.parallel.ParallelPlan.uncalibrated_layout`).
    ``copies``: the replicas of that group (:mod:`sim.replicas`); where ranks share cores, each
    collective's messages contend with every copy's, which run the same steps at once
    (:meth:`sim.transport._TransportLinks.floor_s`).
    ``dtype``: the compute dtype (default the model's; a training variant's comes from its
    precision). ``pipelined``: the layout runs pipeline stages (:class:`sim.context.CalibrationContext`).
    ``reduce_dtype``: the dtype the collectives reduce in, whose ``reduction`` rows price them
    (:attr:`sim.calibrated.CalibratedCompute.reduce_dtype`; default ``dtype``), and
    ``reduce_dtypes`` the others its collectives reduce in (``Collective.dtype``), whose sources
    the choice gives too (:attr:`sim.calibrated.CalibratedCompute.reduce_dtypes`).

    Raises:
        ConfigError: devices without the scenario's dtype, an unknown network model.
    """
    config = scenario.config
    dtype = dtype or scenario.model.dtype
    for rank in ranks:
        topology.devices[rank].spec.peak_flops(dtype, field="dtype")
    # Without a profile, CPU ranks on the cores the cluster declares run single-threaded, as the
    # reference runtime runs them: one core's peaks each (a profile's rows are timed so already).
    compute = RooflineCompute(dtype, config.compute.flops_efficiency, config.compute.memory_efficiency,
                              config.compute.op_overhead_s,
                              one_core=profile is None and config.cluster.cores is not None,
                              accumulation=config.compute.accumulation)
    if profile is not None:
        # A profile times the runtime's torch kernels on dense weights and cache; replaying them
        # for quantised blocks (other bytes, a dequantising pass) would be a silent wrong price.
        for field, value in quantised(scenario.model.weights, scenario.model.kv_cache):
            raise ConfigError(field, f"a calibration profile times dense {scenario.model.dtype} weights and "
                                     f"cache, which the runtime runs; quantised ones are priced by the "
                                     f"roofline alone: run without a profile (got '{value}')")
    if profile is not None:
        compute = CalibratedCompute(profile, compute, model=scenario.model, reduce_dtype=reduce_dtype,
                                    reduce_dtypes=reduce_dtypes)
    # With a profile, what it does not time is this model at the gamma its reduction rows fit.
    network = model_network(config.network_model, topology, compute)
    runtime_memory = framework_memory({r: topology.devices[r].spec for r in ranks}, profile)
    choice, cores = None, ()
    if profile is not None:
        choice = calibrated_network(profile, network, topology,
                                    scenario_context(scenario.name, topology, context_group or ranks, dtype,
                                                     cores=config.cluster.cores, layout=layout,
                                                     pipelined=pipelined,
                                                     model=scenario.model if config.is_training else None),
                                    compute, compute.gap_s(topology.devices[ranks[0]]), context_group or ranks,
                                    copies=copies)
        network, compute.scale, cores = choice.network, choice.compute_scale, choice.cores
        compute.phase_scales = dict(choice.phase_scales)
        compute.by_shape = BY_SHAPE and not choice.same_cluster  # a replay keeps the ops as timed in place
    elif config.network_model == DEFAULT_TRANSPORT_MODEL:
        # Ranks outnumbering the cores they share take turns on them (sim.cores), and their
        # messages pay the gloo/tcp contention defaults (sim.transport.DefaultTransportNetwork).
        pool = declared_cores(scenario, topology, ranks)
        network = uncalibrated_network(config.network_model, topology, compute, pool, copies)
        cores = () if pool is None else (pool,)
    engine = Engine(topology, compute, CollectivePricer(network, topology), cores=cores)
    return Pricing(compute, network, engine, choice, runtime_memory, cores)


def solo_kinds(plan) -> frozenset[str]:
    """The compute op kinds of ``plan``'s prefill that only some of its ranks compute (the
    master's embedding and LM head; its layer norms in reduce_ln_bcast)."""
    kinds: dict[int, set[str]] = {rank: set() for rank in plan.ranks}
    for segment in plan.phase(0).segments:
        for rank, ops in segment.programs.items():
            kinds[rank].update(str(op.kind) for op in ops if op.collective is None and op.load is None)
    return frozenset(set().union(*kinds.values()) - set.intersection(*kinds.values()))


def calibrated_solo_kinds(scenario: Scenario, variant: Variant, layout: ParallelPlan) -> frozenset[str]:
    """The :func:`solo_kinds` a calibration of ``variant``'s strategy timed on a core of their own:
    those of its even tensor-parallel plan over the ranks of ``layout``'s first copy (how a
    calibration runs it, its context group), for a layout it did not run (a pipeline's stage plans
    compute other kinds on other ranks). Empty where that plan does not exist (heads that the
    ranks do not divide)."""
    try:
        return solo_kinds(scenario.plan(variant, layout.replica_ranks[0]))
    except ConfigError:
        return frozenset()


def simulate(scenario: Scenario, *, profile: Profile | None = None,
             expand_steps: tuple[int, ...] = (0, 1)) -> SimulationResult:
    """Simulate every variant of ``scenario``.

    Args:
        profile: a calibration profile; without one, compute is priced by the roofline and
            communication by the scenario's network model from datasheet figures, the flow
            model with each transport's documented per-message terms
            (:class:`sim.transport.DefaultTransportNetwork`); CPU ranks beyond the cores the
            cluster declares (``cluster.cores``) share them (:func:`declared_cores`).
        expand_steps: steps whose every op goes into the trace (0 = prefill, 1 = first decode step).

    Raises:
        ConfigError: an inconsistent scenario (devices without the dtype, an unknown algorithm or
            network model, a tensor-parallel degree that does not fit).
    """
    scenario.require_inference("simulate")
    config = scenario.config
    topology = build_topology(config.cluster)
    parallel = ParallelPlan.of(scenario, topology)
    layouts = {v.name: ParallelPlan.of(scenario, topology, v) for v in config.variants}
    every_rank = tuple(sorted({r for layout in layouts.values() for r in layout.ranks}))
    for index, variant in enumerate(config.variants):
        written = variant.parallel or config.parallel
        if layouts[variant.name].pipeline == 1 and written.micro_batches is not None:
            where = "" if variant.parallel is None else f"variants[{index}]."
            raise ConfigError(f"{where}parallel.micro_batches", f"micro-batches split a batch between pipeline "
                                                                f"stages; set parallel.pipeline (got {written.micro_batches})")
    # A rank runs its stage's layers once per micro-batch: the layers a rank runs per step.
    layers_per_rank = max(scenario.model.num_layers if layout.pipeline == 1 else max(layout.stages) * (
        (v.parallel or config.parallel).micro_batches or min(layout.pipeline, config.workload.batch_size))
        for v, layout in zip(config.variants, layouts.values()))
    # Each replica is a run of its own: R replicas of V variants cost what R x V variants do.
    copies = max(len(layout.replica_ranks) for layout in layouts.values())
    check_job_size(len(config.variants) * copies, layers_per_rank, len(every_rank) // copies,
                   config.workload.output_tokens,
                   ranks_field="parallel.tensor" if config.parallel.tensor else "cluster",
                   streamed_variants=sum(scenario.memory_policy(v).streams for v in config.variants) * copies)
    # With a profile, each layout is compared with what the profile measured on its own group: the
    # calibrated layout replays it, a pipeline or an uneven split is predicted (sim.context).
    pricings: dict[tuple, Pricing] = {}

    def pricing_of(layout: ParallelPlan) -> Pricing:
        # Replicas sharing cores contend in each other's messages: a pricing per replica count.
        key = (layout.replicas,) + ((layout.replica_ranks[0], layout.uncalibrated_layout) if profile is not None else ())
        if key not in pricings:
            built = pricings[key] = build_pricing(scenario, topology, every_rank, profile,
                                                  context_group=key[1] if profile is not None
                                                  else parallel.replica_ranks[0],
                                                  layout=key[2] if profile is not None else None,
                                                  pipelined=layout.pipeline > 1, copies=layout.replicas)
            if any(other.pipeline > 1 for other in layouts.values()):  # alike stages: collectives priced once
                built.engine.pricer = AlikeGroups(built.engine.pricer, topology, built.engine.links)
        return pricings[key]

    pricing_of(parallel)
    workload = config.workload
    variants, tables = [], []
    names = [d.name for d in topology.devices]
    for variant in config.variants:
        field = f"variants[{config.variants.index(variant)}]"
        layout = layouts[variant.name]
        pricing = pricing_of(layout)
        compute, engine, runtime_memory, cores = pricing.compute, pricing.engine, pricing.runtime_memory, pricing.cores
        calibrated = pricing.choice is not None  # a roofline op is priced on a core of its own already
        replicas = []
        batches = split_batch(workload.batch_size, layout.replicas)
        pipelines = []  # each replica's pipeline, where the layout is one
        if layout.pipeline > 1:
            try:
                pipelines = [pipeline_plan(scenario, variant, layout, runtime_memory, replica=i, batch_size=batch)
                             for i, batch in enumerate(batches)]
            except ConfigError as error:
                own = variant.memory if error.field.startswith("memory") else variant.parallel
                raise ConfigError(("" if own is None else f"{field}.") + error.field, error.message) from None
            if cores and calibrated:
                compute.solo_kinds = calibrated_solo_kinds(scenario, variant, layout)
        # Replicas on one machine share its cores: each runs on its share (sim.replicas).
        pools = [replica_pools(cores, layout.replica_ranks, group) if layout.replicas > 1 else cores
                 for group in layout.replica_ranks]
        twins = range(layout.replicas)  # the replica each one's run is a copy of (itself: simulated)
        if REUSE_ALIKE_REPLICAS and layout.replicas > 1 and not pipelines and not scenario.memory_policy(variant).streams:
            twins = replica_twins(topology, engine.links, layout.replica_ranks, batches, layout.replica_shards, pools,
                                  runtime_memory)
        for index, (group, shards, batch) in enumerate(zip(layout.replica_ranks, layout.replica_shards, batches)):
            engine.cores = pools[index]
            if pipelines:
                plan = pipelines[index]
            else:
                plan = scenario.plan(variant, group, runtime_memory, shards, batch_size=batch)
                if twins[index] != index:  # runs as an earlier replica: its run and trace, renamed (sim.alike)
                    twin = replicas[twins[index]]
                    ranks = dict(zip(twin.ranks, group))
                    replicas.append(ReplicaRun(group, batch, relabel_run(twin.run, plan, ranks),
                                               relabel_trace(twin.trace, ranks), twin.timing))
                    continue
                if cores and calibrated:
                    compute.solo_kinds = solo_kinds(plan)
            if plan.memory_policy.streams:
                try:
                    check_loader_paths(topology, plan.ranks)
                except ConfigError as error:
                    where = "memory" if variant.memory is None else f"{field}.memory"
                    raise ConfigError(error.field.replace("memory", where, 1), error.message) from None
            try:
                if pipelines:  # the other replicas' hops share the links with this one's (sim.pipeline_run)
                    run = simulate_pipeline_run(plan, engine, topology, (*pipelines[:index], *pipelines[index + 1:]))
                else:
                    run = simulate_run(plan, engine, topology)
            except ConfigError as error:
                # The registry names an unknown algorithm's field by its kind (allreduce, reduce,
                # broadcast): the variant's field of that name.
                raise ConfigError(f"{field}.{error.field}", error.message) from None
            trace = build_trace(run, expand_steps)
            timing = run_metrics(trace, batch)
            check_finite(timing, field, decodes=workload.output_tokens > 1)
            replicas.append(ReplicaRun(group, batch, run, trace, timing))
        run, trace = replicas[0].run, replicas[0].trace
        timing = combined_timing([r.timing for r in replicas]) if len(replicas) > 1 else replicas[0].timing
        peaks = {rank: peak for replica in replicas for rank, peak in peak_memory_bytes(replica.trace).items()}
        memory = {topology.devices[r].name: {Metric.PEAK_MEMORY: peaks[r],
                                             Metric.MEMORY_CAPACITY: topology.devices[r].memory_capacity_bytes}
                  for r in layout.ranks}
        algorithms = tuple(f"{kind}={name}" for kind, name in sorted(
            {a for replica in replicas for phase in replica.run.simulated.values() for res in phase.results
             for a in res.algorithms.values()}))
        variants.append(VariantResult(variant, run, trace, timing, algorithms, layout,
                                      tuple(replicas) if len(replicas) > 1 else (),
                                      calibration_mode(pricing.choice)))
        tables.append(result_rows(config.name, variant.name, "simulated", timing, memory))
        if len(replicas) > 1:
            tables.append(replica_rows(config.name, variant.name, "simulated", replicas, names))
        if layout.idle_devices:
            tables.append(idle_rows(config.name, variant.name, "simulated", layout.idle_devices))
    first = pricings[next(iter(pricings))]
    choice, network = first.choice, first.network
    extrapolated = tuple(sorted(set().union(*(p.compute.extrapolated | p.network.extrapolated
                                              for p in pricings.values())))) if profile is not None else ()
    if isinstance(network, DefaultTransportNetwork):
        contention = tuple(f"core contention: {pool.describe()} (the scenario's cluster.cores), sharing them as "
                           "the simulation runs (processor sharing)" for pool in first.cores)
        specs = [topology.devices[r].spec for r in every_rank]
        one_core = (*first.compute.one_core_lines(specs), *first.compute.accumulation_lines(specs),
                    *source_lines(scenario.model.weights, scenario.model.quantised_matmul, scenario.model.dtype),
                    *cache_lines(scenario.model.kv_cache))
        choice = NetworkChoice(network, False, (), (*one_core, *contention, *network.contention_lines(),
                                                    *sorted(network.used)))
    others = tuple((key[2] or f"tensor {len(key[1])}" + (f" x {key[0]} replicas" if key[0] > 1 else ""), p.choice)
                   for key, p in list(pricings.items())[1:]) if profile is not None else ()
    used = parallel.ranks if not parallel.variant_layouts else every_rank  # every device some variant runs on
    return SimulationResult(scenario, topology, used, tuple(variants), pd.concat(tables, ignore_index=True),
                            calibrated=profile is not None, extrapolated=extrapolated, network=choice,
                            parallel=parallel, layout_networks=others)

