"""``simulate_training(scenario)``: a training scenario's variants, one optimizer step each, on the
simulator's engine and shared network.

Each variant's step (:func:`sim.training.lower.lower_step`) runs segment by segment on the
:class:`sim.engine.Engine`: compute ops on each rank's compute stream, DDP's bucket allreduces on
its communication stream, concurrent collectives sharing every link they cross on the segment's
fabric (:mod:`sim.fabric`) wherever they can meet. A segment that repeats (a forward layer, the
micro-batches before the one that synchronises) is simulated once: its instances are identical.
Under parameter averaging with period H the step time is the mean of H - 1 local steps and one
averaging step. Memory is :func:`models.training.training_memory` per device.

With a calibration profile (:mod:`sim.profile`), ops are priced as :func:`sim.simulate.simulate`
prices an inference step (:func:`sim.simulate.build_pricing`): forward ops from its ``compute``
rows, backward ops from its ``backward_input`` / ``backward_weight`` rows of the op kind, the
optimizer step from its ``optimizer_step`` rows of the variant's optimizer, each interpolated
along the op's roofline time (:class:`sim.calibrated.CalibratedCompute`); DDP's bucket
allreduces and the other collectives by the calibrated network (the profile's timings replayed on
the cluster it was measured on, its fitted transport terms and core contention elsewhere,
:func:`sim.calibrated.calibrated_network`), their reductions at the gamma fitted on the profile's
``reduction`` rows of the dtype each reduces in (:func:`sim.training.lower.reduction_dtypes`: a
bucket's gradients in :data:`models.training.GRADIENT_DTYPE`, or fp16 / bf16 under compression;
a tensor-parallel allreduce's compute dtype), its fp32 rows unscaled where the profile has none of
that dtype, and the sources say so (:mod:`sim.reduction`; the roofline's without any). What the
profile lacks is the uncalibrated model's and is listed in ``extrapolated``. Each rank's framework memory is the profile's
``memory_baseline`` (the backend's documented baseline without one), as the planner charges it
(:func:`sim.framework.framework_memory`).
A profile's whole forward and backward passes scale their ops' per-call time by what a pass does
to it (:mod:`sim.training.step_compute`), and where the profile's cores are fewer than the
ranks, the ranks and their comm threads share them as the step runs
(:mod:`sim.training.comm_thread`); ``sources`` says how. There, where the step's last ring releases the
ranks apart (a ring over fast and slow links, :mod:`sim.transport`'s send buffer), the step is
simulated again with each late rank asleep for its lag at the start of the bucket segment and
counted from the lag's end (:mod:`sim.training.lag`). A variant is priced from the profile's rows
of its own training precision (``amp_bf16`` and ``bf16_mixed`` both compute in bf16, their kernels
apart), else from another precision's of its compute dtype, which ``sources`` says
(:meth:`sim.profile.Profile.of_precision`, :func:`precision_source`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from models.errors import ConfigError
from models.ops import OpKind
from models.accounting import rank_parameter_count
from models.training import (GRADIENT_DTYPE, ActivationLayout, Precision, TrainingMemory, compute_dtype,
                             gradient_bytes_per_parameter, training_memory)
from sim.calibrated import NetworkChoice
from sim.collectives.registry import LIBRARY, known_algorithms
from sim.context import scenario_context, shared_calibration
from sim.cores import CorePool, core_shares
from sim.engine import Engine, SegmentResult
from sim.framework import Backend, backend_of
from sim.metrics import RESULT_COLUMNS
from sim.parallel import ParallelPlan
from sim.profile import MeasurementKind, Profile
from sim.scenario import Scenario, Variant
from sim.simulate import Pricing, build_pricing
from sim.topology import Topology, build_topology
from sim.trace import MEMORY_COLUMNS, OP_COLUMNS, STEP_COLUMNS, Trace, peak_table
from sim.training.comm_thread import SharedCores, schedule_work, shared_cores
from sim.training.lag import LAG_TOLERANCE_S, finish_lags, lagged_step, with_lags
from sim.training.step_compute import StepCompute, calibrated_tensor, nearest_factors, pass_factors
from sim.training.lower import (StepShape, TrainingStep, bucket_dtype, lower_step, scenario_reduction_dtypes,
                               tp_allreduce_algorithm)
from sim.training.symmetry import replica_images, replicas_identical
from sim.training.metrics import step_metrics
from sim.training_config import Averaging, TrainingSettings, micro_batching
from sim.vocabulary import Calibration, Metric, TrainingPhase, unit_of

MEMORY_CATEGORIES = {
    Metric.PEAK_MEMORY_WEIGHTS: "weights",
    Metric.PEAK_MEMORY_GRADIENTS: "gradients",
    Metric.PEAK_MEMORY_OPTIMIZER_STATES: "optimizer_states",
    Metric.PEAK_MEMORY_ACTIVATIONS: "activations",
    Metric.PEAK_MEMORY_BUCKET_BUFFERS: "bucket_buffers",
    Metric.PEAK_MEMORY_FRAMEWORK: "framework",
}
"""The per-device memory metrics and the :class:`models.training.TrainingMemory` field of each."""


@dataclass(frozen=True)
class SimulatedStep:
    """One lowered step and the engine's result of each of its segments (in order).

    ``mirrors``: rank -> the rank of replica 0 whose ops and times it repeats, for the ranks of
    replicas that were not simulated because they run identically (:mod:`sim.training.symmetry`);
    empty when every replica was simulated. ``overlap_s``: how much of the segments' time the
    step shares with the one before (ranks that start it asleep in that step's last ring,
    :mod:`sim.training.lag`); its duration is the segments' less that."""

    step: TrainingStep
    results: tuple[SegmentResult, ...]
    mirrors: dict[int, int] = field(default_factory=dict)
    overlap_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return sum(s.segment.repeat * r.duration_s for s, r in zip(self.step.segments, self.results)) - self.overlap_s


@dataclass(frozen=True)
class TrainingVariantResult:
    """One variant: its settings, batch split, simulated steps (the averaging step last), metrics
    and memory per rank; ``trace``, the last step's, is built when first asked for."""

    variant: Variant
    settings: TrainingSettings
    micro_batch_size: int
    accumulation: int
    steps: tuple[SimulatedStep, ...]
    metrics: dict[str, float]
    memory: dict[int, TrainingMemory]

    @cached_property
    def trace(self) -> Trace:
        return _trace(self.steps[-1], self.memory)


@dataclass(frozen=True)
class TrainingSimulation:
    """What ``hetsim simulate`` reports for a training scenario.

    ``calibrated``: priced from a profile; ``calibrated_terms``: the compute terms the profile
    priced (``backward_weight mlp_up on cpu``), one line each; ``extrapolated``: the terms it did
    not price, or priced outside its measured shapes (uncalibrated model, scaled), one line each;
    ``network``: how it priced the collectives (same-cluster replay or transferred terms)."""

    scenario: Scenario
    topology: Topology
    plan: ParallelPlan
    variants: tuple[TrainingVariantResult, ...]
    results: pd.DataFrame
    calibrated: bool = False
    calibrated_terms: tuple[str, ...] = ()
    extrapolated: tuple[str, ...] = ()
    network: NetworkChoice | None = None
    step_terms: tuple[str, ...] = ()

    @property
    def sources(self) -> tuple[str, ...]:
        """The scenario's terms against the profile's context and where the calibrated prediction's
        network terms come from (:mod:`sim.context`), how the ranks' comm threads share the cores
        (:mod:`sim.training.comm_thread`) and what each pass's factor is, one line each."""
        if self.network is None:
            return self.step_terms
        return (*self.network.lines(), *self.step_terms)

    @property
    def calibrations(self) -> dict[str, Calibration]:
        """How each variant was priced (variant name -> mode): every variant alike, one network
        for all (:func:`sim.context.shared_calibration`)."""
        return shared_calibration((v.variant.name for v in self.variants), self.network)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for replica in self.plan.replica_ranks for rank in replica)

    def variant(self, name: str) -> TrainingVariantResult:
        return next(v for v in self.variants if v.variant.name == name)


MAX_WORK_UNITS = 30_000
"""The bound on a training job's estimated work (:func:`training_work_units`): one unit is about
35 ops to lower, run and trace, 1 ms of the 2-core development machine. The shipped scenarios are
1,760 to 20,480 units (the 2 x 4 RTX 3060 one, whose data-parallel groups share each host's NIC,
45 s with its outputs); the bound keeps a job around a minute and its trace under about 700,000
rows."""
MAX_MICRO_BATCHES = 4096
"""Micro-batches per optimizer step: each is a span of the trace and a pass of the metrics."""
FABRIC_WEIGHT = 10
"""How much more a rank's ops cost when data-parallel groups share a channel: their collectives,
and those crossing the same channels, run transfer by transfer on the shared fabric."""
_PRICING_UNITS_PER_SQUARED_RANK = 1 / 117  # a distinct bucket's ring over D ranks: 2 D^2 transfers of ~3 us


def training_work_units(scenario: Scenario, plan: ParallelPlan, topology: Topology) -> float:
    """The estimated work of simulating every variant of a training scenario: per variant, ranks x
    decoder layers (times :data:`FABRIC_WEIGHT` where data-parallel groups share a channel), plus
    pricing each distinct bucket's allreduce over the D data-parallel ranks (about as many sizes as
    buckets, at most two a layer, D^2 transfers each). Every replica is counted: whether
    identical ones are simulated once is known only when they are lowered."""
    spec = scenario.model
    ranks = plan.tensor * plan.data
    shared = _data_groups_share_a_channel(plan, topology)
    params = rank_parameter_count(spec, plan.tensor, is_master=True)
    units = 0.0
    for variant in scenario.config.variants:
        settings = scenario.training_settings(variant)
        buckets = params * gradient_bytes_per_parameter(settings.precision) / settings.bucket_cap_bytes + 1
        sizes = min(buckets, 2 * spec.num_layers + 2)
        units += ranks * spec.num_layers * (FABRIC_WEIGHT if shared else 1)
        units += sizes * plan.data**2 * _PRICING_UNITS_PER_SQUARED_RANK
    return units


def _data_groups_share_a_channel(plan: ParallelPlan, topology: Topology) -> bool:
    owner: dict[str, int] = {}
    for position in range(plan.tensor):
        group = [replica[position] for replica in plan.replica_ranks]
        for src, dst in zip(group, group[1:] + group[:1]):
            for channel in (topology.path(src, dst) if src != dst else ()):
                if owner.setdefault(channel.name, position) != position:
                    return True
    return False


def check_training_job_size(scenario: Scenario, plan: ParallelPlan, topology: Topology) -> None:
    """Refuse, naming the field, a training job past :data:`MAX_WORK_UNITS`
    (:func:`training_work_units`) or :data:`MAX_MICRO_BATCHES`.

    Raises:
        ConfigError: on ``variants`` (when one variant alone would fit), else ``parallel.data`` or
            ``cluster`` (the data degree's source); on ``workload.global_batch_size`` or a
            variant's ``training.gradient_accumulation`` for too many micro-batches.
    """
    config = scenario.config
    for index, variant in enumerate(config.variants):
        settings = scenario.training_settings(variant)
        for name, size in (("bucket_cap_mb", settings.bucket_cap_bytes), ("first_bucket_mb", settings.first_bucket_bytes)):
            if size < 1:
                written = variant.training is not None and name in variant.training.model_fields_set
                raise ConfigError(f"variants[{index}].training.{name}" if written else f"training.{name}",
                                  f"less than a byte (got {getattr(settings, name)})")
    units = training_work_units(scenario, plan, topology)
    if units > MAX_WORK_UNITS:
        field = "variants" if units / len(config.variants) <= MAX_WORK_UNITS else \
            ("parallel.data" if config.parallel.data is not None else "cluster")
        raise ConfigError(field, f"{len(config.variants)} variants over {plan.tensor * plan.data} ranks of "
                                 f"{scenario.model.num_layers} layers are about {units:.0f} units of work, more than "
                                 f"the {MAX_WORK_UNITS} hetsim simulates in a training scenario (got {units:.0f})")
    for index, variant in enumerate(config.variants):
        settings = scenario.training_settings(variant)
        micro = settings.gradient_accumulation or config.workload.global_batch_size // (
            config.workload.micro_batch_size * plan.data) or 1
        if micro > MAX_MICRO_BATCHES:
            field = f"variants[{index}].training.gradient_accumulation" if settings.gradient_accumulation \
                else "workload.global_batch_size"
            raise ConfigError(field, f"{micro} micro-batches per step, more than the {MAX_MICRO_BATCHES} hetsim "
                                     f"simulates (got {micro})")


def simulate_training(scenario: Scenario, profile: Profile | None = None) -> TrainingSimulation:
    """Simulate one optimizer step of every variant of a training ``scenario``, priced by the
    roofline and the scenario's network model, or from a calibration ``profile`` (see the module
    docstring).

    Raises:
        ConfigError: a scenario that does not fit (devices without the compute dtype, degrees
            the cluster or model cannot take, batches that do not split, an unknown network model
            or algorithm), naming the field.
    """
    config = scenario.config
    if not config.is_training:
        raise ConfigError("workload.kind", "simulate_training takes training workloads (got inference)")
    topology = build_topology(config.cluster)
    plan = ParallelPlan.of(scenario, topology)
    check_training_job_size(scenario, plan, topology)
    ranks = tuple(rank for replica in plan.replica_ranks for rank in replica)
    # Keyed by (compute dtype, the precision whose rows price it): amp_bf16 and bf16_mixed compute
    # in bf16 with kernels apart, each priced from its own rows (sim.profile.Profile.of_precision).
    pricings: dict[tuple[str, Precision | None], Pricing] = {}
    shared: SharedCores | None = None
    factors: dict[tuple[str, Precision | None], dict] = {}  # -> (pass, micro batch) -> in-step factor (step_compute)
    step_terms: list[str] = []
    variants, tables = [], []
    precisions = tuple(dict.fromkeys(scenario.training_settings(v).precision for v in config.variants))
    reduce_dtypes = scenario_reduction_dtypes(scenario, plan.tensor)  # whose reduction terms the sources give
    for index, variant in enumerate(config.variants):
        where = f"variants[{index}]"
        settings = scenario.training_settings(variant)
        dtype = compute_dtype(settings.precision)
        for rank in ranks:
            topology.devices[rank].spec.peak_flops(dtype, field=f"{where}.training.precision")
        rows, timed_in = (None, None) if profile is None else profile.of_precision(settings.precision)
        key = (dtype, timed_in)
        if key not in pricings:
            # The context is the data-parallel ranks': a training calibration runs one rank each.
            # Each collective reduces in its own dtype (Collective.dtype, sim.training.lower): DDP's
            # buckets fp32 gradients under every precision unless compressed, the tensor-parallel
            # allreduces the compute dtype's activations; that dtype's reduction rows price it.
            pricings[key] = build_pricing(scenario, topology, ranks, rows, context_group=ranks, dtype=dtype,
                                          reduce_dtype=GRADIENT_DTYPE, reduce_dtypes=reduce_dtypes)
            if profile is not None:  # its rows time one op per call (sim.training.step_compute)
                pricings[key].compute.per_call_latency = True
            if profile is not None and shared is None:
                shared = shared_cores(profile, pricings[key].network, scenario_context(
                    scenario.name, topology, ranks, dtype), ranks)
            if shared is not None and pricings[key].choice.same_cluster:
                # Replayed op times hold every rank computing at once (sim.training.comm_thread).
                pricings[key].compute.scale = min(1.0, shared.pool.cores / len(ranks))
        if profile is not None:
            line = precision_source(profile, settings.precision, timed_in, precisions)
            if line is not None and line not in step_terms:
                step_terms.append(line)
        pricing = pricings[key]
        engine = pricing.engine
        if profile is not None:
            pricing.compute.optimizer = settings.optimizer.value
        try:
            micro, accumulation = micro_batching(config.workload, settings, plan.data)
        except ConfigError as error:
            field = error.field if error.field.startswith("workload") else f"{where}.{error.field}"
            raise ConfigError(field, error.message) from None
        if profile is not None:
            if key not in factors:
                device = topology.devices[ranks[0]]
                factors[key], lines = pass_factors(rows, device, dtype, scenario.model.with_dtype(dtype),
                                                   settings, config.workload.sequence_length, pricing.compute,
                                                   ranks[0], calibrated_tensor(rows, plan.tensor))
                timed = "" if timed_in is None else f" ({timed_in.value} rows)"
                step_terms += [line + timed for line in lines] or [
                    f"in-step passes on {device.spec.name} {dtype}{timed}: not calibrated (the ops' sum, x 1)"]
            queued = backend_of(topology.devices[ranks[0]].spec) is Backend.NCCL  # CUDA: the host queues kernels
            engine.compute = StepCompute(pricing.compute, nearest_factors(factors[key], micro),
                                         recompute_pass=OpKind.BACKWARD if queued else OpKind.FORWARD,
                                         bucket_dtype=bucket_dtype(settings))
            if shared is not None:
                engine.compute.message_work_s = shared.message_work_s[settings.allreduce == LIBRARY]
                engine.compute.work = _bucket_work(engine, settings.allreduce, plan.replica_ranks,
                                                   bucket_dtype(settings))
        tp_algorithm = tp_allreduce_algorithm(variant, backend_of(topology.devices[ranks[0]].spec))
        if tp_algorithm not in known_algorithms(OpKind.ALLREDUCE):
            raise ConfigError(f"{where}.allreduce", f"unknown allreduce algorithm for the tensor-parallel "
                                                   f"allreduces; known: {', '.join(known_algorithms(OpKind.ALLREDUCE))} "
                                                   f"(got {tp_algorithm!r})")
        if profile is not None and plan.tensor > 1:
            step_terms += [line for line in tensor_parallel_sources(rows, plan, topology, tp_algorithm, micro,
                                                                     config.workload.sequence_length,
                                                                     scenario.model.with_dtype(dtype))
                           if line not in step_terms]
        shape = StepShape(scenario.model.with_dtype(dtype), settings, micro, config.workload.sequence_length,
                          accumulation, plan.replica_ranks, tp_algorithm, comm_thread=shared is not None)
        try:
            # Each rank's framework: the one definition the planner charges too (sim.framework).
            result = _simulate_variant(variant, shape, engine, topology, config.workload, pricing.runtime_memory,
                                       shared.pool if shared is not None else None)
        except ConfigError as error:
            field = error.field if error.field.startswith(("variants", "workload", "cluster")) else \
                f"{where}.{error.field}"
            raise ConfigError(field, error.message) from None
        for metric, value in result.metrics.items():
            if not math.isfinite(value):
                raise ConfigError(where, f"the simulated {metric} is not a finite number; the scenario's magnitudes "
                                         f"are out of any useful range (got {value})")
        variants.append(result)
        tables.append(_rows(config.name, variant.name, result, topology))
    results = pd.concat(tables, ignore_index=True)
    if profile is None:
        return TrainingSimulation(scenario, topology, plan, tuple(variants), results)
    calibrated, extrapolated = set(), set()
    for pricing in pricings.values():
        calibrated |= pricing.compute.calibrated
        extrapolated |= pricing.compute.extrapolated | pricing.network.extrapolated
    return TrainingSimulation(scenario, topology, plan, tuple(variants), results, calibrated=True,
                              calibrated_terms=tuple(sorted(calibrated)), extrapolated=tuple(sorted(extrapolated)),
                              network=next(iter(pricings.values())).choice,
                              step_terms=(*(shared.sources if shared is not None else ()), *step_terms))


_KERNELS = {Precision.FP32: "fp32 weights", Precision.AMP_BF16: "autocast over fp32 weights",
            Precision.BF16_MIXED: "bf16 copies of fp32 weights"}
"""What a precision's kernels compute on, as the runtime trains it (:mod:`runtime.training.precision`)."""


def precision_source(profile: Profile, precision: Precision, timed_in: Precision | None,
                     precisions: tuple[Precision, ...]) -> str | None:
    """The line saying which rows price the ``precision`` variants of a scenario whose variants
    train in ``precisions``, where they are not their own: ``timed_in`` (what
    :meth:`sim.profile.Profile.of_precision` chose) another precision's, none (the roofline), or a
    profile that records no precision pricing two precisions of one compute dtype alike. None
    where the variants are priced from their own rows, or the profile's rows, recording no
    precision, price only this precision of their dtype."""
    kernels = f"{precision.value} variants ({_KERNELS[precision]})"
    recorded = profile.precisions()
    if timed_in is precision:
        return None
    if timed_in is not None:
        return (f"{kernels}: the profile times no {precision.value} ops; priced from its {timed_in.value} rows "
                f"({_KERNELS[timed_in]}), the same compute dtype {compute_dtype(precision)}")
    if recorded:
        return (f"{kernels}: the profile times no {compute_dtype(precision)} training ops (it times "
                f"{', '.join(p.value for p in recorded)}): the roofline prices their forward and backward ops")
    alike = [p for p in precisions if compute_dtype(p) == compute_dtype(precision)]
    if len(alike) > 1:
        return (f"{' and '.join(p.value for p in alike)} variants: the profile records no precision (written "
                f"before profiles did); its {compute_dtype(precision)} rows price them alike")
    return None


def tensor_parallel_sources(profile: Profile, plan: ParallelPlan, topology: Topology, algorithm: str, micro: int,
                            sequence: int, model) -> list[str]:
    """What prices a calibrated tensor-parallel step, one line each: which rows price the layer
    ops (timed at the plan's shard, or at whole layers and scaled along the roofline,
    :func:`sim.training.step_compute.calibrated_tensor`), and which ``collective`` rows price the
    tensor-parallel allreduce of ``algorithm`` at the hidden state's size (``micro x sequence x
    hidden`` elements of ``model``'s dtype, bytes) over the replica's ranks."""
    tensor = calibrated_tensor(profile, plan.tensor)
    rows = f"timed at tensor {tensor}" if tensor == plan.tensor else \
        "of whole layers (tensor 1), scaled along the roofline to the shard"
    lines = [f"tensor-parallel layer ops ({plan.tensor}-way shard): compute and backward rows {rows}"]
    replica = plan.replica_ranks[0]
    hosts = len(topology.host_groups(replica))
    size = micro * sequence * model.hidden_size * model.dtype_bytes
    sweep = profile.of(MeasurementKind.COLLECTIVE)
    sweep = sweep[(sweep["op"] == str(OpKind.ALLREDUCE)) & (sweep["algorithm"] == algorithm)
                  & (sweep["group_size"] == plan.tensor) & (sweep["num_hosts"] == hosts)]
    what = f"tensor-parallel allreduce {algorithm} over {plan.tensor} ranks on {hosts} hosts at {size} bytes"
    if sweep.empty:
        lines.append(f"{what}: no collective rows, the network model")
    else:
        sizes = sweep["size_bytes"].astype(int)
        within = "within" if sizes.min() <= size <= sizes.max() else "outside"
        lines.append(f"{what}: collective rows at {len(sizes)} sizes, {sizes.min()} to {sizes.max()} bytes "
                     f"({within} them{', the size itself timed' if (sizes == size).any() else ''})")
    return lines


def _bucket_work(engine: Engine, algorithm: str, replicas: tuple[tuple[int, ...], ...], dtype: str):
    """``(bucket bytes, rank) -> (core turns of the bucket's allreduce schedule on the rank,
    bytes it reduces)``, over the rank's data-parallel group (its position in every replica),
    ``algorithm`` resolved as the engine resolves it for a bucket reducing in ``dtype``
    (:func:`sim.training.comm_thread.schedule_work`)."""
    position = {rank: t for replica in replicas for t, rank in enumerate(replica)}

    def work(size_bytes: int, rank: int) -> tuple[int, int]:
        group = tuple(replica[position[rank]] for replica in replicas)
        resolved, _ = engine.pricer.price(OpKind.ALLREDUCE, algorithm, group, size_bytes, dtype=dtype)
        return schedule_work(engine.pricer.schedule(OpKind.ALLREDUCE, resolved, group, size_bytes, dtype=dtype), rank)

    return work


def _simulate_variant(variant: Variant, shape: StepShape, engine: Engine, topology: Topology, workload,
                      framework: dict[int, int], pool: CorePool | None = None) -> TrainingVariantResult:
    """One variant's steps; ``pool``: the cores every rank shares (None: as the engine has them),
    of which the simulated ranks get their share (:func:`sim.cores.core_shares`)."""
    settings = shape.settings
    if settings.averaging is Averaging.PARAMETERS:
        period = settings.averaging_period
        # (synchronise gradients, average parameters, steps of the period)
        kinds = ([(False, False, period - 1)] if period > 1 else []) + [(False, True, 1)]
    else:
        kinds = [(True, False, 1)]
    steps = []
    for sync, average, _ in kinds:
        simulated = None
        step = lower_step(shape, sync_gradients=sync, average_parameters=average, first_replica_only=True)
        if replicas_identical(shape, step, engine, topology):
            mirrors = {rank: shape.replicas[0][t] for replica in shape.replicas[1:] for t, rank in enumerate(replica)}
            simulated = _run_step(step, engine, pool, replica_images(shape), mirrors)
        if simulated is None:  # the replicas differ, or their collectives would meet on a channel
            simulated = _run_step(lower_step(shape, sync_gradients=sync, average_parameters=average), engine, pool)
        lags = finish_lags(simulated) if pool is not None and isinstance(engine.compute, StepCompute) else {}
        if any(lag_s > LAG_TOLERANCE_S for lag_s in lags.values()):
            # On shared cores, where the last ring releases the ranks apart (sim.training.lag).
            engine.compute.lags = lags
            try:
                lagged = with_lags(lower_step(shape, sync_gradients=sync, average_parameters=average), lags)
                simulated = lagged_step(_run_step(lagged, engine, pool), lags)
            finally:
                engine.compute.lags = {}
        steps.append(simulated)
    weights = [count for _, _, count in kinds]
    memory = _memory(shape, framework)
    metrics = step_metrics(steps, weights, shape, workload)
    return TrainingVariantResult(variant, settings, shape.micro_batch_size, shape.accumulation, tuple(steps),
                                 metrics, memory)


def _run_step(step: TrainingStep, engine: Engine, pool: CorePool | None, images: tuple[dict[int, int], ...] = (),
              mirrors: dict[int, int] | None = None) -> SimulatedStep | None:
    """``step`` run segment by segment (each distinct segment once), its ranks sharing ``pool``'s
    cores where given; with ``images`` (:func:`sim.training.symmetry.replica_images`), ``step``
    holds replica 0 alone and stands for every replica (``mirrors``): None where the engine finds
    that the replicas must be simulated whole (:meth:`sim.engine.Engine.run_segment`)."""
    if pool is not None:
        engine.cores = core_shares(pool, frozenset(step.segments[0].segment.programs))
    segments = list({id(part.segment): part.segment for part in step.segments}.values())
    if images:
        # The segments whose collectives span the replicas (as replica 0's first rank calls
        # them) first: where the replicas must be simulated whole, they are the ones that say
        # so (a segment's times do not depend on the order the segments run in).
        ranks = set(step.segments[0].segment.programs)
        segments.sort(key=lambda segment: not any(op.collective is not None and not ranks.issuperset(
            op.collective.group) for op in next(iter(segment.programs.values()), ())))
    memo: dict[int, SegmentResult] = {}  # segment id -> result: the step keeps its segments alive
    for segment in segments:
        result = memo[id(segment)] = engine.run_segment(segment, images)
        if result is None:
            return None
    return SimulatedStep(step, tuple(memo[id(part.segment)] for part in step.segments), mirrors or {})


def _memory(shape: StepShape, framework: dict[int, int]) -> dict[int, TrainingMemory]:
    """Memory by category per rank; ``framework``: the runtime's own bytes per rank (0 where absent)."""
    settings = shape.settings
    layout = ActivationLayout(shape.micro_batch_size, shape.sequence_length, shape.tensor, loss=settings.loss)
    model = shape.model
    memory = {}
    for replica in shape.replicas:
        for rank in replica:  # every TP rank holds the embeddings and the LM head (sim.training.lower)
            memory[rank] = training_memory(model, layout, optimizer=settings.optimizer, precision=settings.precision,
                                           data_parallel=shape.data, zero_stage=settings.zero,
                                           gradient_as_bucket_view=settings.gradient_as_bucket_view,
                                           checkpoint_every=settings.activation_checkpointing,
                                           framework_baseline_bytes=framework.get(rank, 0),
                                           accumulation=shape.accumulation)
    return memory


def _trace(simulated: SimulatedStep, memory: dict[int, TrainingMemory]) -> Trace:
    """The trace of one step: a span per segment run (every micro-batch), the op instances of
    the last micro-batch and the optimizer step (``phase``: the op's :class:`TrainingPhase`,
    ``step``: its micro-batch; the micro-batches before it repeat the same ops, without or with
    their own allreduces), and memory samples per rank (the model states, plus the activations
    of a micro-batch from the end of its forward to the end of its backward)."""
    op_parts, spans = [], []
    offset = 0.0
    source = {rank: rank for rank in simulated.step.segments[0].segment.programs} | simulated.mirrors
    ranks = sorted(source)
    last = simulated.step.segments[-1].micro_batch
    activation_marks = []  # (time at which a micro-batch's activations are all held, time freed)
    forward_end = 0.0
    columns: dict[tuple[int, int], dict] = {}  # (segment id, simulated rank) -> the op columns of its program
    for part, result in zip(simulated.step.segments, simulated.results):
        segment = part.segment
        end_s = offset + segment.repeat * result.duration_s
        phases = part.phases.get(source[ranks[0]])
        spans.append((part.micro_batch, str(phases[0] if phases else TrainingPhase.OPTIMIZER), offset, end_s, 0.0))
        if segment.name == "forward_epilogue":
            forward_end = end_s
        elif segment.name.startswith("backward"):
            activation_marks.append((forward_end, end_s))
        if part.micro_batch == last:
            op_parts += [_op_frame(part, result, rank, source[rank], offset, columns) for rank in ranks
                         if segment.programs[source[rank]]]
        offset = end_s
    ops = (pd.concat(op_parts, ignore_index=True) if op_parts else pd.DataFrame(columns=OP_COLUMNS))[OP_COLUMNS]
    steps = pd.DataFrame(spans, columns=STEP_COLUMNS)
    samples = []
    for rank in ranks:
        states = memory[rank].total - memory[rank].activations
        samples.append((rank, 0.0, states))
        for held_s, freed_s in activation_marks:
            samples += [(rank, held_s, memory[rank].total), (rank, freed_s, states)]
    return Trace(ops.sort_values(["rank", "start_s"], kind="stable").reset_index(drop=True), steps,
                 pd.DataFrame(samples, columns=MEMORY_COLUMNS),
                 peak_table({rank: memory[rank].total for rank in ranks}))


def _op_frame(part, result: SegmentResult, rank: int, simulated_rank: int, offset: float, columns) -> pd.DataFrame:
    """The op rows of every instance of ``part``'s segment on ``rank``, whose ops and times are
    those of ``simulated_rank`` (itself, or the replica-0 rank it mirrors)."""
    segment = part.segment
    key = (id(segment), simulated_rank)
    if key not in columns:
        program = segment.programs[simulated_rank]
        columns[key] = {
            "stream": np.array([op.stream.value for op in program], dtype=object),
            "kind": np.array([op.kind.value for op in program], dtype=object),
            "name": np.array([op.name for op in program], dtype=object),
            "phase": np.array([str(p) for p in part.phases[simulated_rank]], dtype=object),
            "layer": np.array([-1 if op.layer is None else op.layer for op in program]),
            "bytes": np.array([op.traffic_bytes for op in program]),
            "flops": np.array([op.flops for op in program]),
        }
    fixed = columns[key]
    n, repeat = len(fixed["name"]), segment.repeat
    instance = np.repeat(np.arange(repeat), n)
    shift = offset + instance * result.duration_s
    frame = {name: np.tile(values, repeat) for name, values in fixed.items()}
    if segment.layers:
        frame["layer"] = instance
    return pd.DataFrame(frame | {"rank": rank, "step": part.micro_batch,
                                 "start_s": shift + np.tile(result.starts[simulated_rank], repeat),
                                 "end_s": shift + np.tile(result.ends[simulated_rank], repeat)})


def _rows(scenario: str, variant: str, result: TrainingVariantResult, topology: Topology) -> pd.DataFrame:
    rows = [(scenario, variant, "simulated", metric, value, unit_of(metric), "")
            for metric, value in result.metrics.items()]
    for rank, memory in sorted(result.memory.items()):
        device = topology.devices[rank]
        values = {Metric.PEAK_MEMORY: memory.total, Metric.MEMORY_CAPACITY: device.memory_capacity_bytes}
        values |= {metric: getattr(memory, field) for metric, field in MEMORY_CATEGORIES.items()}
        rows += [(scenario, variant, "simulated", metric, float(value), unit_of(metric), device.name)
                 for metric, value in values.items()]
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)
