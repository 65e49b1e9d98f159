"""The runtime's model shards (runtime/model.py, runtime/weights.py) against an unsharded reference.

Small specs cover each architecture feature the runtime implements: GPT-2's LayerNorm, GELU MLP,
learned positions and linear biases; Qwen2's q/k/v biases and tied head with grouped-query
attention; Llama's untied head, SwiGLU and (optional) biases; multi-query attention. Tensor-parallel
degrees include those that replicate KV heads (tp above the KV heads).
"""

import dataclasses
from functools import cache

import pytest

from models.accounting import rank_weight_bytes
from models.catalog import get_model
from models.errors import ConfigError
from models.spec import ModelSpec

# torch is an optional dependency (the runtime extra); without it the suite skips this module.
torch = pytest.importorskip("torch")

from runtime.model import (  # noqa: E402
    RankModel,
    prompt_tokens,
    reference_generate,
    seeded_tensor,
    seeded_weights,
    tensor_parallel_generate,
)
from runtime.weights import family_of, weight_shapes  # noqa: E402

SEED = 7
BATCH, PROMPT, OUTPUT = 2, 6, 4


def _tiny(name: str, **fields) -> ModelSpec:
    """A small Llama-shaped spec; the fields given override it."""
    base = dict(name=name, num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=4,
                intermediate_size=128, vocab_size=256, norm="rmsnorm", mlp="gated", tied_embeddings=False,
                attention_bias=False, linear_bias=False, learned_position_embeddings=False,
                max_position_embeddings=64, dtype="bf16")
    return ModelSpec(**(base | fields))


SPECS = {
    "gpt2": _tiny("gpt2-tiny", hidden_size=64, num_attention_heads=4, num_kv_heads=4, intermediate_size=256,
                        norm="layernorm", mlp="plain", tied_embeddings=True, attention_bias=True, linear_bias=True,
                        learned_position_embeddings=True, max_position_embeddings=32, dtype="fp32"),
    "qwen": _tiny("qwen2.5-tiny", hidden_size=128, num_kv_heads=2, intermediate_size=256,
                        tied_embeddings=True, attention_bias=True),
    "llama3": _tiny("llama-3.1-tiny", attention_bias=True, linear_bias=True),
    "llama2-mqa": _tiny("llama-2-tiny", num_layers=3, num_attention_heads=4, num_kv_heads=1, dtype="fp16"),
}
# (spec, tp): qwen at tp 4 and llama3 at tp 8 replicate KV heads, as does every tp > 1 with MQA.
CASES = [(name, tp) for name in SPECS for tp in (1, 2, 4)] + [("llama3", 8)]


@cache
def _reference(name: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    spec = SPECS[name]
    tokens, hiddens = reference_generate(spec, seed=SEED, prompt=_prompt(spec), output_tokens=OUTPUT)
    return tokens, tuple(hiddens)


def _prompt(spec: ModelSpec) -> torch.Tensor:
    return prompt_tokens(spec, BATCH, PROMPT, SEED)


def _assert_same_generation(actual, expected) -> None:
    (tokens, hiddens), (ref_tokens, ref_hiddens) = actual, expected
    assert torch.equal(tokens, ref_tokens)
    assert len(hiddens) == len(ref_hiddens)
    for step, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert h.shape == ref.shape
        error = ((h - ref).norm() / ref.norm()).item()
        assert error < 1e-4, f"step {step}: relative error {error:.2e}"


@pytest.mark.parametrize("name,tp", CASES)
def test_tensor_parallel_matches_the_reference(name, tp):
    spec = SPECS[name]
    result = tensor_parallel_generate(spec, tp, seed=SEED, prompt=_prompt(spec), output_tokens=OUTPUT)
    _assert_same_generation(result, _reference(name))


def test_bfloat16_matches_the_reference_to_its_precision():
    spec = SPECS["qwen"]
    kwargs = dict(seed=SEED, prompt=_prompt(spec), output_tokens=OUTPUT, dtype=torch.bfloat16)
    tokens, hiddens = tensor_parallel_generate(spec, 4, **kwargs)
    ref_tokens, ref_hiddens = reference_generate(spec, **kwargs)
    assert torch.equal(tokens, ref_tokens)
    for h, ref in zip(hiddens, ref_hiddens):
        assert h.dtype == torch.bfloat16
        assert ((h.float() - ref.float()).norm() / ref.float().norm()) < 2e-2  # bf16 keeps 8 bits


def test_reference_output_shapes():
    tokens, hiddens = _reference("llama3")
    spec = SPECS["llama3"]
    assert tokens.shape == (BATCH, OUTPUT) and tokens.dtype == torch.int64
    assert [h.shape for h in hiddens] == [(BATCH, spec.hidden_size)] * OUTPUT
    assert 0 <= tokens.min() and tokens.max() < spec.vocab_size


GPT2_TWO_LAYERS = dataclasses.replace(get_model("gpt2"), num_layers=2)


@cache
def _gpt2_reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    return reference_generate(GPT2_TWO_LAYERS, seed=SEED, prompt=_prompt(GPT2_TWO_LAYERS), output_tokens=3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_catalog_gpt2_with_two_layers_matches_the_reference(tp):
    result = tensor_parallel_generate(GPT2_TWO_LAYERS, tp, seed=SEED, prompt=_prompt(GPT2_TWO_LAYERS),
                                      output_tokens=3)
    _assert_same_generation(result, _gpt2_reference())


@pytest.mark.parametrize("name,tp", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_match_the_accounting(name, tp, dtype):
    spec = SPECS[name]
    scale = torch.tensor([], dtype=dtype).element_size() / spec.dtype_bytes
    for rank in range(tp):
        model = RankModel(spec, tp, rank, seed=SEED, batch_size=1, max_tokens=4, dtype=dtype)
        assert model.weight_bytes == rank_weight_bytes(spec, tp, is_master=rank == 0) * scale


def test_replicated_kv_heads_follow_their_query_heads():
    spec = SPECS["qwen"]  # 8 query heads, 2 KV heads: at tp 4, ranks 0-1 use KV head 0, ranks 2-3 KV head 1
    d, full_k = spec.head_dim, seeded_tensor(spec, SEED, "layers.1.k_proj.weight")
    for rank in range(4):
        model = RankModel(spec, 4, rank, seed=SEED, batch_size=1, max_tokens=4)
        q_width = spec.num_attention_heads // 4 * d
        local_k = model.weights["layers.1.qkv_proj.weight"][q_width:q_width + d]
        assert torch.equal(local_k, full_k[rank // 2 * d:(rank // 2 + 1) * d])
        assert model.k_cache[1].shape == (1, 1, 4, d)


def test_seeded_weights_are_deterministic_and_depend_on_the_seed():
    spec = SPECS["qwen"]
    first, again, other = seeded_weights(spec, 1), seeded_weights(spec, 1), seeded_weights(spec, 2)
    assert list(first) == list(weight_shapes(spec))
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(torch.equal(first[n], seeded_tensor(spec, 1, n)) for n in first)
    drawn = [n for n in first if "_norm." not in n]
    assert not any(torch.equal(first[n], other[n]) for n in drawn)
    assert all(first[n].shape == shape for n, shape in weight_shapes(spec).items())
    assert torch.equal(first["final_norm.weight"], torch.ones(spec.hidden_size))
    assert 0.018 < first["layers.0.q_proj.weight"].std() < 0.022
    assert torch.equal(seeded_tensor(spec, 1, "embed.weight", torch.bfloat16), first["embed.weight"].bfloat16())


def test_seeded_values_are_pinned():
    # Seeds come from hashlib, not Python's salted hash: these values hold in every process.
    spec = get_model("qwen2.5-0.5b")
    expected = torch.tensor([0.012861771509051323, 0.02753664180636406, 0.027728671208024025, 0.02258414961397648])
    assert torch.equal(seeded_tensor(spec, 0, "layers.3.k_proj.bias")[:4], expected)
    assert prompt_tokens(spec, 2, 4, 0).tolist() == [[75425, 602, 19966, 10991], [99930, 15470, 130382, 77117]]


def test_family_constants_follow_the_model_name():
    assert (family_of(get_model("qwen2.5-7b")).norm_eps, family_of(get_model("qwen2.5-7b")).rope_theta) == (1e-6, 1e6)
    assert family_of(get_model("llama-2-70b")).rope_theta == 10_000.0
    assert family_of(get_model("llama-3.1-8b")).rope_theta == 500_000.0
    assert family_of(get_model("gpt2")).norm_eps == 1e-5
    unknown = dataclasses.replace(get_model("llama-2-7b"), name="my-model")
    assert (family_of(unknown).norm_eps, family_of(unknown).rope_theta) == (1e-6, 10_000.0)


def test_reset_cache_zeroes_it():
    spec = SPECS["llama3"]
    model = RankModel(spec, 2, 1, seed=SEED, batch_size=BATCH, max_tokens=8)
    x = torch.randn(BATCH, 3, spec.hidden_size)
    model.attention(*model.qkv_proj(model.norm(x, 0, "attn"), 0), 0, start_pos=0)
    assert model.k_cache[0][:, :, :3].abs().sum() > 0
    model.reset_cache()
    assert all(not c.any() for c in model.k_cache + model.v_cache)


def test_misuse_raises():
    spec = SPECS["llama3"]
    worker = RankModel(spec, 2, 1, seed=SEED, batch_size=1, max_tokens=4)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="master"):
        worker.embedding(tokens, 0)
    with pytest.raises(RuntimeError, match="master"):
        worker.lm_head(torch.zeros(1, spec.hidden_size))
    with pytest.raises(RuntimeError, match="master"):
        worker.norm(torch.zeros(1, 1, spec.hidden_size), None, "final")
    with pytest.raises(ValueError, match="norm must be one of"):
        worker.norm(torch.zeros(1, 1, spec.hidden_size), 0, "ffn")
    with pytest.raises(ValueError, match="outside"):
        worker.attention(*worker.qkv_proj(torch.zeros(1, 2, spec.hidden_size), 0), 0, start_pos=3)
    with pytest.raises(ConfigError, match="parallel.tensor"):
        RankModel(spec, 3, 0, seed=SEED, batch_size=1, max_tokens=4)
    with pytest.raises(ValueError, match="rank index"):
        RankModel(spec, 2, 2, seed=SEED, batch_size=1, max_tokens=4)
    with pytest.raises(ValueError, match="positions"):
        RankModel(spec, 2, 0, seed=SEED, batch_size=1, max_tokens=spec.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="output tokens"):
        reference_generate(spec, seed=SEED, prompt=tokens, output_tokens=0)
    with pytest.raises(ValueError, match="not a tensor"):
        seeded_tensor(spec, SEED, "layers.9.q_proj.weight")
