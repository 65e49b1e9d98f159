"""The published-measurement check (validation/published, issue 18 item 5): its scenarios load and
simulate without a profile, every row is labelled a prediction, and a bad case file is refused
naming the field. The error values themselves are the report's, not asserted here."""

import math
from pathlib import Path

import pytest

from models.errors import ConfigError
from sim.scenario import load_scenario
from validation.published_check import CASES_FILE, compare, load_cases, report_markdown


def test_every_published_scenario_loads_and_every_case_simulates():
    cases, not_represented = load_cases()
    scenarios = sorted(CASES_FILE.parent.glob("*.yaml"))
    named = {case.scenario for case in cases}
    assert set(scenarios) - {CASES_FILE} == named, "a scenario of validation/published that no case uses, or the reverse"
    for path in named:
        load_scenario(path)
    table = compare(cases)
    assert list(table["id"]) == [case.id for case in cases]
    assert (table["kind"] == "prediction").all()
    assert all(math.isfinite(v) and v > 0 for v in table["simulated"])
    assert table["error"].tolist() == pytest.approx((table["simulated"] / table["published"] - 1).tolist())
    assert all(table["dominant"]), "every case names what dominates its simulated step or where its peak is"
    pipelines = table[~table["setup"].str.contains(" x PP 1 ")]
    assert len(pipelines) >= 2, "issue 20 is checked against published figures of pipelines (llama.cpp's layer split)"
    text = report_markdown(table, not_represented, "cmd")
    assert all(case.id in text for case in cases) and "prediction" in text
    assert not_represented and all(m["why"] for m in not_represented)


def _write_cases(tmp_path: Path, **override) -> Path:
    (tmp_path / "s.yaml").write_text((CASES_FILE.parent / "lmdeploy_a100_tp1_llama2_7b.yaml").read_text())
    case = {"id": "x", "scenario": "s.yaml", "variant": "tp1", "metric": "tpot_s", "published": 0.01,
            "published_text": "10 ms", "system": "s", "source": "src", "reading": "r", **override}
    lines = ["cases:", "  - " + "\n    ".join(f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {v}"
                                            for k, v in case.items())]
    path = tmp_path / "cases.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("override, field", [
    ({"metric": "watts"}, "cases[0].metric"),
    ({"published": -1}, "cases[0].published"),
    ({"scenario": "missing.yaml"}, "cases[0].scenario"),
])
def test_a_bad_case_is_refused_naming_its_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as error:
        load_cases(_write_cases(tmp_path, **override))
    assert str(error.value).startswith(field)


def test_a_bad_not_represented_entry_is_refused(tmp_path):
    path = _write_cases(tmp_path)
    path.write_text(path.read_text() + "not_represented:\n  - {source: x}\n")
    with pytest.raises(ConfigError) as error:
        load_cases(path)
    assert str(error.value).startswith("not_represented[0]")


def test_an_unknown_variant_is_refused_naming_the_known_ones(tmp_path):
    cases, _ = load_cases(_write_cases(tmp_path, variant="tp9"))
    with pytest.raises(ConfigError, match="tp1"):
        compare(cases)
