"""The HTML reports render in a real browser: each opened in headless Chromium, every plotly figure
must have drawn its traces, and every axis must carry a title (the unit is in it); every report
opens with the sentence saying what to use and why.

The reports: simulate's (inference, layouts compared, training, serving), plan's (inference,
serving, training), a scenario sweep's memory_report.html and a grid sweep's report.html, each of
a small scenario so that the browser, not the simulation, takes the time.

Chromium is the Debian package (``/usr/bin/chromium``), which ``.ci/run`` installs; without it the
test is skipped on a developer's machine and fails in CI (``CI`` set).
"""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from sim.planning.outcome import plan
from sim.planning.plan_config import plan_from_dict
from sim.scenario import load_scenario, scenario_from_dict
from sim.serving.simulate import simulate_serving
from sim.simulate import simulate
from sim.sweep import run_sweep
from sim.training.simulate import simulate_training
from tests.conftest import ROOT, make_scenario, run_cli, scenario_dict
from tests.test_planner import SMALL
from validation.cli import main
from validation.present.plan_report import report_html as plan_html
from validation.present.serving import serving_html
from validation.present.simulate_report import report_html as simulate_html
from validation.present.sweep_report import sweep_html
from validation.present.training_report import training_report_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("chromium is not installed (CI installs it: .ci/run)", allow_module_level=True)


def _rendered(path) -> str:
    """The page's DOM after its scripts ran (plotly draws on load)."""
    assert CHROMIUM is not None, "chromium is required in CI (.ci/run installs it)"
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=10000", "--dump-dom", path.as_uri()],
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def _check_every_figure(html_text: str, tmp_path) -> int:
    figures = re.findall(r'<div id="(figure-\d+)"', html_text)
    assert figures and len(re.findall(r'<div id="', html_text)) == len(figures)  # no figure escapes the check
    assert re.search(r"<p class='answer'>(Use|No|For) ", html_text), "the page does not open with its answer"
    page = tmp_path / "report.html"
    page.write_text(html_text)
    dom = _rendered(page)
    starts = [dom.index(f'<div id="{name}"') for name in figures] + [len(dom)]
    for name, start, end in zip(figures, starts, starts[1:]):
        chunk = dom[start:end]
        assert "js-plotly-plot" in chunk[:200] and 'class="main-svg"' in chunk, f"{name} was not drawn"
        assert re.search(r'class="(trace|point)', chunk), f"{name} drew no trace"
        axes = len(re.findall(r'class="xaxislayer-above"', chunk))
        titled = re.findall(r'class="[xy]\d*title"[^>]*data-unformatted="([^"]+)"', chunk)
        assert len(titled) >= 2 * axes and all(title.strip() for title in titled), f"{name}: an axis without a title"
    return len(figures)


def test_the_simulate_report_renders_every_figure(tmp_path):
    result = simulate(make_scenario())
    assert _check_every_figure(simulate_html(result), tmp_path) >= 4


def test_the_layout_comparison_report_renders_every_figure(tmp_path):
    result = simulate(load_scenario(ROOT / "scenarios" / "layout_qwen25_7b_3x2_rtx4090.yaml"))
    page = simulate_html(result)
    assert "Layouts compared" in page
    assert _check_every_figure(page, tmp_path) == 6


def test_the_plan_report_renders_every_figure(tmp_path):
    result = plan(plan_from_dict(SMALL))
    assert _check_every_figure(plan_html(result), tmp_path) == 3


def test_the_serving_plan_report_renders_every_figure(tmp_path):
    from tests.test_plan_serving import SERVING

    result = plan(plan_from_dict(SERVING))
    assert _check_every_figure(plan_html(result), tmp_path) == 2


def test_the_training_plan_report_renders_every_figure(tmp_path):
    from tests.test_planner import TRAINING

    result = plan(plan_from_dict(TRAINING))
    page = plan_html(result)
    assert "time of one optimizer step (s, log scale)" in page and "trained tokens per second (tokens" in page
    assert _check_every_figure(page, tmp_path) == 3


def test_the_training_simulate_report_renders_every_figure(tmp_path):
    result = simulate_training(load_scenario(ROOT / "tests" / "data" / "training_small.yaml"))
    page = training_report_html(result)
    assert "<p class='answer'>Use base: the shortest optimizer step of the 3 variants that fit" in page
    assert _check_every_figure(page, tmp_path) == 3  # step terms, the baseline's (and fastest's) timeline, memory


def test_the_serving_simulate_report_renders_every_figure(tmp_path):
    result = simulate_serving(load_scenario(ROOT / "tests" / "data" / "serving_small.yaml"))
    page = serving_html(result)
    assert "<p class='answer'>Use allreduce_ring: it sustains " in page and "max rate req/s" in page
    assert _check_every_figure(page, tmp_path) == 1


def test_the_memory_sweep_report_renders_every_figure(tmp_path):
    data = scenario_dict(variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}])
    data["cluster"]["hosts"][0]["storage"] = {"bandwidth": "1GB/s", "latency": "50us"}
    data["sweep"] = {"models": ["gpt2"], "devices": [1, 4],
                     "memory": [{"policy": "resident"}, {"policy": "sliding_window", "window": 2}]}
    page = sweep_html("test", "", run_sweep(scenario_from_dict(data, base_dir=ROOT)))
    assert "<p class='answer'>For gpt2 use " in page
    assert _check_every_figure(page, tmp_path) == 1


def test_the_grid_sweep_report_renders_every_figure(tmp_path, capsys):
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario_dict()))
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump({"axes": {"parallel.tensor": [2, 4],
                                                                 "workload.batch_size": [1, 2]}}))
    code, _, err = run_cli(main, ["sweep", str(tmp_path / "scenario.yaml"), "--grid", str(tmp_path / "grid.yaml"),
                                  "--out", str(tmp_path / "out"), "--workers", "1"], capsys)
    assert code == 0, err
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<p class='answer'>Use parallel.tensor = " in page
    assert _check_every_figure(page, tmp_path) == 4  # TTFT, TPOT, decode tokens/s, peak memory against each axis
