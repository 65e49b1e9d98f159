"""``hetsim sweep SCENARIO --grid GRID.yaml``: axes, filters, per-point errors, the tidy output,
calibration, resuming and Dask."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

from models.errors import ConfigError
from sim.grid import combinations, grid_points, load_grid, point_key
from sim.metrics import RESULT_COLUMNS
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import ROOT, scenario_dict
from validation.cli import main

PROFILE = ROOT / "validation" / "report" / "profiles" / "v4x1_latency.csv"


def _run(args, capsys) -> tuple[int, str, str]:
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _files(tmp_path, grid, scenario=None):
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario or scenario_dict()))
    (tmp_path / "grid.yaml").write_text(grid if isinstance(grid, str) else yaml.safe_dump(grid, sort_keys=False))
    return tmp_path / "scenario.yaml", tmp_path / "grid.yaml"


GRID = {"axes": {"parallel.tensor": [2, 4, 5], "workload.batch_size": [1, 4],
                 "cluster.hosts[0].nic.bandwidth": ["1Gbit/s", "10Gbit/s"]},
        "exclude": [{"parallel.tensor": 4, "workload.batch_size": 4}]}


def test_the_product_less_the_exclusions_each_point_validated_by_the_scenario_schema(tmp_path):
    _, grid_path = _files(tmp_path, GRID)
    grid = load_grid(grid_path)
    combos = combinations(grid)
    assert len(combos) == 3 * 2 * 2 - 2
    assert not any(c["parallel.tensor"] == 4 and c["workload.batch_size"] == 4 for c in combos)
    points = grid_points(scenario_dict(), grid)
    # TP=5 exceeds neither the schema nor the field types: the simulator refuses it, per point.
    assert all(p.scenario is not None and len(p.key) == 64 for p in points)
    assert points[0].scenario.config.cluster.hosts[0].nic.bandwidth_bytes_per_s == 1e9 / 8
    assert len({p.key for p in points}) == len(points)
    bad = grid_points(scenario_dict(), load_grid(_files(tmp_path, {"axes": {"workload.batch_size": [1, 0]}})[1]))
    assert bad[0].error == "" and bad[1].scenario is None and bad[1].error.startswith("workload.batch_size: ")


def test_the_key_is_the_content_the_version_and_the_profile(tmp_path):
    one = scenario_from_dict(scenario_dict())
    assert point_key(one, "1") == point_key(scenario_from_dict(scenario_dict()), "1")
    assert point_key(one, "1") != point_key(one, "2") != point_key(one, "2", "digest")
    # the same scenario written two ways is one point
    assert point_key(one, "1") == point_key(scenario_from_dict(scenario_dict(memory={"policy": "resident"})), "1")


@pytest.mark.parametrize("grid, field", [
    ("axes: [1, 2]", "axes"),
    ("- a\n- b", "grid"),
    ({"axes": {}}, "axes"),
    ({"axes": {"workload.batch_size": []}}, "axes.workload.batch_size"),
    ({"axes": {"workload..batch": [1]}}, "axes"),
    ({"axes": {"colour": ["red"]}}, "axes.colour"),
    ({"axes": {"cluster.hosts[3].count": [1]}}, "axes.cluster.hosts[3].count"),
    ({"axes": {"model.name": ["x"]}}, "axes.model.name"),
    ({"axes": {"model": ["gpt2"]}, "exclude": [{"dtype": "fp16"}]}, "exclude[0].dtype"),
    ({"axes": {"model": ["gpt2"]}, "exclude": [{"model": "llama"}]}, "exclude[0].model"),
    ({"axes": {"model": ["gpt2"]}, "filters": []}, "filters"),
    ({"axes": {f"workload.batch_size": list(range(1, 400)), "workload.output_tokens": list(range(1, 400))}}, "axes"),
])
def test_a_malformed_grid_is_one_line_naming_the_field_and_nothing_is_written(tmp_path, capsys, grid, field):
    scenario, grid_path = _files(tmp_path, grid)
    code, out, err = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "out"], capsys)
    assert code == 2, (out, err)
    assert err.startswith(f"hetsim: error: {field}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_sweep_writes_the_tidy_table_with_the_axes_and_a_row_per_refused_point(tmp_path, capsys):
    scenario, grid_path = _files(tmp_path, GRID)
    out = tmp_path / "out"
    code, stdout, err = _run(["sweep", scenario, "--grid", grid_path, "--out", out, "--workers", 2], capsys)
    assert code == 0, err
    table = pd.read_csv(out / "results.csv", keep_default_na=False, na_values=[""])
    axes = list(GRID["axes"])
    assert list(table.columns) == [*axes, *RESULT_COLUMNS, "oom", "error"]
    parquet = pd.read_parquet(out / "results.parquet")
    assert list(parquet.columns) == list(table.columns) and len(parquet) == len(table)
    refused = table[table["parallel.tensor"] == 5]
    assert len(refused) == 4 and refused["error"].str.startswith("parallel.tensor: ").all()
    assert refused["metric"].isna().all()
    # Every other point is exactly what hetsim simulate gives for that scenario.
    point = scenario_dict(parallel={"tensor": 4})
    point["cluster"]["hosts"][0]["nic"]["bandwidth"] = "10Gbit/s"
    expected = simulate(scenario_from_dict(point), expand_steps=()).results
    got = table[(table["parallel.tensor"] == 4) & (table["workload.batch_size"] == 1)
                & (table["cluster.hosts[0].nic.bandwidth"] == "10Gbit/s")]
    assert got[RESULT_COLUMNS].fillna("").reset_index(drop=True).equals(
        expected.astype({"value": float}).fillna("").reset_index(drop=True))
    text = " ".join(stdout.split())
    assert "TPOT ms" in text and "10 points: 10 simulated now (2 local workers), 0 from" in text
    assert "lowest TPOT that fits: parallel.tensor = " in text
    # A rerun computes nothing and writes the same files.
    before = (out / "results.csv").read_bytes()
    code, stdout, _ = _run(["sweep", scenario, "--grid", grid_path, "--out", out, "--workers", 2], capsys)
    assert code == 0 and "0 simulated now (2 local workers), 10 from" in " ".join(stdout.split())
    assert (out / "results.csv").read_bytes() == before


def test_hf_config_paths_as_models_and_a_profile_applied_to_every_point(tmp_path, capsys):
    config = ROOT / "tests" / "data" / "gpt2.config.json"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.json").write_text(config.read_text())
    grid = {"axes": {"model": ["gpt2", "configs/tiny.json"], "workload.batch_size": [1, 2]}}
    scenario = scenario_dict(dtype=None, cluster={"switches": [{"name": "sw"}], "hosts": [
        {"name": "n{i}", "count": 4, "parent": "sw", "nic": {"bandwidth": "200Mbit/s", "latency": "3ms"},
         "devices": {"type": "cpu", "count": 1, "memory": "8GiB"}}]})
    scenario_path, grid_path = _files(tmp_path, grid, scenario)
    runs = {}
    for name, extra in (("plain", []), ("calibrated", ["--profile", PROFILE])):
        code, stdout, err = _run(["sweep", scenario_path, "--grid", grid_path, "--out", tmp_path / name,
                                  "--workers", 1, *extra], capsys)
        assert code == 0, err
        runs[name] = pd.read_csv(tmp_path / name / "results.csv")
        assert ("calibrated from" in stdout) == bool(extra)
    plain, calibrated = runs["plain"], runs["calibrated"]
    assert (plain["error"].isna()).all() and set(plain["model"]) == {"gpt2", str(tmp_path / "configs" / "tiny.json")}
    assert not plain["value"].equals(calibrated["value"])  # the profile priced the points
    # The same scenario with the profile is the same calibrated simulation.
    from sim.profile import load_profile
    one = scenario_from_dict(scenario | {"workload": scenario["workload"] | {"batch_size": 2}})
    expected = simulate(one, profile=load_profile(PROFILE), expand_steps=()).results
    got = calibrated[(calibrated["model"] == "gpt2") & (calibrated["workload.batch_size"] == 2)]
    assert list(got["value"]) == list(expected["value"])
