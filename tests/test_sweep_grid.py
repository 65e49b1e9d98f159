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

from sim.grid import combinations, evaluate_point, grid_points, load_grid, point_key
from sim.metrics import RESULT_COLUMNS
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import ROOT, cluster, scenario_dict
from validation.cli import main
from validation.sweep_runner import tidy_table

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
    _, more = _files(tmp_path, GRID | {"exclude": [*GRID["exclude"], {"parallel.tensor": 5}]})
    assert [c for c in combinations(load_grid(more))] == [c for c in combos if c["parallel.tensor"] != 5]
    points = grid_points(scenario_dict(), grid)
    # TP=5 exceeds neither the schema nor the field types: the simulator refuses it, per point.
    assert all(p.scenario is not None and len(p.key) == 64 for p in points)
    assert points[0].scenario.config.cluster.hosts[0].nic.bandwidth_bytes_per_s == 1e9 / 8
    assert len({p.key for p in points}) == len(points)
    bad = grid_points(scenario_dict(), load_grid(_files(tmp_path, {"axes": {"workload.batch_size": [1, 0]}})[1]))
    assert bad[0].error == "" and bad[1].scenario is None and bad[1].error.startswith("workload.batch_size: ")


def test_a_degree_that_does_not_divide_the_heads_is_split_by_the_default_basis_not_refused(tmp_path):
    # GPT-2's 12 heads over 5 devices of two kinds: the point runs unevenly, by the basis hetsim
    # simulate takes without parallel.shares (a short generation is decode-heavy: memory, not
    # compute); 13 devices cannot split 12 heads at all, and the point keeps the simulator's reason.
    # Each row of the uneven point says its basis, as hetsim simulate does; the even point's say nothing.
    mixed = cluster(7, 2)
    mixed["hosts"][0]["devices"] = [{"type": "rtx_4090", "count": 1}, {"type": "rtx_3060_12gb", "count": 1}]
    base = scenario_dict(cluster=mixed, variants=scenario_dict()["variants"][:1])
    _, grid_path = _files(tmp_path, {"axes": {"parallel.tensor": [5, 13, 4]}})
    points = grid_points(base, load_grid(grid_path))
    five, thirteen, four = points
    outcomes = {p.key: evaluate_point(p.scenario) for p in points}
    outcome = outcomes[five.key]
    value = RESULT_COLUMNS.index("value")
    by = {basis: list(simulate(scenario_from_dict(base | {"parallel": {"tensor": 5, "shares": basis}}),
                               expand_steps=()).results["value"]) for basis in ("memory", "compute")}
    assert outcome.error == "" and [r[value] for r in outcome.rows] == by["memory"] != by["compute"]
    assert outcomes[thirteen.key].error.startswith("parallel.tensor: 13 ranks but only 12 attention heads")
    notes = tidy_table(points, outcomes).groupby("parallel.tensor")["shares_note"].unique()
    assert outcome.shares_note.startswith("uneven shares by memory (default: decode-heavy workload, ")
    assert list(notes[5]) == [outcome.shares_note]
    assert list(notes[4]) == [""] and list(notes[13]) == [""]


def test_the_key_is_the_content_the_version_and_the_profile(tmp_path):
    one = scenario_from_dict(scenario_dict())
    assert point_key(one, "1") == point_key(scenario_from_dict(scenario_dict()), "1")
    assert point_key(one, "1") != point_key(one, "2") != point_key(one, "2", "digest")
    # the same scenario written two ways is one point
    assert point_key(one, "1") == point_key(scenario_from_dict(scenario_dict(memory={"policy": "resident"})), "1")


@pytest.mark.parametrize("grid, field", [
    ("axes: [1, 2]", "axes"),
    ("- a\n- b", "grid"),
    ("axes: {model: [gpt2]\n", "grid"),
    ({"axes": {"model": "gpt2"}}, "axes.model"),
    ({"axes": {}}, "axes"),
    ({"axes": {"workload.batch_size": []}}, "axes.workload.batch_size"),
    ({"axes": {"workload..batch": [1]}}, "axes"),
    ({"axes": {"colour": ["red"]}}, "axes.colour"),
    ({"axes": {"cluster.hosts[3].count": [1]}}, "axes.cluster.hosts[3].count"),
    ({"axes": {"model.name": ["x"]}}, "axes.model.name"),
    ({"axes": {"model": ["gpt2"]}, "exclude": [{"dtype": "fp16"}]}, "exclude[0].dtype"),
    ({"axes": {"model": ["gpt2"]}, "exclude": [{"model": "llama"}]}, "exclude[0].model"),
    ({"axes": {"model": ["gpt2"]}, "filters": []}, "filters"),
    ({"axes": {"model": ["gpt2"]}, "exclude": [{}]}, "exclude[0]"),
    ({"axes": {"model": ["gpt2"]}, "exclude": [{"model": "gpt2"}]}, "exclude"),
    ({"axes": {"workload.batch_size": list(range(1, 400)), "workload.output_tokens": list(range(1, 400))}}, "axes"),
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
    assert list(table.columns) == [*axes, *RESULT_COLUMNS, "oom", "error", "profile_context", "shares_note"]
    assert table["profile_context"].isna().all()  # uncalibrated: nothing to say
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
    assert "Use parallel.tensor = " in text and " the lowest TPOT of the 18 of 22 point-variants that fit (TPOT " \
        in text
    page = (out / "report.html").read_text()  # from the store's rows: a figure per metric, the verdict on top
    assert page.count('<div id="figure-') == 4 and "<p class='answer'>Use parallel.tensor = " in page
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


def test_a_profile_names_the_points_outside_its_calibration_context(tmp_path, capsys):
    # The profile's own cluster (v4x1_latency: 100 Mbit/s, 5 ms one way) replays it; a faster
    # link is priced by terms fitted on it, outside its context, as hetsim plan says it.
    scenario = yaml.safe_load((ROOT / "scenarios" / "validation" / "v4x1_latency.yaml").read_text())
    scenario["variants"] = scenario["variants"][:2]
    grid = {"axes": {"cluster.hosts[0].nic.bandwidth": ["100Mbit/s", "1Gbit/s"]}}
    scenario_path, grid_path = _files(tmp_path, grid, scenario)
    code, stdout, err = _run(["sweep", scenario_path, "--grid", grid_path, "--out", tmp_path / "out",
                              "--workers", 1, "--profile", PROFILE], capsys)
    assert code == 0, err
    table = pd.read_csv(tmp_path / "out" / "results.csv")
    context = table.groupby("cluster.hosts[0].nic.bandwidth")["profile_context"].unique()
    assert list(context["100Mbit/s"]) == ["replay"]
    assert len(context["1Gbit/s"]) == 1 and context["1Gbit/s"][0].startswith(
        "prediction; outside: link inter_host 1000 Mbit/s")
    assert "1 of 2 simulated points outside its calibration context" in " ".join(stdout.split())
    # The store keeps it: a rerun reads the same column back.
    code, stdout, _ = _run(["sweep", scenario_path, "--grid", grid_path, "--out", tmp_path / "out",
                            "--workers", 1, "--profile", PROFILE], capsys)
    assert code == 0 and "0 simulated now" in stdout
    assert pd.read_csv(tmp_path / "out" / "results.csv")["profile_context"].equals(table["profile_context"])


def _store_counts(path) -> tuple[dict[str, int], dict[str, int]]:
    """(key -> run, key -> result rows) of a sweep store, read-only."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        runs = dict(db.execute("SELECT key, run FROM points"))
        rows = dict(db.execute("SELECT key, COUNT(*) FROM results GROUP BY key"))
    finally:
        db.close()
    return runs, rows


def test_a_sweep_killed_with_sigkill_resumes_computing_only_the_missing_points(tmp_path, capsys):
    grid = {"axes": {"workload.batch_size": list(range(1, 16)), "cluster.hosts[0].nic.bandwidth": ["1Gbit/s", "10Gbit/s"]}}
    scenario, grid_path = _files(tmp_path, grid)
    out, total = tmp_path / "out", 30
    store = out / "sweep.sqlite"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", "import sys; from validation.cli import main; main(sys.argv[1:])",
               "sweep", str(scenario), "--grid", str(grid_path), "--out", str(out), "--workers", "2"]
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if store.exists() and len(_store_counts(store)[0]) >= 3:
                    break
            except sqlite3.OperationalError:  # created, its tables not yet
                pass
            time.sleep(0.01)
        assert process.poll() is None, process.stderr.read()
        os.killpg(process.pid, signal.SIGKILL)  # the sweep and its workers, mid-run
    finally:
        process.wait()
    runs, rows = _store_counts(store)
    assert 3 <= len(runs) < total
    per_point = 3 * (6 + 2 * 4)  # 3 variants x (6 timing metrics + 2 memory metrics x 4 devices)
    assert set(runs.values()) == {1} and set(rows.values()) == {per_point} and rows.keys() == runs.keys()
    code, stdout, err = _run(["sweep", scenario, "--grid", grid_path, "--out", out, "--workers", 2], capsys)
    assert code == 0, err
    assert f"{total - len(runs)} simulated now (2 local workers), {len(runs)} from" in " ".join(stdout.split())
    after_runs, after_rows = _store_counts(store)
    assert len(after_runs) == total and set(after_rows.values()) == {per_point}
    assert {k: r for k, r in after_runs.items() if r == 1} == runs  # nothing stored twice or recomputed
    assert len(pd.read_csv(out / "results.csv")) == total * per_point


def test_a_dask_cluster_of_two_workers_gives_the_local_results(tmp_path, capsys, monkeypatch):
    distributed = pytest.importorskip("dask.distributed")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the workers' processes import hetsim
    grid = {"axes": {"parallel.tensor": [2, 3], "workload.batch_size": [1, 8]}}
    scenario, grid_path = _files(tmp_path, grid)
    code, _, err = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "local", "--workers", 1], capsys)
    assert code == 0, err
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster:
        code, stdout, err = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "dask",
                                  "--scheduler", cluster.scheduler_address, "--profile", PROFILE], capsys)
        assert code == 0, err
        assert "4 simulated now (Dask at tcp://" in " ".join(stdout.split())
        code, stdout, err = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "dask",
                                  "--scheduler", cluster.scheduler_address], capsys)
        assert code == 0, err
        # Workers that run another simulator would store their results under this one's keys.
        monkeypatch.setattr("validation.sweep_runner.hetsim_version", lambda: "0.0.0+other")
        code, _, refused = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "other",
                                 "--scheduler", cluster.scheduler_address], capsys)
        assert code == 2 and refused.startswith("hetsim: error: --scheduler: 2 of 2 workers run another hetsim")
    assert (tmp_path / "dask" / "results.csv").read_bytes() == (tmp_path / "local" / "results.csv").read_bytes()
    # the calibrated points were other points: the uncalibrated ones were all computed anew
    assert "4 simulated now" in " ".join(stdout.split())


def test_an_address_where_no_scheduler_answers_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("dask.distributed")
    monkeypatch.setattr("validation.sweep_runner.SCHEDULER_TIMEOUT_S", 1)
    scenario, grid_path = _files(tmp_path, {"axes": {"workload.batch_size": [1]}})
    code, _, err = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "out",
                         "--scheduler", "tcp://127.0.0.1:9"], capsys)
    assert code == 2 and err.startswith("hetsim: error: --scheduler: ") and err.count("\n") == 1, err


def test_a_scenarios_sweep_section_takes_config_paths_and_the_profile(tmp_path, capsys):
    (tmp_path / "tiny.json").write_text((ROOT / "tests" / "data" / "gpt2.config.json").read_text())
    data = scenario_dict(dtype=None, variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}],
                         sweep={"models": ["gpt2", "tiny.json"], "devices": [2, 4]})
    data["cluster"] = {"switches": [{"name": "sw"}], "hosts": [
        {"name": "n{i}", "count": 4, "parent": "sw", "nic": {"bandwidth": "200Mbit/s", "latency": "3ms"},
         "devices": {"type": "cpu", "count": 1, "memory": "8GiB"}}]}
    scenario, _ = _files(tmp_path, {"axes": {"model": ["gpt2"]}}, data)
    tables = {}
    for name, extra in (("plain", []), ("calibrated", ["--profile", PROFILE])):
        code, stdout, err = _run(["simulate", scenario, "--out", tmp_path / name, *extra], capsys)
        assert code == 0, err
        assert "TPOT (ms)" in stdout
        tables[name] = pd.read_csv(tmp_path / name / "sweep.csv")
    assert list(tables["plain"]["model"]) == ["gpt2", "gpt2", "tiny.json", "tiny.json"]
    assert (tables["plain"]["tpot_s"] != tables["calibrated"]["tpot_s"]).all()
    # 200 Mbit/s and 3 ms are not the profile's link: every calibrated point says so, and how many
    assert tables["plain"]["profile_context"].isna().all()
    assert tables["calibrated"]["profile_context"].str.startswith(
        "prediction; outside: link inter_host 200 Mbit/s").all()
    assert "4 of 4 points outside its calibration context" in " ".join(stdout.split())


def test_the_terminal_table_shows_tpot_in_ms_and_past_forty_rows_the_fastest_that_fit():
    from rich.console import Console

    from sim.vocabulary import WorkloadKind
    from validation.present.grid_report import grid_verdict
    from validation.present.sweep_table import grid_table

    rows = []
    for batch in range(1, 51):
        tpot = 0.05 - batch * 1e-4  # the larger the batch, the faster, so the last rows lead
        for metric, value, unit, device in (("ttft_s", 0.2, "s", ""), ("tpot_s", tpot, "s", ""),
                                            ("decode_tokens_per_s", 1 / tpot, "tokens/s", ""),
                                            ("peak_memory_bytes", 2**30, "bytes", "dev0")):
            rows.append((batch, "test", "rlb", "simulated", metric, value, unit, device,
                         "op x does not fit" if batch == 50 else "", ""))
    tidy = pd.DataFrame(rows, columns=["workload.batch_size", *RESULT_COLUMNS, "oom", "error"])
    console = Console(record=True, width=200)
    console.print(grid_table(tidy, ["workload.batch_size"], "t"))
    text = console.export_text()
    assert "the 40 of 50 rows that fit with the lowest TPOT" in text and "TPOT ms" in text
    body = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert body == [str(b) for b in range(49, 9, -1)]  # batch 50 does not fit
    assert "45.1 " in text  # batch 49: 0.0451 s as 45.1 ms
    # The verdict: the lowest TPOT that fits, and why: at batch 1 the best is 10% slower.
    assert grid_verdict(tidy, ["workload.batch_size"], WorkloadKind.INFERENCE) == (
        "Use workload.batch_size = 49 with variant rlb: the lowest TPOT of the 49 of 50 point-variants that fit "
        "(TPOT 45.1 ms, TTFT 200 ms, decode throughput 22.2 tok/s, max peak memory per device 1.00 GiB); "
        "workload.batch_size matters most: the best that fits with workload.batch_size = 1 is 49.9 ms (+11%).")


def test_a_grid_axis_of_bare_numbers_is_titled_with_the_unit_its_field_reads_them_in():
    from sim.grid import axis_unit
    from sim.vocabulary import WorkloadKind
    from validation.present.grid_report import metric_figure
    from validation.present.sweep_table import shown_columns, wide_results

    assert [axis_unit(p) for p in ("parallel.tensor", "workload.prompt_tokens", "training.bucket_cap_mb",
                                   "cluster.switches[1].uplink.bandwidth", "cluster.switches[0].uplink.latency",
                                   "workload.rate_per_s", "model", "variants", "no.such_field")] == [
        "count", "tokens", "MB", "bytes/s", "s", "per s", None, None, None]
    rows = [(tensor, link, "test", "rlb", "simulated", "tpot_s", 0.1 / tensor, "s", "", "", "")
            for tensor in (2, 4) for link in ("100Mbit/s", "1Gbit/s")]
    axes = ["parallel.tensor", "cluster.switches[1].uplink.bandwidth"]
    tidy = pd.DataFrame(rows, columns=[*axes, *RESULT_COLUMNS, "oom", "error"])
    wide = wide_results(tidy, axes)
    column = next(c for c in shown_columns(WorkloadKind.INFERENCE, wide) if c.metric == "tpot_s")
    figure = metric_figure(wide, axes, column, pd.Series("", index=wide.index), None)
    # Bare numbers get their unit; values written with theirs show as written.
    assert [figure.layout.xaxis.title.text, figure.layout.xaxis2.title.text] == [
        "parallel.tensor (count)", "cluster.switches[1].uplink.bandwidth"]


def test_the_shipped_grid_expands_over_its_scenario_without_a_refused_point():
    from models.input_files import load_yaml

    scenario = ROOT / "scenarios" / "low_resource_llama2_7b.yaml"
    points = grid_points(load_yaml(scenario, "scenario"), load_grid(ROOT / "scenarios" / "grids" / "low_resource_what_if.yaml"),
                         base_dir=scenario.parent)
    assert len(points) == 18 and all(p.scenario is not None for p in points)


def test_the_store_keeps_a_points_first_result_and_its_rows_once(tmp_path):
    from sim.grid import PointOutcome
    from sim.sweep_store import SweepStore

    first = PointOutcome((("s", "v", "simulated", "tpot_s", 0.5, "s", ""),), {"v": "op x does not fit"}, "", 1.0)
    second = PointOutcome((("s", "v", "simulated", "tpot_s", 0.7, "s", ""),), {}, "", 2.0)
    with SweepStore(tmp_path / "sweep.sqlite") as store:
        store.start_run(1)
        assert store.commit("k", "{}", first) and not store.commit("k", "{}", second)
    with SweepStore(tmp_path / "sweep.sqlite") as store:  # reopened, as a rerun does
        assert store.stored(["k", "other"]) == {"k"}
        assert store.outcomes(["k", "other"]) == {"k": first}


def test_an_out_directory_whose_store_is_not_a_sweep_store_is_one_line(tmp_path, capsys):
    scenario, grid_path = _files(tmp_path, {"axes": {"workload.batch_size": [1]}})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.sqlite").write_text("not a database\n" * 100)
    code, _, err = _run(["sweep", scenario, "--grid", grid_path, "--out", tmp_path / "out"], capsys)
    assert code == 2 and err.startswith("hetsim: error: --out: ") and "is not a sweep store" in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sweep.sqlite"]


@pytest.mark.parametrize("data, axes, metric, verdict", [
    ("training_small.yaml", {"training.bucket_cap_mb": [1, 25], "workload.micro_batch_size": [1, 2]}, "step_time_s",
     "the lowest step time of the 12 of 12 point-variants that fit (step time "),
    ("serving_small.yaml", {"workload.rate_per_s": [1, 4]}, "ttft_p90_s",
     "the lowest p90 TTFT of the 4 of 4 point-variants that fit (p90 TTFT "),
])
def test_training_and_serving_scenarios_sweep_like_any_other(tmp_path, capsys, data, axes, metric, verdict):
    document = yaml.safe_load((ROOT / "tests" / "data" / data).read_text())
    document["workload"].pop("slo", None)  # keep the serving points short: no rate search
    scenario, grid_path = _files(tmp_path, {"axes": axes}, document)
    out = tmp_path / "out"
    code, stdout, err = _run(["sweep", scenario, "--grid", grid_path, "--out", out, "--workers", 1], capsys)
    assert code == 0, err
    text = " ".join(stdout.split())
    assert verdict in text and (metric != "step_time_s" or "; its step is bound by " in text), text
    table = pd.read_csv(out / "results.csv", keep_default_na=False, na_values=[""])
    assert table["error"].isna().all()  # no point refused
    values = table[table["metric"] == metric].groupby(list(axes))["value"].first()
    assert len(values) == len(combinations(load_grid(grid_path))) and (values > 0).all()
    if "workload.rate_per_s" in axes:  # more load, a longer wait for the first token
        assert values.loc[4] > values.loc[1]


def test_a_store_from_before_its_added_columns_opens_and_keeps_its_points(tmp_path):
    from sim.grid import PointOutcome
    from sim.sweep_store import SweepStore

    path = tmp_path / "sweep.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE runs (run INTEGER PRIMARY KEY AUTOINCREMENT, started_s REAL NOT NULL, points INTEGER NOT NULL);
        CREATE TABLE points (key TEXT NOT NULL UNIQUE, run INTEGER NOT NULL, axes TEXT NOT NULL, error TEXT NOT NULL,
                             seconds REAL NOT NULL);
        CREATE TABLE results (key TEXT NOT NULL, ord INTEGER NOT NULL, scenario TEXT, variant TEXT, source TEXT,
                              metric TEXT, value REAL, unit TEXT, device TEXT, oom TEXT NOT NULL, UNIQUE (key, ord));
        INSERT INTO runs VALUES (1, 0.0, 1);
        INSERT INTO points VALUES ('old', 1, '{}', 'x: refused', 0.5);
    """)
    db.commit()
    db.close()
    with SweepStore(path) as store:
        store.start_run(1)
        store.commit("new", "{}", PointOutcome((), {}, "y: refused", 0.1, "replay", "uneven shares by memory"))
        outcomes = store.outcomes(["old", "new"])
    assert outcomes["old"].profile_context == outcomes["old"].shares_note == ""
    assert outcomes["old"].error == "x: refused"
    assert outcomes["new"].profile_context == "replay" and outcomes["new"].shares_note == "uneven shares by memory"
