"""Model specs, the catalog, the Hugging Face config reader and the FLOP / byte accounting."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.accounting import (
    check_tensor_parallel,
    forward_flops,
    head_op_costs,
    kv_cache_bytes_per_token,
    kv_heads_per_rank,
    layer_block_weight_bytes,
    layer_op_costs,
    parameter_count,
    rank_weight_bytes,
)
from models.catalog import CATALOG, HF_REPOSITORIES, PUBLISHED_PARAMETER_COUNTS, get_model, load_hf_config
from models.dtypes import dtype_bytes
from models.errors import ConfigError
from models.ops import OpKind

DATA = Path(__file__).parent / "data"
LAYER_OPS = {
    OpKind.LAYERNORM,
    OpKind.QKV_PROJ,
    OpKind.ATTENTION,
    OpKind.OUT_PROJ,
    OpKind.MLP_UP,
    OpKind.MLP_DOWN,
}


def test_every_catalog_entry_has_a_published_count_and_its_repository():
    assert set(PUBLISHED_PARAMETER_COUNTS) == set(CATALOG) == set(HF_REPOSITORIES)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_parameter_count_matches_published(name):
    assert parameter_count(CATALOG[name]) == pytest.approx(PUBLISHED_PARAMETER_COUNTS[name], rel=0.005)


def test_published_configs_spot_checks():
    llama_70b = get_model("llama-2-70b")
    assert (llama_70b.num_layers, llama_70b.num_kv_heads, llama_70b.head_dim) == (80, 8, 128)
    assert get_model("llama-3.1-8b").vocab_size == 128256
    assert get_model("yi-34b").num_attention_heads == 56
    qwen = get_model("qwen2.5-0.5b")
    assert qwen.tied_embeddings and qwen.attention_bias and not qwen.linear_bias
    gpt2 = get_model("gpt2")
    assert gpt2.learned_position_embeddings and gpt2.norm == "layernorm" and gpt2.mlp == "plain"


def test_get_model_is_case_insensitive_and_lists_known_names():
    assert get_model("Llama-2-7B") is CATALOG["llama-2-7b"]
    with pytest.raises(ConfigError, match=r"^model: unknown model 'gpt-5'; known: gpt2, llama-2-7b") as info:
        get_model("gpt-5")
    assert info.value.field == "model"


@pytest.mark.parametrize("name", ["gpt2", "qwen2.5-0.5b"])
def test_load_hf_config_round_trips_to_the_catalog(name):
    spec = load_hf_config(DATA / f"{name}.config.json")
    assert spec == CATALOG[name]
    assert parameter_count(spec) == PUBLISHED_PARAMETER_COUNTS[name]


def test_load_hf_config_names_a_config_json_after_its_folder(tmp_path):
    folder = tmp_path / "my-qwen"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "qwen2.5-0.5b.config.json").read_text())
    assert load_hf_config(folder / "config.json").name == "my-qwen"


def _write_config(tmp_path, **changes):
    config = json.loads((DATA / "qwen2.5-0.5b.config.json").read_text()) | changes
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def test_load_hf_config_llama_defaults(tmp_path):
    path = _write_config(tmp_path, model_type="llama", num_key_value_heads=None, tie_word_embeddings=None)
    spec = load_hf_config(path)
    assert spec.num_kv_heads == spec.num_attention_heads
    assert not spec.tied_embeddings and not spec.attention_bias and spec.dtype == "bf16"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "bert"}, "unsupported model_type"),
        ({"hidden_size": None}, "missing key 'hidden_size'"),
        ({"torch_dtype": "int8"}, "unsupported torch_dtype"),
        ({"head_dim": 128}, "head_dim"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ],
)
def test_load_hf_config_rejects_bad_configs(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_hf_config(_write_config(tmp_path, **changes))
    assert info.value.field == "model.config"


def test_load_hf_config_rejects_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="nothing.json") as info:
        load_hf_config(tmp_path / "nothing.json")
    assert info.value.field == "model.config"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON") as info:
        load_hf_config(bad)
    assert info.value.field == "model.config"


def test_load_hf_config_reports_bad_values_by_field(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_hf_config(_write_config(tmp_path, num_key_value_heads=3))
    assert info.value.field == "model.num_kv_heads"


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_layers": 0}, "model.num_layers"),
        ({"hidden_size": "4096"}, "model.hidden_size"),
        ({"num_attention_heads": True}, "model.num_attention_heads"),
        ({"num_attention_heads": 33}, "model.num_attention_heads"),
        ({"num_kv_heads": 5}, "model.num_kv_heads"),
        ({"norm": "batchnorm"}, "model.norm"),
        ({"mlp": "moe"}, "model.mlp"),
        ({"tied_embeddings": 1}, "model.tied_embeddings"),
        ({"dtype": "fp8"}, "model.dtype"),
        ({"name": ""}, "model.name"),
    ],
)
def test_model_spec_rejects_bad_fields(changes, field):
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(get_model("llama-2-7b"), **changes)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_dtypes():
    assert dtype_bytes("bf16") == 2
    with pytest.raises(ConfigError, match=r"^dtype: unknown dtype; known: fp32, fp16, bf16 \(got 'fp8'\)$"):
        dtype_bytes("fp8")
    spec = get_model("llama-2-7b").with_dtype("fp32")
    assert spec.dtype_bytes == 4 and spec.num_layers == 32
    with pytest.raises(ConfigError, match="^model.dtype"):
        spec.with_dtype("int4")


def test_kv_cache_bytes_per_token():
    spec = get_model("llama-2-7b")
    assert kv_cache_bytes_per_token(spec) == 2 * 32 * 4096 * 2 == 524288
    assert kv_cache_bytes_per_token(spec, tp_degree=4) == 524288 // 4


def test_kv_heads_replicated_when_tp_exceeds_them():
    spec = get_model("llama-3.1-70b")
    assert kv_heads_per_rank(spec, 4) == 2
    assert kv_heads_per_rank(spec, 16) == 1
    check_tensor_parallel(spec, 16)
    assert kv_cache_bytes_per_token(spec, tp_degree=16) == kv_cache_bytes_per_token(spec, tp_degree=8)


@pytest.mark.parametrize(
    "name, tp, message",
    [
        (
            "llama-2-7b",
            3,
            r"^parallel.tensor: tensor-parallel degree 3 does not divide 32 attention heads; set "
            r"parallel.shares \(compute, memory or a weight per device\) to split them unevenly \(got 3\)$",
        ),
        ("qwen2.5-0.5b", 7, "does not divide the intermediate size 4864"),
        ("llama-2-7b", 0, "must be a positive integer"),
    ],
)
def test_check_tensor_parallel_errors(name, tp, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_tensor_parallel(get_model(name), tp)
    assert info.value.field == "parallel.tensor"


def test_kv_heads_neither_dividing_nor_divided_by_tp():
    spec = dataclasses.replace(get_model("gpt2"), num_kv_heads=4)
    for check in (kv_heads_per_rank, check_tensor_parallel):
        with pytest.raises(ConfigError, match="degree 6 and 4 key-value heads: neither divides") as info:
            check(spec, 6)
        assert info.value.field == "parallel.tensor"


def _replicated_layer_params(spec):
    """Per-layer parameters every rank keeps whole: two norms and the row-parallel biases."""
    norm = spec.hidden_size * (2 if spec.norm == "layernorm" else 1)
    return 2 * norm + (2 * spec.hidden_size if spec.linear_bias else 0)


@pytest.mark.parametrize("name, tp", [("llama-2-7b", 4), ("llama-2-70b", 8), ("qwen2.5-7b", 4), ("gpt2", 12)])
def test_sharded_layer_weights_sum_to_the_whole(name, tp):
    spec = get_model(name)
    whole = sum(layer_block_weight_bytes(spec, 1).values())
    shard = sum(layer_block_weight_bytes(spec, tp).values())
    replicated = _replicated_layer_params(spec) * spec.dtype_bytes
    assert tp * (shard - replicated) == whole - replicated


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_single_rank_master_holds_every_parameter(name):
    spec = CATALOG[name]
    assert rank_weight_bytes(spec, 1, is_master=True) == parameter_count(spec) * spec.dtype_bytes


def test_master_rank_adds_embeddings_and_head_once_if_tied():
    for name in ("qwen2.5-0.5b", "llama-2-7b"):
        spec = get_model(name)
        extra = rank_weight_bytes(spec, 2, is_master=True) - rank_weight_bytes(spec, 2, is_master=False)
        tables = 1 if spec.tied_embeddings else 2
        assert extra == (tables * spec.vocab_size + 1) * spec.hidden_size * spec.dtype_bytes


def _layer_flops(spec, tp, **shape):
    return sum(cost.flops for cost in layer_op_costs(spec, tp_degree=tp, **shape).values())


@pytest.mark.parametrize(
    "shape",
    [
        dict(batch_size=2, new_tokens=128, context_tokens=128),
        dict(batch_size=8, new_tokens=1, context_tokens=1000),
    ],
)
def test_layer_flops_summed_over_ranks_match_one_rank(shape):
    spec = get_model("llama-2-70b")
    costs = layer_op_costs(spec, tp_degree=8, **shape)
    assert set(costs) == LAYER_OPS
    assert 8 * _layer_flops(spec, 8, **shape) == pytest.approx(_layer_flops(spec, 1, **shape), rel=0.01)


def test_prefill_flops_per_token_are_about_twice_the_parameters():
    spec = get_model("llama-2-7b")
    tokens = 128
    layers = spec.num_layers * _layer_flops(spec, 1, batch_size=1, new_tokens=tokens, context_tokens=tokens)
    head = sum(cost.flops for cost in head_op_costs(spec, batch_size=1, new_tokens=tokens).values())
    total = layers + head
    assert total / tokens == pytest.approx(2 * parameter_count(spec), rel=0.05)
    assert total == pytest.approx(forward_flops(spec, tokens), rel=0.05)


def test_attention_counts_causal_pairs():
    spec = get_model("llama-2-7b")
    d, heads = spec.head_dim, spec.num_attention_heads
    prefill = layer_op_costs(spec, tp_degree=1, batch_size=1, new_tokens=4, context_tokens=4)
    decode = layer_op_costs(spec, tp_degree=1, batch_size=1, new_tokens=1, context_tokens=4)
    assert prefill[OpKind.ATTENTION].flops == heads * 10 * (4 * d + 5)  # 4 + 3 + 2 + 1 pairs
    assert decode[OpKind.ATTENTION].flops == heads * 4 * (4 * d + 5)


def test_decode_attention_reads_the_cache_and_eager_materialises_scores():
    spec = get_model("llama-3.1-8b").with_attention("eager")
    tp, batch, context = 2, 4, 1000
    costs = layer_op_costs(spec, tp_degree=tp, batch_size=batch, new_tokens=1, context_tokens=context)
    cost = costs[OpKind.ATTENTION]
    per_token_cache = kv_cache_bytes_per_token(spec, tp) // spec.num_layers
    query = batch * spec.hidden_size // tp * 2
    assert cost.bytes_read == batch * context * per_token_cache + query
    assert cost.bytes_written == batch * per_token_cache + query
    # bf16 scores, their fp32 copy and fp32 probabilities; three query-sized tensors
    assert cost.workspace_bytes == batch * spec.num_attention_heads // tp * context * (2 + 4 + 4) + 3 * query
    assert cost.weight_bytes == 0


def test_fused_attention_holds_one_statistic_per_query_row_not_the_scores():
    # FlashAttention (arXiv 2205.14135) keeps an fp32 logsumexp per row: memory linear in the prompt.
    spec = get_model("llama-3.1-8b")
    assert spec.attention == "sdpa"
    tp, batch, prompt = 2, 4, 8192
    sdpa = layer_op_costs(spec, tp_degree=tp, batch_size=batch, new_tokens=prompt, context_tokens=prompt)
    eager = layer_op_costs(spec.with_attention("eager"), tp_degree=tp, batch_size=batch, new_tokens=prompt,
                           context_tokens=prompt)
    heads, output = spec.num_attention_heads // tp, batch * prompt * spec.hidden_size // tp * 2
    assert sdpa[OpKind.ATTENTION].workspace_bytes == batch * heads * prompt * 4 + 3 * output
    assert eager[OpKind.ATTENTION].workspace_bytes == batch * heads * prompt * prompt * (2 + 4 + 4) + 3 * output
    # Only memory differs: the same arithmetic and traffic price both.
    assert sdpa[OpKind.ATTENTION].flops == eager[OpKind.ATTENTION].flops
    assert sdpa[OpKind.ATTENTION].bytes_read == eager[OpKind.ATTENTION].bytes_read


def test_an_unknown_attention_kernel_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="model.attention.*sdpa, eager.*flash3"):
        get_model("gpt2").with_attention("flash3")


def test_layer_op_weights_add_up_to_the_layer_blocks():
    spec = get_model("gpt2")
    costs = layer_op_costs(spec, tp_degree=4, batch_size=1, new_tokens=1, context_tokens=1)
    blocks = layer_block_weight_bytes(spec, 4)
    # The plan runs LAYERNORM twice per layer, once per block.
    op_weights = sum(cost.weight_bytes for cost in costs.values()) + costs[OpKind.LAYERNORM].weight_bytes
    assert op_weights == sum(blocks.values())


def test_head_ops():
    spec = get_model("gpt2")
    costs = head_op_costs(spec, batch_size=3, new_tokens=5)
    assert set(costs) == {OpKind.EMBEDDING, OpKind.LAYERNORM, OpKind.LM_HEAD}
    h, b = spec.hidden_size, spec.dtype_bytes
    assert costs[OpKind.LM_HEAD].flops == 2 * 3 * h * spec.vocab_size
    assert costs[OpKind.LM_HEAD].bytes_written == 3 * spec.vocab_size * b
    assert costs[OpKind.EMBEDDING].bytes_read == 2 * 15 * h * b  # token and position rows
    assert costs[OpKind.EMBEDDING].weight_bytes == (spec.vocab_size + 1024) * h * b


@pytest.mark.parametrize(
    "shape, field",
    [
        (dict(batch_size=0, new_tokens=1, context_tokens=1), "batch_size"),
        (dict(batch_size=1, new_tokens=0, context_tokens=1), "new_tokens"),
        (dict(batch_size=1, new_tokens=8, context_tokens=4), "context_tokens"),
    ],
)
def test_layer_op_costs_reject_bad_shapes(shape, field):
    with pytest.raises(ConfigError) as info:
        layer_op_costs(get_model("gpt2"), tp_degree=1, **shape)
    assert info.value.field == field


def test_models_never_imports_torch_or_sim():
    code = (
        "import sys, models.accounting, models.catalog; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'sim')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
