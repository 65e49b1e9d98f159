"""Replicas of a layout serve their share of the batch (throughput adds up, latency per replica),
and devices a layout leaves unused are named on the terminal and in results."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from models.errors import ConfigError
from sim.cores import CorePool
from sim.replicas import replica_pools, split_batch
from sim.scenario import load_scenario, scenario_from_dict
import sim.simulate as simulate_module
from sim.outputs import simulation_files
from sim.simulate import simulate
from sim.timeline import simulate_run
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


def test_replicas_of_a_pipeline_add_their_throughput_and_the_slowest_sets_the_latency():
    one = _simulate(2, tensor=1, pipeline=2)
    two = _simulate(4, tensor=1, pipeline=2, replicas=2)
    assert [vr.layout.label for vr in two.variants] == ["PP=2 x 2 replicas"]
    assert two.ranks == (0, 1, 2, 3) and two.idle_devices == ("h2/dev0", "h2/dev1")
    assert list(_metric(two, "idle_device").index) == ["h2/dev0", "h2/dev1"]
    single, every = one.variants[0].timing, two.variants[0].timing
    assert every["decode_tokens_per_s"] == pytest.approx(2 * single["decode_tokens_per_s"])
    assert every["ttft_s"] == pytest.approx(single["ttft_s"]) and every["tpot_s"] == pytest.approx(single["tpot_s"])
    # each replica is a whole pipeline on its own host: its stages, its hops, its memory
    replica = two.variants[0].replicas[1]
    assert replica.ranks == (2, 3) and set(replica.trace.ops["rank"]) == {2, 3}
    peaks, alone = _metric(two, "peak_memory_bytes"), _metric(one, "peak_memory_bytes")
    assert set(peaks.index) == {f"h{h}/dev{d}" for h in range(2) for d in range(2)}
    assert all(peaks[f"h{h}/dev{d}"] == alone[f"h0/dev{d}"] for h in range(2) for d in range(2))
    # 3 sequences: the first replica's 2 in two micro-batches take longer than the second's 1
    uneven = _simulate(3, tensor=1, pipeline=2, replicas=2)
    assert list(_metric(uneven, "replica_batch_size")) == [2, 1]
    ttft = _metric(uneven, "replica_ttft_s")
    assert ttft["h0/dev0"] > ttft["h1/dev0"] and uneven.variants[0].timing["ttft_s"] == ttft.max()
    rates = _metric(uneven, "replica_decode_tokens_per_s")
    assert uneven.variants[0].timing["decode_tokens_per_s"] == pytest.approx(rates.sum())


# hosts a0, b0 under switch A / B, then a1, b1: each replica's 2-stage pipeline crosses the A-B uplinks
_NIC = {"bandwidth": "10Gbit/s", "latency": "50us"}
_CROSSING = {"switches": [{"name": "core"}] + [{"name": n, "parent": "core",
                                                 "uplink": {"bandwidth": "100Mbit/s", "latency": "1ms"}}
                                                for n in ("A", "B")],
             "hosts": [{"name": n, "parent": n[0].upper(), "nic": _NIC, "devices": {"type": "rtx_4090", "count": 1}}
                       for n in ("a0", "b0", "a1", "b1")]}


def test_replicas_of_a_pipeline_share_the_links_their_hops_cross():
    def ttft(replicas: int) -> float:
        data = _data(replicas, tensor=1, pipeline=2, replicas=replicas) | {"cluster": _CROSSING}
        return simulate(scenario_from_dict(data, base_dir=ROOT)).variants[0].timing["ttft_s"]

    # a prefill hop of 64 tokens x 896 x 2 bytes takes 9.2 ms over 100 Mbit/s alone, twice that shared
    hop_s = 64 * 896 * 2 / 12.5e6
    assert ttft(2) - ttft(1) == pytest.approx(hop_s, rel=0.05)


def _cpu_pipelines(replicas: int, cores: int):
    """GPT-2 on ``replicas`` replicas of a 2-stage pipeline of one-rank stages, one sequence each,
    every rank on one machine of ``cores`` cores (c45's cluster, uncalibrated)."""
    data = yaml.safe_load((ROOT / "validation/plan-check-report/replicas/scenarios/c45.yaml").read_text())
    data["cluster"]["cores"] = cores
    data["workload"]["batch_size"] = replicas
    data["parallel"] = {"tensor": 1, "pipeline": 2, "replicas": replicas}
    return simulate(scenario_from_dict(data, base_dir=ROOT)).variants[0].timing


def test_replicas_of_a_pipeline_share_the_machines_cores():
    alone, two = _cpu_pipelines(1, 1), _cpu_pipelines(2, 1)
    # a relay computes one stage at a time: two replicas' stages share the one core, each at half
    assert 1.8 * alone["tpot_s"] < two["tpot_s"] < 2.1 * alone["tpot_s"]
    assert _cpu_pipelines(2, 2)["tpot_s"] == alone["tpot_s"]  # a core for each replica's computing stage


@pytest.mark.parametrize("batch_size, parallel, needle", [
    (2, {"tensor": 2, "replicas": 3}, "3 replicas need at least one sequence each, but workload.batch_size is 2"),
    (4, {"tensor": 2, "replicas": 4}, "tensor 2 x data 1 x pipeline 1 x replicas 4 = 8 ranks exceed the cluster's 6"),
    (4, {"tensor": 2, "pipeline": 2, "replicas": 2},
     "tensor 2 x data 1 x pipeline 2 x replicas 2 = 8 ranks exceed the cluster's 6"),
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



def _mixed_hosts(batch_size: int, **parallel) -> dict:
    """THREE_HOSTS with the middle host's RTX 4090s swapped for RTX 3090s: a replica per host of
    TP 2 has a twin on the third host only; 6 replicas of TP 1, twins by device type."""
    data = _data(batch_size, **parallel)
    hosts = data["cluster"]["hosts"][0]
    data["cluster"]["hosts"] = [dict(hosts, name=name, count=1, devices={"type": kind, "count": 2})
                                for name, kind in (("a", "rtx_4090"), ("b", "rtx_3090"), ("c", "rtx_4090"))]
    return data


@pytest.mark.parametrize("batch_size, parallel, simulated", [
    (6, {"tensor": 1, "replicas": 6}, 2),  # one run per device type
    (3, {"tensor": 2, "replicas": 3}, 2),  # hosts a and c alike, b not
    (4, {"tensor": 1, "replicas": 3}, 3),  # shares 2, 1, 1 on a/dev0, a/dev1, b/dev0: none alike
    (4, {"tensor": 2, "replicas": 3}, 3),  # shares 2, 1, 1: a's replica serves more than c's
])
def test_alike_replicas_are_simulated_once_and_their_outputs_are_the_full_simulations(
        monkeypatch, batch_size, parallel, simulated):
    scenario = scenario_from_dict(_mixed_hosts(batch_size, **parallel), base_dir=ROOT)
    runs = []
    monkeypatch.setattr(simulate_module, "simulate_run", lambda plan, *args: runs.append(plan) or simulate_run(plan, *args))
    shortcut = simulation_files(simulate(scenario))
    assert len(runs) == simulated
    monkeypatch.setattr(simulate_module, "REUSE_ALIKE_REPLICAS", False)
    full = simulation_files(simulate(scenario))
    assert len(runs) == simulated + parallel["replicas"]
    assert shortcut == full


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
    # two of the four computing at once: each has half the free cores; a rank of no replica idles
    assert replica_pools(pools, ((0,), (1,), (2,), (3,)), (2,), computing=2) == (CorePool(frozenset({2}), 1.0, 0.25),)
    machine = (CorePool(frozenset({0, 1, 2}), 2.0),)
    assert replica_pools(machine, ((0,), (1,)), (1,)) == (CorePool(frozenset({1}), 1.0),)


def _tp2_replicas(replicas: int, cores: int):
    """GPT-2 over 2 hosts of 2 CPU ranks (c94's cluster, uncalibrated), tensor-parallel 2 on each
    host, ``replicas`` replicas of one sequence each, every rank on one machine of ``cores`` cores."""
    data = yaml.safe_load((ROOT / "validation/plan-check-report/replicas/scenarios/c94.yaml").read_text())
    data["cluster"]["cores"] = cores
    data["workload"]["batch_size"] = replicas
    data["parallel"] = {"tensor": 2, "replicas": replicas}
    return simulate(scenario_from_dict(data, base_dir=ROOT))


def _decode_allreduces_s(result) -> pd.Series:
    ops = result.variants[0].trace.ops
    ops = ops[(ops["step"] == 1) & (ops["kind"] == "allreduce")]
    return ops["end_s"] - ops["start_s"]


def test_a_replicas_messages_contend_with_every_replica_on_the_machines_cores():
    from sim.transport import GLOO_CONTENTION_PER_TURN_S

    # two TP-2 replicas on 2 cores: each allreduce step keeps both replicas' 2 ranks busy at once,
    # 2 beyond the cores, for a core turn to enter it and one per message
    shared = _decode_allreduces_s(_tp2_replicas(2, 2))
    floor_s = 2 * GLOO_CONTENTION_PER_TURN_S[False]
    assert shared.min() >= floor_s
    # one replica's 2 ranks on the 2 cores, or two replicas on 4: no contention floor
    assert _decode_allreduces_s(_tp2_replicas(1, 2)).max() < floor_s
    assert _decode_allreduces_s(_tp2_replicas(2, 4)).max() < floor_s


def test_a_groups_copies_on_its_cores_count_among_the_busy_ranks_of_its_steps():
    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import TransportNetwork, TransportTerms

    topology = build_topology(_tp2_replicas(1, 2).scenario.config.cluster)  # 2 hosts of 2 ranks
    group = (0, 1)
    schedule = build_schedule("allreduce", "recursive_doubling", group, 3072, root=None,
                              host_groups=topology.host_groups(group))
    floor_s = 2e-3  # per core turn with every rank busy
    terms = TransportTerms(0.0, 1.0, 1.0, "test", min_message_s=floor_s)

    def cost(copies: int) -> float:
        return TransportNetwork(topology, None, {}, terms, cores=2, copies=copies).time(
            schedule).duration_s

    # one exchange step of 3 turns (enter, send, receive): with a mirror copy all 4 ranks are busy
    assert 3 * floor_s <= cost(2) < 3 * floor_s + 0.5e-3
    assert cost(1) < floor_s  # the group alone: its 2 ranks have the 2 cores


def test_replicas_on_one_machine_share_its_measured_memory_bandwidth():
    from sim.context import ContextTerm, profile_contexts
    from sim.profile import MeasurementKind, Profile, load_profile

    profile = load_profile(ROOT / "validation/plan-check/profile_v2x2_bandwidth.csv")
    rows = profile.rows
    memory = (rows["measurement"] == MeasurementKind.CONTEXT) & (rows["op"] == ContextTerm.MEMORY.value)
    assert profile_contexts(rows)[0].stream_bytes_per_s[:2] == ((1, 23.66e9), (2, 33.71e9))
    without = Profile(rows[~memory])
    scenario = load_scenario(ROOT / "validation/plan-check-report/replicas/scenarios/c15.yaml")  # 2 x 1 rank, 2 cores

    def tpot(of):
        return simulate(scenario, profile=of, expand_steps=()).variants[0].timing["tpot_s"]

    # a core each, but both ranks stream at once: slower than the cores alone say
    assert tpot(profile) > 1.05 * tpot(without)
    alone = load_scenario(ROOT / "validation/plan-check-report/close-call/scenarios/c0.yaml")  # one rank
    assert simulate(alone, profile=profile, expand_steps=()).results.equals(
        simulate(alone, profile=without, expand_steps=()).results)
