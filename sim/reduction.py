"""The reduction cost per byte (gamma) of a device type and dtype, fitted on a profile's
``reduction`` rows.

A collective's reduction steps combine each received buffer into the rank's own; the simulator
prices that gamma seconds per received byte, the gamma of the alpha-beta-gamma model (Thakur,
Rabenseifner and Gropp, IJHPCA 19(1), 2005; :mod:`sim.network`, :mod:`sim.transport`). Without
a measurement it is a roofline (:meth:`sim.cost.RooflineCompute.reduce_s_per_byte`: 3 bytes of
traffic per byte over the memory bandwidth times its efficiency). With the ``reduction`` rows of
a calibration (:mod:`runtime.reduction_bench`: the runtime schedules' own ``add_`` of a received
buffer, timed alone at 64 KiB to 64 MiB), it is the slope of an affine least-squares fit
``t = intercept + gamma x bytes`` over the sizes' medians, per device type and dtype (the rows of
a pool of profiles pooled: one microbenchmark of one device type).

The intercept, a call's fixed cost, is reported and not priced: the engine charges a reduction
gamma x bytes only, and a message's fixed costs are what the transport terms fitted on the
collective sweep hold (per-message software overhead, :mod:`sim.transport`). It can come out
negative: sizes that fit in a cache run faster per byte than the larger ones that set the slope
(a calibration on this project's CPU, fp32: 65 ps/B at 64 KiB, 95 ps/B at 64 MiB, gamma 95.5 ps/B,
intercept -56 us).

Each collective is priced with the gamma of the dtype it reduces in (``Collective.dtype``,
:class:`sim.network.ReductionCosts`): a DDP bucket's fp32 gradients, a compressed bucket's fp16 or
bf16, a tensor-parallel allreduce's activations in the compute dtype. They differ: on a CPU torch
adds fp16 and bf16 elements through fp32 conversions. Measured on this project's CPU (AMD EPYC,
2 cores, AVX2, torch 2.13 CPU build), ``a.add_(b)`` of 16 MiB per operand on one thread, median
of 5 calls after 2 warm-up calls: on a quiet machine, twice, fp32 87-90 ps/B (11.3 GB/s), fp16
129-139 ps/B (x 1.5), bf16 190-192 ps/B (x 2.2); with other processes on the cores (load 3.5-4),
five runs timing the thread's CPU time (``time.thread_time``, as :mod:`runtime.reduction_bench`),
fp32 76-138, fp16 140-192, bf16 201-261 ps/B: bf16 1.6 to 2.6 times fp32's in every run, fp16
1.2 to 1.8 times. With (``time.thread_time`` for ``time.perf_counter`` in the second)::

    python -c "import statistics, time, torch; torch.set_num_threads(1)
    for d in (torch.float32, torch.float16, torch.bfloat16):
        n = (16 << 20) // torch.empty((), dtype=d).element_size()
        a, b = torch.full((n,), 1.0, dtype=d), torch.full((n,), 2.0**-10, dtype=d)
        [a.add_(b) for _ in range(2)]
        t = []
        for _ in range(5): s = time.perf_counter(); a.add_(b); t.append(time.perf_counter() - s)
        print(d, statistics.median(t) / (16 << 20) * 1e12, 'ps/B')"

A profile without rows of a collective's dtype prices it with the :data:`STAND_IN_DTYPE` rows of
the device type, unscaled, and its terms say so (:func:`reduction_terms`); without those either,
with the roofline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.training import GRADIENT_DTYPE
from sim.context import TermComparison, Verdict
from sim.profile import ISOLATED, Profile
from sim.topology import Device
from sim.vocabulary import MeasurementKind


@dataclass(frozen=True)
class ReductionFit:
    """The fitted reduction cost of one device type in one dtype.

    Attributes:
        device_class: the device type (a :data:`sim.devices.DEVICES` name).
        dtype: the dtype the reduction ran in.
        gamma_s_per_byte: the slope, seconds per received byte (> 0).
        intercept_s: the fit's value at 0 bytes (s); not priced (module docstring).
        sizes_bytes: the distinct sizes fitted on, ascending.
    """

    device_class: str
    dtype: str
    gamma_s_per_byte: float
    intercept_s: float
    sizes_bytes: tuple[int, ...]

    def describe(self) -> str:
        """One line: the fitted gamma, what it was fitted on, and the intercept left out."""
        return (f"gamma {self.gamma_s_per_byte * 1e12:.1f} ps/B, {1e-9 / self.gamma_s_per_byte:.2f} GB/s of received "
                f"bytes: the slope of the profile's reduction rows over {len(self.sizes_bytes)} sizes, "
                f"{_size(self.sizes_bytes[0])} to {_size(self.sizes_bytes[-1])}; their intercept, "
                f"{self.intercept_s * 1e6:.1f} us per call, not priced: a message's fixed cost is the transport terms'")


def fit_reductions(profile: Profile) -> dict[tuple[str, str], ReductionFit]:
    """(device type, dtype) -> :class:`ReductionFit` of the profile's ``reduction`` rows, the
    median of each size's rows (their :data:`sim.profile.ISOLATED` statistic) fitted; a device
    type and dtype with fewer than two sizes, or whose slope is not positive (noise), has none."""
    rows = profile.of(MeasurementKind.REDUCTION)
    fits = {}
    for (device_class, dtype), group in rows.groupby(["device_class", "dtype"], sort=True):
        by_size = group.groupby("size_bytes", sort=True)[ISOLATED].median()
        if len(by_size) < 2:
            continue
        sizes = by_size.index.to_numpy(dtype=float)
        gamma, intercept = np.polyfit(sizes, by_size.to_numpy(dtype=float), 1)
        if gamma > 0:
            fits[(str(device_class), str(dtype))] = ReductionFit(str(device_class), str(dtype), float(gamma),
                                                               float(intercept), tuple(int(s) for s in sizes))
    return fits


STAND_IN_DTYPE = GRADIENT_DTYPE
"""The dtype whose ``reduction`` rows price a reduction in a dtype the profile has none of: fp32,
what every training calibration times (the gradients' dtype, :data:`models.training.GRADIENT_DTYPE`)."""


def fit_for(fits: dict[tuple[str, str], ReductionFit], device_class: str, dtype: str) -> ReductionFit | None:
    """The fit that prices a reduction in ``dtype`` on ``device_class``: that dtype's, else the
    :data:`STAND_IN_DTYPE` fit of the device type (unscaled: see the module docstring for how far
    apart the dtypes are), else None (the roofline)."""
    return fits.get((device_class, dtype)) or fits.get((device_class, STAND_IN_DTYPE))


UNMEASURED = ("reductions: the roofline's cost per byte (3 bytes of traffic per byte over the memory "
              "bandwidth x memory_efficiency): the profile has no reduction rows, written before they were measured")
"""The source line of a profile without ``reduction`` rows (:meth:`sim.calibrated.CalibratedCompute.reduction_sources`)."""


def reduction_terms(fits: dict[tuple[str, str], ReductionFit], measured: bool, devices: tuple[Device, ...],
                    dtypes: tuple[str, ...], roofline_s_per_byte) -> tuple[TermComparison, ...]:
    """What prices the reductions of ``devices`` in each of ``dtypes`` (those the collectives
    reduce in), one term per device type in order of first appearance and dtype: ``same`` where
    ``fits`` (:func:`fit_reductions`) has that device type and dtype (the microbenchmark carries
    over to any device of the type), else ``not applicable``: the :data:`STAND_IN_DTYPE` fit of
    the device type, unscaled, where there is one (:func:`fit_for`), else the roofline,
    ``roofline_s_per_byte(device)`` s/byte, and why. None where the
    profile has no ``reduction`` rows at all (``measured`` False: one written before they were
    measured): the term was not calibrated, which is no difference between the profile's context and
    the scenario's, so it is no term outside the context (:func:`sim.context.profile_context`);
    :data:`UNMEASURED` says so among the sources instead."""
    if not measured:
        return ()
    first: dict[str, Device] = {}
    for device in devices:
        first.setdefault(device.spec.name, device)
    terms = []
    for name, device in first.items():
        for dtype in dict.fromkeys(dtypes):
            terms.append(_term(fits, name, dtype, roofline_s_per_byte(device)))
    return tuple(terms)


def _term(fits: dict[tuple[str, str], ReductionFit], name: str, dtype: str, roofline_s: float) -> TermComparison:
    """The term of reductions in ``dtype`` on device type ``name`` (:func:`reduction_terms`)."""
    term = f"reduction on {name} {dtype}"
    fit = fits.get((name, dtype))
    if fit is not None:
        return TermComparison(term, Verdict.SAME, fit.describe())
    stand_in = fit_for(fits, name, dtype)
    if stand_in is not None:
        return TermComparison(term, Verdict.NOT_APPLICABLE, (
            f"no {name} {dtype} reduction rows: the {name} {STAND_IN_DTYPE} rows' gamma, unscaled, though a "
            f"{dtype} add costs other than an {STAND_IN_DTYPE} one per byte (on a CPU torch converts, "
            f"sim.reduction); {stand_in.describe()}"))
    if fits:
        why = f"the profile's reductions fitted are of {', '.join(' '.join(key) for key in sorted(fits))}"
    else:
        why = "the profile's reduction rows give no positive slope over two sizes or more"
    return TermComparison(term, Verdict.NOT_APPLICABLE,
                          f"{why}: roofline, {roofline_s * 1e12:.1f} ps/B, 3 bytes of "
                          "traffic per byte over the memory bandwidth x memory_efficiency")


def _size(size_bytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"
