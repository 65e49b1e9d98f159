"""Replicas of a layout serve their share of the batch (throughput adds up, latency per replica),
and devices a layout leaves unused are named on the terminal and in results."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from models.errors import ConfigError
from sim.cores import CorePool
from sim.replicas import replica_pools, split_batch
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import ROOT, scenario_dict
from tests.test_cli import _run, _write

THREE_HOSTS = {"switches": [{"name": "sw"}],
               "hosts": [{"name": "h{i}", "count": 3, "parent": "sw",
                          "nic": {"bandwidth": "10Gbit/s", "latency": "50us"},
                          "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
                          "devices": {"type": "rtx_4090", "count": 2}}]}


def _data(batch_size: int, **parallel) -> dict:
    return scenario_dict(model="qwen2.5-0.5b", cluster=THREE_HOSTS, parallel=parallel,
                         workload={"batch_size": batch_size, "prompt_tokens": 64, "output_tokens": 4},
                         variants=[{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])


def _simulate(batch_size: int, **parallel):
    return simulate(scenario_from_dict(_data(batch_size, **parallel), base_dir=ROOT))


def _metric(result, metric: str) -> pd.Series:
    rows = result.results[result.results["metric"] == metric]
    return rows.set_index("device")["value"]


def test_three_replicas_of_tp2_serve_three_times_one_replicas_throughput():
    one = _simulate(1, tensor=2)
    three = _simulate(3, tensor=2, replicas=3)
    assert three.ranks == (0, 1, 2, 3, 4, 5) and three.idle_devices == ()
    assert one.idle_devices == ("h1/dev0", "h1/dev1", "h2/dev0", "h2/dev1")
    single, every = one.variants[0].timing, three.variants[0].timing
    assert every["decode_tokens_per_s"] == pytest.approx(3 * single["decode_tokens_per_s"])
    assert every["ttft_s"] == pytest.approx(single["ttft_s"]) and every["tpot_s"] == pytest.approx(single["tpot_s"])
    per_replica = _metric(three, "replica_decode_tokens_per_s")
    assert list(per_replica.index) == ["h0/dev0", "h1/dev0", "h2/dev0"]
    assert per_replica.sum() == pytest.approx(every["decode_tokens_per_s"])
    assert set(_metric(three, "peak_memory_bytes").index) == {f"h{h}/dev{d}" for h in range(3) for d in range(2)}


def test_the_batch_is_split_across_replicas_and_the_slowest_sets_the_latency():
    result = _simulate(4, tensor=2, replicas=3)
    assert list(_metric(result, "replica_batch_size")) == [2, 1, 1]
    ttft = _metric(result, "replica_ttft_s")
    assert ttft["h0/dev0"] > ttft["h1/dev0"] == ttft["h2/dev0"]
    assert result.variants[0].timing["ttft_s"] == ttft.max()
    assert split_batch(7, 3) == (3, 2, 2)


@pytest.mark.parametrize("batch_size, parallel, needle", [
    (2, {"tensor": 2, "replicas": 3}, "3 replicas need at least one sequence each, but workload.batch_size is 2"),
    (4, {"tensor": 2, "replicas": 4}, "tensor 2 x data 1 x pipeline 1 x replicas 4 = 8 ranks exceed the cluster's 6"),
])
def test_replicas_that_do_not_fit_are_refused(batch_size, parallel, needle):
    with pytest.raises(ConfigError) as error:
        _simulate(batch_size, **parallel)
    assert error.value.field == "parallel.replicas" and needle in error.value.message


def test_idle_devices_are_named_on_the_terminal_and_in_results(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = _run(["simulate", str(_write(tmp_path, _data(2, tensor=2, replicas=2))), "--out", str(out)],
                           capsys)
    assert code == 0
    assert "warning: 2 of 6 devices idle: h2/dev0, h2/dev1" in " ".join(stdout.split())
    assert "TP=2 x 2 replicas" in stdout
    assert "2 of 6 devices idle: h2/dev0, h2/dev1" in (out / "report.html").read_text()
    results = pd.read_csv(out / "results.csv")
    assert list(results.loc[results["metric"] == "idle_device", "device"]) == ["h2/dev0", "h2/dev1"]
    code, stdout, _ = _run(["simulate", str(_write(tmp_path, _data(3, tensor=2, replicas=3))), "--out", str(out)],
                           capsys)
    assert code == 0 and "devices idle" not in stdout


def test_hetsim_measure_names_the_devices_it_leaves_idle(tmp_path, capsys):
    pytest.importorskip("torch")
    import json

    from tests.conftest import cluster, tiny_model_config

    (tmp_path / "gpt2.config.json").write_text(json.dumps(tiny_model_config("gpt2", num_layers=1)))
    data = scenario_dict(model="gpt2.config.json", dtype="fp32", cluster=cluster(1, 3, device="cpu"),
                         parallel={"tensor": 2}, workload={"batch_size": 1, "prompt_tokens": 4, "output_tokens": 2},
                         variants=[{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])
    out = tmp_path / "measured"
    code, stdout, _ = _run(["measure", str(_write(tmp_path, data)), "--out", str(out), "--repeats", "1",
                            "--warmup", "0"], capsys)
    assert code == 0
    assert "warning: 1 of 3 devices idle: h0/dev2" in " ".join(stdout.split())
    results = pd.read_csv(out / "results.csv")
    assert list(results.loc[results["metric"] == "idle_device", "device"]) == ["h0/dev2"]


def test_hetsim_measure_runs_every_replica_on_its_share_of_the_batch(tmp_path, capsys):
    pytest.importorskip("torch")
    import json

    import torch

    from runtime.measure import measure_scenario
    from runtime.model import reference_generate
    from runtime.weights import prompt_tokens
    from tests.conftest import cluster, tiny_model_config

    (tmp_path / "gpt2.config.json").write_text(json.dumps(tiny_model_config("gpt2", num_layers=1)))
    data = scenario_dict(model="gpt2.config.json", dtype="fp32", cluster=cluster(1, 4, device="cpu"),
                         parallel={"tensor": 2, "replicas": 2},
                         workload={"batch_size": 3, "prompt_tokens": 4, "output_tokens": 3},
                         variants=[{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])
    scenario = scenario_from_dict(data, base_dir=tmp_path)
    result = measure_scenario(scenario, repeats=1, warmup=0, hang_timeout_s=60)
    rows = result.results.set_index(["metric", "device"])["value"]
    # replica 0 on dev0-dev1 serves 2 sequences, replica 1 on dev2-dev3 the third
    assert rows[("replica_batch_size", "h0/dev0")] == 2 and rows[("replica_batch_size", "h0/dev2")] == 1
    assert result.idle_devices == () and len(result.ranks) == 4
    # throughput adds up, latency is the slowest replica's (one repeat: its medians are its values)
    assert rows[("decode_tokens_per_s", "")] == pytest.approx(
        rows[("replica_decode_tokens_per_s", "h0/dev0")] + rows[("replica_decode_tokens_per_s", "h0/dev2")])
    assert rows[("tpot_s", "")] == max(rows[("replica_tpot_s", "h0/dev0")], rows[("replica_tpot_s", "h0/dev2")])
    # each replica generates the single-process reference's tokens for its own prompts
    tokens = result.variants[0].tokens
    for batch, got in ((2, tokens[0, :2]), (1, tokens[0, 2:])):
        prompt = prompt_tokens(scenario.model, batch, 4, seed=0)
        expected, _ = reference_generate(scenario.model, seed=0, prompt=prompt, output_tokens=3)
        assert torch.equal(torch.from_numpy(got), expected)


def _cpu_replicas(replicas: int, cores: int):
    """GPT-2 on ``replicas`` one-rank replicas, one sequence each, on hosts whose CPU ranks all
    run on one machine of ``cores`` cores (the emulated cluster)."""
    data = yaml.safe_load((ROOT / "validation/plan-check-report/replicas/scenarios/c45.yaml").read_text())
    data["cluster"]["hosts"][0]["count"] = replicas
    data["cluster"]["cores"] = cores
    data["workload"]["batch_size"] = replicas
    data["parallel"] = {"tensor": 1, "replicas": replicas}
    return simulate(scenario_from_dict(data, base_dir=ROOT)).variants[0].timing


def test_replicas_sharing_one_machines_cores_slow_each_other():
    alone = _cpu_replicas(1, 1)
    two = _cpu_replicas(2, 1)
    # every replica's rank computes at once: each at half the one core, its decode step twice as long
    assert two["tpot_s"] == pytest.approx(2 * alone["tpot_s"], rel=0.05)
    assert two["decode_tokens_per_s"] == pytest.approx(alone["decode_tokens_per_s"], rel=0.05)


def test_replicas_with_a_core_each_are_left_as_they_were():
    alone, spread = _cpu_replicas(1, 1), _cpu_replicas(4, 4)
    assert spread["tpot_s"] == alone["tpot_s"] and spread["ttft_s"] == alone["ttft_s"]


def test_each_replica_gets_its_share_of_the_cores_its_mirrors_share():
    # the calibrated pool names the first replica's rank only: its mirrors are on that machine too
    pools = (CorePool(frozenset({0}), 2.0, 0.5),)
    assert replica_pools(pools, ((0,), (1,), (2,), (3,)), (2,)) == (CorePool(frozenset({2}), 0.5, 0.125),)
    assert replica_pools((), ((0,), (1,)), (1,)) == ()
