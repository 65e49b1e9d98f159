"""What a plan answers: the pick, the top 10 with their bottlenecks, the Pareto frontiers.

* **The pick**: the cheapest configuration that fits and meets every objective (ties: the lower
  end-to-end latency, then the candidate number).
* **The top 10**: ten clusters, each with its best layout (the fastest end to end among those
  meeting the most objectives): those meeting every objective by price, then those that fit but
  miss some, fewest misses first; every layout of every cluster is in ``plan.csv``. A cluster
  whose best configuration a no dearer one ranked before it matches on every metric (the same
  layout over a dearer network it sends nothing over) takes no slot: it would repeat that one.
  Each says why it lost to the pick (``versus_pick``: it misses an
  objective, it costs more, or at the same price it is slower) and its **bottleneck**: the term
  that takes most of the master rank's decode step (the prefill's with one output token,
  :func:`sim.bottleneck.bottleneck`), from a re-simulation of that one configuration with the
  step's ops in the trace.
* **Pareto frontiers** among the simulated configurations that fit: price per hour against
  end-to-end latency (``pareto_latency``: no other is both cheaper-or-equal and faster), and
  against decode tokens/s (``pareto_throughput``).

A **serving** plan (:mod:`sim.planning.search`) meets the objectives where a configuration's
maximum request rate reaches the target. Its pick is the cheapest such (ties: the higher maximum
rate); the top 10 go by the same rule, then those that miss, the highest maximum rate first; its
one frontier is price per hour against maximum request rate (``pareto_rate``). A pipeline's
bottleneck is its busiest stage or link at the maximum rate (replicas of a pipeline: the busiest
replica's; :func:`sim.serving.simulate.pipeline_bottleneck`); a single group's (replicas included) is the
term taking most of the master's decode iteration at the maximum rate (:func:`sim.bottleneck.bottleneck`),
from its layout simulated at the batch it decodes there
(:meth:`~sim.planning.search.Planner.batch_scenario_dict`; the prefill chunks sharing a loaded
server's iterations are left out). Its real run is a vLLM server
(:mod:`sim.planning.pick_commands`): hetsim's runtime does not serve request loads.

A **training** plan reads the optimizer step's time for latency and trained tokens/s for
throughput (its frontiers, ranking and ties alike); each top configuration's bottleneck is the
term that takes most of its simulated step (:func:`sim.training.metrics.bottleneck`: forward or
backward compute, recomputation, the optimizer, or communication no compute hides).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from models.errors import ConfigError
from sim.bottleneck import bottleneck
from sim.context import outside
from sim.planning.catalog import price_text
from sim.planning.pick_commands import pick_commands
from sim.planning.plan_config import PlanRequest
from sim.planning.search import COST_PER_MILLION_TOKENS, DECODE_BATCH, SLO_TPOT, SLO_TTFT, TOP_N, Planner, Stage
from sim.profile import Profile
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from sim.units import duration_text
from sim.vocabulary import Metric

@dataclass(frozen=True)
class PlanResult:
    """A plan's answer (see the module docstring).

    ``table``: every candidate (:data:`sim.planning.search.PLAN_COLUMNS`, a serving plan's
    :data:`~sim.planning.search.SERVING_COLUMNS`, ``pareto_latency``, ``pareto_throughput``, ``pareto_rate``,
    ``bottleneck``, ``prefill_bottleneck``, ``versus_pick`` and ``rank``, 1..10 for the top 10); ``pick``: the pick's row, None when nothing meets every objective; ``pick_scenario``: its
    scenario (a dict for YAML), or the closest miss's; ``recommendation``: one sentence;
    ``elapsed_s``: the search's wall time; ``pick_batch_scenario``: a serving pick's layout at the
    batch it decodes at its maximum rate, an inference scenario
    (:meth:`sim.planning.search.Planner.batch_scenario_dict`; None elsewhere).
    """

    request: PlanRequest
    table: pd.DataFrame
    pick: pd.Series | None
    pick_scenario: dict | None
    recommendation: str
    elapsed_s: float = 0.0
    profile_path: Path | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    pick_batch_scenario: dict | None = None

    @property
    def top(self) -> pd.DataFrame:
        """The top 10, in order."""
        return self.table[self.table["rank"] > 0].sort_values("rank")

    def commands(self, scenario_path: Path, batch_path: Path | None = None) -> list[str]:
        """How to run the pick (or the closest miss) whose scenario is at ``scenario_path``
        (:func:`sim.planning.pick_commands.pick_commands`; ``batch_path``: where
        ``pick_batch_scenario`` is, for a serving pick)."""
        if self.pick_scenario is None:
            return []
        row = self.pick if self.pick is not None else self.top.iloc[0]
        return pick_commands(self.request, row, self.pick_scenario, scenario_path,
                             batch_path if self.pick_batch_scenario is not None else None)


def pareto(price: pd.Series, value: pd.Series, *, larger_is_better: bool) -> pd.Series:
    """Whether each point is on the Pareto frontier of lower ``price`` and better ``value``.

    A point is on it when no other point is at most as expensive and strictly better, or cheaper
    and at least as good (equal points are on it together). NaN values are never on it.
    """
    sign = -1.0 if larger_is_better else 1.0
    order = np.lexsort((sign * value.to_numpy(float), price.to_numpy(float)))
    on = pd.Series(False, index=price.index)
    best, best_price = math.inf, math.nan
    for position in order:
        v, p = sign * float(value.iloc[position]), float(price.iloc[position])
        if not math.isnan(v) and (v < best or (v == best and p == best_price)):
            on.iloc[position] = True
            best, best_price = v, p
    return on


_RANKED_METRICS = (Metric.MAX_REQUEST_RATE, SLO_TTFT, SLO_TPOT, Metric.OUTPUT_TOKENS_PER_S, Metric.TTFT, Metric.TPOT,
                   Metric.DECODE_TOKENS_PER_S, Metric.E2E_LATENCY, Metric.STEP_TIME, Metric.TOKENS_PER_S,
                   Metric.MAX_PEAK_MEMORY)
"""The metrics by which two ranked configurations are the same (those a plan's table has)."""


def ranking(table: pd.DataFrame, *, serving: bool = False, latency: str = Metric.E2E_LATENCY) -> pd.Series:
    """1..10 for the top 10 (see the module docstring; ``serving``: a serving plan's rule; ``latency``:
    the column that breaks a price tie, a training plan's step time), 0 for the rest."""
    simulated = table[(table["stage"] == Stage.SIMULATED) & table["fits"]]
    if serving:  # those that miss go by how close they come: the highest maximum rate first
        closeness = (-simulated[Metric.MAX_REQUEST_RATE]).where(~simulated["meets_slo"], 0.0)
        order = simulated.assign(_misses=closeness, _rate=-simulated[Metric.MAX_REQUEST_RATE]).sort_values(
            ["meets_slo", "_misses", "price_per_hour", "_rate", "candidate"], ascending=[False, True, True, True, True])
    else:
        misses = simulated["slo_miss"].map(lambda text: text.count(";") + 1 if text else 0)
        order = simulated.assign(_misses=misses).sort_values(
            ["meets_slo", "_misses", "price_per_hour", latency, "candidate"],
            ascending=[False, True, True, True, True])
    order = order.drop_duplicates(["model", "cluster"])  # each cluster with its best layout
    # A configuration that an earlier one (no dearer) matches on every metric repeats it: the same
    # layout over a dearer network it sends nothing over, say. It takes no slot.
    metrics = [c for c in _RANKED_METRICS if c in order]
    same = order[metrics].apply(lambda column: column.map(lambda value: float(f"{value:.9g}")))
    order = order[~same.assign(model=order["model"]).duplicated()]
    rank = pd.Series(0, index=table.index)
    rank.loc[order.index[:TOP_N]] = np.arange(1, min(TOP_N, len(order)) + 1)
    return rank


def versus_pick(row: pd.Series, pick: pd.Series | None) -> str:
    """Why ``row`` lost to ``pick``, in a few words ('' for the pick itself)."""
    if pick is None or row["candidate"] == pick["candidate"]:
        return ""
    if not row["meets_slo"]:
        return f"misses {row['slo_miss']}"
    extra = row["price_per_hour"] - pick["price_per_hour"]
    if extra > 1e-9:
        return f"costs ${price_text(extra)}/h more (+{100 * extra / pick['price_per_hour']:.0f}%)"
    if Metric.MAX_REQUEST_RATE in row:
        return f"same price, maximum rate {100 * (row[Metric.MAX_REQUEST_RATE] / pick[Metric.MAX_REQUEST_RATE] - 1):+.1f}%"
    if Metric.STEP_TIME in row:
        return f"same price, step time {100 * (row[Metric.STEP_TIME] / pick[Metric.STEP_TIME] - 1):+.1f}%"
    slower = row[Metric.E2E_LATENCY] / pick[Metric.E2E_LATENCY] - 1
    return f"same price, end-to-end latency {100 * slower:+.1f}%"


def recommendation(request: PlanRequest, table: pd.DataFrame, pick: pd.Series | None) -> str:
    """One sentence: what to rent and how to run it, and why."""
    if request.config.is_serving:
        return serving_recommendation(request, table, pick)
    if request.config.is_training:
        return training_recommendation(request, table, pick)
    slo = request.config.slo
    objectives = ", ".join(part for part in (
        f"TTFT <= {duration_text(slo.ttft_s)}" if slo.ttft_s is not None else "",
        f"TPOT <= {duration_text(slo.tpot_s)}" if slo.tpot_s is not None else "",
        f">= {slo.tokens_per_s:g} decode tokens/s" if slo.tokens_per_s is not None else "") if part)
    feasible = int(table["meets_slo"].sum())
    if pick is None:
        top = table[table["rank"] == 1]
        bound = table[table["stage"] == Stage.BOUND]
        if top.empty and not bound.empty:
            return (f"No configuration within the limits can meet {objectives}: the best lower bounds are TTFT "
                    f"{duration_text(bound['ttft_lower_bound_s'].min())} and TPOT {duration_text(bound['tpot_lower_bound_s'].min())}; "
                    "relax an objective or raise limits.budget_per_hour or limits.max_devices.")
        if top.empty:
            return f"No configuration can meet {objectives}: {_none_simulated(table)}."
        row = top.iloc[0]
        return (f"No configuration within the limits meets {objectives}; the closest is {row['cluster']} "
                f"running {_layout(row)}, at ${price_text(row['price_per_hour'])}/h, which misses {row['slo_miss']}.")
    why = f"; its decode step is bound by {pick['bottleneck']}" if pick.get("bottleneck") else ""
    return (f"Use {pick['cluster']} for {pick['model']}, running {_layout(pick)}: at ${price_text(pick['price_per_hour'])}/h "
            f"it is the cheapest of the {feasible} configurations that meet {objectives} "
            f"(TTFT {duration_text(pick[Metric.TTFT])}, TPOT {duration_text(pick[Metric.TPOT])}){why}.")


def training_recommendation(request: PlanRequest, table: pd.DataFrame, pick: pd.Series | None) -> str:
    """A training plan's sentence: what trains the job cheapest within its objectives, or what comes closest."""
    slo, w = request.config.slo, request.config.workload
    objectives = " and ".join(part for part in (
        f"a step <= {duration_text(slo.step_time_s)}" if slo.step_time_s is not None else "",
        f">= {slo.tokens_per_s:g} tokens/s" if slo.tokens_per_s is not None else "") if part)
    job = f"{w.global_batch_size} x {w.sequence_length} tokens per step"
    if pick is None:
        top = table[table["rank"] == 1]
        bound = table[table["stage"] == Stage.BOUND]
        if top.empty and not bound.empty:
            return (f"No configuration within the limits can train {job} with {objectives}: the shortest step's lower "
                    f"bound is {duration_text(bound['step_time_lower_bound_s'].min())}; relax an objective or raise "
                    "limits.budget_per_hour or limits.max_devices.")
        if top.empty:
            return f"No configuration can train {job} with {objectives}: {_none_simulated(table)}."
        row = top.iloc[0]
        return (f"No configuration within the limits trains {job} with {objectives}; the closest is {row['cluster']} "
                f"as {_layout(row)}, at ${price_text(row['price_per_hour'])}/h, which misses "
                f"{row['slo_miss']}.")
    why = f"; its step is bound by {pick['bottleneck']}" if pick.get("bottleneck") else ""
    return (f"Use {pick['cluster']} for {pick['model']}, as {_layout(pick)}: at ${price_text(pick['price_per_hour'])}/h it is the cheapest of the "
            f"{int(table['meets_slo'].sum())} configurations that train {job} with {objectives} "
            f"(step {duration_text(pick[Metric.STEP_TIME])}, {pick[Metric.TOKENS_PER_S]:.3g} tokens/s){why}.")


def serving_recommendation(request: PlanRequest, table: pd.DataFrame, pick: pd.Series | None) -> str:
    """A serving plan's sentence: what sustains the target rate cheapest, or what comes closest."""
    config = request.config
    slo, target = config.slo, config.workload.rate_per_s
    objectives = " and ".join(part for part in (
        f"TTFT <= {duration_text(slo.ttft_s)}" if slo.ttft_s is not None else "",
        f"TPOT <= {duration_text(slo.tpot_s)}" if slo.tpot_s is not None else "") if part)
    goal = f"{target:g} requests/s with p{slo.percentile} {objectives}"
    if pick is None:
        top = table[table["rank"] == 1]
        if top.empty:
            return f"No configuration can serve {goal}: {_none_simulated(table)}."
        row = top.iloc[0]
        return (f"No configuration within the limits sustains {goal}; the closest is {row['cluster']} running "
                f"{_layout(row)}, at ${price_text(row['price_per_hour'])}/h, whose maximum rate is "
                f"{row[Metric.MAX_REQUEST_RATE]:.3g} requests/s.")
    why = f"; its busiest part there is {pick['bottleneck']}" if pick.get("bottleneck") else ""
    return (f"Use {pick['cluster']} for {pick['model']}, running {_layout(pick)}: at ${price_text(pick['price_per_hour'])}/h "
            f"it is the cheapest of the {int(table['meets_slo'].sum())} configurations that sustain {goal} "
            f"(maximum {pick[Metric.MAX_REQUEST_RATE]:.3g} requests/s, "
            f"${pick[COST_PER_MILLION_TOKENS]:.3g} per million output tokens there{why}).")


def _none_simulated(table: pd.DataFrame) -> str:
    """Why no candidate reached the simulator, from the latest stage any reached (a clause)."""
    stages = set(table["stage"])
    if Stage.ERROR in stages:
        return f"the simulator refused every candidate, e.g. {table.loc[table['stage'] == Stage.ERROR, 'reason'].iloc[0]}"
    if Stage.BOUND in stages:
        return ("every candidate within the limits that fits in memory misses an objective by its lower bound; relax "
                "an objective or raise limits.budget_per_hour or limits.max_devices")
    if Stage.MEMORY in stages:
        example = table.loc[table["stage"] == Stage.MEMORY].sort_values("price_per_hour").iloc[-1]
        return (f"none within the limits fits in memory (the largest tried, {example['cluster']}: "
                f"{example['reason']}); raise limits.budget_per_hour or limits.max_devices")
    if Stage.LIMITS in stages:
        over = table.loc[table["stage"] == Stage.LIMITS].sort_values(["price_per_hour", "num_devices"]).iloc[0]
        return (f"every cluster that can run the model is over the limits; the cheapest, {over['cluster']}, "
                f"costs ${price_text(over['price_per_hour'])}/h with {int(over['num_devices'])} devices ({over['reason']})")
    reason = table["reason"].iloc[0] if len(table) else "the search space is empty"
    return f"no cluster of the search can run the model (e.g. {reason}); widen search.devices_per_host or search.hosts"


def _layout(row: pd.Series) -> str:
    if not row["strategy"]:  # a training candidate: its layout and settings
        return f"{row['parallel']} with {row['variant']} ({row['algorithms']})"
    if row["num_devices"] == 1:  # every strategy is the same program there
        return f"on one device (no collectives) with {row['memory_policy']} weights"
    return f"{row['parallel']}, {row['strategy']} with {row['algorithms'] or 'no collectives'} and {row['memory_policy']} weights"


def plan(request: PlanRequest, *, profile: Profile | None = None, progress=None) -> PlanResult:
    """Run a plan end to end (:class:`sim.planning.search.Planner`, then this module).

    Raises:
        ConfigError: from the request's validation only; a candidate that cannot be simulated is a
            row of stage ``error``.
    """
    import time

    start = time.perf_counter()
    planner = Planner(request, profile)
    planner.run(progress)
    table = planner.table
    serving = request.config.is_serving
    latency, throughput = planner.latency_metric, planner.throughput_metric
    fits = (table["stage"] == Stage.SIMULATED) & table["fits"]
    table["pareto_latency"] = False
    table["pareto_throughput"] = False
    table["pareto_rate"] = False
    if fits.any() and serving:
        table.loc[fits, "pareto_rate"] = pareto(table.loc[fits, "price_per_hour"],
                                                table.loc[fits, Metric.MAX_REQUEST_RATE], larger_is_better=True)
    elif fits.any():
        table.loc[fits, "pareto_latency"] = pareto(table.loc[fits, "price_per_hour"],
                                                   table.loc[fits, latency], larger_is_better=False)
        table.loc[fits, "pareto_throughput"] = pareto(table.loc[fits, "price_per_hour"],
                                                      table.loc[fits, throughput], larger_is_better=True)
    table["rank"] = ranking(table, serving=serving, latency=latency)
    table["bottleneck"], table["prefill_bottleneck"] = "", ""
    # a training step's own terms, a serving pipeline's busiest part name it: no re-simulation
    for own in ("step_bottleneck", "server_bottleneck"):
        if own in table:
            ranked = table["rank"] > 0
            table.loc[ranked, "bottleneck"] = table.loc[ranked, own].fillna("")
    decode_step = 1 if serving or request.config.is_training or request.config.workload.output_tokens > 1 else 0
    for i in table.index[table["rank"] > 0] if not (serving or request.config.is_training) else ():
        scenario = scenario_from_dict(planner.scenario_dict(table.loc[i]))
        result = simulate(scenario, profile=profile, expand_steps=(0, decode_step))
        table.loc[i, "bottleneck"] = bottleneck(result, result.variants[0], decode_step)
        table.loc[i, "prefill_bottleneck"] = bottleneck(result, result.variants[0], 0)
    # A serving group's: the term taking most of a decode iteration at its maximum rate, from its
    # layout simulated at that batch (a pipeline's busiest part, above, already names its stage).
    for i in table.index[(table["rank"] > 0) & (table["bottleneck"] == "")] if serving else ():
        batch = planner.batch_scenario_dict(table.loc[i])
        if batch is None:
            continue
        try:
            result = simulate(scenario_from_dict(batch), profile=profile, expand_steps=(1,))
        except ConfigError as error:  # the batch as a scenario of its own: say why, do not fail the plan
            table.loc[i, "bottleneck"] = f"unknown: its decode batch does not simulate ({error})"
            continue
        table.loc[i, "bottleneck"] = bottleneck(result, result.variants[0], 1, step_name=(
            f"a decode iteration of {round(table.loc[i, DECODE_BATCH])} requests"))
    feasible = table[table["meets_slo"] & (table["rank"] > 0)]
    pick = feasible.sort_values("rank").iloc[0] if not feasible.empty else None
    table["versus_pick"] = ""
    for i in table.index[table["rank"] > 0]:
        table.loc[i, "versus_pick"] = versus_pick(table.loc[i], pick)
    chosen = pick if pick is not None else (table[table["rank"] == 1].iloc[0] if (table["rank"] == 1).any() else None)
    scenario = planner.scenario_dict(chosen, name=f"{request.name}-pick") if chosen is not None else None
    batch_scenario = None
    if scenario is not None:
        scenario["description"] = f"hetsim plan {request.name}: {chosen['cluster']}, {_layout(chosen)}"
        scenario["variants"][0]["name"] = chosen["variant"]
        if serving:
            batch_scenario = planner.batch_scenario_dict(chosen, name=f"{request.name}-pick-batch")
    if batch_scenario is not None:
        batch_scenario["description"] = (f"hetsim plan {request.name}: {chosen['cluster']}, {_layout(chosen)}, at the "
                                         f"batch it decodes at its maximum rate")
        batch_scenario["variants"][0]["name"] = chosen["variant"]
    public = [c for c in table.columns if c not in ("shape", "variant_config", "memory_config", "model_index", "layout",
                                                    "step_bottleneck", "server_bottleneck", "tokens_upper_bound")]
    notes = []
    if profile is not None:
        beyond = table[(table["rank"] > 0) & table["profile_context"].map(outside).astype(bool)]
        notes = [f"candidate {int(r['candidate'])} ({r['cluster']}, {r['variant']}): {r['profile_context']}"
                 for _, r in beyond.iterrows()]
    return PlanResult(request, table[public].reset_index(drop=True),
                      table.loc[pick.name, public] if pick is not None else None, scenario,
                      recommendation(request, table, table.loc[pick.name] if pick is not None else None),
                      time.perf_counter() - start, notes=tuple(notes), pick_batch_scenario=batch_scenario)
