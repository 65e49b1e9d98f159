"""Cost models priced from a calibration profile (:mod:`sim.profile`).

* :class:`CalibratedCompute`: a compute op's time is interpolated among the measured times of the
  same op kind on the same device type and dtype, in the same regime (prefill: several new
  tokens; decode: one), along the op's roofline time (which grows with tokens, context, batch and
  shard size alike, so one axis serves every shape). The framework's gap between ops is added to
  every op, compute or collective.
  A training step's backward ops (each op's input and weight gradients apart) and optimizer step
  are interpolated the same way among a training calibration's ``backward_input`` /
  ``backward_weight`` rows of the op kind and ``optimizer_step`` rows of the optimizer.
* :class:`CalibratedNetwork`: a collective's time is interpolated piecewise linearly in message
  size among the measured times of the same kind, algorithm, group size and number of hosts:
  those measured in place, in real generations, where it has them (with the master's wait for
  the last rank, a term of its own); the isolated timings elsewhere. Linear because between two measured sizes an alpha-beta(-gamma) cost is affine in
  the size (Thakur, Rabenseifner, Gropp, IJHPCA 2005), which linear interpolation reproduces exactly; log-log
  interpolation bends it upwards between a latency-bound and a bandwidth-bound point (measured
  here: +15% at 384 KiB between 256 KiB and 1 MiB on the 5 ms clusters).

* Outside same-cluster mode, a forward op of a kind the profile timed alone (``compute_isolated``
  rows, :mod:`runtime.shape_bench`: the op of each shard width on a core of its own) is priced by
  its shape instead (:meth:`CalibratedCompute._by_shape`): a GEMM's time per FLOP depends on its
  shape (cache fit, arithmetic intensity: the roofline, Williams, Waterman and Patterson, CACM
  2009), so times timed in place at one shard width, scaled by FLOPs, misprice another (measured
  here: GPT-2's whole ``mlp_up`` at 32 prompt tokens took 3.1 times its 4-way shard in place,
  which FLOPs and 4 ranks on 2 cores put at 2.0). Per-operator profiles by shape, as Vidur's
  (Agrawal et al., MLSys 2024, arXiv 2405.05187). Those times hold no contention: the target's
  comes from the engine's processor sharing alone (:mod:`sim.cores`), with no factor. A decode op
  timed alone at several batch sizes is priced between them in its rows
  (:meth:`CalibratedCompute._by_shape`): the roofline's memory-bound decode costs 2 rows as 1,
  a CPU thread x1.89 (``benchmarks/bench_decode_rows.py``).

* On a device whose host queues kernels ahead (CUDA: the profile has ``device_ceiling``,
  ``compute_device`` and ``host_issue`` rows), a forward op costs the larger of its host's queuing
  and its kernels' time, each from terms that carry to other shapes and models
  (:mod:`sim.async_compute`), in every mode: the ops timed in place, each after a device
  synchronisation, hold a wait for the device that an asynchronous run does not.

Outside the measured range a query is priced from the nearest measurement scaled by the
uncalibrated model's ratio (roofline, or the scenario's network model; a training step's ops, the
nearest measurement's latency per call plus the op's roofline: ``per_call_latency``), and recorded in
``extrapolated`` so the output can say which predictions rest on it. Tables are built once;
lookups are cached, so pricing is O(1) per op inside the simulation loop.

What a run repeats per step is charged the statistic :data:`sim.profile.CHARGED` names for its kind of
measurement (:mod:`sim.profile` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from models.accounting import head_op_costs, layer_op_costs
from models.errors import ConfigError
from models.ops import OpKind
from models.spec import ModelSpec
from sim.async_compute import AsyncCompute
from sim.async_compute import regime as _regime
from sim.collectives.registry import LIBRARY, build_schedule
from sim.collectives.schedule import CommSchedule
from sim.cost import RooflineCompute
from sim.network import CollectiveTiming, NetworkModel, reduction_costs
from sim.plan import Op
from sim.profile import CHARGED, ISOLATED, MeasurementKind, Profile, noise_floor
from sim.program import Gradient
from sim.reduction import UNMEASURED, ReductionFit, fit_for, fit_reductions, reduction_terms
from sim.topology import Device, Topology
from sim.vocabulary import PhaseKind




BACKWARD_ROWS = {Gradient.INPUT: MeasurementKind.BACKWARD_INPUT, Gradient.WEIGHT: MeasurementKind.BACKWARD_WEIGHT}
"""The profile rows that price a training backward op, by the gradient it computes."""
OPTIMIZER_DTYPE = "fp32"  # an optimizer updates fp32 (master) parameters under every precision


@dataclass
class CalibratedCompute:
    """Compute times from a profile's ``compute`` and ``op_gap`` rows; see the module docstring.

    Args:
        profile: the calibration profile.
        fallback: the roofline used as the interpolation axis and outside the measured range.
        optimizer: the optimizer whose ``optimizer_step`` rows price an ``optimizer_step`` op
            (set per training variant; None: roofline).
        scale: factor on every compute op and gap (core contention other than calibrated:
            :func:`sim.context.core_contention`: calibrated compute at a core of its own), but
            those of ``solo_kinds``; an op priced by its shape takes it on its gap only.
        model: the scenario's model: the profile's ``compute_isolated`` rows of its ops (FLOPs
            alike) price them; None: those rows are not used.
        by_shape: price forward ops by their shape from the ``compute_isolated`` rows where the
            profile has them (outside same-cluster mode; :func:`calibrated_network` says which).
        phase_scales: the factor on the ``compute`` rows of a calibrated ``new_tokens`` (1: a decode
            step) where it differs from ``scale`` (:func:`sim.context.core_contention`): an op
            priced among rows of several takes theirs interpolated along the same axis.
        per_call_latency: beyond the calibrated shapes of a kind, keep the nearest row's time above
            its roofline as a latency per call and add the roofline of the op's work, instead of
            scaling the row by the roofline (FLOPs scaling); where the row ran faster than the
            roofline, its rate scales the op. Not for the optimizer step, whose row times a whole
            model's step over all its tensors (its time beyond the roofline grows with them).
            Set for a training step, whose rows time one op
            alone per call, each holding the call's host work, kernel launches and a device
            synchronisation whatever its size (measured on an H100: Qwen2.5-0.5B's ``out_proj``
            forward, 13 GFLOP, 0.17 ms; TinyLlama-1.1B's, 69 GFLOP, 0.27 ms; FLOPs scaling from
            one priced the other at 0.05 and 0.61 ms, ``validation/gpu-report``). The roofline of
            a GEMM, Williams, Waterman and Patterson, CACM 52(4), 2009.
        solo_kinds: op kinds that only some ranks of the group compute in the plan being priced
            (the master's embedding and LM head; its layer norms in reduce_ln_bcast): timed in place while the other ranks waited, asleep, for their result,
            so on a core of their own already (measured in one calibration run: the LM head of
            GPT-2 took 14.3 ms with 4 ranks on 2 cores and 13.4 ms with 3, while ``mlp_down``,
            run by every rank at once, ran 1.33 times faster with 3; and the same time in every
            strategy: validation/transfer-new-report and remeasure-report ``terms.csv``,
            ``benchmarks/bench_lm_head_rows.py``).
        reduce_dtype: the dtype the collectives' reductions run in where a collective names none
            (``Collective.dtype``; None: the priced dtype, ``fallback.dtype``, an inference step's
            activations); a training step's buckets reduce gradients in
            :data:`models.training.GRADIENT_DTYPE` whatever its compute dtype.
        reduce_dtypes: the other dtypes its collectives reduce in (a compressed bucket's fp16 or
            bf16, a training step's tensor-parallel allreduces in the compute dtype), whose
            sources :meth:`reduction_terms` gives too.
    """

    profile: Profile
    fallback: RooflineCompute
    scale: float = 1.0
    phase_scales: dict[int, float] = field(default_factory=dict)
    solo_kinds: frozenset[str] = frozenset()
    optimizer: str | None = None
    model: ModelSpec | None = None
    by_shape: bool = False
    per_call_latency: bool = False
    reduce_dtype: str | None = None
    reduce_dtypes: tuple[str, ...] = ()
    extrapolated: set[str] = field(default_factory=set)
    calibrated: set[str] = field(default_factory=set)
    _tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    _shapes: dict[tuple, dict[float, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict, repr=False)
    _widths: dict[tuple, float] = field(default_factory=dict, repr=False)
    # decode rows timed alone at several batch sizes: (key, width) -> (FLOPs of one row, {batch: s per roofline s})
    _batches: dict[tuple, tuple[float, dict[int, float]]] = field(default_factory=dict, repr=False)
    _new_tokens: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False)  # per table point
    _gap_s: dict[str, float] = field(default_factory=dict, repr=False)
    _cache: dict[tuple, float] = field(default_factory=dict, repr=False)
    _alone: set[tuple] = field(default_factory=set, repr=False)  # cache keys of ops timed alone (timed_alone)
    asynchronous: AsyncCompute | None = field(default=None, repr=False)
    _reductions: dict[tuple[str, str], ReductionFit] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        rows = self.profile.of(MeasurementKind.COMPUTE)
        points: dict[tuple, list[tuple[float, float]]] = {}
        new_tokens: dict[tuple, dict[float, int]] = {}
        for row in rows.itertuples(index=False):
            x = self._axis(row.flops, row.traffic_bytes, row.device_class, row.dtype)
            key = (row.device_class, row.dtype, row.op, _regime(int(row.new_tokens)))
            points.setdefault(key, []).append((x, float(getattr(row, CHARGED[MeasurementKind.COMPUTE]))))
            new_tokens.setdefault(key, {}).setdefault(x, int(row.new_tokens))
        for measurement in (*BACKWARD_ROWS.values(), MeasurementKind.OPTIMIZER_STEP):
            for row in self.profile.of(measurement).itertuples(index=False):
                x = self._axis(row.flops, row.traffic_bytes, row.device_class, row.dtype)
                key = (row.device_class, row.dtype, row.op, measurement)
                points.setdefault(key, []).append((x, float(getattr(row, CHARGED[measurement]))))
        for key, values in points.items():
            xs = np.array(sorted({x for x, _ in values}))
            ys = np.array([np.median([y for x, y in values if x == v]) for v in xs])
            self._tables[key] = (xs, ys)
            if key in new_tokens:
                self._new_tokens[key] = np.array([new_tokens[key][v] for v in xs])
        for row in self.profile.of(MeasurementKind.OP_GAP).itertuples(index=False):
            self._gap_s[row.device_class] = float(getattr(row, CHARGED[MeasurementKind.OP_GAP]))
        self.asynchronous = AsyncCompute(self.profile, self.fallback.dtype, dict(self._gap_s))
        self._reductions = fit_reductions(self.profile)
        shapes: dict[tuple, dict[float, list[tuple[float, float]]]] = {}
        batches: dict[tuple, dict[int, list[tuple[float, float]]]] = {}
        for row in self.profile.of(MeasurementKind.COMPUTE_ISOLATED).itertuples(index=False):
            if self.model is None:
                break
            new, context, width, kind = int(row.new_tokens), int(row.context_tokens), int(row.group_size), OpKind(row.op)
            batch = int(row.batch_size)
            try:
                costs = {**head_op_costs(self.model, batch_size=batch, new_tokens=new),
                         **layer_op_costs(self.model, tp_degree=width, batch_size=batch, new_tokens=new,
                                          context_tokens=context)}
            except ConfigError:  # a width this model cannot split into: another model's row
                continue
            if kind not in costs or not np.isclose(costs[kind].flops, row.flops, rtol=1e-9, atol=0.0):
                continue  # another model's op: its shard width cannot be read
            x = self._axis(row.flops, row.traffic_bytes, row.device_class, row.dtype)
            key = (row.device_class, row.dtype, row.op, _regime(new))
            width_share = self._width(kind, costs[kind] if kind in _LAYER_KINDS else None, new, context)
            time_s = float(getattr(row, CHARGED[MeasurementKind.COMPUTE_ISOLATED]))
            shapes.setdefault(key, {}).setdefault(width_share, []).append((x, time_s))
            if key[3] == PhaseKind.DECODE and kind != OpKind.ATTENTION and x > 0:  # attention's batch is in its width
                batches.setdefault((key, width_share), {}).setdefault(batch, []).append((row.flops / batch, time_s / x))
        for key, widths in shapes.items():
            self._shapes[key] = {}
            for width, values in sorted(widths.items()):
                xs = np.array(sorted({x for x, _ in values}))
                self._shapes[key][width] = (xs, np.array([np.median([y for x, y in values if x == v]) for v in xs]))
        for at, by_batch in batches.items():
            if len(by_batch) > 1:  # a profile timing decode at one batch size prices as before
                row_flops = float(np.median([f for values in by_batch.values() for f, _ in values]))
                self._batches[at] = (row_flops, {b: float(np.median([r for _, r in values]))
                                                 for b, values in sorted(by_batch.items())})

    def gap_s(self, device: Device) -> float:
        """The framework's time between two ops on ``device`` (s); 0 if not calibrated."""
        return self._gap_s.get(device.spec.name, 0.0)

    def _axis(self, flops: float, traffic_bytes: float, device_class: str, dtype: str) -> float:
        """The interpolation axis: the roofline time of ``flops`` and ``traffic_bytes`` (s)."""
        return max(flops / (self.fallback.flops_efficiency * _peak(device_class, dtype)),
                   traffic_bytes / (self.fallback.memory_efficiency * _bandwidth(device_class)))

    def duration_s(self, op: Op, device: Device) -> float:
        solo = str(op.kind) in self.solo_kinds
        key = (device.spec.name, op.kind, op.shape, op.cost.flops, op.traffic_bytes, solo, op.gradient,
               self.optimizer if op.kind == OpKind.OPTIMIZER_STEP else None)
        cached = self._cache.get(key)
        if cached is None and (queued_s := self.asynchronous.duration_s(op, device)) is not None:
            self.calibrated.add(f"{op.kind} ({_regime(op.shape[0])}) on {device.spec.name}: host queuing and "
                                f"device kernels, asynchronous")
            cached = self._cache[key] = queued_s
        if cached is None:
            alone_s = self._by_shape(op, device) if self.by_shape and self._shapes else None
            if alone_s is not None:  # no contention in it: the engine's processor sharing adds the target's
                cached = self._cache[key] = alone_s + self.gap_s(device) * (1.0 if solo else self.scale)
                self._alone.add(key)
            else:
                price_s, scale = self._price(op, device)
                cached = self._cache[key] = (price_s + self.gap_s(device)) * (1.0 if solo else scale)
                if solo:
                    self._alone.add(key)
        return cached

    def timed_alone(self, op: Op, device: Device) -> bool:
        """Whether ``op``'s time was measured with its process alone on the machine's memory: priced
        by its shape (``compute_isolated``, the other ranks asleep) or a solo kind (timed while the
        other ranks waited asleep). Ops priced from in-place rows hold the calibration's sharing of
        the memory bandwidth already, as they hold its cores' (:func:`sim.context.core_contention`
        divides only the latter out), so the engine does not stretch them again."""
        self.duration_s(op, device)
        solo = str(op.kind) in self.solo_kinds
        return (device.spec.name, op.kind, op.shape, op.cost.flops, op.traffic_bytes, solo, op.gradient,
                self.optimizer if op.kind == OpKind.OPTIMIZER_STEP else None) in self._alone

    def _width(self, kind: OpKind, cost, new_tokens: int, context_tokens: int) -> float:
        """An op's shard width: its share of the whole layer's op (a projection's weights; for
        attention, its FLOPs over one sequence's of all heads, so sequences times heads, which
        the kernel batches alike); 1 for an op that is not sharded (``cost`` None)."""
        if cost is None:
            return 1.0
        whole_key = (kind, new_tokens if kind == OpKind.ATTENTION else 0, context_tokens if kind == OpKind.ATTENTION else 0)
        whole = self._widths.get(whole_key)
        if whole is None:
            full = layer_op_costs(self.model, tp_degree=1, batch_size=1, new_tokens=max(1, whole_key[1]),
                                  context_tokens=max(1, whole_key[2]))[kind]
            whole = self._widths[whole_key] = full.flops if kind == OpKind.ATTENTION else full.weight_bytes
        return round((cost.flops if kind == OpKind.ATTENTION else cost.weight_bytes) / whole, 9)

    def _by_shape(self, op: Op, device: Device) -> float | None:
        """A forward op's time on a core of its own from the ``compute_isolated`` rows of its kind
        and regime (s), None where the profile has none. The op's time per roofline second
        (its efficiency) is read at each measured shard width from that width's rows at the
        op's token shape, its roofline scaled to the width (FLOPs, traffic, both in proportion
        to a shard's width), and interpolated linearly in width between the two measured widths
        around the op's; beyond the measured widths, the nearest one's, and beyond a width's
        measured tokens, its nearest row's (FLOPs scaling; both flagged in ``extrapolated``).

        Where a width's decode rows of a kind other than attention were timed at several batch sizes
        (:func:`runtime.shape_bench.decode_batch_sizes`), its time per roofline second is instead
        interpolated linearly in the op's rows (its FLOPs over one row's at that width) between the
        measured batch sizes around it, beyond them the nearest one's (flagged): the roofline prices
        a memory-bound decode of 2 rows about as 1, which one torch CPU thread does not
        (``benchmarks/bench_decode_rows.py``: x1.89). Attention's rows are in its width already
        (sequences times heads)."""
        if op.gradient is not None or op.kind == OpKind.OPTIMIZER_STEP or op.cost is None:
            return None
        name = device.spec.name
        key = (name, self.fallback.dtype, str(op.kind), _regime(op.shape[0]))
        tables = self._shapes.get(key)
        if tables is None:
            return None
        new, context = op.shape
        width = self._width(op.kind, op.cost if op.kind in _LAYER_KINDS else None, new, context)
        x = self.fallback.roofline_s(op, device)
        label = f"{op.kind} ({_regime(new)}) on {name}"
        widths = sorted(tables)
        outside = []

        def efficiency(at: float) -> float:
            if (batched := self._batches.get((key, at))) is not None:
                row_flops, rates = batched
                rows = op.cost.flops * at / width / row_flops
                sizes = list(rates)
                if not sizes[0] * (1 - 1e-6) <= rows <= sizes[-1] * (1 + 1e-6):
                    outside.append(f"decode batch sizes ({', '.join(map(str, sizes))})")
                return float(np.interp(rows, sizes, list(rates.values())))
            xs, ys = tables[at]
            scaled = x * at / width
            if xs[0] <= scaled <= xs[-1]:
                return float(np.interp(scaled, xs, ys)) / scaled
            outside.append("tokens")
            edge = 0 if scaled < xs[0] else -1
            return float(ys[edge] / xs[edge])

        if x <= 0:
            return None
        near = [w for w in widths if abs(w - width) <= 1e-6 * width]
        if near:
            rate = efficiency(near[0])
        elif widths[0] < width < widths[-1]:
            above = next(w for w in widths if w > width)
            below = max(w for w in widths if w < width)
            share = (width - below) / (above - below)
            rate = (1 - share) * efficiency(below) + share * efficiency(above)
        else:
            outside.append("shard width")
            rate = efficiency(widths[0] if width < widths[0] else widths[-1])
        self.calibrated.add(f"{label}: timed alone by shape")
        for what in dict.fromkeys(outside):
            self.extrapolated.add(f"{label}: outside the {what} timed alone, FLOPs scaling")
        return rate * x

    def reduce_s_per_byte(self, device: Device, dtype: str | None = None) -> float:
        """Seconds per received byte to reduce it into a local buffer on ``device`` in ``dtype``
        (default ``reduce_dtype``, else the priced dtype): the gamma fitted on the profile's
        ``reduction`` rows of the device's type and that dtype (:func:`sim.reduction.fit_reductions`),
        else on its fp32 rows, unscaled (:func:`sim.reduction.fit_for`; :meth:`reduction_terms`
        says so), else the roofline's."""
        fit = fit_for(self._reductions, device.spec.name, dtype or self.reduce_dtype or self.fallback.dtype)
        return self.fallback.reduce_s_per_byte(device) if fit is None else fit.gamma_s_per_byte

    def reduction_terms(self, devices: tuple[Device, ...]) -> tuple:
        """Where the reduction cost of ``devices`` comes from, in ``reduce_dtype`` (else the priced
        dtype) and each of ``reduce_dtypes``, one :class:`sim.context.TermComparison` per device
        type and dtype (:func:`sim.reduction.reduction_terms`)."""
        return reduction_terms(self._reductions, self._reductions_measured, devices,
                               (self.reduce_dtype or self.fallback.dtype, *self.reduce_dtypes),
                               self.fallback.reduce_s_per_byte)

    @property
    def _reductions_measured(self) -> bool:
        return len(self.profile.of(MeasurementKind.REDUCTION)) > 0

    def reduction_sources(self) -> tuple[str, ...]:
        """The source line of reductions priced by the roofline because the profile never measured
        them (:data:`sim.reduction.UNMEASURED`); none where it has ``reduction`` rows (then
        :meth:`reduction_terms` says where each device type's cost comes from)."""
        return () if self._reductions_measured else (UNMEASURED,)

    def _price(self, op: Op, device: Device) -> tuple[float, float]:
        """(the op's calibrated time as timed in place, s; the factor on it for core contention)."""
        name = device.spec.name
        measurement = MeasurementKind.COMPUTE
        if op.gradient is not None:  # a training backward op: the rows of its gradient
            measurement = BACKWARD_ROWS[op.gradient]
            key, label = (name, self.fallback.dtype, str(op.kind), measurement), f"{measurement} {op.kind}"
            x = self.fallback.roofline_s(op, device)
        elif op.kind == OpKind.OPTIMIZER_STEP:
            measurement = MeasurementKind.OPTIMIZER_STEP
            key = (name, OPTIMIZER_DTYPE, self.optimizer, measurement)
            label = f"{measurement} {self.optimizer}"
            x = self._axis(op.cost.flops, op.traffic_bytes, name, OPTIMIZER_DTYPE)
        else:
            regime = _regime(op.shape[0])
            key, label = (name, self.fallback.dtype, str(op.kind), regime), f"{op.kind} ({regime})"
            x = self.fallback.roofline_s(op, device)
        table = self._tables.get(key)
        if table is None:
            self.extrapolated.add(f"{label} on {name}: not calibrated, roofline")
            return self.fallback.duration_s(op, device), self.scale
        self.calibrated.add(f"{label} on {name}")
        xs, ys = table
        phases = self._new_tokens.get(key)
        scale = self.scale if phases is None or not self.phase_scales else float(
            np.interp(x, xs, [self.phase_scales.get(int(n), self.scale) for n in phases]))
        if xs[0] <= x <= xs[-1]:
            return float(np.interp(x, xs, ys)), scale
        edge = 0 if x < xs[0] else -1
        self.extrapolated.add(f"{label} on {name}: outside the calibrated shapes")
        if xs[edge] <= 0:
            return float(ys[edge]), scale
        if self.per_call_latency and measurement is not MeasurementKind.OPTIMIZER_STEP:
            # what the row took beyond its roofline is per call: kept, not scaled
            latency_s = max(0.0, float(ys[edge] - xs[edge]))
            return latency_s + x * min(1.0, float(ys[edge] / xs[edge])), scale
        return float(ys[edge] * x / xs[edge]), scale


_LAYER_KINDS = frozenset({OpKind.QKV_PROJ, OpKind.ATTENTION, OpKind.OUT_PROJ, OpKind.MLP_UP, OpKind.MLP_DOWN})
"""The op kinds a tensor-parallel split shards (a decoder layer's but its norms)."""


def _peak(device_class: str, dtype: str) -> float:
    from sim.devices import get_device

    return get_device(device_class).peak_flops(dtype)


def _bandwidth(device_class: str) -> float:
    from sim.devices import get_device

    return get_device(device_class).memory_bandwidth_bytes_per_s


@dataclass
class CalibratedNetwork:
    """Collective times from a profile's ``collective_in_place``, ``collective_wait`` and
    ``collective`` rows.

    A collective is priced, for its kind, algorithm, group size and number of hosts:

    * within the sizes measured in place (in real generations), by linear interpolation among
      them: what the call costs the master inside a run on this cluster, from the last rank's
      arrival to its end, plus its wait for that arrival (``wait_s`` of the timing: ranks that
      share cores arrive apart, which the simulated ranks, doing equal work, do not). The
      timings of the same plan op (``call``, its name: where in a step it sits, which sets who
      arrives last and what the cores do meanwhile) where the profile has them; else those of
      every call of the kind, algorithm and group, pooled (a median over the calls' rows);
    * elsewhere, by linear interpolation among the isolated timings plus the in-place overhead
      at the nearest in-place size (in place less isolated there, in seconds; flagged in
      ``extrapolated``), and the wait at that size. The overhead is per call (waking ranks,
      sharing cores with compute), so it is carried as a constant, not a ratio;
    * without isolated timings, by the scenario's network model scaled to the nearest one.

    The isolated timings are first made non-decreasing in size, each the least median measured
    at its size or above (:func:`sim.profile.noise_floor`). In-place timings are kept as measured: their sizes come from different
    phases (decode, prefill) with different contention for the cores.

    Args:
        profile: the calibration profile.
        fallback: the scenario's network model, for shapes and sizes not measured.
        topology: to count the hosts a group spans.
        gap_s: the framework's time between two ops, added to every collective.
        in_place: use the in-place rows (False prices collectives as they run alone, which is
            what an isolated microbenchmark is checked against).
        spread: the model whose ranks' finishes, each before its last rank's, a call priced from
            the isolated timings keeps (None: every rank at the calibrated time).
    """

    profile: Profile
    fallback: NetworkModel
    topology: Topology
    gap_s: float = 0.0
    in_place: bool = True
    spread: object = None
    extrapolated: set[str] = field(default_factory=set)
    _tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    _in_place: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    _wait: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._tables = _size_tables(self.profile.of(MeasurementKind.COLLECTIVE), ISOLATED, monotone=True)
        if self.in_place:
            for measurement, tables in ((MeasurementKind.COLLECTIVE_IN_PLACE, self._in_place),
                                      (MeasurementKind.COLLECTIVE_WAIT, self._wait)):
                rows = self.profile.of(measurement)
                statistic = CHARGED[measurement]
                tables.update(_size_tables(rows, statistic, monotone=False))  # pooled, keyed without a call
                for call, of_call in rows.groupby("call", sort=True):
                    tables.update({(str(call), *key): table
                                   for key, table in _size_tables(of_call, statistic, monotone=False).items()})

    def time(self, schedule: CommSchedule, call: str | None = None) -> CollectiveTiming:
        """The timing of ``schedule``, the plan op ``call`` where given: the calibrated time for
        every rank where it was timed in place (the profile holds the master's view of a call,
        not per-rank finishes), its calibrated wait in ``wait_s``. A call priced from the
        isolated timings (the last rank's end) releases each rank as much before it as the
        ``spread`` model's ranks finish before its last (a ring whose ranks receive over links
        of different rates: :class:`sim.transport._TransportRun`, the sender's send buffer)."""
        key = (str(schedule.kind), schedule.algorithm, len(schedule.group),
               len(self.topology.host_groups(schedule.group)))
        in_place_key = (call, *key) if (call, *key) in self._in_place else key
        if len(schedule.group) == 1 and in_place_key not in self._in_place:
            return CollectiveTiming(0.0, {r: 0.0 for r in schedule.group})
        # A group of one moves nothing, but where the profile timed the call in place (a one-rank
        # calibration: the runtime's call into its communicator) that time is the framework's.
        wait_s = self._wait_s(schedule, in_place_key)
        duration = wait_s + self._duration(schedule, key, in_place_key) + self.gap_s
        # timed in place, or isolated plus the in-place overhead at the nearest size: either way the
        # bursts its links' buckets gave the call in the run are in it (sim.bucket_clock)
        in_place = in_place_key in self._in_place and schedule.size_bytes > 0
        return CollectiveTiming(duration, self._finishes(schedule, duration, in_place), wait_s, in_place)

    def _finishes(self, schedule: CommSchedule, duration: float, in_place: bool) -> dict[int, float]:
        if self.spread is None or in_place or schedule.size_bytes <= 0 or len(schedule.group) == 1:
            return {r: duration for r in schedule.group}
        modelled = self.spread.time(schedule).finish_s
        last = max(modelled.values(), default=0.0)
        return {r: max(0.0, duration - (last - modelled.get(r, last))) for r in schedule.group}

    def _wait_s(self, schedule: CommSchedule, key: tuple) -> float:
        table = self._wait.get(key)
        if table is None:
            return 0.0
        sizes, times = table  # beyond the measured sizes, the nearest: skew comes from the compute around
        return max(0.0, float(np.interp(schedule.size_bytes, sizes, times)))

    def _duration(self, schedule: CommSchedule, key: tuple, in_place_key: tuple) -> float:
        label = f"{schedule.kind} {schedule.algorithm} over {key[2]} ranks on {key[3]} hosts"
        in_place = self._in_place.get(in_place_key)
        if in_place is None or schedule.size_bytes <= 0:
            return self._isolated_s(schedule, key, label, flag=True)
        sizes, times = in_place
        if sizes[0] <= schedule.size_bytes <= sizes[-1]:
            return float(np.interp(schedule.size_bytes, sizes, times))
        edge = 0 if schedule.size_bytes < sizes[0] else -1
        self.extrapolated.add(f"{label}: {schedule.size_bytes} bytes outside the sizes measured in place, "
                              "isolated timing plus the in-place overhead")
        overhead_s = times[edge] - self._isolated_s(self._resized(schedule, sizes[edge]), key, label)
        isolated = self._isolated_s(schedule, key, label, flag=True)
        return isolated + overhead_s if isolated + overhead_s > 0 else isolated

    def _isolated_s(self, schedule: CommSchedule, key: tuple, label: str, flag: bool = False) -> float:
        table = self._tables.get(key)
        if table is None or schedule.size_bytes <= 0:
            if flag:
                self.extrapolated.add(f"{label}: not calibrated, {type(self.fallback).__name__}")
            return self.fallback.time(schedule).duration_s
        sizes, times = table
        if sizes[0] <= schedule.size_bytes <= sizes[-1]:
            return float(np.interp(schedule.size_bytes, sizes, times))
        edge = 0 if schedule.size_bytes < sizes[0] else -1
        if flag:
            self.extrapolated.add(f"{label}: {schedule.size_bytes} bytes outside the calibrated sizes")
        at_edge = self._resized(schedule, sizes[edge])
        ratio = self.fallback.time(schedule).duration_s / max(self.fallback.time(at_edge).duration_s, 1e-12)
        return float(times[edge] * ratio)

    def _resized(self, schedule: CommSchedule, size_bytes: float) -> CommSchedule:
        return replace(build_schedule(schedule.kind, schedule.algorithm, schedule.group, int(round(size_bytes)),
                                      root=schedule.root, host_groups=self.topology.host_groups(schedule.group)),
                       reduce_dtype=schedule.reduce_dtype)


def _size_tables(rows, statistic: str, monotone: bool) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """(kind, algorithm, group size, hosts) -> (sizes in bytes, times in s: the rows'
    ``statistic`` column), sizes ascending. ``monotone``: each time becomes the least at its size
    or above (see :class:`CalibratedNetwork`)."""
    tables = {}
    for key, group in rows.groupby(["op", "algorithm", "group_size", "num_hosts"], sort=True):
        group = group.groupby("size_bytes", sort=True)[statistic].median()
        times = group.to_numpy(dtype=float)
        if monotone:
            times = noise_floor(times)
        tables[(str(key[0]), str(key[1]), int(key[2]), int(key[3]))] = (group.index.to_numpy(dtype=float), times)
    return tables


@dataclass(frozen=True)
class NetworkChoice:
    """How a profile prices a scenario's collectives (:func:`calibrated_network`).

    Attributes:
        network: the network model to price collectives with.
        same_cluster: the profile's collective timings are replayed (same-cluster mode).
        compute_scale: factor on calibrated compute for core contention (:func:`sim.context.core_contention`).
        phase_scales: the factor on the compute rows of each calibrated ``new_tokens`` where the
            profile says how many ranks computed at once then (:mod:`sim.concurrency`).
        cores: the target's core pools for the engine (:mod:`sim.cores`; none: a core per rank).
        terms: the scenario's terms against the profile's context (:func:`sim.context.compare`).
        sources: one line per collective implementation: where its price comes from.
    """

    network: NetworkModel
    same_cluster: bool
    terms: tuple
    sources: tuple[str, ...]
    compute_scale: float = 1.0
    cores: tuple = ()
    phase_scales: dict = field(default_factory=dict)

    def lines(self) -> tuple[str, ...]:
        """What came from where, one line each: the scenario's terms against the profile's
        context (:meth:`sim.context.TermComparison.line`), then :attr:`sources`."""
        return (*(term.line() for term in self.terms), *self.sources)


@dataclass(frozen=True)
class _Fit:
    """What :func:`calibrated_network` fits from one profile, kept because fitting takes seconds
    and an estimate tens of ms: per (kind, algorithm) the terms of its sweep (``terms``) and of its
    sweep inside one host (``inside``), per link class a pipeline hop's (``hops``), and the ranks
    computing at once per calibrated phase (``concurrency``), and the ranks' arrival lag per block
    on shared cores (``lag_per_block``, :mod:`sim.arrival_skew`)."""

    profile: Profile
    terms: dict
    hops: dict
    concurrency: dict
    inside: dict
    lag_per_block: float


_FITS: dict[int, _Fit] = {}  # by id(profile)


def calibrated_network(profile: Profile, fallback: NetworkModel, topology: Topology, target,
                       compute: CalibratedCompute, gap_s: float,
                       ranks: tuple[int, ...] = (), copies: int = 1) -> NetworkChoice:
    """The network model a profile gives a scenario whose context is ``target``
    (:class:`sim.context.CalibrationContext`), one copy's ranks of ``copies`` replicas that
    share the cores (:mod:`sim.replicas`; their messages' contention counts every copy's ranks:
    :func:`contention_floor`, :meth:`sim.transport._TransportLinks.floor_s`).

    Where the profile records no context, or one cluster whose network is the target's, its
    timings are replayed (:class:`CalibratedNetwork`; *same-cluster mode*). Otherwise no timing
    measured on another network is replayed: every collective is its schedule priced over the
    target's topology with transport terms fitted on the profile's isolated collective sweep
    (:class:`sim.transport.TransportNetwork`), or the gloo defaults for an implementation the
    profile did not time; and ``ranks`` (the target's, topology rank ids) share the cores as
    :func:`sim.context.core_contention` says. A target in a layout the profile did not measure
    (``target.layout``: a pipeline, an uneven split) is priced that way on its own cluster too,
    the hops between its stages with point-to-point terms fitted per link class on the profile's
    ping-pongs (:func:`sim.transport.fit_hops`), and a pipeline's compute given the ranks that
    computed at once in each calibrated phase (:func:`sim.context.core_contention`).
    ``compute``'s reduction cost per byte (:meth:`CalibratedCompute.reduce_s_per_byte`: fitted on
    the profile's ``reduction`` rows, else the roofline) prices the reductions of the calibrated
    ranks, in the dtype they ran in, when their sweep is fitted, and of the target's; where it
    comes from joins the terms (:meth:`CalibratedCompute.reduction_terms`).
    """
    from sim.concurrency import calibrated_concurrency
    from sim.context import compare, core_contention, profile_contexts, same_cluster
    from sim.transport import TransportNetwork, default_terms, fit_hops, fit_intra_host, fit_profile

    contexts = profile_contexts(profile.rows)
    terms = (*compare(contexts, target),
             *compute.reduction_terms(tuple(topology.devices[r] for r in ranks or range(topology.num_ranks))))
    if not contexts or same_cluster(contexts, target):
        mode = "same-cluster mode: timings of this cluster's collectives replayed (in place per plan op, isolated)"
        from sim.transport import DefaultTransportNetwork
        spread = DefaultTransportNetwork(topology, reduction_costs(compute, topology.devices))
        return NetworkChoice(CalibratedNetwork(profile, fallback, topology, gap_s=gap_s, spread=spread), True, terms,
                             (mode, *compute.reduction_sources()))
    cached = _FITS.get(id(profile))
    if cached is None or cached.profile is not profile:
        fitted: dict = {}
        hops: dict = {}
        inside: dict = {}
        for context in contexts:  # a pool: each cluster's own sweep over its own links; first fit wins
            rows = profile.of(MeasurementKind.COLLECTIVE)
            rows = rows[_rows_of(profile.rows, rows, context.name)]
            pings = profile.of(MeasurementKind.P2P)
            pings = pings[_rows_of(profile.rows, pings, context.name)]
            # the calibrated ranks' reductions, in the dtype they ran in
            dtypes = {device: dtype for device, dtype, _ in context.devices}
            calibrated = {d.rank: compute.reduce_s_per_byte(d, dtypes.get(d.spec.name))
                          for d in context_devices(context)}
            own = fit_profile(rows, context, calibrated, pings)
            for key, value in own.items():
                fitted.setdefault(key, value)
            for key, value in fit_intra_host(rows, pings, context, own, calibrated).items():
                inside.setdefault(key, value)
            for key, value in fit_hops(pings, context).items():
                hops.setdefault(key, value)
        # one calibrated cluster's rows say how many of its ranks computed at once (a pool: every rank)
        concurrency = calibrated_concurrency(profile.rows, sum(contexts[0].ranks_per_host)) if len(contexts) == 1 else {}
        cached = _FITS[id(profile)] = _Fit(profile, fitted, hops, concurrency, inside, lag_per_block(profile, contexts))
    fitted, hops, inside = cached.terms, cached.hops, cached.inside
    network = TransportNetwork(topology, reduction_costs(compute, topology.devices), fitted,
                               _borrowed(fitted) or default_terms(""), gap_s, hops=hops, intra_host=inside)
    concurrency = cached.concurrency if target.pipelined else {}
    scale, pools, contention, phase_scales = core_contention(contexts, target, ranks or tuple(range(topology.num_ranks)),
                                                             concurrency, cached.lag_per_block)
    if len(profile.of(MeasurementKind.COMPUTE_ISOLATED)):
        contention += ("; the forward ops the profile timed alone by shard shape (compute_isolated) at that time, "
                       "no factor: processor sharing only")
    floors = {library: contention_floor(profile, contexts, target, fitted, library=library, copies=copies)
              for library in (False, True)}
    network.cores = contention_cores(contexts, target)
    network.copies = copies
    if any(floor.floor_s > 0 for floor in floors.values()):
        def floored(terms: dict) -> dict:
            return {key: replace(t, min_message_s=floors[key[1] == LIBRARY].floor_s,
                                 intra_host_min_message_s=floors[key[1] == LIBRARY].intra_host_s)
                    for key, t in terms.items()}

        fitted, inside = floored(fitted), floored(inside)
        network.terms, network.intra_host = fitted, inside
        network.default = replace(network.default, min_message_s=floors[False].floor_s,
                                  intra_host_min_message_s=floors[False].intra_host_s)
    sources = (contention, floors[False].source, floors[True].source,
               *(f"{kind} {algorithm}: {t.describe()}" for (kind, algorithm), t in sorted(fitted.items())),
               *(f"{kind} {algorithm} inside a host: {t.describe()}" for (kind, algorithm), t in sorted(inside.items())),
               *(f"pipeline hop over {link_class.value}: {t.describe()}" for link_class, t in sorted(hops.items())),
               *compute.reduction_sources())
    return NetworkChoice(network, False, terms, sources, scale, pools, phase_scales)


def lag_per_block(profile: Profile, contexts) -> float:
    """The ranks' arrival lag coefficient on shared cores (:mod:`sim.arrival_skew`): the median
    of :func:`sim.arrival_skew.fit_lag_per_block` over the calibrated clusters that record their
    cores (a pool: each cluster's rows, ranks and cores) and whose links have a delay below
    :data:`sim.transport.IDENTIFIABLE_DELAY_S`, else :data:`sim.arrival_skew.DEFAULT_LAG_PER_BLOCK`.
    Over delayed links the ranks leave a call apart by the wire (a schedule's ranks finish at
    different steps, which the pricing gives them already) and sleep through the delay, so the
    master's wait there is not the cores' alone (as for :func:`contention_floor`)."""
    from sim.arrival_skew import DEFAULT_LAG_PER_BLOCK, fit_lag_per_block
    from sim.transport import IDENTIFIABLE_DELAY_S, context_topology

    fits = []
    for context in contexts:
        if context.cores is None:
            continue
        topology = context_topology(context)
        if max((topology.path_latency_s(a, b) for a in range(topology.num_ranks) for b in range(topology.num_ranks)
                if a != b), default=0.0) >= IDENTIFIABLE_DELAY_S:
            continue
        rows = profile.rows[_rows_of(profile.rows, profile.rows, context.name)] if len(contexts) > 1 else profile.rows
        fit = fit_lag_per_block(rows, sum(context.ranks_per_host), context.cores)
        if fit is not None:
            fits.append(fit)
    return float(np.median(fits)) if fits else DEFAULT_LAG_PER_BLOCK


CONTENTION_BOUND = 1.5  # a message is contention-bound where it costs this much more than its wire


def contention_cores(contexts, target) -> int | None:
    """The cores the target's ranks share: the scenario's, else the first calibrated machine's
    that records them (the emulated hosts share one machine); None where none does."""
    known = [c.cores for c in contexts if c.cores is not None]
    return target.cores or (known[0] if known else None)


class ContentionFloor(NamedTuple):
    """What :func:`contention_floor` gives: the least a message costs per core turn (s), a line
    saying whence, and where it differs inside a host, that of a message between two ranks of
    one host (s; None: the same)."""

    floor_s: float
    source: str
    intra_host_s: float | None = None


def contention_floor(profile: Profile, contexts, target, fitted: dict, library: bool = False,
                     copies: int = 1) -> ContentionFloor:
    """The least a message costs on the target per core turn of a step that keeps every rank
    busy (s; between hosts and inside one where they differ) and a line saying whence, for
    point-to-point schedules or (``library``) gloo's own collectives.

    Where ranks outnumber the cores, a message moves only once both its ends are scheduled, so
    on a fast link it costs a scheduling delay, not its wire time; over a slow link the ranks
    sleep and the cores are free, and so are they in a step that leaves no more ranks busy
    than there are cores (:meth:`sim.transport._TransportLinks.floor_s` charges the floor per core
    turn of a step whose busy ranks outnumber the cores, :func:`sim.transport.step_turns`: one
    to enter it, one per message a rank sends or receives). Fitted on the calibrated cluster's
    collectives of that family timed in place at their smallest size: the median over the calls
    of each call over its core turns in contending steps (of steps a rank keeps in flight
    together, gloo's ring's, those on the critical path), of the calls whose time per
    contending step is :data:`CONTENTION_BOUND` times what the fitted transport terms give a
    message (else the links hid it). The target's ranks on the machine are
    its ``copies`` replicas' (:mod:`sim.replicas`: each replica's ranks compute, and message, at
    once with the others'). For gloo's own collectives the test is
    against the wire's latencies alone: their isolated sweep on fast links ran on the same
    shared cores, so the fitted per-message overhead already holds the contention and would hide
    it. Measured here with 4 ranks on 2 cores over links without delay: 0.74-0.77 ms per core
    turn of a point-to-point schedule (2.0-2.4 ms per exchange step), 0.35 ms per turn of gloo's
    own allreduce, reduce and broadcast, which wait inside the library (a step of gloo's ring: a
    round of its two segments in flight). Each calibrated cluster's value is carried to the
    target's ranks per core (the calibrated machine's cores where the scenario does not say) by
    :func:`sim.transport.contention_at`: point-to-point in proportion (processor sharing), gloo's
    own unchanged; 0 where they do not outnumber them. Not fitted on a calibrated cluster whose links have a delay of at least
    :data:`sim.transport.IDENTIFIABLE_DELAY_S`: each step there holds the delay, which the ranks
    sleep through, and priced at the fitted terms' overhead bounded by the ping-pongs'
    (:func:`sim.transport.message_overhead_s`) it would pass for contention (h2x2_mid, 1.1 ms:
    3.7 ms per point-to-point message, which then priced the fast clusters' TPOT +50-90%). There,
    and where a cluster's in-place calls are none of them contention-bound, fitted the same way
    on the same calls timed on loopback after its launch (``collective_loopback`` rows,
    :mod:`runtime.loopback_contention`: the calibrated machine's cores without the links' delay,
    at a few group sizes, each rank its own host), where no cluster of the pool shows it in place:
    a message over the loopback interface costs more per turn than one between the testbed's
    hosts (4 ranks on 2 cores: 0.54-0.62 ms on loopback, 0.51 in place on 2 hosts of 2 ranks, 0.28
    on 4 hosts of 1), so loopback is the fallback, not the rule. Of a cluster's loopback sizes,
    the one nearest the target's ranks on the machine is carried: how the delay grows with the
    ranks beyond the cores is the machine's too (this project's 2-vCPU machine: 3 ranks 0.41 of 4,
    where processor sharing says 0.75). The path decides the delay too: on the emulated cluster the
    same group with each rank in its own namespace, the hosts' path, costs about half loopback's
    per turn and reproduces the in-place calls (``benchmarks/bench_contention_paths.py``), so
    where no cluster of the pool shows the floor in place and a calibration timed the calls both
    ways (``collective_bridged`` rows, a calibration on the testbed), the floor between hosts
    comes from the namespaces and the one inside a host from loopback, each at the size nearest
    the target's ranks (loopback's alone for every message priced 4 hosts of 1 rank +34% TPOT
    median from the delayed clusters' profiles; session 31, ``validation/transfer-report/progress.md``).
    The in-place calls still come first: taking the per-path rows over them priced the intra-host
    messages of 2 hosts of 2 ranks over a 1 ms link (h2x2_mid) +14% TPOT, where the in-place
    clusters' floors gave +5%. But a cluster with a host of several ranks mixes both paths in
    place, so where its calibration timed the per-path rows too, its in-place calls are counted
    with each step's turns weighted by its slowest message's path, one inside a host counting the
    ratio of the loopback floor to the bridged one: that gives the floor between hosts, the ratio
    times it the one inside (a pool's median of v2x2_bandwidth's mixed floor and the one-rank-a-host
    clusters' priced v4x1_bandwidth +15% TPOT and v2x2_bandwidth -11%; so split, -0.4% and -2%,
    ``validation/transfer-report/fresh-s31``). The slowest, not the mean over the step's messages:
    a step lasts until its last message is through, and so is it priced (each message waits out
    its own path's floor, :class:`sim.transport._TransportRun`); weighted by the mean, the fit
    gave a step of 2 messages inside a host and 2 between hosts (TP 4 on 2 hosts of 2) 1.23 times
    the floor between hosts where pricing then charged 1.46, and priced uneven TP 3's 3-rank
    reduce on v2x2_bandwidth 2.8 ms a decode call against 1.7-2.0 ms measured (TPOT +24..+28%,
    ``validation/layouts-report/progress.md``, session 34). Where no calibrated cluster has either, the gloo/tcp default
    (:data:`sim.transport.GLOO_CONTENTION_PER_TURN_S`, fitted on another machine), else 0."""
    from sim.transport import (GLOO_CONTENTION_PER_TURN_S, GLOO_CONTENTION_SHARING, IDENTIFIABLE_DELAY_S, Transport,
                               contention_at, context_topology, of_replicas)

    family = "gloo's own collectives" if library else "point-to-point"
    known = [c for c in contexts if c.cores is not None]
    cores = contention_cores(contexts, target)
    if cores is None:
        return ContentionFloor(0.0, f"core contention per core turn ({family}): none (no cores recorded)")
    machine_ranks = sum(target.ranks_per_host) * copies
    sharing = f"{machine_ranks} ranks{of_replicas(copies)} on {cores} cores"
    excess = max(0, machine_ranks - cores)
    if excess == 0:
        return ContentionFloor(0.0, f"core contention per core turn ({family}): none ({sharing})")
    def own(kind: MeasurementKind, calibrated):
        rows = profile.of(kind)
        return rows[_rows_of(profile.rows, rows, calibrated.name)]

    def carried(ranks: int, costs: list[float], calibrated) -> float:  # to the target's ranks per core
        return contention_at(float(np.median(costs)), ranks / calibrated.cores, machine_ranks / cores, library)

    def nearest(kind: MeasurementKind, calibrated) -> tuple[float, int] | None:
        """(the floor of the group size of ``kind``'s rows timed nearest the target's ranks, that size)."""
        rows = own(kind, calibrated)
        sized = [(int(size), _turn_costs(rows[rows["group_size"] == size], kind, calibrated, fitted, library,
                                         one_host_each, (1,) * int(size), 0.0))
                 for size in sorted(set(rows["group_size"]))]
        sized = [(size, costs) for size, costs in sized if costs]
        if not sized:
            return None
        size, costs = min(sized, key=lambda m: abs(m[0] - machine_ranks))
        return carried(size, costs, calibrated), size

    def by_path(calibrated):
        """(the floor between namespaces, the one on loopback) of ``calibrated``, each as
        :func:`nearest` gives it; None without both."""
        bridged = nearest(MeasurementKind.COLLECTIVE_BRIDGED, calibrated)
        looped = nearest(MeasurementKind.COLLECTIVE_LOOPBACK, calibrated) if bridged else None
        return (bridged, looped) if looped else None

    # each calibrated cluster's calls in place, unless their steps held the link's delay, slept
    # through (what they show is the link's); where no cluster of the pool has them, the same calls
    # timed by path after its launch, between namespaces (the inter-host path) and on loopback (the
    # intra-host one), at the group size timed nearest the target's ranks; without the first, the
    # calls on loopback alone, for every message
    per_turn, inside, names = [], [], []
    for calibrated in known:  # a pool: each cluster's calls over its own links and cores
        topology = context_topology(calibrated)
        delay_s = max((topology.path_latency_s(a, b) for a in range(topology.num_ranks)
                       for b in range(topology.num_ranks) if a != b), default=0.0)
        if delay_s < IDENTIFIABLE_DELAY_S:
            paths = by_path(calibrated)
            ratio = paths[1][0] / paths[0][0] if paths and paths[0][0] > 0 else None
            costs = _turn_costs(own(MeasurementKind.COLLECTIVE_IN_PLACE, calibrated), MeasurementKind.COLLECTIVE_IN_PLACE,
                                calibrated, fitted, library, topology.host_groups, calibrated.ranks_per_host, delay_s,
                                intra_ratio=ratio or 1.0)
            if costs:
                per_turn.append(carried(sum(calibrated.ranks_per_host), costs, calibrated))
                inside.append(per_turn[-1] * (ratio or 1.0))
                names.append(f"in place on {calibrated.name}" + ("" if ratio is None else
                                                                  f" (split by path {ratio:.2f}:1)"))
    for calibrated in known if not per_turn else ():
        paths = by_path(calibrated)
        if paths:
            bridged, looped = paths
            per_turn.append(bridged[0])
            inside.append(looped[0])
            names.append(f"between namespaces over {bridged[1]} ranks and on loopback over {looped[1]} (inside a "
                         f"host) after the launch of {calibrated.name}")
    for calibrated in known if not per_turn else ():
        looped = nearest(MeasurementKind.COLLECTIVE_LOOPBACK, calibrated)
        if looped:
            per_turn.append(looped[0])
            names.append(f"on loopback over {looped[1]} ranks after the launch of {calibrated.name}")
    if per_turn:
        floor_s = float(np.median(per_turn))
        intra_s = float(np.median(inside)) if inside else None
        within = "" if intra_s is None else f" between hosts, {intra_s * 1e3:.2f} ms inside one"
        return ContentionFloor(floor_s, (f"core contention per core turn ({family}): at least {floor_s * 1e3:.2f} ms"
                                         f"{within}, fitted on the calls timed {', '.join(names)} ({sharing})"),
                               intra_s)
    if all(c.backend == Transport.GLOO_TCP.value for c in known):
        floor_s = contention_at(GLOO_CONTENTION_PER_TURN_S[library], GLOO_CONTENTION_SHARING, machine_ranks / cores,
                                library)
        return ContentionFloor(floor_s, (f"core contention per core turn ({family}): at least {floor_s * 1e3:.2f} ms, "
                                         f"the gloo/tcp default (the calibrated links hid it; {sharing})"))
    return ContentionFloor(0.0, (f"core contention per core turn ({family}): not priced (the calibrated links were "
                                 f"too slow for it to show in place; {sharing})"))


def _turn_costs(rows, kind: MeasurementKind, calibrated, fitted: dict, library: bool, host_groups,
                ranks_per_host: tuple[int, ...], delay_s: float, intra_ratio: float = 1.0) -> list[float]:
    """Per call of ``rows`` (calibrated cluster ``calibrated``'s rows of ``kind``:
    ``collective_in_place``, its own group; ``collective_loopback``, a group of ``ranks_per_host``'s
    ranks on the calibrated machine) of the family (gloo's own or point-to-point) at its smallest
    size, its schedule over ``host_groups`` (``Topology.host_groups``' shape) whose links' longest
    delay is ``delay_s``: the call over its core turns in contending steps (s), a turn of a step
    with a message inside a host counting ``intra_ratio`` (its path's floor over the inter-host
    one's: a step lasts as long as its slowest message), for the
    calls that are contention-bound (:func:`contention_floor`). Every rank of the group is on the
    machine."""
    from sim.transport import busy_ranks, step_turns, steps_in_series

    rows = rows[rows["group_size"] <= sum(ranks_per_host)]
    rows = rows[((rows["algorithm"] == LIBRARY) == library) & (rows["size_bytes"] == rows["size_bytes"].min())]
    if sum(ranks_per_host) <= calibrated.cores:
        return []  # no rank waited for a core
    bound = []
    for row in rows.itertuples(index=False):
        terms = fitted.get((str(row.op), str(row.algorithm)))
        if terms is None:
            continue
        group = tuple(range(int(row.group_size)))
        schedule = build_schedule(row.op, row.algorithm, group, int(row.size_bytes),
                                  root=None if row.op == OpKind.ALLREDUCE.value else 0, host_groups=host_groups(group))
        # the steps that contend: those whose busy ranks outnumber the cores
        shares = [float(n > calibrated.cores) for n in busy_ranks(schedule)]
        steps = steps_in_series(schedule, shares)
        if steps <= 0:
            continue
        call_s = float(getattr(row, CHARGED[kind]))
        overhead_s = 0.0 if library else terms.per_message_s
        if call_s / steps > CONTENTION_BOUND * (overhead_s + terms.latencies_per_message * delay_s):
            # per core turn on the critical path: a step counts its share times its turns
            host_of = {rank: index for index, ranks in enumerate(host_groups(group)) for rank in ranks}
            paths = [max(intra_ratio if host_of[t.src] == host_of[t.dst] else 1.0 for t in step)
                     if step else 1.0 for step in schedule.steps]
            bound.append(call_s / steps_in_series(schedule, [share * turns * path for share, turns, path
                                                             in zip(shares, step_turns(schedule), paths)]))
    return bound


def one_host_each(group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """A loopback group's ranks partitioned into hosts (``Topology.host_groups``' shape): each its
    own, as :mod:`runtime.loopback_contention` times them."""
    return tuple((r,) for r in group)


def _borrowed(fitted: dict):
    """The terms of an isend/irecv schedule the profile did not time: the median of those it did
    (every such schedule sends the same kind of message), None if it timed none."""
    from sim.transport import TransportTerms

    p2p = [t for (_, algorithm), t in sorted(fitted.items()) if algorithm != LIBRARY]
    if not p2p:
        return None
    return TransportTerms(float(np.median([t.per_message_s for t in p2p])),
                          float(np.median([t.latencies_per_message for t in p2p])),
                          float(np.median([t.bandwidth_efficiency for t in p2p])),
                          f"the median of the {len(p2p)} point-to-point schedules fitted",
                          notice_latencies=float(np.median([t.notice_latencies for t in p2p])),
                          sender_done_on_write=all(t.sender_done_on_write for t in p2p),
                          send_buffer_s=min(t.send_buffer_s for t in p2p),
                          send_buffer_max_bytes=min(t.send_buffer_max_bytes for t in p2p))


def context_devices(context) -> tuple[Device, ...]:
    """The devices of the cluster a context describes (:func:`sim.transport.context_topology`)."""
    from sim.transport import context_topology

    return context_topology(context).devices


def _rows_of(all_rows, rows, name: str):
    """Which of ``rows`` belong to calibrated cluster ``name``. A pooled profile concatenates
    whole profiles, each sorted by measurement (:func:`sim.profile.profile_frame`), so one begins
    wherever the measurement kind goes back in order; its context rows name it."""
    kinds = all_rows["measurement"].astype(str)
    segment = (kinds < kinds.shift(fill_value="")).cumsum()
    named = all_rows[kinds == MeasurementKind.CONTEXT].groupby(segment[kinds == MeasurementKind.CONTEXT])["call"].first()
    return segment.loc[rows.index].map(named).to_numpy() == name
