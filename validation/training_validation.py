"""``hetsim validate`` of a training matrix: calibrate each emulated cluster once, measure every
training case on it, simulate each case with its own cluster's profile (replay) and with every
other cluster's (prediction), and report how far the simulator is.

A training matrix file (``validation/training.yaml`` is the full one)::

    kind: training
    name: training_matrix
    testbed: true                 # each cluster's emulated hosts (root, iproute2)
    repeats: 3                    # timed repeats of workload.steps steps per case
    warmup: 1
    calibration_repeats: 3
    max_call_s: 1.0               # the calibration's collective sweep stops growing past this (s)
    clusters:                     # scenarios whose cluster (and name, the testbed's) is used
      - ../scenarios/validation/v2x2_bandwidth.yaml
    model: ../scenarios/validation/models/tiny_gpt2.json
    workload: {kind: training, global_batch_size: 16, micro_batch_size: 4, sequence_length: 128}
    training: {optimizer: adamw}  # every case's settings, which the grid and variants override
    grid:                         # every combination is a case
      bucket_cap_mb: [1, 25]
      gradient_accumulation: [1, 4]
      activation_checkpointing: [null, 1]
    variants:                     # cases besides the grid, each overriding ``training``
      - {name: no_overlap, training: {overlap: false}}
    transfer: false               # also predict every cluster from the others pooled and from no profile
    interleave: false             # time the cases one step of each in turn (every case's trainer alive at once)

With ``transfer: true`` the report also holds the calibration-transfer figure as the transfer
issue defines it (:mod:`validation.training_transfer`, written under ``transfer/``): every
cluster predicted from every other cluster's profile alone, from the profiles of all clusters but
it pooled (leave-one-out) and from none, per (source, target) pair.

A case is one variant on one cluster. Per cluster, the calibration
(:func:`runtime.training.calibrate.calibrate_training`: forward and backward per op, the optimizer
step, the buckets' allreduce over the data-parallel group) runs once, then the measurement
(:func:`runtime.training.measure.measure_training`; with ``interleave``, the cases timed one step
of each in turn), each in a launch of its own inside the cluster's testbed, with the share of the machine the hypervisor stole and other processes took
recorded; the measured ops of each case's last repeat (every bucket's allreduce on every rank) are
saved beside them (``clusters/<cluster>/trace.csv``), with what was measured (the model, the
workload and each case's settings, ``cases.json``). A cluster already calibrated and measured
under the output directory (its ``load.json``, written last, is there) is not run again, so a run
stopped between clusters resumes at the next one (a matrix can be run over several sessions, each
holding the testbed for one cluster's time; a cluster stopped inside is run again from its
calibration); a saved cluster measured for other cases (another matrix's) is refused, naming it,
before any rank starts.

Errors are signed, ``simulated / measured - 1``, per case, metric and ``calibrated_on`` (the
cluster whose profile priced it: the case's own cluster is a replay of its calibration, another
one a prediction; with ``transfer``, also :data:`validation.transfer.POOLED` and
:data:`validation.transfer.NO_PROFILE`). The report gives, per mode (:data:`MODES`), the median
and p90 |error| of the step time, peak memory error, whether the simulator orders each pair of
cases of a cluster as the measurement does where the measured step times differ by more than
10%, and the overlap gain (step time without overlap over with, the case and its partner equal
in every other setting) measured and simulated.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from models.errors import ConfigError
from models.input_files import load_yaml
from sim.profile import Profile, load_profile
from sim.scenario import Scenario, load_scenario, scenario_from_dict
from sim.training.simulate import MEMORY_CATEGORIES
from sim.training_config import TrainingSettings
from sim.vocabulary import Metric
from validation.limits import MAX_REPEATS, MAX_TIMED_S
from validation.matrix import read_matrix_file
from validation.transfer import PAIR_KINDS, kind_of_pair, transfer_sources

RANKING_THRESHOLD = 0.10
CHECKED_METRICS = (Metric.STEP_TIME, Metric.FORWARD_TIME, Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME,
                   Metric.EXPOSED_COMMUNICATION, Metric.PEAK_MEMORY, *MEMORY_CATEGORIES)
"""What errors.csv compares; the targets are on the step time and peak memory, the phases and
the memory categories (measured beside the peak, :mod:`runtime.training.memory`) say where an
error comes from."""
ERROR_COLUMNS = ["case", "cluster", "metric", "device", "measured", "simulated", "error", "calibrated_on", "replay"]
RANKING_COLUMNS = ["cluster", "calibrated_on", "replay", "faster", "slower", "measured_ratio", "simulated_ratio",
                   "right"]
OVERLAP_COLUMNS = ["cluster", "calibrated_on", "replay", "case", "partner", "measured_gain", "simulated_gain",
                   "difference_points"]
MODES = dict(zip(PAIR_KINDS, ("replay", "prediction", "prediction (pooled)", "uncalibrated"), strict=True))
"""The summary's mode per kind of (profile, cluster) pair (:func:`validation.transfer.kind_of_pair`):
a replay of the cluster's own calibration, a prediction from another cluster's, from all other
clusters' pooled, or from no profile (the uncalibrated models)."""
_SHORT = {"bucket_cap_mb": "bucket", "gradient_accumulation": "acc", "activation_checkpointing": "ckpt"}


class TrainingMatrix(BaseModel):
    """A validated training matrix file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["training"]
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    testbed: bool = True
    repeats: int = Field(default=3, gt=0, le=MAX_REPEATS)
    warmup: int = Field(default=1, ge=0, le=MAX_REPEATS)
    calibration_repeats: int = Field(default=3, gt=0, le=MAX_REPEATS)
    max_call_s: float = Field(default=1.0, gt=0, le=MAX_TIMED_S, allow_inf_nan=False)
    clusters: list[str] = Field(min_length=1)
    model: str = Field(min_length=1)
    workload: dict
    training: dict = {}
    grid: dict[str, list] = {}
    variants: list[dict] = []
    transfer: bool = False
    interleave: bool = False


def is_training_matrix(path: str | Path) -> bool:
    """Whether the matrix file at ``path`` is a training matrix (``kind: training``)."""
    data = load_yaml(Path(path), "matrix")
    return isinstance(data, dict) and data.get("kind") == "training"


def grid_variants(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid's training fields as a variant, named for its values
    (``bucket1_acc4_ckptoff``)."""
    variants = []
    for values in itertools.product(*grid.values()):
        name = "_".join(f"{_SHORT.get(field, field)}{'off' if value is None else value}"
                        for field, value in zip(grid, values))
        variants.append({"name": name, "training": dict(zip(grid, values))})
    return variants


def load_training_matrix(path: str | Path) -> tuple[TrainingMatrix, list[Scenario]]:
    """Read a training matrix and build its scenario per cluster: the cluster scenario's name and
    cluster, the matrix's model, workload, training settings and cases.

    Raises:
        ConfigError: missing or malformed file, unknown field, a cluster scenario that does not
            load, a case the scenario schema refuses (naming its field).
    """
    path = Path(path)
    matrix = read_matrix_file(path, TrainingMatrix)
    variants = grid_variants(matrix.grid) + list(matrix.variants)
    if not variants:
        raise ConfigError("matrix.grid", "no case: give a grid or variants (got neither)")
    scenarios = []
    for name in matrix.clusters:
        cluster = load_scenario(path.parent / name)
        data = {"name": cluster.name, "description": f"training matrix {matrix.name} on {cluster.name}",
                "model": matrix.model, "cluster": cluster.config.model_dump(mode="json", by_alias=True,
                                                                            exclude_none=True)["cluster"],
                "workload": matrix.workload, "training": matrix.training,
                "network_model": cluster.config.network_model, "variants": variants}
        scenarios.append(scenario_from_dict(data, base_dir=path.parent, source_path=cluster.source_path))
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ConfigError("matrix.clusters", f"cluster names must be unique (got {names})")
    return matrix, scenarios


@dataclass(frozen=True)
class ClusterRun:
    """One cluster's calibration and measurement: the profile, the measured results (tidy rows),
    the machine's load while each ran (shares of all CPU time) and the measured ops of each
    case's last repeat on every rank (``trace``: the trace's ops table with a ``variant``
    column; each bucket's allreduce apart, which the results fold into the step's phases; None
    for a run saved without it) and what was measured (``cases``: :func:`measured_cases`; None
    for a run saved without it)."""

    name: str
    profile: Profile
    measured: pd.DataFrame
    load: dict[str, float]
    trace: pd.DataFrame | None = None
    cases: dict | None = None


def measured_cases(scenario: Scenario) -> dict:
    """What a cluster's measurement measured, as JSON values: the model, the workload and every
    case's training settings by name (saved beside it, so that a run resumed into a directory
    never mixes another matrix's measurements with this one's)."""
    config = scenario.config
    return json.loads(json.dumps({
        "model": scenario.model.name, "workload": config.workload.model_dump(mode="json"),
        "cases": {v.name: scenario.training_settings(v).model_dump(mode="json") for v in config.variants}}))


def check_saved_cases(run: ClusterRun, scenario: Scenario, report_dir: Path) -> None:
    """Refuse a saved cluster measured for other cases than ``scenario``'s (:func:`measured_cases`;
    a run saved before they were kept: its measured case names).

    Raises:
        ConfigError: naming the cluster's directory and the cases that differ.
    """
    expected = measured_cases(scenario)
    if run.cases is not None:
        saved = run.cases
        # A settings field added since the run was saved, at its default, is what the run trained with.
        defaults = TrainingSettings().model_dump(mode="json")
        saved_cases = {name: defaults | case for name, case in saved["cases"].items()}
        if saved["model"] != expected["model"] or saved["workload"] != expected["workload"]:
            differing = ["the model or workload"]
        else:
            differing = sorted(name for name in set(saved_cases) | set(expected["cases"])
                               if saved_cases.get(name) != expected["cases"].get(name))
    else:
        differing = sorted(set(run.measured["variant"]) ^ set(expected["cases"]))
    if differing:
        raise ConfigError("report", f"cluster {run.name} saved under {report_dir / 'clusters' / run.name} was measured "
                                    f"for other cases than the matrix's ({', '.join(differing)}); give --out another "
                                    f"directory or remove that one")


@dataclass(frozen=True)
class TrainingValidationReport:
    """The tables of a training validation (see the module docstring)."""

    errors: pd.DataFrame
    ranking: pd.DataFrame
    overlap: pd.DataFrame
    summary: pd.DataFrame
    load: pd.DataFrame


def _or_nan(share: float | None) -> float:
    """A recorded share, NaN where the machine's load could not be read."""
    return float("nan") if share is None else share


def run_cluster(matrix: TrainingMatrix, scenario: Scenario, on_progress: Callable[[str], None]) -> ClusterRun:
    """Calibrate and measure one cluster (inside its testbed if the matrix says so; the testbed
    goes down whatever happens), holding the testbed lock where ``HETSIM_TESTBED_LOCK`` names one
    (:func:`validation.validate.testbed_turn`: runs sharing the machine take turns by cluster)."""
    from runtime.cpu_steal import load_during
    from runtime.training.calibrate import calibrate_training
    from runtime.training.measure import measure_training
    from sim.context import profile_contexts
    from sim.topology import build_topology
    from validation.validate import testbed_turn

    with testbed_turn():  # the whole cluster: its testbed, calibration and measurement
        bed = None
        if matrix.testbed:
            from runtime.testbed import Testbed, require_privileges

            require_privileges()
            bed = Testbed(scenario.name, build_topology(scenario.config.cluster))
            bed.down()  # a previous crash may have left it behind
            bed.up(owned=True)
        try:
            on_progress(f"{scenario.name}: calibrating")
            beat = lambda rank, label: on_progress(f"{scenario.name}: calibrating: {label}") if rank == 0 else None
            profile = calibrate_training(scenario, testbed=matrix.testbed, repeats=matrix.calibration_repeats,
                                         max_call_s=matrix.max_call_s, on_beat=beat)
            on_progress(f"{scenario.name}: measuring {len(scenario.config.variants)} cases")
            measured, spent = load_during(lambda: measure_training(
                scenario, repeats=matrix.repeats, warmup=matrix.warmup, testbed=matrix.testbed,
                interleave=matrix.interleave))
        finally:
            if bed is not None:
                bed.down()
    trace = pd.concat([v.trace.ops.assign(variant=v.name) for v in measured.variants], ignore_index=True)
    calibrated = profile_contexts(profile)[0]  # calibrate_training records the load its launch ran under
    return ClusterRun(scenario.name, Profile(profile), measured.results,
                      {"cpu_steal": spent.steal_fraction, "other_load": spent.other_load,
                       "calibration_cpu_steal": _or_nan(calibrated.cpu_steal),
                       "calibration_other_load": _or_nan(calibrated.other_load)}, trace, measured_cases(scenario))


def _cluster_files(out_dir: Path, name: str) -> dict[str, Path]:
    base = out_dir / "clusters" / name
    return {"profile": base / "profile.csv", "measured": base / "measured.csv", "load": base / "load.json",
            "trace": base / "trace.csv", "cases": base / "cases.json"}


def _load_cluster(out_dir: Path, scenario: Scenario) -> ClusterRun | None:
    """The cluster of ``scenario`` saved under ``out_dir`` (None where it is not, or only in
    part: a run interrupted inside it); refused where measured for other cases
    (:func:`check_saved_cases`)."""
    files = _cluster_files(out_dir, scenario.name)
    if not all(files[key].is_file() for key in ("profile", "measured", "load")):
        return None
    trace = pd.read_csv(files["trace"]) if files["trace"].is_file() else None
    cases = json.loads(files["cases"].read_text()) if files["cases"].is_file() else None
    run = ClusterRun(scenario.name, load_profile(files["profile"]), pd.read_csv(files["measured"]),
                     json.loads(files["load"].read_text()), trace, cases)
    check_saved_cases(run, scenario, out_dir)
    return run


def _save_cluster(out_dir: Path, run: ClusterRun) -> None:
    from runtime import interrupt
    from sim.outputs import write_atomic

    files = _cluster_files(out_dir, run.name)
    with interrupt.deferred():  # the load file last: a cluster counts as run once it is there
        write_atomic(files["profile"], run.profile.rows.to_csv(index=False, lineterminator="\n"))
        write_atomic(files["measured"], run.measured.to_csv(index=False, lineterminator="\n"))
        if run.trace is not None:
            write_atomic(files["trace"], run.trace.to_csv(index=False, lineterminator="\n"))
        if run.cases is not None:
            write_atomic(files["cases"], json.dumps(run.cases, indent=1, sort_keys=True) + "\n")
        write_atomic(files["load"], json.dumps(run.load, indent=1) + "\n")


def case_errors(cluster: str, calibrated_on: str, simulated: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Signed errors of every case of ``cluster`` simulated with ``calibrated_on``'s profile,
    per :data:`CHECKED_METRICS` (peak memory per device)."""
    keys = ["variant", "metric", "device"]

    def values(frame):
        frame = frame[frame["metric"].isin([str(m) for m in CHECKED_METRICS])].copy()
        frame["device"] = frame["device"].fillna("")
        return frame.set_index(keys)["value"]

    joined = pd.concat({"measured": values(measured), "simulated": values(simulated)}, axis=1).dropna().reset_index()
    joined["error"] = joined["simulated"] / joined["measured"] - 1
    joined.loc[joined["measured"] == 0, "error"] = np.nan
    joined = joined.rename(columns={"variant": "case"}).assign(cluster=cluster, calibrated_on=calibrated_on,
                                                               replay=cluster == calibrated_on)
    return joined[ERROR_COLUMNS]


def ranking(errors: pd.DataFrame) -> pd.DataFrame:
    """Per cluster and profile, every pair of cases whose measured step times differ by more than
    :data:`RANKING_THRESHOLD`, the faster first, and whether the simulation orders them alike."""
    rows = []
    steps = errors[errors["metric"] == str(Metric.STEP_TIME)]
    for (cluster, source), group in steps.groupby(["cluster", "calibrated_on"], sort=True):
        group = group.sort_values("measured")
        for a, b in itertools.combinations(group.itertuples(index=False), 2):
            if b.measured > (1 + RANKING_THRESHOLD) * a.measured:
                rows.append((cluster, source, cluster == source, a.case, b.case, b.measured / a.measured,
                             b.simulated / a.simulated, bool(b.simulated > a.simulated)))
    return pd.DataFrame(rows, columns=RANKING_COLUMNS)


def overlap_gains(scenario: Scenario, errors: pd.DataFrame) -> pd.DataFrame:
    """Per profile, each case without overlap against its partner with overlap (equal in every
    other setting): the step-time ratio without over with, measured and simulated, and their
    difference in percentage points. A case without a partner is left out."""
    settings = {v.name: scenario.training_settings(v) for v in scenario.config.variants}
    pairs = [(name, next((other for other, s in settings.items()
                          if s.overlap and s == own.model_copy(update={"overlap": True})), None))
             for name, own in settings.items() if not own.overlap]
    steps = errors[(errors["metric"] == str(Metric.STEP_TIME)) & (errors["cluster"] == scenario.name)]
    rows = []
    for source, group in steps.groupby("calibrated_on", sort=True):
        group = group.set_index("case")
        for case, partner in pairs:
            if partner is None or case not in group.index or partner not in group.index:
                continue
            measured = group.loc[case, "measured"] / group.loc[partner, "measured"]
            simulated = group.loc[case, "simulated"] / group.loc[partner, "simulated"]
            rows.append((scenario.name, source, scenario.name == source, case, partner, measured, simulated,
                         100 * (simulated - measured)))
    return pd.DataFrame(rows, columns=OVERLAP_COLUMNS)


def _modes(table: pd.DataFrame) -> pd.Series:
    """Each row's mode (:data:`MODES`) from its ``calibrated_on`` and ``cluster``."""
    return pd.Series([MODES[kind_of_pair(source, target)] for source, target
                      in zip(table["calibrated_on"], table["cluster"])], index=table.index, dtype=object)


def summarise(errors: pd.DataFrame, rank: pd.DataFrame, overlap: pd.DataFrame) -> pd.DataFrame:
    """Per mode (:data:`MODES`: replay with the cluster's own profile, prediction with another's,
    and with the transfer figure the others pooled and none): median and p90 |error| per metric,
    pairs ranked right of those compared, and the largest overlap-gain difference."""
    rows = []
    error_modes, rank_modes, overlap_modes = _modes(errors), _modes(rank), _modes(overlap)
    for label in MODES.values():
        of = errors[error_modes == label].dropna(subset=["error"])
        for metric, group in of.groupby("metric", sort=True):
            magnitude = group["error"].abs()
            rows.append((label, metric, len(group), float(magnitude.median()), float(magnitude.quantile(0.9)),
                         float(magnitude.max())))
        pairs = rank[rank_modes == label]
        if len(pairs):
            rows.append((label, "ranking_right", len(pairs), float(pairs["right"].mean()), np.nan, np.nan))
        gains = overlap[overlap_modes == label]
        if len(gains):
            rows.append((label, "overlap_gain_points", len(gains), float(gains["difference_points"].abs().median()),
                         np.nan, float(gains["difference_points"].abs().max())))
    return pd.DataFrame(rows, columns=["mode", "metric", "cases", "median_abs", "p90_abs", "max_abs"])


def validate_training(matrix: TrainingMatrix, scenarios: list[Scenario], out_dir: Path,
                      on_progress: Callable[[str], None] = lambda text: None, *,
                      allow_overcommit: bool = False) -> TrainingValidationReport:
    """Run the training matrix (see the module docstring): each cluster not yet run under
    ``out_dir/clusters`` is calibrated and measured (and saved there), then every cluster's cases
    are simulated with every cluster's profile.

    Raises:
        ConfigError: a case that does not fit in memory, a cluster saved under ``out_dir`` measured
            for other cases (:func:`check_saved_cases`), testbed prerequisites missing.
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    from validation.memory_fit import check_memory_fits

    for scenario in scenarios:  # before any rank starts or any testbed is built
        check_memory_fits(scenario, allow_overcommit=allow_overcommit)
    saved = {scenario.name: _load_cluster(out_dir, scenario) for scenario in scenarios}
    runs = {}
    for scenario in scenarios:
        run = saved[scenario.name]
        if run is None:
            run = run_cluster(matrix, scenario, on_progress)
            _save_cluster(out_dir, run)
        runs[scenario.name] = run
    return compare_clusters(scenarios, runs, on_progress, transfer=matrix.transfer)


def load_report_clusters(scenarios: list[Scenario], report_dir: Path) -> dict[str, ClusterRun]:
    """The saved calibration and measurement of every cluster of ``scenarios`` under
    ``report_dir/clusters`` (what :func:`validate_training` wrote), by cluster name.

    Raises:
        ConfigError: a cluster of the matrix without its saved files (naming the directory), or
            measured for other cases (:func:`check_saved_cases`).
    """
    runs = {}
    for scenario in scenarios:
        run = _load_cluster(report_dir, scenario)
        if run is None:
            raise ConfigError("report", f"no saved calibration and measurement of cluster {scenario.name} "
                                        f"(got {report_dir / 'clusters' / scenario.name})")
        runs[scenario.name] = run
    return runs


def compare_clusters(scenarios: list[Scenario], runs: dict[str, ClusterRun],
                     on_progress: Callable[[str], None] = lambda text: None, *,
                     transfer: bool = False) -> TrainingValidationReport:
    """Every cluster's cases simulated with every cluster's profile (``runs``, by cluster name)
    against its measurement: the report's tables, no testbed (what :func:`validate_training` does
    once every cluster has run; an offline re-simulation of a saved report,
    ``benchmarks/bench_training_offline.py``). With ``transfer``, also with the profiles of every
    cluster but it pooled and with none (:func:`validation.transfer.transfer_sources`, the
    inference transfer's sources).

    Raises:
        ConfigError: a case the simulator refuses, naming its field.
    """
    from sim.training.simulate import simulate_training

    errors = []
    profiles = {name: run.profile for name, run in runs.items()}
    for scenario in scenarios:
        for source, profile in transfer_sources(scenario.name, profiles, pooled=transfer, none=transfer):
            on_progress(f"simulating {scenario.name} with {source}'s profile")
            simulated = simulate_training(scenario, profile)
            errors.append(case_errors(scenario.name, source, simulated.results, runs[scenario.name].measured))
    error_table = pd.concat(errors, ignore_index=True)
    overlap_table = pd.concat([overlap_gains(s, error_table) for s in scenarios], ignore_index=True)
    rank = ranking(error_table)
    load = pd.DataFrame([{"cluster": name, **run.load} for name, run in runs.items()])
    return TrainingValidationReport(error_table, rank, overlap_table, summarise(error_table, rank, overlap_table),
                                    load)


def summary_markdown(report: TrainingValidationReport, name: str) -> str:
    """summary.md: the figures against the issue's targets, per mode (:data:`MODES`)."""
    transfer = set(report.summary["mode"]) - {MODES["same"], MODES["other"]}
    lines = [f"# Training validation: {name}", "",
             "Errors are simulated / measured - 1. *replay*: a cluster's cases simulated with its own "
             "calibration; *prediction*: with another cluster's (not calibrated on it)"
             + ("; *prediction (pooled)*: with the calibrations of every cluster but it together; *uncalibrated*: "
                "with no profile. The transfer figure per (source, target) pair is in `transfer/`." if transfer
                else "."), "",
             "| mode | metric | cases | median abs | p90 abs | max abs |", "|---|---|---|---|---|---|"]
    for row in report.summary.itertuples(index=False):
        if row.metric == "ranking_right":
            lines.append(f"| {row.mode} | pairs > 10% apart ranked right | {row.cases} | {row.median_abs:.0%} | | |")
        elif row.metric == "overlap_gain_points":
            lines.append(f"| {row.mode} | overlap gain difference (points) | {row.cases} | {row.median_abs:.1f} | | "
                         f"{row.max_abs:.1f} |")
        else:
            lines.append(f"| {row.mode} | {row.metric} | {row.cases} | {row.median_abs:.1%} | {row.p90_abs:.1%} | "
                         f"{row.max_abs:.1%} |")
    lines += ["", "Targets (issue 19 item 5): step time median |error| <= 5% and p90 <= 10%; peak memory within "
              "5%; every pair > 10% apart ranked right; overlap gain within 5 points.", "",
              "Machine load while each cluster ran (shares of all CPU time):", "",
              "| cluster | steal (measuring) | other load (measuring) | steal (calibrating) | other load (calibrating) |",
              "|---|---|---|---|---|"]
    for row in report.load.itertuples(index=False):
        lines.append(f"| {row.cluster} | {row.cpu_steal:.1%} | {row.other_load:.1%} | {row.calibration_cpu_steal:.1%} "
                     f"| {row.calibration_other_load:.1%} |")
    gains = report.overlap
    if len(gains):
        lines += ["", "Overlap gain (step time without overlap over with):", "",
                  "| cluster | profile of | case | measured | simulated | difference (points) |", "|---|---|---|---|---|---|"]
        for row in gains.itertuples(index=False):
            lines.append(f"| {row.cluster} | {row.calibrated_on} | {row.case} | {row.measured_gain:.3f} | "
                         f"{row.simulated_gain:.3f} | {row.difference_points:+.1f} |")
    return "\n".join(lines) + "\n"


def write_training_validation(report: TrainingValidationReport, out_dir: Path, name: str,
                              transfer_command: str | None = None) -> list[Path]:
    """errors.csv, ranking.csv, overlap.csv, summary.csv, load.csv and summary.md under ``out_dir``;
    with ``transfer_command`` (the command that regenerates them, for a report made with the
    transfer's sources: :func:`compare_clusters` with ``transfer``), the transfer figure under
    ``out_dir/transfer`` too (:func:`validation.training_transfer.write_training_transfer`)."""
    from sim.outputs import write_files
    from validation.training_transfer import write_training_transfer

    tables = {"errors.csv": report.errors, "ranking.csv": report.ranking, "overlap.csv": report.overlap,
              "summary.csv": report.summary, "load.csv": report.load}
    files = {name_: table.to_csv(index=False, lineterminator="\n") for name_, table in tables.items()}
    files["summary.md"] = summary_markdown(report, name)
    written = write_files(out_dir, files)
    if transfer_command is not None:
        written += write_training_transfer(report.errors, report.ranking, out_dir / "transfer", name, transfer_command)
    return written
