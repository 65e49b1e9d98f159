"""The names the simulator, the runtime and the validation share: metrics and phases.

Each is a :class:`enum.StrEnum` whose values are the strings the files carry (``results.csv``'s
``metric`` column, a trace's ``phase`` column), so a member compares, hashes and prints as its
string and the files stay as they were. Op kinds are :class:`models.ops.OpKind`; the kinds of a
calibration profile's rows are :class:`sim.profile.MeasurementKind`.
"""

from __future__ import annotations

from enum import StrEnum


class PhaseKind(StrEnum):
    """A forward pass of a generation: the prefill (step 0), then one decode step per further token;
    or one optimizer step of a training job (forward and backward of its micro-batches, the
    optimizer)."""

    PREFILL = "prefill"
    DECODE = "decode"
    TRAINING = "training"

    @classmethod
    def of_step(cls, step: int) -> PhaseKind:
        """The kind of step ``step`` of a generation (0 is the prefill)."""
        return cls.PREFILL if step == 0 else cls.DECODE


class WorkloadKind(StrEnum):
    """What a scenario's cluster does (``workload.kind``): one batch of generations
    (``inference``, the default), a training job, or requests arriving over time (``serving``)."""

    INFERENCE = "inference"
    TRAINING = "training"
    SERVING = "serving"


class Accumulation(StrEnum):
    """What an fp16 matrix product accumulates in (``compute.accumulation``), which sets its peak on
    GeForce tensor cores: ``fp32``, what PyTorch asks cuBLAS for (``CUBLAS_COMPUTE_32F``), the
    catalog's fp16 peak; ``fp16``, what llama.cpp's cuBLAS path asks for F16 weights
    (``CUBLAS_COMPUTE_16F``, ``ggml_cuda_op_mul_mat_cublas`` in ggml-cuda), twice that rate on a
    GeForce card (NVIDIA's GA102 and Ada whitepapers, appendix A: FP16 Tensor TFLOPS with FP16
    accumulate against FP32 accumulate), the same on data-centre parts. bf16 and fp32 products
    accumulate in fp32 either way."""

    FP32 = "fp32"
    FP16 = "fp16"


class Calibration(StrEnum):
    """How a simulated run was priced (``results.csv``'s ``calibration`` column, the first word of
    a plan's or a sweep's ``profile_context``, :func:`sim.context.calibration_mode`): with the
    profile of this very cluster, its timings replayed (``replay``: same-cluster mode,
    :func:`sim.context.same_cluster`); from a profile of another cluster, or of this one in
    another layout, by terms fitted on it (``prediction``); or without a profile
    (``uncalibrated``: roofline compute, datasheet links and documented transport defaults)."""

    REPLAY = "replay"
    PREDICTION = "prediction"
    UNCALIBRATED = "uncalibrated"

    @property
    def meaning(self) -> str:
        """What the mode means, in a few words, for the outputs that name it."""
        return {Calibration.REPLAY: "same-cluster mode: the profile's own timings of this cluster replayed",
                Calibration.PREDICTION: "predicted by terms fitted on the profile, none of its collective timings replayed",
                Calibration.UNCALIBRATED: "no profile: roofline compute, datasheet links, transport defaults"}[self]


class TrainingPhase(StrEnum):
    """What part of a training step an op belongs to (a training trace's ``phase`` column)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # the forward again, during backward, under activation checkpointing
    OPTIMIZER = "optimizer"
    LAG = "lag"  # a rank asleep at the step's start, the previous step's last ring not yet done with it


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
    # Serving (sim/serving): over requests, TTFT and TPOT are means and their percentiles.
    OUTPUT_TOKENS_PER_S = "output_tokens_per_s"
    REQUESTS_PER_S = "requests_per_s"
    SLO_ATTAINED = "slo_attained_fraction"
    MAX_REQUEST_RATE = "max_request_rate_per_s"
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
    # Training (sim.training.metrics defines each).
    STEP_TIME = "step_time_s"
    SAMPLES_PER_S = "samples_per_s"
    TOKENS_PER_S = "tokens_per_s"
    EXPOSED_COMMUNICATION = "exposed_communication_s"
    OVERLAP_RATIO = "overlap_ratio"
    FORWARD_TIME = "forward_s"
    BACKWARD_TIME = "backward_s"
    RECOMPUTE_TIME = "recompute_s"
    OPTIMIZER_TIME = "optimizer_s"
    COMMUNICATION_TIME = "communication_s"
    PEAK_MEMORY_WEIGHTS = "peak_memory_weights_bytes"
    PEAK_MEMORY_GRADIENTS = "peak_memory_gradients_bytes"
    PEAK_MEMORY_OPTIMIZER_STATES = "peak_memory_optimizer_states_bytes"
    PEAK_MEMORY_ACTIVATIONS = "peak_memory_activations_bytes"
    PEAK_MEMORY_BUCKET_BUFFERS = "peak_memory_bucket_buffers_bytes"
    PEAK_MEMORY_FRAMEWORK = "peak_memory_framework_bytes"
    # Measured only (runtime.training.measure), never simulated: what a rank's host's TCP
    # retransmitted per timed step (runtime.tcp_counters), evidence of losses on its links.
    TCP_RETRANSMITTED_SEGMENTS = "tcp_retransmitted_segments_per_step"
    # Measured only, in the testbed: the packets its host's tbf queues dropped per timed step
    # (runtime.testbed.shaping.dropped_packets); non-zero marks a measurement the testbed's
    # queues made lossy.
    DROPPED_PACKETS = "dropped_packets_per_step"

    @property
    def unit(self) -> str:
        """The unit of the metric's values: ``s``, ``tokens/s``, ``bytes`` or ``count``."""
        return unit_of(self.value)

    @property
    def _unit_suffix(self) -> str:
        for suffix in ("_per_s", "_bytes", "_s", "_ratio"):
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
TRAINING_TIMING_METRICS = (Metric.STEP_TIME, Metric.SAMPLES_PER_S, Metric.TOKENS_PER_S, Metric.FORWARD_TIME,
                           Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME, Metric.EXPOSED_COMMUNICATION)
"""The metrics of a training run's optimizer steps whose spread over repeats is reported."""
DECODE_METRICS = (Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.LOADER_STALL_DECODE)
"""The metrics of decode steps: NaN by definition when a generation has none (one output token)."""


class MeasurementKind(StrEnum):
    """What a calibration profile row measured (its ``measurement`` column; :mod:`sim.profile`
    defines each)."""

    COMPUTE = "compute"
    COMPUTE_ISOLATED = "compute_isolated"
    COMPUTE_DEVICE = "compute_device"
    HOST_ISSUE = "host_issue"
    DEVICE_CEILING = "device_ceiling"
    OP_GAP = "op_gap"
    COLLECTIVE = "collective"
    COLLECTIVE_HELD_OUT = "collective_held_out"
    COLLECTIVE_IN_PLACE = "collective_in_place"
    COLLECTIVE_WAIT = "collective_wait"
    COLLECTIVE_LOOPBACK = "collective_loopback"
    COLLECTIVE_BRIDGED = "collective_bridged"
    P2P = "p2p"
    REDUCTION = "reduction"
    MEMORY_BASELINE = "memory_baseline"
    CONTEXT = "context"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    OPTIMIZER_STEP = "optimizer_step"
    TRAINING_PASS = "training_pass"


def unit_of(name: str) -> str:
    """The unit a metric name ends with (a :class:`Metric` or one of its percentiles):
    ``*request*_per_s`` requests/s, ``samples*_per_s`` samples/s, other ``*_per_s`` tokens/s,
    ``*_bytes`` bytes, ``*_fraction`` fraction, ``*_s`` s, ``*_ratio`` ratio, otherwise ``count``."""
    if name.endswith("_per_s"):
        if "request" in name:
            return "requests/s"
        return "samples/s" if name.startswith("samples") else "tokens/s"
    if name.endswith("_fraction"):
        return "fraction"
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "s"
    if name.endswith("_ratio"):
        return "ratio"
    return "count"
