"""hetsim plan with a serving workload: the maximum request rate of each configuration, the pick
that sustains the target rate cheapest, the pruning that only drops what the serving simulator
refuses or what misses, and the one-line errors of bad serving plans."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from models.errors import ConfigError
from sim.planning.outcome import plan
from sim.planning.plan_config import load_plan, plan_from_dict
from sim.planning.pick_commands import vllm_lines
from sim.planning.search import COST_PER_MILLION_TOKENS, DECODE_BATCH, Planner, Stage
from sim.scenario import load_scenario, scenario_from_dict
from sim.serving.simulate import cost_per_million_tokens, meets_slo, percentile_floor_key, simulate_serving
from sim.simulate import simulate
from sim.vocabulary import Metric
from tests.test_planner import SMALL, assert_plan_refused
from validation.cli import main

# Llama-2-7B in fp16 (13.5 GB of weights): too large for one RTX 3060 12GB, too slow per token on
# a T4 for TPOT 50 ms (its roofline bound), served by one or two RTX 4090 or two RTX 3060.
SERVING = {
    "name": "serve_small",
    "models": ["llama-2-7b"],
    "dtype": "fp16",
    "workload": {"kind": "serving", "rate_per_s": 3.0, "requests": 30, "prompt_tokens": 512, "output_tokens": 64},
    "slo": {"ttft": "1s", "tpot": "50ms", "percentile": 90},
    "search": {"devices": ["rtx_3060_12gb", "t4", "rtx_4090"], "devices_per_host": [1, 2], "hosts": [1],
               "mixed": False, "variants": [{"name": "auto", "strategy": "allreduce_ln", "allreduce": "auto"}],
               "rate_horizon": "5s"},
}


@pytest.fixture(scope="module")
def served():
    return plan(plan_from_dict(SERVING))


def _at_rate(scenario: dict, rate: float, horizon_s: float) -> dict:
    """The pick's scenario served at ``rate`` with as many requests as the plan's search used there."""
    workload = scenario["workload"] | {"rate_per_s": rate, "requests": max(30, math.ceil(rate * horizon_s)),
                                       "slo": None}
    return scenario | {"workload": workload}


def test_the_picks_maximum_rate_meets_the_slo_when_simulated_and_one_and_a_half_times_it_does_not(served):
    pick = served.pick
    assert pick is not None and pick["meets_slo"] and pick[Metric.MAX_REQUEST_RATE] >= 3.0
    slo = served.request.config.slo.serving()
    rate = pick[Metric.MAX_REQUEST_RATE]
    verdicts = []
    for factor in (1.0, 1.5):
        scenario = scenario_from_dict(_at_rate(served.pick_scenario, factor * rate, 5.0))
        verdicts.append(meets_slo(simulate_serving(scenario).variants[0].metrics, slo))
    assert verdicts == [True, False]
    assert pick[COST_PER_MILLION_TOKENS] == pytest.approx(
        cost_per_million_tokens(pick["price_per_hour"], pick[Metric.OUTPUT_TOKENS_PER_S]))


def test_the_pick_is_the_cheapest_that_sustains_the_target_and_a_cheaper_miss_is_not_picked(served):
    table = served.table
    simulated = table[table["stage"] == Stage.SIMULATED]
    assert (simulated["meets_slo"] == (simulated[Metric.MAX_REQUEST_RATE] >= 3.0)).all()
    assert served.pick["price_per_hour"] == simulated.loc[simulated["meets_slo"], "price_per_hour"].min()
    cheaper = simulated[simulated["price_per_hour"] < served.pick["price_per_hour"]]
    assert not cheaper.empty and not cheaper["meets_slo"].any()
    assert cheaper["slo_miss"].str.startswith("max rate").all()
    assert served.recommendation.startswith(f"Use {served.pick['cluster']}")
    # The frontier of price against maximum rate: no point is both no dearer and faster.
    for _, row in simulated.iterrows():
        dominated = ((simulated["price_per_hour"] <= row["price_per_hour"])
                     & (simulated[Metric.MAX_REQUEST_RATE] > row[Metric.MAX_REQUEST_RATE])).any()
        assert row["pareto_rate"] == (not dominated)


def test_pruning_drops_only_what_the_serving_simulator_refuses_or_what_misses(served):
    planner = Planner(served.request)
    table = served.table
    memory = table[table["stage"] == Stage.MEMORY].iloc[0]
    bound = table[table["stage"] == Stage.BOUND].iloc[0]
    assert "rtx_3060_12gb" in memory["cluster"] and "t4" in bound["cluster"]
    rows = planner.candidates()  # indexed by candidate number
    with pytest.raises(ConfigError):
        simulate_serving(scenario_from_dict(_at_rate(planner.scenario_dict(rows.loc[memory["candidate"]]), 0.1, 0)))
    unloaded = scenario_from_dict(_at_rate(planner.scenario_dict(rows.loc[bound["candidate"]]), 0.01, 0))
    tpot = simulate_serving(unloaded).variants[0].metrics[Metric.TPOT]
    assert tpot >= bound["tpot_lower_bound_s"] > served.request.config.slo.tpot_s


def test_a_candidate_pruned_by_its_ttft_bound_misses_the_ttft_objective_when_served_anyway(tmp_path):
    # Three requests in ten have 1500-token prompts: the p90 TTFT is one of theirs at every request
    # count the rate search serves, so the bound prices a 1500-token prefill, though most prompts are
    # 300 tokens. Pruned: a T4 (just above the objective), two RTX 3060 as TP=2 and as PP=2.
    prompts = [300, 1500, 300, 300, 1500, 300, 300, 300, 1500, 300]
    (tmp_path / "requests.csv").write_text("prompt_tokens,output_tokens\n" + "".join(f"{p},16\n" for p in prompts))
    config = SERVING | {"workload": {"kind": "serving", "rate_per_s": 0.5, "trace": "requests.csv"},
                        "slo": {"ttft": "500ms", "percentile": 90},
                        "search": SERVING["search"] | {"devices": ["t4", "rtx_3060_12gb", "rtx_4090"]}}
    planner = Planner(plan_from_dict(config, base_dir=tmp_path))
    rows = planner.candidates()
    pruned = rows[rows["stage"] == Stage.BOUND]
    assert set(pruned["cluster"] + " " + pruned["parallel"]) == {
        "1 x 1 t4 TP=1", "1 x 2 rtx_3060_12gb (pcie4) TP=2", "1 x 2 rtx_3060_12gb (pcie4) PP=2"}
    assert pruned["reason"].str.fullmatch(r"TTFT p90 at least \d\.\d+ s > 0\.5 s").all()
    kept = rows[rows["stage"] == Stage.SIMULATED]
    assert (kept["ttft_lower_bound_s"] <= 0.5).all() and "rtx_4090" in set(kept["device_types"])
    for _, row in pruned.iterrows():
        unloaded = scenario_from_dict(_at_rate(planner.scenario_dict(row), 0.01, 0), base_dir=tmp_path)
        ttft = simulate_serving(unloaded).variants[0].metrics[Metric.TTFT.percentile(90)]
        assert ttft >= row["ttft_lower_bound_s"] > 0.5, row["cluster"]


@pytest.mark.parametrize("percentile", [10, 50, 90, 99, 100])
def test_the_ttft_bounds_prompt_bounds_the_percentile_at_every_request_count(percentile):
    # the rate search serves the lengths repeated in order to any count from len(prompts) up: the
    # percentile of any quantity growing with the prompt is at least its value at the prompt found
    prompts = [512, 2000, 2000, 128, 512, 2000, 128, 128, 512, 2000, 512, 128]
    key = percentile_floor_key(prompts, percentile)
    counts = range(len(prompts), 6 * len(prompts))
    assert min(np.percentile([prompts[i % len(prompts)] for i in range(n)], percentile) for n in counts) >= key
    # and it is not the trivial answer where the percentile sits among the longer prompts
    assert key == {10: 128, 50: 512, 90: 2000, 99: 2000, 100: 2000}[percentile]


def test_every_top_configuration_names_its_bottleneck_and_the_pick_runs_on_vllm_and_at_its_batch(served):
    top = served.top
    # single groups: the term that takes most of a decode iteration at the maximum rate
    assert top["bottleneck"].str.contains(r"% of a decode iteration of \d+ requests\)").all(), list(top["bottleneck"])
    pick = served.pick
    commands = served.commands(Path("pick.yaml"), Path("pick_batch.yaml"))
    assert commands[0] == "hetsim simulate pick.yaml" and any("does not serve request loads" in c for c in commands)
    serve = next(c for c in commands if c.startswith("vllm serve "))
    assert serve.startswith(f"vllm serve meta-llama/Llama-2-7b-hf --tensor-parallel-size {int(pick['num_devices'])} "
                            "--pipeline-parallel-size 1 --max-num-batched-tokens 2048 --max-num-seqs 256 ")
    assert "--dtype float16" in serve and "hetsim measure pick_batch.yaml" in commands
    # the batch the pick decodes at its maximum rate, as a batch scenario of its layout
    batch = scenario_from_dict(served.pick_batch_scenario)
    assert batch.config.workload.batch_size == round(pick[DECODE_BATCH]) >= 2
    assert batch.config.parallel.tensor == int(pick["num_devices"])
    assert simulate(batch, expand_steps=()).variants[0].overflow is None


def test_vllm_runs_replicas_as_separate_servers_and_a_server_over_hosts_on_ray():
    request = plan_from_dict(SERVING | {"search": SERVING["search"] | {"devices": ["rtx_4090"], "devices_per_host": [2],
                                                                      "hosts": [2], "networks": ["eth10g"]}})
    planner = Planner(request)
    table = planner.candidates().set_index("parallel", drop=False)
    lines = {layout: vllm_lines(request, table.loc[layout], planner.scenario_dict(table.loc[layout]))
             for layout in ("TP=2 x 2 replicas", "TP=2 x PP=2")}
    replicas, pipeline = lines["TP=2 x 2 replicas"], lines["TP=2 x PP=2"]
    assert replicas[0].startswith("vllm serve meta-llama/Llama-2-7b-hf --tensor-parallel-size 2 "
                                  "--pipeline-parallel-size 1 ")
    assert "round-robin" in replicas[-1] and not any(line.startswith("ray ") for line in replicas)
    assert [line.split("  #")[0] for line in pipeline if line.startswith("ray ")] == [
        "ray start --head --port 6379", "ray start --address HOST0:6379"]
    assert pipeline[-1].startswith("vllm serve meta-llama/Llama-2-7b-hf --tensor-parallel-size 2 "
                                   "--pipeline-parallel-size 2 ") and "--distributed-executor-backend ray" in pipeline[-1]


def test_a_target_above_every_maximum_rate_has_no_pick():
    result = plan(plan_from_dict(SERVING | {"workload": SERVING["workload"] | {"rate_per_s": 40.0}}))
    simulated = result.table[result.table["stage"] == Stage.SIMULATED]
    assert result.pick is None and not simulated["meets_slo"].any()
    assert (simulated[Metric.MAX_REQUEST_RATE] < 40.0).all()
    assert result.recommendation.startswith("No configuration within the limits sustains 40 requests/s")


def test_plan_command_writes_rates_and_cost_per_million_tokens(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(SERVING))
    main(["plan", str(path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "max req/s" in out and "$/Mtok" in out and "TTFT p90 ms at" in out
    csv = pd.read_csv(tmp_path / "out" / "plan.csv")
    assert {Metric.MAX_REQUEST_RATE, COST_PER_MILLION_TOKENS, "pareto_rate"} <= set(csv.columns)
    assert len(pd.read_parquet(tmp_path / "out" / "plan.parquet")) == len(csv)
    pick = load_scenario(tmp_path / "out" / "pick.yaml")
    assert pick.config.workload.kind == "serving" and pick.config.workload.slo.tpot_s == 0.05
    assert load_scenario(tmp_path / "out" / "pick_batch.yaml").config.workload.kind == "inference"
    assert "vllm serve" in out and "hetsim measure" in out and "pick_batch.yaml" in out
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Price against maximum request rate" in html and "Pareto frontier" in html


def test_the_shipped_serving_plan_loads():
    request = load_plan("scenarios/plan_serving_llama31_8b.yaml")
    assert request.config.is_serving and request.config.slo.serving().percentile == 90
    assert [m.policy for m in request.config.search.memory] == ["resident"]


@pytest.mark.parametrize("change, field", [
    ({"workload": SERVING["workload"] | {"rate_per_s": -1.0}}, "workload.rate_per_s"),
    ({"slo": {"ttft": "1s", "percentile": 0}}, "slo.percentile"),
    ({"slo": {"ttft": "1s", "percentile": 101}}, "slo.percentile"),
    ({"slo": {"tpot": "50ms"}}, "slo.ttft"),
    ({"slo": {"ttft": "1s", "tokens_per_s": 100}}, "slo.tokens_per_s"),
    ({"workload": SERVING["workload"] | {"slo": {"ttft": "1s"}}}, "workload.slo"),
    ({"workload": SERVING["workload"] | {"kind": "pretraining"}}, "workload.kind"),
    ({"workload": SERVING["workload"] | {"kind": "training"}}, "workload.global_batch_size"),
    ({"search": SERVING["search"] | {"memory": [{"policy": "sliding_window"}]}}, "search.memory[0]"),
    ({"search": SERVING["search"] | {"rate_tolerance": 0}}, "search.rate_tolerance"),
    ({"search": SERVING["search"] | {"rate_horizon": "soon"}}, "search.rate_horizon"),
])
def test_a_bad_serving_plan_is_one_line_naming_the_field_exit_2(tmp_path, capsys, change, field):
    assert_plan_refused(SERVING | change, field, tmp_path, capsys)


def test_a_percentile_is_refused_in_a_batch_plan():
    with pytest.raises(ConfigError) as error:
        plan_from_dict(SMALL | {"slo": {"ttft": "30ms", "percentile": 90}})
    assert error.value.field == "slo.percentile"


def test_a_trace_gives_the_request_lengths_and_a_row_beyond_the_context_is_refused(tmp_path):
    (tmp_path / "requests.csv").write_text("prompt_tokens,output_tokens\n256,32\n1024,64\n512,16\n")
    workload = {"kind": "serving", "rate_per_s": 1.0, "requests": 10, "trace": "requests.csv"}
    request = plan_from_dict(SERVING | {"workload": workload}, base_dir=tmp_path)
    assert [r.prompt_tokens for r in request.requests] == [256, 1024, 512]
    result = plan(request)
    assert result.pick is not None and result.pick_scenario["workload"]["trace"] == str(tmp_path / "requests.csv")
    (tmp_path / "requests.csv").write_text("prompt_tokens,output_tokens\n256,32\n4000,200\n")
    with pytest.raises(ConfigError) as error:
        plan_from_dict(SERVING | {"workload": workload}, base_dir=tmp_path)
    assert error.value.field == "workload.trace" and "line 3" in error.value.message


def test_a_serving_plan_searches_replicas_and_pipelines():
    search = SERVING["search"] | {"devices": ["rtx_4090"], "devices_per_host": [1], "hosts": [1, 2],
                                  "networks": ["eth10g"], "rate_horizon": "20s"}
    result = plan(plan_from_dict(SERVING | {"search": search}))
    table = result.table.set_index("parallel")
    assert set(table.index) == {"TP=1", "TP=2", "PP=2", "TP=1 x 2 replicas"}
    assert (table["stage"] == Stage.SIMULATED).all()
    rate = table[Metric.MAX_REQUEST_RATE]
    one, two = rate["TP=1"], rate["TP=1 x 2 replicas"]
    # each replica serves half the rate: together about twice one device's, a little more as round
    # robin hands each replica every other arrival (gaps less variable than a Poisson stream's, so
    # shorter queues), to the search's tolerance; and more than both devices in one group over the network
    assert 1.7 * one < two < 2.5 * one
    assert two > rate["TP=2"]
    # two devices as a pipeline keep an iteration in flight on each: more than one device, less
    # than two replicas (every token also crosses the network twice); and more than tensor
    # parallelism, which crosses it every layer
    assert one < rate["PP=2"] < two and rate["PP=2"] > rate["TP=2"]
    assert result.pick["parallel"] in ("TP=1", "TP=1 x 2 replicas")


def test_the_shipped_serving_plan_lists_pipelines_among_its_candidates():
    table = Planner(load_plan("scenarios/plan_serving_llama31_8b.yaml")).candidates()
    pipelines = table[table["parallel"].str.contains("PP=")]
    assert not pipelines.empty and (pipelines["stage"] != Stage.LAYOUT).all()
    assert (pipelines["stage"] == Stage.SIMULATED).any()


def test_a_serving_plan_serves_replicas_of_a_pipeline_each_a_vllm_server_on_its_own_hosts():
    # Llama-2-13B in fp16 (26 GB) does not fit one RTX 4090: two pipelines of two hosts each serve
    # more than one of four hosts (twice the stages per token) or TP 4 (allreduces on the network).
    search = SERVING["search"] | {"devices": ["rtx_4090"], "devices_per_host": [1], "hosts": [4],
                                  "networks": ["eth10g"]}
    result = plan(plan_from_dict(SERVING | {"models": ["llama-2-13b"], "search": search}))
    table = result.table.set_index("parallel")
    assert table.loc["TP=1 x 4 replicas", "stage"] == Stage.MEMORY
    pick = result.pick
    assert pick["parallel"] == "PP=2 x 2 replicas" and pick[Metric.MAX_REQUEST_RATE] >= 3.0
    assert pick[Metric.MAX_REQUEST_RATE] > table.loc[["PP=4", "TP=4"], Metric.MAX_REQUEST_RATE].max()
    assert pick["ttft_lower_bound_s"] <= pick[Metric.TTFT]
    # the busiest replica's busiest stage or link names the bottleneck, as for one pipeline
    assert pd.Series([pick["bottleneck"]]).str.fullmatch(r"(stage \d|link from stage \d to \d)( of 2)?, busy \d+%").all()
    assert result.pick_scenario["parallel"] == {"tensor": 1, "pipeline": 2, "replicas": 2}
    lines = result.commands(Path("pick.yaml"), Path("pick_batch.yaml"))
    serve = next(line for line in lines if line.startswith("vllm serve "))
    assert serve.startswith("vllm serve meta-llama/Llama-2-13b-hf --tensor-parallel-size 1 --pipeline-parallel-size 2 ")
    assert "--distributed-executor-backend ray" in serve
    assert ("# one such server per replica, each on its own 2 hosts with its own Ray cluster (HOST0: its first "
            "host), 2 in all, behind a round-robin balancer") in lines
    assert lines[-1].startswith("torchrun --nnodes 4 --nproc-per-node 1 ")
