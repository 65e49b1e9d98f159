"""A training scenario simulated from a calibration profile: forward, backward and optimizer ops
priced from the profile's rows, what it lacks modelled and said so, from the library and the CLI."""

import pandas as pd
import pytest

from models.errors import ConfigError
from models.training import compute_dtype
from sim.reduction import UNMEASURED
from sim.profile import MeasurementKind, Profile, load_profile, profile_frame
from sim.program import Gradient
from sim.training.lower import StepShape, lower_step
from sim.training.simulate import simulate_training
from sim.vocabulary import Metric
from tests.conftest import run_cli
from tests.test_training_sim import _scenario
from validation.cli import main

_ROWS = {None: MeasurementKind.COMPUTE, Gradient.INPUT: MeasurementKind.BACKWARD_INPUT,
         Gradient.WEIGHT: MeasurementKind.BACKWARD_WEIGHT}


def _profile(scenario, seconds: float, training_rows: bool = True, variant: int = 0,
             precision: bool = False) -> Profile:
    """A profile timing every compute op of ``scenario``'s variant ``variant``'s step at ``seconds``,
    at the op's own FLOPs and bytes (so no interpolation is needed); ``precision``: the rows record
    the variant's precision, as a training calibration writes them."""
    settings = scenario.training_settings(scenario.config.variants[variant])
    workload = scenario.config.workload
    dtype = compute_dtype(settings.precision)
    shape = StepShape(scenario.model.with_dtype(dtype), settings, workload.micro_batch_size,
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
                "dtype": "fp32" if optimizer else dtype, "flops": op.cost.flops, "traffic_bytes": op.traffic_bytes,
                "precision": settings.precision.value if precision else None,
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
    results = pd.read_csv(tmp_path / "out" / "results.csv")
    # a profile that records no context is taken as this cluster's own: its timings replayed
    assert set(results["source"]) == {"simulated"} and set(results["calibration"]) == {"replay"}


def test_a_tensor_parallel_step_from_a_data_parallel_profile_says_its_shard_is_scaled_from_whole_layers():
    scenario = _cpu_scenario(parallel={"tensor": 2, "data": 2}, devices_per_host=2)
    result = simulate_training(scenario, _profile(_cpu_scenario(), 1e-4))  # rows of whole layers (tensor 1)
    assert "tensor-parallel layer ops (2-way shard): compute and backward rows of whole layers (tensor 1), scaled " \
           "along the roofline to the shard" in result.sources
    assert any(line.startswith("tensor-parallel allreduce library over 2 ranks on 1 hosts") and
               line.endswith("no collective rows, the network model") for line in result.sources)
    assert "mlp_up (prefill) on cpu: outside the calibrated shapes" in result.extrapolated  # the shard is smaller


def _bf16_scenario(*extra):
    """Variants training in both bf16 precisions (and ``extra`` ones): amp_bf16 first, bf16_mixed second."""
    return _scenario([{"name": "amp", "training": {"precision": "amp_bf16"}},
                      {"name": "mixed", "training": {"precision": "bf16_mixed"}}, *extra], hosts=2,
                     training={"optimizer": "adamw"})


def _joined(*profiles: Profile) -> Profile:
    return Profile(profile_frame([row for p in profiles for row in p.rows.to_dict("records")]))


def test_a_profile_timing_amp_bf16_and_bf16_mixed_keeps_them_apart_and_prices_each_variant_from_its_own():
    scenario = _bf16_scenario()
    amp, mixed = _profile(scenario, 1e-4, variant=0, precision=True), _profile(scenario, 3e-4, variant=1, precision=True)
    both = _joined(amp, mixed)
    assert both.precisions() == ("bf16_mixed", "amp_bf16")
    result = simulate_training(scenario, both)
    # autocast's ops took a third of the bf16 copies' in the profile, and so they do in the step
    assert result.variant("mixed").metrics[Metric.FORWARD_TIME] == pytest.approx(
        3 * result.variant("amp").metrics[Metric.FORWARD_TIME], rel=1e-9)
    # each variant as a profile of its own precision alone prices it: the other's rows are not in it
    for name, own in (("amp", amp), ("mixed", mixed)):
        alone = simulate_training(scenario, own).variant(name).metrics
        for metric in (Metric.FORWARD_TIME, Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME):
            assert result.variant(name).metrics[metric] == pytest.approx(alone[metric], rel=1e-9), (name, metric)
    assert not any("the profile times no" in line or "records no precision" in line for line in result.sources)
    # the rows pooled as one precision (what a profile that records none does) price both alike
    pooled = simulate_training(scenario, Profile(both.rows.drop(columns="precision")))
    assert pooled.variant("mixed").metrics[Metric.FORWARD_TIME] == pytest.approx(
        pooled.variant("amp").metrics[Metric.FORWARD_TIME], rel=1e-9)


def test_a_precision_the_profile_did_not_time_is_priced_from_the_other_bf16_rows_and_hetsim_simulate_says_so(
        tmp_path, capsys):
    import yaml

    scenario = _bf16_scenario({"name": "fp32", "training": {"precision": "fp32"}})
    amp = _profile(scenario, 1e-4, variant=0, precision=True)
    result = simulate_training(scenario, amp)
    assert result.variant("mixed").metrics[Metric.FORWARD_TIME] == pytest.approx(
        result.variant("amp").metrics[Metric.FORWARD_TIME], rel=1e-9)
    fallback = ("bf16_mixed variants (bf16 copies of fp32 weights): the profile times no bf16_mixed ops; priced from "
                "its amp_bf16 rows (autocast over fp32 weights), the same compute dtype bf16")
    roofline = ("fp32 variants (fp32 weights): the profile times no fp32 training ops (it times amp_bf16): the "
                "roofline prices their forward and backward ops")
    assert fallback in result.sources and roofline in result.sources
    assert result.variant("fp32").metrics[Metric.FORWARD_TIME] == pytest.approx(
        simulate_training(scenario).variant("fp32").metrics[Metric.FORWARD_TIME], rel=1e-9)
    path, profile = tmp_path / "train.yaml", tmp_path / "profile.csv"
    path.write_text(yaml.safe_dump(scenario.config.model_dump(mode="json", by_alias=True, exclude_none=True)))
    profile.write_text(amp.rows.to_csv(index=False))
    code, out, _ = run_cli(main, ["simulate", str(path), "--profile", str(profile), "--out", str(tmp_path / "out")],
                           capsys)
    assert code == 0 and fallback in " ".join(out.split())


def test_a_profile_written_before_rows_recorded_their_precision_loads_and_says_it_prices_both_alike(tmp_path):
    scenario = _bf16_scenario()
    path = tmp_path / "old.csv"
    path.write_text(_profile(scenario, 1e-4).rows.drop(columns="precision").to_csv(index=False))
    old = load_profile(path)
    assert old.rows["precision"].isna().all() and old.precisions() == ()
    result = simulate_training(scenario, old)
    assert ("amp_bf16 and bf16_mixed variants: the profile records no precision (written before profiles did); its "
            "bf16 rows price them alike") in result.sources
    frame = _profile(scenario, 1e-4, precision=True).rows
    frame["precision"] = "fp8"
    frame.to_csv(path, index=False)
    with pytest.raises(ConfigError, match="unknown precision 'fp8'; known: fp32, bf16_mixed, amp_bf16") as caught:
        load_profile(path)
    assert caught.value.field == "profile"


def test_the_profiles_reduction_rows_of_the_gradients_dtype_price_the_buckets_allreduces_and_the_sources_say_so():
    from tests.test_reduction import _rows as reduction_rows

    # bf16_mixed computes in bf16 and its buckets reduce fp32 gradients: the fp32 rows price them
    scenario = _scenario([{"name": "mixed", "training": {"precision": "bf16_mixed", "allreduce": "ring"}}], hosts=2,
                         training={"optimizer": "adamw"})
    plain = _profile(scenario, 1e-4, precision=True)
    gamma = 2e-8  # 50 MB/s of received bytes: far above the roofline's, so that it shows in the step
    profile = Profile(profile_frame([*plain.rows.to_dict("records"), *reduction_rows(gamma, 0.0),
                                     *reduction_rows(1e-12, 0.0, dtype="bf16")]))
    result = simulate_training(scenario, profile)
    assert any(line.startswith("reduction on cpu fp32: same (gamma 20000.0 ps/B") for line in result.sources)
    assert not any(line.startswith("reduction on cpu bf16") for line in result.sources)
    without = simulate_training(scenario, plain)
    # no reduction rows: the roofline, named among the sources, and no term outside the context
    assert UNMEASURED in without.sources
    assert not any(line.startswith("reduction on") for line in without.sources)
    # the ring's reductions of ~250 MB of gradients per rank at 20 ns/B: seconds more in the step
    assert (result.variants[0].metrics[Metric.STEP_TIME]
            > without.variants[0].metrics[Metric.STEP_TIME] + 1.0)


def test_a_compressed_bf16_buckets_allreduce_is_priced_with_the_profiles_bf16_reduction_rows_else_fp32s_said_so():
    from tests.test_reduction import _rows as reduction_rows

    # fp32 training, buckets cast to bf16 for the allreduce: its reductions add bf16 elements
    scenario = _scenario([{"name": "bf16_buckets", "training": {"gradient_compression": "bf16", "allreduce": "ring"}}],
                         hosts=2, training={"optimizer": "adamw", "precision": "fp32"})
    plain = _profile(scenario, 1e-4, precision=True).rows.to_dict("records")
    slow, fast = 2e-8, 1e-12  # 2e-8 s/B: ~125 MB of bf16 gradients per rank reduced take seconds
    costly_bf16 = simulate_training(scenario, Profile(profile_frame(
        [*plain, *reduction_rows(fast, 0.0), *reduction_rows(slow, 0.0, dtype="bf16")])))
    cheap_bf16 = simulate_training(scenario, Profile(profile_frame(
        [*plain, *reduction_rows(slow, 0.0), *reduction_rows(fast, 0.0, dtype="bf16")])))
    step = Metric.STEP_TIME
    # the bf16 rows' gamma prices the bucket's reductions, not the fp32 rows'
    assert costly_bf16.variants[0].metrics[step] > cheap_bf16.variants[0].metrics[step] + 0.5
    assert any(line.startswith("reduction on cpu bf16: same (gamma 20000.0 ps/B") for line in costly_bf16.sources)
    # a profile without bf16 rows prices them with the fp32 rows' gamma, unscaled, and says so
    fp32_only = simulate_training(scenario, Profile(profile_frame([*plain, *reduction_rows(slow, 0.0)])))
    assert fp32_only.variants[0].metrics[step] == pytest.approx(costly_bf16.variants[0].metrics[step], rel=1e-9)
    assert any(line.startswith("reduction on cpu bf16: not applicable (no cpu bf16 reduction rows: the cpu fp32 "
                               "rows' gamma, unscaled") for line in fp32_only.sources)
    assert not any(line.startswith("reduction on cpu bf16") for line in cheap_bf16.sources if "not applicable" in line)


def test_tensor_parallel_allreduces_in_bf16_are_priced_with_the_bf16_reduction_rows():
    from tests.test_reduction import _rows as reduction_rows

    # bf16_mixed with 2-way tensor parallelism: the buckets reduce fp32 gradients, the
    # tensor-parallel allreduces bf16 activations and their gradients
    scenario = _scenario([{"name": "tp", "training": {"precision": "bf16_mixed"}}], hosts=2, devices_per_host=2,
                         parallel={"tensor": 2, "data": 2}, global_batch=2, training={"optimizer": "adamw"})
    plain = _profile(scenario, 1e-4, precision=True).rows.to_dict("records")
    slow, fast = 2e-8, 1e-12

    def step_s(fp32: float, bf16: float) -> tuple[float, tuple[str, ...]]:
        result = simulate_training(scenario, Profile(profile_frame(
            [*plain, *reduction_rows(fp32, 0.0), *reduction_rows(bf16, 0.0, dtype="bf16")])))
        return result.variants[0].metrics[Metric.STEP_TIME], result.sources

    costly_bf16, sources = step_s(fast, slow)
    assert any(line.startswith("reduction on cpu bf16: same (gamma 20000.0 ps/B") for line in sources)
    assert any(line.startswith("reduction on cpu fp32: same (gamma 1.0 ps/B") for line in sources)
    # allreduces of 96 KiB of bf16, half of each reduced per rank, at 20 ns/B: 1 ms each on the
    # compute stream (24 ms more a step here); at the fp32 rows' gamma they would cost nothing
    assert costly_bf16 > step_s(fast, fast)[0] + 0.01
