"""The published-measurement check (validation/published, issues 18 item 5 and 19): its scenarios
load and simulate without a profile, inference and training alike, every row is labelled a
prediction, a bad case file is refused naming the field, and the training step times derived from
Megatron-LM's table follow from its printed figures by the paper's own FLOP count. The error
values themselves are the report's, not asserted here."""

import math
import re
from pathlib import Path

import pytest

from models.errors import ConfigError
from sim.scenario import load_scenario
from sim.topology import build_topology
from sim.training.metrics import STEP_TERMS
from validation.published_check import CASES_FILE, TRAINING_METRICS, compare, load_cases, report_markdown


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


def test_a_training_case_is_simulated_as_training_and_explained_by_the_steps_terms(tmp_path):
    (tmp_path / "t.yaml").write_text((CASES_FILE.parent / "llmc_gpt2_124m_8x_a100.yaml").read_text())
    common = "scenario: t.yaml, variant: llmc, published_text: p, system: s, source: src, reading: r"
    (tmp_path / "cases.yaml").write_text(
        "cases:\n"
        f"  - {{id: step, metric: step_time_s, published: 0.3, {common}}}\n"
        f"  - {{id: peak, metric: max_peak_memory_bytes, published: 50000000000, {common}}}\n")
    table = compare(load_cases(tmp_path / "cases.yaml")[0])
    step, peak = table.iloc[0], table.iloc[1]
    assert step["kind"] == peak["kind"] == "prediction"
    assert step["error"] == pytest.approx(step["simulated"] / 0.3 - 1)
    assert "TP 1 x DP 8" in step["setup"] and "ZeRO-1" in step["setup"]
    terms = {name: int(share.rstrip("%")) for name, share in
             (part.rsplit(" ", 1) for part in step["breakdown"].split(", "))}
    assert set(terms) == set(STEP_TERMS.values()), "every term of the step, named as reports name it"
    assert 95 <= sum(terms.values()) <= 105, "the terms make about the whole step"
    assert step["dominant"].startswith(max(terms, key=terms.get))
    assert peak["dominant"].startswith("peak on ") and "activations" in peak["breakdown"]


@pytest.mark.parametrize("scenario, variant, metric", [
    ("t.yaml", "llmc", "tpot_s"),  # a training scenario has no decode step
    ("s.yaml", "tp1", "step_time_s"),  # an inference scenario has no optimizer step
])
def test_a_metric_of_the_other_kind_of_scenario_is_refused(tmp_path, scenario, variant, metric):
    (tmp_path / "t.yaml").write_text((CASES_FILE.parent / "llmc_gpt2_124m_8x_a100.yaml").read_text())
    cases, _ = load_cases(_write_cases(tmp_path, scenario=scenario, variant=variant, metric=metric))
    with pytest.raises(ConfigError) as error:
        compare(cases)
    assert str(error.value).startswith("cases[x].metric")


def test_megatron_step_times_follow_from_the_printed_throughput_by_the_papers_flop_count():
    """Narayanan et al. 2021 (arXiv 2104.04473), appendix eq. 3: F = 96 B s l h^2 (1 + s/6h + V/16lh)
    FLOPs per iteration; the step is F / (GPUs x the printed teraFLOP/s per GPU)."""
    cases = [case for case in load_cases()[0] if case.id.startswith("megatron_")]
    assert len(cases) == 4
    for case in cases:
        scenario = load_scenario(case.scenario)
        model, workload = scenario.model, scenario.config.workload
        b, s, l, h, v = (workload.global_batch_size, workload.sequence_length, model.num_layers,
                         model.hidden_size, model.vocab_size)
        flops = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
        per_gpu = float(re.match(r"(\d+) teraFLOP/s per GPU", case.published_text).group(1)) * 1e12
        gpus = len(build_topology(scenario.config.cluster).devices)
        assert case.metric in TRAINING_METRICS
        assert case.published == pytest.approx(flops / (gpus * per_gpu), rel=1e-4), case.id
