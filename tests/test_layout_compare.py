"""Layouts compared (sim/layout_compare.py): the winner of each metric, the term that decides it,
the devices each variant leaves idle, and the shipped layout scenarios."""

import math

import pytest
import yaml

from sim.bottleneck import StepTerm, step_breakdown
from sim.layout_compare import COMPARED, compare_layouts, layouts_differ
from sim.scenario import load_scenario, scenario_from_dict
from sim.simulate import simulate
from sim.units import duration_text
from sim.vocabulary import Metric, PhaseKind
from tests.conftest import ROOT, run_cli, scenario_dict
from validation.cli import main
from validation.present.layout import idle_warnings
from validation.present.simulate_report import report_html

QWEN = ROOT / "scenarios" / "layout_qwen25_7b_3x2_rtx4090.yaml"
LOW_RESOURCE = ROOT / "scenarios" / "layout_low_resource_llama2_7b.yaml"


@pytest.fixture(scope="module")
def qwen():
    return simulate(load_scenario(QWEN))


@pytest.fixture(scope="module")
def low_resource():
    return simulate(load_scenario(LOW_RESOURCE))


def test_the_shipped_layout_scenarios_compare_every_layout_they_name(qwen, low_resource):
    assert [vr.layout.label for vr in qwen.variants] == ["TP=2 x PP=3", "PP=6", "TP=6 uneven", "TP=2 x 3 replicas",
                                                         "TP=2"]
    assert [vr.layout.label for vr in low_resource.variants] == ["TP=8", "PP=8", "TP=2 x PP=4", "TP=4 x PP=2"]
    for result in (qwen, low_resource):
        assert layouts_differ(result)
        assert all(vr.overflow is None for vr in result.variants)
        comparison = compare_layouts(result)
        assert len(comparison.sentences()) == len(COMPARED)
        assert all(set(row.breakdown) == {PhaseKind.PREFILL, PhaseKind.DECODE} for row in comparison.rows)


@pytest.mark.parametrize("which", ["qwen", "low_resource"])
def test_the_sentence_names_the_true_winner_of_each_metric(which, request):
    result = request.getfixturevalue(which)
    comparison = compare_layouts(result)
    for verdict, sentence in zip(comparison.verdicts, comparison.sentences()):
        values = {vr.variant.name: vr.timing[verdict.metric] for vr in result.variants}
        best = (max if verdict.metric == Metric.DECODE_TOKENS_PER_S else min)(values, key=values.get)
        ranked = sorted(values.values(), reverse=verdict.metric == Metric.DECODE_TOKENS_PER_S)
        assert verdict.winner.variant == best
        assert values[verdict.runner_up.variant] == ranked[1]
        assert f": {verdict.winner.title} wins, " in sentence and f" for {verdict.runner_up.title}" in sentence


@pytest.mark.parametrize("which", ["qwen", "low_resource"])
def test_the_decisive_term_is_the_largest_difference_of_the_breakdowns(which, request):
    result = request.getfixturevalue(which)
    for verdict in compare_layouts(result).verdicts:
        if verdict.metric == Metric.DECODE_TOKENS_PER_S:
            continue
        step = 0 if verdict.metric == Metric.TTFT else 1
        ours = step_breakdown(result, result.variant(verdict.winner.variant), step)
        theirs = step_breakdown(result, result.variant(verdict.runner_up.variant), step)
        differences = {t: theirs.get(t, 0.0) - ours.get(t, 0.0) for t in StepTerm}
        assert verdict.term == max(differences, key=differences.get)
        assert verdict.term_s == pytest.approx(differences[verdict.term])
        assert verdict.gap_s == pytest.approx(sum(differences.values()))


def test_the_low_resource_pipeline_wins_tpot_by_the_allreduces_it_does_not_make(low_resource):
    tpot = next(v for v in compare_layouts(low_resource).verdicts if v.metric == Metric.TPOT)
    assert (tpot.winner.variant, tpot.runner_up.variant, tpot.term) == ("pp8", "tp2_pp4", StepTerm.ALLREDUCE)
    assert "allreduce between hosts (300 Mbit/s)" in tpot.sentence()


@pytest.mark.parametrize("variant", ["tp2_pp3", "pp6", "tp6_uneven", "tp2_x3", "tp2"])
def test_a_step_breakdown_adds_up_to_the_step(qwen, variant):
    vr = qwen.variant(variant)
    for step, metric in ((0, Metric.TTFT), (1, Metric.TPOT)):
        terms = step_breakdown(qwen, vr, step)
        trace = max(vr.replicas, key=lambda r: r.timing[metric]).trace if vr.replicas else vr.trace
        steps = trace.steps.set_index("step")
        assert sum(terms.values()) == pytest.approx(steps.at[step, "end_s"] - steps.at[step, "start_s"], rel=1e-9)
        assert all(seconds >= -1e-12 for seconds in terms.values())
    # A pipeline idles in its bubble; tensor parallelism over one host's pair hardly waits.
    if variant in ("tp2_pp3", "pp6"):
        assert step_breakdown(qwen, vr, 1)[StepTerm.IDLE] > 0.1 * vr.timing[Metric.TPOT]
        assert StepTerm.SEND in step_breakdown(qwen, vr, 1)


def test_each_variant_names_the_devices_its_own_layout_leaves_idle(qwen, tmp_path, capsys):
    rows = {row.variant: row for row in compare_layouts(qwen).rows}
    assert rows["tp2"].idle == ("pc1/dev0", "pc1/dev1", "pc2/dev0", "pc2/dev1")
    assert rows["tp2"].used == ("pc0/dev0", "pc0/dev1")
    assert all(not row.idle for name, row in rows.items() if name != "tp2")
    warnings = idle_warnings(qwen)
    assert warnings == ["warning: tp2: 4 of 6 devices idle: pc1/dev0, pc1/dev1, pc2/dev0, pc2/dev1 (the layout uses "
                        "2: TP=2; set parallel.tensor or parallel.replicas to use them)"]
    assert warnings[0].replace("'", "&#x27;") in report_html(qwen)
    code, out, _ = run_cli(main, ["simulate", str(QWEN), "--out", str(tmp_path)], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert "warning: tp2: 4 of 6 devices idle: pc1/dev0, pc1/dev1, pc2/dev0, pc2/dev1" in text
    for sentence in compare_layouts(qwen).sentences():
        assert " ".join(sentence.split()) in text


def test_a_scenario_without_layouts_of_its_own_prints_no_comparison(tmp_path, capsys):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario_dict()))
    code, out, _ = run_cli(main, ["simulate", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and "Layouts compared" not in out


@pytest.mark.parametrize("seconds, text", [(19.3, "19.3 s"), (19300.0, "19300 s"), (1.0, "1.00 s"),
                                           (0.1379, "138 ms"), (0.0151, "15.1 ms"), (4.56e-5, "45.6 us"),
                                           (math.nan, "")])
def test_durations_print_in_the_unit_that_suits_them_never_in_exponent_form(seconds, text):
    assert duration_text(seconds) == text


def test_a_layout_that_does_not_fit_in_memory_never_wins():
    data = yaml.safe_load(QWEN.read_text())
    data["workload"]["output_tokens"] = 8
    data["cluster"]["hosts"][0]["devices"]["memory"] = "5GiB"  # TP 2's 7.6 GB of weights do not fit
    result = simulate(scenario_from_dict(data))
    comparison = compare_layouts(result)
    assert {vr.variant.name for vr in result.variants if vr.overflow is not None} == {"tp2_x3", "tp2"}
    assert {v.winner.variant for v in comparison.verdicts} | {v.runner_up.variant for v in comparison.verdicts} \
        <= {"tp2_pp3", "pp6", "tp6_uneven"}
    assert comparison.sentences()[-1] == ("Not ranked, as they do not fit in memory: tp2_x3 (TP=2 x 3 replicas), "
                                          "tp2 (TP=2).")
