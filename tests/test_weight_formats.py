"""Quantised weights (``weights: q8_0 | q6_k | q4_0``, ggml's blocks): the bytes a device holds and
reads, and the dequantising pass llama.cpp's CUDA backend ran before large products."""

from __future__ import annotations

import pytest

from models.accounting import layer_op_costs, rank_weight_bytes, stage_weight_bytes
from models.catalog import get_model
from models.errors import ConfigError
from models.weight_formats import WeightFormat, head_format, matrix_bytes, use_more_bits
from sim.profile import load_profile
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import cluster, scenario_dict

GIB = 2 ** 30


@pytest.mark.parametrize("model, weights, printed_gib", [
    # ggml-org/llama.cpp pull request #4766 (ggerganov, 2024-01-10): "llama 7B F16 | 12.55 GiB",
    # "llama 7B Q8_0 | 6.67 GiB", "llama 7B Q4_0 | 3.56 GiB" (the Q4_0 file's LM head is Q6_K)
    ("llama-2-7b", "native", 12.55), ("llama-2-7b", "q8_0", 6.67), ("llama-2-7b", "q4_0", 3.56),
    # geerlingguy/ai-benchmarks issue #53: "llama 3B Q4_K - Medium | 1.87 GiB | 3.21 B", a mix of
    # q4_k and q6_k by llama.cpp's use_more_bits, its tied embedding in q6_k
    ("llama-3.2-3b", "q4_k_m", 1.87),
    # geerlingguy/ai-benchmarks issue #21: "llama 70B Q4_K - Medium | 39.59 GiB | 70.55 B", whose
    # other value projections a 70B file raises to q5_k
    ("llama-3.1-70b", "q4_k_m", 39.59),
])
def test_a_model_takes_the_size_llama_bench_prints_for_its_file(model, weights, printed_gib):
    spec = get_model(model).with_dtype("fp16").with_weights(weights)
    assert round(rank_weight_bytes(spec, 1, is_master=True) / GIB, 2) == printed_gib


def test_the_m_mixes_raise_the_value_and_down_projections_of_about_half_the_layers():
    # llama.cpp's use_more_bits over 32 layers: the first and last 4, and every third between
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    spec = get_model("llama-2-7b")
    mixed, flat = spec.with_weights("q4_k_m"), spec.with_weights("q4_k")
    step = dict(tp_degree=1, batch_size=1, new_tokens=1, context_tokens=8)
    down, up = layer_op_costs(mixed, **step)["mlp_down"], layer_op_costs(mixed, **step)["mlp_up"]
    assert down.weight_bytes > layer_op_costs(flat, **step)["mlp_down"].weight_bytes
    assert up.weight_bytes == layer_op_costs(flat, **step)["mlp_up"].weight_bytes


def test_blocks_round_up_and_the_head_is_raised_to_q6_k_except_in_q8_0_files():
    assert matrix_bytes(64, WeightFormat.Q4_0, 2) == 36 and matrix_bytes(33, WeightFormat.Q4_0, 2) == 36
    assert matrix_bytes(256, WeightFormat.Q6_K, 2) == 210 and matrix_bytes(10, WeightFormat.NATIVE, 2) == 20
    assert head_format(WeightFormat.Q4_0) == WeightFormat.Q6_K
    assert head_format(WeightFormat.Q8_0) == WeightFormat.Q8_0


def test_a_pipeline_splits_the_quantised_model_without_losing_or_adding_a_byte():
    spec = get_model("llama-2-7b").with_weights("q4_0")
    whole = rank_weight_bytes(spec, 1, is_master=True)
    first = stage_weight_bytes(spec, 1, 16, embeds=True, heads=False)
    last = stage_weight_bytes(spec, 1, 16, embeds=False, heads=True)
    assert first + last == whole


def test_a_decoded_token_reads_the_blocks_and_a_long_prompt_dequantises_them_first():
    dense, quantised = get_model("llama-2-7b"), get_model("llama-2-7b").with_weights("q8_0")
    h = dense.hidden_size
    stored = matrix_bytes(h * 3 * h, WeightFormat.Q8_0, 2)  # q, k and v of one layer
    step = layer_op_costs(quantised, tp_degree=1, batch_size=1, new_tokens=1, context_tokens=8)
    assert step["qkv_proj"].bytes_read == stored + h * 2 and step["qkv_proj"].prepass_bytes == 0
    # at 32 tokens the product still reads the blocks (MMQ_MAX_BATCH_SIZE); above, a pass converts
    # the matrix to fp16 (blocks read, dense copy written) and the product reads the dense copy
    assert layer_op_costs(quantised, tp_degree=1, batch_size=1, new_tokens=32,
                          context_tokens=32)["qkv_proj"].prepass_bytes == 0
    prompt = layer_op_costs(quantised, tp_degree=1, batch_size=1, new_tokens=512, context_tokens=512)
    same_dense = layer_op_costs(dense, tp_degree=1, batch_size=1, new_tokens=512, context_tokens=512)
    assert prompt["qkv_proj"].prepass_bytes == stored + h * 3 * h * 2
    assert prompt["qkv_proj"].bytes_read == same_dense["qkv_proj"].bytes_read
    direct = quantised.with_weights("q8_0", "direct")
    assert layer_op_costs(direct, tp_degree=1, batch_size=1, new_tokens=512,
                          context_tokens=512)["qkv_proj"].prepass_bytes == 0


def _timing(**fields) -> dict:
    data = scenario_dict(model="llama-2-7b", dtype="fp16", cluster=cluster(1, 1, device="rtx_4090"),
                         workload={"batch_size": 1, "prompt_tokens": 512, "output_tokens": 8},
                         variants=[{"name": "tp1", "strategy": "allreduce_ln", "allreduce": "ring"}], **fields)
    return simulate(scenario_from_dict(data)).variants[0].timing


def test_quantised_decode_is_faster_and_a_dequantising_prefill_slower_than_fp16():
    dense, q4, q4_direct = _timing(), _timing(weights="q4_0"), _timing(weights="q4_0", quantised_matmul="direct")
    # decode reads the weights: 3.5 times fewer bytes (the ops' fixed overheads stay)
    assert dense["tpot_s"] / q4["tpot_s"] > 2.5
    # the prompt's products are bound by their FLOPs; the dequantising pass comes on top of them
    assert q4["ttft_s"] > dense["ttft_s"]
    assert q4_direct["ttft_s"] < q4["ttft_s"]


def test_the_simulation_says_how_it_priced_the_weights():
    data = scenario_dict(model="llama-2-7b", weights="q4_0", cluster=cluster(1, 1, device="rtx_4090"),
                         variants=[{"name": "tp1", "strategy": "allreduce_ln", "allreduce": "ring"}])
    lines = simulate(scenario_from_dict(data)).network.sources
    assert any(line.startswith("weights: q4_0, 18 bytes per 32 weights") and "q6_k" in line for line in lines)


def test_a_seventy_billion_model_fits_two_24_gib_cards_only_quantised():
    def peak_gib(weights: str) -> float:
        data = scenario_dict(model="llama-2-70b", cluster=cluster(1, 2, device="rtx_4090"), weights=weights,
                             workload={"batch_size": 1, "prompt_tokens": 64, "output_tokens": 2},
                             variants=[{"name": "tp2", "strategy": "allreduce_ln", "allreduce": "ring"}])
        results = simulate(scenario_from_dict(data)).results
        return results[results["metric"] == "peak_memory_bytes"]["value"].max() / GIB

    assert peak_gib("q4_0") < 24 < peak_gib("native")


@pytest.mark.parametrize("fields, field", [
    ({"weights": "q3_k"}, "weights"),
    ({"weights": 4}, "weights"),
    ({"weights": "q4_0", "quantised_matmul": "fast"}, "quantised_matmul"),
    ({"quantised_matmul": "direct"}, "quantised_matmul"),  # native weights: nothing to read so
])
def test_an_unknown_format_or_product_names_the_field(fields, field):
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(scenario_dict(**fields))
    assert error.value.field == field


def test_training_and_a_calibration_profile_refuse_quantised_weights(root):
    training = scenario_dict(weights="q4_0", variants=[{"name": "ddp"}],
                             workload={"kind": "training", "global_batch_size": 4, "micro_batch_size": 1,
                                       "sequence_length": 16})
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(training)
    assert error.value.field == "weights" and "training" in error.value.message
    # a profile times the runtime's dense kernels: never replayed for blocks it did not run
    profile = load_profile(root / "validation/report/profiles/v2x2_bandwidth.csv")
    with pytest.raises(ConfigError) as error:
        simulate(scenario_from_dict(scenario_dict(weights="q8_0")), profile=profile)
    assert error.value.field == "weights" and "profile" in error.value.message


@pytest.mark.parametrize("field, value", [("weights", "q8_0"), ("kv_cache", "fp8")])
def test_the_runtime_refuses_to_measure_weights_or_a_cache_it_does_not_run(field, value):
    pytest.importorskip("torch")
    from runtime.measure import launch_scenario

    with pytest.raises(ConfigError) as error:
        launch_scenario(scenario_from_dict(scenario_dict(**{field: value})), lambda *a: None,
                        testbed=False, hang_timeout_s=1.0)
    assert error.value.field == field and f"'{value}'" in error.value.message


def test_the_planner_fits_a_quantised_model_on_fewer_cards_and_its_pick_simulates_quantised():
    from sim.planning.outcome import plan
    from sim.planning.plan_config import plan_from_dict

    def pick(weights: str):
        request = plan_from_dict({
            "name": "home_13b", "models": ["llama-2-13b"], "dtype": "fp16", "weights": weights,
            "workload": {"batch_size": 1, "prompt_tokens": 128, "output_tokens": 8}, "slo": {"tpot": "1s"},
            "search": {"devices": ["rtx_3060_12gb"], "devices_per_host": [1, 2, 4], "hosts": [1],
                       "networks": ["eth10g"], "variants": [{"name": "ring", "strategy": "allreduce_ln",
                                                               "allreduce": "ring"}]}})
        return plan(request)

    dense, quantised = pick("native"), pick("q4_0")
    # 26 GB of fp16 weights need more than two 12 GB cards; 7.3 GB of q4_0 blocks fit on one
    assert quantised.pick["price_per_hour"] < dense.pick["price_per_hour"]
    assert quantised.pick_scenario["weights"] == "q4_0"
    assert simulate(scenario_from_dict(quantised.pick_scenario)).scenario.model.weights == WeightFormat.Q4_0


def test_a_grid_sweeps_the_weights_like_any_other_field(tmp_path):
    import pandas as pd

    from sim.grid import evaluate_point, grid_points, load_grid
    from sim.metrics import RESULT_COLUMNS

    (tmp_path / "grid.yaml").write_text("axes:\n  weights: [native, q8_0, q4_k_m]\n")
    base = scenario_dict(model="llama-2-7b", cluster=cluster(1, 1, device="rtx_4090"),
                         workload={"batch_size": 1, "prompt_tokens": 16, "output_tokens": 4},
                         variants=[{"name": "tp1", "strategy": "allreduce_ln", "allreduce": "ring"}])
    points = grid_points(base, load_grid(tmp_path / "grid.yaml"))
    assert [p.scenario.model.weights for p in points] == ["native", "q8_0", "q4_k_m"]
    assert len({p.key for p in points}) == 3
    def tpot(point) -> float:
        rows = pd.DataFrame(evaluate_point(point.scenario).rows, columns=RESULT_COLUMNS)
        return rows.loc[rows["metric"] == "tpot_s", "value"].iloc[0]

    native, q8_0, q4_k_m = (tpot(p) for p in points)
    assert native > q8_0 > q4_k_m
