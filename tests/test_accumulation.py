"""``compute.accumulation``: fp16 products accumulated in fp16 (llama.cpp's cuBLAS path) run at the
GeForce tensor cores' doubled rate; PyTorch's fp32 accumulation, the default, at the catalog's."""

from __future__ import annotations

import pytest

from models.errors import ConfigError
from sim.cost import RooflineCompute
from sim.devices import get_device
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import cluster, scenario_dict


def _timing(device: str, dtype: str = "fp16", **compute) -> dict:
    data = scenario_dict(model="llama-2-7b", dtype=dtype, cluster=cluster(1, 1, device=device),
                         workload={"batch_size": 1, "prompt_tokens": 512, "output_tokens": 4},
                         variants=[{"name": "tp1", "strategy": "allreduce_ln", "allreduce": "ring"}],
                         **({"compute": compute} if compute else {}))
    return simulate(scenario_from_dict(data)).variants[0].timing


def test_fp16_accumulation_doubles_a_geforce_cards_matrix_rate_and_nothing_else():
    spec = get_device("rtx_4090")
    assert spec.peak_flops("fp16", accumulation="fp16") == 330.3e12  # the whitepaper rounds 2 x 165.2
    assert spec.peak_flops("bf16", accumulation="fp16") == spec.peak_flops("bf16")  # bf16 sums in fp32
    fast, default = _timing("rtx_4090", accumulation="fp16"), _timing("rtx_4090")
    # a 512-token prefill is bound by its products; a decode step by reading the weights
    assert fast["ttft_s"] < 0.6 * default["ttft_s"]
    assert fast["tpot_s"] == pytest.approx(default["tpot_s"], rel=1e-9)
    # a data-centre part runs both accumulations at one rate; bf16 ignores the setting
    assert _timing("a100_80gb", accumulation="fp16") == _timing("a100_80gb")
    assert _timing("rtx_4090", "bf16", accumulation="fp16") == _timing("rtx_4090", "bf16")


def test_the_simulation_says_which_rate_it_priced():
    compute = RooflineCompute("fp16", 0.6, 0.8, 5e-6, accumulation="fp16")
    lines = compute.accumulation_lines([get_device("rtx_3060_12gb"), get_device("a100_80gb")])
    assert "51 TFLOP/s peak against 25.5 with fp32 accumulation" in lines[1]
    assert "at its fp16 peak" in lines[0]
    assert RooflineCompute("fp16", 0.6, 0.8, 5e-6).accumulation_lines([get_device("rtx_4090")]) == ()


def test_an_unknown_accumulation_names_the_field():
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(scenario_dict(compute={"accumulation": "fp8"}))
    assert error.value.field == "compute.accumulation" and "fp8" in error.value.message


def test_the_runtime_refuses_to_measure_what_torch_does_not_run():
    pytest.importorskip("torch")
    from runtime.measure import launch_scenario

    with pytest.raises(ConfigError) as error:
        launch_scenario(scenario_from_dict(scenario_dict(compute={"accumulation": "fp16"})), lambda *a: None,
                        testbed=False, hang_timeout_s=1.0)
    assert error.value.field == "compute.accumulation" and "'fp16'" in error.value.message
