"""The calibration profile: what the runtime measured on a cluster, for the simulator's cost models.

A tidy CSV table, one row per measurement, SI units (``unit`` says which: s or bytes). Only the
runtime writes it (``hetsim calibrate``); only the simulator's cost models read it
(:mod:`sim.calibrated`). Columns:

``version``: :data:`PROFILE_VERSION`; a profile of another version is refused.
``measurement``: what the row is:
  * ``compute``: one compute op, timed inside the runtime's own execution (the ranks running
    together, as in a real run): ``device_class`` (the device type), ``op`` (an op kind),
    ``group_size`` (tensor-parallel degree), ``batch_size``, ``new_tokens``, ``context_tokens``,
    ``dtype``, ``flops`` and ``traffic_bytes`` of the op;
  * ``compute_isolated``: one compute op of the model alone on a core (the other ranks asleep):
    rank 0's shard at tensor-parallel width ``group_size``, with the same columns as ``compute``
    (:mod:`runtime.shape_bench`); what prices a target's ops by their shape outside same-cluster
    mode (:class:`sim.calibrated.CalibratedCompute`);
  * ``compute_device`` / ``host_issue`` (an accelerator whose host queues work ahead, CUDA): the
    same op alone, with the same columns, split in two: the time its kernels take on the device
    (CUDA events, the kernels queued before the device reached them, so no wait for the host is
    in it) and the time the host takes to queue them (the call's return, without waiting for the
    device), :mod:`runtime.shape_bench`;
  * ``device_ceiling``: the two ceilings of such a device (op ``matmul``: a large matrix product in
    ``dtype``, FLOP/s; op ``copy``: a large device-to-device copy, bytes read plus written per s),
    whose ``median`` is the rate (:func:`runtime.shape_bench.ceiling_rows`);
  * ``op_gap``: time between the end of one op and the start of the next on a rank (dispatch and
    bookkeeping of the framework), per ``device_class``;
  * ``collective``: a collective ``op`` (allreduce, reduce, broadcast) by ``algorithm`` over
    ``group_size`` ranks on ``num_hosts`` hosts, of ``size_bytes`` per rank, timed in isolation
    from the last rank's start to the last rank's end (the simulator's charge);
  * ``collective_held_out``: a ``collective`` row at a size the simulator does not interpolate
    from (``hetsim validate`` times sizes between the calibrated ones in the same rounds, to check
    the interpolation);
  * ``collective_in_place``: the collective calls of real generations of the scenario's strategies
    (where they share the cores with the ranks' compute), from the group's last arrival to the
    end of the call on its first rank (the master: the rank whose steps TTFT and TPOT time),
    per plan op (``call``: its name in the plan, such as ``attn_allreduce``, which says where in
    a step it sits); each repeat is one generation's mean call;
  * ``collective_wait``: the same calls, the master's wait inside them for the last rank to
    arrive (arrival skew: ranks time-sliced on shared cores, a broadcast's leaves still
    receiving after its root left); each repeat one generation's mean;
  * ``collective_loopback``: the in-place calls' kinds and algorithms at their smallest size, timed
    as ``collective_in_place`` is, after the launch, in one loopback gloo group of the machine's
    ranks computing between calls (:mod:`runtime.loopback_contention`): the machine's delay per
    core turn on a small message, which a calibration over delayed links cannot show in place
    (:func:`sim.calibrated.contention_floor`): intra-host messages' path on the emulated cluster;
  * ``collective_bridged``: the same calls timed the same way with each rank in its own testbed
    namespace on a bridge without delay (:func:`runtime.loopback_contention.bridged_rows`, a
    calibration on the testbed only): the delay per core turn of the emulated cluster's
    inter-host path, about half loopback's;
  * ``p2p``: a point-to-point message of ``size_bytes`` on a ``device_class`` link class
    (:class:`sim.context.LinkClass`: ``intra_host`` or ``inter_host``), half a ping-pong round trip;
  * ``reduction``: the reduction the runtime's own collectives perform (``op`` add: a received
    buffer added into the local one, :func:`runtime.comm.run_schedule`) on a ``device_class`` in
    ``dtype``, of ``size_bytes`` per operand (``traffic_bytes``: both read, one written), timed
    alone (:mod:`runtime.reduction_bench`); what the reduction cost per byte, gamma, is fitted on
    (:func:`sim.reduction.fit_reductions`);
  * ``memory_baseline``: what a rank holds beyond its model's weights and KV cache (framework,
    communication buffers, allocator), in bytes;
  * ``backward_input`` / ``backward_weight``: a training scenario's backward of one compute ``op``
    kind, the gradient of its inputs or of its weights alone, at ``batch_size`` sequences of
    ``new_tokens`` tokens, with the op's ``flops`` and ``traffic_bytes`` (:mod:`models.training`);
  * ``optimizer_step``: one step of optimizer ``op`` (sgd, adam, adamw) over ``size_bytes`` of fp32
    parameters, with its ``flops`` and ``traffic_bytes`` (:func:`models.training.optimizer_step_cost`);
  * ``training_pass``: a training model's whole forward pass (``op`` forward: to the loss) or
    backward pass (``op`` backward) on one rank without DDP or communication, at ``batch_size``
    sequences of ``new_tokens`` tokens in ``dtype`` (:mod:`sim.training.step_compute` sets it
    against the sum of the pass's ops);
  * ``context``: what the profile was measured on (device types, ranks per host, cores, each
    link class's rate and delay, backend and transport, torch version) and the load it ran
    under (the shares of the machine's CPU time stolen and taken by other processes), one row
    per term with its value as JSON in ``method`` (:mod:`sim.context`). A profile without them is
    taken to be of the scenario it is simulated with; one without the load row, of unknown load.
``precision``: of a training calibration's ``compute``, ``backward_*``, ``training_pass`` and
``optimizer_step`` rows, the training precision the op ran in as the trainer runs it
(:class:`models.training.Precision`: ``amp_bf16`` autocast over the fp32 weights, ``bf16_mixed``
kernels reading bf16 copies of them, ``fp32``), so that two precisions of one compute dtype are
rows apart and each variant is priced from its own (:meth:`Profile.of_precision`); empty on every
other row. Optional: a profile written before the column was added has none, and its rows price
every precision of their dtype.
``median``, ``p10``, ``p90``, ``mean``: over ``repeats`` repetitions; ``method``: how it was measured.
The simulator charges, of what a run repeats in every step, the statistic
:data:`sim.calibrated.CHARGED` names: the *mean* of ``compute`` and ``op_gap`` rows, pooled
single timings, because a step is a sum of them, the mean of a sum is the sum of the means, and
the median of a right-skewed time (a shared machine only ever adds time) falls short of it; the
*median* of ``collective_in_place`` and ``collective_wait`` rows, whose repeats are generations'
means already, because TTFT and TPOT are medians over generations.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from models.errors import ConfigError, shorten
from models.input_files import read_text
from models.training import Precision, compute_dtype
from sim.vocabulary import MeasurementKind

# The profile statistic charged, per kind of measurement a run repeats in every step: compute ops
# and gaps are pooled over ranks, layers and repeats, and their mean is what a sum of them adds
# up to; in-place collectives and waits are per-generation means already (runtime.comm_timing),
# and their median over generations is what a median TTFT or TPOT is made of. An op timed alone
# is charged its median, as an isolated microbenchmark is: the target's contention is the
# simulation's processor sharing, not the noise of the calibrating machine.
CHARGED = {MeasurementKind.COMPUTE: "mean", MeasurementKind.COMPUTE_ISOLATED: "median", MeasurementKind.OP_GAP: "mean",
           MeasurementKind.COMPUTE_DEVICE: "median", MeasurementKind.HOST_ISSUE: "median",
           MeasurementKind.BACKWARD_INPUT: "mean", MeasurementKind.BACKWARD_WEIGHT: "mean",
           MeasurementKind.OPTIMIZER_STEP: "mean",
           MeasurementKind.COLLECTIVE_IN_PLACE: "median", MeasurementKind.COLLECTIVE_WAIT: "median",
           MeasurementKind.COLLECTIVE_LOOPBACK: "median", MeasurementKind.COLLECTIVE_BRIDGED: "median"}
ISOLATED = "median"  # the statistic of an isolated microbenchmark, which is checked by its median


def noise_floor(times):
    """Isolated timings of one schedule in ascending message size made non-decreasing: each the
    least at its size or above (a numpy array, s). A larger message of the same schedule cannot
    take less time, and on a shared machine noise only adds time, so a median above a larger
    size's is noise (measured here: a 1 KiB reduce over 5 ms links calibrated at 54 ms, 64 KiB at
    42 ms, and 2 KiB then measured 40 ms)."""
    return np.minimum.accumulate(np.asarray(times, dtype=float)[::-1])[::-1]

_MAX_PROFILE_BYTES = 64 << 20  # a calibrated cluster's profile is tens of KiB
PROFILE_VERSION = 4  # 4: in-place collectives and waits per plan op, statistics over generations' means

PROFILE_COLUMNS = [
    "version", "measurement", "device_class", "call", "op", "algorithm", "group_size", "num_hosts", "batch_size",
    "new_tokens", "context_tokens", "size_bytes", "dtype", "precision", "flops", "traffic_bytes",
    "median", "p10", "p90", "mean", "unit", "repeats", "method",
]
OPTIONAL_COLUMNS = frozenset({"precision"})
"""Columns a profile of :data:`PROFILE_VERSION` written before they were added lacks (read as empty)."""


@dataclass(frozen=True)
class Profile:
    """A loaded calibration profile (its rows, validated)."""

    rows: pd.DataFrame

    def of(self, measurement: MeasurementKind) -> pd.DataFrame:
        """The rows of one kind of measurement."""
        return self.rows[self.rows["measurement"] == measurement]

    def precisions(self) -> tuple[Precision, ...]:
        """The training precisions the profile's rows were timed in (``precision`` column), in
        :class:`models.training.Precision`'s order; empty for a profile that records none."""
        if "precision" not in self.rows.columns:
            return ()
        recorded = set(self.rows["precision"].dropna())
        return tuple(p for p in Precision if p.value in recorded)

    def of_precision(self, precision: Precision) -> tuple[Profile, Precision | None]:
        """The profile a variant trained in ``precision`` is priced from, and the precision whose
        rows it holds: the rows timed in ``precision`` where the profile has them; else in the first
        recorded precision (:meth:`precisions`) of the same compute dtype
        (:func:`models.training.compute_dtype`: ``amp_bf16`` and ``bf16_mixed`` both compute in
        bf16, their kernels apart: autocast casts the fp32 weights in every op, bf16 copies are
        read as they are), which the caller must say; else (None) the profile as it is (no row
        of the variant's compute dtype to misprice it: the roofline prices those ops). Rows that
        record no precision (every row but a training calibration's timed ops) stay in all."""
        recorded = self.precisions()
        if precision in recorded:
            chosen = precision
        else:
            chosen = next((p for p in recorded if compute_dtype(p) == compute_dtype(precision)), None)
            if chosen is None:
                return self, None
        column = self.rows["precision"]
        return Profile(self.rows[column.isna() | (column == chosen.value)]), chosen


def profile_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows (dicts with any subset of the columns) as a profile table in column order, sorted so
    the file is the same for the same measurements."""
    frame = pd.DataFrame(rows, columns=PROFILE_COLUMNS)
    frame["version"] = PROFILE_VERSION
    keys = ["measurement", "device_class", "call", "op", "algorithm", "group_size", "num_hosts", "batch_size",
            "new_tokens", "context_tokens", "size_bytes"]
    return frame.sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)


def with_rows(profile: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """The profile table ``profile`` with ``rows`` added (:func:`profile_frame`'s order)."""
    return profile_frame(profile.to_dict("records") + rows)


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile CSV.

    Raises:
        ConfigError: missing file, unreadable CSV, missing columns, another version, an unknown
            kind of measurement, or a context row that does not parse (field ``profile``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("profile", f"no such file (got '{path}')")
    text = read_text(path, "profile", max_bytes=_MAX_PROFILE_BYTES)
    try:
        rows = pd.read_csv(io.StringIO(text))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as error:
        raise ConfigError("profile", f"not a CSV profile: {shorten(str(error).splitlines()[0], quote=False)} "
                                     f"(got '{path}')") from None
    missing = [c for c in PROFILE_COLUMNS if c not in rows.columns and c not in OPTIONAL_COLUMNS]
    if missing:
        raise ConfigError("profile", f"missing columns {', '.join(missing)} (got '{path}')")
    try:
        versions = set(pd.to_numeric(rows["version"].dropna()).astype(int))
    except (ValueError, TypeError, OverflowError):
        versions = {"not a number"}
    if versions != {PROFILE_VERSION}:
        raise ConfigError("profile", f"profile version must be {PROFILE_VERSION}; recalibrate "
                                     f"(got {sorted(versions)} in '{path}')")
    unknown = set(rows["measurement"]) - set(MeasurementKind)
    if unknown:
        raise ConfigError("profile", f"unknown measurement {sorted(unknown)[0]!r}; "
                                     f"known: {', '.join(MeasurementKind)}")
    for column in OPTIONAL_COLUMNS - set(rows.columns):
        rows.insert(min(PROFILE_COLUMNS.index(column), len(rows.columns)), column, np.nan)
    unknown = set(rows["precision"].dropna()) - set(Precision)
    if unknown:
        raise ConfigError("profile", f"unknown precision {sorted(map(str, unknown))[0]!r}; "
                                     f"known: {', '.join(Precision)} (got '{path}')")
    from sim.context import profile_contexts

    try:
        profile_contexts(rows)
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError("profile", f"unreadable context row: {str(error).splitlines()[0]} (got '{path}')") from None
    return Profile(rows)
