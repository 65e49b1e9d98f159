"""The planning question as a user writes it (``PLAN.yaml``), validated at the boundary.

Example (``scenarios/plan_llama31_8b.yaml`` is a complete one)::

    name: chat_llama31_8b
    models: [llama-3.1-8b]            # catalog names or Hugging Face config.json paths
    dtype: bf16                       # optional, as in a scenario; attention, weights, quantised_matmul, kv_cache too
    workload: {batch_size: 16, prompt_tokens: 2048, output_tokens: 256}
    slo: {ttft: 2s, tpot: 50ms, tokens_per_s: 300}   # each optional, at least one
    catalog: my_prices.yaml           # optional; default: the shipped sim/planning/catalog.yaml
    prices: {rtx_4090: 0.29}          # optional, $/h per device, over the catalog's
    host_prices: {rtx_4090: 0.1}      # optional, $/h per host carrying such devices, over the catalog's
    search:                           # optional, every key with a default
      devices: [h100_sxm, rtx_4090]   # device types of the catalog (default: all)
      devices_per_host: [1, 2, 4, 8]
      hosts: [1, 2, 4]
      mixed: true                     # also two hosts of two device types, same devices per host
      networks: [eth10g, eth100g]     # networks of the catalog (default: all)
      variants: [...]                 # as a scenario's (default: search.DEFAULT_VARIANTS)
      memory: [{policy: resident}, {policy: sliding_window, window: 1}]
    limits: {budget_per_hour: 40, max_devices: 32}
    compute: {flops_efficiency: 0.6}  # optional, as in a scenario

A training plan writes a scenario's training workload, its ``training`` settings (optional, as a
training scenario's section) and objectives on the optimizer step::

    workload: {kind: training, global_batch_size: 64, micro_batch_size: 4, sequence_length: 1024}
    training: {precision: bf16_mixed}                  # optional; each variant may override it
    slo: {step_time: 2s, tokens_per_s: 30000}          # each optional, at least one; no ttft / tpot
    search: {variants: [{name: ddp}, {name: zero1, training: {zero: 1}}]}   # default: DEFAULT_TRAINING_VARIANTS

A serving plan (``scenarios/plan_serving_llama31_8b.yaml``) writes a scenario's serving workload,
whose ``rate_per_s`` is the target rate, and objectives at a percentile over requests::

    workload: {kind: serving, rate_per_s: 4, requests: 60, prompt_tokens: 1024, output_tokens: 128}
    slo: {ttft: 2s, tpot: 100ms, percentile: 90}       # ttft required; no tokens_per_s
    search: {rate_tolerance: 0.05, rate_horizon: 80s}  # the rate search: relative bracket, and the
                                                       # least arrival time per rate (default 40 x ttft)

Every problem is a :class:`~models.errors.ConfigError` naming the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag, field_validator,
                      model_validator)

from models.cache_formats import CacheFormat, check_inference_only
from models.catalog import get_model, load_hf_config
from models.errors import ConfigError, shorten
from models.input_files import load_yaml
from models.spec import Attention, ModelSpec
from models.weight_formats import QuantisedMatmul, WeightFormat
from sim.cluster_config import MAX_DEVICES
from sim.planning.catalog import DEFAULT_CATALOG, MAX_PRICE_PER_HOUR, Catalog, load_catalog
from sim.scenario import (MAX_NAME_CHARS, ComputeSettings, MemoryConfig, Variant, Workload, unique_variant_names,
                          validate_document, workload_kind_of)
from sim.serving.config import ServingSLO, ServingWorkload
from sim.serving.requests import Request, workload_requests
from sim.slo import LatencyObjectives
from sim.training_config import TrainingSettings, TrainingWorkload
from sim.units import parse_duration
from sim.vocabulary import WorkloadKind

_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)
_FILE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"

DEFAULT_VARIANTS = (
    {"name": "rlb", "strategy": "reduce_ln_bcast", "reduce": "binomial", "broadcast": "binomial"},
    {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"},
    {"name": "recursive_doubling", "strategy": "allreduce_ln", "allreduce": "recursive_doubling"},
    {"name": "double_binary_tree", "strategy": "allreduce_ln", "allreduce": "double_binary_tree"},
    {"name": "two_level_rs", "strategy": "allreduce_ln", "allreduce": "two_level_rs"},
    {"name": "auto", "strategy": "allreduce_ln", "allreduce": "auto"},
)
"""The layouts searched by default: every strategy, with the allreduce algorithms that differ most."""

DEFAULT_TRAINING_VARIANTS = (
    {"name": "ddp"},
    {"name": "zero1", "training": {"zero": 1}},
    {"name": "zero1_checkpointing", "training": {"zero": 1, "activation_checkpointing": 1}},
)
"""A training plan's variants searched by default: DDP; ZeRO-1, which shards the optimizer states
over the data-parallel ranks; and ZeRO-1 with every layer's activations checkpointed, the least
memory of the three (each over every tensor-parallel degree that fits a host, :mod:`sim.planning.search`)."""


class Slo(LatencyObjectives):
    """Service-level objectives: ``ttft`` and ``tpot`` at most (durations), ``tokens_per_s`` at least
    (decode tokens/s; a training plan's: trained tokens/s), ``step_time`` at most (a training plan's
    optimizer step, a duration); each optional, at least one given. ``percentile`` applies to a
    serving workload only (:class:`sim.slo.LatencyObjectives`)."""

    tokens_per_s: float | None = Field(default=None, gt=0, le=1e12)
    step_time_s: float | None = Field(default=None, gt=0, alias="step_time")

    @field_validator("step_time_s", mode="before")
    @classmethod
    def _step_duration(cls, value: Any) -> float | None:
        return None if value is None else parse_duration(value)

    @model_validator(mode="after")
    def _at_least_one(self) -> Slo:
        if self.ttft_s is None and self.tpot_s is None and self.tokens_per_s is None and self.step_time_s is None:
            raise ValueError("give at least one of ttft, tpot, tokens_per_s, step_time")
        return self

    def serving(self) -> ServingSLO:
        """The objectives as a serving workload's SLO (``tokens_per_s`` has no place there)."""
        return ServingSLO.model_validate(self.model_dump(include=set(LatencyObjectives.model_fields)))


class SearchSpace(BaseModel):
    """What the planner tries (see the module docstring)."""

    model_config = _STRICT
    devices: list[str] = Field(default_factory=list, max_length=64)
    devices_per_host: list[StrictInt] = Field(default=[1, 2, 4, 8], min_length=1, max_length=16)
    hosts: list[StrictInt] = Field(default=[1, 2, 4], min_length=1, max_length=16)
    mixed: StrictBool = True
    networks: list[str] = Field(default_factory=list, max_length=16)
    variants: list[Variant] = Field(default_factory=lambda: [Variant(**v) for v in DEFAULT_VARIANTS],
                                    min_length=1, max_length=16)
    memory: list[MemoryConfig] = Field(default_factory=lambda: [MemoryConfig(), MemoryConfig(policy="sliding_window")],
                                       min_length=1, max_length=8)
    rate_tolerance: float = Field(default=0.05, gt=0, le=1)
    rate_horizon_s: float | None = Field(default=None, gt=0, alias="rate_horizon")

    @field_validator("rate_horizon_s", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        return None if value is None else parse_duration(value)

    @field_validator("devices_per_host", "hosts")
    @classmethod
    def _counts(cls, values: list[int]) -> list[int]:
        for value in values:
            if not 1 <= value <= MAX_DEVICES:
                raise ValueError(f"counts must be between 1 and {MAX_DEVICES} (got {value})")
        return sorted(set(values))

    @model_validator(mode="after")
    def _unique_variant_names(self) -> SearchSpace:
        unique_variant_names(self.variants)
        return self


class Limits(BaseModel):
    """``budget_per_hour`` ($/h, none: no limit) and ``max_devices`` of a configuration."""

    model_config = _STRICT
    budget_per_hour: float | None = Field(default=None, gt=0, le=MAX_PRICE_PER_HOUR)
    max_devices: StrictInt = Field(default=64, ge=1, le=MAX_DEVICES)


class PlanConfig(BaseModel):
    """The PLAN.yaml document, validated field by field (units parsed to SI)."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=_FILE_NAME_PATTERN)
    description: str = Field(default="", max_length=10_000)
    models: list[str] = Field(min_length=1, max_length=16)
    dtype: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    attention: Attention = "sdpa"
    weights: WeightFormat = WeightFormat.NATIVE
    quantised_matmul: QuantisedMatmul = QuantisedMatmul.DEQUANTIZE
    kv_cache: CacheFormat = CacheFormat.NATIVE
    workload: Annotated[Annotated[Workload, Tag(WorkloadKind.INFERENCE)]
                        | Annotated[ServingWorkload, Tag(WorkloadKind.SERVING)]
                        | Annotated[TrainingWorkload, Tag(WorkloadKind.TRAINING)], Discriminator(workload_kind_of)]
    training: TrainingSettings | None = None
    slo: Slo
    catalog: str | None = Field(default=None, max_length=4096)
    prices: dict[str, float] = Field(default_factory=dict, max_length=256)
    host_prices: dict[str, float] = Field(default_factory=dict, max_length=256)
    search: SearchSpace = SearchSpace()
    limits: Limits = Limits()
    compute: ComputeSettings = ComputeSettings()

    @field_validator("workload", mode="before")
    @classmethod
    def _planned_kind(cls, value: Any) -> Any:
        kind = value.get("kind", WorkloadKind.INFERENCE) if isinstance(value, dict) else WorkloadKind.INFERENCE
        if kind not in set(WorkloadKind):
            raise ConfigError("kind", f"unknown workload kind; a plan takes {', '.join(WorkloadKind)} "
                                      f"(got {shorten(kind)})")
        return value

    @property
    def is_serving(self) -> bool:
        """Whether the workload is requests over time (:class:`sim.serving.config.ServingWorkload`)."""
        return self.workload.kind == WorkloadKind.SERVING

    @property
    def is_training(self) -> bool:
        """Whether the workload is a training job (:class:`sim.training_config.TrainingWorkload`)."""
        return self.workload.kind == WorkloadKind.TRAINING

    @field_validator("prices", "host_prices")
    @classmethod
    def _prices(cls, prices: dict[str, float]) -> dict[str, float]:
        for name, price in prices.items():
            if isinstance(price, bool) or not isinstance(price, int | float) or not 0 <= price <= MAX_PRICE_PER_HOUR:
                raise ConfigError(name, f"a price per hour between 0 and {MAX_PRICE_PER_HOUR:g} (got {shorten(price)})")
        return {name: float(price) for name, price in prices.items()}


@dataclass(frozen=True)
class PlanRequest:
    """A validated plan: its config, the models resolved (in the plan's dtype and attention
    kernel), the catalog with the plan's prices, the file it came from, and a serving workload's
    requests (their lengths; empty for a batch)."""

    config: PlanConfig
    models: tuple[ModelSpec, ...]
    catalog: Catalog
    source_path: Path | None = None
    requests: tuple[Request, ...] = ()

    @property
    def name(self) -> str:
        return self.config.name


def plan_from_dict(data: Any, *, base_dir: Path = Path(".")) -> PlanRequest:
    """Validate a parsed PLAN.yaml into a :class:`PlanRequest`.

    Raises:
        ConfigError: any invalid field, naming it and its value; a device, network or model the
            catalog or the model catalog does not know; a workload beyond a model's context.
    """
    config = validate_document(PlanConfig, data, "plan")
    if config.is_serving:
        config = _serving_config(config, base_dir)
    elif "percentile" in config.slo.model_fields_set:
        raise ConfigError("slo.percentile", "applies to a serving workload, whose requests' latencies spread "
                                            f"(got {config.slo.percentile})")
    if config.is_training:
        config = _training_config(config)
    else:
        if config.slo.step_time_s is not None:
            raise ConfigError("slo.step_time", "applies to a training workload (workload.kind: training) "
                                               f"(got {config.slo.step_time_s:g} s)")
        if config.training is not None:
            raise ConfigError("training", "applies to a training workload (workload.kind: training) "
                                          "(got a training section)")
    models = []
    for i, name in enumerate(config.models):
        try:
            spec = load_hf_config(_resolve(name, base_dir)) if name.endswith(".json") else get_model(name)
            if config.dtype is not None:
                spec = spec.with_dtype(config.dtype)
        except ConfigError as error:
            raise ConfigError(f"models[{i}]" if not error.field.startswith("model.dtype") else "dtype",
                              error.message) from None
        spec = (spec.with_attention(config.attention).with_weights(config.weights, config.quantised_matmul)
                .with_kv_cache(config.kv_cache))
        config.workload.check_context(spec, "workload")
        models.append(spec)
    catalog = load_catalog(_resolve(config.catalog, base_dir)) if config.catalog else load_catalog(DEFAULT_CATALOG)
    catalog = catalog.with_prices(config.prices, config.host_prices)
    for i, device in enumerate(config.search.devices):
        if device not in catalog.devices:
            raise ConfigError(f"search.devices[{i}]", f"not a device of the catalog; offered: "
                                                      f"{', '.join(catalog.devices)} (got {shorten(device)})")
    for i, network in enumerate(config.search.networks):
        if network not in catalog.networks:
            raise ConfigError(f"search.networks[{i}]", f"not a network of the catalog; known: "
                                                       f"{', '.join(catalog.networks)} (got {shorten(network)})")
    if config.is_serving:
        # Each model reads the trace: its rows must fit every model's context.
        requests = [workload_requests(config.workload, spec) for spec in models]
        return PlanRequest(config, tuple(models), catalog, requests=tuple(requests[0]))
    if config.is_training:
        return PlanRequest(config, tuple(models), catalog)
    needs_decode = config.slo.tpot_s is not None or config.slo.tokens_per_s is not None
    if needs_decode and config.workload.output_tokens < 2:
        raise ConfigError("workload.output_tokens", "a TPOT or tokens/s objective needs at least 2 output tokens "
                                                    f"(got {config.workload.output_tokens})")
    return PlanRequest(config, tuple(models), catalog)


def _serving_config(config: PlanConfig, base_dir: Path) -> PlanConfig:
    """A serving plan's config checked for what only serving asks, its trace path made absolute
    (the candidates' scenarios are read from anywhere) and its memory policies resident by default
    (weights are not streamed under a serving workload).

    Raises:
        ConfigError: an SLO inside the workload, an SLO without TTFT or with tokens/s, a streaming
            memory policy.
    """
    workload, slo = config.workload, config.slo
    if workload.slo is not None:
        raise ConfigError("workload.slo", "a plan's objectives are its slo section; leave the workload's out "
                                          "(got an slo in the workload)")
    if slo.tokens_per_s is not None:
        raise ConfigError("slo.tokens_per_s", "a serving plan's load is workload.rate_per_s, the request rate "
                                              f"to sustain (got {slo.tokens_per_s:g})")
    if slo.ttft_s is None:
        raise ConfigError("slo.ttft", "a serving plan needs a TTFT objective: an overloaded server's queue shows "
                                      "in TTFT only (got tpot alone)")
    search = config.search
    if "memory" not in search.model_fields_set:
        search = search.model_copy(update={"memory": [MemoryConfig()]})
    for i, memory in enumerate(search.memory):
        if memory.to_policy().streams:
            raise ConfigError(f"search.memory[{i}]", "weight streaming is not simulated under a serving workload "
                                                     f"(got {memory.to_policy().label()})")
    if workload.trace is not None:
        workload = workload.model_copy(update={"trace": str(_resolve(workload.trace, base_dir).resolve())})
    return config.model_copy(update={"workload": workload, "search": search})


def _training_config(config: PlanConfig) -> PlanConfig:
    """A training plan's config checked for what only training asks, with the default training
    variants where the plan names none.

    Raises:
        ConfigError: a ``dtype`` (the precision sets it), a TTFT or TPOT objective, a memory
            policy, or a variant that names an inference strategy, a memory policy or a layout.
    """
    if config.dtype is not None:  # the training simulator computes in the precision's dtype, whatever dtype says
        raise ConfigError("dtype", "a training job's dtypes are training.precision's (fp32; bf16_mixed: bf16 "
                                   f"compute, fp32 master weights; amp_bf16: bf16 compute, fp32 parameters) (got {shorten(config.dtype)})")
    check_inference_only(config.weights, config.kv_cache)
    for name, value in (("ttft", config.slo.ttft_s), ("tpot", config.slo.tpot_s)):
        if value is not None:
            raise ConfigError(f"slo.{name}", "a training plan's objectives are step_time and tokens_per_s "
                                             f"(trained tokens/s) (got {name}: {value:g} s)")
    w = config.workload
    settings = [(config.training or TrainingSettings()).merged(v.training) for v in config.search.variants]
    if w.global_batch_size % w.micro_batch_size and not any(s.gradient_accumulation for s in settings):
        # Data parallelism of degree 1 is the least any layout needs: no cluster could run it.
        raise ConfigError("workload.global_batch_size", f"must be a multiple of micro_batch_size "
                                                        f"{w.micro_batch_size} (got {w.global_batch_size})")
    search = config.search
    if "memory" in search.model_fields_set:
        raise ConfigError("search.memory", "weight memory policies apply to inference; a training plan searches "
                                           "ZeRO and activation checkpointing through its variants (got a memory list)")
    if "variants" not in search.model_fields_set:
        search = search.model_copy(update={"variants": [Variant(**v) for v in DEFAULT_TRAINING_VARIANTS]})
    for i, variant in enumerate(search.variants):
        if variant.strategy is not None or variant.memory is not None or variant.parallel is not None:
            written = "strategy" if variant.strategy is not None else "memory" if variant.memory is not None \
                else "parallel"
            raise ConfigError(f"search.variants[{i}].{written}", "a training variant sets only its name, its "
                                                                 "training settings and allreduce (the tensor-"
                                                                 "parallel allreduces' algorithm); the planner "
                                                                 f"searches the layout (got {written})")
    return config.model_copy(update={"search": search.model_copy(update={"memory": [MemoryConfig()]})})


def _resolve(name: str, base_dir: Path) -> Path:
    path = Path(name)
    return path if path.is_absolute() else base_dir / path


def load_plan(path: str | Path) -> PlanRequest:
    """Read and validate a PLAN.yaml; relative model and catalog paths are resolved beside it.

    Raises:
        ConfigError: a missing file, malformed YAML, or any invalid field.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("plan", f"no such file (got {shorten(str(path), keep_end=True)})")
    data = load_yaml(path, "plan")
    request = plan_from_dict(data, base_dir=path.parent)
    return replace(request, source_path=path)
