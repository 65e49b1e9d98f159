"""Synthetic, seeded weights and prompts, and the hyperparameters a :class:`ModelSpec` leaves out.

The runtime measures time and memory, not quality, so it runs on random weights instead of
checkpoints. Each tensor is drawn from its own ``torch.Generator`` whose seed is derived from the
run seed and the tensor's name with hashlib (never Python's salted ``hash``), so a rank can draw
exactly the tensors it shards, in any order, and every process and run gets the same bytes.
Values are always drawn in fp32 on the CPU and then cast: the same seed gives the same model in
every dtype and on every device.
"""

import hashlib
from dataclasses import dataclass

import torch

from models.spec import ModelSpec

_INIT_STD = 0.02  # GPT-2's and Llama's initializer_range


@dataclass(frozen=True)
class Family:
    """What a model family's Hugging Face ``config.json`` sets beyond :class:`ModelSpec`.

    ``norm_eps``: the epsilon of LayerNorm (``layer_norm_epsilon``) or RMSNorm (``rms_norm_eps``).
    ``rope_theta``: the base of the rotary frequencies (Su et al. 2021, arXiv 2104.09864; HF
    ``LlamaRotaryEmbedding``), used only by models without learned position embeddings.
    """

    prefix: str
    norm_eps: float
    rope_theta: float = 10_000.0


# Keyed by the prefix of ModelSpec.name; each value transcribes the config.json of the repository
# named. Llama 3.1's "llama3" rope_scaling (a frequency remap beyond 8192 tokens) is not applied:
# it changes values, not cost, and the weights are synthetic anyway.
FAMILIES: tuple[Family, ...] = (
    Family("gpt2", norm_eps=1e-5),  # openai-community/gpt2
    Family("llama-2", norm_eps=1e-5, rope_theta=10_000.0),  # meta-llama/Llama-2-7b-hf
    Family("llama-3", norm_eps=1e-5, rope_theta=500_000.0),  # meta-llama/Llama-3.1-8B
    Family("yi", norm_eps=1e-5, rope_theta=5_000_000.0),  # 01-ai/Yi-34B
    Family("qwen2", norm_eps=1e-6, rope_theta=1_000_000.0),  # Qwen/Qwen2.5-0.5B
)
# Names outside the table (a config.json read from disk) get the transformers defaults:
# GPT2Config.layer_norm_epsilon, LlamaConfig.rms_norm_eps and LlamaConfig.rope_theta.
_DEFAULT_FAMILY = {"layernorm": Family("", norm_eps=1e-5), "rmsnorm": Family("", norm_eps=1e-6)}


def family_of(spec: ModelSpec) -> Family:
    """The first entry of :data:`FAMILIES` whose prefix starts ``spec.name`` (case-insensitive),
    else the transformers defaults for ``spec.norm``."""
    name = spec.name.lower()
    return next((f for f in FAMILIES if name.startswith(f.prefix)), _DEFAULT_FAMILY[spec.norm])


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor of the full (unsharded) model, in load order.

    Linear weights are ``[out_features, in_features]`` as in ``torch.nn.Linear``. Names:
    ``embed.weight`` ``[vocab, hidden]``; ``pos_embed.weight`` ``[max_positions, hidden]`` (learned
    positions only); per layer ``i``: ``layers.i.attn_norm.{weight,bias}``,
    ``layers.i.{q,k,v}_proj.{weight,bias}``, ``layers.i.o_proj.{weight,bias}``,
    ``layers.i.mlp_norm.{weight,bias}``, ``layers.i.gate_proj.{weight,bias}`` (gated MLP only),
    ``layers.i.up_proj.{weight,bias}``, ``layers.i.down_proj.{weight,bias}``; then
    ``final_norm.{weight,bias}`` and ``lm_head.weight`` (untied only). Norm biases exist for
    LayerNorm only, q/k/v biases with ``attention_bias``, o_proj and MLP biases with ``linear_bias``.
    """
    h, d = spec.hidden_size, spec.head_dim
    q_width, kv_width, inter = spec.num_attention_heads * d, spec.num_kv_heads * d, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (spec.vocab_size, h)}
    if spec.learned_position_embeddings:
        shapes["pos_embed.weight"] = (spec.max_position_embeddings, h)

    def norm(name: str) -> None:
        shapes[f"{name}.weight"] = (h,)
        if spec.norm == "layernorm":
            shapes[f"{name}.bias"] = (h,)

    def linear(name: str, out_features: int, in_features: int, bias: bool) -> None:
        shapes[f"{name}.weight"] = (out_features, in_features)
        if bias:
            shapes[f"{name}.bias"] = (out_features,)

    for i in range(spec.num_layers):
        norm(f"layers.{i}.attn_norm")
        for proj, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            linear(f"layers.{i}.{proj}", width, h, spec.attention_bias)
        linear(f"layers.{i}.o_proj", h, q_width, spec.linear_bias)
        norm(f"layers.{i}.mlp_norm")
        if spec.mlp == "gated":
            linear(f"layers.{i}.gate_proj", inter, h, spec.linear_bias)
        linear(f"layers.{i}.up_proj", inter, h, spec.linear_bias)
        linear(f"layers.{i}.down_proj", h, inter, spec.linear_bias)
    norm("final_norm")
    if not spec.tied_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


# The decoder-layer modules of each streamed weight block (sim.plan.WeightBlock.part), under both
# the names of weight_shapes and RankModel's fused ones; the split is that of
# models.accounting.layer_block_weight_bytes.
BLOCK_PARTS = ("attention", "mlp")
_PART_OF_MODULE = {
    "attn_norm": "attention", "q_proj": "attention", "k_proj": "attention", "v_proj": "attention",
    "qkv_proj": "attention", "o_proj": "attention",
    "mlp_norm": "mlp", "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "down_proj": "mlp",
}


def block_of(name: str) -> str | None:
    """The weight block (``"layer3.mlp"``, :attr:`sim.plan.WeightBlock.name`) that tensor ``name``
    (``"layers.3.down_proj.weight"``) belongs to, or None for the embeddings, final norm and LM head."""
    parts = name.split(".")
    if parts[0] != "layers":
        return None
    return f"layer{parts[1]}.{_PART_OF_MODULE[parts[2]]}"


def block_names(spec: ModelSpec) -> tuple[str, ...]:
    """Every weight block of ``spec`` in order of use: ``layer0.attention, layer0.mlp, layer1...``."""
    return tuple(f"layer{i}.{part}" for i in range(spec.num_layers) for part in BLOCK_PARTS)


def seeded_tensor(spec: ModelSpec, seed: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One tensor of :func:`seeded_weights`, drawn alone, on the CPU, in ``dtype``.

    Norm gains are ones and norm biases zeros (a freshly initialised LayerNorm / RMSNorm); every
    other tensor, biases included, is drawn from N(0, 0.02^2). Raises ``ValueError`` if ``name``
    is not a tensor of ``spec`` (see :func:`weight_shapes`).
    """
    shape = weight_shapes(spec).get(name)
    if shape is None:
        raise ValueError(f"{name!r} is not a tensor of model {spec.name!r}")
    if "_norm." in name:
        fill = 1.0 if name.endswith(".weight") else 0.0
        return torch.full(shape, fill, dtype=dtype)
    generator = torch.Generator().manual_seed(_stable_seed(seed, name))
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * _INIT_STD).to(dtype)


def seeded_weights(spec: ModelSpec, seed: int, *, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the full model (names and shapes from :func:`weight_shapes`), on the CPU.

    Equal to calling :func:`seeded_tensor` for each name; identical across calls, processes and
    runs for the same ``seed``, different for different seeds.
    """
    return {name: seeded_tensor(spec, seed, name, dtype) for name in weight_shapes(spec)}


def prompt_tokens(spec: ModelSpec, batch_size: int, prompt_tokens: int, seed: int) -> torch.LongTensor:
    """Token ids ``[batch_size, prompt_tokens]`` (int64, CPU) drawn uniformly from the vocabulary.

    Deterministic in ``seed``, and independent of the weights drawn from the same seed. Raises
    ``ValueError`` unless both counts are positive.
    """
    if batch_size < 1 or prompt_tokens < 1:
        raise ValueError(f"batch size and prompt length must be positive (got {batch_size}, {prompt_tokens})")
    generator = torch.Generator().manual_seed(_stable_seed(seed, "prompt"))
    return torch.randint(0, spec.vocab_size, (batch_size, prompt_tokens), generator=generator)


def _stable_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a tensor name (non-negative, fits in int64)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
