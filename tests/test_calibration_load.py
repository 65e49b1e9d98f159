"""A profile records the machine load its calibration ran under (issue 18 item 3): the context's
load row is written and read back, profiles without it still load, and a profile calibrated under
heavy load is flagged where it is used. Likewise the model a training calibration trained
(issue 19): read back, absent from older profiles, refused in one line where it is no model."""

import dataclasses
import json

import pytest

from models.catalog import get_model
from models.errors import ConfigError
from sim.context import LOADED_OTHER_LOAD, ContextTerm, load_rows, load_warning, profile_contexts
from sim.profile import load_profile, with_rows
from sim.vocabulary import MeasurementKind
from tests.conftest import ROOT, run_cli

SHIPPED = ROOT / "validation" / "report" / "profiles" / "v2x2_bandwidth.csv"  # written before load rows existed


def _with_load(tmp_path, other_load: float):
    rows = load_profile(SHIPPED).rows
    path = tmp_path / "profile.csv"
    path.write_text(with_rows(rows, load_rows("v2x2_bandwidth", 0.02, other_load)).to_csv(index=False,
                                                                                          lineterminator="\n"))
    return path


def test_load_row_round_trips_through_the_profile_file(tmp_path):
    profile = load_profile(_with_load(tmp_path, 0.31))
    (context,) = profile_contexts(profile.rows)
    assert (context.cpu_steal, context.other_load) == (0.02, 0.31)
    # the other context terms are untouched by the added row
    (old,) = profile_contexts(load_profile(SHIPPED).rows)
    assert (context.cores, context.links, context.backend) == (old.cores, old.links, old.backend)


def test_profile_without_load_row_loads_with_load_unknown_and_no_warning():
    (context,) = profile_contexts(load_profile(SHIPPED).rows)
    assert context.cpu_steal is None and context.other_load is None
    assert load_warning((context,)) == ""


def test_unreadable_load_writes_no_row():
    assert load_rows("x", float("nan"), 0.5) == [] and load_rows("x", 0.0, float("nan")) == []


def test_warning_only_above_the_threshold_and_on_one_line(tmp_path):
    (quiet,) = profile_contexts(load_profile(_with_load(tmp_path, LOADED_OTHER_LOAD)).rows)
    assert load_warning((quiet,)) == ""
    (busy,) = profile_contexts(load_profile(_with_load(tmp_path, 0.31)).rows)
    warning = load_warning((busy,))
    assert "31.0%" in warning and "v2x2_bandwidth" in warning and "inflated" in warning and "\n" not in warning


def test_plan_with_a_loaded_profile_says_so(tmp_path, capsys):
    from validation.cli import main

    code, out, _ = run_cli(main, ["plan", str(ROOT / "validation" / "plan-check" / "plan.yaml"), "--out",
                                  str(tmp_path / "out"), "--profile", str(_with_load(tmp_path, 0.31))], capsys)
    assert code in (0, 3)  # 3: no configuration meets every objective, outputs written
    assert "other processes took 31.0%" in " ".join(out.split())


def _tiny_scenario(tmp_path):
    """A one-layer GPT-2 on two CPU ranks of one host, one variant: a launch of seconds."""
    import yaml

    from tests.conftest import cluster, scenario_dict, tiny_model_config

    model = tmp_path / "gpt2.config.json"
    model.write_text(json.dumps(dict(tiny_model_config("gpt2", num_layers=1), n_positions=256)))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(scenario_dict(
        name="calload", model=str(model), dtype="fp32", cluster=cluster(2, 1, device="cpu"),
        workload={"batch_size": 1, "prompt_tokens": 5, "output_tokens": 2},
        variants=[{"name": "a", "strategy": "allreduce_ln", "allreduce": "library", "broadcast": "library"}])))
    return scenario


def test_calibrate_records_and_prints_the_load_it_ran_under(tmp_path, capsys):
    pytest.importorskip("torch")
    from validation.cli import main

    scenario = _tiny_scenario(tmp_path)
    profile = tmp_path / "profile.csv"
    code, out, err = run_cli(main, ["calibrate", str(scenario), "--out", str(profile), "--repeats", "1",
                                    "--max-call", "0.01"], capsys)
    assert code == 0, err
    (context,) = profile_contexts(load_profile(profile).rows)
    assert 0 <= context.cpu_steal <= 1 and 0 <= context.other_load <= 1
    # the ops timed alone at each width the 2 ranks take (runtime.shape_bench)
    assert set(load_profile(profile).of("compute_isolated")["group_size"]) == {1, 2}
    # the runtime schedules' reduction at every size, in the model's dtype (runtime.reduction_bench)
    from runtime.reduction_bench import REDUCTION_SIZES

    reductions = load_profile(profile).of("reduction")
    assert sorted(reductions["size_bytes"]) == list(REDUCTION_SIZES)
    assert set(reductions["dtype"]) == {context.devices[0][1]}
    assert f"other processes {context.other_load:.1%}" in " ".join(out.split())
    # the machine's speed around the launch: every reference op, timed (sim.machine_speed)
    assert {op for op, _ in context.reference_s} == {"matmul", "stream"}
    assert all(seconds > 0 for _, seconds in context.reference_s)
    assert "machine speed (reference op set, median): matmul" in " ".join(out.split())


def test_rewriting_a_profiles_context_keeps_its_recorded_load(tmp_path):
    from sim.scenario import load_scenario
    from validation.transfer import SHIPPED_BACKEND, SHIPPED_CORES, SHIPPED_TORCH, add_context

    path = _with_load(tmp_path, 0.31)
    add_context(path, load_scenario(ROOT / "scenarios" / "validation" / "v2x2_bandwidth.yaml"), cores=SHIPPED_CORES,
                backend=SHIPPED_BACKEND, torch_version=SHIPPED_TORCH)
    (context,) = profile_contexts(load_profile(path).rows)
    assert (context.cpu_steal, context.other_load) == (0.02, 0.31)


def test_validates_interleaved_profile_records_its_calibration_rounds_load(tmp_path):
    pytest.importorskip("torch")
    from runtime.interleaved import launch_interleaved
    from sim.scenario import load_scenario

    scenario = load_scenario(_tiny_scenario(tmp_path))
    run = launch_interleaved(scenario, [scenario], testbed=False, repeats=1, warmup=0, min_timed_s=0.0,
                             calibration_repeats=1, max_call_s=0.01, used_only=True)
    (context,) = profile_contexts(run.profile)
    assert (context.cpu_steal, context.other_load) == (run.calibration_cpu_steal, run.calibration_other_load)
    # one launch calibrated and measured: the profile records the reference timing made around it
    assert dict(context.reference_s) == run.reference_s and set(run.reference_s) == {"matmul", "stream"}
    # it holds what hetsim calibrate times alone: the ops by shard width, the reductions, the
    # memory bandwidth the ranks shared (a layout or cluster it did not run is priced by them)
    assert {MeasurementKind.COMPUTE_ISOLATED, MeasurementKind.REDUCTION} <= set(run.profile["measurement"])
    assert len(context.stream_bytes_per_s) >= 1


def _with_model_row(tmp_path, value: dict):
    rows = load_profile(SHIPPED).rows
    row = {"measurement": "context", "call": "v2x2_bandwidth", "op": ContextTerm.MODEL.value,
           "device_class": value.get("name"), "method": json.dumps(value, sort_keys=True)}
    path = tmp_path / "profile.csv"
    path.write_text(with_rows(rows, [row]).to_csv(index=False, lineterminator="\n"))
    return path


def test_the_trained_model_round_trips_through_the_profile_file_and_a_profile_without_it_has_none(tmp_path):
    model = dataclasses.replace(get_model("tinyllama-1.1b"), name="my-llama", num_layers=3)
    (context,) = profile_contexts(load_profile(_with_model_row(tmp_path, dataclasses.asdict(model))).rows)
    assert context.model == model
    (old,) = profile_contexts(load_profile(SHIPPED).rows)
    assert old.model is None and (context.links, context.cores) == (old.links, old.cores)


@pytest.mark.parametrize("change, named", [({"num_layers": 0}, "model.num_layers"), ({"hidden_size": None}, "hidden_size")])
def test_a_model_row_that_is_not_a_model_is_refused_in_one_line(tmp_path, change, named):
    value = {**dataclasses.asdict(get_model("gpt2")), **change}
    if change.get("hidden_size", 1) is None:
        del value["hidden_size"]  # a field missing
    with pytest.raises(ConfigError) as error:
        load_profile(_with_model_row(tmp_path, value))
    assert error.value.field == "profile" and "unreadable context row" in error.value.message
    assert named in error.value.message and "\n" not in str(error.value)
