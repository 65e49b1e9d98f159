"""The runtime: every strategy and algorithm generates the single-process reference's tokens on
1, 2 and 4 gloo ranks; faults end the run naming the rank; measured results join simulated ones."""

import json
import os
import signal
import time
from pathlib import Path

import multiprocessing
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from runtime.comm import Communicator  # noqa: E402
from runtime.executor import Executor  # noqa: E402
from runtime.launch import LaunchError, launch  # noqa: E402
from runtime.model import RankModel, reference_generate  # noqa: E402
from runtime.weights import prompt_tokens  # noqa: E402
from sim.plan import Plan, StrategyChoice  # noqa: E402
from sim.topology import build_topology  # noqa: E402
from tests.conftest import cluster, make_scenario, tiny_model_config  # noqa: E402

LLAMA_LIKE = tiny_model_config("llama", num_layers=2)
GPT2_LIKE = tiny_model_config("gpt2", num_layers=2)

VARIANTS = [
    StrategyChoice("reduce_ln_bcast", reduce="library", broadcast="library"),
    StrategyChoice("reduce_ln_bcast", reduce="binomial", broadcast="binomial"),
    StrategyChoice("reduce_ln_bcast", reduce="star", broadcast="star"),
    *(StrategyChoice("allreduce_ln", allreduce=a, broadcast="binomial")
      for a in ("library", "ring", "recursive_doubling", "rabenseifner", "star", "double_binary_tree",
                "two_level_tree", "two_level_rs")),
]

CLUSTERS = {1: cluster(1, 1, device="cpu"), 2: cluster(2, 1, device="cpu"), 4: cluster(2, 2, device="cpu")}


def _scenario(tmp_path: Path, config: dict, tp: int):
    path = tmp_path / f"{config['model_type']}.config.json"
    path.write_text(json.dumps(config))
    return make_scenario(model=str(path), dtype="fp32", cluster=CLUSTERS[tp],
                         workload={"batch_size": 2, "prompt_tokens": 5, "output_tokens": 4})


def _generate_all_variants(scenario, tp: int):
    spec = scenario.model
    topology = build_topology(scenario.config.cluster)
    work = scenario.config.workload

    def body(rank, heartbeat):
        model = RankModel(spec, tp, rank, seed=7, batch_size=work.batch_size,
                          max_tokens=work.prompt_tokens + work.output_tokens)
        prompt = prompt_tokens(spec, work.batch_size, work.prompt_tokens, seed=7)
        out = []
        for choice in VARIANTS:
            plan = Plan(spec, tuple(range(tp)), work.batch_size, work.prompt_tokens, work.output_tokens, choice)
            generation = Executor(plan, model, Communicator(rank, topology.host_groups), rank).generate(
                prompt, time.perf_counter())
            if rank == 0:
                out.append((torch.stack(generation.tokens, 1), torch.stack(generation.hidden, 1)))
        return out

    return launch(body, tp, hang_timeout_s=60)[0]


@pytest.mark.parametrize("config", [LLAMA_LIKE, GPT2_LIKE], ids=["llama_gqa", "gpt2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_strategy_generates_the_reference_tokens(tmp_path, config, tp):
    scenario = _scenario(tmp_path, config, tp)
    work = scenario.config.workload
    prompt = prompt_tokens(scenario.model, work.batch_size, work.prompt_tokens, seed=7)
    tokens, hidden = reference_generate(scenario.model, seed=7, prompt=prompt, output_tokens=work.output_tokens)
    for choice, (got_tokens, got_hidden) in zip(VARIANTS, _generate_all_variants(scenario, tp)):
        assert torch.equal(got_tokens, tokens), choice
        torch.testing.assert_close(got_hidden, torch.stack(hidden, 1), rtol=1e-4, atol=1e-5, msg=str(choice))


def test_the_runtime_runs_a_new_strategy_from_its_typed_ops_alone(tmp_path, monkeypatch):
    from sim.strategies import STRATEGIES
    from tests.test_strategies import ResidualBcastReduceLn

    # Registered in the simulator only: the executor knows nothing of it but the ops' typed fields.
    monkeypatch.setitem(STRATEGIES, ResidualBcastReduceLn.name, ResidualBcastReduceLn())
    scenario = _scenario(tmp_path, LLAMA_LIKE, 2)
    spec, work = scenario.model, scenario.config.workload
    topology = build_topology(scenario.config.cluster)
    prompt = prompt_tokens(spec, work.batch_size, work.prompt_tokens, seed=7)
    plan = Plan(spec, (0, 1), work.batch_size, work.prompt_tokens, work.output_tokens,
                StrategyChoice(ResidualBcastReduceLn.name, reduce="star", broadcast="binomial"))

    def body(rank, heartbeat):
        model = RankModel(spec, 2, rank, seed=7, batch_size=work.batch_size,
                          max_tokens=work.prompt_tokens + work.output_tokens)
        generation = Executor(plan, model, Communicator(rank, topology.host_groups), rank).generate(
            prompt, time.perf_counter())
        return torch.stack(generation.tokens, 1) if rank == 0 else None

    tokens, _ = reference_generate(spec, seed=7, prompt=prompt, output_tokens=work.output_tokens)
    assert torch.equal(launch(body, 2, hang_timeout_s=60)[0], tokens)


def _no_children_left():
    assert multiprocessing.active_children() == []


def test_a_killed_rank_fails_the_run_naming_it():
    def body(rank, heartbeat):
        for step in range(200):
            heartbeat(f"step {step}")
            torch.distributed.barrier()
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        return rank

    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 died: killed by SIGKILL"):
        launch(body, 3, hang_timeout_s=20)
    assert time.monotonic() - start < 20
    _no_children_left()


def test_a_hung_rank_fails_the_run_naming_it():
    def body(rank, heartbeat):
        for step in range(200):
            heartbeat(f"step {step}")
            if rank == 2 and step == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            torch.distributed.barrier()
        return rank

    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 2 hung"):
        launch(body, 3, hang_timeout_s=3)
    assert time.monotonic() - start < 15
    _no_children_left()


def test_a_failing_rank_reports_its_error():
    def body(rank, heartbeat):
        if rank == 1:
            raise ValueError("weights file is corrupt")
        torch.distributed.barrier()

    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: weights file is corrupt"):
        launch(body, 2, hang_timeout_s=10)
    _no_children_left()


def test_measured_results_join_simulated_ones(tmp_path):
    from runtime.measure import measure_scenario
    from sim.simulate import simulate

    scenario = _scenario(tmp_path, LLAMA_LIKE, 2)
    measured = measure_scenario(scenario, repeats=2, warmup=0, hang_timeout_s=60).results
    simulated = simulate(scenario).results
    keys = ["scenario", "variant", "metric", "device"]
    joined = simulated.merge(measured, on=keys, suffixes=("_sim", "_meas"))
    assert set(joined["metric"]) >= {"ttft_s", "tpot_s", "decode_tokens_per_s", "peak_memory_bytes"}
    assert len(joined[joined["metric"] == "peak_memory_bytes"]) == 2 * len(scenario.config.variants)
    assert (measured["source"] == "measured").all()
    timing = measured[measured["metric"].isin(["ttft_s", "tpot_s"])]["value"]
    assert (timing > 0).all()
    spread = measured.pivot_table(index="variant", columns="metric", values="value")
    assert ((spread["ttft_p10_s"] <= spread["ttft_s"]) & (spread["ttft_s"] <= spread["ttft_p90_s"])).all()
    assert isinstance(measured, pd.DataFrame)


def test_an_executor_that_records_no_ops_generates_the_same_tokens_and_times_its_steps(tmp_path):
    # The GPU check's asynchronous mode: no op record and no per-op device wait, the step still timed.
    scenario = _scenario(tmp_path, LLAMA_LIKE, 2)
    spec, work = scenario.model, scenario.config.workload
    topology = build_topology(scenario.config.cluster)

    def body(rank, heartbeat):
        model = RankModel(spec, 2, rank, seed=7, batch_size=work.batch_size,
                          max_tokens=work.prompt_tokens + work.output_tokens)
        prompt = prompt_tokens(spec, work.batch_size, work.prompt_tokens, seed=7)
        plan = Plan(spec, (0, 1), work.batch_size, work.prompt_tokens, work.output_tokens, VARIANTS[0])
        runs = [Executor(plan, model, Communicator(rank, topology.host_groups), rank, record_ops=record).generate(
            prompt, time.perf_counter()) for record in (True, False)]
        return [(torch.stack(g.tokens, 1) if rank == 0 else None, len(g.records), len(g.step_end_s),
                 all(e > s for s, e in zip(g.step_start_s, g.step_end_s))) for g in runs]

    recorded, unrecorded = launch(body, 2, hang_timeout_s=60)[0]
    assert torch.equal(recorded[0], unrecorded[0])
    assert recorded[1] > 0 and unrecorded[1] == 0
    assert recorded[2] == unrecorded[2] == work.output_tokens and unrecorded[3]
