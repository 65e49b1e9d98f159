"""A training scenario simulated from a calibration profile: forward, backward and optimizer ops
priced from the profile's rows, what it lacks modelled and said so, from the library and the CLI."""

import pandas as pd
import pytest

from sim.profile import MeasurementKind, Profile, profile_frame
from sim.program import Gradient
from sim.training.lower import StepShape, lower_step
from sim.training.simulate import simulate_training
from sim.vocabulary import Metric
from tests.conftest import run_cli
from tests.test_training_sim import _scenario
from validation.cli import main

_ROWS = {None: MeasurementKind.COMPUTE, Gradient.INPUT: MeasurementKind.BACKWARD_INPUT,
         Gradient.WEIGHT: MeasurementKind.BACKWARD_WEIGHT}


def _profile(scenario, seconds: float, training_rows: bool = True) -> Profile:
    """A profile timing every compute op of ``scenario``'s first variant's step at ``seconds``,
    at the op's own FLOPs and bytes (so no interpolation is needed)."""
    settings = scenario.training_settings(scenario.config.variants[0])
    workload = scenario.config.workload
    shape = StepShape(scenario.model.with_dtype("fp32"), settings, workload.micro_batch_size,
                      workload.sequence_length, 1, ((0,), (1,)))
    rows = {}
    for part in lower_step(shape, sync_gradients=True, average_parameters=False).segments:
        for op in part.segment.programs[0]:
            if op.cost is None or op.kind == "gradient_cast":
                continue
            optimizer = op.kind == "optimizer_step"
            measurement = MeasurementKind.OPTIMIZER_STEP if optimizer else _ROWS[op.gradient]
            if measurement != MeasurementKind.COMPUTE and not training_rows:
                continue
            rows[(measurement, op.kind, op.cost.flops, op.traffic_bytes)] = {
                "measurement": measurement, "device_class": "cpu", "op": settings.optimizer.value if optimizer
                else op.kind.value, "group_size": 1, "batch_size": workload.micro_batch_size,
                "new_tokens": workload.sequence_length, "context_tokens": workload.sequence_length,
                "dtype": "fp32", "flops": op.cost.flops, "traffic_bytes": op.traffic_bytes,
                "median": seconds, "p10": seconds, "p90": seconds, "mean": seconds, "unit": "s", "repeats": 3,
                "method": "test"}
    return Profile(profile_frame(list(rows.values())))


def _cpu_scenario(**overrides):
    return _scenario([{"name": "ddp"}], hosts=2, training={"optimizer": "adamw", "precision": "fp32"}, **overrides)


def test_compute_twice_as_slow_in_the_profile_is_twice_as_slow_in_the_step():
    scenario = _cpu_scenario()
    fast = simulate_training(scenario, _profile(scenario, 1e-4))
    slow = simulate_training(scenario, _profile(scenario, 2e-4))
    for metric in (Metric.FORWARD_TIME, Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME):
        assert slow.variants[0].metrics[metric] == pytest.approx(2 * fast.variants[0].metrics[metric], rel=1e-9)
    assert fast.calibrated and any(t.startswith("backward_weight mlp_up") for t in fast.calibrated_terms)
    assert "optimizer_step adamw on cpu" in fast.calibrated_terms
    # a profile's times, not the roofline's: the uncalibrated step differs
    assert simulate_training(scenario).variants[0].metrics[Metric.FORWARD_TIME] != fast.variants[0].metrics[Metric.FORWARD_TIME]


def test_a_profile_without_training_rows_prices_backward_and_optimizer_by_the_roofline_and_says_so():
    scenario = _cpu_scenario()
    uncalibrated = simulate_training(scenario).variants[0].metrics
    result = simulate_training(scenario, _profile(scenario, 1e-4, training_rows=False))
    metrics = result.variants[0].metrics
    assert metrics[Metric.BACKWARD_TIME] == pytest.approx(uncalibrated[Metric.BACKWARD_TIME], rel=1e-9)
    assert metrics[Metric.OPTIMIZER_TIME] == pytest.approx(uncalibrated[Metric.OPTIMIZER_TIME], rel=1e-9)
    assert metrics[Metric.FORWARD_TIME] != pytest.approx(uncalibrated[Metric.FORWARD_TIME], rel=1e-3)
    assert "backward_input mlp_up on cpu: not calibrated, roofline" in result.extrapolated
    assert "optimizer_step adamw on cpu: not calibrated, roofline" in result.extrapolated
    assert any("not calibrated" in line and "allreduce" in line for line in result.extrapolated)


def test_hetsim_simulate_takes_a_profile_for_a_training_scenario(tmp_path, capsys):
    import yaml

    scenario = _cpu_scenario()
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(scenario.config.model_dump(mode="json", by_alias=True, exclude_none=True)))
    profile = tmp_path / "profile.csv"
    profile.write_text(_profile(scenario, 1e-4, training_rows=False).rows.to_csv(index=False))
    code, out, _ = run_cli(main, ["simulate", str(path), "--profile", str(profile), "--out", str(tmp_path / "out")],
                           capsys)
    assert code == 0
    assert "calibrated from" in out and "backward_input mlp_up on cpu: not calibrated, roofline" in out
    assert set(pd.read_csv(tmp_path / "out" / "results.csv")["source"]) == {"simulated"}


def test_a_tensor_parallel_step_from_a_data_parallel_profile_says_its_shard_is_scaled_from_whole_layers():
    scenario = _cpu_scenario(parallel={"tensor": 2, "data": 2}, devices_per_host=2)
    result = simulate_training(scenario, _profile(_cpu_scenario(), 1e-4))  # rows of whole layers (tensor 1)
    assert "tensor-parallel layer ops (2-way shard): compute and backward rows of whole layers (tensor 1), scaled " \
           "along the roofline to the shard" in result.sources
    assert any(line.startswith("tensor-parallel allreduce library over 2 ranks on 1 hosts") and
               line.endswith("no collective rows, the network model") for line in result.sources)
    assert "mlp_up (prefill) on cpu: outside the calibrated shapes" in result.extrapolated  # the shard is smaller
