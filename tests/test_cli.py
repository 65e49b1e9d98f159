"""The ``hetsim simulate`` command: outputs, one-line errors with exit code 2, determinism."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.conftest import ROOT, run_cli, scenario_dict
from validation.cli import main

SCENARIOS = sorted(p for p in (ROOT / "scenarios").glob("*.yaml") if not p.name.startswith("plan_"))  # plan_*: hetsim plan


def _run(args, capsys) -> tuple[int, str, str]:
    return run_cli(main, args, capsys)


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_simulate_writes_results_trace_and_report(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = _run(["simulate", str(_write(tmp_path, scenario_dict())), "--out", str(out)], capsys)
    assert code == 0
    assert "TTFT" in stdout and "rlb" in stdout
    results = pd.read_csv(out / "results.csv")
    assert list(results.columns) == ["scenario", "variant", "source", "metric", "value", "unit", "device",
                                     "calibration"]
    assert set(results["metric"]) >= {"ttft_s", "tpot_s", "decode_tokens_per_s", "peak_memory_bytes"}
    assert (results["source"] == "simulated").all() and (results["calibration"] == "uncalibrated").all()
    assert "calibration: uncalibrated (no profile" in " ".join(stdout.split())
    per_device = results[results["metric"] == "peak_memory_bytes"]
    assert len(per_device) == 3 * 4 and per_device["device"].notna().all()
    trace = json.loads((out / "trace.json").read_text())
    kinds = {e["ph"] for e in trace["traceEvents"]}
    assert {"X", "C", "M"} <= kinds
    assert "plotly" in (out / "report.html").read_text()[:5_000_000]


def test_two_runs_give_byte_identical_results(tmp_path, capsys):
    path = _write(tmp_path, scenario_dict())
    for name in ("a", "b"):
        assert _run(["simulate", str(path), "--out", str(tmp_path / name)], capsys)[0] == 0
    assert (tmp_path / "a" / "results.csv").read_bytes() == (tmp_path / "b" / "results.csv").read_bytes()


def _bad_cases():
    unknown_field = scenario_dict()
    unknown_field["colour"] = "red"
    negative = scenario_dict()
    negative["cluster"]["hosts"][0]["nic"]["bandwidth"] = "-10Gbit/s"
    unknown_device = scenario_dict()
    unknown_device["cluster"]["hosts"][0]["devices"]["type"] = "tpu_v9"
    return [
        ("malformed", "name: [unclosed\n", "malformed YAML"),
        ("unknown_field", unknown_field, "colour"),
        ("negative_bandwidth", negative, "bandwidth"),
        ("tp_shares", scenario_dict(model="llama-2-7b", parallel={"tensor": 3, "shares": [1, 1]}), "parallel.shares"),
        ("unknown_model", scenario_dict(model="llama-9-1b"), "llama-9-1b"),
        ("unknown_device", unknown_device, "tpu_v9"),
        ("unknown_algorithm", scenario_dict(variants=[{"name": "x", "strategy": "allreduce_ln",
                                                      "allreduce": "telepathy"}]), "telepathy"),
        ("zero_tokens", scenario_dict(workload={"batch_size": 1, "prompt_tokens": 0, "output_tokens": 2}),
         "workload.prompt_tokens"),
    ]


@pytest.mark.parametrize("name,data,needle", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, name, data, needle):
    out = tmp_path / "out"
    code, stdout, stderr = _run(["simulate", str(_write(tmp_path, data)), "--out", str(out)], capsys)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert needle in stderr and "Traceback" not in stderr
    assert not out.exists()


def test_missing_file_is_a_one_line_error(tmp_path, capsys):
    code, _, stderr = _run(["simulate", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "nope.yaml" in stderr and len(stderr.strip().splitlines()) == 1


def test_console_script_reports_errors_without_traceback(tmp_path):
    path = _write(tmp_path, scenario_dict(model="llama-9-1b"))
    proc = subprocess.run([sys.executable, "-c", "from validation.cli import main; main()", "simulate", str(path),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("hetsim: error: model:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_every_shipped_scenario_simulates(path):
    from sim.scenario import load_scenario
    from sim.serving.simulate import simulate_serving
    from sim.simulate import simulate
    from sim.training.simulate import simulate_training
    from sim.vocabulary import WorkloadKind

    scenario = load_scenario(path)
    if scenario.config.workload_kind is WorkloadKind.SERVING:
        served = simulate_serving(scenario)
        assert all(v.metrics["ttft_s"] > 0 and v.metrics["max_request_rate_per_s"] > 0 for v in served.variants)
        return
    if scenario.config.is_training:
        result = simulate_training(scenario)
        assert all(v.metrics["step_time_s"] > 0 for v in result.variants)
        fits = [all(m.total <= result.topology.devices[r].memory_capacity_bytes for r, m in v.memory.items())
                for v in result.variants]
        assert any(fits) != ("rtx3060" in path.stem or "tp4" in path.stem)  # 7B training does not fit 12 GB
        return
    result = simulate(scenario)
    for vr in result.variants:
        assert vr.timing["ttft_s"] > 0 and vr.timing["tpot_s"] > 0
    if "70b" in path.stem and "low_resource" in path.stem:
        assert all(v.overflow is not None for v in result.variants)  # 138 GB over 8 x 8 GiB
    else:
        assert all(v.overflow is None for v in result.variants)


def test_memory_sweep_writes_tables_csv_and_report(tmp_path, capsys):
    data = scenario_dict(variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}])
    data["cluster"]["hosts"][0]["storage"] = {"bandwidth": "1GB/s", "latency": "50us"}
    data["sweep"] = {"models": ["gpt2"], "devices": [1, 4],
                     "memory": [{"policy": "resident"}, {"policy": "sliding_window", "window": 2}]}
    out = tmp_path / "out"
    code, stdout, _ = _run(["simulate", str(_write(tmp_path, data)), "--out", str(out)], capsys)
    assert code == 0
    assert "gpt2" in stdout and "window 2" in stdout and "4 devices" in stdout
    assert "For gpt2 use resident on 1 device (" in stdout  # the sentence: the fastest that fits
    sweep = pd.read_csv(out / "sweep.csv")
    assert len(sweep) == 4 and sweep["fits"].all()
    assert "plotly" in (out / "memory_report.html").read_text()


def test_memory_report_scenario_is_the_default_cluster():
    """The shipped memory report answers its question for the default low-resource scenario."""
    memory = yaml.safe_load((ROOT / "scenarios/low_resource_memory.yaml").read_text())
    default = yaml.safe_load((ROOT / "scenarios/low_resource_llama2_7b.yaml").read_text())
    assert memory["cluster"] == default["cluster"]
    assert memory["sweep"]["devices"] == [2, 4, 6, 8]
    assert memory["sweep"]["models"] == ["llama-2-7b", "llama-2-13b", "llama-2-70b"]


def test_simulate_with_another_clusters_profile_says_what_came_from_where(tmp_path, capsys):
    scenario = ROOT / "scenarios" / "holdout" / "h3x1_delay.yaml"
    other = ROOT / "validation" / "report" / "profiles" / "v4x1_latency.csv"
    code, stdout, _ = _run(["simulate", str(scenario), "--profile", str(other), "--out", str(tmp_path / "a")], capsys)
    assert code == 0
    text = " ".join(stdout.split())
    assert "compute on cpu fp32: same (measured on v4x1_latency)" in text
    assert "link inter_host 200 Mbit/s, 3 ms, burst 32 kB: rescaled" in text
    assert "not replayed" in text and "same-cluster mode" not in text
    # the files say so too: every variant predicted, the report's section lists the terms' verdicts
    assert set(pd.read_csv(tmp_path / "a" / "results.csv")["calibration"]) == {"prediction"}
    report = (tmp_path / "a" / "report.html").read_text()
    came_from = report[report.index("<h2>What came from where</h2>"):]
    assert "calibration: prediction (" in came_from and "in-place collective timings: not applicable" in came_from
    own = ROOT / "validation" / "holdout-report" / "profiles" / "h3x1_delay.csv"
    code, stdout, _ = _run(["simulate", str(scenario), "--profile", str(own), "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "same-cluster mode" in " ".join(stdout.split())
    assert set(pd.read_csv(tmp_path / "b" / "results.csv")["calibration"]) == {"replay"}
    assert "calibration: replay (same-cluster mode" in (tmp_path / "b" / "report.html").read_text()
