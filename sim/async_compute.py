"""Compute ops of a device whose host queues kernels ahead of it (CUDA), priced from a profile.

A GPU runs the kernels its host queued: the host returns from an op's call once its kernels are
queued and goes on to the next op while the device works (PyTorch, "CUDA semantics: asynchronous
execution"). A step then costs the host's queuing and the device's kernels overlapped, not their
sum: an op that queues faster than it runs leaves the host ahead (the device-bound regime of large
prefills), one that runs faster than it queues leaves the device waiting (the launch-bound regime
of small decode steps, which CUDA graphs exist to remove). A steady two-stage pipeline of host and
device spends the larger of the two per op; that is this model's charge per op, an upper bound of
the pipeline on a sequence of unlike ops (the host's lead can absorb a small op's queuing behind a
large op's kernels; neglected).

The terms, each measured on the calibrated device (:mod:`runtime.shape_bench`) and each with a
physical meaning, so that they carry to shapes and models the calibration never ran:

* the device's two ceilings (``device_ceiling`` rows): the rate of a large matrix product in the
  dtype (F, FLOP/s) and of a large copy (B, bytes/s), measured rather than taken from a datasheet;
* an op kind's kernel time at a shape: ``latency + max(flops / F, traffic / B)``, the roofline at
  the measured ceilings (Williams, Waterman and Patterson, CACM 52(4), 2009) plus the kind's fixed
  latency (kernel launches and the fill of small grids), the median over the calibrated shapes of
  the kind (``compute_device`` rows, one regime: decode or prefill) of its kernels' measured time
  less that roofline, never below 0;
* an op kind's host time: the median of its ``host_issue`` rows in the regime (queuing costs the
  same at any shape: the framework's Python and launch calls), plus the profile's ``op_gap`` (the
  runtime's time between ops).

Training backward and optimizer ops, and op kinds without rows, are left to the caller's model
(:meth:`AsyncCompute.duration_s` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.ops import OpKind
from sim.plan import Op
from sim.profile import CHARGED, MeasurementKind, Profile
from sim.topology import Device
from sim.vocabulary import PhaseKind


def regime(new_tokens: int) -> PhaseKind:
    """Decode (one new token per sequence) or prefill (several)."""
    return PhaseKind.DECODE if new_tokens == 1 else PhaseKind.PREFILL


@dataclass
class AsyncCompute:
    """The asynchronous device's ops of ``profile`` (module docstring) in ``dtype``, with the
    framework's time between ops ``gap_s`` (s) per device class added to the host's part.

    Raises nothing at construction; a device class without ceilings, or an op kind without rows,
    is simply not covered (:meth:`covers`, :meth:`duration_s` returns None)."""

    profile: Profile
    dtype: str
    gap_s: dict[str, float] = field(default_factory=dict)
    ceilings: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)
    latency_s: dict[tuple, float] = field(default_factory=dict, repr=False)
    host_s: dict[tuple, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        rows = self.profile.of(MeasurementKind.DEVICE_CEILING)
        rates: dict[str, dict[str, float]] = {}
        for row in rows[rows["dtype"] == self.dtype].itertuples(index=False):
            rates.setdefault(row.device_class, {})[row.op] = float(row.median)
        self.ceilings = {cls: (r["matmul"], r["copy"]) for cls, r in rates.items() if {"matmul", "copy"} <= set(r)}
        over: dict[tuple, list[float]] = {}
        for row in self.profile.of(MeasurementKind.COMPUTE_DEVICE).itertuples(index=False):
            if row.dtype != self.dtype or row.device_class not in self.ceilings:
                continue
            flops_per_s, bytes_per_s = self.ceilings[row.device_class]
            roofline = max(float(row.flops) / flops_per_s, float(row.traffic_bytes) / bytes_per_s)
            over.setdefault((row.device_class, row.op, regime(int(row.new_tokens))), []).append(
                float(getattr(row, CHARGED[MeasurementKind.COMPUTE_DEVICE])) - roofline)
        self.latency_s = {key: max(0.0, float(np.median(v))) for key, v in over.items()}
        hosts: dict[tuple, list[float]] = {}
        for row in self.profile.of(MeasurementKind.HOST_ISSUE).itertuples(index=False):
            if row.dtype == self.dtype and row.device_class in self.ceilings:
                hosts.setdefault((row.device_class, row.op, regime(int(row.new_tokens))), []).append(
                    float(getattr(row, CHARGED[MeasurementKind.HOST_ISSUE])))
        self.host_s = {key: float(np.median(v)) for key, v in hosts.items()}

    def covers(self, device: Device) -> bool:
        """Whether the profile measured ``device``'s class as an asynchronous device in the dtype."""
        return device.spec.name in self.ceilings

    def kernel_s(self, op: Op, device: Device) -> float | None:
        """The op's kernels on the device (s): the kind's latency plus the roofline at the measured
        ceilings; None where the kind was not measured in the op's regime."""
        return self.kernel_at(device.spec.name, str(op.kind), op.shape[0], op.cost.flops, op.traffic_bytes)

    def kernel_at(self, device_class: str, kind: str, new_tokens: int, flops: float, traffic_bytes: float
                  ) -> float | None:
        """:meth:`kernel_s` of an op of ``kind`` by its numbers: ``flops`` (FLOP) and
        ``traffic_bytes`` (bytes) at ``new_tokens`` new tokens per sequence (s)."""
        latency = self.latency_s.get((device_class, kind, regime(new_tokens)))
        if latency is None:
            return None
        flops_per_s, bytes_per_s = self.ceilings[device_class]
        return latency + max(flops / flops_per_s, traffic_bytes / bytes_per_s)

    def queue_s(self, op: Op, device: Device) -> float | None:
        """The host's time to queue the op (s), the framework's gap included; None where not measured."""
        host = self.host_s.get((device.spec.name, str(op.kind), regime(op.shape[0])))
        return None if host is None else host + self.gap_s.get(device.spec.name, 0.0)

    def duration_s(self, op: Op, device: Device) -> float | None:
        """The larger of the op's host and device parts (s); None for what this model does not
        price: another device class, a training backward or optimizer op, a kind without rows."""
        if (not self.covers(device) or op.cost is None or op.gradient is not None
                or op.kind == OpKind.OPTIMIZER_STEP or op.collective is not None):
            return None
        kernel, queue = self.kernel_s(op, device), self.queue_s(op, device)
        if kernel is None or queue is None:
            return None
        return max(kernel, queue)
