"""``hetsim validate``: run a matrix both ways and report how far the simulator is from reality.

For each scenario of the matrix, with its testbed up (if the matrix says so): read each case's
peak memory in a short launch of its own, then calibrate and measure every variant at every
prompt length in one launch, interleaved in rounds (:mod:`runtime.interleaved`), so that a shared
machine's drift falls on the calibration and the measurement alike. The calibration sweep also
times the collectives at the matrix's ``collective_sizes`` in its rounds, which the profile holds
out of the interpolation (``collective_held_out``). Then simulate each case with the profile and
compare: the metrics (:func:`case_errors`, with the measurement's own split-half disagreement,
:func:`split_halves`), the collective calls inside the runs (:func:`in_run_errors`), where each
step's time goes (:func:`validation.terms.term_errors`), and the held-out collectives against
the calibrated network model's interpolation (:func:`collective_errors`). The testbed goes down
whatever happens.

Each launch also times a reference op set around it (:mod:`runtime.reference_timing`): the
interleaved launch's timing goes into its profile (a ``speed`` context row), and a layout measured
in a launch of its own is set against it (``machine_slowdown``, :func:`sim.machine_speed.slowdown`;
1 for the interleaved cases, whose calibration and measurement share one launch), with its error
again with the profile's compute rescaled by that factor (``error_compute_rescaled``): a diagnosis
of the machine's stretch between the launches, not a prediction (it uses a timing made while
measuring). The raw ``error`` is the report's.

Errors are signed, ``simulated / measured - 1``. The report gives, per metric, the median and p90
of |error| over cases; whether the simulator orders each pair of variants as the measurement does
where the measured difference exceeds 10%; and the seed's claim: allreduce_ln with its best
algorithm against reduce_ln_bcast, measured and simulated side by side.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.context import calibrated_speed, profile_contexts
from sim.machine_speed import rescaled_profile, slowdown
from sim.parallel import ParallelPlan
from sim.profile import MeasurementKind, Profile
from sim.scenario import Scenario
from sim.trace import COLLECTIVE_KINDS, master_calls
from sim.vocabulary import Metric
from validation.matrix import Matrix, with_layout, with_prompt
from validation.terms import profile_gap_s, term_errors

TIMING_METRICS = (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S)
CHECKED_METRICS = (*TIMING_METRICS, Metric.PEAK_MEMORY)
RANKING_THRESHOLD = 0.10
# The collective target's population (the calibrate-and-validate issue): messages of at least
# 1 MiB, or any size over links with injected delay (at least 1 ms one way between two hosts).
# Below both, a gloo message is bound by the machine (0.7-2 ms, 30-170% spread, measured here).
TARGET_COLLECTIVE_BYTES = 2**20
INJECTED_DELAY_S = 1e-3
STALL_THRESHOLD = 0.10  # a run stalls when waiting for weight loads takes over 10% of a decode step
COLLECTIVE_COLUMNS = ["scenario", "op", "algorithm", "size_bytes", "simulated", "measured", "measured_p10",
                      "measured_p90", "error", "targeted"]
IN_RUN_COLUMNS = ["scenario", "prompt_tokens", "variant", "phase", "call", "op", "size_bytes", "simulated", "measured",
                  "measured_p10", "measured_p90", "error"]
REGIME_COLUMNS = ["scenario", "prompt_tokens", "variant", "fits_simulated", "fits_measured",
                  "stall_simulated_s", "stall_measured_s", "stalls_simulated", "stalls_measured", "agrees"]


@dataclass(frozen=True)
class ValidationReport:
    """Tables of a validation run (see :func:`validate`)."""

    errors: pd.DataFrame
    collectives: pd.DataFrame
    summary: pd.DataFrame
    ranking: pd.DataFrame
    claim: pd.DataFrame
    regimes: pd.DataFrame
    in_run: pd.DataFrame
    terms: pd.DataFrame


def case_errors(scenario: str, prompt_tokens: int, simulated: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Join simulated and measured result tables of one case set on (variant, metric, device)."""
    sim = simulated[simulated["metric"].isin(CHECKED_METRICS)]
    meas = measured.set_index(["variant", "metric", "device"])["value"]
    rows = []
    for row in sim.itertuples(index=False):
        key = (row.variant, row.metric, row.device)
        if key not in meas.index:
            continue
        p10 = p90 = np.nan
        if row.metric in TIMING_METRICS:
            p10 = meas.get((row.variant, Metric(row.metric).percentile(10), row.device), np.nan)
            p90 = meas.get((row.variant, Metric(row.metric).percentile(90), row.device), np.nan)
        measured_value = float(meas[key])
        rows.append({"scenario": scenario, "prompt_tokens": prompt_tokens, "variant": row.variant,
                     "metric": row.metric, "device": row.device, "simulated": float(row.value),
                     "measured": measured_value, "measured_p10": p10, "measured_p90": p90,
                     "error": float(row.value) / measured_value - 1 if measured_value else np.nan})
    return pd.DataFrame(rows)


def memory_regimes(scenario: str, prompt_tokens: int, simulated: pd.DataFrame, measured: pd.DataFrame
                   ) -> pd.DataFrame:
    """Per variant: does it fit (every device's peak within its capacity), and does decode stall
    waiting for streamed weights (stall over :data:`STALL_THRESHOLD` of TPOT), simulated and
    measured; ``agrees`` when both verdicts match."""
    rows = []
    for variant, sim in simulated.groupby("variant", sort=False):
        meas = measured[measured["variant"] == variant]
        if meas.empty:
            continue
        capacity = sim[sim["metric"] == Metric.MEMORY_CAPACITY].set_index("device")["value"]

        def fits(table: pd.DataFrame) -> bool:
            peaks = table[table["metric"] == Metric.PEAK_MEMORY].set_index("device")["value"]
            return bool((peaks <= capacity.reindex(peaks.index)).all())

        def value(table: pd.DataFrame, metric: str) -> float:
            found = table.loc[(table["metric"] == metric) & (table["device"].fillna("") == ""), "value"]
            return float(found.iloc[0]) if len(found) else np.nan

        stall_sim, stall_meas = value(sim, Metric.LOADER_STALL_DECODE), value(meas, Metric.LOADER_STALL_DECODE)
        stalls_sim = bool(stall_sim > STALL_THRESHOLD * value(sim, Metric.TPOT))
        stalls_meas = bool(stall_meas > STALL_THRESHOLD * value(meas, Metric.TPOT))
        fits_sim, fits_meas = fits(sim), fits(meas)
        rows.append({"scenario": scenario, "prompt_tokens": prompt_tokens, "variant": variant,
                     "fits_simulated": fits_sim, "fits_measured": fits_meas, "stall_simulated_s": stall_sim,
                     "stall_measured_s": stall_meas, "stalls_simulated": stalls_sim, "stalls_measured": stalls_meas,
                     "agrees": fits_sim == fits_meas and stalls_sim == stalls_meas})
    return pd.DataFrame(rows, columns=REGIME_COLUMNS)


def split_halves(case: Scenario, gathered: list) -> pd.DataFrame:
    """The measurement against itself, per variant and timing metric: the median over its even
    timed rounds against the median over its odd ones, ``|even / odd - 1|`` (``split_half``). On
    a shared machine this is the floor under any simulator's error: two halves of one
    interleaved measurement disagree by it. NaN with fewer than two rounds.

    Args:
        gathered: the case's measurements, ``[rank][variant]`` (:mod:`runtime.measure`).
    """
    from runtime.measure import repeat_timings

    master = min(per_rank[0].rank for per_rank in gathered)
    rows = []
    for measured in zip(*gathered):  # one variant, every rank
        per_repeat = repeat_timings(list(measured), master, case.config.workload.batch_size)
        for metric in TIMING_METRICS:
            values = np.array([r[metric] for r in per_repeat], dtype=float)
            half = (float(np.median(values[0::2]) / np.median(values[1::2]) - 1) if len(values) >= 2
                    else np.nan)
            rows.append({"variant": measured[0].variant, "metric": metric, "split_half": abs(half)})
    return pd.DataFrame(rows, columns=["variant", "metric", "split_half"])


def summarise_errors(errors: pd.DataFrame, collectives: pd.DataFrame, in_run: pd.DataFrame | None = None
                     ) -> pd.DataFrame:
    """Per metric: number of cases, median and p90 of |error|, median signed error.
    ``collective_s`` is the target's population (``targeted``); ``collective_s_all`` every size;
    ``collective_in_run_s`` the collectives inside the measured runs (:func:`in_run_errors`)."""
    parts = [errors[["metric", "error"]]]
    if in_run is not None and len(in_run):
        parts.append(in_run.assign(metric=Metric.COLLECTIVE_IN_RUN.value)[["metric", "error"]])
    if len(collectives):
        parts.append(collectives[collectives["targeted"].astype(bool)].assign(metric=Metric.COLLECTIVE.value)[["metric", "error"]])
        parts.append(collectives.assign(metric=Metric.COLLECTIVE_ALL.value)[["metric", "error"]])
    both = pd.concat(parts, ignore_index=True).dropna()
    grouped = both.groupby("metric", sort=True)["error"]
    summary = pd.DataFrame({
        "cases": grouped.size(),
        "median_abs_error": grouped.apply(lambda e: float(np.median(np.abs(e)))),
        "p90_abs_error": grouped.apply(lambda e: float(np.percentile(np.abs(e), 90))),
        "median_signed_error": grouped.median(),
    })
    if "split_half" in errors:
        halves = errors.dropna(subset=["split_half"]).groupby("metric", sort=True)["split_half"]
        summary["split_half_median"] = halves.median()
        summary["split_half_p90"] = halves.apply(lambda e: float(np.percentile(e, 90)))
    return summary.reset_index()


def ranking_agreement(errors: pd.DataFrame) -> pd.DataFrame:
    """Every pair of variants of a case set whose measured TTFT or TPOT differ by more than 10%:
    does the simulator order them the same way?"""
    rows = []
    timing = errors[errors["metric"].isin((Metric.TTFT, Metric.TPOT))]
    for (scenario, prompt, metric), group in timing.groupby(["scenario", "prompt_tokens", "metric"], sort=True):
        values = group.set_index("variant")
        for a, b in itertools.combinations(sorted(values.index), 2):
            measured_a, measured_b = values.loc[a, "measured"], values.loc[b, "measured"]
            difference = abs(measured_a / measured_b - 1)
            if difference <= RANKING_THRESHOLD:
                continue
            agree = (measured_a < measured_b) == (values.loc[a, "simulated"] < values.loc[b, "simulated"])
            rows.append({"scenario": scenario, "prompt_tokens": prompt, "metric": metric, "faster": a if
                         measured_a < measured_b else b, "slower": b if measured_a < measured_b else a,
                         "measured_difference": difference, "simulator_agrees": bool(agree)})
    return pd.DataFrame(rows, columns=["scenario", "prompt_tokens", "metric", "faster", "slower",
                                       "measured_difference", "simulator_agrees"])


def seed_claim(errors: pd.DataFrame) -> pd.DataFrame:
    """reduce_ln_bcast against allreduce_ln with its best algorithm (by measured TPOT), per case
    set: TTFT and decode tokens/s, measured and simulated."""
    rows = []
    for (scenario, prompt), group in errors.groupby(["scenario", "prompt_tokens"], sort=True):
        by = group.set_index(["variant", "metric"])
        variants = sorted(group["variant"].unique())
        baseline = next((v for v in variants if v.startswith("reduce_ln_bcast")), None)
        candidates = [v for v in variants if v != baseline and (v, Metric.TPOT) in by.index]
        if baseline is None or not candidates:
            continue
        best = min(candidates, key=lambda v: by.loc[(v, Metric.TPOT), "measured"])
        for source in ("measured", "simulated"):
            rows.append({"scenario": scenario, "prompt_tokens": prompt, "source": source, "best_allreduce": best,
                         "ttft_reduce_ln_bcast_s": by.loc[(baseline, Metric.TTFT), source],
                         "ttft_allreduce_ln_s": by.loc[(best, Metric.TTFT), source],
                         "tokens_per_s_reduce_ln_bcast": by.loc[(baseline, Metric.DECODE_TOKENS_PER_S), source],
                         "tokens_per_s_allreduce_ln": by.loc[(best, Metric.DECODE_TOKENS_PER_S), source]})
    return pd.DataFrame(rows)


def collective_errors(scenario: Scenario, profile: Profile, measured: pd.DataFrame) -> pd.DataFrame:
    """Measured collective times (in isolation) against the calibrated network model's
    interpolation of the isolated timings. ``targeted``: the case is in the collective target's
    population (at least :data:`TARGET_COLLECTIVE_BYTES`, or the group's hosts are at least
    :data:`INJECTED_DELAY_S` apart)."""
    from sim.calibrated import CalibratedNetwork
    from sim.collectives.registry import build_schedule
    from sim.network import NETWORK_MODELS
    from sim.topology import build_topology

    topology = build_topology(scenario.config.cluster)
    fallback = NETWORK_MODELS[scenario.config.network_model](topology, None)
    network = CalibratedNetwork(profile, fallback, topology, in_place=False)
    rows = []
    for row in measured.itertuples(index=False):
        group = tuple(range(int(row.group_size)))
        root = None if row.op == OpKind.ALLREDUCE else 0
        schedule = build_schedule(row.op, row.algorithm, group, int(row.size_bytes), root=root,
                                  host_groups=topology.host_groups(group))
        predicted = network.time(schedule).duration_s
        delay_s = max((topology.path_latency_s(a, b) for a in group for b in group if a != b), default=0.0)
        rows.append({"scenario": scenario.name, "op": row.op, "algorithm": row.algorithm,
                     "size_bytes": int(row.size_bytes), "simulated": predicted, "measured": row.median,
                     "measured_p10": row.p10, "measured_p90": row.p90, "error": predicted / row.median - 1,
                     "targeted": bool(row.size_bytes >= TARGET_COLLECTIVE_BYTES or delay_s >= INJECTED_DELAY_S)})
    return pd.DataFrame(rows, columns=COLLECTIVE_COLUMNS)


def call_durations(ops: pd.DataFrame) -> pd.DataFrame:
    """Each collective call of a trace's op table, charged as the simulator's
    ``collective_in_place`` rows charge it: the master's (the trace's lowest rank's) end less the
    last rank's start; the master's wait before that start is left out, as it is a term of its own
    (:mod:`validation.terms`). Columns: phase, call (the plan op's name), op, size_bytes, duration_s."""
    master = master_calls(ops[ops["kind"].isin(COLLECTIVE_KINDS)])
    return pd.DataFrame({"phase": master["phase"], "call": master["name"], "op": master["kind"],
                         "size_bytes": master["bytes"], "duration_s": master["call_s"]}).reset_index(drop=True)


def in_run_errors(scenario: str, prompt_tokens: int, simulated, measured) -> pd.DataFrame:
    """The collectives inside the runs: per variant, phase, plan op, kind and size, the simulated
    call time against the measured mean (the statistic the simulator charges, :mod:`sim.calibrated`;
    with p10 / p90) over the calls of the measured trace.

    Args:
        simulated: a :class:`sim.simulate.SimulationResult`; measured: a
            :class:`runtime.measure.MeasuredResult` (their traces share one schema).
    """
    rows = []
    for sim_variant, meas_variant in zip(simulated.variants, measured.variants):
        sim_calls = call_durations(sim_variant.trace.ops)
        meas_calls = call_durations(meas_variant.trace.ops)
        for (phase, call, op, size), group in meas_calls.groupby(["phase", "call", "op", "size_bytes"], sort=True):
            predicted = sim_calls[(sim_calls.phase == phase) & (sim_calls.call == call) & (sim_calls.op == op)
                                  & (sim_calls.size_bytes == size)]
            if predicted.empty:
                continue
            value = float(predicted["duration_s"].median())
            times = group["duration_s"].to_numpy()
            mean = float(np.mean(times))
            rows.append({"scenario": scenario, "prompt_tokens": prompt_tokens, "variant": meas_variant.name,
                         "phase": phase, "call": call, "op": op, "size_bytes": int(size), "simulated": value,
                         "measured": mean,
                         "measured_p10": float(np.percentile(times, 10)),
                         "measured_p90": float(np.percentile(times, 90)),
                         # a root that left before the last arrival: no time after it to compare
                         "error": value / mean - 1 if mean > 0 else np.nan})
    return pd.DataFrame(rows, columns=IN_RUN_COLUMNS)


LOCK_TURN_S = 2.0  # between two clusters, how long a run sharing the testbed lock leaves it free


LOCK_VARIABLE = "HETSIM_TESTBED_LOCK"


@contextmanager
def testbed_turn() -> Iterator[None]:
    """An exclusive lock on the file named by ``HETSIM_TESTBED_LOCK`` (flock(2), as ``flock FILE``
    takes it) for the block, so that runs sharing one machine's testbed take turns; on release,
    :data:`LOCK_TURN_S` without it before the caller may take it again (flock wakes its waiters but
    does not queue them). No lock without the variable."""
    path = os.environ.get(LOCK_VARIABLE)
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock
    time.sleep(LOCK_TURN_S)


def with_rescaled_errors(errors: pd.DataFrame, case: Scenario, profile: Profile, factor: float, measured,
                         simulate) -> pd.DataFrame:
    """``errors`` (:func:`case_errors` of ``case``) with ``machine_slowdown`` = ``factor`` and
    ``error_compute_rescaled``: the simulation with the profile's compute times multiplied by
    ``factor`` (:func:`sim.machine_speed.rescaled_profile`) against the same ``measured`` results;
    the error as it is where the factor is 1 (nothing to rescale), NaN where it is unknown."""
    errors = errors.assign(machine_slowdown=factor)
    if np.isnan(factor):
        return errors.assign(error_compute_rescaled=np.nan)
    if factor == 1.0:
        return errors.assign(error_compute_rescaled=errors["error"])
    again = case_errors(case.name, case.config.workload.prompt_tokens,
                        simulate(case, profile=rescaled_profile(profile, factor)).results, measured)
    again = again[["variant", "metric", "device", "error"]].rename(columns={"error": "error_compute_rescaled"})
    return errors.merge(again, on=["variant", "metric", "device"], how="left")


def layout_errors(case: Scenario, topology, profile: Profile, matrix: Matrix, simulate) -> pd.DataFrame:
    """One layout of a layouts matrix (``case``: one variant in a layout the profile did not
    measure) measured in a launch of its own on the cluster calibrated just before, against its
    prediction from that profile: :func:`case_errors` with the split half, ``layout_seen`` false,
    the machine's CPU shares over the launch (``cpu_steal``; ``other_load``: busy time less
    this process's and its children's, the ranks, :func:`runtime.cpu_steal.load_during`), and its
    speed against the calibration's (:func:`with_rescaled_errors`)."""
    from runtime.cpu_steal import load_during
    from runtime.measure import launch_measurement, measured_result
    from runtime.reference_timing import medians, timed_around

    (gathered, spent), reference = timed_around(lambda: load_during(lambda: launch_measurement(
        case, repeats=matrix.repeats, warmup=matrix.warmup, testbed=matrix.testbed, min_timed_s=matrix.min_timed_s)))
    measured = measured_result(case, topology, gathered)
    simulated = simulate(case, profile=profile)
    prompt = case.config.workload.prompt_tokens
    factor = slowdown(calibrated_speed(profile_contexts(profile.rows)), medians(reference))
    errors = (case_errors(case.name, prompt, simulated.results, measured.results)
              .merge(split_halves(case, gathered), on=["variant", "metric"], how="left")
              .assign(repeats=len(gathered[0][0].step_start_s), cpu_steal=spent.steal_fraction,
                      other_load=spent.other_load,
                      layout_seen=False))
    return with_rescaled_errors(errors, case, profile, factor, measured.results, simulate)


def validate(matrix: Matrix, scenarios: list[Scenario], out_dir: Path,
             on_progress: Callable[[str], None] = lambda text: None, *,
             allow_overcommit: bool = False) -> ValidationReport:
    """Run the matrix (see the module docstring); profiles are written under ``out_dir/profiles``
    once every scenario has run. Every case is checked to fit in memory first
    (:func:`validation.memory_fit.check_memory_fits`, ``allow_overcommit`` as there).

    Raises:
        ConfigError: bad scenario, a case that does not fit in memory, or testbed prerequisites missing.
        runtime.errors.LaunchError: a rank failed, died or hung.
        runtime.interrupt.Interrupted: a signal arrived; the ranks are stopped, the testbed is
            down and no profile is written.
    """
    from runtime import interrupt
    from runtime.interleaved import launch_interleaved
    from runtime.measure import launch_measurement, measured_result, with_memory
    from sim.outputs import write_atomic
    from sim.simulate import simulate
    from sim.topology import build_topology

    from validation.memory_fit import check_memory_fits

    calibrated = next((layout for layout in matrix.layouts if layout.parallel is None), None)
    others = [layout for layout in matrix.layouts if layout.parallel is not None]
    for scenario in scenarios:  # before any rank starts or any testbed is built
        for prompt in matrix.prompt_tokens:
            for case in [with_prompt(scenario, prompt)] if calibrated is None else [
                    with_layout(scenario, layout, prompt) for layout in matrix.layouts]:
                check_memory_fits(case, allow_overcommit=allow_overcommit)
    errors, collectives, regimes, in_run, terms = [], [], [], [], []
    profiles: dict[Path, str] = {}
    for original in scenarios:
        # A layouts matrix calibrates and measures the scenario's baseline in its own layout, then
        # measures the other layouts and predicts them with that profile (layout_errors).
        scenario = original if calibrated is None else with_layout(original, calibrated)
        topology = build_topology(scenario.config.cluster)
        turn = ExitStack()
        turn.enter_context(testbed_turn())
        bed = None
        if matrix.testbed:
            from runtime.testbed import Testbed, require_privileges

            require_privileges()
            bed = Testbed(scenario.name, topology)
            bed.down()  # a previous crash may have left it behind
            bed.up(owned=True)
        try:
            cases = {prompt: with_prompt(scenario, prompt) for prompt in matrix.prompt_tokens}
            # Peak memory does not drift: it is read in a short launch per case (its warm-up, then
            # the memory probes), in a process that holds what a measured run holds
            # (runtime.interleaved says why not there).
            memory = {}
            for prompt, case in cases.items():
                on_progress(f"{scenario.name}: reading peak memory at prompt {prompt}")
                memory[prompt] = launch_measurement(case, repeats=0, warmup=matrix.warmup, testbed=matrix.testbed)
            on_progress(f"{scenario.name}: calibrating and measuring, interleaved")
            beat = lambda rank, label, name=scenario.name: on_progress(f"{name}: {label}") if rank == 0 else None
            held_out = tuple(matrix.collective_sizes)
            run = launch_interleaved(scenario, list(cases.values()), testbed=matrix.testbed, repeats=matrix.repeats,
                                     warmup=matrix.warmup, min_timed_s=matrix.min_timed_s,
                                     calibration_repeats=matrix.calibration_repeats,
                                     used_only=matrix.calibrate_collectives == "used", held_out_sizes=held_out,
                                     on_beat=beat)
            profile_csv = run.profile.to_csv(index=False, lineterminator="\n")
            profiles[out_dir / "profiles" / f"{scenario.name}.csv"] = profile_csv
            profile = Profile(run.profile)
            gap_s = profile_gap_s(profile, topology.devices[ParallelPlan.of(scenario, topology).tensor_ranks[0]].spec.name)
            for (prompt, case), timed in zip(cases.items(), run.measurements):
                simulated = simulate(case, profile=profile)
                gathered = with_memory(timed, memory[prompt])
                measured = measured_result(case, topology, gathered)
                case_table = (case_errors(scenario.name, prompt, simulated.results, measured.results)
                              .merge(split_halves(case, gathered), on=["variant", "metric"], how="left")
                              .assign(repeats=run.rounds["measurement"],
                                      calibration_rounds=run.rounds["calibration"],
                                      cpu_steal=run.measurement_cpu_steal,
                                      calibration_cpu_steal=run.calibration_cpu_steal,
                                      other_load=run.measurement_other_load,
                                      calibration_other_load=run.calibration_other_load))
                # one launch calibrated and measured: its reference timing is both (factor 1)
                errors.append(with_rescaled_errors(case_table, case, profile,
                                                   slowdown(run.reference_s, run.reference_s),
                                                   measured.results, simulate))
                regimes.append(memory_regimes(scenario.name, prompt, simulated.results, measured.results))
                in_run.append(in_run_errors(scenario.name, prompt, simulated, measured))
                terms.append(term_errors(scenario.name, prompt, simulated, measured, gap_s))
            if held_out:
                timed = profile.of(MeasurementKind.COLLECTIVE_HELD_OUT)
                collectives.append(collective_errors(scenario, profile, timed))
            if calibrated is not None:
                errors[-len(cases):] = [e.assign(layout_seen=True) for e in errors[-len(cases):]]
                for layout in others:
                    for prompt in matrix.prompt_tokens:
                        on_progress(f"{scenario.name}: measuring layout {layout.name} at prompt {prompt}")
                        errors.append(layout_errors(with_layout(original, layout, prompt), topology,
                                                    profile, matrix, simulate))
        finally:
            if bed is not None:
                bed.down()
            turn.close()
    with interrupt.deferred():  # written once every scenario ran: an interrupted run leaves none
        for path, text in profiles.items():
            write_atomic(path, text)
    error_table = pd.concat(errors, ignore_index=True)
    collective_table = pd.concat(collectives, ignore_index=True) if collectives else pd.DataFrame(
        columns=COLLECTIVE_COLUMNS)
    in_run_table = pd.concat(in_run, ignore_index=True)
    return ValidationReport(error_table, collective_table,
                            summarise_errors(error_table, collective_table, in_run_table),
                            ranking_agreement(error_table), seed_claim(error_table),
                            pd.concat(regimes, ignore_index=True), in_run_table,
                            pd.concat(terms, ignore_index=True))
