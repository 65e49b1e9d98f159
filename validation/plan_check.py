"""``hetsim plan-check``: a plan's top configurations measured on the emulated cluster.

A plan (:mod:`sim.planning`) over clusters the testbed can build (``validation/plan-check/``: CPU
ranks, shaped links, notional prices) picks the cheapest configuration whose predicted TTFT and
TPOT meet the objectives. This module measures the plan's top ``n`` (5) configurations, each
written as the scenario the planner would run (:meth:`sim.planning.search.Planner.scenario_dict`),
on its own emulated cluster, and checks the plan against the measurement:

* **the pick against the best measured**: the pick's measured TPOT and TTFT against the lowest
  measured among the ``n``, ``pick / best - 1``, within :data:`WITHIN` (10%) or not;
* **the pick's SLO verdict**: does the measured pick still meet every objective;
* **the measured choice**: the plan's own ranking rule (:func:`sim.planning.outcome.ranking`: meets
  every objective, fewest misses, price, end-to-end latency) applied to the measured values of
  the ``n``: does it choose the pick;
* **predicted against measured** per candidate: signed error ``predicted / measured - 1`` of TTFT
  and TPOT, each marked ``replay`` (the profile was calibrated on that very cluster: its
  collective timings are replayed, same-cluster mode) or ``prediction`` (any other cluster);
* **rank agreement**: for every pair of candidates whose measured TTFT or TPOT differ by more
  than 10%, whether the prediction orders them alike
  (:func:`validation.validate.ranking_agreement`).

Candidates run on different clusters, so they cannot share a launch: each **round** measures
every candidate once (a testbed built, one launch of ``warmup`` + ``repeats`` generations, the
testbed removed), in plan order on even rounds and reversed on odd ones, so that a slow stretch
of a shared machine falls on several candidates. A candidate's figure is the median over all its
timed generations of all rounds, with p10 / p90. While each launch runs, the share of CPU time the
hypervisor stole and the share other processes took are recorded (:mod:`runtime.cpu_steal`), and
around it the machine's speed (a reference op set, :mod:`runtime.reference_timing`): against the
one the profile recorded at calibration, :func:`sim.machine_speed.slowdown` says how much slower
the machine ran while measuring (``machine_slowdown``), and the errors are given a second time with
the profile's compute rescaled by it (``ttft_error_compute_rescaled``, ``tpot_error_compute_rescaled``):
a diagnosis of how much of an error is the machine's stretch, not a prediction (it uses a timing
made while measuring). The raw errors are the check's.
Where ``HETSIM_TESTBED_LOCK`` names a file, each round holds a ``flock`` on it (:func:`testbed_turn`),
so that other runs using the testbed take turns with this one between rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from sim.context import calibrated_speed, load_warning, profile_contexts
from sim.machine_speed import describe, rescaled_profile, slowdown, speed_cell
from sim.planning.outcome import PlanResult, ranking
from sim.planning.plan_config import PlanRequest
from sim.planning.search import Planner, Stage, slo_miss
from sim.profile import Profile
from sim.scenario import Scenario, scenario_from_dict
from sim.vocabulary import Metric
from validation.validate import RANKING_THRESHOLD, ranking_agreement, testbed_turn

TOP_CHECKED = 5
WITHIN = 0.10  # the pick must measure within 10% of the best measured (issue 21, item 6)
CHECKED = {Metric.TTFT: "ttft", Metric.TPOT: "tpot"}  # the metrics judged, by column prefix
MEASURED = (Metric.TTFT, Metric.TPOT, Metric.E2E_LATENCY, Metric.DECODE_TOKENS_PER_S)
REPLAY, PREDICTION = "replay", "prediction"
CANDIDATE_COLUMNS = ["plan_rank", "measured_rank", "candidate", "cluster", "variant", "price_per_hour", "source",
                     "profile_context", "predicted_ttft_s", "measured_ttft_s", "measured_ttft_p10_s",
                     "measured_ttft_p90_s", "ttft_error", "predicted_tpot_s", "measured_tpot_s", "measured_tpot_p10_s",
                     "measured_tpot_p90_s", "tpot_error", "meets_slo_predicted", "meets_slo_measured",
                     "slo_miss_measured", "repeats", "cpu_steal", "other_load", "machine_slowdown",
                     "ttft_error_compute_rescaled", "tpot_error_compute_rescaled"]


def top_candidates(result: PlanResult, n: int = TOP_CHECKED) -> pd.DataFrame:
    """The plan's top ``n`` configurations (rank 1..n of :attr:`PlanResult.top`), in rank order.

    Raises:
        ValueError: the plan simulated no configuration that fits (it has no top).
    """
    top = result.top.head(n)
    if top.empty:
        raise ValueError("the plan has no simulated configuration that fits: nothing to measure")
    return top


def candidate_scenarios(request: PlanRequest, profile: Profile | None, top: pd.DataFrame) -> dict[int, dict]:
    """Each candidate of ``top`` as the scenario the planner simulated it with (one variant), by
    candidate number, named ``<plan>-c<candidate>`` (the name of its testbed too)."""
    planner = Planner(request, profile)
    rows = planner.candidates().set_index("candidate", drop=False)  # closed forms only, no simulation
    return {int(c): planner.scenario_dict(rows.loc[int(c)], name=f"{request.name}-c{int(c)}")
            for c in top["candidate"]}


def rescaled_predictions(scenarios: dict[int, Scenario], profile: Profile | None,
                         factors: dict[int, float]) -> dict[int, dict[str, float]]:
    """Each candidate's predicted TTFT and TPOT (s, by :class:`sim.vocabulary.Metric`) simulated
    with the profile's compute rescaled by its machine slowdown (:func:`sim.machine_speed.rescaled_profile`),
    as the planner simulates it (one variant, no expanded steps); none where there is no profile
    or the slowdown is unknown (NaN)."""
    from sim.simulate import simulate

    if profile is None:
        return {}
    out = {}
    for c, factor in factors.items():
        if math.isnan(factor):
            continue
        timing = simulate(scenarios[c], profile=rescaled_profile(profile, factor), expand_steps=()).variants[0].timing
        out[c] = {metric: float(timing[metric]) for metric in CHECKED}
    return out


def replayed(scenario: Scenario, profile: Profile | None) -> bool:
    """Whether the profile was calibrated on this very cluster (same-cluster mode: its collective
    timings are replayed, :mod:`sim.context`), so a figure of it is a replay, not a prediction."""
    from sim.simulate import simulate

    if profile is None:
        return False
    result = simulate(scenario, profile=profile, expand_steps=())
    return result.network is not None and result.network.same_cluster


@dataclass(frozen=True)
class CandidateRuns:
    """What one candidate measured over every round: one row per timed generation (``round``,
    ``repeat`` and the run metrics of :func:`sim.metrics.run_metrics`), the CPU time others
    took while its launches ran (fractions of the machine's, :mod:`runtime.cpu_steal`) and the
    machine's speed around them (the reference op set's median times, s by op,
    :mod:`runtime.reference_timing`; empty where not timed)."""

    generations: pd.DataFrame
    cpu_steal: float
    other_load: float
    reference_s: dict[str, float] = field(default_factory=dict)

    def median(self, metric: str) -> float:
        return float(np.median(self.generations[metric]))

    def percentile(self, metric: str, q: float) -> float:
        return float(np.percentile(self.generations[metric], q))


def measured_table(top: pd.DataFrame, runs: dict[int, CandidateRuns], slo, sources: dict[int, str],
                   calibrated_s: dict[str, float] | None = None,
                   rescaled: dict[int, dict[str, float]] | None = None) -> pd.DataFrame:
    """Predicted against measured per candidate (:data:`CANDIDATE_COLUMNS`), in plan order.

    ``measured_rank``: the plan's ranking rule applied to the measured values
    (:func:`sim.planning.outcome.ranking`). ``sources``: ``replay`` or ``prediction`` per candidate.
    ``machine_slowdown``: the candidate's reference timing against ``calibrated_s``, the profile's
    (:func:`sim.machine_speed.slowdown`; NaN where either is missing); ``*_error_compute_rescaled``:
    ``rescaled`` (the predictions with compute rescaled by it, :func:`rescaled_predictions`) against
    the measured values, NaN for a candidate it lacks.
    """
    measured = top.copy()
    for metric in MEASURED:
        measured[metric] = [runs[int(c)].median(metric) for c in top["candidate"]]
    measured["slo_miss"] = [slo_miss(row, slo) for _, row in measured.iterrows()]
    measured["meets_slo"] = measured["slo_miss"] == ""
    measured["stage"], measured["fits"] = Stage.SIMULATED, True  # the pool ranking() chooses from
    measured_rank = ranking(measured)
    rows = []
    for (i, row), rank in zip(top.iterrows(), measured_rank):
        c = int(row["candidate"])
        run = runs[c]
        out = {"plan_rank": int(row["rank"]), "measured_rank": int(rank), "candidate": c, "cluster": row["cluster"],
               "variant": row["variant"], "price_per_hour": row["price_per_hour"], "source": sources[c],
               "profile_context": row["profile_context"], "meets_slo_predicted": bool(row["meets_slo"]),
               "meets_slo_measured": bool(measured.loc[i, "meets_slo"]),
               "slo_miss_measured": measured.loc[i, "slo_miss"], "repeats": len(run.generations),
               "cpu_steal": run.cpu_steal, "other_load": run.other_load,
               "machine_slowdown": slowdown(calibrated_s or {}, run.reference_s)}
        for metric, short in CHECKED.items():
            value = run.median(metric)
            again = (rescaled or {}).get(c, {}).get(metric, math.nan)
            out |= {f"predicted_{short}_s": float(row[metric]), f"measured_{short}_s": value,
                    f"measured_{short}_p10_s": run.percentile(metric, 10),
                    f"measured_{short}_p90_s": run.percentile(metric, 90),
                    f"{short}_error": float(row[metric]) / value - 1 if value > 0 else math.nan,
                    f"{short}_error_compute_rescaled": again / value - 1 if value > 0 else math.nan}
        rows.append(out)
    return pd.DataFrame(rows, columns=CANDIDATE_COLUMNS)


@dataclass(frozen=True)
class Verdict:
    """The plan against the measurement (see the module docstring).

    ``pick``: the pick's candidate number, None when the plan has none (nothing else is then
    judged); ``versus_best``: per metric (TTFT, TPOT), ``pick / best measured - 1``;
    ``within``: per metric, whether that is at most :data:`WITHIN`; ``slo_holds``: the measured
    pick meets every objective; ``measured_choice``: the candidate the plan's rule chooses from the
    measured values (None: none of them meets the objectives); ``ranking``: the pairs of
    :func:`validation.validate.ranking_agreement`.
    """

    pick: int | None
    best: dict[str, int]
    versus_best: dict[str, float]
    within: dict[str, bool]
    slo_holds: bool | None
    measured_choice: int | None
    ranking: pd.DataFrame

    @property
    def passed(self) -> bool:
        """The pick measures within :data:`WITHIN` of the best in TTFT and TPOT, and meets its SLO."""
        return self.pick is not None and all(self.within.values()) and bool(self.slo_holds)


def verdict(table: pd.DataFrame) -> Verdict:
    """Judge a :func:`measured_table` (see :class:`Verdict`)."""
    errors = pd.concat([pd.DataFrame({"scenario": "plan", "prompt_tokens": 0, "variant": table["candidate"].astype(str),
                                      "metric": metric, "simulated": table[f"predicted_{short}_s"],
                                      "measured": table[f"measured_{short}_s"]})
                        for metric, short in CHECKED.items()], ignore_index=True)
    agreement = ranking_agreement(errors)
    choice = table[(table["measured_rank"] == 1) & table["meets_slo_measured"]]
    measured_choice = int(choice["candidate"].iloc[0]) if not choice.empty else None
    best = {metric: int(table.loc[table[f"measured_{short}_s"].idxmin(), "candidate"])
            for metric, short in CHECKED.items()}
    picks = table[(table["plan_rank"] == 1) & table["meets_slo_predicted"]]
    if picks.empty:
        return Verdict(None, best, {}, {}, None, measured_choice, agreement)
    pick = picks.iloc[0]
    versus = {metric: float(pick[f"measured_{short}_s"] / table[f"measured_{short}_s"].min() - 1)
              for metric, short in CHECKED.items()}
    return Verdict(int(pick["candidate"]), best, versus, {m: v <= WITHIN for m, v in versus.items()},
                   bool(pick["meets_slo_measured"]), measured_choice, agreement)


def measure_candidates(scenarios: dict[int, Scenario], *, rounds: int, repeats: int, warmup: int,
                       testbed: bool = True, on_progress: Callable[[str], None] = lambda text: None) -> dict[int, CandidateRuns]:
    """Measure every candidate in ``rounds`` rounds (see the module docstring), each launch inside
    its own testbed when ``testbed`` (built and removed by this call, in :func:`testbed_turn`).

    Raises:
        ConfigError: a scenario that does not fit in memory, testbed prerequisites missing.
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    from runtime.cpu_steal import ZERO, load_during
    from runtime.measure import launch_measurement, repeat_timings
    from runtime.reference_timing import medians, pooled, timed_around
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology
    from validation.memory_fit import check_memory_fits

    for scenario in scenarios.values():  # before any testbed is built
        check_memory_fits(scenario, allow_overcommit=False)
    generations: dict[int, list[dict]] = {c: [] for c in scenarios}
    spent = {c: ZERO for c in scenarios}
    reference: dict[int, dict[str, list[float]]] = {c: {} for c in scenarios}
    order = list(scenarios)
    for round_index in range(rounds):
        with testbed_turn():  # a round is a few minutes: others' runs get their turns between rounds
            for c in order if round_index % 2 == 0 else order[::-1]:
                scenario = scenarios[c]
                topology = build_topology(scenario.config.cluster)
                on_progress(f"round {round_index + 1}/{rounds}: candidate {c}")
                bed = None
                if testbed:
                    from runtime.testbed import Testbed, require_privileges

                    require_privileges()
                    bed = Testbed(scenario.name, topology)
                    bed.down()  # a previous crash may have left it behind
                    bed.up(owned=True)
                try:
                    (gathered, span), samples = timed_around(lambda: load_during(lambda: launch_measurement(
                        scenario, repeats=repeats, warmup=warmup, testbed=testbed)))
                finally:
                    if bed is not None:
                        bed.down()
                spent[c] = spent[c] + span
                reference[c] = pooled(reference[c], samples)
                master = ParallelPlan.of(scenario, topology).stage_ranks[-1][0]
                per_rank = [ranks[0] for ranks in gathered]  # one variant per candidate scenario
                timings = repeat_timings(per_rank, master, scenario.config.workload.batch_size)
                generations[c] += [{"candidate": c, "round": round_index, "repeat": i,
                                    **{m: t[m] for m in MEASURED}} for i, t in enumerate(timings)]
    return {c: CandidateRuns(pd.DataFrame(generations[c]), spent[c].steal_fraction, spent[c].other_load,
                             medians(reference[c])) for c in scenarios}


@dataclass(frozen=True)
class PlanCheck:
    """A plan-check's tables: ``candidates`` (:func:`measured_table`), ``generations`` (every timed
    generation), the :class:`Verdict`, the scenarios measured (YAML dicts by candidate), what
    was run (``command``) and ``profile_load``: the warning that the profile was calibrated under
    load (:func:`sim.context.load_warning`), '' where it was not or there is no profile."""

    plan: PlanResult
    candidates: pd.DataFrame
    generations: pd.DataFrame
    verdict: Verdict
    scenarios: dict[int, dict]
    command: str
    profile_load: str = ""


def check_plan(plan: PlanResult, profile: Profile | None, *, n: int = TOP_CHECKED, rounds: int = 3,
               repeats: int = 3, warmup: int = 1, testbed: bool = True, command: str = "", on_progress: Callable[[str], None] = lambda text: None) -> PlanCheck:
    """Measure the plan's top ``n`` and judge it (see the module docstring).

    Raises:
        ValueError: the plan has no configuration to measure.
        ConfigError, runtime.errors.LaunchError: as :func:`measure_candidates`.
    """
    top = top_candidates(plan, n)
    dicts = candidate_scenarios(plan.request, profile, top)
    base = plan.request.source_path.parent if plan.request.source_path else Path(".")
    scenarios = {c: scenario_from_dict(d, base_dir=base) for c, d in dicts.items()}
    sources = {c: REPLAY if replayed(s, profile) else PREDICTION for c, s in scenarios.items()}
    runs = measure_candidates(scenarios, rounds=rounds, repeats=repeats, warmup=warmup, testbed=testbed,
                              on_progress=on_progress)
    calibrated_s = {} if profile is None else calibrated_speed(profile_contexts(profile.rows))
    factors = {c: slowdown(calibrated_s, run.reference_s) for c, run in runs.items()}
    table = measured_table(top, runs, plan.request.config.slo, sources, calibrated_s,
                           rescaled_predictions(scenarios, profile, factors))
    generations = pd.concat([r.generations for r in runs.values()], ignore_index=True)
    loaded = "" if profile is None else load_warning(profile_contexts(profile.rows))
    return PlanCheck(plan, table, generations, verdict(table), dicts, command, loaded)


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _span(values: pd.Series) -> str:
    low, high = int(values.min()), int(values.max())
    return f"{low}" if low == high else f"{low}-{high}"


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f}"


def summary_markdown(check: PlanCheck) -> str:
    """The report's ``summary.md``: the verdict, then predicted against measured per candidate."""
    v, table, slo = check.verdict, check.candidates, check.plan.request.config.slo
    lines = [f"# Plan check: {check.plan.request.name}", "",
             f"`{check.command}`" if check.command else "", "",
             f"The plan's top {len(table)} configurations, each measured on its own emulated cluster "
             f"({int(check.generations['round'].max()) + 1} rounds, {_span(table['repeats'])} timed generations "
             "each; medians). Errors are predicted / measured - 1.",
             ""]
    if v.pick is None:
        lines += ["The plan has no pick (no configuration was predicted to meet the objectives): nothing to judge.", ""]
    else:
        pick = table.set_index("candidate").loc[v.pick]
        lines += [f"- The pick: candidate {v.pick}, {pick['cluster']}, {pick['variant']} "
                  f"({pick['source']}, {pick['price_per_hour']:g} $/h notional)."]
        for metric, short in CHECKED.items():
            best = table.set_index("candidate").loc[v.best[metric]]
            lines.append(f"- Measured {short.upper()}: the pick {_ms(pick[f'measured_{short}_s'])} ms, the best of the "
                         f"{len(table)} {_ms(best[f'measured_{short}_s'])} ms (candidate {v.best[metric]}): "
                         f"{_pct(v.versus_best[metric])}, "
                         f"{'within' if v.within[metric] else 'NOT within'} {WITHIN:.0%}.")
        lines.append(f"- Its SLO verdict ({_objectives(slo)}) measured: "
                     + ("holds." if v.slo_holds else f"does NOT hold ({pick['slo_miss_measured']})."))
    choice = ("none of them meets the objectives" if v.measured_choice is None else
              f"candidate {v.measured_choice}" + (" (the pick)" if v.measured_choice == v.pick else ""))
    lines.append(f"- The plan's own rule applied to the measured values chooses {choice}.")
    agreed = int(v.ranking["simulator_agrees"].sum())
    lines.append(f"- Rank agreement: {agreed} of {len(v.ranking)} pairs whose measured TTFT or TPOT differ by more "
                 f"than {RANKING_THRESHOLD:.0%} are ordered alike by the prediction.")
    lines.append("")
    for source in (REPLAY, PREDICTION):
        part = table[table["source"] == source]
        if part.empty:
            continue
        errors = np.abs(pd.concat([part["ttft_error"], part["tpot_error"]]))
        lines.append(f"- {source}: {len(part)} candidates, median / max |error| of TTFT and TPOT "
                     f"{np.median(errors):.1%} / {np.max(errors):.1%}.")
    if check.profile_load:
        lines.append(f"- The profile was {check.profile_load}.")
    lines += _speed_lines(table)
    lines += ["", "| plan rank | measured rank | candidate | cluster | layout | $/h | source | TTFT ms predicted / "
              "measured (p10-p90) | error | TPOT ms predicted / measured (p10-p90) | error | SLO predicted / measured "
              "| steal | other load | machine vs calibration | TTFT / TPOT error, compute rescaled (diagnosis) |",
              "|" + "---|" * 16]
    for row in table.itertuples(index=False):
        lines.append(
            f"| {row.plan_rank} | {row.measured_rank or '-'} | {row.candidate} | {row.cluster} | {row.variant} | "
            f"{row.price_per_hour:g} | {row.source} | {_ms(row.predicted_ttft_s)} / {_ms(row.measured_ttft_s)} "
            f"({_ms(row.measured_ttft_p10_s)}-{_ms(row.measured_ttft_p90_s)}) | {_pct(row.ttft_error)} | "
            f"{_ms(row.predicted_tpot_s)} / {_ms(row.measured_tpot_s)} ({_ms(row.measured_tpot_p10_s)}-"
            f"{_ms(row.measured_tpot_p90_s)}) | {_pct(row.tpot_error)} | "
            f"{'meets' if row.meets_slo_predicted else 'misses'} / {'meets' if row.meets_slo_measured else 'misses'} | "
            f"{row.cpu_steal:.1%} | {row.other_load:.1%} | {speed_cell(row.machine_slowdown)} | "
            f"{_pct_or_blank(row.ttft_error_compute_rescaled)} / {_pct_or_blank(row.tpot_error_compute_rescaled)} |")
    lines += ["", "Source: `replay` where the profile was calibrated on that very cluster (its timings are "
              "replayed), `prediction` elsewhere. Prices are notional (validation/plan-check/catalog.yaml). "
              "steal: CPU time the hypervisor took; other load: CPU time other processes took, both while the "
              "candidate's launches ran. Machine vs calibration: a reference op set (a GPT-2 matmul and a "
              "memory-bound matvec, one thread) timed around the candidate's launches against its timing "
              "around the profile's calibration (runtime.reference_timing). Error, compute rescaled: the "
              "prediction re-simulated with the profile's compute times multiplied by that factor; it uses a "
              "timing made while measuring, so it is a diagnosis of the machine's stretch, not a prediction.", ""]
    return "\n".join(lines)


def _pct_or_blank(value: float) -> str:
    return "-" if math.isnan(value) else _pct(value)


def _speed_lines(table: pd.DataFrame) -> list[str]:
    """The machine's speed while measuring against the calibration's, and the errors with compute
    rescaled by it (a diagnosis, beside the raw errors); one line saying it is unknown where the
    profile or the measurement did not time the reference op set."""
    known = table[table["machine_slowdown"].notna()]
    if known.empty:
        return ["- Machine speed against the calibration: not known (the profile records no reference timing, "
                "or none was made while measuring): no error with compute rescaled."]
    factors = known["machine_slowdown"]
    raw = np.abs(pd.concat([known["ttft_error"], known["tpot_error"]]))
    again = np.abs(pd.concat([known["ttft_error_compute_rescaled"], known["tpot_error_compute_rescaled"]]))
    return [f"- Machine speed while measuring, against the calibration (reference op set): "
            f"{describe(float(np.median(factors)))} (median over candidates; "
            f"{speed_cell(float(factors.min()))} .. {speed_cell(float(factors.max()))}). With the profile's compute "
            f"rescaled by each candidate's factor, median / max |error| {np.median(again):.1%} / {np.max(again):.1%} "
            f"(raw {np.median(raw):.1%} / {np.max(raw):.1%}): a diagnosis using a timing made while measuring, "
            "not a prediction."]


def _objectives(slo) -> str:
    parts = [f"TTFT <= {_ms(slo.ttft_s)} ms" if slo.ttft_s is not None else "",
             f"TPOT <= {_ms(slo.tpot_s)} ms" if slo.tpot_s is not None else "",
             f"{slo.tokens_per_s:g} tokens/s" if slo.tokens_per_s is not None else ""]
    return ", ".join(p for p in parts if p)


def write_plan_check(check: PlanCheck, out_dir: Path) -> list[Path]:
    """``candidates.csv``, ``generations.csv``, ``summary.md`` and ``scenarios/c<N>.yaml`` into ``out_dir``."""
    from sim.outputs import write_files

    files = {"candidates.csv": check.candidates.to_csv(index=False, lineterminator="\n"),
             "generations.csv": check.generations.to_csv(index=False, lineterminator="\n"),
             "summary.md": summary_markdown(check)}
    files |= {f"scenarios/c{c}.yaml": yaml.safe_dump(d, sort_keys=False) for c, d in check.scenarios.items()}
    return write_files(out_dir, files)
