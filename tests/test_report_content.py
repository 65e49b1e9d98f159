"""What the reports say and how they draw it. The sentence each opens with says which configuration
to use and why, from its results: a training scenario's fastest variant that fits and the term that
makes its lead, a memory sweep's fastest policy that fits and what faster one does not (a grid
sweep's: tests/test_sweep_grid.py; every report page carries its sentence and titles every axis:
tests/test_reports_render.py). Every op kind, step term, training term and memory category has a
colour of its own, and a variant the same colour in every report."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
import yaml

from models.ops import OpKind
from sim.bottleneck import StepTerm
from sim.scenario import load_scenario, scenario_from_dict
from sim.serving.simulate import simulate_serving
from sim.simulate import simulate
from sim.training.simulate import MEMORY_CATEGORIES
from sim.training.metrics import STEP_TERMS, step_terms
from sim.training.simulate import simulate_training
from sim.vocabulary import Metric
from tests.conftest import ROOT
from validation.present.colors import (MEMORY_CATEGORY_COLORS, OP_KIND_COLORS, STEP_TERM_COLORS,
                                       TRAINING_TERM_COLORS, category_colors)
from validation.present.serving import serving_html
from validation.present.simulate_report import report_html
from validation.present.sweep_report import memory_verdict
from validation.present.training_report import recommendation

_GIB = 2**30


def _training(memory: str | None = None):
    document = yaml.safe_load((ROOT / "tests" / "data" / "training_small.yaml").read_text())
    if memory is not None:
        document["cluster"]["hosts"][0]["devices"]["memory"] = memory
    return simulate_training(scenario_from_dict(document, base_dir=ROOT))


def test_the_training_sentence_names_the_fastest_variant_and_the_term_of_its_lead():
    result = _training()
    by_step = sorted(result.variants, key=lambda v: v.metrics[Metric.STEP_TIME])
    best, runner_up = by_step[0], by_step[1]
    ours, theirs = step_terms(best.metrics), step_terms(runner_up.metrics)
    term = max(STEP_TERMS, key=lambda m: theirs[m] - ours[m])
    sentence = recommendation(result)
    # base is the baseline here, so its lead is over the runner-up
    assert sentence.startswith(f"Use {best.variant.name}: the shortest optimizer step of the 3 variants that fit")
    assert f"below the runner-up {runner_up.variant.name} because its {STEP_TERMS[term]} is " in sentence
    assert "; its step is bound by exposed communication (" in sentence
    for v in result.variants:  # the terms the sentence and the figure split a step into add up to it
        assert sum(step_terms(v.metrics).values()) == pytest.approx(v.metrics[Metric.STEP_TIME], rel=1e-3)


@pytest.mark.parametrize("memory, expected", [
    ("2.9GiB", "Use acc: the only one of the 3 variants that fits in memory ("),  # checkpointing fits, base does not
    ("1GiB", "No variant fits in memory (the leanest, acc, needs 2.82 GiB on h0/dev0 of its 1.00 GiB): "),
])
def test_the_training_sentence_ranks_only_the_variants_that_fit(memory, expected):
    assert recommendation(_training(memory)).startswith(expected)


def _sweep(rows: list[tuple]) -> pd.DataFrame:
    """Sweep rows (:data:`sim.sweep.SWEEP_COLUMNS`, those the sentence reads) of 8 GiB devices:
    (model, devices, policy, window, feasible, peak GiB, TPOT s[, note])."""
    return pd.DataFrame([{"model": model, "devices": devices, "memory_policy": policy, "window": window,
                          "retain_every": math.nan, "variant": "v", "feasible": feasible,
                          "fits": feasible and peak <= 8, Metric.MAX_PEAK_MEMORY: peak * _GIB,
                          Metric.MEMORY_CAPACITY: 8 * _GIB, Metric.TPOT: tpot, "note": note[0] if note else ""}
                         for model, devices, policy, window, feasible, peak, tpot, *note in rows])


def test_the_memory_sentence_picks_per_model_the_fastest_that_fits_and_says_what_it_gives_up():
    sweep = _sweep([
        ("a", 2, "resident", math.nan, True, 12.0, 0.5),  # fastest, but does not fit
        ("a", 4, "resident", math.nan, True, 6.0, 0.8),
        ("a", 2, "sliding_window", 2, True, 2.0, 3.0),
        ("a", 6, "resident", math.nan, False, math.nan, math.nan),  # cannot run: never named
        ("b", 2, "sliding_window", 2, True, 2.0, 1.0),
        ("b", 4, "sliding_window", 2, True, 1.5, 0.9),
        ("c", 2, "resident", math.nan, True, 30.0, 2.0),
        ("c", 4, "resident", math.nan, True, 15.0, 1.5),
        ("d", 2, "resident", math.nan, True, 7.0, 0.9),
        ("d", 3, "resident", math.nan, True, 5.0, 0.7, "uneven shares by memory (default: ...)"),  # named so
    ])
    assert memory_verdict(sweep) == (
        "For a use resident on 4 devices (800 ms per token, 6.00 of 8 GiB per device), the lowest TPOT that fits "
        "(resident on 2 devices would take 500 ms but needs 12.00 GiB); "
        "for b use window 2 on 4 devices (900 ms per token, 1.50 of 8 GiB per device), the lowest TPOT that fits "
        "(window 2 fits on as few as 2 devices, at 1.00 s per token); "
        "no policy fits c on up to 4 devices (the leanest, resident on 4 devices, needs 15.00 of 8 GiB per device); "
        "for d use resident on 3 devices split unevenly (700 ms per token, 5.00 of 8 GiB per device), the lowest "
        "TPOT that fits (resident fits on as few as 2 devices, at 900 ms per token).")


def test_every_op_kind_and_term_has_a_colour_of_its_own():
    assert set(OP_KIND_COLORS) == {kind.value for kind in OpKind}
    assert set(STEP_TERM_COLORS) == {term.value for term in StepTerm}
    assert len(set(STEP_TERM_COLORS.values())) == len(StepTerm)
    assert set(TRAINING_TERM_COLORS) == {m.value for m in STEP_TERMS}
    assert len(set(TRAINING_TERM_COLORS.values())) == len(STEP_TERMS)
    assert set(MEMORY_CATEGORY_COLORS) == {m.value for m in MEMORY_CATEGORIES}
    assert len(set(MEMORY_CATEGORY_COLORS.values())) == len(MEMORY_CATEGORIES)


def _traces(page: str) -> list[dict]:
    """Every trace of every plotly figure of a report page (the data each ``Plotly.newPlot`` draws)."""
    decoder, traces = json.JSONDecoder(), []
    for match in re.finditer(r'Plotly\.newPlot\(\s*"figure-\d+",\s*', page):
        traces += decoder.raw_decode(page, match.end())[0]
    return traces


def _colour(trace: dict) -> str | None:
    return trace.get("line", {}).get("color") or trace.get("marker", {}).get("color")


def test_a_variant_has_the_same_colour_in_the_serving_and_the_simulate_report():
    serving = simulate_serving(load_scenario(ROOT / "tests" / "data" / "serving_small.yaml"))
    document = yaml.safe_load((ROOT / "tests" / "data" / "serving_small.yaml").read_text())
    document["workload"] = {"batch_size": 1, "prompt_tokens": 32, "output_tokens": 4}
    batch = simulate(scenario_from_dict(document, base_dir=ROOT))
    names = {v.variant.name for v in batch.variants}
    assert names == {v.variant.name for v in serving.variants}
    for page in (serving_html(serving), report_html(batch)):
        drawn = {(t["name"], _colour(t)) for t in _traces(page) if t.get("name") in names}
        assert drawn == set(category_colors(names).items())
