"""The scenario: what a user writes in YAML, validated at the boundary.

A scenario names a model, a cluster, a workload and the variants (strategy x collective algorithm)
to compare. Loading turns every problem into a :class:`~models.errors.ConfigError` whose one-line
message names the field and the value; nothing downstream re-validates user input.

Example (``scenarios/*.yaml`` hold complete ones)::

    name: two_hosts_rtx3060
    model: llama-2-13b              # catalog name, or a path to a Hugging Face config.json
    dtype: fp16                     # optional, overrides the model's dtype
    attention: sdpa                 # optional: sdpa (fused, no score matrix; default) | eager (scores materialised)
    weights: q4_k_m                 # optional: native (default) | q8_0 | q6_k | q5_k_m | q5_k | q4_k_m | q4_k | q4_0 (models.weight_formats)
    quantised_matmul: dequantize    # optional: dequantize (default, above 32 tokens) | direct
    kv_cache: q8_0                  # optional: native (default) | q8_0 | q4_0 (llama.cpp) | fp8 (vLLM)
    cluster: {switches: [...], hosts: [...], cores: 2}  # see sim.cluster_config (cores: optional)
    parallel: {tensor: 8}           # optional, default: every device of the cluster
    #   shares: compute | memory | [w0, w1, ...]   optional: split heads and MLP columns unevenly
    #                                (default where the degree cannot split evenly: by the workload)
    #   replicas: 3                 optional: copies of the layout (group or pipeline), the batch split among them
    # parallel: {tensor: 2, pipeline: 3, stages: [10, 11, 11], micro_batches: 3}   # a pipeline (sim.pipeline)
    workload: {batch_size: 1, prompt_tokens: 512, output_tokens: 128}   # allow_beyond_context: false
    compute: {flops_efficiency: 0.6, memory_efficiency: 0.8, op_overhead: 10us}   # optional
    #   accumulation: fp32 | fp16   optional: what fp16 products sum in (fp16: llama.cpp on GeForce, twice the rate)
    network_model: flow             # flow (max-min fair link sharing) | alpha_beta (closed form per step)
    memory: {policy: sliding_window, window: 2, retain_every: 4}   # optional, default resident
    baseline: reduce_ln_bcast       # a variant name; default: the first variant
    variants:
      - {name: reduce_ln_bcast, strategy: reduce_ln_bcast, reduce: binomial, broadcast: binomial}
      - {name: allreduce_ring, strategy: allreduce_ln, allreduce: ring}
      - {name: ring_streamed, strategy: allreduce_ln, allreduce: ring, memory: {policy: sliding_window, window: 1}}
      - {name: ring_pp2, strategy: allreduce_ln, allreduce: ring, parallel: {tensor: 4, pipeline: 2}}  # own layout

Limits (every one refused with the field, never silently clipped): the file is UTF-8 YAML of at
most 1 MiB, nested at most 32 deep, without duplicate keys (:mod:`models.input_files`); counts are
integers (``true`` is not a count); ``name`` is a safe file name (letters, digits, ``_ . -``, not
starting with a dot, at most 100 characters), since outputs go to ``out/<name>``;
``prompt_tokens + output_tokens`` fits the model's context (``max_position_embeddings``) unless
``workload.allow_beyond_context: true``; ``batch_size`` at most :data:`MAX_BATCH_SIZE`,
``prompt_tokens`` at most :data:`MAX_PROMPT_TOKENS`, ``output_tokens`` at most
:data:`MAX_OUTPUT_TOKENS`, and ``batch_size x (prompt_tokens + output_tokens)`` at most
:data:`MAX_BATCH_TOKENS`; quantities within the ranges of :mod:`sim.units`; the cluster within
the counts of :mod:`sim.cluster_config`; the whole job within the work bounds of :mod:`sim.budget`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, Tag,
                      ValidationError, field_validator, model_validator)

from models.cache_formats import CacheFormat, check_inference_only
from models.catalog import get_model, load_hf_config
from models.errors import ConfigError, shorten
from models.input_files import load_yaml
from models.shards import TensorShard
from models.spec import Attention, ModelSpec
from models.weight_formats import QuantisedMatmul, WeightFormat
from sim.cluster_config import DEVICE_UNION_TAGS, MAX_DEVICES, ClusterConfig
from sim.parallel import BALANCED, ParallelPlan, ShareBasis
from sim.pipeline import PipelinePlan
from sim.plan import MemoryPolicy, Plan, WeightPolicy
from sim.strategies import StrategyChoice
from sim.serving.config import ServingWorkload
from sim.training_config import TrainingSettings, TrainingWorkload
from sim.vocabulary import Accumulation, WorkloadKind
from sim.units import parse_duration

_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
MAX_BATCH_SIZE = 65536
MAX_PROMPT_TOKENS = 1 << 20
MAX_OUTPUT_TOKENS = 1 << 17
MAX_BATCH_TOKENS = 1 << 26
MAX_NAME_CHARS = 100
MAX_SHARES = MAX_DEVICES
MAX_SHARE = 1e30  # a weight's ratio to the others is what counts; this keeps their sum finite
# Safe as one path component: no separator, not "." or "..", no leading dot (hidden, or a parent),
# no leading dash (read as an option by the shell tools a user points at out/<name>).
_FILE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"


class Workload(BaseModel):
    """Requests served at once: ``batch_size`` sequences of ``prompt_tokens`` producing ``output_tokens``.

    The first output token comes from prefill; the other ``output_tokens - 1`` from decode steps.
    ``allow_beyond_context``: accept a prompt plus output longer than the model's
    ``max_position_embeddings`` (the model was not trained for it; the cost model still applies).
    """

    model_config = _STRICT
    kind: Literal["inference"] = "inference"
    batch_size: StrictInt = Field(gt=0, le=MAX_BATCH_SIZE)
    prompt_tokens: StrictInt = Field(gt=0, le=MAX_PROMPT_TOKENS)
    output_tokens: StrictInt = Field(gt=0, le=MAX_OUTPUT_TOKENS)
    allow_beyond_context: StrictBool = False

    @model_validator(mode="after")
    def _bounded_tokens(self) -> Workload:
        total = self.batch_size * (self.prompt_tokens + self.output_tokens)
        if total > MAX_BATCH_TOKENS:
            raise ConfigError("batch_size", f"batch_size x (prompt_tokens + output_tokens) = {total} tokens, more "
                                            f"than the {MAX_BATCH_TOKENS} hetsim simulates (got {self.batch_size})")
        return self

    def check_context(self, model: ModelSpec, field: str = "workload") -> None:
        """Raise ConfigError unless the prompt and output fit ``model``'s context (or it is allowed)."""
        if self.allow_beyond_context or self.prompt_tokens + self.output_tokens <= model.max_position_embeddings:
            return
        which = "prompt_tokens" if self.prompt_tokens > model.max_position_embeddings else "output_tokens"
        raise ConfigError(f"{field}.{which}", f"prompt_tokens + output_tokens = {self.prompt_tokens + self.output_tokens} "
                                              f"exceeds {model.name}'s context of {model.max_position_embeddings} "
                                              f"tokens; set workload.allow_beyond_context: true to simulate it anyway "
                                              f"(got {getattr(self, which)})")


class ComputeSettings(BaseModel):
    """Roofline factors: achieved / peak FLOP/s and memory bandwidth, a fixed cost per op (s), and
    what fp16 matrix products accumulate in (:class:`sim.vocabulary.Accumulation`: ``fp16`` for
    llama.cpp's cuBLAS path, whose GeForce peak is twice PyTorch's)."""

    model_config = _STRICT
    flops_efficiency: StrictFloat = Field(default=0.6, gt=0, le=1)
    memory_efficiency: StrictFloat = Field(default=0.8, gt=0, le=1)
    op_overhead_s: float = Field(default=5e-6, ge=0, le=1, alias="op_overhead")
    accumulation: Accumulation = Accumulation.FP32

    @field_validator("op_overhead_s", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)


INFERENCE_LAYOUT_FIELDS = ("pipeline", "stages", "micro_batches", "shares", "replicas")
"""The fields of :class:`Parallel` that only an inference layout reads (a training job is
``tensor`` x ``data``, :meth:`sim.parallel.ParallelPlan.of`)."""


class Parallel(BaseModel):
    """Parallel plan (:class:`sim.parallel.ParallelPlan` checks it against the model and cluster).

    ``tensor``: tensor-parallel degree per stage (None: the devices divided by the stages and
    replicas). ``pipeline``: pipeline stages (GPipe, arXiv 1811.06965), default 1. ``stages``: the
    layers of each stage: a list of layer counts (the first may be 0: a client that only embeds and
    sends the tokens' embeddings on, as llama.cpp's RPC client does), a list of per-stage device lists (device names,
    which also place the ranks), or ``balanced`` (by compute and memory,
    :func:`sim.parallel.balanced_stages`); default even. ``micro_batches``: how many micro-batches a
    batch is split into between the stages, default the number of stages or the batch, whichever
    is smaller.

    ``shares``: split each layer's attention heads and MLP columns unevenly, in proportion to each
    device's ``compute`` (dense peak FLOP/s in the dtype) or ``memory`` (capacity), or to the
    weights given, one per tensor-parallel rank (:class:`sim.parallel.ShareBasis`,
    :func:`models.shards.tensor_shards` for what is valid); None: even where the degree allows
    it, else by the workload's default basis (:func:`sim.parallel.scenario_shares`).

    ``data``: data-parallel degree of a training workload (copies of the tensor-parallel group,
    each on the next ``tensor`` devices); None = 1 (training: the devices // tensor).

    ``replicas``: copies of the layout (its tensor-parallel group, or its whole pipeline) on
    consecutive blocks of devices, the batch's sequences split among them (:mod:`sim.replicas`);
    ``tensor`` then defaults to the devices divided among the stages and replicas.
    """

    model_config = _STRICT
    tensor: StrictInt | None = Field(default=None, gt=0)
    data: StrictInt | None = Field(default=None, gt=0)
    replicas: StrictInt = Field(default=1, gt=0, le=MAX_DEVICES)
    shares: ShareBasis | tuple[float, ...] | None = None
    pipeline: StrictInt = Field(default=1, gt=0, le=1 << 16)
    stages: str | list | None = None
    micro_batches: StrictInt | None = Field(default=None, gt=0, le=MAX_BATCH_SIZE)

    @field_validator("shares", mode="before")
    @classmethod
    def _shares(cls, value: Any) -> ShareBasis | tuple[float, ...] | None:
        if value is None:
            return None
        if isinstance(value, str):
            if value not in tuple(ShareBasis):
                raise ValueError(f"unknown basis; known: {', '.join(ShareBasis)}, or a list of "
                                 f"weights (got {shorten(value)})")
            return ShareBasis(value)
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_SHARES:
            raise ValueError(f"must be {' or '.join(ShareBasis)} or a list of 1 to {MAX_SHARES} "
                             f"weights (got {shorten(value)})")
        for weight in value:
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
                    math.isfinite(weight) and 0 < weight <= MAX_SHARE):
                raise ValueError(f"every weight must be a number in (0, {MAX_SHARE:g}] "
                                 f"(got {shorten(weight)})")
        return tuple(float(w) for w in value)

    @field_validator("stages", mode="before")
    @classmethod
    def _stages(cls, value: Any) -> Any:
        """One of the three forms; raises ValueError naming them (pydantic locates it)."""
        counts = isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
        lists = isinstance(value, list) and all(isinstance(d, list) and d and all(isinstance(n, str) for n in d)
                                                for d in value)
        if value is None or value == BALANCED or (value and (counts or lists)):
            return value
        raise ValueError(f"must be {BALANCED}, a list of layer counts per stage, or a list of per-stage device "
                         f"lists (device names) (got {shorten(str(value))})")


class MemoryConfig(BaseModel):
    """Weight memory policy (see :class:`sim.plan.MemoryPolicy`): ``resident`` or ``sliding_window``
    with ``window`` blocks resident ahead of the one computing, and optionally every
    ``retain_every``-th block kept resident. Streamed weights come over the host's ``storage`` link
    (and the device's ``host_link``, if any), see :mod:`sim.cluster_config`."""

    model_config = _STRICT
    policy: WeightPolicy = WeightPolicy.RESIDENT
    window: StrictInt = Field(default=1, ge=1, le=1 << 16)
    retain_every: StrictInt | None = Field(default=None, ge=2, le=1 << 16)

    def to_policy(self) -> MemoryPolicy:
        return MemoryPolicy(self.policy, self.window, self.retain_every)


class Variant(BaseModel):
    """One strategy to compare: ``strategy`` names an entry of :data:`sim.strategies.STRATEGIES`,
    ``allreduce``/``reduce``/``broadcast`` the algorithms of the collectives it calls
    (:class:`sim.strategies.StrategyChoice` validates them).

    ``reduce_ln_bcast``: partial sums are reduced to the master (rank 0 of the group), which adds the
    residual and normalises, then broadcasts the normalised tensor (``reduce``/``broadcast`` name
    the algorithms). ``allreduce_ln``: partial sums are allreduced (``allreduce`` names the
    algorithm, or ``auto``) and every rank normalises its copy. LayerNorm commutes with broadcast,
    so both compute the same values (Megatron-LM, arXiv 1909.08053, section 3).
    """

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    strategy: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    allreduce: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    reduce: str = Field(default="binomial", max_length=MAX_NAME_CHARS)
    broadcast: str = Field(default="binomial", max_length=MAX_NAME_CHARS)
    memory: MemoryConfig | None = None  # overrides the scenario's memory policy
    training: TrainingSettings | None = None  # a training workload's settings this variant changes
    parallel: Parallel | None = None  # overrides the scenario's layout: variants compare layouts

    @model_validator(mode="after")
    def _algorithms_fit_strategy(self) -> Variant:
        if self.strategy is None:
            # A training variant without tensor parallelism calls no strategy; ScenarioConfig
            # requires one for inference.
            return self
        # StrategyChoice raises ConfigError on the field at fault (strategy, allreduce, ...);
        # config_error_from joins it to this variant's place in the scenario.
        choice = self.choice()
        called = {name for _, name in choice.implementation.calls}
        # A re-validated dump sets every field: only a value other than the default was written.
        written = {name for name in self.model_fields_set
                   if getattr(self, name) != type(self).model_fields[name].default}
        for name in sorted({"allreduce", "reduce", "broadcast"} & written - called):
            # An algorithm the strategy never calls would be silently ignored.
            takes = ", ".join(f"'{n}'" for _, n in choice.implementation.calls)
            raise ConfigError(name, f"variant {shorten(self.name)} uses {self.strategy}, which takes {takes}, "
                                    f"not '{name}' (got {shorten(getattr(self, name))})")
        return self

    def choice(self) -> StrategyChoice:
        """The variant's strategy and algorithms (:class:`sim.strategies.StrategyChoice`).

        Raises:
            ConfigError: on ``strategy`` when the variant names none.
        """
        if self.strategy is None:
            raise ConfigError("strategy", f"variant {shorten(self.name)} names no tensor-parallel strategy")
        return StrategyChoice(self.strategy, self.allreduce, self.reduce, self.broadcast)


def unique_variant_names(variants: list[Variant]) -> list[str]:
    """The variants' names; raises ConfigError on ``variants[i].name``, the first repeated one."""
    names = [v.name for v in variants]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"variants[{i}].name", f"variant names must be unique (got {shorten(name)} twice)")
    return names


class SweepConfig(BaseModel):
    """The ``sweep`` section of a scenario: models, tensor-parallel degrees and memory policies to
    cross with the variants (see :mod:`sim.sweep`)."""

    model_config = _STRICT
    models: list[str] = Field(default_factory=list, max_length=64)
    devices: list[StrictInt] = Field(default_factory=list, max_length=64)
    memory: list[MemoryConfig] = Field(default_factory=list, max_length=64)


def workload_kind_of(value: Any) -> str:
    """The workload union's tag: its ``kind``, ``inference`` by default (so scenarios written before
    other kinds existed keep their meaning)."""
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if kind in set(WorkloadKind) else WorkloadKind.INFERENCE


class ScenarioConfig(BaseModel):
    """The YAML document, validated field by field (units parsed to SI)."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=_FILE_NAME_PATTERN)
    description: str = Field(default="", max_length=10_000)
    model: str = Field(min_length=1, max_length=4096)
    dtype: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    attention: Attention = "sdpa"
    weights: WeightFormat = WeightFormat.NATIVE
    quantised_matmul: QuantisedMatmul = QuantisedMatmul.DEQUANTIZE
    kv_cache: CacheFormat = CacheFormat.NATIVE
    cluster: ClusterConfig
    parallel: Parallel = Parallel()
    workload: Annotated[Annotated[Workload, Tag(WorkloadKind.INFERENCE)]
                        | Annotated[TrainingWorkload, Tag(WorkloadKind.TRAINING)]
                        | Annotated[ServingWorkload, Tag(WorkloadKind.SERVING)],
                        Discriminator(workload_kind_of)]
    training: TrainingSettings | None = None
    compute: ComputeSettings = ComputeSettings()
    network_model: str = Field(default="flow", max_length=MAX_NAME_CHARS)
    memory: MemoryConfig = MemoryConfig()
    sweep: SweepConfig | None = None
    baseline: str | None = None
    variants: list[Variant] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _storage_fits_workload(self) -> "ScenarioConfig":
        if self.is_training:
            check_inference_only(self.weights, self.kv_cache)
        # (the default passes: a dumped and reloaded scenario writes every field)
        if self.quantised_matmul != QuantisedMatmul.DEQUANTIZE and self.weights == WeightFormat.NATIVE:
            raise ConfigError("quantised_matmul", f"says how products read quantised weights; the scenario's "
                                                  f"are native (set weights) (got '{self.quantised_matmul}')")
        return self

    @field_validator("workload", mode="before")
    @classmethod
    def _known_kind(cls, value: Any) -> Any:
        kind = value.get("kind", WorkloadKind.INFERENCE) if isinstance(value, dict) else WorkloadKind.INFERENCE
        if kind not in set(WorkloadKind):
            raise ConfigError("kind", f"unknown workload kind; known: {', '.join(WorkloadKind)} (got {shorten(kind)})")
        return value

    @property
    def workload_kind(self) -> WorkloadKind:
        """The workload's kind (``workload.kind``)."""
        return WorkloadKind(self.workload.kind)

    @property
    def is_training(self) -> bool:
        """Whether the workload is a training job (:class:`sim.training_config.TrainingWorkload`)."""
        return self.workload_kind is WorkloadKind.TRAINING

    @model_validator(mode="after")
    def _sections_fit_workload(self) -> ScenarioConfig:
        if self.is_training:
            for i, variant in enumerate(self.variants):
                if variant.memory is not None:
                    raise ConfigError(f"variants[{i}].memory", "weight memory policies apply to inference "
                                                              "workloads, not training (got a memory section)")
            if self.sweep is not None:
                raise ConfigError("sweep", "a sweep section applies to inference workloads (got one with a "
                                           "training workload)")
            for where, parallel in (("", self.parallel), *((f"variants[{i}].", v.parallel)
                                                           for i, v in enumerate(self.variants) if v.parallel)):
                for name in INFERENCE_LAYOUT_FIELDS:  # the training simulator would ignore them
                    value = getattr(parallel, name)
                    if value != Parallel.model_fields[name].default:
                        raise ConfigError(f"{where}parallel.{name}", f"applies to inference workloads; a training "
                                                                     f"job runs parallel.tensor x parallel.data "
                                                                     f"(got {shorten(str(value), quote=False)})")
            return self
        if self.training is not None:
            raise ConfigError("training", "applies to workload kind: training (got a training section with "
                                          "an inference workload)")
        if self.workload_kind is WorkloadKind.SERVING:
            for i, variant in enumerate(self.variants):
                if self.memory_policy_of(variant).streams:
                    raise ConfigError(f"variants[{i}].memory" if variant.memory else "memory",
                                      "weight streaming is not simulated under a serving workload "
                                      f"(got {self.memory_policy_of(variant).label()})")
            if self.sweep is not None:
                raise ConfigError("sweep", "a sweep section applies to inference workloads (got one with a "
                                           "serving workload)")
        if self.parallel.data not in (None, 1):
            raise ConfigError("parallel.data", f"data parallelism applies to training workloads "
                                               f"(got {self.parallel.data})")
        for i, variant in enumerate(self.variants):
            if variant.training is not None:
                raise ConfigError(f"variants[{i}].training", "applies to workload kind: training (got a training "
                                                            "section with an inference workload)")
            if variant.strategy is None:
                raise ConfigError(f"variants[{i}].strategy", "Field required for an inference workload")
        return self

    def memory_policy_of(self, variant: Variant) -> MemoryPolicy:
        """The variant's weight memory policy: its own ``memory``, else the scenario's."""
        return (variant.memory or self.memory).to_policy()

    @model_validator(mode="after")
    def _names(self) -> ScenarioConfig:
        names = unique_variant_names(self.variants)
        for i, variant in enumerate(self.variants):
            if self.sweep is not None and variant.parallel is not None:
                # A sweep sets every point's layout (sweep.devices); a variant's own would be ignored.
                raise ConfigError(f"variants[{i}].parallel", "a sweep sets the layout of its points; a variant "
                                                             "cannot set its own (got a parallel section)")
        if self.baseline is not None and self.baseline not in names:
            raise ConfigError("baseline", f"not a variant name; variants: {shorten(', '.join(names), 200, quote=False)} "
                                          f"(got {shorten(self.baseline)})")
        return self


class Scenario(BaseModel):
    """A validated scenario with its model resolved to a :class:`~models.spec.ModelSpec`."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    config: ScenarioConfig
    model: ModelSpec
    source_path: Path | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def baseline(self) -> str:
        return self.config.baseline or self.config.variants[0].name

    def memory_policy(self, variant: Variant) -> MemoryPolicy:
        """The variant's weight memory policy: its own ``memory``, else the scenario's."""
        return self.config.memory_policy_of(variant)

    def require_inference(self, what: str) -> None:
        """Raise ConfigError on ``workload.kind`` if this is a training scenario, which ``what`` (a
        command or function) does not run."""
        kind = self.config.workload_kind
        if kind is not WorkloadKind.INFERENCE:
            raise ConfigError("workload.kind", f"{what} takes inference workloads (got {kind})")

    def training_settings(self, variant: Variant) -> TrainingSettings:
        """A training variant's settings: the scenario's ``training`` section (defaults where absent)
        with the fields the variant writes replacing them."""
        return (self.config.training or TrainingSettings()).merged(variant.training)

    def plan(self, variant: Variant, ranks: tuple[int, ...], runtime_memory_bytes: dict[int, int] | None = None,
             shards: tuple[TensorShard, ...] | None = None, batch_size: int | None = None) -> Plan:
        """The plan of ``variant`` on ``ranks`` (the simulator and the runtime lower the same one);
        ``shards``: each rank's slice when the split is uneven (:attr:`sim.parallel.ParallelPlan.shards`);
        ``batch_size``: the sequences this group serves (a replica's share), default the workload's."""
        w = self.config.workload
        return Plan(self.model, ranks, batch_size or w.batch_size, w.prompt_tokens, w.output_tokens,
                    variant.choice(),
                    runtime_memory_bytes or {}, self.memory_policy(variant), shards)


def check_pipeline_policy(policy: MemoryPolicy, pipeline: int) -> None:
    """Refuse weights streamed through a pipeline of ``pipeline`` stages (not supported: a
    pipeline keeps its weights resident, :class:`sim.pipeline.PipelinePlan`).

    Raises:
        ConfigError: on ``memory.policy`` when ``policy`` streams and ``pipeline`` > 1.
    """
    if pipeline > 1 and policy.streams:
        raise ConfigError("memory.policy", f"a pipeline keeps its weights resident; sliding_window is not "
                                           f"supported with {pipeline} stages (got sliding_window)")


def pipeline_plan(scenario: Scenario, variant: Variant, parallel: ParallelPlan,
                  runtime_memory_bytes: dict[int, int] | None = None, *, replica: int = 0,
                  batch_size: int | None = None) -> PipelinePlan:
    """The pipeline plan of ``variant`` over the stages of ``parallel``'s replica ``replica``
    (the simulator and the runtime run the same one); ``batch_size``: the sequences that replica
    serves (:func:`sim.replicas.split_batch`), default the workload's.

    Raises:
        ConfigError: weights streamed through a pipeline (``memory.policy``, not supported), or
            ``parallel.micro_batches`` without a pipeline or beyond the batch.
    """
    check_pipeline_policy(scenario.memory_policy(variant), parallel.pipeline)
    w = scenario.config.workload
    return PipelinePlan.of(parallel, batch_size or w.batch_size, w.prompt_tokens, w.output_tokens, variant.choice(),
                           (variant.parallel or scenario.config.parallel).micro_batches, runtime_memory_bytes,
                           replica)


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    # The workload union's tag is pydantic's bookkeeping, not a field the user wrote.
    loc = tuple(x for i, x in enumerate(loc) if not (i and loc[i - 1] == "workload" and x in set(WorkloadKind)))
    for item in loc:
        text += f"[{item}]" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text or "scenario"


def config_error_from(error: ValidationError) -> ConfigError:
    """The first problem of a pydantic ValidationError as a one-line ConfigError (field, value).

    A validator that raises :class:`ConfigError` names a field relative to the model it checks
    (``allreduce`` of a variant, ``hosts[0].count`` of a cluster); it is joined to the location.
    The value is shown once, shortened to 60 characters.
    """
    first = error.errors()[0]
    loc = tuple(x for x in first["loc"] if not str(x).startswith("function-") and x not in DEVICE_UNION_TAGS)
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return ConfigError(_location((*loc, *_split(cause.field))), cause.message)
    field = _location(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    value = first.get("input")
    already = "(got " in message
    shown = "" if already or isinstance(value, dict | list) or first["type"] == "missing" else f" (got {shorten(value)})"
    return ConfigError(field, f"{shorten(message, 300, quote=False)}{shown}")


def validate_document(model: type[BaseModel], data: Any, what: str) -> Any:
    """A parsed YAML document validated as ``model``.

    Raises:
        ConfigError: on ``what`` when the document is not a mapping, else the first invalid field
            (:func:`config_error_from`).
    """
    if not isinstance(data, dict):
        raise ConfigError(what, f"expected a mapping of fields at the top level (got {type(data).__name__})")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise config_error_from(error) from None


def _split(field: str) -> tuple[Any, ...]:
    """``"hosts[0].count"`` as ``("hosts", 0, "count")``, the form of a pydantic location."""
    parts: list[Any] = []
    for name in field.split("."):
        head, *indices = name.split("[")
        if head:
            parts.append(head)
        parts += [int(i.rstrip("]")) for i in indices]
    return tuple(parts)


def resolve_model(name: str, dtype: str | None, base_dir: Path, attention: Attention = "sdpa",
                  weights: WeightFormat = WeightFormat.NATIVE,
                  matmul: QuantisedMatmul = QuantisedMatmul.DEQUANTIZE,
                  kv_cache: CacheFormat = CacheFormat.NATIVE) -> ModelSpec:
    """A model field's spec: a catalog name, or a Hugging Face ``config.json`` path (relative to
    ``base_dir``), in ``dtype`` (None: the model's own), with the ``attention`` kernel, its
    matrices stored in ``weights``, large products reading them by ``matmul``, its KV cache in
    ``kv_cache``.

    Raises:
        ConfigError: an unknown name, an unreadable config, a dtype the model cannot take.
    """
    if name.endswith(".json"):
        path = Path(name)
        spec = load_hf_config(path if path.is_absolute() else base_dir / path)
    else:
        spec = get_model(name)
    return with_dtype(spec, dtype).with_attention(attention).with_weights(weights, matmul).with_kv_cache(kv_cache)


def as_configured(spec: ModelSpec, config: ScenarioConfig) -> ModelSpec:
    """``spec`` as the scenario runs it: in its ``dtype``, with its ``attention`` kernel, weights
    and KV cache."""
    return (with_dtype(spec, config.dtype).with_attention(config.attention)
            .with_weights(config.weights, config.quantised_matmul).with_kv_cache(config.kv_cache))


def with_dtype(spec: ModelSpec, dtype: str | None) -> ModelSpec:
    """``spec`` in the scenario's ``dtype`` (unchanged for None); raises ConfigError on ``dtype``."""
    if dtype is None:
        return spec
    try:
        return spec.with_dtype(dtype)
    except ConfigError as error:
        raise ConfigError("dtype", error.message) from None


def scenario_from_dict(data: Any, *, base_dir: Path = Path("."), source_path: Path | None = None) -> Scenario:
    """Validate a parsed YAML document into a Scenario.

    Raises:
        ConfigError: any invalid field, naming it and its value.
    """
    config = validate_document(ScenarioConfig, data, "scenario")
    model = resolve_model(config.model, config.dtype, base_dir, config.attention, config.weights,
                          config.quantised_matmul, config.kv_cache)
    config.workload.check_context(model)
    return Scenario(config=config, model=model, source_path=source_path)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file; a relative model config path is resolved beside it.

    Raises:
        ConfigError: missing file, malformed YAML, or any invalid field.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("scenario", f"no such file (got {shorten(str(path), keep_end=True)})")
    data = load_yaml(path, "scenario")
    return scenario_from_dict(data, base_dir=path.parent, source_path=path)
