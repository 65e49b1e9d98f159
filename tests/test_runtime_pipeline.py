"""The runtime runs a pipeline plan on gloo ranks (send/recv between stage masters, tensor
parallelism inside each stage) and generates the single-process reference's tokens."""

import json
import time

import pytest

torch = pytest.importorskip("torch")

from runtime.comm import Communicator  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.model import reference_generate  # noqa: E402
from runtime.pipeline import PipelineExecutor, stage_model, stage_process_groups  # noqa: E402
from runtime.weights import prompt_tokens  # noqa: E402
from sim.parallel import ParallelPlan  # noqa: E402
from sim.pipeline import PipelinePlan  # noqa: E402
from sim.plan import StrategyChoice  # noqa: E402
from sim.topology import build_topology  # noqa: E402
from tests.conftest import cluster, make_scenario, tiny_model_config  # noqa: E402

VARIANTS = [StrategyChoice("allreduce_ln", allreduce="library", broadcast="library"),
            StrategyChoice("reduce_ln_bcast", reduce="binomial", broadcast="binomial")]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("tensor,stages", [(1, [1, 3]), (2, None), (1, [0, 4])], ids=["pp2xtp1", "pp2xtp2", "client_stage"])
def test_a_pipeline_generates_the_reference_tokens(tmp_path, model_type, tensor, stages):
    path = tmp_path / f"{model_type}.config.json"
    path.write_text(json.dumps(tiny_model_config(model_type, num_layers=4)))
    parallel = {"tensor": tensor, "pipeline": 2} | ({"stages": stages} if stages else {})
    # Three sequences in two micro-batches (2 and 1): each stage's KV cache holds both.
    scenario = make_scenario(model=str(path), dtype="fp32", cluster=cluster(2, tensor, device="cpu"),
                             parallel=parallel, workload={"batch_size": 3, "prompt_tokens": 5, "output_tokens": 4})
    spec, work = scenario.model, scenario.config.workload
    topology = build_topology(scenario.config.cluster)
    layout = ParallelPlan.of(scenario, topology)
    prompt = prompt_tokens(spec, work.batch_size, work.prompt_tokens, seed=7)

    def body(rank, heartbeat):
        out = []
        for choice in VARIANTS:
            plan = PipelinePlan.of(layout, work.batch_size, work.prompt_tokens, work.output_tokens, choice)
            comm = Communicator(rank, topology.host_groups, stage_process_groups(layout.replica_stage_ranks))
            model = stage_model(plan, rank, seed=7, max_tokens=work.prompt_tokens + work.output_tokens,
                                device=torch.device("cpu"), dtype=torch.float32)
            stage = plan.stages[plan.stage_of(rank)]
            assert {name.split(".")[1] for name in model.weights if name.startswith("layers.")} == {
                str(layer) for layer in range(stage.first_layer, stage.first_layer + stage.num_layers)}
            generation = PipelineExecutor(plan, model, comm, rank).generate(prompt, time.perf_counter())
            if rank == plan.master:
                out.append(torch.stack(generation.tokens, 1))
            if generation.hidden:
                out.append(torch.stack(generation.hidden, 1))
        return out

    results = launch(body, 2 * tensor, hang_timeout_s=60)
    tokens, hidden = reference_generate(spec, seed=7, prompt=prompt, output_tokens=work.output_tokens)
    last_master = 2 * tensor - tensor
    for v, choice in enumerate(VARIANTS):
        assert torch.equal(results[0][v], tokens), choice
        torch.testing.assert_close(results[last_master][v], torch.stack(hidden, 1), rtol=1e-4, atol=1e-5,
                                   msg=str(choice))


def test_hetsim_measure_times_a_pipeline_and_its_results_join_the_simulated_ones(tmp_path):
    from runtime.measure import measure_scenario
    from sim.simulate import simulate

    path = tmp_path / "gpt2.config.json"
    path.write_text(json.dumps(tiny_model_config("gpt2", num_layers=4)))
    scenario = make_scenario(model=str(path), dtype="fp32", cluster=cluster(2, 1, device="cpu"),
                             parallel={"tensor": 1, "pipeline": 2},
                             variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}],
                             workload={"batch_size": 2, "prompt_tokens": 5, "output_tokens": 4})
    measured = measure_scenario(scenario, repeats=2, warmup=0, hang_timeout_s=60)
    prompt = prompt_tokens(scenario.model, 2, 5, seed=0)
    tokens, _ = reference_generate(scenario.model, seed=0, prompt=prompt, output_tokens=4)
    assert (measured.variants[0].tokens == tokens.numpy()).all()
    joined = simulate(scenario).results.merge(measured.results, on=["scenario", "variant", "metric", "device"])
    assert set(joined["metric"]) >= {"ttft_s", "tpot_s", "peak_memory_bytes"}
    timing = measured.results.set_index("metric")["value"]
    assert 0 < timing["ttft_s"] < timing["e2e_latency_s"]


def test_hetsim_measure_runs_every_replica_of_a_pipeline_on_its_share_of_the_batch(tmp_path):
    from runtime.measure import measure_scenario

    path = tmp_path / "gpt2.config.json"
    path.write_text(json.dumps(tiny_model_config("gpt2", num_layers=2)))
    # 2 replicas x PP 2 on 4 gloo ranks: replica 0 on ranks 0-1 serves 2 sequences, replica 1 on 2-3 the third
    scenario = make_scenario(model=str(path), dtype="fp32", cluster=cluster(2, 2, device="cpu"),
                             parallel={"tensor": 1, "pipeline": 2, "replicas": 2},
                             variants=[{"name": "rlb", "strategy": "reduce_ln_bcast"}],
                             workload={"batch_size": 3, "prompt_tokens": 4, "output_tokens": 3})
    result = measure_scenario(scenario, repeats=1, warmup=0, hang_timeout_s=60)
    assert result.ranks == (0, 1, 2, 3) and result.idle_devices == ()
    rows = result.results.set_index(["metric", "device"])["value"]
    assert rows[("replica_batch_size", "h0/dev0")] == 2 and rows[("replica_batch_size", "h1/dev0")] == 1
    assert rows[("decode_tokens_per_s", "")] == pytest.approx(
        rows[("replica_decode_tokens_per_s", "h0/dev0")] + rows[("replica_decode_tokens_per_s", "h1/dev0")])
    assert rows[("ttft_s", "")] == max(rows[("replica_ttft_s", "h0/dev0")], rows[("replica_ttft_s", "h1/dev0")])
    # each replica's pipeline generates the single-process reference's tokens for its own prompts
    tokens = result.variants[0].tokens  # [repeats, batch, output tokens], replica after replica
    for batch, got in ((2, tokens[0, :2]), (1, tokens[0, 2:])):
        expected, _ = reference_generate(scenario.model, seed=0, prompt=prompt_tokens(scenario.model, batch, 4, seed=0),
                                         output_tokens=3)
        assert torch.equal(torch.from_numpy(got), expected)
