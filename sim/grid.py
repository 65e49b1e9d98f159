"""Grid sweeps: any scenario field as an axis, the cartesian product of the axes, filters.

A grid file (``hetsim sweep SCENARIO --grid GRID.yaml``) names scenario fields by their dotted
path and gives each a list of values; every combination is one point, a scenario of its own::

    axes:
      model: [llama-2-7b, llama-2-13b, ../configs/my-model.json]  # catalog name or HF config.json
      parallel.tensor: [2, 4, 8]
      cluster.hosts[0].count: [2, 4]
      cluster.switches[0].uplink.bandwidth: [1Gbit/s, 10Gbit/s]
      workload.batch_size: [1, 8]
      memory: [{policy: resident}, {policy: sliding_window, window: 2}]
    exclude:                  # a point matching every entry of one mapping is dropped
      - {model: llama-2-7b, parallel.tensor: 8}

A path is field names joined by dots, with ``[i]`` indexing a list (``cluster.hosts[0].count``);
a value replaces what the scenario has there, whole (a mapping or a list too: ``variants`` takes
a list of variants). A relative ``.json`` value of the ``model`` axis is read beside the grid
file. Every point is validated by the scenario's own schema (:func:`sim.scenario.scenario_from_dict`);
a point the schema or the simulator refuses for its combination (a tensor-parallel degree above
the model's heads) is kept as a point with its error, never a crash; a degree that does not divide
the heads is simulated with the uneven split :func:`sim.simulate.simulate` gives it
(:meth:`sim.parallel.ParallelPlan.of`), and its outcome says so and by which basis
(:attr:`PointOutcome.shares_note`). A grid file that is
itself wrong (not a mapping, an axis that is no field of the scenario, an exclusion naming no
axis, more than :data:`MAX_GRID_POINTS` points) is one :class:`ConfigError` naming the field.

Each valid point has a content key (:func:`point_key`): the sha256 of its canonical scenario
(the validated config and the resolved model, as sorted JSON), the simulator's version
(:func:`hetsim_version`: the package version and a digest of its source) and the calibration
profile's digest. Equal keys are equal simulations, so a store of results keyed by
it (:mod:`sim.sweep_store`) lets a rerun compute only what is missing. There is no ``eval`` of
anything a user writes: filters are equality on axis values.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import re
import time
import typing
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.errors import ConfigError, shorten
from models.input_files import load_yaml
from sim.context import profile_context
from sim.profile import Profile
from sim.scenario import Scenario, ScenarioConfig, config_error_from, scenario_from_dict
from sim.serving.simulate import simulate_serving
from sim.simulate import simulate
from sim.training.simulate import simulate_training
from sim.vocabulary import WorkloadKind

MAX_GRID_POINTS = 20_000  # about 10 KB and 5 ms of validation each, before the first runs
MAX_AXIS_VALUES = 10_000
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[\d{1,6}\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d{1,6}\])*)*$")


@functools.cache
def hetsim_version() -> str:
    """The version of the simulator that prices a point (part of its content key): the package's
    version and a digest of the source of ``models/`` and ``sim/``, since a checkout changes the
    simulator without changing the version (``0.1.0+3f2a9c1e04bd``)."""
    try:
        version = metadata.version("hetsim")
    except metadata.PackageNotFoundError:  # run from a checkout without installing it
        version = "0"
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*(root / "models").rglob("*.py"), *(root / "sim").rglob("*.py")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{version}+{digest.hexdigest()[:12]}"


class GridConfig(BaseModel):
    """The grid file: ``axes`` (dotted scenario path -> values) and ``exclude`` (mappings of axis
    -> value; a point equal to all of one mapping's values is dropped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    axes: dict[str, list[Any]] = Field(min_length=1, max_length=64)
    exclude: list[dict[str, Any]] = Field(default_factory=list, max_length=1_000)


@dataclass(frozen=True)
class GridPoint:
    """One combination of axis values: ``axes`` (path -> value, in the grid's axis order), the
    validated ``scenario`` and its content ``key``, or ``error`` ("field: message") when the
    scenario schema refuses the combination (then ``scenario`` is None and ``key`` empty)."""

    axes: dict[str, Any]
    scenario: Scenario | None
    key: str = ""
    error: str = ""


@dataclass(frozen=True)
class PointOutcome:
    """What simulating one point gave: tidy result ``rows`` (tuples in
    :data:`sim.metrics.RESULT_COLUMNS` order), ``oom`` (variant -> the first op that does not fit,
    for the variants that overflow), ``error`` ("field: message" when the simulator refused the
    point; then no rows), the wall ``seconds`` it took, priced from a profile, its
    ``profile_context`` (:func:`sim.context.profile_context`: ``replay`` or ``prediction``, and what
    lies outside the profile's context; '' uncalibrated) and, where the scenario's layout splits
    its tensor-parallel group unevenly, its ``shares_note`` (:attr:`sim.parallel.ParallelPlan.shares_note`:
    ``uneven shares by memory (default: ...)``; '' for the even split)."""

    rows: tuple[tuple, ...]
    oom: dict[str, str]
    error: str
    seconds: float
    profile_context: str = ""
    shares_note: str = ""


def parse_path(path: str) -> tuple[str | int, ...]:
    """``"cluster.hosts[0].count"`` as ``("cluster", "hosts", 0, "count")``.

    Raises:
        ConfigError: on ``axes`` when ``path`` is not dotted field names with ``[i]`` indices.
    """
    if not isinstance(path, str) or not _PATH.match(path):
        raise ConfigError("axes", f"an axis is a dotted scenario field path such as cluster.hosts[0].count "
                                  f"(got {shorten(path)})")
    parts: list[str | int] = []
    for name in path.split("."):
        head, *indices = name.split("[")
        parts += [head, *(int(i.rstrip("]")) for i in indices)]
    return tuple(parts)


# The project's names carry their unit (SI inside the code): the suffix a field's own name ends
# with says what a bare number on its axis means.
_UNIT_SUFFIXES = (("_bytes_per_s", "bytes/s"), ("_per_s", "per s"), ("_bytes", "bytes"), ("_mb", "MB"),
                  ("_s", "s"), ("_tokens", "tokens"))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation can hold, through unions, ``Annotated`` and lists."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def axis_unit(path: str) -> str | None:
    """The unit a bare number on grid axis ``path`` is read in: from the suffix of the scenario
    field's own name (``workload.prompt_tokens``: tokens; ``training.bucket_cap_mb``: MB; a link's
    ``bandwidth``, stored as ``bandwidth_bytes_per_s``: bytes/s), ``count`` for an integer field
    without one (``parallel.tensor``, ``workload.batch_size``); None where the path names no field
    the schema knows or one with no numeric unit (a strategy, a model, a mapping).
    """
    try:
        parts = parse_path(path)
    except ConfigError:
        return None
    models: list[type[BaseModel]] = [ScenarioConfig]
    field = None
    for part in parts:
        if isinstance(part, int):
            continue  # a list's element has its list's type
        field = next((f for model in models for name, f in model.model_fields.items()
                      if part in (name, f.alias)), None)
        if field is None:
            return None
        name = next(n for model in models for n, f in model.model_fields.items() if f is field)
        models = _models_in(field.annotation)
    if field is None or models:
        return None
    unit = next((u for suffix, u in _UNIT_SUFFIXES if name.endswith(suffix)), None)
    if unit is None and _holds_int(field.annotation):
        unit = "count"
    return unit


def _holds_int(annotation: Any) -> bool:
    """Whether an annotation is an integer, through unions and ``Annotated`` (``StrictInt | None``)."""
    return annotation is int or any(_holds_int(arg) for arg in typing.get_args(annotation))


def set_path(data: dict, path: str, value: Any) -> None:
    """Set ``path`` (:func:`parse_path`) in the parsed scenario ``data`` to ``value``, in place;
    missing mappings on the way are created (``parallel.tensor`` in a scenario without
    ``parallel``), a list index must exist.

    Raises:
        ConfigError: on ``axes.<path>`` when the path runs through a value that is not a mapping
            or list, or past the end of a list.
    """
    parts = parse_path(path)
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[:i]).lstrip(".") or "scenario"
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                size = f"a list of {len(node)}" if isinstance(node, list) else "not a list"
                raise ConfigError(f"axes.{path}", f"{where} is {size}: no entry [{part}] in the scenario (got {path})")
        elif not isinstance(node, dict):
            raise ConfigError(f"axes.{path}", f"{where} is not a mapping of fields in the scenario (got {path})")
        if last:
            node[part] = value
        else:
            if isinstance(part, str) and part not in node:
                node[part] = [] if isinstance(parts[i + 1], int) else {}
            node = node[part]


def load_grid(path: Path) -> GridConfig:
    """Read and check a grid file (the guarded YAML reader of :mod:`models.input_files`).

    Raises:
        ConfigError: on ``grid`` for an unreadable file, on its field for anything malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("grid", f"no such file (got {shorten(str(path), keep_end=True)})")
    data = load_yaml(path, "grid")
    if not isinstance(data, dict):
        raise ConfigError("grid", f"expected a mapping with axes (and exclude) at the top level "
                                  f"(got {type(data).__name__})")
    try:
        grid = GridConfig.model_validate(data)
    except ValidationError as error:
        raise config_error_from(error) from None
    for name, values in grid.axes.items():
        parse_path(name)
        if not values:
            raise ConfigError(f"axes.{name}", "an axis needs at least one value (got [])")
        if len(values) > MAX_AXIS_VALUES:
            raise ConfigError(f"axes.{name}", f"at most {MAX_AXIS_VALUES} values per axis (got {len(values)})")
    for i, entry in enumerate(grid.exclude):
        if not entry:
            raise ConfigError(f"exclude[{i}]", "an empty entry would drop every point (got {})")
        for name, value in entry.items():
            if name not in grid.axes:
                raise ConfigError(f"exclude[{i}].{name}", f"not an axis; axes: {', '.join(grid.axes)} (got {name})")
            if value not in grid.axes[name]:
                raise ConfigError(f"exclude[{i}].{name}", f"not one of the axis's values (got {shorten(value)})")
    count = math.prod(len(v) for v in grid.axes.values())
    if count > MAX_GRID_POINTS:
        raise ConfigError("axes", f"{' x '.join(str(len(v)) for v in grid.axes.values())} = {count} points, more "
                                  f"than the {MAX_GRID_POINTS} of one sweep; split the grid (got {count})")
    if "model" in grid.axes:  # a config path is read beside the grid file, as a scenario's beside it
        models = [str(path.parent / m) if isinstance(m, str) and m.endswith(".json") and not Path(m).is_absolute()
                  else m for m in grid.axes["model"]]
        grid = grid.model_copy(update={"axes": grid.axes | {"model": models},
                                       "exclude": [e | {"model": models[grid.axes["model"].index(e["model"])]}
                                                   if "model" in e else e for e in grid.exclude]})
    return grid


def combinations(grid: GridConfig) -> list[dict[str, Any]]:
    """The axes' cartesian product, in the grid's order (the last axis fastest), less the excluded.

    Raises:
        ConfigError: on ``exclude`` when it drops every point.
    """
    names = list(grid.axes)
    # An exclusion as positions in its axes' value lists, grouped by the axes it names: a point is
    # then a few set lookups, whatever the number of exclusions.
    excluded: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for entry in grid.exclude:
        axes = tuple(sorted(names.index(name) for name in entry))
        excluded.setdefault(axes, set()).add(tuple(grid.axes[names[a]].index(entry[names[a]]) for a in axes))
    points = []
    for positions in itertools.product(*(range(len(v)) for v in grid.axes.values())):
        if not any(tuple(positions[a] for a in axes) in chosen for axes, chosen in excluded.items()):
            points.append({name: grid.axes[name][p] for name, p in zip(names, positions)})
    if not points:
        raise ConfigError("exclude", f"every one of the grid's points is excluded (got {len(grid.exclude)} entries)")
    return points


def grid_points(base: dict, grid: GridConfig, *, base_dir: Path = Path("."), source_path: Path | None = None,
                profile_digest: str = "") -> list[GridPoint]:
    """Every point of ``grid`` over the parsed scenario ``base``, validated, with its content key.

    Raises:
        ConfigError: an axis that names no field of the scenario (``axes.<path>``); a point the
            schema refuses for its combination is a :class:`GridPoint` with ``error`` instead.
    """
    base = {k: v for k, v in base.items() if k != "sweep"}  # the grid replaces a scenario's own sweep
    for name, values in grid.axes.items():  # the paths, checked once
        set_path(copy.deepcopy(base), name, values[0])
    version = hetsim_version()
    points = []
    for axes in combinations(grid):
        data = copy.deepcopy(base)
        for name, value in axes.items():
            set_path(data, name, copy.deepcopy(value))
        try:
            scenario = scenario_from_dict(data, base_dir=base_dir, source_path=source_path)
        except ConfigError as error:
            _refuse_unknown_axis(error, grid)
            points.append(GridPoint(axes, None, error=str(error)))
            continue
        points.append(GridPoint(axes, scenario, point_key(scenario, version, profile_digest)))
    return points


def _refuse_unknown_axis(error: ConfigError, grid: GridConfig) -> None:
    """An axis the schema calls an unknown field is a wrong grid, not a point to report."""
    if error.message.startswith("unknown field") and any(error.field == name or name.startswith(error.field + ".")
                                                for name in grid.axes):
        raise ConfigError(f"axes.{error.field}", f"not a field of the scenario; sim/scenario.py documents "
                                                 f"them (got {error.field})")


def point_key(scenario: Scenario, version: str, profile_digest: str = "") -> str:
    """The content key of a point: sha256 (hex) of the canonical JSON of its validated config,
    its resolved model (so that an edited config.json is another point), ``version`` and
    ``profile_digest``."""
    canonical = {"config": scenario.config.model_dump(mode="json", by_alias=True),
                 "model": dataclasses.asdict(scenario.model), "hetsim": version, "profile": profile_digest}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def profile_digest(path: Path | None) -> str:
    """The sha256 (hex) of a profile file's bytes; empty without one."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path is not None else ""


def evaluate_point(scenario: Scenario, profile: Profile | None = None) -> PointOutcome:
    """Simulate one point (no trace expanded: only its metrics are kept), whatever its workload:
    a batch of generations (:func:`sim.simulate.simulate`), a training step
    (:func:`sim.training.simulate.simulate_training`) or requests over time
    (:func:`sim.serving.simulate.simulate_serving`).

    A :class:`ConfigError` of the simulator (more tensor-parallel ranks than heads, a job too
    large) is the outcome's ``error``, not an exception: it belongs to the point. With a
    ``profile``, the outcome says how it priced the point (as ``hetsim plan`` does).
    """
    start = time.perf_counter()
    kind = scenario.config.workload_kind
    try:
        if kind is WorkloadKind.TRAINING:
            result, oom = simulate_training(scenario, profile), {}
            for v in result.variants:  # the first device, in rank order, whose step does not fit
                for rank, memory in sorted(v.memory.items()):
                    device = result.topology.devices[rank]
                    if memory.total > device.memory_capacity_bytes and v.variant.name not in oom:
                        oom[v.variant.name] = (f"{device.name} needs {memory.total / 2**30:.2f} GiB of its "
                                               f"{device.memory_capacity_bytes / 2**30:.2f} GiB")
        elif kind is WorkloadKind.SERVING:
            result, oom = simulate_serving(scenario, profile=profile), {}
        else:
            result = simulate(scenario, profile=profile, expand_steps=())
            oom = {vr.variant.name: vr.overflow.describe(result.topology.devices[vr.overflow.rank].name)
                   for vr in result.variants if vr.overflow is not None}
    except ConfigError as error:
        return PointOutcome((), {}, str(error), time.perf_counter() - start)
    rows = tuple(tuple(row) for row in result.results.itertuples(index=False, name=None))
    context = profile_context(result) if profile is not None else ""
    plan = result.plan if kind is WorkloadKind.TRAINING else result.parallel
    return PointOutcome(rows, oom, "", time.perf_counter() - start, context, plan.shares_note or "")
