"""Shared builders: small scenarios as dicts, so each test states only what it varies."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from sim.scenario import Scenario, scenario_from_dict

ROOT = Path(__file__).resolve().parent.parent


def cluster(num_hosts: int = 2, devices_per_host: int = 2, *, device: str = "rtx_3060_12gb",
            nic: str = "10Gbit/s", nic_latency: str = "10us", memory: str | None = None,
            nic_per_device: bool = False) -> dict:
    """``num_hosts`` hosts under one switch, ``devices_per_host`` devices each on PCIe-like links."""
    devices = {"type": device, "count": devices_per_host}
    if memory:
        devices["memory"] = memory
    host = {"name": "h{i}", "count": num_hosts, "parent": "sw", "nic": {"bandwidth": nic, "latency": nic_latency},
            "nic_per_device": nic_per_device, "devices": devices}
    if devices_per_host > 1:
        host["interconnect"] = {"bandwidth": "16GB/s", "latency": "2us"}
    return {"switches": [{"name": "sw"}], "hosts": [host]}


def scenario_dict(**overrides) -> dict:
    """A small valid scenario (GPT-2 in fp16 on 2 x 2 RTX 3060), with top-level fields overridden."""
    data = {
        "name": "test",
        "model": "gpt2",
        "dtype": "fp16",
        "cluster": cluster(),
        "workload": {"batch_size": 1, "prompt_tokens": 32, "output_tokens": 8},
        "variants": [
            {"name": "rlb", "strategy": "reduce_ln_bcast"},
            {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"},
            {"name": "rd", "strategy": "allreduce_ln", "allreduce": "recursive_doubling"},
        ],
    }
    data.update(copy.deepcopy(overrides))
    return data


def tiny_model_config(model_type: str, num_layers: int) -> dict:
    """A Hugging Face config.json of a tiny model for runtime tests: ``llama`` (GQA: 8 query heads,
    2 KV heads, untied head) or ``gpt2``, hidden size 64, vocabulary 256, fp32."""
    if model_type == "llama":
        return {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8,
                "num_key_value_heads": 2, "num_hidden_layers": num_layers, "vocab_size": 256, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 128, "tie_word_embeddings": False, "torch_dtype": "float32"}
    return {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": num_layers, "vocab_size": 256,
            "n_positions": 128, "n_inner": None, "torch_dtype": "float32"}


def run_cli(main, args, capsys) -> tuple[int, str, str]:
    """``main(args)`` in this process: (exit code, stdout, stderr)."""
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def make_scenario(**overrides) -> Scenario:
    return scenario_from_dict(scenario_dict(**overrides), base_dir=ROOT)


def four_rank_layer(pools: tuple = ()):
    """A 4-rank tensor-parallel ring-allreduce generation on one host (alpha-beta network, roofline
    compute) and an engine over its topology whose ranks share ``pools`` (``sim.cores.CorePool``;
    empty: a core each). Returns ``(result, compute, engine)``; a decoder layer is
    ``result.variants[0].run.simulated[phase].phase.segments[1]``."""
    from sim.cost import RooflineCompute
    from sim.engine import Engine
    from sim.network import NETWORK_MODELS, CollectivePricer
    from sim.simulate import simulate

    result = simulate(make_scenario(cluster=cluster(4, 1), network_model="alpha_beta",
                                    variants=[{"name": "ar", "strategy": "allreduce_ln", "allreduce": "ring"}]))
    config = result.scenario.config
    compute = RooflineCompute(result.scenario.model.dtype, config.compute.flops_efficiency,
                              config.compute.memory_efficiency, config.compute.op_overhead_s)
    pricer = CollectivePricer(NETWORK_MODELS["alpha_beta"](
        result.topology, {d.rank: compute.reduce_s_per_byte(d) for d in result.topology.devices}), result.topology)
    return result, compute, Engine(result.topology, compute, pricer, cores=pools)


@pytest.fixture
def root() -> Path:
    return ROOT
