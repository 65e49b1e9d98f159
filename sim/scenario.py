"""The scenario: what a user writes in YAML, validated at the boundary.

A scenario names a model, a cluster, a workload and the variants (strategy x collective algorithm)
to compare. Loading turns every problem into a :class:`~models.errors.ConfigError` whose one-line
message names the field and the value; nothing downstream re-validates user input.

Example (``scenarios/*.yaml`` hold complete ones)::

    name: two_hosts_rtx3060
    model: llama-2-13b              # catalog name, or a path to a Hugging Face config.json
    dtype: fp16                     # optional, overrides the model's dtype
    cluster: {switches: [...], hosts: [...]}     # see sim.cluster_config
    parallel: {tensor: 8}           # optional, default: every device of the cluster
    workload: {batch_size: 1, prompt_tokens: 512, output_tokens: 128}
    compute: {flops_efficiency: 0.6, memory_efficiency: 0.8, op_overhead: 10us}   # optional
    network_model: flow             # flow (max-min fair link sharing) | alpha_beta (closed form per step)
    memory: {policy: sliding_window, window: 2, retain_every: 4}   # optional, default resident
    baseline: reduce_ln_bcast       # a variant name; default: the first variant
    variants:
      - {name: reduce_ln_bcast, strategy: reduce_ln_bcast, reduce: binomial, broadcast: binomial}
      - {name: allreduce_ring, strategy: allreduce_ln, allreduce: ring}
      - {name: ring_streamed, strategy: allreduce_ln, allreduce: ring, memory: {policy: sliding_window, window: 1}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from models.catalog import get_model, load_hf_config
from models.errors import ConfigError
from models.spec import ModelSpec
from sim.cluster_config import ClusterConfig
from sim.plan import MemoryPolicy, Plan, WeightPolicy
from sim.strategies import STRATEGIES, StrategyChoice
from sim.units import parse_duration

_STRICT = ConfigDict(extra="forbid", frozen=True)


class Workload(BaseModel):
    """Requests served at once: ``batch_size`` sequences of ``prompt_tokens`` producing ``output_tokens``.

    The first output token comes from prefill; the other ``output_tokens - 1`` from decode steps.
    """

    model_config = _STRICT
    batch_size: int = Field(gt=0)
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)


class ComputeSettings(BaseModel):
    """Roofline factors: achieved / peak FLOP/s and memory bandwidth, and a fixed cost per op (s)."""

    model_config = _STRICT
    flops_efficiency: float = Field(default=0.6, gt=0, le=1)
    memory_efficiency: float = Field(default=0.8, gt=0, le=1)
    op_overhead_s: float = Field(default=5e-6, ge=0, alias="op_overhead")

    @field_validator("op_overhead_s", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)


class Parallel(BaseModel):
    """Parallel plan. ``tensor``: tensor-parallel degree (the first ``tensor`` devices); None = all."""

    model_config = _STRICT
    tensor: int | None = Field(default=None, gt=0)


class MemoryConfig(BaseModel):
    """Weight memory policy (see :class:`sim.plan.MemoryPolicy`): ``resident`` or ``sliding_window``
    with ``window`` blocks resident ahead of the one computing, and optionally every
    ``retain_every``-th block kept resident. Streamed weights come over the host's ``storage`` link
    (and the device's ``host_link``, if any), see :mod:`sim.cluster_config`."""

    model_config = _STRICT
    policy: WeightPolicy = WeightPolicy.RESIDENT
    window: int = Field(default=1, ge=1)
    retain_every: int | None = Field(default=None, ge=2)

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
    name: str = Field(min_length=1)
    strategy: str
    allreduce: str | None = None
    reduce: str = "binomial"
    broadcast: str = "binomial"
    memory: MemoryConfig | None = None  # overrides the scenario's memory policy

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        if value not in STRATEGIES:
            raise ValueError(f"unknown strategy; known: {', '.join(STRATEGIES)}")
        return value

    @model_validator(mode="after")
    def _algorithms_fit_strategy(self) -> Variant:
        try:
            self.choice()
        except ConfigError as error:
            raise ValueError(f"{error.field}: {error.message}") from None
        return self

    def choice(self) -> StrategyChoice:
        """The variant's strategy and algorithms (:class:`sim.strategies.StrategyChoice`)."""
        return StrategyChoice(self.strategy, self.allreduce, self.reduce, self.broadcast)


class SweepConfig(BaseModel):
    """The ``sweep`` section of a scenario: models, tensor-parallel degrees and memory policies to
    cross with the variants (see :mod:`sim.sweep`)."""

    model_config = _STRICT
    models: list[str] = Field(default_factory=list)
    devices: list[int] = Field(default_factory=list)
    memory: list[MemoryConfig] = Field(default_factory=list)


class ScenarioConfig(BaseModel):
    """The YAML document, validated field by field (units parsed to SI)."""

    model_config = _STRICT
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    model: str = Field(min_length=1)
    dtype: str | None = None
    cluster: ClusterConfig
    parallel: Parallel = Parallel()
    workload: Workload
    compute: ComputeSettings = ComputeSettings()
    network_model: str = "flow"
    memory: MemoryConfig = MemoryConfig()
    sweep: SweepConfig | None = None
    baseline: str | None = None
    variants: list[Variant] = Field(min_length=1)

    @model_validator(mode="after")
    def _names(self) -> ScenarioConfig:
        names = [v.name for v in self.variants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"variant names must be unique (got {', '.join(duplicates)} twice)")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline '{self.baseline}' is not a variant name; variants: {', '.join(names)}")
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
        return (variant.memory or self.config.memory).to_policy()

    def plan(self, variant: Variant, ranks: tuple[int, ...], runtime_memory_bytes: dict[int, int] | None = None
             ) -> Plan:
        """The plan of ``variant`` on ``ranks`` (the simulator and the runtime lower the same one)."""
        w = self.config.workload
        return Plan(self.model, ranks, w.batch_size, w.prompt_tokens, w.output_tokens,
                    variant.choice(),
                    runtime_memory_bytes or {}, self.memory_policy(variant))


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    for item in loc:
        text += f"[{item}]" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text or "scenario"


def config_error_from(error: ValidationError) -> ConfigError:
    """The first problem of a pydantic ValidationError as a one-line ConfigError (field, value)."""
    first = error.errors()[0]
    field = _location(tuple(x for x in first["loc"] if not str(x).startswith("function-")))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    value = first.get("input")
    shown = "" if isinstance(value, dict | list) or first["type"] == "missing" else f" (got {value!r})"
    return ConfigError(field, f"{message}{shown}")


def _resolve_model(config: ScenarioConfig, base_dir: Path) -> ModelSpec:
    name = config.model
    if name.endswith(".json"):
        path = Path(name)
        spec = load_hf_config(path if path.is_absolute() else base_dir / path)
    else:
        spec = get_model(name)
    return spec.with_dtype(config.dtype) if config.dtype else spec


def scenario_from_dict(data: Any, *, base_dir: Path = Path("."), source_path: Path | None = None) -> Scenario:
    """Validate a parsed YAML document into a Scenario.

    Raises:
        ConfigError: any invalid field, naming it and its value.
    """
    if not isinstance(data, dict):
        raise ConfigError("scenario", f"expected a mapping of fields at the top level (got {type(data).__name__})")
    try:
        config = ScenarioConfig.model_validate(data)
    except ValidationError as error:
        raise config_error_from(error) from None
    return Scenario(config=config, model=_resolve_model(config, base_dir), source_path=source_path)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file; a relative model config path is resolved beside it.

    Raises:
        ConfigError: missing file, malformed YAML, or any invalid field.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("scenario", f"no such file (got '{path}')")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError("scenario", f"malformed YAML{where}: {problem} (got '{path}')") from None
    return scenario_from_dict(data, base_dir=path.parent, source_path=path)
