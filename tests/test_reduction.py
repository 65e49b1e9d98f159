"""The reduction cost per byte (gamma): measured by the calibration, fitted, and priced by the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.profile import Profile, load_profile, profile_frame, with_rows
from sim.reduction import UNMEASURED, fit_reductions
from sim.vocabulary import MeasurementKind

ROOT = Path(__file__).resolve().parent.parent
SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _rows(gamma_s_per_byte: float, intercept_s: float, device_class: str = "cpu", dtype: str = "fp32") -> list[dict]:
    return [{"measurement": MeasurementKind.REDUCTION, "device_class": device_class, "op": "add", "size_bytes": n,
             "dtype": dtype, "unit": "s", "median": intercept_s + gamma_s_per_byte * n, "repeats": 7} for n in SIZES]


def test_the_calibrations_reduction_rows_time_the_runtimes_add_and_fit_a_positive_gamma():
    import torch

    from runtime.reduction_bench import reduction_rows

    rows = reduction_rows("cpu", "fp32", torch.float32, torch.device("cpu"), sizes=SIZES)
    assert [r["size_bytes"] for r in rows] == list(SIZES)
    assert {(r["measurement"], r["device_class"], r["dtype"], r["op"], r["unit"]) for r in rows} == {
        (MeasurementKind.REDUCTION, "cpu", "fp32", "add", "s")}
    assert all(r["repeats"] == 7 and 0 < r["p10"] <= r["median"] <= r["p90"] for r in rows)
    (fit,) = fit_reductions(Profile(profile_frame(rows))).values()
    assert fit.gamma_s_per_byte > 0 and fit.sizes_bytes == SIZES
    with pytest.raises(ValueError, match="multiples of 4 bytes"):
        reduction_rows("cpu", "fp32", torch.float32, torch.device("cpu"), sizes=(1026,))


def test_the_fit_recovers_gamma_and_the_intercept_per_device_type_and_dtype():
    profile = Profile(profile_frame(_rows(1e-10, 5e-6) + _rows(2e-10, 1e-5, dtype="bf16")
                                    + _rows(3e-10, 0.0, device_class="a100_sxm")[:1]))  # one size: no slope
    fits = fit_reductions(profile)
    assert set(fits) == {("cpu", "fp32"), ("cpu", "bf16")}
    assert fits[("cpu", "fp32")].gamma_s_per_byte == pytest.approx(1e-10)
    assert fits[("cpu", "fp32")].intercept_s == pytest.approx(5e-6)
    assert fits[("cpu", "bf16")].gamma_s_per_byte == pytest.approx(2e-10)
    assert "gamma 100.0 ps/B" in fits[("cpu", "fp32")].describe()


@pytest.fixture(scope="module")
def cluster():
    from validation.matrix import load_matrix

    _, scenarios = load_matrix(ROOT / "validation" / "matrix.yaml")
    by_name = {s.name: s for s in scenarios}
    return by_name["v4x1_latency"], load_profile(ROOT / "validation" / "report" / "profiles" / "v2x2_latency.csv")


def _pricing(scenario, profile):
    from sim.parallel import ParallelPlan
    from sim.simulate import build_pricing
    from sim.topology import build_topology

    topology = build_topology(scenario.config.cluster)
    return build_pricing(scenario, topology, ParallelPlan.of(scenario, topology).tensor_ranks, profile)


def test_a_profile_with_reduction_rows_sets_the_gamma_the_engine_and_network_price_with(cluster):
    scenario, old = cluster
    gamma = 4e-10  # well off the roofline's, so that it shows
    profile = Profile(with_rows(old.rows, _rows(gamma, 2e-6)))
    fitted = _pricing(scenario, profile)
    assert fitted.engine.links.gamma == pytest.approx([gamma] * 4)
    assert list(fitted.network.reduce_s_per_byte.values()) == pytest.approx([gamma] * 4)  # the transport model
    lines = fitted.choice.lines()
    assert any(line.startswith("reduction on cpu fp32: same (gamma 400.0 ps/B") for line in lines)
    # an old profile, without the rows, keeps the roofline and says so
    roofline = _pricing(scenario, old)
    assert roofline.engine.links.gamma == pytest.approx(
        [roofline.compute.fallback.reduce_s_per_byte(d) for d in roofline.engine.topology.devices])
    assert roofline.engine.links.gamma != pytest.approx([gamma] * 4)
    # no reduction rows: the roofline, named among the sources, and no term outside the context
    assert UNMEASURED in roofline.choice.lines()
    assert not any(line.startswith("reduction on") for line in roofline.choice.lines())
    # and the larger gamma prices a reducing collective longer: a ring allreduce reduces 3 MiB per rank
    assert _ring_allreduce_s(fitted) > _ring_allreduce_s(roofline)


def _ring_allreduce_s(pricing) -> float:
    from sim.collectives.registry import build_schedule

    group = (0, 1, 2, 3)
    schedule = build_schedule("allreduce", "ring", group, 4 << 20,
                              host_groups=pricing.engine.topology.host_groups(group))
    return pricing.network.time(schedule).duration_s


def test_reduction_rows_of_another_dtype_leave_the_roofline_and_name_what_was_fitted(cluster):
    scenario, old = cluster
    profile = Profile(with_rows(old.rows, _rows(4e-10, 0.0, dtype="bf16")))
    pricing = _pricing(scenario, profile)
    assert pricing.engine.links.gamma == pytest.approx(
        [pricing.compute.fallback.reduce_s_per_byte(d) for d in pricing.engine.topology.devices])
    assert any(line.startswith("reduction on cpu fp32: not applicable (the profile's reductions fitted are of cpu bf16")
               for line in pricing.choice.lines())


def test_a_schedule_reducing_in_bf16_is_priced_with_the_bf16_gamma_and_fp16_without_rows_with_fp32s(cluster):
    from dataclasses import replace

    scenario, old = cluster
    fp32, bf16 = 1e-10, 8e-10
    pricing = _pricing(scenario, Profile(with_rows(old.rows, _rows(fp32, 0.0) + _rows(bf16, 0.0, dtype="bf16"))))
    links = pricing.engine.links
    assert links.gamma_in(None) == pytest.approx([fp32] * 4) and links.gamma_in("bf16") == pytest.approx([bf16] * 4)
    assert links.gamma_in("fp16") == pytest.approx([fp32] * 4)  # no fp16 rows: fp32's, unscaled
    from sim.collectives.registry import build_schedule

    group = (0, 1, 2, 3)
    ring = build_schedule("allreduce", "ring", group, 4 << 20, host_groups=pricing.engine.topology.host_groups(group))
    # a ring reduces 3 MiB per rank: 2.1 ms more at 0.7 ns/B more
    network = pricing.network
    extra_s = network.time(replace(ring, reduce_dtype="bf16")).duration_s - network.time(ring).duration_s
    assert extra_s == pytest.approx((bf16 - fp32) * 3 * (1 << 20), rel=0.05)


def test_a_training_steps_collectives_reduce_in_their_own_dtype():
    from sim.training.lower import StepShape, lower_step, scenario_reduction_dtypes
    from tests.test_training_sim import _scenario

    scenario = _scenario([{"name": "fp16_buckets", "training": {"precision": "bf16_mixed",
                                                                  "gradient_compression": "fp16"}},
                          {"name": "plain", "training": {"precision": "fp32"}}],
                         hosts=2, devices_per_host=2, parallel={"tensor": 2, "data": 2}, global_batch=2)
    assert scenario_reduction_dtypes(scenario, 2) == ("fp16", "bf16", "fp32")
    assert scenario_reduction_dtypes(scenario, 1) == ("fp16", "fp32")
    settings = scenario.training_settings(scenario.config.variants[0])
    shape = StepShape(scenario.model.with_dtype("bf16"), settings, 1, 16, 1, ((0, 1), (2, 3)))
    dtypes = {("bucket" if op.name.startswith("bucket") else "tensor", op.collective.dtype)
              for part in lower_step(shape, sync_gradients=True, average_parameters=False).segments
              for op in part.segment.programs[0] if op.collective is not None}
    assert dtypes == {("bucket", "fp16"), ("tensor", "bf16")}
