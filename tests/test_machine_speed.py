"""The machine's speed recorded with a calibration (a ``speed`` context row) and set against a
measurement's: the row round-trips through a profile file, a profile written before it still
loads, the slowdown and the compute rescaling are computed from given timings (no timing here)."""

import math
from pathlib import Path

import pandas as pd
import pytest

from sim.context import ContextTerm, calibrated_speed, profile_contexts, speed_rows
from sim.machine_speed import RESCALED_KINDS, describe, rescaled_profile, slowdown
from sim.profile import Profile, load_profile, with_rows
from sim.vocabulary import MeasurementKind

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "validation" / "plan-check" / "profile_v2x2_bandwidth.csv"  # written before the speed row


def test_a_profile_without_the_speed_row_loads_and_has_no_calibrated_speed():
    profile = load_profile(PROFILE)
    assert not (profile.rows["op"] == ContextTerm.SPEED.value).any()
    assert calibrated_speed(profile_contexts(profile.rows)) == {}


def test_the_speed_row_round_trips_through_a_profile_file(tmp_path):
    profile = load_profile(PROFILE)
    name = profile_contexts(profile.rows)[0].name
    path = tmp_path / "profile.csv"
    with_rows(profile.rows, speed_rows(name, {"stream": 0.0031, "matmul": 0.0079})).to_csv(path, index=False)
    contexts = profile_contexts(load_profile(path).rows)
    assert contexts[0].reference_s == (("matmul", 0.0079), ("stream", 0.0031))
    assert calibrated_speed(contexts) == {"matmul": 0.0079, "stream": 0.0031}
    assert speed_rows(name, {}) == []  # nothing timed: no row


def test_a_pool_of_calibrations_with_different_speeds_has_no_one_speed():
    rows = pd.DataFrame(speed_rows("a", {"matmul": 0.008}) + speed_rows("b", {"matmul": 0.010}))
    assert calibrated_speed(profile_contexts(rows)) == {}


def test_the_slowdown_is_the_geometric_mean_of_the_ops_both_timed():
    calibrated = {"matmul": 0.010, "stream": 0.004}
    assert slowdown(calibrated, {"matmul": 0.0121, "stream": 0.0064, "other": 1.0}) == pytest.approx(math.sqrt(1.21 * 1.6))
    assert slowdown(calibrated, {"matmul": 0.020, "stream": 0.002}) == pytest.approx(1.0)  # x2 and /2
    assert math.isnan(slowdown({}, {"matmul": 0.01}))  # an old profile: unknown
    assert math.isnan(slowdown(calibrated, {}))
    assert describe(1.22) == "machine x1.22 slower than at calibration"
    assert describe(1 / 1.05) == "machine x1.05 faster than at calibration"
    assert describe(1.001) == "machine as fast as at calibration"
    assert describe(math.nan) == "machine speed at calibration not recorded"


def test_rescaling_multiplies_the_compute_rows_times_and_nothing_else():
    profile = load_profile(PROFILE)
    scaled = rescaled_profile(profile, 1.25).rows
    compute = profile.rows["measurement"].isin([k.value for k in RESCALED_KINDS])
    assert compute.any() and (profile.rows["measurement"] == MeasurementKind.COLLECTIVE).any()
    for column in ("median", "p10", "p90", "mean"):
        pd.testing.assert_series_equal(scaled.loc[compute, column].astype(float),
                                       profile.rows.loc[compute, column].astype(float) * 1.25)
        pd.testing.assert_series_equal(scaled.loc[~compute, column], profile.rows.loc[~compute, column])
    with pytest.raises(ValueError, match="positive and finite"):
        rescaled_profile(profile, math.nan)


def test_compute_rescaled_for_a_slower_machine_lengthens_the_step_and_factor_one_changes_nothing():
    from sim.scenario import load_scenario
    from sim.simulate import simulate
    from sim.vocabulary import Metric

    scenario = load_scenario(ROOT / "scenarios" / "validation" / "v2x2_bandwidth.yaml")
    profile = load_profile(PROFILE)

    def tpot(p: Profile) -> float:
        return simulate(scenario, profile=p, expand_steps=()).variants[0].timing[Metric.TPOT]

    base = tpot(profile)
    assert tpot(rescaled_profile(profile, 1.0)) == base
    # compute x 1.3, the collectives (most of this 4-rank step over 100 Mbit/s links) as calibrated
    assert base < tpot(rescaled_profile(profile, 1.3)) < base * 1.3


def test_validate_adds_the_error_with_compute_rescaled_beside_the_raw_one():
    from types import SimpleNamespace

    from sim.scenario import load_scenario
    from sim.vocabulary import Metric
    from validation.validate import case_errors, with_rescaled_errors

    case = load_scenario(ROOT / "scenarios" / "validation" / "v2x2_bandwidth.yaml")
    profile = load_profile(PROFILE)
    measured = pd.DataFrame([{"variant": "v", "metric": Metric.TPOT.value, "device": "", "value": 0.100}])

    def simulate(scenario, profile):  # TPOT: the profile's compute rows' mean, summed
        compute = profile.of(MeasurementKind.COMPUTE)["mean"].astype(float).sum()
        return SimpleNamespace(results=pd.DataFrame([{"variant": "v", "metric": Metric.TPOT.value, "device": "",
                                                      "value": compute}]))

    raw = case_errors("c", 32, simulate(case, profile).results, measured)
    same = with_rescaled_errors(raw, case, profile, 1.0, measured, simulate)
    assert same["error_compute_rescaled"].tolist() == raw["error"].tolist() and (same["machine_slowdown"] == 1).all()
    slower = with_rescaled_errors(raw, case, profile, 1.2, measured, simulate)
    assert slower["error"].tolist() == raw["error"].tolist()  # kept as it was
    assert slower.loc[0, "error_compute_rescaled"] == pytest.approx((raw.loc[0, "simulated"] * 1.2) / 0.1 - 1)
    unknown = with_rescaled_errors(raw, case, profile, math.nan, measured, simulate)
    assert unknown["error_compute_rescaled"].isna().all()
