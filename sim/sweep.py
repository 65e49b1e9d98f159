"""Sweeps: one scenario simulated over a grid of models, device counts and memory policies.

A scenario with a ``sweep`` section (``scenarios/low_resource_memory.yaml``) answers the capacity
question "how many of these devices, and which memory policy, does this model need, and what does
each cost in TTFT and TPOT?"::

    sweep:
      models: [llama-2-7b, llama-2-13b, llama-2-70b]   # or config.json paths; default: the scenario's model
      devices: [2, 4, 6, 8]                            # tensor-parallel degrees; default: parallel.tensor
      memory:                                          # default: the variants' own policies
        - {policy: resident}
        - {policy: sliding_window, window: 1}

Every point (model, devices, memory policy, variant) is one simulated run, its layout the one
``hetsim simulate`` gives the point's scenario (:meth:`sim.parallel.ParallelPlan.of`): a degree
that cannot split the model evenly is split unevenly, by ``parallel.shares`` or the workload's
default basis (:func:`sim.parallel.scenario_shares`), and its rows' ``note`` says so and by which
basis (:attr:`sim.parallel.ParallelPlan.shares_note`). A point that cannot be built even so (more
devices than attention heads, a pipeline's stages that split only evenly) is kept as a row with
its reason, so the report shows the gap instead of hiding it. Every axis value is validated as the
scenario's own field would be (``sweep.devices[i]`` within the cluster, ``sweep.models[i]`` a known
model whose context holds the workload), ``parallel.tensor`` too even when ``sweep.devices``
replaces it, and the whole sweep's estimated work is bounded (:data:`sim.budget.MAX_SWEEP_WORK_UNITS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from models.errors import ConfigError
from sim.budget import MAX_SWEEP_WORK_UNITS, check_job_size
from sim.grid import PointOutcome, evaluate_point
from sim.metrics import RESULT_COLUMNS
from sim.parallel import ParallelPlan
from sim.profile import Profile
from sim.scenario import Scenario, Variant, resolve_model
from sim.topology import build_topology
from sim.vocabulary import Metric

SWEEP_COLUMNS = ["model", "devices", "memory_policy", "window", "retain_every", "variant", "feasible", "fits",
                 Metric.MAX_PEAK_MEMORY, "master_peak_memory_bytes", "worker_peak_memory_bytes",
                 Metric.MEMORY_CAPACITY, Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S,
                 Metric.LOADER_STALL_DECODE, "note", "profile_context"]
"""``profile_context``: with a profile, how it priced the point (:func:`sim.context.profile_context`:
its :class:`sim.vocabulary.Calibration`, ``replay`` or ``prediction``, then ``; outside: `` and the terms
outside its calibration context, where any are); empty otherwise (uncalibrated)."""
_BYTE_COLUMNS = [Metric.MAX_PEAK_MEMORY, "master_peak_memory_bytes", "worker_peak_memory_bytes", Metric.MEMORY_CAPACITY]


@dataclass(frozen=True)
class SweepPoint:
    """One (model, tensor-parallel degree) of a sweep, as a scenario of its own: ``reason`` why it
    cannot be built (then ``scenario`` is None), or ``split``, what its rows' note says of an
    uneven split (:attr:`sim.parallel.ParallelPlan.shares_note`; empty for the even split)."""

    model: str
    devices: int
    scenario: Scenario | None  # None when the point cannot be built
    reason: str = ""
    split: str = ""


def sweep_points(scenario: Scenario) -> list[SweepPoint]:
    """The scenarios of a sweep: per model and degree, the variants crossed with the memory policies.

    Raises:
        ConfigError: an unknown model name, a degree larger than the cluster (``sweep.*``,
            ``parallel.tensor``), a workload beyond a model's context, or a sweep too large to run.
    """
    sweep = scenario.config.sweep
    assert sweep is not None
    config = scenario.config
    topology = build_topology(config.cluster)
    num_devices = topology.num_ranks
    if config.parallel.tensor is not None and config.parallel.tensor > num_devices:
        raise ConfigError("parallel.tensor", f"tensor-parallel degree exceeds the cluster's {num_devices} devices "
                                             f"(got {config.parallel.tensor})")
    models = sweep.models or [config.model]
    degrees = sweep.devices or [config.parallel.tensor or num_devices]
    for i, degree in enumerate(degrees):
        if not 1 <= degree <= num_devices:
            raise ConfigError(f"sweep.devices[{i}]", f"must be between 1 and the cluster's {num_devices} devices "
                                                     f"(got {degree})")
    variants = _variants(scenario)
    base_dir = scenario.source_path.parent if scenario.source_path is not None else Path(".")
    streamed = sum(scenario.memory_policy(v).streams for v in variants)
    points = []
    total_work = 0.0
    for i, name in enumerate(models):
        if not sweep.models:
            spec = scenario.model
        else:
            try:
                spec = resolve_model(name, config.dtype, base_dir, config.attention, config.weights,
                                     config.quantised_matmul, config.kv_cache)
            except ConfigError as error:
                raise ConfigError(f"sweep.models[{i}]", error.message) from None
            config.workload.check_context(spec)
        for j, degree in enumerate(degrees):
            field = f"sweep.devices[{j}]" if sweep.devices else ("parallel.tensor" if config.parallel.tensor else "cluster")
            total_work += check_job_size(len(variants), spec.num_layers, degree, config.workload.output_tokens,
                                         ranks_field=field, variants_field="sweep.memory" if sweep.memory else "variants",
                                         streamed_variants=streamed)
            if total_work > MAX_SWEEP_WORK_UNITS:
                raise ConfigError("sweep", f"the sweep's points are estimated at more than {MAX_SWEEP_WORK_UNITS:.3g} "
                                           f"work units in all (minutes); sweep fewer models, degrees or memory "
                                           f"policies (got {len(models)} x {len(degrees)} points)")
            point_config = config.model_copy(update={
                "name": f"{config.name}-{name}-tp{degree}", "model": name, "variants": variants, "baseline": None,
                "parallel": config.parallel.model_copy(update={"tensor": degree}), "sweep": None})
            point = Scenario(config=point_config, model=spec, source_path=scenario.source_path)
            try:  # the layout the simulator will run, an uneven split where the degree needs one
                plan = ParallelPlan.of(point, topology)
            except ConfigError as error:
                points.append(SweepPoint(name, degree, None, str(error)))  # as the simulator's refusals
                continue
            points.append(SweepPoint(name, degree, point, split=plan.shares_note or ""))
    return points


def run_sweep(scenario: Scenario, *, profile: Profile | None = None, on_point=lambda point: None,
              imap: Callable[[list[Scenario]], Iterator[tuple[int, PointOutcome]]] | None = None) -> pd.DataFrame:
    """Simulate every point of ``scenario``'s sweep; one row per (model, devices, variant) with the
    columns :data:`SWEEP_COLUMNS` (SI units; ``note``: why a point is infeasible, else its uneven
    split and by which basis (:attr:`SweepPoint.split`) and what overflowed, joined by ``; ``).

    ``profile`` calibrates every point (:func:`sim.simulate.simulate`). ``imap(scenarios)`` runs
    the points, yielding (index, :class:`sim.grid.PointOutcome`) as each finishes (default: one
    after another in this process; :class:`validation.sweep_runner.LocalExecutor` runs them on a
    process pool); ``on_point(point)`` is called as each point is done (for a progress bar). A
    point the simulator refuses (a streamed policy without a storage link) is infeasible, with
    the refusal as its note.
    """
    points = sweep_points(scenario)
    runnable = [p for p in points if p.scenario is not None]
    for point in points:
        if point.scenario is None:
            on_point(point)
    if imap is None:
        imap = lambda scenarios: ((i, evaluate_point(s, profile)) for i, s in enumerate(scenarios))  # noqa: E731
    outcomes: dict[int, PointOutcome] = {}
    for index, outcome in imap([p.scenario for p in runnable]):
        outcomes[index] = outcome
        on_point(runnable[index])
    by_point = {id(point): outcomes[i] for i, point in enumerate(runnable)}
    rows = []
    for point in points:
        outcome = by_point.get(id(point))
        if outcome is None or outcome.error:
            for variant in _variants(scenario):
                rows.append(_row(point, variant, scenario) | {
                    "feasible": False, "fits": False, "note": point.reason or outcome.error})
            continue
        for variant in point.scenario.config.variants:
            measures = _measures(outcome, variant.name)
            note = "; ".join(filter(None, (point.split, measures["note"])))
            rows.append(_row(point, variant, point.scenario) | measures | {"note": note})
    # Byte counts are integers; nullable ones, so that an infeasible row (no measure) does not turn
    # every other row's count into a float and the CSV's spelling of a point into another.
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS).astype(dict.fromkeys(_BYTE_COLUMNS, "Int64"))


def _measures(outcome: PointOutcome, variant: str) -> dict:
    """The sweep columns of one variant of a simulated point, from its tidy rows (devices in rank
    order: the first is the master)."""
    rows = [r for r in outcome.rows if r[RESULT_COLUMNS.index("variant")] == variant]
    metric, value, device = (RESULT_COLUMNS.index(c) for c in ("metric", "value", "device"))
    timing = {r[metric]: r[value] for r in rows if r[device] == ""}
    peaks = [int(r[value]) for r in rows if r[metric] == Metric.PEAK_MEMORY]
    note = outcome.oom.get(variant, "")
    return {"feasible": True, "fits": not note, Metric.MAX_PEAK_MEMORY: max(peaks),
            "master_peak_memory_bytes": peaks[0], "worker_peak_memory_bytes": max(peaks[1:]) if peaks[1:] else math.nan,
            Metric.MEMORY_CAPACITY: min(int(r[value]) for r in rows if r[metric] == Metric.MEMORY_CAPACITY),
            **{m: timing[m] for m in (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S, Metric.LOADER_STALL_DECODE)},
            "note": note, "profile_context": outcome.profile_context}


def _variants(scenario: Scenario) -> list[Variant]:
    """The scenario's variants crossed with the sweep's memory policies (named ``variant/policy``)."""
    sweep = scenario.config.sweep
    if not sweep.memory:
        return list(scenario.config.variants)
    return [v.model_copy(update={"name": f"{v.name}/{m.to_policy().label()}", "memory": m})
            for m in sweep.memory for v in scenario.config.variants]


def _row(point: SweepPoint, variant: Variant, scenario: Scenario) -> dict:
    policy = scenario.memory_policy(variant)
    row = dict.fromkeys(SWEEP_COLUMNS, math.nan)
    return row | {"model": point.model, "devices": point.devices, "memory_policy": policy.policy,
                  "window": policy.window if policy.streams else math.nan,
                  "retain_every": policy.retain_every or math.nan, "variant": variant.name.split("/")[0],
                  "note": "", "profile_context": ""}
