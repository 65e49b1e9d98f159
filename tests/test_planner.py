"""hetsim plan: the pick, the frontiers, the pruning that never drops what the simulator would
accept, the outputs and the one-line errors of bad plan files."""

import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from models.errors import ConfigError
from sim.planning.catalog import DEFAULT_CATALOG, load_catalog
from sim.planning.outcome import pareto, plan, ranking
from sim.planning.plan_config import load_plan, plan_from_dict
from sim.planning.search import Planner, Stage, slo_miss
from sim.scenario import load_scenario, scenario_from_dict
from sim.simulate import simulate
from sim.vocabulary import Metric
from validation.cli import main

ROOT = Path(__file__).resolve().parent.parent
SMALL = {
    "name": "small_plan",
    "models": ["gpt2"],
    "dtype": "fp16",
    "workload": {"batch_size": 4, "prompt_tokens": 256, "output_tokens": 8},
    "slo": {"ttft": "30ms", "tpot": "3ms"},
    "search": {"devices": ["rtx_4090", "t4", "rtx_3060_12gb", "cpu"], "devices_per_host": [1, 2], "hosts": [1, 2],
               "networks": ["eth10g", "eth100g"],
               "variants": [{"name": "rlb", "strategy": "reduce_ln_bcast"},
                            {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"},
                            {"name": "auto", "strategy": "allreduce_ln", "allreduce": "auto"}]},
}


@pytest.fixture(scope="module")
def small():
    return plan(plan_from_dict(SMALL))


def test_the_pick_is_the_cheapest_configuration_meeting_every_objective(small):
    table = small.table
    assert small.pick is not None and small.pick["meets_slo"]
    assert small.pick["price_per_hour"] == table.loc[table["meets_slo"], "price_per_hour"].min()
    assert not slo_miss(small.pick, small.request.config.slo)
    # Every layout of every cluster is in the table; the top 10 are distinct clusters.
    top = small.top
    assert list(top["rank"]) == list(range(1, len(top) + 1)) and top["cluster"].is_unique
    assert top.iloc[0]["candidate"] == small.pick["candidate"]
    for _, row in top.iloc[1:].iterrows():
        assert row["versus_pick"] and row["bottleneck"]
    assert str(small.pick["cluster"]) in small.recommendation and "$" in small.recommendation


def test_frontier_points_are_not_dominated_and_the_rest_are(small):
    fitted = small.table[(small.table["stage"] == Stage.SIMULATED) & small.table["fits"]]
    for flag, metric, better in (("pareto_latency", Metric.E2E_LATENCY, lambda a, b: a < b),
                                 ("pareto_throughput", Metric.DECODE_TOKENS_PER_S, lambda a, b: a > b)):
        for _, row in fitted.iterrows():
            dominated = ((fitted["price_per_hour"] <= row["price_per_hour"]) & better(fitted[metric], row[metric])).any()
            cheaper_as_good = ((fitted["price_per_hour"] < row["price_per_hour"])
                               & ~better(row[metric], fitted[metric])).any()
            assert row[flag] == (not dominated and not cheaper_as_good), (flag, row["cluster"], row["variant"])


def test_pareto_keeps_the_cheapest_of_equals_and_skips_nan():
    price = pd.Series([1.0, 1.0, 2.0, 3.0, 4.0])
    latency = pd.Series([5.0, 4.0, 4.0, 1.0, math.nan])
    assert list(pareto(price, latency, larger_is_better=False)) == [False, True, False, True, False]
    assert list(pareto(pd.Series([1.0, 1.0]), pd.Series([2.0, 2.0]), larger_is_better=False)) == [True, True]


def test_a_dearer_configuration_with_the_same_metrics_takes_no_top_slot():
    # the same layout over 10 GbE and over 100 GbE, no traffic between its hosts: one slot, the cheaper
    rows = [("2 x 4 a over eth10g", 1.0, 0.5), ("2 x 4 a over eth100g", 1.1, 0.5), ("1 x 8 b", 1.2, 0.4)]
    table = pd.DataFrame([{"candidate": i, "model": "m", "cluster": cluster, "price_per_hour": price,
                           "stage": Stage.SIMULATED, "fits": True, "meets_slo": True, "slo_miss": "",
                           Metric.TTFT: 0.1, Metric.TPOT: 0.01, Metric.E2E_LATENCY: e2e,
                           Metric.DECODE_TOKENS_PER_S: 100.0 / e2e} for i, (cluster, price, e2e) in enumerate(rows)])
    assert list(ranking(table)) == [1, 0, 2]
    assert list(ranking(table.assign(model=["m", "n", "m"]))) == [1, 2, 3]  # another model is another answer


def test_closed_form_pruning_never_drops_a_configuration_the_simulator_accepts():
    # Llama-2-7B in fp16 (13.5 GB): too large for one 12 GiB RTX 3060, too slow on a T4 for 100 ms.
    pruned = SMALL | {"models": ["llama-2-7b"], "slo": {"ttft": "100ms"},
                      "workload": {"batch_size": 1, "prompt_tokens": 512, "output_tokens": 4},
                      "search": SMALL["search"] | {"devices": ["rtx_3060_12gb", "t4"], "hosts": [1]}}
    planner = Planner(plan_from_dict(pruned))
    table = planner.candidates()
    assert {Stage.MEMORY, Stage.BOUND} <= set(table["stage"])
    checked = 0
    for stage in (Stage.MEMORY, Stage.BOUND):
        for _, row in table[table["stage"] == stage].head(4).iterrows():
            scenario = scenario_from_dict(planner.scenario_dict(row))
            vr = simulate(scenario, expand_steps=()).variants[0]
            if stage == Stage.MEMORY:
                assert vr.overflow is not None
            else:
                assert slo_miss(vr.timing, planner.request.config.slo)
                assert vr.timing[Metric.TTFT] >= row["ttft_lower_bound_s"]
                assert vr.timing[Metric.TPOT] >= row["tpot_lower_bound_s"] * (1 - 1e-9)
            checked += 1
    assert checked >= 4


def test_streamed_weights_bound_each_step_by_their_loads():
    # Llama-2-7B in fp16 (13.5 GB) on one RTX 3060 12GB: only streamed weights fit, and each step
    # reads most of them from the host's NVMe (3 GB/s): seconds, where its compute takes milliseconds
    request = SMALL | {"models": ["llama-2-7b"], "slo": {"tpot": "1000s"},
                       "workload": {"batch_size": 1, "prompt_tokens": 64, "output_tokens": 2},
                       "search": SMALL["search"] | {"devices": ["rtx_3060_12gb"], "devices_per_host": [1], "hosts": [1],
                                                    "variants": SMALL["search"]["variants"][:1]}}
    table = plan(plan_from_dict(request)).table
    streamed = table[table["memory_policy"].str.startswith("sliding_window")].iloc[0]
    assert streamed["stage"] == Stage.SIMULATED and streamed[Metric.TPOT] >= streamed["tpot_lower_bound_s"] > 1.0
    assert streamed[Metric.TTFT] >= streamed["ttft_lower_bound_s"] > 1.0
    strict = Planner(plan_from_dict(request | {"slo": {"tpot": "500ms"}})).candidates()
    pruned = strict[strict["memory_policy"].str.startswith("sliding_window")].iloc[0]
    assert pruned["stage"] == Stage.BOUND and pruned["reason"].startswith("TPOT at least")


def test_mixed_clusters_and_every_stage_are_searched(small):
    table = small.table
    assert table["device_types"].str.contains(r"\+").any()
    # Mixed clusters also try the split by each device's compute; clusters of one type do not.
    mixed = table["device_types"].str.contains(r"\+")
    assert table.loc[mixed, "parallel"].str.endswith("uneven").any()
    assert not table.loc[~mixed, "parallel"].str.endswith("uneven").any()
    assert {Stage.LAYOUT, Stage.SIMULATED} <= set(table["stage"])
    assert len(table) == len(Planner(plan_from_dict(SMALL)).candidates())


def test_plan_command_writes_the_table_the_report_and_a_pick_that_simulates(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    main(["plan", str(path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    for name in ("plan.csv", "plan.parquet", "report.html", "pick.yaml"):
        assert (tmp_path / "out" / name).is_file()
    csv = pd.read_csv(tmp_path / "out" / "plan.csv")
    parquet = pd.read_parquet(tmp_path / "out" / "plan.parquet")
    assert len(csv) == len(parquet) and {"price_per_hour", "stage", "bottleneck", "pareto_latency", "parallel"} <= set(csv.columns)
    assert "hetsim measure" in out and "torchrun" in out and "Use " in out
    pick = load_scenario(tmp_path / "out" / "pick.yaml")
    picked = csv[csv["rank"] == 1].iloc[0]
    assert simulate(pick, expand_steps=()).variants[0].timing[Metric.TTFT] == pytest.approx(picked[Metric.TTFT])
    html = (tmp_path / "out" / "report.html").read_text()
    assert "price ($ per hour)" in html and "Pareto frontier" in html


@pytest.mark.parametrize("change, field", [
    ({"search": {"devices": ["b200"]}}, "search.devices[0]"),
    ({"limits": {"budget_per_hour": 0}}, "limits.budget_per_hour"),
    ({"slo": {}}, "slo"),
    ({"slo": {"tpot": "fast"}}, "slo.tpot"),
    ({"prices": {"b200": 3.0}}, "prices.b200"),
    ({"prices": {"t4": -1}}, "prices.t4"),
    ({"host_prices": {"b200": 0.1}}, "host_prices.b200"),
    ({"host_prices": {"t4": "cheap"}}, "host_prices.t4"),
    ({"models": ["gpt-9"]}, "models[0]"),
    ({"surprise": 1}, "surprise"),
    ({"search": {"hosts": [0]}}, "search.hosts"),
    ({"workload": {"batch_size": 1, "prompt_tokens": 16, "output_tokens": 1}}, "workload.output_tokens"),
    ({"catalog": "missing.yaml"}, "catalog"),
    ({"search": {"networks": ["carrier_pigeon"]}}, "search.networks[0]"),
])
def test_a_bad_plan_file_is_one_line_naming_the_field_exit_2(tmp_path, capsys, change, field):
    assert_plan_refused(SMALL | change, field, tmp_path, capsys)


def assert_plan_refused(data: dict, field: str, tmp_path, capsys) -> None:
    """``hetsim plan`` on ``data`` exits 2 with one line naming ``field``, writing nothing."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"hetsim: error: {field}"), err
    assert not (tmp_path / "out").exists()


def test_the_default_catalog_dates_and_sources_every_price():
    catalog = load_catalog(DEFAULT_CATALOG)
    for name, offer in catalog.devices.items():
        assert offer.source and offer.as_of and offer.price_per_hour > 0 and offer.host_source, name
        # an owned GPU's host is bought beside it; a rented one's is in its price, a Jetson is its own host
        owned_gpu = offer.source.startswith("owned") and not name.startswith("jetson")
        assert (offer.host_price_per_hour > 0) == owned_gpu, name
    for option in (*catalog.interconnects.values(), *catalog.networks.values()):
        assert option.source


def test_a_cluster_pays_for_its_hosts_and_host_prices_override_the_catalogs():
    request = plan_from_dict(SMALL | {"search": SMALL["search"] | {"devices": ["rtx_3060_12gb", "rtx_4090"]},
                                      "host_prices": {"rtx_4090": 0.5}})
    catalog = request.catalog
    owned, rented = catalog.devices["rtx_3060_12gb"], catalog.devices["rtx_4090"]
    assert owned.host_price_per_hour > 0 and rented.host_source == "PLAN.yaml host_prices"
    prices = {shape.label(): shape.price_per_hour(catalog) for shape in Planner(request).shapes}
    network = catalog.networks["eth100g"].price_per_hour_per_host
    assert prices["2 x 2 rtx_3060_12gb (pcie4) over eth100g"] == pytest.approx(
        4 * owned.price_per_hour + 2 * owned.host_price_per_hour + 2 * network)
    assert prices["1 x 2 rtx_4090 (pcie4)"] == pytest.approx(2 * rented.price_per_hour + 0.5)


def test_the_shipped_example_plan_loads():
    request = load_plan("scenarios/plan_llama31_8b.yaml")
    assert request.models[0].name == "llama-3.1-8b" and request.config.slo.tpot_s == 0.05


def test_a_price_override_changes_the_pick():
    cheap_t4 = plan_from_dict(SMALL | {"prices": {"t4": 0.001, "rtx_3060_12gb": 10.0, "rtx_4090": 10.0, "cpu": 10.0}})
    assert cheap_t4.catalog.devices["t4"].price_per_hour == 0.001
    with pytest.raises(ConfigError):
        plan_from_dict(SMALL | {"prices": {"t4": math.inf}})


def test_a_profile_prices_the_candidates_and_names_those_outside_its_context():
    from sim.profile import load_profile

    cpu = {"name": "cpu_plan", "models": ["gpt2"], "workload": {"batch_size": 1, "prompt_tokens": 64, "output_tokens": 4},
           "slo": {"tpot": "2s"}, "search": {"devices": ["cpu"], "hosts": [1, 2], "networks": ["eth10g"],
                                             "variants": [{"name": "auto", "strategy": "allreduce_ln", "allreduce": "auto"}],
                                             "memory": [{"policy": "resident"}]}}
    profile = load_profile("validation/report/profiles/v2x2_bandwidth.csv")
    calibrated = plan(plan_from_dict(cpu), profile=profile)
    two_hosts = calibrated.table[calibrated.table["num_hosts"] == 2].iloc[0]
    assert two_hosts["profile_context"].startswith("prediction; outside: ") and "inter_host" in two_hosts["profile_context"]
    assert any("inter_host" in note for note in calibrated.notes)
    # Every layout that can run is simulated (2 replicas need 2 sequences: a batch of 1 cannot).
    runs = calibrated.table["stage"] == Stage.SIMULATED
    assert calibrated.table.loc[~runs, "parallel"].eq("TP=1 x 2 replicas").all()
    assert calibrated.table.loc[runs, Metric.TPOT].notna().all() and runs.sum() == 3


def test_when_nothing_can_meet_the_objectives_the_sentence_says_why():
    impossible = plan(plan_from_dict(SMALL | {"slo": {"ttft": "1us"}, "search": SMALL["search"] | {"hosts": [1]}}))
    assert impossible.pick is None and impossible.pick_scenario is None
    assert impossible.recommendation.startswith("No configuration within the limits can meet TTFT <= 1.00 us")
    assert "lower bounds are TTFT" in impossible.recommendation
    broke = plan(plan_from_dict(SMALL | {"limits": {"budget_per_hour": 0.001}}))
    assert broke.pick is None and broke.pick_scenario is None and set(broke.table["stage"]) <= {"layout", "limits"}


def test_a_catalog_file_replaces_the_default_and_its_errors_name_the_entry(tmp_path, capsys):
    catalog = yaml.safe_load(DEFAULT_CATALOG.read_text())
    catalog["devices"] = {"t4": catalog["devices"]["t4"] | {"price_per_hour": 0.1}}
    (tmp_path / "prices.yaml").write_text(yaml.safe_dump(catalog))
    request = plan_from_dict(SMALL | {"catalog": "prices.yaml", "search": {"hosts": [1]}}, base_dir=tmp_path)
    assert list(request.catalog.devices) == ["t4"] and request.catalog.devices["t4"].price_per_hour == 0.1
    catalog["devices"]["t4"]["interconnects"] = ["warp"]
    (tmp_path / "prices.yaml").write_text(yaml.safe_dump(catalog))
    with pytest.raises(ConfigError) as error:
        plan_from_dict(SMALL | {"catalog": "prices.yaml"}, base_dir=tmp_path)
    assert error.value.field == "prices.yaml: devices.t4.interconnects" and "'warp'" in error.value.message


TRAINING = {
    "name": "training_plan",
    "models": ["gpt2"],
    "workload": {"kind": "training", "global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 256},
    "training": {"precision": "bf16_mixed"},
    "slo": {"step_time": "400ms"},
    "search": {"devices": ["rtx_4090", "t4", "rtx_3060_12gb"], "devices_per_host": [1, 2], "hosts": [1, 2],
               "networks": ["eth10g"], "mixed": False},
}


@pytest.fixture(scope="module")
def trained():
    return plan(plan_from_dict(TRAINING))


def test_a_training_plan_picks_the_cheapest_cluster_and_layout_meeting_the_step_time(trained):
    from sim.training.simulate import simulate_training

    table = trained.table
    assert trained.pick is not None and trained.pick[Metric.STEP_TIME] <= 0.4
    assert trained.pick["price_per_hour"] == table.loc[table["meets_slo"], "price_per_hour"].min()
    # The layouts searched: data parallelism with TP inside a host, and each default variant.
    assert {"TP=1", "TP=1 x DP=2", "TP=2", "TP=2 x DP=2", "TP=1 x DP=4"} <= set(table["parallel"])
    assert {"ddp", "zero1", "zero1_checkpointing"} <= set(table["variant"])
    assert trained.recommendation.startswith(f"Use {trained.pick['cluster']}")
    t4 = table[table["device_types"] == "t4"]  # Turing has no bf16
    assert len(t4) and t4["stage"].eq(Stage.LAYOUT).all() and t4["reason"].str.contains("t4 has no bf16 rate").all()
    for _, row in trained.top.iterrows():
        assert row["bottleneck"] and "% of the step" in row["bottleneck"]
    # The pick's scenario simulates to the plan's step time.
    scenario = scenario_from_dict(trained.pick_scenario)
    assert simulate_training(scenario).variants[0].metrics[Metric.STEP_TIME] == pytest.approx(
        trained.pick[Metric.STEP_TIME])


def test_a_training_plans_pruning_never_drops_what_the_simulator_accepts():
    from sim.training.simulate import simulate_training

    tight = TRAINING | {"models": ["tinyllama-1.1b"], "slo": {"step_time": "300ms"},
                        "search": TRAINING["search"] | {"devices": ["rtx_3060_12gb", "rtx_4090"]}}
    planner = Planner(plan_from_dict(tight))
    table = planner.candidates()
    assert {Stage.MEMORY, Stage.BOUND} <= set(table["stage"])
    bound = table[table["stage"] == Stage.BOUND]
    assert (bound["num_hosts"] > 1).any()  # where gradients cross the network, its bound too
    for stage in (Stage.MEMORY, Stage.BOUND):
        rows = table[table["stage"] == stage]
        for _, row in pd.concat([rows[rows["num_hosts"] == 1].head(2), rows[rows["num_hosts"] > 1].head(2)]).iterrows():
            result = simulate_training(scenario_from_dict(planner.scenario_dict(row)))
            simulated = planner._training_result(row, result.variants[0], result, "")
            if stage == Stage.MEMORY:
                assert not simulated["fits"], row["reason"]
            else:
                assert simulated[Metric.STEP_TIME] >= row["step_time_lower_bound_s"] > 0.3


def test_a_training_plan_nothing_meets_says_why_and_the_command_exits_3(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(TRAINING | {"slo": {"step_time": "1us"}}))
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(path), "--out", str(tmp_path / "out")])
    assert exited.value.code == 3
    out = capsys.readouterr().out
    assert "No configuration within the limits can train 8 x 256 tokens per step with a step <= 1.00 us" in out
    assert (tmp_path / "out" / "plan.csv").is_file()


@pytest.mark.parametrize("change, field", [
    ({"slo": {"ttft": "1s"}}, "slo.ttft"),
    ({"slo": {"step_time": "-1s"}}, "slo.step_time"),
    ({"search": TRAINING["search"] | {"memory": [{"policy": "resident"}]}}, "search.memory"),
    ({"search": {"variants": [{"name": "tp", "strategy": "reduce_ln_bcast"}]}}, "search.variants[0].strategy"),
    ({"training": {"zero": 3}}, "training.zero"),
    ({"dtype": "bf16"}, "dtype"),
    ({"workload": TRAINING["workload"] | {"global_batch_size": 7}}, "workload.global_batch_size"),
    ({"workload": {"kind": "training", "global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 4096}},
     "workload.sequence_length"),
])
def test_a_bad_training_plan_is_one_line_naming_the_field(tmp_path, capsys, change, field):
    assert_plan_refused(TRAINING | change, field, tmp_path, capsys)


@pytest.mark.parametrize("change, field", [
    ({"slo": {"step_time": "1s"}}, "slo.step_time"),
    ({"training": {"zero": 1}}, "training"),
])
def test_training_fields_in_an_inference_plan_are_refused(tmp_path, capsys, change, field):
    assert_plan_refused(SMALL | change, field, tmp_path, capsys)


def _narrowed(path: str, **search) -> dict:
    """A shipped plan file with its search narrowed to ``search`` (the test's time), its catalog path kept."""
    data = yaml.safe_load((ROOT / path).read_text())
    if "catalog" in data:
        data["catalog"] = str((ROOT / "scenarios" / data["catalog"]).resolve())
    data["search"] = data.get("search", {}) | search
    return data


def test_the_70b_home_gpus_example_plans_over_mixed_device_types():
    # Owned RTX 3090 / 4090, four per workstation, beside rented A100s: 70B needs two workstations.
    request = plan_from_dict(_narrowed("scenarios/plan_llama2_70b_home_gpus.yaml", devices_per_host=[4], hosts=[2],
                                       networks=["eth100g"]))
    assert set(request.catalog.devices) == {"rtx_3090", "rtx_4090", "a100_80gb"}
    result = plan(request)
    table = result.table
    assert (table["device_types"] == "rtx_3090+rtx_4090").any()  # a mixed cluster was searched
    assert result.pick is not None and result.pick["meets_slo"] and result.pick["num_devices"] == 8
    assert result.pick["price_per_hour"] <= 5 and result.pick[Metric.TTFT] <= 5
    assert result.pick["price_per_hour"] == table.loc[table["meets_slo"], "price_per_hour"].min()


def test_the_training_example_plans_and_its_pick_simulates():
    from sim.training.simulate import simulate_training

    result = plan(plan_from_dict(_narrowed("scenarios/plan_training_tinyllama_1b.yaml", devices=["rtx_4090"],
                                           hosts=[1], devices_per_host=[2, 4])))
    assert result.pick is not None and result.pick[Metric.STEP_TIME] <= 2.0
    assert result.pick["cluster"].endswith("rtx_4090 (pcie4)") and result.pick["parallel"].startswith("TP=")
    simulated = simulate_training(scenario_from_dict(result.pick_scenario)).variants[0].metrics[Metric.STEP_TIME]
    assert simulated == pytest.approx(result.pick[Metric.STEP_TIME])


def test_a_single_device_pick_says_so_and_cheap_prices_keep_their_cents():
    cheap = plan(plan_from_dict(SMALL | {"slo": {"tpot": "200ms"}, "limits": {"budget_per_hour": 0.05, "max_devices": 2},
                                         "search": SMALL["search"] | {"devices": ["rtx_3060_12gb", "t4"]},
                                         "prices": {"t4": 0.043}, "host_prices": {"rtx_3060_12gb": 0.0}}))
    assert cheap.pick is not None and cheap.pick["num_devices"] == 1
    assert "on one device (no collectives)" in cheap.recommendation and "$0.041/h" in cheap.recommendation
    loser = cheap.top[cheap.top["device_types"] == "t4"].iloc[0]
    assert loser["versus_pick"].startswith("costs $0.002/h more")


def test_a_plan_nothing_meets_exits_3_and_says_which_limit_excluded_every_cluster(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(SMALL | {"limits": {"budget_per_hour": 0.001}}))
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(path), "--out", str(tmp_path / "out")])
    assert exited.value.code == 3
    out = capsys.readouterr().out
    assert "every cluster that can run the model is over the limits" in out and "top 0" not in out
    assert (tmp_path / "out" / "plan.csv").is_file() and not (tmp_path / "out" / "pick.yaml").exists()


SLOW_LINKS = {"name": "slow_links", "models": ["llama-2-7b"], "dtype": "fp16",
              "workload": {"batch_size": 1, "prompt_tokens": 128, "output_tokens": 8},
              "search": {"devices": ["rtx_4090"], "devices_per_host": [2], "hosts": [2], "networks": ["wan1g"],
                         "mixed": False, "memory": [{"policy": "resident"}]}}


@pytest.fixture(scope="module")
def wan_catalog(tmp_path_factory):
    """The default catalog with a 1 Gbit/s, 500 us network between hosts (a slow WAN-like link)."""
    from sim.planning.catalog import DEFAULT_CATALOG
    data = yaml.safe_load(DEFAULT_CATALOG.read_text())
    data["networks"]["wan1g"] = {"bandwidth": "1Gbit/s", "latency": "500us", "nic_per_device": False,
                                 "price_per_hour_per_host": 0.0, "source": "a test's slow link"}
    path = tmp_path_factory.mktemp("catalog") / "catalog.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_over_slow_links_a_pipeline_across_hosts_beats_tensor_parallelism_over_all_devices(wan_catalog):
    # Two hosts of two RTX 4090 over 1 Gbit/s: TP 4 puts every layer's allreduces on the slow
    # link; TP 2 inside each host with a pipeline across them crosses it once per stage per step.
    result = plan(plan_from_dict(SLOW_LINKS | {"catalog": wan_catalog, "slo": {"tpot": "50ms"}}))
    table = result.table
    simulated = table[table["stage"] == Stage.SIMULATED]
    assert {"TP=4", "TP=2 x PP=2", "PP=4"} <= set(simulated["parallel"])
    assert table.loc[table["parallel"] == "TP=2 x 2 replicas", "stage"].eq(Stage.LAYOUT).all()  # batch of 1
    assert simulated["price_per_hour"].nunique() == 1  # one cluster: the layouts cost the same
    pick = result.pick
    assert pick["parallel"] == "TP=2 x PP=2" and "TP=2 x PP=2" in result.recommendation
    assert pick[Metric.TPOT] < simulated.loc[simulated["parallel"] == "TP=4", Metric.TPOT].min()
    assert not simulated.loc[simulated["parallel"] == "TP=4", "meets_slo"].any()
    # The closed forms that pruned the others bound every layout's simulated latency.
    assert (simulated["ttft_lower_bound_s"] <= simulated[Metric.TTFT]).all()
    assert (simulated["tpot_lower_bound_s"] <= simulated[Metric.TPOT]).all()
    # The pick's scenario runs that layout, and simulating it gives the plan's prediction.
    assert result.pick_scenario["parallel"] == {"tensor": 2, "pipeline": 2}
    timing = simulate(scenario_from_dict(result.pick_scenario), expand_steps=()).variants[0].timing
    assert timing[Metric.TPOT] == pytest.approx(pick[Metric.TPOT], rel=1e-9)
    assert timing[Metric.TTFT] == pytest.approx(pick[Metric.TTFT], rel=1e-9)


def test_a_throughput_objective_picks_one_replica_per_host(wan_catalog):
    request = SLOW_LINKS | {"catalog": wan_catalog, "slo": {"tokens_per_s": 650},
                            "workload": {"batch_size": 8, "prompt_tokens": 128, "output_tokens": 8}}
    result = plan(plan_from_dict(request))
    simulated = result.table[result.table["stage"] == Stage.SIMULATED]
    best = simulated.groupby("parallel")[Metric.DECODE_TOKENS_PER_S].max()
    assert best.idxmax() == "TP=2 x 2 replicas" and best["TP=2 x 2 replicas"] > best["TP=2 x PP=2"]
    assert result.pick["parallel"] == "TP=2 x 2 replicas" and result.pick_scenario["parallel"] == {"tensor": 2, "replicas": 2}
    timing = simulate(scenario_from_dict(result.pick_scenario), expand_steps=()).variants[0].timing
    assert timing[Metric.DECODE_TOKENS_PER_S] == pytest.approx(result.pick[Metric.DECODE_TOKENS_PER_S], rel=1e-9)
    # hetsim measure runs every replica, so the pick is run as written: here and on 2 hosts x 2 ranks
    commands = result.commands(Path("pick.yaml"))
    assert "hetsim measure pick.yaml" in commands
    assert commands[-1].startswith("torchrun --nnodes 2 --nproc-per-node 2 ")


def test_a_layout_the_model_cannot_take_is_never_proposed():
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology
    # Qwen2.5-7B has 28 heads: TP 6 over 3 hosts x 2 cannot split them evenly; the rest can run.
    request = {"name": "heads", "models": ["qwen2.5-7b"], "dtype": "bf16", "slo": {"tpot": "1s"},
               "workload": {"batch_size": 4, "prompt_tokens": 128, "output_tokens": 4},
               "search": {"devices": ["rtx_4090"], "devices_per_host": [2], "hosts": [3], "networks": ["eth10g"],
                          "mixed": False, "memory": [{"policy": "resident"}]}}
    planner = Planner(plan_from_dict(request))
    table = planner.candidates()
    even = table[table["parallel"] == "TP=6"]
    assert (even["stage"] == Stage.LAYOUT).all() and even["reason"].str.contains("28 attention heads").all()
    proposed = table[table["stage"] != Stage.LAYOUT]
    assert set(proposed["parallel"]) == {"TP=2 x PP=3", "PP=6", "TP=2 x 3 replicas"}
    for _, row in proposed.drop_duplicates("parallel").iterrows():  # the simulator takes each as written
        scenario = scenario_from_dict(planner.scenario_dict(row))
        assert ParallelPlan.of(scenario, build_topology(scenario.config.cluster)).label == row["parallel"]


def test_a_model_too_large_for_a_host_runs_as_replicas_of_a_pipeline_of_hosts():
    # Llama-2-13B in fp16 (26 GB) does not fit a host of two 12 GB RTX 3060: one replica per host
    # is refused; two pipelines of two hosts each beat TP 8 (every layer's allreduces on the
    # network) and one pipeline of four hosts (twice the stages per token) on TTFT.
    request = {"name": "pp_replicas", "models": ["llama-2-13b"], "dtype": "fp16", "slo": {"ttft": "380ms"},
               "workload": {"batch_size": 8, "prompt_tokens": 128, "output_tokens": 8},
               "search": {"devices": ["rtx_3060_12gb"], "devices_per_host": [2], "hosts": [4], "networks": ["eth10g"],
                          "mixed": False, "memory": [{"policy": "resident"}],
                          "variants": [{"name": "auto", "strategy": "allreduce_ln", "allreduce": "auto"}]}}
    result = plan(plan_from_dict(request))
    table = result.table.set_index("parallel")
    assert set(table.index) == {"TP=8", "TP=2 x PP=4", "PP=8", "TP=2 x 4 replicas", "TP=2 x PP=2 x 2 replicas"}
    assert table.loc["TP=2 x 4 replicas", "stage"] == Stage.MEMORY
    pick = result.pick
    assert pick["parallel"] == "TP=2 x PP=2 x 2 replicas" and "memory bandwidth" in pick["bottleneck"]
    assert result.pick_scenario["parallel"] == {"tensor": 2, "pipeline": 2, "replicas": 2}
    assert pick["ttft_lower_bound_s"] <= pick[Metric.TTFT] and pick["tpot_lower_bound_s"] <= pick[Metric.TPOT]
    timing = simulate(scenario_from_dict(result.pick_scenario), expand_steps=()).variants[0].timing
    for metric in (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S):
        assert timing[metric] == pytest.approx(pick[metric], rel=1e-9)
    assert result.commands(Path("pick.yaml"))[-1].startswith("torchrun --nnodes 4 --nproc-per-node 2 ")
