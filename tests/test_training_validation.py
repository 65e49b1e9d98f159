"""hetsim validate of a training matrix (validation/training_validation.py): its cases, and the
report it makes from clusters already calibrated and measured (no rank is started here)."""

import json

import pandas as pd
import pytest
import yaml

from models.errors import ConfigError
from sim.training.simulate import simulate_training
from sim.vocabulary import Metric
from tests.conftest import ROOT, run_cli
from tests.test_training_calibrated import _profile
from validation.cli import main
from validation.training_validation import (ClusterRun, _save_cluster, compare_clusters, load_report_clusters,
                                            load_training_matrix, measured_cases, validate_training)

CLUSTERS = ["v2x2_bandwidth", "v4x1_latency"]


def _matrix(tmp_path, **overrides) -> str:
    document = {
        "kind": "training", "name": "t", "testbed": False,
        "clusters": [str(ROOT / "scenarios" / "validation" / f"{name}.yaml") for name in CLUSTERS],
        "model": str(ROOT / "scenarios" / "validation" / "models" / "tiny_gpt2.json"),
        "workload": {"kind": "training", "global_batch_size": 16, "micro_batch_size": 4, "sequence_length": 128},
        "training": {"optimizer": "adamw", "precision": "fp32"},
        "grid": {"bucket_cap_mb": [1, 25], "activation_checkpointing": [None, 1]},
        "variants": [{"name": "no_overlap", "training": {"bucket_cap_mb": 1, "overlap": False}}],
    } | overrides
    path = tmp_path / "training.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_the_grid_and_the_variants_are_the_cases_of_every_cluster(tmp_path):
    matrix, scenarios = load_training_matrix(_matrix(tmp_path))
    assert [s.name for s in scenarios] == CLUSTERS
    names = [v.name for v in scenarios[0].config.variants]
    assert names == ["bucket1_ckptoff", "bucket1_ckpt1", "bucket25_ckptoff", "bucket25_ckpt1", "no_overlap"]
    settings = scenarios[1].training_settings(scenarios[1].config.variants[1])
    assert settings.bucket_cap_mb == 1 and settings.activation_checkpointing == 1
    assert len(scenarios[1].config.cluster.hosts) == 1 and scenarios[1].config.cluster.hosts[0].count == 4


def test_a_case_the_schema_refuses_is_named(tmp_path):
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        load_training_matrix(_matrix(tmp_path, grid={"bucket_cap_mb": [0]}))


def _calibrated_and_measured(tmp_path, scenarios, slower: dict[str, float]):
    """Clusters saved as a run leaves them: a profile each, and measurements that are the
    replay's simulation with the step time of some cases scaled by ``slower``."""
    for scenario in scenarios:
        profile = _profile(scenario, 1e-3)
        measured = simulate_training(scenario, profile).results.assign(source="measured")
        steps = measured["metric"] == str(Metric.STEP_TIME)
        for case, factor in slower.items():
            measured.loc[steps & (measured["variant"] == case), "value"] *= factor
        base = tmp_path / "out" / "clusters" / scenario.name
        base.mkdir(parents=True)
        profile.rows.to_csv(base / "profile.csv", index=False)
        measured.to_csv(base / "measured.csv", index=False)
        (base / "load.json").write_text(json.dumps({"cpu_steal": 0.01, "other_load": 0.02,
                                                    "calibration_cpu_steal": 0.0, "calibration_other_load": 0.0}))


def test_the_report_of_clusters_already_run_gives_replay_and_prediction_apart(tmp_path):
    matrix, scenarios = load_training_matrix(_matrix(tmp_path))
    _calibrated_and_measured(tmp_path, scenarios, {"no_overlap": 1.5})
    report = validate_training(matrix, scenarios, tmp_path / "out")
    errors = report.errors
    assert set(errors["calibrated_on"]) == set(CLUSTERS)
    assert (errors["replay"] == (errors["cluster"] == errors["calibrated_on"])).all()
    steps = errors[(errors["metric"] == str(Metric.STEP_TIME)) & errors["replay"]].set_index(["cluster", "case"])
    for cluster in CLUSTERS:
        assert steps.loc[(cluster, "no_overlap"), "error"] == pytest.approx(1 / 1.5 - 1)
        assert steps.loc[(cluster, "bucket1_ckptoff"), "error"] == pytest.approx(0, abs=1e-12)
    memory = errors[errors["metric"] == str(Metric.PEAK_MEMORY)]
    assert len(memory) and (memory["device"] != "").all() and memory["error"].abs().max() < 1e-12
    # measured 1.5 times its simulation: slower than every other case by more than 10%, as simulated
    pairs = report.ranking[report.ranking["replay"]]
    against = pairs[pairs["slower"] == "no_overlap"]
    assert len(against) == 2 * 4 and against["right"].all() and pairs["right"].all()
    gains = report.overlap[report.overlap["replay"]].set_index("cluster")
    assert set(report.overlap["partner"]) == {"bucket1_ckptoff"}
    for cluster in CLUSTERS:
        simulated = gains.loc[cluster, "simulated_gain"]
        assert gains.loc[cluster, "measured_gain"] == pytest.approx(1.5 * simulated)
        assert gains.loc[cluster, "difference_points"] == pytest.approx(100 * (simulated - 1.5 * simulated))
    modes = set(report.summary["mode"])
    assert modes == {"replay", "prediction"}


def test_a_saved_report_re_simulates_offline_with_the_measured_buckets_kept(tmp_path):
    matrix, scenarios = load_training_matrix(_matrix(tmp_path))
    _calibrated_and_measured(tmp_path, scenarios, {"no_overlap": 1.5})
    out = tmp_path / "out"
    runs = load_report_clusters(scenarios, out)
    assert all(run.trace is None for run in runs.values())  # saved before traces were kept
    offline = compare_clusters(scenarios, runs)
    pd.testing.assert_frame_equal(offline.summary, validate_training(matrix, scenarios, out).summary)
    # a run saved with its measured ops gives them back, every bucket's allreduce apart
    first = runs[scenarios[0].name]
    trace = pd.DataFrame({"variant": ["no_overlap"] * 2, "rank": [0, 0], "name": ["bucket 0", "bucket 1"],
                          "start_s": [0.5, 0.7], "end_s": [0.7, 0.9]})
    _save_cluster(out, ClusterRun(first.name, first.profile, first.measured, first.load, trace))
    pd.testing.assert_frame_equal(load_report_clusters(scenarios, out)[first.name].trace, trace)
    with pytest.raises(ConfigError, match=f"report: no saved calibration and measurement of cluster {CLUSTERS[0]}"):
        load_report_clusters(scenarios, tmp_path / "elsewhere")


def test_hetsim_validate_writes_the_training_report_and_its_transfer_figure_from_saved_clusters(tmp_path, capsys):
    matrix = _matrix(tmp_path, transfer=True)
    _, scenarios = load_training_matrix(matrix)
    _calibrated_and_measured(tmp_path, scenarios, {})
    code, out, err = run_cli(main, ["validate", str(matrix), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert "Training validation" in out and "replay" in out and "prediction" in out
    assert "Calibration transfer: training matrix t" in out
    for name in ("errors.csv", "ranking.csv", "overlap.csv", "summary.csv", "load.csv", "summary.md",
                 "transfer/transfer.csv", "transfer/errors.csv", "transfer/summary.md", "transfer/report.html"):
        assert (tmp_path / "out" / name).is_file()
    errors = pd.read_csv(tmp_path / "out" / "errors.csv")
    assert {"case", "cluster", "metric", "measured", "simulated", "error", "calibrated_on"} <= set(errors.columns)
    assert set(errors["calibrated_on"]) == {*CLUSTERS, "pooled", "none"}
    modes = set(pd.read_csv(tmp_path / "out" / "summary.csv")["mode"])
    assert modes == {"replay", "prediction", "prediction (pooled)", "uncalibrated"}
    summary = (tmp_path / "out" / "transfer" / "summary.md").read_text()
    assert f"Regenerate: `hetsim validate {matrix} --out {tmp_path / 'out'}`" in summary


def test_a_run_resumed_into_a_directory_of_another_matrix_is_refused_before_any_rank_starts(tmp_path):
    matrix, scenarios = load_training_matrix(_matrix(tmp_path))
    _calibrated_and_measured(tmp_path, scenarios, {})
    out = tmp_path / "out"
    # saved before what was measured was kept: the case names tell
    other, others = load_training_matrix(_matrix(tmp_path, grid={"bucket_cap_mb": [1, 5]}))
    with pytest.raises(ConfigError, match=f"cluster {CLUSTERS[0]} saved under .* was measured for other cases than "
                                          "the matrix's \\(bucket1, bucket1_ckpt1, bucket1_ckptoff, bucket25_ckpt1, "
                                          "bucket25_ckptoff, bucket5\\); give --out another directory"):
        validate_training(other, others, out)
    # saved with them: a case of the same name and other settings is refused too
    for scenario in scenarios:
        (out / "clusters" / scenario.name / "cases.json").write_text(json.dumps(measured_cases(scenario)))
    assert set(load_report_clusters(scenarios, out)) == set(CLUSTERS)
    changed = _matrix(tmp_path, variants=[{"name": "no_overlap", "training": {"bucket_cap_mb": 25, "overlap": False}}])
    with pytest.raises(ConfigError, match="was measured for other cases than the matrix's \\(no_overlap\\)"):
        load_report_clusters(load_training_matrix(changed)[1], out)
