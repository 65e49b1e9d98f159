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

Every case off by more than :data:`TERM_THRESHOLD` is given the term behind it
(:func:`validation.terms.term_behind`): the simulated run's split of the metric
(:func:`validation.terms.metric_terms`) against the target's measured split, its report's
``terms.csv`` (the named terms' measured seconds; ``other`` the rest of the measured median, so
that the terms add up to the error).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sim.profile import Profile, load_profile
from sim.transport import Transport
from sim.vocabulary import Metric
from sim.scenario import Scenario
from validation.matrix import load_matrix, with_prompt
from validation.terms import PHASE_METRIC, metric_terms, phase_metrics, profile_gap_s, term_behind

REPO_ROOT = Path(__file__).resolve().parent.parent
# The shipped reports and the matrices that produced them.
SHIPPED = ((REPO_ROOT / "validation" / "matrix.yaml", REPO_ROOT / "validation" / "report"),
           (REPO_ROOT / "validation" / "holdout.yaml", REPO_ROOT / "validation" / "holdout-report"),
           # quiet re-measurements; each replaces the cluster of the same name above (see the file)
           (REPO_ROOT / "validation" / "remeasure.yaml", REPO_ROOT / "validation" / "remeasure-report"))
TRANSFER_METRICS = (Metric.TTFT, Metric.TPOT)
NO_PROFILE = "none"
POOLED = "pooled"
ERROR_COLUMNS = ["source", "target", "prompt_tokens", "variant", "metric", "simulated", "measured", "error", "term",
                 "term_contribution"]
TERM_THRESHOLD = 0.10  # |error| above which a case is given the term behind it
# errors.csv's columns on the machine's CPU time others took (runtime.cpu_steal), and what they say
MACHINE_LOAD = {"cpu_steal": "stolen by the hypervisor while measured",
                "calibration_cpu_steal": "stolen while calibrated",
                "other_load": "taken by other processes while measured",
                "calibration_other_load": "taken by other processes while calibrated"}
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
        terms: its measured term split (:data:`validation.terms.TERM_COLUMNS`, the report's
            ``terms.csv``), None where the report has none.
        machine: the share of the machine's CPU time others took while it was measured and
            calibrated (:data:`MACHINE_LOAD`: the hypervisor, other processes), those its
            report's ``errors.csv`` records.
    """

    scenario: Scenario
    profile: Profile
    measured: pd.DataFrame
    terms: pd.DataFrame | None = None
    machine: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.scenario.name


def matrix_cluster_names(matrix_path: Path = SHIPPED[0][0]) -> list[str]:
    """The names of the clusters of a matrix file (default: the shipped matrix)."""
    return [scenario.name for scenario in load_matrix(matrix_path)[1]]


def shipped_clusters(reports: Sequence[tuple[Path, Path]] = SHIPPED) -> list[Cluster]:
    """The clusters of the shipped reports, in matrix order.

    A later report's cluster replaces an earlier one of the same name, in its place: a cluster
    re-measured (``validation/remeasure.yaml``: on a quiet machine, where its first measurement ran
    under other load) is used as re-measured, its calibration and its measured medians together.

    Args:
        reports: (matrix file, report directory) pairs.

    Raises:
        ConfigError: a matrix, scenario or profile that does not load.
    """
    clusters: dict[str, Cluster] = {}
    for matrix_path, report_dir in reports:
        _, scenarios = load_matrix(matrix_path)
        errors = pd.read_csv(report_dir / "errors.csv")
        for scenario in scenarios:
            measured = errors[(errors["scenario"] == scenario.name) & errors["metric"].isin(TRANSFER_METRICS)]
            terms = None
            if (report_dir / "terms.csv").exists():
                terms = pd.read_csv(report_dir / "terms.csv")
                terms = terms[terms["scenario"] == scenario.name].reset_index(drop=True)
            of_scenario = errors[errors["scenario"] == scenario.name]
            machine = {column: float(of_scenario[column].iloc[0]) for column in MACHINE_LOAD
                       if column in of_scenario and len(of_scenario) and pd.notna(of_scenario[column].iloc[0])}
            clusters[scenario.name] = Cluster(scenario, load_profile(report_dir / "profiles" / f"{scenario.name}.csv"),
                                              measured[["prompt_tokens", "variant", "metric", "measured"]]
                                              .reset_index(drop=True), terms, machine)
    return list(clusters.values())


def pooled_profile(profiles: Sequence[Profile]) -> Profile:
    """One profile holding the rows of several (leave-one-out calibration)."""
    return Profile(pd.concat([p.rows for p in profiles], ignore_index=True))


def transfer_sources(target: str, profiles: Mapping[str, Profile], *, pooled: bool = True,
                     none: bool = True) -> list[tuple[str, Profile | None]]:
    """The profiles a ``target`` cluster is predicted from, by source name: every cluster's own
    (``profiles``, by cluster name, in their order; the target's is the diagonal), then
    (``none``) :data:`NO_PROFILE` and (``pooled``) :data:`POOLED`, the profiles of every cluster
    but the target concatenated (:func:`pooled_profile`; left out where no other cluster has
    one). The one list of sources of the inference transfer (:func:`transfer_errors`) and the
    training one (:func:`validation.training_validation.compare_clusters`)."""
    sources: list[tuple[str, Profile | None]] = list(profiles.items())
    if none:
        sources.append((NO_PROFILE, None))
    others = [profile for name, profile in profiles.items() if name != target]
    if pooled and others:
        sources.append((POOLED, pooled_profile(others)))
    return sources


def transfer_errors(clusters: Sequence[Cluster], *, pooled: bool = True,
                    simulate_case: Callable | None = None,
                    on_progress: Callable[[str], None] = lambda text: None) -> pd.DataFrame:
    """Every (source, target) case's error; columns :data:`ERROR_COLUMNS`.

    Sources: each cluster's profile, :data:`NO_PROFILE` and (``pooled``) :data:`POOLED`, the
    profiles of all clusters but the target. ``term`` and ``term_contribution``: the term behind
    a case off by more than :data:`TERM_THRESHOLD` and its contribution (see the module
    docstring); empty and NaN elsewhere, and where the target has no measured split or the
    simulation no trace.

    Args:
        simulate_case: ``(scenario, profile or None) -> SimulationResult``; default
            :func:`sim.simulate.simulate`.
    """
    if simulate_case is None:
        from sim.simulate import simulate

        simulate_case = lambda scenario, profile: simulate(scenario, profile=profile)  # noqa: E731
    rows = []
    profiles = {c.name: c.profile for c in clusters}
    for target in clusters:
        sources = transfer_sources(target.name, profiles, pooled=pooled)
        for prompt, measured in target.measured.groupby("prompt_tokens", sort=True):
            case = with_prompt(target.scenario, int(prompt))
            measured_terms = None if target.terms is None else target.terms[target.terms["prompt_tokens"] == prompt]
            for source, profile in sources:
                on_progress(f"{target.name} at prompt {prompt} with {source}")
                result = simulate_case(case, profile)
                results = result.results
                simulated = results[results["device"].isna() | (results["device"] == "")] \
                    .set_index(["variant", "metric"])["value"]
                split: dict[str, pd.Series] = {}  # variant -> its simulated split, computed once
                for row in measured.itertuples(index=False):
                    value = float(simulated[(row.variant, row.metric)])
                    error = value / float(row.measured) - 1
                    term, contribution = "", float("nan")
                    if abs(error) > TERM_THRESHOLD and measured_terms is not None and hasattr(result, "variant"):
                        if row.variant not in split:
                            ran = result.variant(row.variant)
                            split[row.variant] = metric_terms(
                                [ran.trace], phase_metrics(ran.timing),
                                profile_gap_s(profile, result.topology.devices[result.ranks[0]].spec.name))
                        term, contribution = case_term(split[row.variant], measured_terms, row, error)
                    rows.append({"source": source, "target": target.name, "prompt_tokens": int(prompt),
                                 "variant": row.variant, "metric": row.metric, "simulated": value,
                                 "measured": float(row.measured), "error": error, "term": term,
                                 "term_contribution": contribution})
    return pd.DataFrame(rows, columns=ERROR_COLUMNS)


def case_term(simulated: pd.Series, measured_terms: pd.DataFrame, case, error: float) -> tuple[str, float]:
    """(the term behind a case's ``error``, its contribution): ``simulated`` is the simulated run's
    split of its variant (:func:`validation.terms.metric_terms`), ``measured_terms`` the target's
    measured split at the case's prompt (``terms.csv`` rows), ``case`` has ``variant``,
    ``metric`` and ``measured`` (the median the error compares against, s). ("", NaN) where
    the measured split lacks the case."""
    phase = next(p for p, m in PHASE_METRIC.items() if m == case.metric)
    mine = measured_terms[(measured_terms["variant"] == case.variant) & (measured_terms["phase"] == phase)
                          & (measured_terms["term"] != "other")]
    if mine.empty:
        return "", float("nan")
    named = mine.set_index("term")["measured_s"]
    measured = pd.concat([named, pd.Series({"other": float(case.measured) - float(named.sum())})])
    simulated = simulated[phase] if phase in simulated.index.get_level_values("phase") else pd.Series(dtype=float)
    both = pd.DataFrame({"simulated_s": simulated, "measured_s": measured}).fillna(0.0)
    both = both.assign(contribution=(both["simulated_s"] - both["measured_s"]) / float(case.measured))
    behind = term_behind(both.rename_axis("term").reset_index(), error)
    return str(behind["term"]), float(behind["contribution"])


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


PAIR_KINDS = ("same", "other", POOLED, NO_PROFILE)
"""The kinds of (source, target) pair (:func:`kind_of_pair`), in the order the reports give them."""


def kind_of_pair(source: str, target: str) -> str:
    """``same`` (the diagonal), ``none``, ``pooled`` or ``other`` (true transfer): one of
    :data:`PAIR_KINDS`."""
    if source == target:
        return "same"
    return source if source in (NO_PROFILE, POOLED) else "other"


def overall_table(errors: pd.DataFrame, matrix_clusters: Sequence[str] = (),
                  metrics: Sequence[str] = TRANSFER_METRICS, both: bool = True) -> pd.DataFrame:
    """Per kind of pair (:func:`kind_of_pair`) and metric (each of ``metrics``, then, with
    ``both``, all of them together: TTFT and TPOT by default): cases, median and p90 |error|,
    median signed error; over every cluster (``scope`` all) and, where ``matrix_clusters``
    names some, over the pairs among them alone (``scope`` matrix)."""
    kinds = errors.assign(kind=[kind_of_pair(s, t) for s, t in zip(errors["source"], errors["target"])])
    scopes = [("all", kinds)]
    if matrix_clusters:
        among = kinds["target"].isin(matrix_clusters) & (kinds["source"].isin(matrix_clusters)
                                                          | kinds["kind"].isin((NO_PROFILE, POOLED)))
        scopes.append(("matrix", kinds[among]))
    rows = []
    for scope, table in scopes:
        for kind in PAIR_KINDS:
            of_kind = table[table["kind"] == kind]
            if of_kind.empty:
                continue
            for metric in (*metrics, *(("both",) if both else ())):
                chosen = of_kind[of_kind["metric"].isin(metrics)] if metric == "both" \
                    else of_kind[of_kind["metric"] == metric]
                if chosen.empty:
                    continue
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


def behind_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Per kind of pair (:func:`kind_of_pair`) and term: of the cases off by more than
    :data:`TERM_THRESHOLD`, how many that term is behind, and the median of its contribution
    and of their error. Columns ``pairs, term, cases, median_contribution, median_error``."""
    off = errors[errors["error"].abs() > TERM_THRESHOLD]
    off = off.assign(pairs=[kind_of_pair(s, t) for s, t in zip(off["source"], off["target"])],
                     term=off["term"].fillna("").replace("", "(no measured split)"))
    grouped = off.groupby(["pairs", "term"], sort=True)
    table = pd.DataFrame({"cases": grouped.size(), "median_contribution": grouped["term_contribution"].median(),
                          "median_error": grouped["error"].median()}).reset_index()
    return table.sort_values(["pairs", "cases"], ascending=[True, False], kind="stable").reset_index(drop=True)


def matrix_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Target x source: median |error| over the target's TTFT and TPOT cases."""
    table = errors.assign(abs_error=errors["error"].abs()).pivot_table(
        index="target", columns="source", values="abs_error", aggfunc="median")
    order = [c for c in dict.fromkeys(errors["target"]) if c in table.columns]
    extra = [c for c in (POOLED, NO_PROFILE) if c in table.columns]
    return table.reindex(index=list(dict.fromkeys(errors["target"])), columns=order + extra)


def overall_lines(overall: pd.DataFrame) -> list[str]:
    """An :func:`overall_table` as a markdown table (without its ``scope`` column where the
    table has none)."""
    scoped = "scope" in overall.columns
    header = [*(("scope",) if scoped else ()), "pairs", "metric", "cases", "median abs error", "p90 abs error",
              "median signed error"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in overall.itertuples(index=False):
        cells = [*((row.scope,) if scoped else ()), row.pairs, row.metric, row.cases, f"{row.median_abs_error:.1%}",
                 f"{row.p90_abs_error:.1%}", f"{row.median_signed_error:+.1%}"]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def behind_lines(errors: pd.DataFrame) -> list[str]:
    """:func:`behind_table` of ``errors`` as a markdown table."""
    lines = ["| pairs | term | cases | median contribution | median error |", "|---|---|---|---|---|"]
    for row in behind_table(errors).itertuples(index=False):
        lines.append(f"| {row.pairs} | {row.term} | {row.cases} | {row.median_contribution:+.1%} | "
                     f"{row.median_error:+.1%} |")
    return lines


def matrix_lines(errors: pd.DataFrame, what: str) -> list[str]:
    """:func:`matrix_table` of ``errors`` as a markdown table, headed by a line naming ``what``
    its median |error| is of."""
    table = matrix_table(errors)
    lines = [f"Median |error| {what} per target (rows) and source profile (columns):", "",
             "| target | " + " | ".join(table.columns) + " |", "|---" * (len(table.columns) + 1) + "|"]
    for target, values in table.iterrows():
        lines.append(f"| {target} | " + " | ".join("" if np.isnan(v) else f"{v:.1%}" for v in values) + " |")
    return lines


def machine_lines(clusters: Sequence[Cluster]) -> list[str]:
    """One line per cluster: the share of the machine's CPU time others took while it was
    measured and calibrated (:attr:`Cluster.machine`), or that its report did not record it."""
    lines = []
    for cluster in clusters:
        known = [f"{cluster.machine[column]:.1%} {what}" for column, what in MACHINE_LOAD.items()
                 if column in cluster.machine]
        missing = [column for column in MACHINE_LOAD if column not in cluster.machine]
        lines.append(f"- {cluster.name}: " + ", ".join(known)
                     + ("; " if known and missing else "") + (f"not recorded: {', '.join(missing)}" if missing else ""))
    return lines


def summary_markdown(errors: pd.DataFrame, command: str, matrix_clusters: Sequence[str] = (),
                     clusters: Sequence[Cluster] = ()) -> str:
    """The report's summary: how it was made, the overall figures, the terms behind the cases
    off by more than :data:`TERM_THRESHOLD`, the source x target table and (``clusters``) the
    machine's load while each target was measured."""
    lines = ["# Calibration transfer", "",
             f"Regenerate: `{command}` (re-simulation of the reports' profiles against their measured "
             "medians).", "",
             "Signed error = simulated / measured - 1, TTFT and TPOT of every variant at every measured prompt "
             "length. Pairs: `same` = a cluster with its own profile (same-cluster mode); `other` = another "
             "cluster's profile (true transfer); `pooled` = the profiles of all clusters but the target; "
             f"`none` = no profile. Scope `all`: the {errors['target'].nunique()} clusters; `matrix`: the "
             f"{len(matrix_clusters)} clusters of `validation/matrix.yaml` among themselves (the issue's 240 "
             "off-diagonal cases).", "", *overall_lines(overall_table(errors, matrix_clusters))]
    lines += ["", "Strategy ranking: of the variant pairs of a target whose measured TTFT or TPOT differ by more "
              "than 10%, those the prediction orders as measured:", ""]
    lines += [f"- {row.pairs}: {row.agreeing} of {row.compared}" for row in ranking_table(errors).itertuples()]
    lines += ["", f"The term behind every case off by more than {TERM_THRESHOLD:.0%} (`term` and `term_contribution` "
              "in `errors.csv`): of the simulated run's split of the metric against the target's measured split "
              "(its report's `terms.csv`; `other` the rest of the measured median, so that a case's terms add up "
              "to its error), the term contributing most in the error's direction. Per kind of pair:", "",
              *behind_lines(errors)]
    lines += ["", *matrix_lines(errors, "(TTFT and TPOT)")]
    if clusters:
        lines += ["", "The machine's CPU time others took while each cluster was measured and calibrated (its report's "
                  "`errors.csv`; reports made before the load probe record steal alone):", "", *machine_lines(clusters)]
    return "\n".join(lines) + "\n"


def write_transfer_report(errors: pd.DataFrame, out_dir: Path, command: str,
                          matrix_clusters: Sequence[str] = (), clusters: Sequence[Cluster] = ()) -> list[Path]:
    """Write ``errors.csv`` (every case), ``transfer.csv`` (per pair and metric), ``overall.csv``
    and ``summary.md`` (:func:`summary_markdown`) under ``out_dir``; returns the paths."""
    from sim.outputs import write_files

    return write_files(out_dir, {
        "errors.csv": errors.to_csv(index=False, lineterminator="\n"),
        "transfer.csv": transfer_table(errors).to_csv(index=False, lineterminator="\n"),
        "overall.csv": overall_table(errors, matrix_clusters).to_csv(index=False, lineterminator="\n"),
        "summary.md": summary_markdown(errors, command, matrix_clusters, clusters),
    })


# What the shipped reports were measured on (their summary.md): the project's 2-core virtual
# machine, gloo over TCP in the emulated hosts, torch 2.13.0.
SHIPPED_CORES = 2
SHIPPED_BACKEND = Transport.GLOO_TCP.value
SHIPPED_TORCH = "2.13.0"


def add_context(profile_path: Path, scenario: Scenario, *, cores: int | None, backend: str | None,
                torch_version: str | None) -> None:
    """Rewrite a profile file with ``context`` rows derived from the scenario it was calibrated
    on (replacing any it had, but keeping the load and the model it recorded), so that it says
    what it was measured on (:mod:`sim.context`).

    Raises:
        ConfigError: the profile does not load.
    """
    from dataclasses import replace

    from sim.context import context_rows, profile_contexts, scenario_context
    from sim.outputs import write_atomic
    from sim.profile import profile_frame
    from sim.vocabulary import MeasurementKind
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology

    recorded = profile_contexts(load_profile(profile_path).rows)  # load_profile checks it
    topology = build_topology(scenario.config.cluster)
    context = scenario_context(scenario.name, topology, ParallelPlan.of(scenario, topology).tensor_ranks,
                               scenario.model.dtype, cores=cores, backend=backend, torch_version=torch_version)
    if recorded:  # the load is measured and the model what ran, not derived from the scenario
        context = replace(context, cpu_steal=recorded[0].cpu_steal, other_load=recorded[0].other_load,
                          model=recorded[0].model)
    # The measured rows stay byte for byte as calibration wrote them; the context rows go where
    # profile_frame's order puts them (after the compute rows).
    header, *lines = [line for line in profile_path.read_text().splitlines()
                      if line.split(",")[1:2] != [MeasurementKind.CONTEXT]]
    kinds = [line.split(",")[1] for line in lines]
    at = sum(kind <= MeasurementKind.CONTEXT for kind in kinds)
    # In the file's own columns: one written before an optional column (sim.profile.OPTIONAL_COLUMNS) lacks it.
    added = profile_frame(context_rows(context))[header.split(",")].to_csv(
        index=False, header=False, lineterminator="\n").splitlines()
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
