"""Offline transfer evaluation: predict one cluster with another cluster's calibration profile.

Everything comes from shipped validation reports (``hetsim validate``'s output directories): each
report holds every cluster's profile (``profiles/<cluster>.csv``) and the measured medians of its
cases (``errors.csv``: scenario, prompt_tokens, variant, metric, measured). For every ordered pair
(source profile, target cluster) the target's scenario is simulated at every prompt length its
report measured, as ``hetsim validate`` builds each case (:func:`validation.matrix.with_prompt`),
and compared with the target's measured TTFT and TPOT. Three more sources per target:

* ``none``: no profile (the uncalibrated models);
* ``pooled``: the profiles of every cluster but the target, concatenated (leave-one-out);
* the target's own profile (the diagonal): the same-cluster figure, which must match the shipped
  report's.

No testbed is involved: it is a pure re-simulation. Errors are signed, ``simulated / measured - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sim.profile import Profile, load_profile
from sim.transport import Transport
from sim.vocabulary import Metric
from sim.scenario import Scenario
from validation.matrix import load_matrix, with_prompt

REPO_ROOT = Path(__file__).resolve().parent.parent
# The shipped reports and the matrices that produced them.
SHIPPED = ((REPO_ROOT / "validation" / "matrix.yaml", REPO_ROOT / "validation" / "report"),
           (REPO_ROOT / "validation" / "holdout.yaml", REPO_ROOT / "validation" / "holdout-report"))
TRANSFER_METRICS = (Metric.TTFT, Metric.TPOT)
NO_PROFILE = "none"
POOLED = "pooled"
ERROR_COLUMNS = ["source", "target", "prompt_tokens", "variant", "metric", "simulated", "measured", "error"]
OVERALL_COLUMNS = ["scope", "pairs", "metric", "cases", "median_abs_error", "p90_abs_error", "median_signed_error"]
SUMMARY_COLUMNS = ["source", "target", "metric", "cases", "median_abs_error", "p90_abs_error",
                   "median_signed_error"]


@dataclass(frozen=True)
class Cluster:
    """One calibrated and measured cluster of a shipped report.

    Attributes:
        scenario: its scenario (the variants and the cluster).
        profile: its calibration profile.
        measured: its measured cases: prompt_tokens, variant, metric, measured (s), TTFT and TPOT only.
    """

    scenario: Scenario
    profile: Profile
    measured: pd.DataFrame

    @property
    def name(self) -> str:
        return self.scenario.name


def matrix_cluster_names(matrix_path: Path = SHIPPED[0][0]) -> list[str]:
    """The names of the clusters of a matrix file (default: the shipped matrix)."""
    return [scenario.name for scenario in load_matrix(matrix_path)[1]]


def shipped_clusters(reports: Sequence[tuple[Path, Path]] = SHIPPED) -> list[Cluster]:
    """The clusters of the shipped reports, in matrix order.

    Args:
        reports: (matrix file, report directory) pairs.

    Raises:
        ConfigError: a matrix, scenario or profile that does not load.
    """
    clusters = []
    for matrix_path, report_dir in reports:
        _, scenarios = load_matrix(matrix_path)
        errors = pd.read_csv(report_dir / "errors.csv")
        for scenario in scenarios:
            measured = errors[(errors["scenario"] == scenario.name) & errors["metric"].isin(TRANSFER_METRICS)]
            clusters.append(Cluster(scenario, load_profile(report_dir / "profiles" / f"{scenario.name}.csv"),
                                    measured[["prompt_tokens", "variant", "metric", "measured"]]
                                    .reset_index(drop=True)))
    return clusters


def pooled_profile(profiles: Sequence[Profile]) -> Profile:
    """One profile holding the rows of several (leave-one-out calibration)."""
    return Profile(pd.concat([p.rows for p in profiles], ignore_index=True))


def transfer_errors(clusters: Sequence[Cluster], *, pooled: bool = True,
                    simulate_case: Callable | None = None,
                    on_progress: Callable[[str], None] = lambda text: None) -> pd.DataFrame:
    """Every (source, target) case's error; columns :data:`ERROR_COLUMNS`.

    Sources: each cluster's profile, :data:`NO_PROFILE` and (``pooled``) :data:`POOLED`, the
    profiles of all clusters but the target.

    Args:
        simulate_case: ``(scenario, profile or None) -> SimulationResult``; default
            :func:`sim.simulate.simulate`.
    """
    if simulate_case is None:
        from sim.simulate import simulate

        simulate_case = lambda scenario, profile: simulate(scenario, profile=profile)  # noqa: E731
    rows = []
    for target in clusters:
        sources: list[tuple[str, Profile | None]] = [(c.name, c.profile) for c in clusters]
        sources.append((NO_PROFILE, None))
        if pooled:
            sources.append((POOLED, pooled_profile([c.profile for c in clusters if c.name != target.name])))
        for prompt, measured in target.measured.groupby("prompt_tokens", sort=True):
            case = with_prompt(target.scenario, int(prompt))
            for source, profile in sources:
                on_progress(f"{target.name} at prompt {prompt} with {source}")
                results = simulate_case(case, profile).results
                simulated = results[results["device"].isna() | (results["device"] == "")] \
                    .set_index(["variant", "metric"])["value"]
                for row in measured.itertuples(index=False):
                    value = float(simulated[(row.variant, row.metric)])
                    rows.append({"source": source, "target": target.name, "prompt_tokens": int(prompt),
                                 "variant": row.variant, "metric": row.metric, "simulated": value,
                                 "measured": float(row.measured), "error": value / float(row.measured) - 1})
    return pd.DataFrame(rows, columns=ERROR_COLUMNS)


def _stats(errors: pd.Series) -> dict:
    absolute = np.abs(errors.to_numpy(dtype=float))
    return {"cases": len(absolute), "median_abs_error": float(np.median(absolute)),
            "p90_abs_error": float(np.percentile(absolute, 90)), "median_signed_error": float(errors.median())}


def transfer_table(errors: pd.DataFrame) -> pd.DataFrame:
    """``transfer.csv``: per (source, target, metric), the cases and their median and p90 |error|
    and median signed error; rows sorted, so the file is deterministic."""
    rows = [{"source": source, "target": target, "metric": metric, **_stats(group["error"])}
            for (source, target, metric), group in errors.groupby(["source", "target", "metric"], sort=True)]
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def kind_of_pair(source: str, target: str) -> str:
    """``same`` (the diagonal), ``none``, ``pooled`` or ``other`` (true transfer)."""
    if source == target:
        return "same"
    return source if source in (NO_PROFILE, POOLED) else "other"


def overall_table(errors: pd.DataFrame, matrix_clusters: Sequence[str] = ()) -> pd.DataFrame:
    """Per kind of pair (:func:`kind_of_pair`) and metric (TTFT, TPOT, both): cases, median and
    p90 |error|, median signed error; over every cluster (``scope`` all) and, where
    ``matrix_clusters`` names some, over the pairs among them alone (``scope`` matrix)."""
    kinds = errors.assign(kind=[kind_of_pair(s, t) for s, t in zip(errors["source"], errors["target"])])
    scopes = [("all", kinds)]
    if matrix_clusters:
        among = kinds["target"].isin(matrix_clusters) & (kinds["source"].isin(matrix_clusters)
                                                          | kinds["kind"].isin((NO_PROFILE, POOLED)))
        scopes.append(("matrix", kinds[among]))
    rows = []
    for scope, table in scopes:
        for kind in ("same", "other", POOLED, NO_PROFILE):
            of_kind = table[table["kind"] == kind]
            if of_kind.empty:
                continue
            for metric in (*TRANSFER_METRICS, "both"):
                chosen = of_kind if metric == "both" else of_kind[of_kind["metric"] == metric]
                rows.append({"scope": scope, "pairs": kind, "metric": metric, **_stats(chosen["error"])})
    return pd.DataFrame(rows, columns=OVERALL_COLUMNS)


def ranking_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Per kind of pair (:func:`kind_of_pair`): of the variant pairs of a target whose measured
    TTFT or TPOT differ by more than 10%, how many the source's prediction orders as measured
    (:func:`validation.validate.ranking_agreement`, per source and target)."""
    from validation.validate import ranking_agreement

    rows = []
    for (source, target), group in errors.groupby(["source", "target"], sort=True):
        ranked = ranking_agreement(group.rename(columns={"target": "scenario"}))
        rows.append({"pairs": kind_of_pair(source, target), "source": source, "target": target,
                     "compared": len(ranked), "agreeing": int(ranked["simulator_agrees"].sum())})
    table = pd.DataFrame(rows, columns=["pairs", "source", "target", "compared", "agreeing"])
    return table.groupby("pairs", sort=True)[["compared", "agreeing"]].sum().reset_index()


def matrix_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Target x source: median |error| over the target's TTFT and TPOT cases."""
    table = errors.assign(abs_error=errors["error"].abs()).pivot_table(
        index="target", columns="source", values="abs_error", aggfunc="median")
    order = [c for c in dict.fromkeys(errors["target"]) if c in table.columns]
    extra = [c for c in (POOLED, NO_PROFILE) if c in table.columns]
    return table.reindex(index=list(dict.fromkeys(errors["target"])), columns=order + extra)


def summary_markdown(errors: pd.DataFrame, command: str, matrix_clusters: Sequence[str] = ()) -> str:
    """The report's summary: how it was made, the overall figures and the source x target table."""
    lines = ["# Calibration transfer", "",
             f"Regenerate: `{command}` (re-simulation of the reports' profiles against their measured "
             "medians).", "",
             "Signed error = simulated / measured - 1, TTFT and TPOT of every variant at every measured prompt "
             "length. Pairs: `same` = a cluster with its own profile (same-cluster mode); `other` = another "
             "cluster's profile (true transfer); `pooled` = the profiles of all clusters but the target; "
             f"`none` = no profile. Scope `all`: the {errors['target'].nunique()} clusters; `matrix`: the "
             f"{len(matrix_clusters)} clusters of `validation/matrix.yaml` among themselves (the issue's 240 "
             "off-diagonal cases).", "",
             "| scope | pairs | metric | cases | median abs error | p90 abs error | median signed error |",
             "|---|---|---|---|---|---|---|"]
    for row in overall_table(errors, matrix_clusters).itertuples(index=False):
        lines.append(f"| {row.scope} | {row.pairs} | {row.metric} | {row.cases} | {row.median_abs_error:.1%} | "
                     f"{row.p90_abs_error:.1%} | {row.median_signed_error:+.1%} |")
    lines += ["", "Strategy ranking: of the variant pairs of a target whose measured TTFT or TPOT differ by more "
              "than 10%, those the prediction orders as measured:", ""]
    lines += [f"- {row.pairs}: {row.agreeing} of {row.compared}" for row in ranking_table(errors).itertuples()]
    table = matrix_table(errors)
    lines += ["", "Median |error| (TTFT and TPOT) per target (rows) and source profile (columns):", "",
              "| target | " + " | ".join(table.columns) + " |", "|---" * (len(table.columns) + 1) + "|"]
    for target, values in table.iterrows():
        lines.append(f"| {target} | " + " | ".join("" if np.isnan(v) else f"{v:.1%}" for v in values) + " |")
    return "\n".join(lines) + "\n"


def write_transfer_report(errors: pd.DataFrame, out_dir: Path, command: str,
                          matrix_clusters: Sequence[str] = ()) -> list[Path]:
    """Write ``errors.csv`` (every case), ``transfer.csv`` (per pair and metric), ``overall.csv``
    and ``summary.md`` under ``out_dir``; returns the paths."""
    from sim.outputs import write_files

    return write_files(out_dir, {
        "errors.csv": errors.to_csv(index=False, lineterminator="\n"),
        "transfer.csv": transfer_table(errors).to_csv(index=False, lineterminator="\n"),
        "overall.csv": overall_table(errors, matrix_clusters).to_csv(index=False, lineterminator="\n"),
        "summary.md": summary_markdown(errors, command, matrix_clusters),
    })


# What the shipped reports were measured on (their summary.md): the project's 2-core virtual
# machine, gloo over TCP in the emulated hosts, torch 2.13.0.
SHIPPED_CORES = 2
SHIPPED_BACKEND = Transport.GLOO_TCP.value
SHIPPED_TORCH = "2.13.0"


def add_context(profile_path: Path, scenario: Scenario, *, cores: int | None, backend: str | None,
                torch_version: str | None) -> None:
    """Rewrite a profile file with ``context`` rows derived from the scenario it was calibrated
    on (replacing any it had), so that it says what it was measured on (:mod:`sim.context`).

    Raises:
        ConfigError: the profile does not load.
    """
    from sim.context import context_rows, scenario_context
    from sim.outputs import write_atomic
    from sim.profile import profile_frame
    from sim.vocabulary import MeasurementKind
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology

    load_profile(profile_path)  # checks it
    topology = build_topology(scenario.config.cluster)
    context = scenario_context(scenario.name, topology, ParallelPlan.of(scenario, topology).tensor_ranks,
                               scenario.model.dtype, cores=cores, backend=backend, torch_version=torch_version)
    # The measured rows stay byte for byte as calibration wrote them; the context rows go where
    # profile_frame's order puts them (after the compute rows).
    header, *lines = [line for line in profile_path.read_text().splitlines()
                      if line.split(",")[1:2] != [MeasurementKind.CONTEXT]]
    kinds = [line.split(",")[1] for line in lines]
    at = sum(kind <= MeasurementKind.CONTEXT for kind in kinds)
    added = profile_frame(context_rows(context)).to_csv(index=False, header=False, lineterminator="\n").splitlines()
    write_atomic(profile_path, "\n".join([header, *lines[:at], *added, *lines[at:]]) + "\n")


def add_shipped_context(reports: Sequence[tuple[Path, Path]] = SHIPPED) -> list[Path]:
    """:func:`add_context` on every profile of the shipped reports; returns the paths."""
    written = []
    for matrix_path, report_dir in reports:
        for scenario in load_matrix(matrix_path)[1]:
            path = report_dir / "profiles" / f"{scenario.name}.csv"
            add_context(path, scenario, cores=SHIPPED_CORES, backend=SHIPPED_BACKEND, torch_version=SHIPPED_TORCH)
            written.append(path)
    return written
