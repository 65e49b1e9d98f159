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

from models.errors import ConfigError
from sim.budget import check_job_size
from sim.calibrated import CalibratedCompute, NetworkChoice, calibrated_network
from sim.context import scenario_context
from sim.transport import DEFAULT_TRANSPORT_MODEL, DefaultTransportNetwork
from sim.cost import RooflineCompute
from sim.engine import Engine
from sim.loader import check_loader_paths
from sim.memory import Overflow
from sim.metrics import peak_memory_bytes, result_rows, run_metrics
from sim.network import NETWORK_MODELS, CollectivePricer
from sim.parallel import ParallelPlan
from sim.profile import MeasurementKind, Profile
from sim.pipeline_run import AlikeGroups, simulate_pipeline_run
from sim.scenario import Scenario, Variant, pipeline_plan
from sim.timeline import RunResult, simulate_run
from sim.topology import Topology, build_topology
from sim.trace import Trace, build_trace
from sim.vocabulary import DECODE_METRICS, Metric


@dataclass(frozen=True)
class VariantResult:
    """One variant's run, trace, timing metrics and the algorithms its collectives resolved to
    (``"allreduce=ring"``, sorted)."""

    variant: Variant
    run: RunResult
    trace: Trace
    timing: dict[str, float]
    algorithms: tuple[str, ...]

    @property
    def overflow(self) -> Overflow | None:
        return self.run.overflow


@dataclass(frozen=True)
class SimulationResult:
    """Everything ``hetsim simulate`` reports: per-variant results and the tidy result table.

    ``calibrated``: priced from a calibration profile; ``extrapolated``: the predictions that fell
    outside what the profile measured (priced by the uncalibrated models, scaled), one line each;
    ``network``: how the profile priced the collectives (same-cluster replay or transferred terms).
    ``ranks``: the devices the variants run on (the scenario's layout, or every device some
    variant's own layout uses).
    """

    scenario: Scenario
    topology: Topology
    ranks: tuple[int, ...]
    variants: tuple[VariantResult, ...]
    results: pd.DataFrame
    calibrated: bool = False
    extrapolated: tuple[str, ...] = ()
    network: "NetworkChoice | None" = None

    @property
    def sources(self) -> tuple[str, ...]:
        """Where the calibrated prediction's terms come from (:mod:`sim.context`), one line each."""
        if self.network is None:
            return ()
        return (*(term.line() for term in self.network.terms), *self.network.sources)

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



def simulate(scenario: Scenario, *, profile: Profile | None = None,
             expand_steps: tuple[int, ...] = (0, 1)) -> SimulationResult:
    """Simulate every variant of ``scenario``.

    Args:
        profile: a calibration profile; without one, compute is priced by the roofline and
            communication by the scenario's network model from datasheet figures, the flow
            model with each transport's documented per-message terms
            (:class:`sim.transport.DefaultTransportNetwork`).
        expand_steps: steps whose every op goes into the trace (0 = prefill, 1 = first decode step).

    Raises:
        ConfigError: an inconsistent scenario (devices without the dtype, an unknown algorithm or
            network model, a tensor-parallel degree that does not fit).
    """
    config = scenario.config
    topology = build_topology(config.cluster)
    parallel = ParallelPlan.of(scenario, topology)
    layouts = {v.name: ParallelPlan.of(scenario, topology, v) for v in config.variants}
    ranks = parallel.ranks
    every_rank = sorted({r for layout in layouts.values() for r in layout.ranks})
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
    check_job_size(len(config.variants), layers_per_rank, len(every_rank), config.workload.output_tokens,
                   ranks_field="parallel.tensor" if config.parallel.tensor else "cluster",
                   streamed_variants=sum(scenario.memory_policy(v).streams for v in config.variants))
    dtype = scenario.model.dtype
    for rank in every_rank:
        topology.devices[rank].spec.peak_flops(dtype, field="dtype")
    compute = RooflineCompute(dtype, config.compute.flops_efficiency, config.compute.memory_efficiency,
                              config.compute.op_overhead_s)
    if config.network_model not in NETWORK_MODELS:
        raise ConfigError("network_model", f"unknown network model; known: {', '.join(NETWORK_MODELS)} "
                                           f"(got {config.network_model!r})")
    network = NETWORK_MODELS[config.network_model](
        topology, {d.rank: compute.reduce_s_per_byte(d) for d in topology.devices})
    runtime_memory: dict[int, int] = {}
    choice = None
    if profile is not None:
        gamma = compute.reduce_s_per_byte
        compute = CalibratedCompute(profile, compute)
        choice = calibrated_network(profile, network, topology, scenario_context(scenario.name, topology, ranks, dtype),
                                    gamma, compute.gap_s(topology.devices[ranks[0]]))
        network, compute.scale = choice.network, choice.compute_scale
        baseline = profile.of(MeasurementKind.MEMORY_BASELINE).groupby("device_class")["median"].median()
        runtime_memory = {r: int(baseline.get(topology.devices[r].spec.name, 0)) for r in every_rank}
    elif config.network_model == DEFAULT_TRANSPORT_MODEL:
        network = DefaultTransportNetwork(topology, {d.rank: compute.reduce_s_per_byte(d) for d in topology.devices})
    engine = Engine(topology, compute, CollectivePricer(network, topology))
    if any(layout.pipeline > 1 for layout in layouts.values()):  # alike stages: their collectives priced once
        engine.pricer = AlikeGroups(engine.pricer, topology, engine.links)
    workload = config.workload
    variants, tables = [], []
    for variant in config.variants:
        layout = layouts[variant.name]
        if layout.pipeline > 1:
            try:
                plan = pipeline_plan(scenario, variant, layout, runtime_memory)
            except ConfigError as error:
                own = variant.memory if error.field.startswith("memory") else variant.parallel
                where = "" if own is None else f"variants[{config.variants.index(variant)}]."
                raise ConfigError(where + error.field, error.message) from None
        else:
            plan = scenario.plan(variant, layout.ranks, runtime_memory)
        if plan.memory_policy.streams:
            try:
                check_loader_paths(topology, plan.ranks)
            except ConfigError as error:
                where = "memory" if variant.memory is None else f"variants[{config.variants.index(variant)}].memory"
                raise ConfigError(error.field.replace("memory", where, 1), error.message) from None
        try:
            run = (simulate_run if layout.pipeline == 1 else simulate_pipeline_run)(plan, engine, topology)
        except ConfigError as error:
            # The registry names an unknown algorithm's field by its kind (allreduce, reduce,
            # broadcast): the variant's field of that name.
            raise ConfigError(f"variants[{config.variants.index(variant)}].{error.field}", error.message) from None
        trace = build_trace(run, expand_steps)
        timing = run_metrics(trace, workload.batch_size)
        check_finite(timing, f"variants[{config.variants.index(variant)}]", decodes=workload.output_tokens > 1)
        peaks = peak_memory_bytes(trace)
        memory = {topology.devices[r].name: {Metric.PEAK_MEMORY: peaks[r],
                                             Metric.MEMORY_CAPACITY: topology.devices[r].memory_capacity_bytes}
                  for r in layout.ranks}
        algorithms = tuple(f"{kind}={name}" for kind, name in sorted(
            {a for phase in run.simulated.values() for res in phase.results for a in res.algorithms.values()}))
        variants.append(VariantResult(variant, run, trace, timing, algorithms))
        tables.append(result_rows(config.name, variant.name, "simulated", timing, memory))
    extrapolated = tuple(sorted(compute.extrapolated | network.extrapolated)) if profile is not None else ()
    if isinstance(network, DefaultTransportNetwork):
        choice = NetworkChoice(network, False, (), tuple(sorted(network.used)))
    used = ranks if not parallel.variant_layouts else tuple(every_rank)  # every device some variant runs on
    return SimulationResult(scenario, topology, used, tuple(variants), pd.concat(tables, ignore_index=True),
                            calibrated=profile is not None, extrapolated=extrapolated, network=choice)

