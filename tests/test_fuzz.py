"""Property-based fuzzing of ``hetsim simulate`` (issue 17): mutated shipped scenarios and model
configs give either one clean error line (exit 2, nothing written) or a sane success, within a
time and memory bound, never a traceback. Derandomized, a few dozen examples; the thousands-case
run with a report is ``benchmarks/bench_fuzz.py``."""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from validation import fuzz

_SETTINGS = settings(max_examples=30, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))


@functools.cache
def _seeds() -> tuple[dict, dict]:
    fuzz.warm_imports()
    return fuzz.seed_scenarios(), fuzz.seed_configs()


def _outcome(case: fuzz.Case) -> fuzz.Outcome:
    with tempfile.TemporaryDirectory(prefix="hetsim-fuzz-") as workdir:
        return fuzz.run_case(case, Path(workdir))


@_SETTINGS
@given(mutation=st.sampled_from(sorted(fuzz.MUTATIONS)), seed=st.integers(0, 2**32 - 1))
def test_mutated_scenarios_give_a_clean_error_or_a_sane_success(mutation, seed):
    scenarios, configs = _seeds()
    case = fuzz.make_case(0, random.Random(seed), scenarios, configs, mutation)
    outcome = _outcome(case)
    assert outcome.outcome in ("clean_error", "success"), (case.label, outcome)


_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.none(), st.text(max_size=30), st.sampled_from(fuzz.UNITS),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


@_SETTINGS
@given(data=st.data(), value=_VALUES)
def test_any_value_in_any_field_gives_a_clean_error_or_a_sane_success(data, value):
    scenarios, configs = _seeds()
    seed = data.draw(st.sampled_from(sorted(scenarios)))
    scenario = scenarios[seed]
    path = data.draw(st.sampled_from(fuzz.value_paths(scenario)))
    mutated = yaml.safe_load(yaml.safe_dump(scenario))
    fuzz.set_value(mutated, path, value)
    case = fuzz.Case(0, seed, "hypothesis", f"{path}={value!r}", yaml.safe_dump(mutated).encode(), None)
    outcome = _outcome(case)
    assert outcome.outcome in ("clean_error", "success"), (case.label, outcome)
