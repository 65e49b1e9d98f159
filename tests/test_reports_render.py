"""The HTML reports render in a real browser: each opened in headless Chromium, every plotly figure
must have drawn its traces, and every axis must carry a title (the unit is in it).

Chromium is the Debian package (``/usr/bin/chromium``), which ``.ci/run`` installs; without it the
test is skipped on a developer's machine and fails in CI (``CI`` set).
"""

import os
import re
import shutil
import subprocess

import pytest

from sim.planning.outcome import plan
from sim.planning.plan_config import plan_from_dict
from sim.scenario import load_scenario
from sim.simulate import simulate
from tests.conftest import ROOT, make_scenario
from tests.test_planner import SMALL
from validation.present.plan_report import report_html as plan_html
from validation.present.simulate_report import report_html as simulate_html

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
    assert figures
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
