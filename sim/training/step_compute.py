"""The compute of a training step as it runs: each calibrated op, what a whole pass does to its ops'
per-call time, and the comm thread's work on shared cores (its messages and reductions).

A training calibration times every op alone (:mod:`runtime.training.calibrate`: one op's
forward, or the gradient of its inputs or of its weights, on layer 0 or the head), and the
model's whole forward pass (to the loss) and backward pass without DDP, each with every
data-parallel rank at once. A pass is not the sum of its ops timed alone. An op timed alone is
its work (its roofline time, :meth:`sim.cost.RooflineCompute.roofline_s`) and a per-call part
(the call's host work, kernel launches, a device synchronisation; on a CPU, the framework's
dispatch), which :class:`sim.calibrated.CalibratedCompute` keeps per call for a training step's
ops at shapes it did not time (``per_call_latency``). A pass overlaps those calls with the
kernels the host queued before them (an asynchronous device: PyTorch's "CUDA semantics") and adds
calls no op holds (the autograd engine's nodes, the loss, residual adds, gradient accumulation):
both per call. :func:`pass_factors` sets each measured pass, less its ops' work, against its ops'
per-call time, summed over the ops of *the model the calibration trained*
(:func:`calibrated_model`) as the simulator prices them (the lowered step of one micro-batch of
that size, :func:`sim.training.lower.lower_step`, on the same profile's rows), and
:class:`StepCompute` multiplies every forward op's and every backward op's per-call time by its
pass's factor (a recomputed forward op's: see ``recompute_pass``): from the calibration run
alone, never from a validated measurement. A factor on the whole op would carry the work's share of one model's ops to
another's: measured on an H100 (``validation/gpu-report``), Qwen2.5-0.5B's backward pass took
0.47 of its ops' time alone and TinyLlama-1.1B's, whose layers' GEMMs do 2.6 to 5 times the
work, 0.70.
Where the profile has no whole pass at a variant's dtype, or (a profile whose context does not
record the model it trained, :class:`sim.context.ContextTerm`) the passes' FLOPs are neither the
scenario's model's nor a model's of :data:`models.catalog.CATALOG`, the factor is 1 and the
sources say so.

With tensor parallelism the calibration times the passes of a rank's shard (rows whose
``group_size`` is the degree T, :mod:`runtime.training.calibrate`); they are set against the
shard's ops (:func:`calibrated_tensor` says which degree's rows price a scenario).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.errors import ConfigError
from models.ops import OpKind
from models.spec import ModelSpec
from sim.plan import Op
from sim.profile import MeasurementKind, Profile
from sim.topology import Device

_FORWARD_KINDS = frozenset({OpKind.EMBEDDING, OpKind.LAYERNORM, OpKind.QKV_PROJ, OpKind.ATTENTION, OpKind.OUT_PROJ,
                            OpKind.MLP_UP, OpKind.MLP_DOWN, OpKind.LM_HEAD})
"""Compute kinds of a forward pass (and of a recomputation); with ``gradient`` set, of a backward pass."""


def op_pass(op: Op) -> OpKind | None:
    """The whole pass an op belongs to: :data:`OpKind.BACKWARD` for a gradient op,
    :data:`OpKind.FORWARD` for a forward (or recomputed) layer or head op, None for the rest
    (the optimizer step, gradient casts, collectives)."""
    if op.gradient is not None:
        return OpKind.BACKWARD
    return OpKind.FORWARD if op.kind in _FORWARD_KINDS and op.collective is None else None


def calibrated_tensor(profile: Profile, tensor: int) -> int:
    """The tensor-parallel degree whose shards priced a scenario of degree ``tensor``: ``tensor``
    where the profile has training rows (``training_pass``, ``backward_*``) timed at it, else 1
    (whole layers, as a data-parallel calibration times them; the shard's ops are then priced
    along the roofline from them, :class:`sim.calibrated.CalibratedCompute`)."""
    for measurement in (MeasurementKind.TRAINING_PASS, MeasurementKind.BACKWARD_INPUT):
        if (profile.of(measurement)["group_size"] == tensor).any():
            return tensor
    return 1


def calibrated_model(model: ModelSpec, settings, micro: int, sequence: int, tensor: int,
                     pass_flops: dict[OpKind, float], recorded: ModelSpec | None = None) -> ModelSpec | None:
    """The model (in ``model``'s dtype) whose whole passes a profile's ``training_pass`` rows timed
    at ``micro`` sequences of ``sequence`` tokens on a ``tensor``-way shard.

    ``recorded``: the model the profile's context says the calibration trained
    (:func:`sim.context.recorded_model`, written by :mod:`runtime.training.calibrate`); where
    given, it is the answer: ``model`` where it is that architecture under any name, else it.

    A profile written before its context recorded the model (``recorded`` None) is matched on
    the rows' FLOPs, which are :func:`pass_costs` of the model the calibration trained:
    ``model`` where the rows record no FLOPs (``pass_flops`` NaN) or ``model``'s passes have
    their FLOPs, else the catalog model (:data:`models.catalog.CATALOG`) whose do; None where
    none does."""
    from models.catalog import CATALOG

    if recorded is not None:
        return model if recorded.same_architecture(model) else recorded.with_dtype(model.dtype)
    if not any(math.isfinite(flops) for flops in pass_flops.values()):
        return model
    for spec in (model, *(s.with_dtype(model.dtype) for s in CATALOG.values() if s.name != model.name)):
        try:
            costs = pass_costs(spec, settings, micro, sequence, tensor)
        except ConfigError:  # a degree this model cannot shard into
            continue
        if all(not math.isfinite(flops) or (kind in costs and math.isclose(costs[kind][0], flops, rel_tol=1e-9))
               for kind, flops in pass_flops.items()):
            return spec
    return None


def pass_factors(profile: Profile, device: Device, dtype: str, model: ModelSpec, settings, sequence: int,
                 compute, rank: int = 0, tensor: int = 1) -> tuple[dict[tuple[OpKind, int], float], list[str]]:
    """Per (pass, micro-batch size) of the profile's ``training_pass`` rows on ``device``'s type in
    ``dtype``, timed at the ``tensor``-way shard: the measured pass less its ops' work, over its
    ops' per-call time (:func:`pass_op_sums` of the model the rows timed,
    :func:`calibrated_model`, as ``compute`` prices them; see the module docstring), never below
    0; and one line per factor saying what it is. Charged with the statistic of the ops
    (:data:`sim.profile.CHARGED`), so that the ratio is of like to like; a pooled profile
    (several calibrations' rows concatenated) charges the median of its passes' times."""
    from sim.context import profile_contexts, recorded_model
    from sim.profile import CHARGED

    recorded = recorded_model(profile_contexts(profile.rows))
    rows = profile.of(MeasurementKind.TRAINING_PASS)
    rows = rows[(rows["device_class"] == device.spec.name) & (rows["dtype"] == dtype) & (rows["group_size"] == tensor)]
    statistic = CHARGED[MeasurementKind.COMPUTE]
    factors, lines = {}, []
    shard = f" ({tensor}-way tensor-parallel shard)" if tensor > 1 else ""
    for micro, of_micro in rows.groupby("batch_size", sort=True):
        micro = int(micro)
        timed = calibrated_model(model, settings, micro, sequence, tensor,
                                 {OpKind(row.op): float(row.flops) for row in of_micro.itertuples(index=False)},
                                 recorded)
        if timed is None:
            lines.append(f"in-step passes{shard} on {device.spec.name} {dtype} at micro batch {micro}: not priced, "
                         "x 1 (the profile does not record the model it trained, and its passes' FLOPs are neither "
                         "the scenario's model's nor a catalog model's)")
            continue
        sums = pass_op_sums(timed, settings, micro, sequence, rank, compute, device, tensor)
        on = "" if timed.name == model.name else f", timed on {timed.name}"
        # A pooled profile (several calibrations) holds a row of each pass per calibration: the
        # median of their times, as its ops' rows are pooled (sim.calibrated.CalibratedCompute).
        for op, of_op in of_micro.groupby("op", sort=True):
            kind = OpKind(op)
            measured = float(of_op[statistic].median())
            pooled = f", the median of {len(of_op)} calibrations' passes" if len(of_op) > 1 else ""
            summed, work = sums.get(kind, (0.0, 0.0))
            if summed > work and measured > 0:
                factor = max(0.0, (measured - work) / (summed - work))
                factors[(kind, micro)] = factor
                lines.append(f"in-step {kind.value} pass{shard} on {device.spec.name} {dtype} at micro batch {micro}: "
                             f"x {factor:.2f} on its ops' per-call time (whole pass {measured * 1e3:.1f} ms{pooled}, "
                             f"its ops alone {summed * 1e3:.1f} ms of which work {work * 1e3:.1f} ms{on})")
    return factors, lines


def nearest_factors(factors: dict[tuple[OpKind, int], float], micro: int) -> dict[OpKind, float]:
    """Each pass's factor at the calibrated micro-batch size nearest ``micro`` (in ratio)."""
    out = {}
    for kind in (OpKind.FORWARD, OpKind.BACKWARD):
        sizes = [m for k, m in factors if k is kind]
        if sizes:
            out[kind] = factors[(kind, min(sizes, key=lambda m: (abs(math.log(m / micro)), m)))]
    return out


@dataclass
class StepCompute:
    """A compute model of a training variant's step over ``inner`` (the calibrated model of every
    op, :class:`sim.calibrated.CalibratedCompute`): forward and backward ops with their per-call
    time (:func:`per_call_s`) times their pass's factor (``pass_factor``, see the module
    docstring), and :data:`OpKind.COMM_THREAD` ops priced as a bucket's messages on
    the rank's comm thread (:mod:`sim.training.comm_thread`).

    ``recompute_pass``: the pass whose factor a recomputed forward op's per-call time takes.
    :data:`OpKind.BACKWARD` on a device whose host queues kernels ahead (CUDA):
    ``torch.utils.checkpoint`` recomputes from inside the backward, so the recomputation's calls
    are queued while the device runs the backward's kernels and overlap as the backward's do
    (measured on an H100, TinyLlama-1.1B checkpointing every layer: the recomputation added
    44 ms to the backward, where priced as the forward's layers it took 63 ms; the replayed
    backward +9% priced so, -3% priced as the backward's, ``validation/gpu-report``).
    :data:`OpKind.FORWARD` on a CPU, whose host runs each op itself wherever it is called (as
    the backward, the CPU training report's replayed backward went from 15.3% to 15.7% median
    |error|, ``benchmarks/bench_training_offline.py``).

    A comm-thread op's ``cost.bytes_read`` is its bucket's bytes on the wire (what
    :func:`sim.training.lower.lower_step` gives it); its work (core-seconds) is, of that bucket's
    schedule on the device's rank (``work(bytes, rank)``: its core turns, one to enter each step
    in which it sends or receives and one per message there, and the bytes it reduces),
    ``message_work_s`` per turn plus the reduction of the
    received bytes at the device's reduction cost in ``bucket_dtype`` (``reduce_s_per_byte``, the
    gamma the collectives price the bucket's reductions with; :func:`sim.training.lower.bucket_dtype`).
    A :data:`OpKind.STEP_LAG` op lasts its rank's ``lags`` entry (s; :mod:`sim.training.lag`).
    """

    inner: object
    pass_factor: dict[OpKind, float] = field(default_factory=dict)
    recompute_pass: OpKind = OpKind.FORWARD
    message_work_s: float = 0.0
    work: object = None
    bucket_dtype: str | None = None
    lags: dict[int, float] = field(default_factory=dict)
    _cache: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def timed_alone(self, op: Op, device: Device) -> bool:
        """As ``inner``'s; a comm thread's turns and a rank's lag stream nothing the engine stretches."""
        return op.kind not in (OpKind.COMM_THREAD, OpKind.STEP_LAG) and self.inner.timed_alone(op, device)

    def duration_s(self, op: Op, device: Device) -> float:
        if op.kind is OpKind.STEP_LAG:
            return self.lags.get(device.rank, 0.0)
        if op.kind is OpKind.COMM_THREAD:
            key = (int(op.cost.bytes_read), device.rank)
            work_s = self._cache.get(key)
            if work_s is None:
                turns, reduced_bytes = self.work(*key)
                gamma = self.reduce_s_per_byte(device, self.bucket_dtype)
                work_s = self._cache[key] = turns * self.message_work_s + reduced_bytes * gamma
            return work_s
        price_s = self.inner.duration_s(op, device)
        factor = self.pass_factor.get(self.recompute_pass if op.recompute else op_pass(op))
        if factor is None:
            return price_s
        call_s = per_call_s(self.inner, op, device, price_s)
        return price_s - call_s + factor * call_s

    def reduce_s_per_byte(self, device: Device, dtype: str | None = None) -> float:
        return self.inner.reduce_s_per_byte(device, dtype)


def pass_ops(model, settings, micro: int, sequence: int, rank: int = 0, tensor: int = 1):
    """``(pass, op, instances)`` of every forward and backward op of one micro-batch of ``model``
    (in its compute dtype) at ``micro`` sequences of ``sequence`` tokens on ``rank`` (the first
    of a ``tensor``-way tensor-parallel replica), lowered as the simulator runs it
    (:func:`sim.training.lower.lower_step`) without checkpointing or communication: what a
    calibration's whole pass is set against."""
    from sim.training.lower import StepShape, lower_step

    plain = settings.model_copy(update={"activation_checkpointing": None})
    replica = tuple(range(rank, rank + tensor))
    step = lower_step(StepShape(model, plain, micro, sequence, 1, (replica,)), sync_gradients=False,
                      average_parameters=False)
    for part in step.segments:
        for op in part.segment.programs[rank]:
            kind = op_pass(op)
            if kind is not None:
                yield kind, op, part.segment.repeat


def per_call_s(compute, op: Op, device: Device, price_s: float) -> float:
    """Of ``op``'s time as ``compute`` prices it (``price_s``, s), what is not its work: above its
    roofline time (``compute.fallback``, times the contention ``scale`` the price holds); 0 for
    an op priced below it."""
    return max(0.0, price_s - getattr(compute, "scale", 1.0) * compute.fallback.roofline_s(op, device))


def pass_op_sums(model, settings, micro: int, sequence: int, rank: int, compute, device: Device,
                 tensor: int = 1) -> dict[OpKind, tuple[float, float]]:
    """Per pass, (the sum of one micro-batch's ops in it, s; the part of it that is their work,
    :func:`per_call_s`, s) on ``rank`` of a ``tensor``-way replica (:func:`pass_ops`), as
    ``compute`` prices them at one core's rate (its contention ``scale`` taken out, as the
    calibration's passes and ops were timed alike)."""
    scale = getattr(compute, "scale", 1.0)
    sums: dict[OpKind, tuple[float, float]] = {}
    for kind, op, instances in pass_ops(model, settings, micro, sequence, rank, tensor):
        price_s = compute.duration_s(op, device)
        total_s, work_s = sums.get(kind, (0.0, 0.0))
        sums[kind] = (total_s + instances * price_s / scale,
                      work_s + instances * (price_s - per_call_s(compute, op, device, price_s)) / scale)
    return sums


def pass_costs(model, settings, micro: int, sequence: int, tensor: int = 1) -> dict[OpKind, tuple[float, float]]:
    """Per pass, (FLOPs, memory traffic in bytes) of its ops on a rank of a ``tensor``-way
    replica (:func:`pass_ops`), what a calibration's ``training_pass`` row records."""
    costs: dict[OpKind, tuple[float, float]] = {}
    for kind, op, instances in pass_ops(model, settings, micro, sequence, tensor=tensor):
        flops, traffic = costs.get(kind, (0.0, 0.0))
        costs[kind] = (flops + instances * op.cost.flops, traffic + instances * op.traffic_bytes)
    return costs
