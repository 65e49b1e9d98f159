"""Serving load (sim/serving): requests arriving over time, continuous batching under a token
budget, latency percentiles over requests and the highest rate meeting an SLO."""

import re
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from models.errors import ConfigError
from sim.scenario import scenario_from_dict
from sim.serving.requests import Request, poisson_arrivals, workload_requests
from sim.serving.scheduler import LateLimit, serve, serve_together
from sim.serving.simulate import (cost_per_million_tokens, late_requests_to_miss, meets_slo, pipeline_bottleneck,
                                  simulate_serving)
from sim.simulate import simulate
from sim.vocabulary import Metric, unit_of
from tests.conftest import ROOT

DATA = Path(__file__).parent / "data"


def _document() -> dict:
    return yaml.safe_load((DATA / "serving_small.yaml").read_text())


def _scenario(**workload):
    document = _document()
    document["workload"].update(workload)
    return scenario_from_dict(document, base_dir=DATA)


def test_the_served_results_say_how_each_variant_was_priced(tmp_path):
    import pandas as pd

    from validation.present.serving import write_serving

    write_serving(simulate_serving(_scenario(requests=1, slo=None)), tmp_path)
    results = pd.read_csv(tmp_path / "results.csv")
    assert len(results) and (results["calibration"] == "uncalibrated").all()
    assert "<h2>What came from where</h2><p>calibration: uncalibrated (" in (tmp_path / "report.html").read_text()


def test_an_unloaded_request_takes_the_inference_simulators_ttft_and_tpot():
    serving = simulate_serving(_scenario(requests=1, slo=None))
    document = _document()
    document["workload"] = {"batch_size": 1, "prompt_tokens": 256, "output_tokens": 32}
    inference = simulate(scenario_from_dict(document))
    for served, batch in zip(serving.variants, inference.variants):
        assert served.metrics[Metric.TTFT] == pytest.approx(batch.timing[Metric.TTFT], rel=1e-9)
        assert served.metrics[Metric.TPOT] == pytest.approx(batch.timing[Metric.TPOT], rel=1e-6)


def test_latency_grows_with_load_and_throughput_follows_the_offered_rate():
    runs = [simulate_serving(_scenario(rate_per_s=rate, slo=None)).variants[1] for rate in (0.5, 2.0, 8.0)]
    p90 = [r.metrics[Metric.TTFT.percentile(90)] for r in runs]
    assert p90[0] <= p90[1] < p90[2]
    assert [r.run.max_running for r in runs] == sorted(r.run.max_running for r in runs)
    # Under light load the server delivers what arrives; overloaded, it saturates below the offer.
    light = runs[0].metrics[Metric.REQUESTS_PER_S]
    assert light == pytest.approx(0.5, rel=0.3)
    assert runs[2].metrics[Metric.REQUESTS_PER_S] < 8.0


def test_a_smaller_token_budget_chunks_the_prefill_and_delays_the_first_token():
    whole = simulate_serving(_scenario(requests=1, slo=None)).variants[0].metrics[Metric.TTFT]
    chunked = simulate_serving(_scenario(requests=1, slo=None, max_batch_tokens=64)).variants[0]
    assert chunked.run.iterations == 4 + 31  # 256 prompt tokens in chunks of 64, then 31 decode steps
    assert chunked.metrics[Metric.TTFT] > whole


def test_the_kv_cache_bounds_the_requests_running_at_once():
    roomy = simulate_serving(_scenario(rate_per_s=50.0, slo=None)).variants[0]
    # gpt2's weights and gloo's baseline on 4 GiB leave a small cache at utilisation 0.15: four requests.
    tight = simulate_serving(_scenario(rate_per_s=50.0, slo=None, memory_utilization=0.15)).variants[0]
    assert tight.run.max_running * (256 + 32) <= tight.run.kv_capacity_tokens < roomy.run.kv_capacity_tokens
    assert tight.run.max_running < roomy.run.max_running
    with pytest.raises(ConfigError, match="^workload.memory_utilization: "):
        simulate_serving(_scenario(memory_utilization=0.01))


def test_the_maximum_rate_meets_the_slo_and_twice_it_does_not():
    result = simulate_serving(_scenario())
    slo = result.scenario.config.workload.slo
    for vr in result.variants:
        rate = vr.metrics[Metric.MAX_REQUEST_RATE]
        assert rate > 0 and meets_slo(vr.search.metrics, slo)
        faster = simulate_serving(_scenario(rate_per_s=2 * rate)).variant_result(vr.variant.name)
        assert not meets_slo(faster.metrics, slo)
    rates = {vr.variant.name: vr.metrics[Metric.MAX_REQUEST_RATE] for vr in result.variants}
    assert rates["allreduce_ring"] > rates["reduce_ln_bcast"]  # the faster step serves more


def test_same_seed_same_requests_and_results():
    assert (poisson_arrivals(3.0, 50, 7) == poisson_arrivals(3.0, 50, 7)).all()
    assert not (poisson_arrivals(3.0, 50, 7) == poisson_arrivals(3.0, 50, 8)).all()
    first, second = (simulate_serving(_scenario(slo=None)).results for _ in range(2))
    assert first.equals(second)


def test_a_trace_gives_lengths_and_arrivals(tmp_path):
    trace = tmp_path / "requests.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,10\n0.5,200,5\n0.5,50,1\n")
    scenario = scenario_from_dict({**_document(), "workload": {"kind": "serving", "rate_per_s": 1, "trace": str(trace)}})
    requests = workload_requests(scenario.config.workload, scenario.model)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [(0.0, 100, 10), (0.5, 200, 5),
                                                                                 (0.5, 50, 1)]
    served = simulate_serving(scenario).variants[0].run.served
    assert math.isnan(served[2].tpot_s) and served[2].finish_s == served[2].first_token_s


@pytest.mark.parametrize("text, expected", [
    ("prompt_tokens\n10\n", "missing output_tokens"),
    ("prompt_tokens,output_tokens\n10,0\n", "line 2: output_tokens must be a positive integer"),
    ("prompt_tokens,output_tokens\n1000,100\n", "line 2: prompt_tokens + output_tokens = 1100 exceeds"),
    ("arrival_s,prompt_tokens,output_tokens\n1,10,1\n0.5,10,1\n", "line 3: arrival_s must be finite"),
    ("prompt_tokens,output_tokens\n", "no requests"),
])
def test_bad_traces_are_named_by_line(tmp_path, text, expected):
    trace = tmp_path / "requests.csv"
    trace.write_text(text)
    scenario = scenario_from_dict({**_document(), "workload": {"kind": "serving", "rate_per_s": 1, "trace": str(trace)}})
    with pytest.raises(ConfigError, match=f"^workload.trace: .*{re.escape(expected)}"):
        simulate_serving(scenario)


@pytest.mark.parametrize("workload, expected", [
    ({"rate_per_s": 0}, "workload.rate_per_s: "),
    ({"requests": 0}, "workload.requests: "),
    ({"max_batch_tokens": 0}, "workload.max_batch_tokens: "),
    ({"trace": "x.csv"}, "workload.trace: request lengths come from the trace or"),
    ({"slo": {"percentile": 90}}, "workload.slo.ttft: an SLO names ttft, tpot or both"),
    ({"slo": {"ttft": "fast"}}, "workload.slo.ttft: "),
    ({"slo": {"tpot": "100ms"}}, None),
    ({"prompt_tokens": 1000, "output_tokens": 100}, "workload.prompt_tokens: prompt_tokens + output_tokens = 1100"),
])
def test_bad_serving_fields_are_named(workload, expected):
    document = _document()
    document["workload"].update(workload)
    if expected is None:  # a TPOT-only SLO is attained or not, but cannot bound the rate (no queue in TPOT)
        metrics = simulate_serving(scenario_from_dict(document)).variants[0].metrics
        assert Metric.SLO_ATTAINED in metrics and Metric.MAX_REQUEST_RATE not in metrics
        return
    with pytest.raises(ConfigError) as caught:
        scenario_from_dict(document)
    assert str(caught.value).startswith(expected)


def test_serving_refuses_weight_streaming_and_the_batch_commands():
    document = _document()
    document["memory"] = {"policy": "sliding_window", "window": 1}
    with pytest.raises(ConfigError, match="^memory: weight streaming is not simulated under a serving"):
        scenario_from_dict(document)
    with pytest.raises(ConfigError, match="^workload.kind: simulate takes inference workloads"):
        simulate(scenario_from_dict(_document()))


def test_units_and_cost_per_million_tokens():
    assert unit_of(Metric.MAX_REQUEST_RATE) == "requests/s" and unit_of(Metric.REQUESTS_PER_S) == "requests/s"
    assert unit_of(Metric.OUTPUT_TOKENS_PER_S) == "tokens/s" and unit_of(Metric.SLO_ATTAINED) == "fraction"
    assert unit_of(Metric.TTFT.percentile(99)) == "s"
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # $3.6/h at 1000 tok/s: $1 per 1e6


def _layout(parallel: dict, hosts: int = 2, **workload):
    document = _document()
    document["cluster"]["hosts"][0]["count"] = hosts
    document["workload"].update(workload)
    document["parallel"] = parallel
    document["variants"] = document["variants"][1:]  # allreduce_ring
    return scenario_from_dict(document)


def test_replicas_each_serve_their_share_of_the_rate_in_their_own_memory():
    one = simulate_serving(_layout({"tensor": 1}, requests=1, slo=None)).variants[0]
    two = simulate_serving(_layout({"tensor": 1, "replicas": 2}, requests=1, slo=None)).variants[0]
    # one request alone: the same on either replica; the replicas' caches add up
    assert two.metrics[Metric.TTFT] == pytest.approx(one.metrics[Metric.TTFT], rel=1e-9)
    assert two.run.kv_capacity_tokens == 2 * one.run.kv_capacity_tokens
    # round robin: at twice the rate each replica sees every other request, so the queue stays as
    # short as one replica's at the rate, and shorter than one replica's at twice it
    slow = simulate_serving(_layout({"tensor": 1}, rate_per_s=40.0, requests=120, slo=None)).variants[0]
    fast = simulate_serving(_layout({"tensor": 1}, rate_per_s=80.0, requests=120, slo=None)).variants[0]
    split = simulate_serving(_layout({"tensor": 1, "replicas": 2}, rate_per_s=80.0, requests=120, slo=None)).variants[0]
    assert len(split.run.served) == 120
    assert split.metrics[Metric.TTFT.percentile(90)] < fast.metrics[Metric.TTFT.percentile(90)]
    assert split.metrics[Metric.OUTPUT_TOKENS_PER_S] > 1.5 * slow.metrics[Metric.OUTPUT_TOKENS_PER_S]


def test_an_uneven_split_serves_as_the_inference_simulator_prices_it():
    uneven = {"tensor": 2, "shares": [3, 1]}
    served = simulate_serving(_layout(uneven, requests=1, slo=None)).variants[0]
    even = simulate_serving(_layout({"tensor": 2}, requests=1, slo=None)).variants[0]
    document = _document()
    document["workload"] = {"batch_size": 1, "prompt_tokens": 256, "output_tokens": 32}
    document["parallel"], document["variants"] = uneven, document["variants"][1:]
    batch = simulate(scenario_from_dict(document)).variants[0]
    assert served.metrics[Metric.TTFT] == pytest.approx(batch.timing[Metric.TTFT], rel=1e-9)
    assert served.metrics[Metric.TPOT] == pytest.approx(batch.timing[Metric.TPOT], rel=1e-6)
    # the rank with 3 of 4 shares holds more KV heads per token: fewer tokens fit than evenly
    assert served.run.kv_capacity_tokens < even.run.kv_capacity_tokens


class _FixedStages:
    """A server whose stages take fixed times per iteration whatever its batch (s), each followed
    by a message of a fixed time: the scheduler's view of a pipeline (sim.serving.iteration.ServerCost)."""

    def __init__(self, stage_s: list[float], hop_s: list[float]):
        self.stages, self._stage_s, self._hop_s = tuple(stage_s), stage_s, hop_s

    def stage_s(self, decodes, mean_context, chunks):
        return list(self._stage_s)

    def hop_s(self, stage, tokens, sequences):
        return self._hop_s[stage]


def _saturated(cost, requests):
    run = serve(requests, cost, max_batch_tokens=100, max_num_seqs=200, kv_capacity_tokens=1 << 20)
    return run, run.iterations / max(s.finish_s for s in run.served)


def test_a_saturated_pipeline_runs_an_iteration_per_slowest_stage_and_a_lone_request_relays():
    pipeline = _FixedStages([0.010, 0.006], [0.001, 0.0005])  # a trip of 17.5 ms, the slowest stage 10 ms
    # 200 requests at once, 100 per iteration (the token budget): two batches keep both stages busy
    flood = [Request(i, 0.0, 1, 100) for i in range(200)]
    run, rate = _saturated(pipeline, flood)
    assert 95.0 < rate <= 100.0  # ~ 1 / 10 ms
    assert re.fullmatch(r"stage 1 of 2, busy (99|100)%", pipeline_bottleneck(run))
    one, rate = _saturated(_FixedStages([0.0175], [0.0]), flood)
    assert rate == pytest.approx(1 / 0.0175, rel=0.01) and pipeline_bottleneck(one) == ""
    # a slow link: with one iteration in flight per stage, two per trip of 28.5 ms, the link the busiest
    run, rate = _saturated(_FixedStages([0.010, 0.006], [0.012, 0.0005]), flood)
    assert rate == pytest.approx(2 / 0.0285, rel=0.02) and pipeline_bottleneck(run).startswith("link from stage 1 to 2")
    # alone, every token relays through both stages and both messages
    alone = serve([Request(0, 1.0, 16, 9)], pipeline, max_batch_tokens=100, max_num_seqs=200,
                  kv_capacity_tokens=1 << 20).served[0]
    assert alone.ttft_s == pytest.approx(0.010 + 0.001 + 0.006)  # sampled on the last stage
    assert alone.tpot_s == pytest.approx(0.0175)


def test_a_run_is_stopped_only_once_its_ttft_percentile_misses_for_certain():
    # 50 ms per iteration, one 100-token prompt per iteration, a request every 10 ms: the queue grows
    server, requests = _FixedStages([0.05], [0.0]), [Request(i, 0.01 * i, 100, 2) for i in range(60)]

    def run(limit):
        return serve_together([requests], [(server,)], max_batch_tokens=100, max_num_seqs=200,
                              kv_capacity_tokens=[1 << 20], late_limit=limit)

    full = run(None)[0]
    ttft = [s.ttft_s for s in full.served]
    late = late_requests_to_miss(len(requests), 90)
    assert np.percentile(ttft, 90) > 0.5 and run(LateLimit(0.5, late)) is None
    # an objective the run meets: it runs to its end, the same run
    met = run(LateLimit(max(ttft), late))[0]
    assert [s.first_token_s for s in met.served] == [s.first_token_s for s in full.served]
    # as many values above an objective as the limit: the percentile is above it, wherever they are
    rng = np.random.default_rng(0)
    for count in (2, 3, 10, 61, 1000):
        for q in (50, 90, 99):
            values = np.concatenate([rng.uniform(0, 1, count - min(count, late_requests_to_miss(count, q))),
                                     rng.uniform(1.0001, 2, min(count, late_requests_to_miss(count, q)))])
            assert late_requests_to_miss(count, q) > count or np.percentile(values, q) > 1.0


def test_an_unloaded_request_in_a_pipeline_takes_the_inference_simulators_relay():
    pipeline = {"tensor": 1, "pipeline": 2}
    served = simulate_serving(_layout(pipeline, requests=1, slo=None)).variants[0]
    document = _document()
    document["workload"] = {"batch_size": 1, "prompt_tokens": 256, "output_tokens": 32}
    document["parallel"], document["variants"] = pipeline, document["variants"][1:]
    batch = simulate(scenario_from_dict(document)).variants[0]  # sim.pipeline_run: one micro-batch relays
    assert served.metrics[Metric.TTFT] == pytest.approx(batch.timing[Metric.TTFT], rel=1e-9)
    assert served.metrics[Metric.TPOT] == pytest.approx(batch.timing[Metric.TPOT], rel=1e-6)


def test_under_load_two_hosts_as_a_pipeline_serve_more_and_queue_less_than_one_or_a_tensor_group():
    def run(parallel: dict, rate: float):
        return simulate_serving(_layout(parallel, rate_per_s=rate, requests=120, slo=None)).variants[0].metrics

    p90 = Metric.TTFT.percentile(90)
    pipeline = [run({"tensor": 1, "pipeline": 2}, rate) for rate in (1.0, 16.0, 64.0)]
    assert pipeline[0][p90] < pipeline[1][p90] < pipeline[2][p90]  # queueing grows with the load
    one, tensor = run({"tensor": 1}, 16.0), run({"tensor": 2}, 16.0)
    # each host runs half the layers of every iteration, two iterations in flight; tensor
    # parallelism crosses the 1 Gbit/s link every layer
    assert pipeline[1][p90] < one[p90] < tensor[p90]
    assert pipeline[2][Metric.OUTPUT_TOKENS_PER_S] > 1.5 * run({"tensor": 1}, 64.0)[Metric.OUTPUT_TOKENS_PER_S]


def test_a_client_stage_without_layers_holds_no_kv_cache_and_costs_a_hop():
    one = simulate_serving(_layout({"tensor": 1}, requests=1, slo=None)).variants[0]
    client = simulate_serving(_layout({"tensor": 1, "pipeline": 2, "stages": [0, 12]}, requests=1,
                                      slo=None)).variants[0]
    # the server's cache alone, beside no more weights than the whole model's
    assert one.run.kv_capacity_tokens <= client.run.kv_capacity_tokens < 1.01 * one.run.kv_capacity_tokens
    assert client.metrics[Metric.TPOT] > one.metrics[Metric.TPOT]  # the embeddings' hop and the token back


def test_a_pipeline_stage_holds_only_its_layers_so_more_tokens_fit():
    one = simulate_serving(_layout({"tensor": 1}, requests=1, slo=None)).variants[0]
    two = simulate_serving(_layout({"tensor": 1, "pipeline": 2}, requests=1, slo=None)).variants[0]
    assert two.run.kv_capacity_tokens > 1.9 * one.run.kv_capacity_tokens


def test_replicas_of_a_pipeline_each_serve_their_share_of_the_requests():
    def served(parallel: dict, **workload):  # on 4 hosts: two 2-stage pipelines of one host per stage
        return simulate_serving(_layout(parallel, hosts=4, **workload)).variants[0]

    pipeline, replicas = {"tensor": 1, "pipeline": 2}, {"tensor": 1, "pipeline": 2, "replicas": 2}
    one, two = served(pipeline, requests=1, slo=None), served(replicas, requests=1, slo=None)
    # a request alone relays through one replica's pipeline as through the only one; the caches add up
    assert two.metrics[Metric.TTFT] == pytest.approx(one.metrics[Metric.TTFT], rel=1e-9)
    assert two.run.kv_capacity_tokens == 2 * one.run.kv_capacity_tokens
    # loaded, round robin: each pipeline serves every other request
    loaded = [served(layout, rate_per_s=64.0, requests=120, slo=None) for layout in (pipeline, replicas)]
    assert len(loaded[1].run.served) == 120
    assert loaded[1].metrics[Metric.OUTPUT_TOKENS_PER_S] > 1.5 * loaded[0].metrics[Metric.OUTPUT_TOKENS_PER_S]


def _racks(shared_uplinks: bool, **workload):
    """GPT-2 served by two 2-stage pipelines, each from a host of one rack to a host of another over
    100 Mbit/s rack uplinks: both pipelines' hops cross the same two uplinks (``shared_uplinks``),
    or each pipeline's hosts sit in racks of their own, over uplinks alike."""
    racks = ("a", "b", "a", "b") if shared_uplinks else ("a0", "b0", "a1", "b1")
    uplink = {"bandwidth": "100Mbit/s", "latency": "1ms"}
    document = {
        "name": "racks", "model": "gpt2",
        "cluster": {"switches": [{"name": "core"}, *({"name": rack, "parent": "core", "uplink": uplink}
                                                     for rack in dict.fromkeys(racks))],
                    "hosts": [{"name": f"h{i}", "parent": rack, "nic": {"bandwidth": "1Gbit/s", "latency": "100us"},
                               "devices": {"type": "cpu", "count": 1, "memory": "4GiB"}} for i, rack in enumerate(racks)]},
        "parallel": {"tensor": 1, "pipeline": 2, "replicas": 2},
        "workload": {"kind": "serving", "rate_per_s": 1.0, "requests": 1, "prompt_tokens": 256, "output_tokens": 32,
                     **workload},
        "variants": [{"name": "allreduce_ring", "strategy": "allreduce_ln", "allreduce": "ring"}],
    }
    return simulate_serving(scenario_from_dict(document)).variants[0]


def test_replicas_whose_hops_cross_one_link_share_it_when_they_run_at_once():
    # a request alone crosses the uplinks alone, wherever the other pipeline is
    alone = [_racks(shared).metrics[Metric.TTFT] for shared in (True, False)]
    assert alone[0] == pytest.approx(alone[1], rel=1e-9)
    # loaded, both pipelines' activations cross the shared uplinks at once: each hop at half the rate
    loaded = {"rate_per_s": 40.0, "requests": 120}
    shared, apart = _racks(True, **loaded), _racks(False, **loaded)
    p90 = Metric.TTFT.percentile(90)
    assert shared.metrics[p90] > 1.3 * apart.metrics[p90]
    assert shared.metrics[Metric.OUTPUT_TOKENS_PER_S] < apart.metrics[Metric.OUTPUT_TOKENS_PER_S]


def _shared_cores(replicas: int, tensor: int, **workload):
    """GPT-2 served on 2 hosts of 2 CPU ranks whose ranks all share one machine's 2 cores (the
    emulated cluster of validation/plan-check-report/replicas/scenarios/c94.yaml), uncalibrated."""
    data = yaml.safe_load((ROOT / "validation/plan-check-report/replicas/scenarios/c94.yaml").read_text())
    data["cluster"]["cores"] = 2
    data["workload"] = {"kind": "serving", "rate_per_s": 1.0, "requests": 1, "prompt_tokens": 32,
                        "output_tokens": 8, **workload}
    data["parallel"] = {"tensor": tensor, "replicas": replicas}
    data["variants"] = data["variants"][:1]
    return simulate_serving(scenario_from_dict(data, base_dir=ROOT)).variants[0]


def test_a_request_alone_on_replicas_sharing_cores_has_them_to_itself():
    shared, alone = _shared_cores(2, 2), _shared_cores(1, 2)
    assert shared.metrics[Metric.TTFT] == pytest.approx(alone.metrics[Metric.TTFT], rel=1e-9)
    assert shared.metrics[Metric.TPOT] == pytest.approx(alone.metrics[Metric.TPOT], rel=1e-9)


def test_loaded_replicas_sharing_cores_deliver_what_the_cores_do():
    # four one-rank replicas on 2 cores, loaded: every rank at half a core, so no more tokens than
    # two replicas with a core each; one request at a time still runs at a whole core
    loaded = {"rate_per_s": 40.0, "requests": 200}
    four, two = _shared_cores(4, 1, **loaded), _shared_cores(2, 1, **loaded)
    assert four.metrics[Metric.OUTPUT_TOKENS_PER_S] < 1.05 * two.metrics[Metric.OUTPUT_TOKENS_PER_S]
    assert _shared_cores(4, 1).metrics[Metric.TPOT] == pytest.approx(_shared_cores(2, 1).metrics[Metric.TPOT])
