"""The names the simulator, the runtime and the validation share: metrics and phases.

Each is a :class:`enum.StrEnum` whose values are the strings the files carry (``results.csv``'s
``metric`` column, a trace's ``phase`` column), so a member compares, hashes and prints as its
string and the files stay as they were. Op kinds are :class:`models.ops.OpKind`; the kinds of a
calibration profile's rows are :class:`sim.profile.MeasurementKind`.
"""

from __future__ import annotations

from enum import StrEnum


class PhaseKind(StrEnum):
    """A forward pass of a generation: the prefill (step 0), then one decode step per further token."""

    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def of_step(cls, step: int) -> PhaseKind:
        """The kind of step ``step`` of a generation (0 is the prefill)."""
        return cls.PREFILL if step == 0 else cls.DECODE


class Metric(StrEnum):
    """A metric of the tidy result table (:mod:`sim.metrics` defines each), named with its unit.

    Measured timing metrics come with their spread over repeats, named by :meth:`percentile`.
    """

    TTFT = "ttft_s"
    TPOT = "tpot_s"
    DECODE_TOKENS_PER_S = "decode_tokens_per_s"
    E2E_LATENCY = "e2e_latency_s"
    LOADER_STALL_PREFILL = "loader_stall_prefill_s"
    LOADER_STALL_DECODE = "loader_stall_decode_s"
    PEAK_MEMORY = "peak_memory_bytes"
    MEMORY_CAPACITY = "memory_capacity_bytes"
    MAX_PEAK_MEMORY = "max_peak_memory_bytes"
    REPEATS = "repeats"
    # Replicas (sim.replicas): each replica's own figures, device = its master; devices left unused.
    REPLICA_TTFT = "replica_ttft_s"
    REPLICA_TPOT = "replica_tpot_s"
    REPLICA_DECODE_TOKENS_PER_S = "replica_decode_tokens_per_s"
    REPLICA_BATCH_SIZE = "replica_batch_size"
    IDLE_DEVICE = "idle_device"
    # Validation's summary rows: collective call times against the calibrated network model.
    COLLECTIVE = "collective_s"
    COLLECTIVE_ALL = "collective_s_all"
    COLLECTIVE_IN_RUN = "collective_in_run_s"

    @property
    def unit(self) -> str:
        """The unit of the metric's values: ``s``, ``tokens/s``, ``bytes`` or ``count``."""
        return unit_of(self.value)

    @property
    def _unit_suffix(self) -> str:
        for suffix in ("_per_s", "_bytes", "_s"):
            if self.value.endswith(suffix):
                return suffix
        return ""

    def percentile(self, q: int) -> str:
        """The name of the metric's ``q``-th percentile over repeats: ``ttft_s`` -> ``ttft_p10_s``,
        ``decode_tokens_per_s`` -> ``decode_tokens_p10_per_s`` (the unit stays last)."""
        suffix = self._unit_suffix
        return f"{self.value.removesuffix(suffix)}_p{q}{suffix}"


TIMING_METRICS = (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.E2E_LATENCY)
"""The metrics of a generation's step times (:func:`sim.metrics.timing_metrics`)."""
DECODE_METRICS = (Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.LOADER_STALL_DECODE)
"""The metrics of decode steps: NaN by definition when a generation has none (one output token)."""


class MeasurementKind(StrEnum):
    """What a calibration profile row measured (its ``measurement`` column; :mod:`sim.profile`
    defines each)."""

    COMPUTE = "compute"
    OP_GAP = "op_gap"
    COLLECTIVE = "collective"
    COLLECTIVE_HELD_OUT = "collective_held_out"
    COLLECTIVE_IN_PLACE = "collective_in_place"
    COLLECTIVE_WAIT = "collective_wait"
    P2P = "p2p"
    MEMORY_BASELINE = "memory_baseline"
    CONTEXT = "context"


def unit_of(name: str) -> str:
    """The unit a metric name ends with (a :class:`Metric` or one of its percentiles):
    ``*_per_s`` tokens/s, ``*_bytes`` bytes, ``*_s`` s, otherwise ``count``."""
    if name.endswith("_per_s"):
        return "tokens/s"
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "s"
    return "count"
