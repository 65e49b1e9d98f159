"""A training plan's candidates: the layouts of a cluster, exact memory, a step-time bound, results.

A training candidate (``workload: {kind: training, ...}``, :mod:`sim.planning.plan_config`) is a
cluster, a **layout** on it and a variant (training settings). The layouts are data parallelism
over every device, with tensor parallelism of degree T inside each data-parallel replica, for
every T that divides the devices of a host and shards the model evenly: a replica never spans
hosts, where its per-layer allreduces would cross the network (Megatron-LM's placement,
Narayanan et al. 2021, arXiv 2104.04473, section 3.2). Replica d runs on devices d T .. d T + T - 1
(:class:`sim.parallel.ParallelPlan`), so on a mixed cluster each replica is of one device type.

The search's stages (:mod:`sim.planning.search`) read, for a training candidate:

* ``layout``: T does not shard the model, the global batch does not split into
  ``micro_batch_size`` x D x accumulation, or a device lacks the precision's compute dtype;
* ``memory``: the step's memory exceeds a device's capacity. It is exact, not a bound: the
  training simulator's memory is the same closed form (:func:`models.training.training_memory`:
  weights, gradients, optimizer states, activations, DDP's buckets) plus the framework baseline
  of the device's backend (:mod:`sim.framework`);
* ``bound``: a lower bound of the step time misses ``slo.step_time`` (or its tokens/s upper bound
  misses ``slo.tokens_per_s``). The step lasts at least its compute and at least its gradient
  synchronisation across hosts, whichever is longer (they overlap at best):

  - compute: every compute op of one replica's step (forward, backward, recomputation,
    optimizer, each micro-batch) priced by the simulator's roofline
    (:class:`sim.cost.RooflineCompute`) on each device type the cluster has, the slowest taken: a
    rank runs its compute ops one at a time and every replica waits for the others' gradients;
  - network: an allreduce of S bytes over a group with ranks on both sides of a cut carries at
    least S bytes across it each way (each side needs the other side's sum of every element;
    the bound under Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms for
    clusters of workstations", JPDC 69(2), section 3, for a cut of one rank). Every data-parallel
    group spans every host, so each host's network links carry the bytes of every data-parallel
    allreduce of the step (the lowered step's, in their wire dtype) out of the host, at most at
    their bandwidth together. Parameter averaging synchronises every H steps and is not bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from models.errors import ConfigError
from models.shards import check_tensor_parallel
from models.spec import ModelSpec
from models.training import ActivationLayout, compute_dtype, training_memory
from sim.cost import RooflineCompute
from sim.devices import DEVICES
from sim.framework import framework_memory
from sim.parallel import layout_label
from sim.scenario import ComputeSettings, Variant
from sim.topology import Device
from sim.training.lower import StepShape, TrainingStep, lower_step
from models.ops import OpKind
from sim.training_config import Averaging, TrainingSettings, TrainingWorkload, micro_batching
from sim.vocabulary import Metric

TRAINING_COLUMNS = ["parallel", Metric.STEP_TIME, Metric.TOKENS_PER_S, Metric.SAMPLES_PER_S,
                    Metric.EXPOSED_COMMUNICATION, "step_time_lower_bound_s"]
"""A training plan's columns beyond the plan's own: the layout (``TP=2 x DP=4``), the simulated
step time (s), trained tokens/s and samples/s, the communication no compute hides (s), and the
step-time lower bound (s)."""


@dataclass(frozen=True)
class TrainingLayout:
    """``tensor`` ranks per replica, ``data`` replicas."""

    tensor: int
    data: int

    def label(self) -> str:
        """The layout in a few words (:func:`sim.parallel.layout_label`)."""
        return layout_label(self.tensor, data=self.data)

    def parallel(self) -> dict:
        """The scenario's ``parallel`` section."""
        return {"tensor": self.tensor, "data": self.data}


def layouts(num_devices: int, devices_per_host: int) -> list[TrainingLayout]:
    """Every tensor degree that divides a host's devices, with data parallelism over the rest."""
    return [TrainingLayout(t, num_devices // t) for t in range(1, devices_per_host + 1) if devices_per_host % t == 0]


def settings_of(training: TrainingSettings | None, variant: Variant) -> TrainingSettings:
    """A variant's training settings: the plan's ``training`` section with the variant's fields over it."""
    return (training or TrainingSettings()).merged(variant.training)


def layout_problem(spec: ModelSpec, layout: TrainingLayout, workload: TrainingWorkload, settings: TrainingSettings,
                   device_types: set[str]) -> str:
    """Why ``layout`` cannot run this variant ('' if it can): the model's shards, the batch split,
    a device without the compute dtype."""
    try:
        check_tensor_parallel(spec, layout.tensor)
        micro_batching(workload, settings, layout.data)
    except ConfigError as error:
        return f"{layout.label()}: {error.message}"
    dtype = compute_dtype(settings.precision)
    for device in sorted(device_types):
        if dtype not in DEVICES[device].peak_flops_per_s:
            return f"{device} has no {dtype} rate (training.precision {settings.precision})"
    return ""


def memory_problem(spec: ModelSpec, layout: TrainingLayout, workload: TrainingWorkload, settings: TrainingSettings,
                   device_types: tuple[str, ...]) -> str:
    """A rank whose step needs more than its device holds (exact: see the module docstring), described; ''."""
    micro, accumulation = micro_batching(workload, settings, layout.data)
    activations = ActivationLayout(micro, workload.sequence_length, layout.tensor, loss=settings.loss)
    # Every rank holds the same (its layers' shard and the replicated head: sim.training.lower);
    # check each device type the layout lands on.
    ranks = layout.tensor * layout.data
    for device in sorted(set(device_types)):
        specs = {r: DEVICES[device] for r in range(ranks)}
        framework = framework_memory(specs)[0]
        memory = training_memory(spec, activations, optimizer=settings.optimizer, precision=settings.precision,
                                 data_parallel=layout.data, zero_stage=settings.zero,
                                 gradient_as_bucket_view=settings.gradient_as_bucket_view,
                                 checkpoint_every=settings.activation_checkpointing,
                                 framework_baseline_bytes=framework, accumulation=accumulation)
        capacity = DEVICES[device].memory_capacity_bytes
        if memory.total > capacity:
            return (f"a rank on {device} needs {memory.total / 2**30:.1f} GiB "
                    f"(weights, gradients, optimizer states, activations, framework) of {capacity / 2**30:.0f} GiB")
    return ""


def step_time_bound_s(spec: ModelSpec, layout: TrainingLayout, workload: TrainingWorkload, settings: TrainingSettings,
                      device_types: set[str], compute: ComputeSettings, *, devices_per_host: int = 1,
                      host_egress_bytes_per_s: float | None = None) -> float:
    """A lower bound of the step time (s): see the module docstring. ``host_egress_bytes_per_s``:
    what a host's network links carry out of it together (None: one host, no network); ranks are
    placed ``devices_per_host`` per host, in order."""
    compute_s = max(_compute_bound_s(spec, layout, workload, settings, name, compute) for name in sorted(device_types))
    if host_egress_bytes_per_s is None or settings.averaging is Averaging.PARAMETERS:
        return compute_s
    return max(compute_s, _crossing_bytes(spec, layout, workload, settings, devices_per_host) / host_egress_bytes_per_s)


@lru_cache(maxsize=4096)
def _lowered(spec: ModelSpec, layout: TrainingLayout, workload: TrainingWorkload,
             settings: TrainingSettings) -> TrainingStep:
    """Replica 0's step, lowered once per layout and settings (every cluster of the plan shares it)."""
    micro, accumulation = micro_batching(workload, settings, layout.data)
    replicas = tuple(tuple(range(d * layout.tensor, (d + 1) * layout.tensor)) for d in range(layout.data))
    shape = StepShape(spec.with_dtype(compute_dtype(settings.precision)), settings, micro, workload.sequence_length,
                      accumulation, replicas)
    return lower_step(shape, sync_gradients=True, average_parameters=False, first_replica_only=True)


@lru_cache(maxsize=4096)
def _compute_bound_s(spec: ModelSpec, layout: TrainingLayout, workload: TrainingWorkload, settings: TrainingSettings,
                     device_type: str, compute: ComputeSettings) -> float:
    """The busiest rank's compute ops of replica 0's step on ``device_type``, on the roofline (s)."""
    step = _lowered(spec, layout, workload, settings)
    roofline = RooflineCompute(compute_dtype(settings.precision), compute.flops_efficiency, compute.memory_efficiency,
                               compute.op_overhead_s, accumulation=compute.accumulation)
    device = Device(0, "r0", "r0", DEVICES[device_type], DEVICES[device_type].memory_capacity_bytes)
    totals: dict[int, float] = {}
    for part in step.segments:
        for rank, ops in part.segment.programs.items():
            totals[rank] = totals.get(rank, 0.0) + part.segment.repeat * sum(
                roofline.duration_s(op, device) for op in ops if op.cost is not None)
    return max(totals.values(), default=0.0)


@lru_cache(maxsize=4096)
def _crossing_bytes(spec: ModelSpec, layout: TrainingLayout, workload: TrainingWorkload, settings: TrainingSettings,
                    devices_per_host: int) -> int:
    """Bytes of the step's data-parallel allreduces whose group spans hosts, each call once."""
    crossing = 0
    for part in _lowered(spec, layout, workload, settings).segments:
        for ops in part.segment.programs.values():
            crossing += part.segment.repeat * sum(
                op.collective.size_bytes for op in ops
                if op.collective is not None and op.collective.kind is OpKind.ALLREDUCE
                and len({rank // devices_per_host for rank in op.collective.group}) > 1)
    return crossing


def misses(step_time_s: float, tokens_per_s: float, slo, *, bound: bool = False) -> str:
    """The objectives a step time and tokens/s miss, ``; ``-joined ('' if none); ``bound``: the
    figures are bounds (a step at least, tokens/s at most)."""
    out = []
    at_least, at_most = ("at least ", "at most ") if bound else ("", "")
    if slo.step_time_s is not None and not step_time_s <= slo.step_time_s:
        out.append(f"step {at_least}{step_time_s:.3g} s > {slo.step_time_s:.3g} s")
    if slo.tokens_per_s is not None and not tokens_per_s >= slo.tokens_per_s:
        out.append(f"{at_most}{tokens_per_s:.3g} tokens/s < {slo.tokens_per_s:.3g}")
    return "; ".join(out)

