"""A profile calibrated on a cluster's tensor-parallel scenario prices that cluster's other layouts:
a pipeline's stages from the profile's compute rows per op kind, its hops with point-to-point
terms fitted on the profile's ping-pongs, and an uneven split; the layout it measured is replayed."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.context import Verdict
from sim.profile import MeasurementKind, Profile, load_profile
from sim.scenario import load_scenario, scenario_from_dict
from sim.simulate import simulate
from validation.matrix import LayoutCase, load_matrix, with_layout

ROOT = Path(__file__).resolve().parents[1]
PP4 = LayoutCase(name="pp4", parallel={"tensor": 1, "pipeline": 4})


def _cluster(name: str):
    return (load_scenario(ROOT / "scenarios" / "validation" / f"{name}.yaml"),
            load_profile(ROOT / "validation" / "report" / "profiles" / f"{name}.csv"))


def _reduce_bcast_cluster(name: str):
    """A cluster and the layouts report's profile of it: reduce_ln_bcast alone, whose rooted
    collectives' prefill payloads desynchronised the calibrated ranks."""
    return (load_scenario(ROOT / "scenarios" / "validation" / f"{name}.yaml"),
            load_profile(ROOT / "validation" / "layouts-report" / "profiles" / f"{name}.csv"))


def _decode_ops(result, kind: str):
    ops = result.variants[0].trace.ops
    return ops[(ops["step"] == 1) & (ops["kind"] == kind)]


def test_a_pipeline_stage_computes_in_the_profiles_op_times_not_the_roofline():
    scenario, profile = _cluster("v2x2_bandwidth")
    case = with_layout(scenario, PP4)
    calibrated = simulate(case, profile=profile)
    rows = profile.rows.copy()
    slower = (rows["measurement"] == MeasurementKind.COMPUTE) & (rows["op"] == "mlp_up")
    rows.loc[slower, ["mean", "median", "p10", "p90"]] *= 2
    doubled = simulate(case, profile=Profile(rows))
    gap_s = float(profile.of(MeasurementKind.OP_GAP)["mean"].iloc[0])
    before = _decode_ops(calibrated, "mlp_up")
    after = _decode_ops(doubled, "mlp_up")
    assert len(before) == 12  # every layer, on the four stages
    span = lambda ops: (ops["end_s"] - ops["start_s"]).to_numpy()
    scale = 0.5  # 4 ranks calibrated on 2 cores; a stage computes alone on a core
    np.testing.assert_allclose(span(after) / scale - gap_s, 2 * (span(before) / scale - gap_s), rtol=1e-6)
    roofline = _decode_ops(simulate(case), "mlp_up")
    assert not np.allclose(span(before), span(roofline), rtol=0.1)
    assert f"layout pipeline 4 x tensor 1: {Verdict.RESCALED.value}" in "\n".join(calibrated.sources)


def test_a_hop_over_the_slow_link_costs_the_calibrated_point_to_point_time():
    scenario, profile = _cluster("v2x2_latency")
    case = with_layout(scenario, PP4)
    sends = _decode_ops(simulate(case, profile=profile), "send")
    # rank 1 (host n0) sends rank 2 (host n1) 3 KiB of hidden state per decode token
    across = sends[(sends["name"] == "send_hidden") & (sends["rank"] == 1)].sort_values("start_s")
    hop_s = float((across["end_s"] - across["start_s"]).iloc[-1])  # the first row: rank 0's hop to it
    pings = profile.of(MeasurementKind.P2P)
    inter = pings[pings["device_class"] == "inter_host"].sort_values("size_bytes")
    measured_s = float(np.interp(3072, inter["size_bytes"], inter["median"]))
    assert hop_s == pytest.approx(measured_s, rel=0.1)
    uncalibrated = _decode_ops(simulate(case), "send")
    other = uncalibrated[(uncalibrated["name"] == "send_hidden") & (uncalibrated["rank"] == 1)].sort_values("start_s")
    assert float((other["end_s"] - other["start_s"]).iloc[-1]) != pytest.approx(hop_s, rel=0.1)


def test_the_calibrated_layout_is_replayed_and_an_uneven_split_is_predicted():
    scenario, profile = _cluster("v2x2_bandwidth")
    tp = simulate(with_layout(scenario, LayoutCase(name="tp4")), profile=profile)
    assert tp.network.same_cluster
    uneven = simulate(with_layout(scenario, LayoutCase(name="tp3", parallel={"tensor": 3, "shares": [2, 1, 1]})),
                      profile=profile)
    assert not uneven.network.same_cluster
    assert any(line.startswith("layout tensor 3, uneven shares 2:1:1: rescaled") for line in uneven.sources)
    # the rank with twice the heads computes its attention projections for longer
    ops = uneven.variants[0].trace.ops
    qkv = ops[(ops["kind"] == "qkv_proj") & (ops["step"] == 1) & (ops["layer"] == 0)].set_index("rank")
    span = qkv["end_s"] - qkv["start_s"]
    assert span[0] > 1.5 * span[1]


def test_a_scenario_whose_variants_set_layouts_prices_each_against_the_profile():
    scenario, profile = _cluster("v2x2_bandwidth")
    data = scenario.config.model_dump(by_alias=True)
    data["model"] = scenario.model.name
    data["variants"] = [data["variants"][0], {**data["variants"][0], "name": "pp4", "parallel": PP4.parallel}]
    mixed = simulate(scenario_from_dict(data, base_dir=ROOT), profile=profile)
    assert mixed.network.same_cluster  # the scenario's own layout, replayed
    assert any(line.startswith("[pipeline 4 x tensor 1] layout pipeline 4 x tensor 1: rescaled")
               for line in mixed.sources)
    alone = simulate(with_layout(scenario, PP4), profile=profile)
    assert mixed.variant("pp4").timing == alone.variants[0].timing


def test_the_layouts_matrix_loads_with_one_calibrated_layout(tmp_path):
    matrix, scenarios = load_matrix(ROOT / "validation" / "layouts.yaml")
    assert [layout.parallel is None for layout in matrix.layouts].count(True) == 1
    assert {s.name for s in scenarios} >= {"v2x2_bandwidth", "v1p3_latency"}
    bad = tmp_path / "m.yaml"
    bad.write_text((ROOT / "validation" / "layouts.yaml").read_text().replace("  - {name: tp4}\n", "")
                   .replace("../scenarios", str(ROOT / "scenarios")))
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match="layouts"):
        load_matrix(bad)


def test_the_summary_splits_the_calibrated_layout_from_the_predicted_ones():
    import pandas as pd

    from validation.present.validation_report import _layouts_markdown

    rows = [{"scenario": "c", "prompt_tokens": 32, "variant": name, "metric": metric, "simulated": 1.0 + error,
             "measured": 1.0, "error": error, "split_half": 0.01, "cpu_steal": 0.0, "other_load": 0.1,
             "layout_seen": name == "tp4"}
            for name, error in (("tp4", 0.02), ("pp4", -0.3), ("tp2_pp2", 0.1)) for metric in ("ttft_s", "tpot_s")]
    text = "\n".join(_layouts_markdown(pd.DataFrame(rows)))
    assert "| calibrated layout (replay) | ttft_s | 1 | 2.0% |" in text
    assert "| new layout (prediction) | tpot_s | 2 | 20.0% |" in text
    assert "| 10.0% | - | - |" in text  # a report written before the machine's speed was timed
    timed = pd.DataFrame(rows).assign(machine_slowdown=[1.0, 1.0, 1.25, 1.25, 0.8, 0.8],
                                      error_compute_rescaled=[0.02, 0.02, -0.1, -0.1, 0.05, 0.05])
    text = "\n".join(_layouts_markdown(timed))
    assert "| pp4 | no | tpot_s | 700.0 | 1000.0 | -30.0% | 1.0% | 0.0% | 10.0% | x1.25 slower | -10.0% |" in text
    assert "| tp4 | yes | ttft_s | 1020.0 | 1000.0 | +2.0% | 1.0% | 0.0% | 10.0% | as fast | +2.0% |" in text
    assert "x1.25 faster" in text and "not a prediction" in text
    assert _layouts_markdown(pd.DataFrame(rows).drop(columns="layout_seen")) == []


def _without_prefill_spread(profile: Profile) -> Profile:
    """``profile`` with every call's wait at a prefill's size set to its wait at a decode step's:
    a calibration whose prefill payloads did not desynchronise its ranks."""
    rows = profile.rows.copy()
    waits = rows["measurement"] == MeasurementKind.COLLECTIVE_WAIT
    one_token = rows.loc[waits, "size_bytes"].min()
    calls = ["algorithm", "call", "op"]
    decode = rows[waits & (rows["size_bytes"] == one_token)].set_index(calls)["median"]
    rows.loc[waits, "median"] = decode.reindex(pd.MultiIndex.from_frame(rows.loc[waits, calls])).to_numpy()
    return Profile(rows)


def test_ranks_computing_at_once_per_phase_come_from_the_profiles_waits():
    from sim.concurrency import calibrated_concurrency

    _, profile = _reduce_bcast_cluster("v2x2_bandwidth")
    measured = calibrated_concurrency(profile.rows, 4)
    assert set(measured) == {1, 8, 32, 128}  # the calibrated generations: decode steps and 3 prompts
    assert measured[1] == 4.0  # a decode step's payload desynchronises nothing
    assert 1.0 <= measured[128] < 2.0  # 393 KiB over 100 Mbit/s: the ranks computed about one at a time
    # the same compute rows with no spread added by the prefill's payloads: every rank at once
    assert calibrated_concurrency(_without_prefill_spread(profile).rows, 4) == {1: 4.0, 8: 4.0, 32: 4.0, 128: 4.0}
    # a profile without in-place waits (older calibrations): every calibrated rank, as before
    rows = profile.rows[profile.rows["measurement"] != MeasurementKind.COLLECTIVE_WAIT]
    assert calibrated_concurrency(rows, 4) == {1: 4.0, 8: 4.0, 32: 4.0, 128: 4.0}


def test_an_allreduces_wait_is_contention_not_a_spread_that_desynchronises_the_ranks():
    from sim.concurrency import calibrated_concurrency

    # the plan check's profile pools allreduce_ln over 4 algorithms with reduce_ln_bcast: most of its
    # compute rows come from generations whose ranks an allreduce brought back together every block
    profile = load_profile(ROOT / "validation" / "plan-check" / "profile_v2x2_bandwidth.csv")
    assert calibrated_concurrency(profile.rows, 4) == {1: 4.0, 8: 4.0, 32: 4.0, 128: 4.0}
    # its reduce_ln_bcast generations alone: the rooted collectives' prefill payloads spread the ranks
    rows = profile.rows
    rooted = rows[(rows["measurement"] != MeasurementKind.COLLECTIVE_WAIT) | rows["op"].isin(["reduce", "broadcast"])]
    alone = calibrated_concurrency(rooted, 4)
    assert alone[1] == 4.0 and alone[128] < 2.0


def test_a_pipelines_prefill_is_slower_where_the_calibrations_prefill_ranks_computed_apart():
    scenario, profile = _reduce_bcast_cluster("v2x2_bandwidth")
    apart = simulate(with_layout(scenario, PP4), profile=profile)
    together = simulate(with_layout(scenario, PP4), profile=_without_prefill_spread(profile))
    # ops timed with fewer ranks beside them hold less contention: more work on a core of one's own
    assert apart.variants[0].timing["ttft_s"] > 1.2 * together.variants[0].timing["ttft_s"]
    assert apart.variants[0].timing["tpot_s"] == pytest.approx(together.variants[0].timing["tpot_s"], rel=1e-9)
    assert any("prefill of 128 x 1.00" in line for line in apart.sources)
    # a tensor-parallel target runs its ranks in lockstep as the old factor assumes: unchanged
    uneven = LayoutCase(name="tp3", parallel={"tensor": 3, "shares": [2, 1, 1]})
    assert simulate(with_layout(scenario, uneven), profile=profile).variants[0].timing == simulate(
        with_layout(scenario, uneven), profile=_without_prefill_spread(profile)).variants[0].timing
