"""Calibrated pricing and the validation report's arithmetic, on synthetic profiles and tables."""

import math

import numpy as np
import pandas as pd
import pytest

from models.errors import ConfigError
from models.ops import OpKind
from sim.calibrated import CalibratedCompute, CalibratedNetwork
from sim.collectives.registry import build_schedule
from sim.cost import RooflineCompute
from sim.network import FlowNetwork
from sim.profile import PROFILE_COLUMNS, Profile, load_profile, profile_frame
from sim.simulate import simulate
from sim.topology import build_topology
from sim.cluster_config import ClusterConfig
from tests.conftest import cluster, make_scenario
from validation.validate import case_errors, ranking_agreement, seed_claim, summarise_errors


def _profile_from_simulation(scale: float, gap_s: float = 0.0):
    """A profile whose every compute time is ``scale`` x the roofline's, for the default test scenario."""
    scenario = make_scenario(cluster=cluster(2, 1, device="cpu"), dtype="fp32",
                             variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "library"}])
    baseline = simulate(scenario)
    roofline = RooflineCompute("fp32", 0.6, 0.8, 0.0)
    rows = []
    run = baseline.variants[0].run
    for step in sorted(run.simulated):
        for segment in run.simulated[step].phase.segments:
            for op in segment.programs[0]:
                if op.collective is None:
                    rows.append({"measurement": "compute", "device_class": "cpu", "op": str(op.kind),
                                 "group_size": 2, "batch_size": 1, "new_tokens": op.shape[0],
                                 "context_tokens": op.shape[1], "dtype": "fp32", "flops": op.cost.flops,
                                 "traffic_bytes": op.traffic_bytes, "unit": "s", "repeats": 1, "method": "synthetic",
                                 "mean": scale * roofline.roofline_s(op, baseline.topology.devices[0])})
    rows.append({"measurement": "op_gap", "device_class": "cpu", "mean": gap_s, "unit": "s"})
    return scenario, Profile(profile_frame(rows))


def test_calibrated_compute_reproduces_measured_op_times():
    scenario, profile = _profile_from_simulation(scale=3.0)
    roofline = RooflineCompute("fp32", 0.6, 0.8, 0.0)
    model = CalibratedCompute(profile, roofline)
    result = simulate(scenario)
    device = result.topology.devices[0]
    for segment in result.variants[0].run.simulated[0].phase.segments:
        for op in segment.programs[0]:
            if op.collective is None:
                assert model.duration_s(op, device) == pytest.approx(3.0 * roofline.roofline_s(op, device), rel=1e-9)
    assert not model.extrapolated


def test_gap_is_added_and_unmeasured_ops_are_flagged():
    scenario, profile = _profile_from_simulation(scale=1.0, gap_s=1e-3)
    roofline = RooflineCompute("fp32", 0.6, 0.8, 0.0)
    model = CalibratedCompute(profile, roofline)
    result = simulate(scenario)
    device = result.topology.devices[0]
    op = result.variants[0].run.simulated[0].phase.segments[1].programs[0][0]
    assert model.duration_s(op, device) == pytest.approx(roofline.roofline_s(op, device) + 1e-3, rel=1e-9)
    # a longer prompt than any calibrated one lies outside the calibrated shapes
    longer = simulate(make_scenario(cluster=cluster(2, 1, device="cpu"), dtype="fp32",
                                    workload={"batch_size": 1, "prompt_tokens": 512, "output_tokens": 2},
                                    variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "library"}]),
                      profile=profile)
    assert any("outside the calibrated shapes" in line for line in longer.extrapolated)


def _collective_profile(times: dict[int, float]) -> Profile:
    rows = [{"measurement": "collective", "op": "allreduce", "algorithm": "ring", "group_size": 4, "num_hosts": 2,
             "size_bytes": size, "median": t, "unit": "s"} for size, t in times.items()]
    return Profile(profile_frame(rows))


def _ring(topology, size_bytes: int):
    return build_schedule(OpKind.ALLREDUCE, "ring", (0, 1, 2, 3), size_bytes,
                          host_groups=topology.host_groups((0, 1, 2, 3)))


def test_calibrated_network_interpolates_alpha_beta_exactly_and_flags_the_rest():
    topology = build_topology(ClusterConfig.model_validate(cluster(2, 2)))
    fallback = FlowNetwork(topology)
    # alpha = 10 ms, beta = 1 us/byte: latency-bound at 1 KiB, bandwidth-bound at 1 MiB.
    alpha_beta = {size: 10e-3 + 1e-6 * size for size in (1024, 1 << 20)}
    network = CalibratedNetwork(_collective_profile(alpha_beta), fallback, topology)
    # Between the two, the cost is affine in size: interpolation must give it exactly (log-log
    # interpolation would give 29.6 ms at 128 KiB, 29% over).
    assert network.time(_ring(topology, 131072)).duration_s == pytest.approx(10e-3 + 1e-6 * 131072, rel=1e-9)
    assert not network.extrapolated
    assert network.time(_ring(topology, 4 << 20)).duration_s > alpha_beta[1 << 20]
    rd = build_schedule(OpKind.ALLREDUCE, "recursive_doubling", (0, 1, 2, 3), 2048)
    assert network.time(rd).duration_s == pytest.approx(fallback.time(rd).duration_s)
    assert len(network.extrapolated) == 2


def test_isolated_timings_that_fall_with_size_are_read_as_noise():
    topology = build_topology(ClusterConfig.model_validate(cluster(2, 2)))
    # A noisy 1 KiB median above the 16 KiB one: a smaller message cannot take longer.
    network = CalibratedNetwork(_collective_profile({1024: 54e-3, 4096: 51e-3, 16384: 42e-3, 65536: 60e-3}),
                                FlowNetwork(topology), topology)
    assert network.time(_ring(topology, 1024)).duration_s == pytest.approx(42e-3)
    assert network.time(_ring(topology, 8192)).duration_s == pytest.approx(42e-3)
    assert network.time(_ring(topology, 40960)).duration_s == pytest.approx(51e-3)
    times = [network.time(_ring(topology, size)).duration_s for size in range(1024, 65537, 1024)]
    assert times == sorted(times)


def test_profile_round_trip_and_bad_profiles(tmp_path):
    path = tmp_path / "profile.csv"
    profile_frame([{"measurement": "op_gap", "device_class": "cpu", "median": 1e-4, "unit": "s"}]).to_csv(path, index=False)
    assert load_profile(path).of("op_gap")["median"].iloc[0] == 1e-4
    with pytest.raises(ConfigError, match="profile: no such file"):
        load_profile(tmp_path / "missing.csv")
    pd.DataFrame({"a": [1]}).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(ConfigError, match="missing columns"):
        load_profile(tmp_path / "bad.csv")
    old = pd.read_csv(path).assign(version=0)
    old.to_csv(tmp_path / "old.csv", index=False)
    with pytest.raises(ConfigError, match="version"):
        load_profile(tmp_path / "old.csv")
    assert list(pd.read_csv(path).columns) == PROFILE_COLUMNS


def _results(values: dict[tuple[str, str], float], source: str) -> pd.DataFrame:
    return pd.DataFrame([{"scenario": "s", "variant": v, "source": source, "metric": m, "value": x,
                          "unit": "s", "device": ""} for (v, m), x in values.items()])


def test_errors_ranking_and_claim():
    measured = {("reduce_ln_bcast", "ttft_s"): 1.0, ("reduce_ln_bcast", "tpot_s"): 0.5,
                ("reduce_ln_bcast", "decode_tokens_per_s"): 2.0,
                ("allreduce_rd", "ttft_s"): 0.8, ("allreduce_rd", "tpot_s"): 0.25, ("allreduce_rd", "decode_tokens_per_s"): 4.0,
                ("allreduce_ring", "ttft_s"): 0.78, ("allreduce_ring", "tpot_s"): 1.0,
                ("allreduce_ring", "decode_tokens_per_s"): 1.0}
    simulated = {k: v * (1.1 if k[0] == "allreduce_ring" and k[1] == "ttft_s" else 1.0) for k, v in measured.items()}
    simulated[("allreduce_rd", "tpot_s")] = 0.6  # wrong order against reduce_ln_bcast (0.5)
    errors = case_errors("s", 32, _results(simulated, "simulated"), _results(measured, "measured"))
    assert errors.loc[(errors.variant == "allreduce_ring") & (errors.metric == "ttft_s"), "error"].iloc[0] == pytest.approx(0.1)
    summary = summarise_errors(errors, pd.DataFrame())
    ttft = summary[summary.metric == "ttft_s"].iloc[0]
    assert ttft.cases == 3 and ttft.median_abs_error == pytest.approx(0.0)
    ranking = ranking_agreement(errors)
    # ttft: rd vs ring differ by 2.5% < 10%: not a pair; tpot: all three pairs count
    assert set(ranking.metric) == {"ttft_s", "tpot_s"}
    wrong = ranking[~ranking.simulator_agrees]
    assert list(zip(wrong.faster, wrong.slower)) == [("allreduce_rd", "reduce_ln_bcast")]
    claim = seed_claim(errors)
    assert set(claim.best_allreduce) == {"allreduce_rd"}
    assert claim[claim.source == "measured"].tokens_per_s_allreduce_ln.iloc[0] == 4.0
    assert math.isfinite(claim.ttft_allreduce_ln_s.iloc[0])
    assert np.all(claim.columns[:3] == ["scenario", "prompt_tokens", "source"])


def test_memory_regimes_compare_fit_and_stall_verdicts():
    from validation.validate import memory_regimes

    def table(source, peak_mb, stall_s, tpot_s):
        rows = []
        for variant in peak_mb:
            rows += [("s", variant, source, "tpot_s", tpot_s[variant], "s", ""),
                     ("s", variant, source, "loader_stall_decode_s", stall_s[variant], "s", ""),
                     ("s", variant, source, "peak_memory_bytes", peak_mb[variant] * 1e6, "bytes", "d0"),
                     ("s", variant, source, "memory_capacity_bytes", 450e6, "bytes", "d0")]
        return pd.DataFrame(rows, columns=["scenario", "variant", "source", "metric", "value", "unit", "device"])

    simulated = table("simulated", {"resident": 500, "w1": 340, "w2": 420},
                      {"resident": 0.0, "w1": 2.0, "w2": 0.0}, {"resident": 1.4, "w1": 3.4, "w2": 1.4})
    measured = table("measured", {"resident": 505, "w1": 350, "w2": 460},
                     {"resident": 0.0, "w1": 2.1, "w2": 0.3}, {"resident": 1.4, "w1": 3.5, "w2": 1.7})
    regimes = memory_regimes("s", 64, simulated, measured).set_index("variant")
    assert not regimes.loc["resident", "fits_simulated"] and not regimes.loc["resident", "fits_measured"]
    assert regimes.loc["w1", "stalls_simulated"] and regimes.loc["w1", "stalls_measured"]
    assert regimes.loc["resident", "agrees"] and regimes.loc["w1", "agrees"]
    # w2: fits and does not stall in simulation, but measured 460 MB > 450 MB and stalls 18% of TPOT
    assert not regimes.loc["w2", "fits_measured"] and regimes.loc["w2", "stalls_measured"]
    assert not regimes.loc["w2", "agrees"]


def test_calibration_times_only_the_algorithms_variants_use_when_asked():
    pytest.importorskip("torch")
    from runtime.calibrate import used_algorithms

    scenario = make_scenario()  # rlb (binomial), ring, recursive doubling
    used = used_algorithms(scenario)
    assert used[OpKind.ALLREDUCE] == ("recursive_doubling", "ring")
    assert used[OpKind.REDUCE] == ("binomial",)
    auto = make_scenario(variants=[{"name": "a", "strategy": "allreduce_ln", "allreduce": "auto"}])
    assert "rabenseifner" in used_algorithms(auto)[OpKind.ALLREDUCE]


def test_calibration_generates_with_each_distinct_named_strategy():
    pytest.importorskip("torch")
    from runtime.calibrate import calibration_strategies

    scenario = make_scenario(variants=[
        {"name": "a", "strategy": "allreduce_ln", "allreduce": "ring"},
        {"name": "b", "strategy": "allreduce_ln", "allreduce": "ring"},
        {"name": "c", "strategy": "reduce_ln_bcast"},
        {"name": "d", "strategy": "allreduce_ln", "allreduce": "auto"}])
    assert [(c.strategy, c.allreduce) for c in calibration_strategies(scenario)] == [
        ("allreduce_ln", "ring"), ("reduce_ln_bcast", None)]
    only_auto = make_scenario(variants=[{"name": "d", "strategy": "allreduce_ln", "allreduce": "auto"}])
    assert [(c.strategy, c.allreduce) for c in calibration_strategies(only_auto)] == [("allreduce_ln", "library")]


def _span(generation, call, rank, kind, algorithm, size_bytes, start_s, end_s, name="attn_allreduce"):
    from runtime.comm_timing import CallSpan

    return CallSpan(generation, call, name, rank, kind, algorithm, size_bytes, start_s, end_s)


def test_in_place_rows_split_the_masters_call_into_its_wait_and_the_rest():
    pytest.importorskip("torch")
    from runtime.comm_timing import in_place_rows

    spans = []
    for call in range(3):  # rank 1 arrives 5 ms late (10 ms in the last call); the master ends 2 ms after
        t, late = call * 1.0, 0.005 if call < 2 else 0.010
        spans += [_span("g", call, 0, "allreduce", "ring", 4096, t, t + late + 0.002),
                  _span("g", call, 1, "allreduce", "ring", 4096, t + late, t + late + 0.001)]
    # a broadcast's root (the master) leaves before its leaf arrives: it waited its whole call
    spans += [_span("g", "b", 0, "broadcast", "library", 4096, 0.0, 0.001, name="attn_bcast"),
              _span("g", "b", 1, "broadcast", "library", 4096, 0.003, 0.004, name="attn_bcast")]
    spans.append(_span("g", 9, 0, "allreduce", "ring", 4096, 0.0, 5.0))  # a call only one rank recorded
    rows = {(r["op"], r["measurement"]): r for r in in_place_rows(spans, group_size=2, num_hosts=2, master=0)}
    assert set(rows) == {(op, m) for op in ("allreduce", "broadcast") for m in ("collective_in_place", "collective_wait")}
    transfer, wait = rows["allreduce", "collective_in_place"], rows["allreduce", "collective_wait"]
    # one generation: one sample, its mean call
    assert transfer["size_bytes"] == 4096 and transfer["repeats"] == wait["repeats"] == 1
    assert transfer["call"] == "attn_allreduce" and rows["broadcast", "collective_wait"]["call"] == "attn_bcast"
    assert transfer["median"] == pytest.approx(0.002) and wait["median"] == pytest.approx(0.020 / 3)
    assert rows["broadcast", "collective_wait"]["median"] == pytest.approx(0.001)
    assert rows["broadcast", "collective_in_place"]["median"] == pytest.approx(0.0)


def test_in_place_rows_are_statistics_over_generations_of_their_mean_call_per_plan_op():
    pytest.importorskip("torch")
    from runtime.comm_timing import in_place_rows

    spans = []
    # Three generations of two calls each: means 2, 3 and 10 ms (a slow generation).
    for generation, calls_s in enumerate(([0.001, 0.003], [0.003, 0.003], [0.010, 0.010])):
        for call, duration in enumerate(calls_s):
            t = generation * 10.0 + call
            spans += [_span(generation, call, rank, "allreduce", "ring", 3072, t, t + duration) for rank in (0, 1)]
            # the same kind, algorithm and size in another place of the step: a row of its own
            spans += [_span(generation, ("other", call), rank, "allreduce", "ring", 3072, t + 0.5, t + 0.6,
                            name="mlp_allreduce") for rank in (0, 1)]
    rows = {r["call"]: r for r in in_place_rows(spans, group_size=2, num_hosts=1, master=0)
            if r["measurement"] == "collective_in_place"}
    row = rows["attn_allreduce"]
    assert row["repeats"] == 3
    assert row["median"] == pytest.approx(0.003)  # what the simulator charges: the slow generation does not move it
    assert row["mean"] == pytest.approx(0.005)
    assert rows["mlp_allreduce"]["median"] == pytest.approx(0.1)


def _two_kinds_profile(waits: dict[int, float] | None = None) -> Profile:
    waits = waits or {}
    rows = [{"measurement": "collective", "op": "allreduce", "algorithm": "ring", "group_size": 4, "num_hosts": 2,
             "size_bytes": size, "median": t, "unit": "s"} for size, t in {1024: 1e-3, 4096: 2e-3, 65536: 4e-3}.items()]
    rows += [{"measurement": "collective_in_place", "op": "allreduce", "algorithm": "ring", "group_size": 4,
              "num_hosts": 2, "size_bytes": size, "median": t, "unit": "s"} for size, t in {4096: 5e-3, 16384: 6e-3}.items()]
    rows += [{"measurement": "collective_wait", "op": "allreduce", "algorithm": "ring", "group_size": 4,
              "num_hosts": 2, "size_bytes": size, "median": t, "unit": "s"} for size, t in waits.items()]
    return Profile(profile_frame(rows))


def test_in_place_times_price_a_run_and_carry_their_overhead_beyond_their_sizes():
    topology = build_topology(ClusterConfig.model_validate(cluster(2, 2)))
    group = (0, 1, 2, 3)

    def ring(size):
        return build_schedule(OpKind.ALLREDUCE, "ring", group, size, host_groups=topology.host_groups(group))

    network = CalibratedNetwork(_two_kinds_profile(), FlowNetwork(topology), topology)
    assert network.time(ring(8192)).duration_s == pytest.approx(5e-3 + 1e-3 * (8192 - 4096) / (16384 - 4096), rel=1e-9)
    assert not network.extrapolated
    # beyond the in-place sizes: isolated time there plus the in-place overhead at 16 KiB
    isolated_16k = 2e-3 + 2e-3 * (16384 - 4096) / (65536 - 4096)
    assert network.time(ring(65536)).duration_s == pytest.approx(4e-3 + 6e-3 - isolated_16k, rel=1e-9)
    assert any("outside the sizes measured in place" in line for line in network.extrapolated)
    alone = CalibratedNetwork(_two_kinds_profile(), FlowNetwork(topology), topology, in_place=False)
    assert alone.time(ring(4096)).duration_s == pytest.approx(2e-3, rel=1e-9)


def test_in_run_collective_calls_are_charged_from_the_last_arrival_to_the_masters_end():
    from validation.validate import call_durations

    ops = pd.DataFrame([
        (0, "compute", "allreduce", "attn_allreduce", "decode", 1, 0, 0.000, 0.010, 3072, 0),
        (1, "compute", "allreduce", "attn_allreduce", "decode", 1, 0, 0.004, 0.009, 3072, 0),
        (0, "compute", "allreduce", "attn_allreduce", "decode", 1, 1, 0.020, 0.023, 3072, 0),
        (1, "compute", "allreduce", "attn_allreduce", "decode", 1, 1, 0.020, 0.025, 3072, 0),
        (0, "compute", "mlp_up", "mlp_up", "decode", 1, 1, 0.010, 0.020, 0, 1e6)],
        columns=["rank", "stream", "kind", "name", "phase", "step", "layer", "start_s", "end_s", "bytes", "flops"])
    calls = call_durations(ops)
    assert calls["duration_s"].tolist() == pytest.approx([0.006, 0.003])
    assert set(calls["op"]) == {"allreduce"} and set(calls["size_bytes"]) == {3072}


def test_collective_target_population_is_large_or_delayed():
    errors = pd.DataFrame({"metric": ["ttft_s"], "error": [0.0]})
    collectives = pd.DataFrame({"error": [0.5, 0.02, -0.04], "targeted": [False, True, True]})
    summary = summarise_errors(errors, collectives).set_index("metric")
    assert summary.loc["collective_s", "cases"] == 2
    assert summary.loc["collective_s", "median_abs_error"] == pytest.approx(0.03)
    assert summary.loc["collective_s_all", "cases"] == 3


def test_collective_checks_flag_the_target_population():
    from validation.validate import collective_errors

    rows = [{"measurement": "collective", "op": "allreduce", "algorithm": "ring", "group_size": 4, "num_hosts": 2,
             "size_bytes": size, "median": t, "unit": "s"} for size, t in {1024: 1e-3, 4 * 2**20: 0.4}.items()]
    profile = Profile(profile_frame(rows))
    measured = pd.DataFrame({"op": ["allreduce"] * 2, "algorithm": ["ring"] * 2, "group_size": [4, 4],
                             "size_bytes": [2048, 2 * 2**20], "median": [1.5e-3, 0.2], "p10": [1e-3, 0.2],
                             "p90": [2e-3, 0.2]})
    fast = collective_errors(make_scenario(cluster=cluster(2, 2)), profile, measured)
    assert fast["targeted"].tolist() == [False, True]
    assert fast["error"].iloc[0] == pytest.approx(fast["simulated"].iloc[0] / 1.5e-3 - 1)
    slow = make_scenario(cluster=cluster(2, 2) | {"hosts": [{**cluster(2, 2)["hosts"][0],
                                                            "nic": {"bandwidth": "1Gbit/s", "latency": "2.5ms"}}]})
    assert collective_errors(slow, profile, measured)["targeted"].tolist() == [True, True]


def test_short_cases_get_enough_repeats_to_fill_the_timed_span():
    pytest.importorskip("torch")
    from runtime.worker import timed_rounds

    assert timed_rounds(3, 20.0, 2.5) == 8  # ceil(20 s / the slowest warm-up generation's 2.5 s)
    assert timed_rounds(3, 5.0, 2.5) == 3  # never fewer than repeats
    assert timed_rounds(3, 0.0, 2.5) == 3
    assert timed_rounds(3, 20.0, 0.0) == 3  # no warm-up to judge by


def test_timings_join_the_memory_of_their_own_launch():
    pytest.importorskip("torch")
    from runtime.measure import with_memory
    from runtime.worker import RankMeasurement

    def launch(repeats: int, peak: int, samples: list) -> list[list[RankMeasurement]]:
        starts = np.tile([0.0, 1.0], (repeats, 1))
        return [[RankMeasurement(rank, name, starts, starts + 0.5, ["records"], np.zeros((repeats, 1, 2)),
                                 peak + rank, samples, np.zeros((repeats, 2)))
                 for name in ("a", "b")] for rank in (0, 1)]

    timed, memory = launch(3, 0, []), launch(0, 100, [(0.2, 70), (0.3, 90)])
    both = with_memory(timed, memory)
    lead = both[0][1]
    assert lead.step_start_s.shape == (3, 2) and lead.records == ["records"]
    assert [m.peak_memory_bytes for m in (both[0][0], both[1][0])] == [100, 101]
    assert lead.memory_samples == [(0.5, 70), (1.5, 90)]  # the memory launch's bytes at the timed steps' ends
    with pytest.raises(ValueError, match="same ranks and variants"):
        with_memory(timed, [per_rank[:1] for per_rank in memory])


def test_calibration_rounds_spread_evenly_over_the_interleaved_rounds():
    pytest.importorskip("torch")
    from runtime.interleaved import spread

    assert spread(5, 5) == {0, 1, 2, 3, 4}
    assert spread(5, 10) == {0, 2, 4, 7, 9}
    assert spread(1, 4) == {0} and spread(2, 7) == {0, 6}
    assert spread(8, 3) == {0, 1, 2}
    with pytest.raises(ValueError, match="at least 1"):
        spread(0, 3)


def test_cpu_probe_reads_steal_and_the_load_of_other_processes(tmp_path):
    from runtime.cpu_steal import ZERO, cpu_sample

    stat, proc = tmp_path / "stat", tmp_path / "proc"
    for pid in (11, 12):
        (proc / str(pid)).mkdir(parents=True)

    def write(cpu: str, ours: dict[int, tuple[int, int]]):
        stat.write_text(f"cpu  {cpu}\ncpu0 1 2 3\n")
        for pid, (user, system) in ours.items():
            # a command name with a space and a parenthesis, as proc(5) allows
            (proc / str(pid) / "stat").write_text(f"{pid} (python (r) 1) S 1 1 1 0 -1 4194304 10 0 0 0 "
                                                  f"{user} {system} 0 0 20 0 3 0 100 0 0\n")

    write("100 0 50 800 10 0 20 20 0 0", {11: (40, 10), 12: (30, 5)})
    before = cpu_sample([11, 12, 13], stat, proc)  # 13 has exited: it adds nothing
    assert (before.steal, before.busy, before.total, before.ours) == (20, 170, 1000, 85)
    write("190 0 90 1500 10 0 40 170 0 0", {11: (80, 20), 12: (60, 10)})
    span = cpu_sample([11, 12, 13], stat, proc) - before
    assert span.steal_fraction == pytest.approx(150 / 1000)
    # busy 150 ticks of 1000, the ranks' 85: the other processes took 6.5% of the machine
    assert span.other_load == pytest.approx(65 / 1000)
    assert cpu_sample([11], tmp_path / "missing", proc) == ZERO
    assert math.isnan(ZERO.steal_fraction) and math.isnan(ZERO.other_load)


def test_step_terms_split_the_master_step_and_contributions_add_up_to_its_error():
    from types import SimpleNamespace

    from validation.terms import step_terms, term_errors, term_summary

    columns = ["rank", "stream", "kind", "name", "phase", "step", "layer", "start_s", "end_s", "bytes", "flops"]

    def trace(mlp_s: tuple[float, float], end_s: float):
        ops = pd.DataFrame([
            (0, "compute", "mlp_up", "mlp_up", "decode", 1, 0, 0.0, mlp_s[0], 0, 1e6),
            (0, "compute", "allreduce", "mlp_allreduce", "decode", 1, 0, mlp_s[0], 0.020, 3072, 0),
            (0, "loader", "weight_load", "load_1", "decode", 1, 1, 0.0, 0.019, 1e6, 0),
            (1, "compute", "mlp_up", "mlp_up", "decode", 1, 0, 0.0, mlp_s[1], 0, 1e6),
            (1, "compute", "allreduce", "mlp_allreduce", "decode", 1, 0, mlp_s[1], 0.020, 3072, 0)], columns=columns)
        steps = pd.DataFrame({"step": [0, 1], "phase": ["prefill", "decode"], "start_s": [-1.0, 0.0],
                              "end_s": [0.0, end_s]})
        return SimpleNamespace(ops=ops, steps=steps)

    measured = trace((0.010, 0.014), 0.025)
    terms = step_terms(measured.ops, measured.steps).set_index("term")["seconds"]
    # The master waits 4 ms in the allreduce for rank 1; the loader's stream runs beside the
    # compute and is left out; the terms fill the step.
    assert terms.to_dict() == pytest.approx({"collective:allreduce": 0.006, "compute:mlp_up": 0.010,
                                             "wait": 0.004, "other": 0.005})
    # A simulated op carries the framework's gap inside its span; the split moves it to the rest.
    gapped = step_terms(measured.ops, measured.steps, gap_s=0.001).set_index("term")["seconds"]
    assert gapped.to_dict() == pytest.approx({"collective:allreduce": 0.005, "compute:mlp_up": 0.009,
                                              "wait": 0.004, "other": 0.007})
    simulated = trace((0.012, 0.012), 0.022)
    table = term_errors("s", 8, SimpleNamespace(variants=[SimpleNamespace(trace=simulated, timing={"tpot_s": 0.022})]),
                        SimpleNamespace(variants=[SimpleNamespace(name="ar", trace=measured, timing={"tpot_s": 0.025})]))
    assert set(table["phase"]) == {"decode"}  # no prefill ops: that step is not split
    by_term = table.set_index("term")["contribution"]
    assert by_term.sum() == pytest.approx(0.022 / 0.025 - 1)
    assert by_term.abs().idxmax() == "wait"  # simulated ranks arrive together; measured, 4 ms apart
    summary = term_summary(table).set_index("term")
    assert summary.loc["other", "share"] == pytest.approx(0.2)


def test_term_split_uses_every_repeat_and_accounts_for_the_error_against_the_median():
    from types import SimpleNamespace

    from validation.terms import term_behind, term_errors

    columns = ["rank", "stream", "kind", "name", "phase", "step", "layer", "start_s", "end_s", "bytes", "flops"]

    def trace(mlp_s: float, wait_s: float, end_s: float):
        ops = pd.DataFrame([
            (0, "compute", "mlp_up", "mlp_up", "decode", 1, 0, 0.0, mlp_s, 0, 1e6),
            (0, "compute", "allreduce", "mlp_allreduce", "decode", 1, 0, mlp_s, mlp_s + wait_s + 0.005, 3072, 0),
            (1, "compute", "mlp_up", "mlp_up", "decode", 1, 0, 0.0, mlp_s + wait_s, 0, 1e6),
            (1, "compute", "allreduce", "mlp_allreduce", "decode", 1, 0, mlp_s + wait_s, mlp_s + wait_s + 0.005,
             3072, 0)], columns=columns)
        steps = pd.DataFrame({"step": [0, 1], "phase": ["prefill", "decode"], "start_s": [-1.0, 0.0],
                              "end_s": [0.0, end_s]})
        return SimpleNamespace(ops=ops, steps=steps)

    # Three repeats: the fastest (the last) had no wait; the median TPOT is 30 ms.
    rounds = (trace(0.010, 0.010, 0.030), trace(0.012, 0.020, 0.040), trace(0.010, 0.000, 0.020))
    simulated = trace(0.010, 0.000, 0.021)
    table = term_errors("s", 8, SimpleNamespace(variants=[SimpleNamespace(trace=simulated, timing={"tpot_s": 0.021})]),
                        SimpleNamespace(variants=[SimpleNamespace(name="ar", trace=rounds[-1], rounds=rounds,
                                                                  timing={"tpot_s": 0.030})]))
    terms = table.set_index("term")
    # each measured term is its median over the repeats; together they make the median TPOT
    assert terms["measured_s"].to_dict() == pytest.approx({"compute:mlp_up": 0.010, "collective:allreduce": 0.005,
                                                           "wait": 0.010, "other": 0.005})
    assert terms["contribution"].sum() == pytest.approx(0.021 / 0.030 - 1)  # the error the table reports
    assert term_behind(table, 0.021 / 0.030 - 1)["term"] == "wait"


def test_calibrated_wait_is_charged_before_each_collective_and_shows_in_the_trace():
    from validation.terms import step_terms

    topology = build_topology(ClusterConfig.model_validate(cluster(2, 2)))
    group = (0, 1, 2, 3)
    ring = build_schedule(OpKind.ALLREDUCE, "ring", group, 8192, host_groups=topology.host_groups(group))
    network = CalibratedNetwork(_two_kinds_profile({4096: 1e-3, 16384: 4e-3}), FlowNetwork(topology), topology)
    timing = network.time(ring)
    assert timing.wait_s == pytest.approx(2e-3, rel=1e-9)  # interpolated in size like the rest of the call
    assert timing.duration_s == pytest.approx(2e-3 + 5e-3 + 1e-3 / 3, rel=1e-9)
    # A whole run: every allreduce costs the master 2 ms of waiting and 1 ms after the last arrival.
    scenario, compute = _profile_from_simulation(scale=1.0)

    def with_collectives(wait_s: float) -> Profile:
        rows = [{"measurement": m, "op": "allreduce", "algorithm": "library", "group_size": 2, "num_hosts": 2,
                 "size_bytes": size, "median": t, "unit": "s"}
                for m, t in (("collective_in_place", 1e-3), ("collective_wait", wait_s)) for size in (1, 1 << 30)]
        return Profile(profile_frame([*compute.rows.to_dict("records"), *rows]))

    waiting, together = simulate(scenario, profile=with_collectives(2e-3)), simulate(scenario, profile=with_collectives(0.0))
    trace = waiting.variants[0].trace
    terms = step_terms(trace.ops, trace.steps).set_index(["phase", "term"])["seconds"]
    calls = trace.ops[(trace.ops["kind"] == "allreduce") & (trace.ops["rank"] == 0)].groupby("phase").size()
    steps = trace.ops.groupby("phase")["step"].nunique()
    for phase in ("prefill", "decode"):
        per_step = calls[phase] / steps[phase]
        assert terms[phase, "wait"] == pytest.approx(per_step * 2e-3, rel=1e-6)
        assert terms[phase, "collective:allreduce"] == pytest.approx(per_step * 1e-3, rel=1e-6)
    ttft = {r.metric: r.value for r in waiting.results.itertuples() if r.variant == "ar"}["ttft_s"]
    ttft_together = {r.metric: r.value for r in together.results.itertuples() if r.variant == "ar"}["ttft_s"]
    assert ttft - ttft_together == pytest.approx(calls["prefill"] / steps["prefill"] * 2e-3, rel=1e-6)


def test_in_run_errors_compare_with_the_measured_mean_and_skip_calls_with_no_time_after_the_last_arrival():
    from types import SimpleNamespace

    from validation.validate import in_run_errors

    columns = ["rank", "stream", "kind", "name", "phase", "step", "layer", "start_s", "end_s", "bytes", "flops"]

    def variant(allreduce_ends: tuple[float, float], root_end_s: float, name: str = "ar"):
        ops = pd.DataFrame([
            (0, "compute", "allreduce", "ar", "decode", 1, 0, 0.0, allreduce_ends[0], 3072, 0),
            (1, "compute", "allreduce", "ar", "decode", 1, 0, 0.0, 0.004, 3072, 0),
            (0, "compute", "allreduce", "ar", "decode", 1, 1, 0.1, 0.1 + allreduce_ends[1], 3072, 0),
            (1, "compute", "allreduce", "ar", "decode", 1, 1, 0.1, 0.104, 3072, 0),
            # the root (the master) sends and leaves before its leaf arrives
            (0, "compute", "broadcast", "bc", "decode", 1, 0, 0.2, root_end_s, 3072, 0),
            (1, "compute", "broadcast", "bc", "decode", 1, 0, 0.21, 0.22, 3072, 0)], columns=columns)
        return SimpleNamespace(name=name, trace=SimpleNamespace(ops=ops))

    table = in_run_errors("s", 8, SimpleNamespace(variants=[variant((0.003, 0.003), 0.201)]),
                          SimpleNamespace(variants=[variant((0.002, 0.004), 0.201)])).set_index("op")
    assert table.loc["allreduce", "measured"] == pytest.approx(0.003)  # the mean of 2 ms and 4 ms
    assert table.loc["allreduce", "error"] == pytest.approx(0.0)
    assert table.loc["broadcast", "measured"] == 0.0 and math.isnan(table.loc["broadcast", "error"])


def test_a_call_is_priced_from_its_own_plan_op_timed_in_place_and_else_from_every_call_pooled():
    scenario, compute = _profile_from_simulation(scale=1.0)
    topology = build_topology(scenario.config.cluster)
    # The same kind, algorithm and sizes in two places of a step: 1 ms as mlp_allreduce, 9 ms as
    # attn_allreduce (another place of the step, other neighbours, another last arrival).
    rows = [{"measurement": "collective_in_place", "call": call, "op": "allreduce", "algorithm": "library",
             "group_size": 2, "num_hosts": 2, "size_bytes": size, "median": t, "unit": "s"}
            for call, t in (("mlp_allreduce", 1e-3), ("attn_allreduce", 9e-3)) for size in (1, 1 << 30)]
    profile = Profile(profile_frame([*compute.rows.to_dict("records"), *rows]))
    network = CalibratedNetwork(profile, FlowNetwork(topology), topology)
    schedule = build_schedule(OpKind.ALLREDUCE, "library", (0, 1), 4096, host_groups=topology.host_groups((0, 1)))
    assert network.time(schedule, "mlp_allreduce").duration_s == pytest.approx(1e-3)
    assert network.time(schedule, "attn_allreduce").duration_s == pytest.approx(9e-3)
    assert network.time(schedule, "embed_bcast").duration_s == pytest.approx(5e-3)  # not timed: the pooled median
    assert network.time(schedule).duration_s == pytest.approx(5e-3)
    # The engine names each call by its plan op: a step charges each its own.
    trace = simulate(scenario, profile=profile).variants[0].trace
    master = trace.ops[(trace.ops["rank"] == 0) & (trace.ops["kind"] == "allreduce")]
    durations = (master["end_s"] - master["start_s"]).groupby(master["name"]).median()
    assert durations["mlp_allreduce"] == pytest.approx(1e-3) and durations["attn_allreduce"] == pytest.approx(9e-3)


def test_measured_result_keeps_a_trace_of_every_timed_repeat_where_the_ranks_kept_them():
    pytest.importorskip("torch")
    from runtime.measure import measured_result
    from runtime.worker import RankMeasurement
    from sim.trace import TraceEvent

    scenario = make_scenario(cluster=cluster(1, 2), variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}])
    topology = build_topology(scenario.config.cluster)

    def event(rank: int, repeat: int) -> TraceEvent:
        return TraceEvent(rank, "compute", "mlp_up", "mlp_up", "decode", 1, 0, 0.0, 0.01 * (repeat + 1), 0.0, 1.0)

    def rank_measurement(rank: int, kept: bool) -> RankMeasurement:
        starts = np.tile([0.0, 1.0], (3, 1))
        rounds = tuple([event(rank, repeat)] for repeat in range(3)) if kept else ()
        return RankMeasurement(rank, "rlb", starts, starts + 0.5, [event(rank, 2)], np.zeros((3, 1, 2)), 0, [],
                               np.zeros((3, 2)), rounds)

    kept = measured_result(scenario, topology, [[rank_measurement(r, True)] for r in (0, 1)]).variants[0]
    assert [len(t.ops) for t in kept.rounds] == [2, 2, 2]  # both ranks' records of each repeat
    assert [float(t.ops["end_s"].max()) for t in kept.rounds] == pytest.approx([0.01, 0.02, 0.03])
    alone = measured_result(scenario, topology, [[rank_measurement(r, False)] for r in (0, 1)]).variants[0]
    assert alone.rounds == () and len(alone.trace.ops) == 2


def test_measured_result_reports_each_device_s_tbf_drops_per_step_where_they_were_counted():
    pytest.importorskip("torch")
    from runtime.measure import measured_result
    from runtime.worker import RankMeasurement
    from sim.trace import TraceEvent

    scenario = make_scenario(cluster=cluster(1, 2), variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}])
    topology = build_topology(scenario.config.cluster)
    starts = np.tile([0.0, 1.0], (3, 1))  # 3 timed repeats of 2 steps

    def rank_measurement(rank: int, dropped: int | None) -> RankMeasurement:
        event = TraceEvent(rank, "compute", "mlp_up", "mlp_up", "decode", 1, 0, 0.0, 0.01, 0.0, 1.0)
        return RankMeasurement(rank, "rlb", starts, starts + 0.5, [event], np.zeros((3, 1, 2)), 0, [],
                               np.zeros((3, 2)), dropped_packets=dropped)

    rows = measured_result(scenario, topology, [[rank_measurement(0, 12)], [rank_measurement(1, None)]]).results
    dropped = rows[rows["metric"] == "dropped_packets_per_step"].set_index("device")["value"]
    devices = [d.name for d in topology.devices]
    assert dropped.to_dict() == {devices[0]: 2.0}  # 12 drops over 6 timed steps; none counted outside a testbed


def test_measured_ttft_runs_from_the_prefill_start_not_the_clock_sync():
    """Rank 0 reads the common start before broadcasting it and starts its prefill once that
    broadcast returns (on the delayed testbed link 11 ms or under 1 ms, by the generation before):
    a measured TTFT counts from the first rank's prefill start, as the simulator's does, so the
    harness's sync lands in no variant's TTFT; the traces keep the common start."""
    pytest.importorskip("torch")
    from runtime.measure import measured_result
    from runtime.worker import RankMeasurement

    scenario = make_scenario(cluster=cluster(1, 2), variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}],
                             workload={"batch_size": 1, "prompt_tokens": 8, "output_tokens": 2})
    topology = build_topology(scenario.config.cluster)
    synced_s = np.array([[0.011], [0.001], [0.024]])  # rank 0's prefill start, per repeat
    prefill_s, decode_s, late_s = 0.100, 0.050, 0.005  # rank 1 hears the start a link latency later

    def rank_measurement(rank: int) -> RankMeasurement:
        starts = synced_s + np.array([0.0, prefill_s]) + (late_s if rank else 0.0) * np.array([1.0, 0.0])
        ends = synced_s + np.array([prefill_s, prefill_s + decode_s])
        return RankMeasurement(rank, "rlb", starts, ends, [], np.zeros((3, 1, 2)), 0, [], np.zeros((3, 2)))

    measured = measured_result(scenario, topology, [[rank_measurement(r)] for r in (0, 1)])
    values = measured.results.set_index("metric")["value"]
    assert values["ttft_s"] == pytest.approx(prefill_s) and values["ttft_p90_s"] == pytest.approx(prefill_s)
    assert values["tpot_s"] == pytest.approx(decode_s)
    assert values["e2e_latency_s"] == pytest.approx(prefill_s + decode_s)
    assert float(measured.variants[0].trace.steps["start_s"].iloc[0]) == pytest.approx(0.024)  # the last repeat's
