"""Compute cost models: how long a compute op takes on a device.

Without a calibration profile the simulator prices compute with a roofline (Williams, Waterman,
Patterson, CACM 2009): an op is bound either by arithmetic or by memory traffic,
``t = max(FLOPs / (peak_FLOP/s * flops_efficiency), bytes / (memory_bandwidth * memory_efficiency))
+ op_overhead_s``, plus, for a product that dequantises its weights first, that pass's bytes at the
same achieved bandwidth (``OpCost.prepass_bytes``, :mod:`models.weight_formats`). The
efficiencies say how far from datasheet peaks real kernels run; the fixed overhead stands for
kernel launch / framework dispatch, which dominates decode on small models.

A CPU rank that runs on one core (``one_core``: the ranks of a cluster that declares the cores
they share, ``cluster.cores``, each single-threaded as the reference runtime runs them) reaches
one core's peaks, not the whole CPU's (:meth:`sim.devices.DeviceSpec.one_core`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from sim.plan import Op
from sim.topology import Device
from sim.vocabulary import Accumulation

# Reducing n received bytes into a buffer reads two operands and writes one: 3n bytes of traffic
# (the uncalibrated gamma; a profile's ``reduction`` rows replace it, :mod:`sim.reduction`).
_REDUCTION_BYTES_PER_BYTE = 3.0


class ComputeModel(Protocol):
    """Prices compute ops and local reductions on one device."""

    def duration_s(self, op: Op, device: Device) -> float:
        """Seconds that compute ``op`` takes on ``device``."""
        ...

    def reduce_s_per_byte(self, device: Device, dtype: str | None = None) -> float:
        """Seconds per byte to combine a received buffer into a local one (gamma), the elements
        being of ``dtype`` (None: the model's default)."""
        ...

    def timed_alone(self, op: Op, device: Device) -> bool:
        """Whether ``duration_s`` of ``op`` is its time with its process alone on the machine's
        memory bandwidth (the engine then stretches its memory part where ranks share it,
        :mod:`sim.cores`), not a time measured with the ranks sharing it already."""
        ...


@dataclass
class RooflineCompute:
    """Roofline pricing from datasheet peaks (see module docstring).

    Args:
        dtype: the dtype whose peak FLOP/s applies ("fp16", "bf16", "fp32").
        flops_efficiency: achieved / peak FLOP/s, in (0, 1].
        memory_efficiency: achieved / peak memory bandwidth, in (0, 1].
        op_overhead_s: fixed cost added to every compute op (s).
        one_core: price a CPU at one core's peaks (:meth:`sim.devices.DeviceSpec.one_core`);
            accelerators are unaffected.
        accumulation: what fp16 products accumulate in (:class:`sim.vocabulary.Accumulation`,
            :meth:`sim.devices.DeviceSpec.peak_flops`).

    Raises:
        ConfigError: from ``DeviceSpec.peak_flops`` when a device lacks ``dtype``.
    """

    dtype: str
    flops_efficiency: float
    memory_efficiency: float
    op_overhead_s: float
    one_core: bool = False
    accumulation: Accumulation = Accumulation.FP32
    _cache: dict[tuple, float] = field(default_factory=dict, repr=False)

    def duration_s(self, op: Op, device: Device) -> float:
        key = (device.spec.name, op.cost.flops, op.traffic_bytes, op.cost.prepass_bytes)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self.roofline_s(op, device) + self.op_overhead_s
        return cached

    def timed_alone(self, op: Op, device: Device) -> bool:
        """True: a roofline is a device's peaks, one process's alone."""
        return True

    def roofline_s(self, op: Op, device: Device) -> float:
        """The roofline time of ``op`` on ``device`` without the fixed overhead (s), after the
        memory-bound pass before it (``OpCost.prepass_bytes``, a dequantisation) at the same
        achieved bandwidth."""
        bandwidth = device.spec.one_core()[1] if self.one_core else device.spec.memory_bandwidth_bytes_per_s
        achieved = bandwidth * self.memory_efficiency
        return max(self.flops_s(op, device), op.traffic_bytes / achieved) + op.cost.prepass_bytes / achieved

    def flops_s(self, op: Op, device: Device) -> float:
        """The arithmetic side of ``op``'s roofline on ``device``: its FLOPs at the achieved peak (s)."""
        peak_flops = (device.spec.one_core()[0][self.dtype] if self.one_core
                      else device.spec.peak_flops(self.dtype, accumulation=self.accumulation))
        return op.cost.flops / (peak_flops * self.flops_efficiency)

    def one_core_lines(self, specs) -> tuple[str, ...]:
        """What ``one_core`` priced, one line per device kind of ``specs`` (:class:`DeviceSpec`)
        that has per-core figures; none where ``one_core`` is off."""
        if not self.one_core:
            return ()
        lines = []
        by_name = {spec.name: spec for spec in specs if spec.core_peak_flops_per_s is not None}
        for spec in (by_name[name] for name in sorted(by_name)):
            peaks, bandwidth = spec.one_core()
            lines.append(f"compute on {spec.name}: one core per rank (single-threaded on the scenario's "
                         f"cluster.cores), {peaks[self.dtype] / 1e9:g} GFLOP/s {self.dtype} and "
                         f"{bandwidth / 1e9:g} GB/s peak (the device catalog's per-core figures)")
        return tuple(lines)

    def accumulation_lines(self, specs) -> tuple[str, ...]:
        """What ``accumulation`` priced, one line per device kind of ``specs``
        (:class:`DeviceSpec`); none with fp32 accumulation, the catalog's peaks."""
        if self.accumulation == Accumulation.FP32:
            return ()
        if self.dtype != "fp16":
            return (f"compute.accumulation {self.accumulation} applies to fp16 products; the scenario computes in "
                    f"{self.dtype}, at the catalog's peaks",)
        by_name = {spec.name: spec for spec in specs}
        return tuple(f"compute on {name}: fp16 products accumulated in fp16 (compute.accumulation), "
                     + (f"{spec.fp16_accumulate_flops_per_s / 1e12:g} TFLOP/s peak against "
                        f"{spec.peak_flops_per_s['fp16'] / 1e12:g} with fp32 accumulation"
                        if spec.fp16_accumulate_flops_per_s is not None else
                        "at its fp16 peak (the catalog lists no faster rate for it)")
                     for name, spec in sorted(by_name.items()))

    def reduce_s_per_byte(self, device: Device, dtype: str | None = None) -> float:
        # The roofline's traffic per byte is the same in every dtype: ``dtype`` changes nothing.
        bandwidth = device.spec.one_core()[1] if self.one_core else device.spec.memory_bandwidth_bytes_per_s
        return _REDUCTION_BYTES_PER_BYTE / (bandwidth * self.memory_efficiency)
