"""The training half of a scenario: the workload of a training job and the settings of its
data-parallel run, validated at the boundary like the rest of :mod:`sim.scenario`.

Example (a complete one: ``scenarios/training_*.yaml``)::

    workload: {kind: training, global_batch_size: 64, micro_batch_size: 4, sequence_length: 1024, steps: 4}
    parallel: {data: 8, tensor: 1}
    training: {optimizer: adamw, precision: bf16_mixed, bucket_cap_mb: 25, overlap: true}
    variants:
      - {name: bucket_25mb}
      - {name: bucket_1mb, training: {bucket_cap_mb: 1}}
      - {name: no_overlap, training: {overlap: false}}
      - {name: local_sgd_h8, training: {averaging: parameters, averaging_period: 8}}

The batch: ``global_batch_size = micro_batch_size x data x gradient_accumulation`` (Megatron-LM's
``--global-batch-size`` / ``--micro-batch-size``, ``megatron/training/arguments.py``). The scenario
gives the global and micro batch; ``training.gradient_accumulation`` is then derived. A variant that
writes ``gradient_accumulation: k`` keeps the global batch and splits it into k micro-batches per
rank (its micro-batch becomes ``global / (data x k)``), so accumulation variants compare the same
optimisation at different memory and communication costs. With ``no_sync: true`` (default) DDP
synchronises only on the last micro-batch (``DistributedDataParallel.no_sync``); ``false`` is naive
accumulation, an allreduce after every micro-batch.

The reducer's settings are PyTorch DDP's (``torch/nn/parallel/distributed.py``): ``bucket_cap_mb``
(25 by default; a MiB, ``bucket_cap_mb * 1024 * 1024`` bytes), the first bucket capped at
``first_bucket_mb`` (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB),
``gradient_as_bucket_view``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from models.errors import ConfigError
from models.ops import OpKind
from models.spec import ModelSpec
from models.training import Loss, Optimizer, Precision
from sim.collectives.registry import known_algorithms

_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
MIB = 1024 * 1024
"""DDP's megabyte: ``int(bucket_cap_mb * 1024 * 1024)`` bytes (``torch/nn/parallel/distributed.py``)."""
MAX_TRAINING_STEPS = 1 << 20
MAX_BUCKET_CAP_MB = 1 << 20


class Averaging(StrEnum):
    """What data-parallel ranks average: ``gradients`` every step (DDP), or ``parameters`` every
    ``averaging_period`` steps with local steps in between (local SGD, Lin et al. 2020, arXiv
    1808.07217; ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``)."""

    GRADIENTS = "gradients"
    PARAMETERS = "parameters"


class GradientCompression(StrEnum):
    """The dtype gradients travel in: ``none`` (the gradients' own), or cast to ``fp16`` / ``bf16``
    for the allreduce and back (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``
    ``fp16_compress_hook`` / ``bf16_compress_hook``)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"


class TrainingWorkload(BaseModel):
    """One training job: ``steps`` optimizer steps over ``global_batch_size`` sequences of
    ``sequence_length`` tokens each, ``micro_batch_size`` sequences per forward/backward on a rank.

    Raises (through :func:`sim.scenario.scenario_from_dict`): ConfigError on a field that is not a
    positive integer, or a micro batch larger than the global batch.
    """

    model_config = _STRICT
    kind: Literal["training"]
    global_batch_size: StrictInt = Field(gt=0, le=1 << 20)
    micro_batch_size: StrictInt = Field(gt=0, le=1 << 16)
    sequence_length: StrictInt = Field(gt=0, le=1 << 20)
    steps: StrictInt = Field(default=1, gt=0, le=MAX_TRAINING_STEPS)

    @model_validator(mode="after")
    def _micro_within_global(self) -> TrainingWorkload:
        if self.micro_batch_size > self.global_batch_size:
            raise ConfigError("micro_batch_size", f"larger than global_batch_size {self.global_batch_size} "
                                                  f"(got {self.micro_batch_size})")
        return self

    def check_context(self, model: ModelSpec, field: str = "workload") -> None:
        """Raise ConfigError on ``sequence_length`` if it exceeds ``model``'s context
        (``max_position_embeddings``)."""
        if self.sequence_length > model.max_position_embeddings:
            raise ConfigError(f"{field}.sequence_length", f"exceeds {model.name}'s context of "
                                                          f"{model.max_position_embeddings} tokens "
                                                          f"(got {self.sequence_length})")

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over every rank: global batch x sequence length."""
        return self.global_batch_size * self.sequence_length


class TrainingSettings(BaseModel):
    """How the data-parallel run trains (the ``training`` section, or a variant's overrides).

    Attributes:
        optimizer: :class:`models.training.Optimizer`.
        precision: :class:`models.training.Precision`.
        bucket_cap_mb: DDP's bucket size cap, MiB (> 0).
        first_bucket_mb: the first bucket's cap, MiB (> 0).
        gradient_as_bucket_view: gradients are views into the buckets (no separate copy).
        overlap: launch each bucket's allreduce as soon as it is ready, during backward; False:
            every bucket after backward.
        gradient_accumulation: micro-batches per optimizer step on each rank; None: derived from
            the workload's batches.
        no_sync: accumulate locally and synchronise on the last micro-batch only.
        activation_checkpointing: None (off) or k: checkpoint consecutive segments of k layers
            (:func:`models.training.recomputed_layer_count`).
        averaging: :class:`Averaging`; averaging_period: H, steps between parameter averages (1
            for gradient averaging).
        gradient_compression: :class:`GradientCompression`.
        allreduce: the allreduce algorithm of the buckets (:mod:`sim.collectives.registry`:
            an algorithm, ``library`` or ``auto``).
        zero: 0, or 1 for ZeRO-1 (``torch.distributed.optim.ZeroRedundancyOptimizer``: optimizer
            states sharded over the data-parallel ranks, parameters broadcast after the step).
        loss: :class:`models.training.Loss`: ``autograd`` (PyTorch's cross-entropy, what the
            runtime trains) or ``fused`` (llm.c's classifier: the logits' gradient written over
            them), which changes the head's memory, not the step's compute.
    """

    model_config = _STRICT
    optimizer: Optimizer = Optimizer.ADAMW
    precision: Precision = Precision.FP32
    bucket_cap_mb: StrictFloat | StrictInt = Field(default=25, gt=0, le=MAX_BUCKET_CAP_MB)
    first_bucket_mb: StrictFloat | StrictInt = Field(default=1, gt=0, le=MAX_BUCKET_CAP_MB)
    gradient_as_bucket_view: StrictBool = False
    overlap: StrictBool = True
    gradient_accumulation: StrictInt | None = Field(default=None, gt=0, le=1 << 16)
    no_sync: StrictBool = True
    activation_checkpointing: StrictInt | None = Field(default=None, gt=0, le=1 << 16)
    averaging: Averaging = Averaging.GRADIENTS
    averaging_period: StrictInt = Field(default=1, gt=0, le=MAX_TRAINING_STEPS)
    gradient_compression: GradientCompression = GradientCompression.NONE
    allreduce: str = Field(default="ring", max_length=100)
    zero: Literal[0, 1] = 0
    loss: Loss = Loss.AUTOGRAD

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _none_is_off(cls, value: object) -> object:
        # "none" reads better in YAML than null; 0 is not a segment length and stays an error.
        return None if value == "none" else value

    @field_validator("allreduce")
    @classmethod
    def _known_allreduce(cls, value: str) -> str:
        known = known_algorithms(OpKind.ALLREDUCE)
        if value not in known:
            raise ValueError(f"unknown allreduce algorithm; known: {', '.join(known)} (got {value!r})")
        return value

    @model_validator(mode="after")
    def _period_fits_averaging(self) -> TrainingSettings:
        if self.averaging is Averaging.GRADIENTS and self.averaging_period != 1:
            raise ConfigError("averaging_period", f"applies to averaging: parameters only; gradients are averaged "
                                                  f"every step (got {self.averaging_period})")
        return self

    @property
    def bucket_cap_bytes(self) -> int:
        """DDP's bucket cap in bytes: ``int(bucket_cap_mb * 1024 * 1024)``."""
        return int(self.bucket_cap_mb * MIB)

    @property
    def first_bucket_bytes(self) -> int:
        """The first bucket's cap in bytes."""
        return int(self.first_bucket_mb * MIB)

    def merged(self, overrides: TrainingSettings | None) -> TrainingSettings:
        """These settings with the fields ``overrides`` wrote (a variant's) replacing them."""
        if overrides is None:
            return self
        update = {name: getattr(overrides, name) for name in overrides.model_fields_set}
        return TrainingSettings.model_validate({**self.model_dump(), **update})


def micro_batching(workload: TrainingWorkload, settings: TrainingSettings, data: int) -> tuple[int, int]:
    """``(micro_batch_size, gradient_accumulation)`` of each data-parallel rank.

    ``global_batch_size = micro_batch_size x data x gradient_accumulation``. Without
    ``settings.gradient_accumulation`` the workload's micro batch is kept and accumulation derived;
    with it, the global batch is kept and the micro batch derived.

    Raises:
        ConfigError: on ``workload.global_batch_size`` (or ``training.gradient_accumulation``) when
            the global batch does not divide evenly, naming every term.
    """
    g = workload.global_batch_size
    if settings.gradient_accumulation is None:
        micro = workload.micro_batch_size
        if g % (micro * data):
            raise ConfigError("workload.global_batch_size", f"must be a multiple of micro_batch_size {micro} x "
                                                            f"parallel.data {data} = {micro * data} (got {g})")
        return micro, g // (micro * data)
    k = settings.gradient_accumulation
    if g % (data * k):
        raise ConfigError("training.gradient_accumulation", f"global_batch_size {g} does not split into parallel.data "
                                                            f"{data} x {k} micro-batches (got {k})")
    return g // (data * k), k
