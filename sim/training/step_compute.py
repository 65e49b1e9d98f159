"""The compute of a training step as it runs: each calibrated op, times what a whole pass adds to
its ops timed alone, and the comm thread's work on shared cores (its messages and reductions).

A training calibration times every op alone (:mod:`runtime.training.calibrate`: one op's
forward, or the gradient of its inputs or of its weights, on layer 0 or the head), and the
model's whole forward pass (to the loss) and backward pass without DDP, each with every
data-parallel rank at once. A pass is more than its ops: the autograd engine schedules the
backward's nodes and accumulates gradients, the loss is computed and differentiated, tensors are
allocated and freed between ops. :func:`pass_factors` sets each measured pass against the sum of
the same pass's ops as the simulator prices them (the lowered step of one micro-batch of that
size, :func:`sim.training.lower.lower_step`, on the same profile's rows), and
:class:`StepCompute` multiplies every forward op (and recomputation) and every backward op by
its pass's factor: from the calibration run alone, never from a validated measurement. Where the
profile has no whole pass at a variant's dtype, the factor is 1 and named in ``missing``.

With tensor parallelism the calibration times the passes of a rank's shard (rows whose
``group_size`` is the degree T, :mod:`runtime.training.calibrate`); they are set against the
shard's ops (:func:`calibrated_tensor` says which degree's rows price a scenario).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.ops import OpKind
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


def pass_factors(profile: Profile, device: Device, dtype: str, op_sums,
                 tensor: int = 1) -> tuple[dict[tuple[OpKind, int], float], list[str]]:
    """Per (pass, micro-batch size) of the profile's ``training_pass`` rows on ``device``'s type in
    ``dtype``, timed at the ``tensor``-way shard: the measured pass over ``op_sums(micro)[pass]``,
    the sum of its ops as priced (s); and one line per factor saying what it is. Charged with the
    statistic of the ops (:data:`sim.profile.CHARGED`), so that the ratio is of like to like."""
    from sim.profile import CHARGED

    rows = profile.of(MeasurementKind.TRAINING_PASS)
    rows = rows[(rows["device_class"] == device.spec.name) & (rows["dtype"] == dtype) & (rows["group_size"] == tensor)]
    statistic = CHARGED[MeasurementKind.COMPUTE]
    factors, lines = {}, []
    for micro, of_micro in rows.groupby("batch_size", sort=True):
        sums = op_sums(int(micro))
        for row in of_micro.itertuples(index=False):
            kind = OpKind(row.op)
            measured, summed = float(getattr(row, statistic)), sums.get(kind, 0.0)
            if summed > 0 and measured > 0:
                factors[(kind, int(micro))] = measured / summed
                shard = f" ({tensor}-way tensor-parallel shard)" if tensor > 1 else ""
                lines.append(f"in-step {kind.value} pass{shard} on {device.spec.name} {dtype} at micro batch {int(micro)}: "
                             f"x {measured / summed:.2f} (whole pass {measured * 1e3:.1f} ms, its ops alone "
                             f"{summed * 1e3:.1f} ms)")
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
    """A compute model of a training variant's step over ``inner`` (the calibrated or roofline
    model of every op): forward and backward ops times their pass's factor (``pass_factor``, see
    the module docstring), and :data:`OpKind.COMM_THREAD` ops priced as a bucket's messages on
    the rank's comm thread (:mod:`sim.training.comm_thread`).

    A comm-thread op's ``cost.bytes_read`` is its bucket's bytes on the wire (what
    :func:`sim.training.lower.lower_step` gives it); its work (core-seconds) is, of that bucket's
    schedule on the device's rank (``work(bytes, rank)``: its core turns, one to enter each step
    in which it sends or receives and one per message there, and the bytes it reduces),
    ``message_work_s`` per turn plus the reduction of the
    received bytes at the device's reduction cost (``reduce_s_per_byte``, the gamma the
    collectives price a reduction with).
    """

    inner: object
    pass_factor: dict[OpKind, float] = field(default_factory=dict)
    message_work_s: float = 0.0
    work: object = None
    _cache: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def duration_s(self, op: Op, device: Device) -> float:
        if op.kind is OpKind.COMM_THREAD:
            key = (int(op.cost.bytes_read), device.rank)
            work_s = self._cache.get(key)
            if work_s is None:
                turns, reduced_bytes = self.work(*key)
                work_s = self._cache[key] = turns * self.message_work_s + reduced_bytes * self.reduce_s_per_byte(device)
            return work_s
        return self.inner.duration_s(op, device) * self.pass_factor.get(op_pass(op), 1.0)

    def reduce_s_per_byte(self, device: Device) -> float:
        return self.inner.reduce_s_per_byte(device)


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


def pass_op_sums(model, settings, micro: int, sequence: int, rank: int, compute, device: Device,
                 tensor: int = 1) -> dict[OpKind, float]:
    """The sum of one micro-batch's forward ops and of its backward ops (s) on ``rank`` of a
    ``tensor``-way replica (:func:`pass_ops`), as ``compute`` prices them at one core's rate (its
    contention ``scale`` taken out, as the calibration's passes and ops were timed alike)."""
    scale = getattr(compute, "scale", 1.0)
    sums: dict[OpKind, float] = {}
    for kind, op, instances in pass_ops(model, settings, micro, sequence, rank, tensor):
        sums[kind] = sums.get(kind, 0.0) + instances * compute.duration_s(op, device) / scale
    return sums


def pass_costs(model, settings, micro: int, sequence: int, tensor: int = 1) -> dict[OpKind, tuple[float, float]]:
    """Per pass, (FLOPs, memory traffic in bytes) of its ops on a rank of a ``tensor``-way
    replica (:func:`pass_ops`), what a calibration's ``training_pass`` row records."""
    costs: dict[OpKind, tuple[float, float]] = {}
    for kind, op, instances in pass_ops(model, settings, micro, sequence, tensor=tensor):
        flops, traffic = costs.get(kind, (0.0, 0.0))
        costs[kind] = (flops + instances * op.cost.flops, traffic + instances * op.traffic_bytes)
    return costs
