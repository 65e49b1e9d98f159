"""A validation matrix: which scenarios to run both ways, at which prompt lengths.

Example (``validation/matrix.yaml`` is the shipped one)::

    name: testbed_matrix
    testbed: true                 # run inside each scenario's emulated cluster (root, iproute2)
    repeats: 3                    # timed generations per case (at least)
    min_timed_s: 20               # more repeats where a case's warm-up generation is short
    warmup: 1
    calibration_repeats: 5
    prompt_tokens: [32, 128]      # every scenario runs at each prompt length
    scenarios:                    # paths relative to this file; each lists its variants
      - ../scenarios/validation/2x2_bandwidth.yaml
    collective_sizes: [2KiB, 96KiB, 1.5MiB]   # collectives held out of calibration, timed with it
    calibrate_collectives: all    # all (every algorithm) | used (only those the variants call)
    transfer: false               # also predict every scenario from every other's profile (transfer/)
    layouts:                      # optional: layouts of each scenario's baseline variant instead of its variants
      - {name: tp4}               # no parallel: the scenario's own (calibrated and measured interleaved)
      - {name: pp4, parallel: {tensor: 1, pipeline: 4}}   # measured after, predicted with that profile

A case is one variant of one scenario at one prompt length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from models.errors import ConfigError
from models.input_files import load_yaml
from sim.scenario import Scenario, config_error_from, load_scenario, scenario_from_dict
from sim.units import parse_size
from validation.limits import MAX_REPEATS, MAX_TIMED_S

M = TypeVar("M", bound=BaseModel)


class LayoutCase(BaseModel):
    """One layout of a layouts matrix (:func:`with_layout`): ``parallel`` as a scenario writes it,
    None for the scenario's own layout (the one its calibration measures)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    parallel: dict | None = None


class Matrix(BaseModel):
    """A validated matrix file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    testbed: bool = True
    repeats: int = Field(default=3, gt=0, le=MAX_REPEATS)
    min_timed_s: float = Field(default=0.0, ge=0, le=MAX_TIMED_S, allow_inf_nan=False)
    warmup: int = Field(default=1, ge=0, le=MAX_REPEATS)
    calibration_repeats: int = Field(default=5, gt=0, le=MAX_REPEATS)
    prompt_tokens: list[int] = Field(min_length=1)
    scenarios: list[str] = Field(min_length=1)
    collective_sizes: list[int] = []
    calibrate_collectives: Literal["all", "used"] = "all"
    transfer: bool = False
    layouts: list[LayoutCase] = []

    @field_validator("layouts")
    @classmethod
    def _layouts(cls, values: list[LayoutCase]) -> list[LayoutCase]:
        names = [v.name for v in values]
        if len(set(names)) != len(names):
            raise ValueError(f"layout names must be unique (got {names})")
        if values and sum(v.parallel is None for v in values) != 1:
            raise ValueError("exactly one layout must be the scenario's own (no parallel): the calibrated one "
                             f"(got {sum(v.parallel is None for v in values)})")
        return values

    @field_validator("collective_sizes", mode="before")
    @classmethod
    def _sizes(cls, values: list) -> list[int]:
        return [parse_size(v) for v in values]


def read_matrix_file(path: Path, schema: type[M]) -> M:
    """The matrix file at ``path`` validated by ``schema`` (a pydantic model).

    Raises:
        ConfigError: no such file, malformed YAML, a field ``schema`` refuses (naming it).
    """
    if not path.is_file():
        raise ConfigError("matrix", f"no such file (got '{path}')")
    try:
        return schema.model_validate(load_yaml(path, "matrix"))
    except ValidationError as error:
        raise config_error_from(error) from None


def load_matrix(path: str | Path) -> tuple[Matrix, list[Scenario]]:
    """Read a matrix and the scenarios it names.

    Raises:
        ConfigError: missing or malformed file, unknown field, a scenario that does not load.
    """
    path = Path(path)
    matrix = read_matrix_file(path, Matrix)
    scenarios = [load_scenario(path.parent / name) for name in matrix.scenarios]
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ConfigError("matrix.scenarios", f"scenario names must be unique (got {names})")
    return matrix, scenarios


def with_layout(scenario: Scenario, layout: LayoutCase, prompt_tokens: int | None = None) -> Scenario:
    """``scenario`` with one variant, its baseline named ``layout.name``, in ``layout``'s parallel
    layout (the scenario's own where None), at ``prompt_tokens`` (default its own). Same name: its
    testbed and profile stay its own.

    Raises:
        ConfigError: a layout the model or cluster cannot take (field ``parallel...``).
    """
    data = scenario.config.model_dump(by_alias=True)
    name = scenario.config.baseline or data["variants"][0]["name"]
    baseline = next(v for v in data["variants"] if v["name"] == name)
    data["variants"] = [{**{k: v for k, v in baseline.items() if k != "parallel"}, "name": layout.name}]
    data["baseline"] = layout.name
    if layout.parallel is not None:
        data["parallel"] = layout.parallel
    if prompt_tokens is not None:
        data["workload"]["prompt_tokens"] = prompt_tokens
    if not data["model"].endswith(".json"):
        data["model"] = scenario.model.name
    base = scenario.source_path.parent if scenario.source_path else Path(".")
    return scenario_from_dict(data, base_dir=base, source_path=scenario.source_path)


def with_prompt(scenario: Scenario, prompt_tokens: int) -> Scenario:
    """``scenario`` at another prompt length (same name: its testbed and profile stay its own)."""
    data = scenario.config.model_dump(by_alias=True)
    data["workload"]["prompt_tokens"] = prompt_tokens
    if not data["model"].endswith(".json"):
        data["model"] = scenario.model.name
    base = scenario.source_path.parent if scenario.source_path else Path(".")
    return scenario_from_dict(data, base_dir=base, source_path=scenario.source_path)
