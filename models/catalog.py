"""Published model architectures, and a reader for Hugging Face ``config.json`` files.

Every catalog entry transcribes the ``config.json`` of the Hugging Face repository named in its
comment, including its ``torch_dtype`` (GPT-2's config has none; its checkpoint is fp32).
"""

from pathlib import Path
from typing import Any

from models.dtypes import TORCH_DTYPE_NAMES
from models.errors import ConfigError, shorten
from models.input_files import load_json
from models.spec import ModelSpec


def _llama_like(**fields: Any) -> ModelSpec:
    """Llama-style defaults: RMSNorm, SwiGLU MLP, rotary positions, no biases, untied head."""
    defaults = dict(
        norm="rmsnorm",
        mlp="gated",
        tied_embeddings=False,
        attention_bias=False,
        linear_bias=False,
        learned_position_embeddings=False,
    )
    return ModelSpec(**(defaults | fields))


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # openai-community/gpt2
        ModelSpec(
            name="gpt2",
            num_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            num_kv_heads=12,
            intermediate_size=3072,  # n_inner is null: 4 * n_embd
            vocab_size=50257,
            norm="layernorm",
            mlp="plain",
            tied_embeddings=True,
            attention_bias=True,
            linear_bias=True,
            learned_position_embeddings=True,
            max_position_embeddings=1024,
            dtype="fp32",
        ),
        # meta-llama/Llama-2-7b-hf
        _llama_like(
            name="llama-2-7b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=32,
            intermediate_size=11008,
            vocab_size=32000,
            max_position_embeddings=4096,
            dtype="fp16",
        ),
        # meta-llama/Llama-2-13b-hf
        _llama_like(
            name="llama-2-13b",
            num_layers=40,
            hidden_size=5120,
            num_attention_heads=40,
            num_kv_heads=40,
            intermediate_size=13824,
            vocab_size=32000,
            max_position_embeddings=4096,
            dtype="fp16",
        ),
        # meta-llama/Llama-2-70b-hf
        _llama_like(
            name="llama-2-70b",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            intermediate_size=28672,
            vocab_size=32000,
            max_position_embeddings=4096,
            dtype="fp16",
        ),
        # meta-llama/Llama-3.1-8B
        _llama_like(
            name="llama-3.1-8b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
            dtype="bf16",
        ),
        # meta-llama/Llama-3.2-3B (tied embeddings)
        _llama_like(
            name="llama-3.2-3b",
            num_layers=28,
            hidden_size=3072,
            num_attention_heads=24,
            num_kv_heads=8,
            intermediate_size=8192,
            vocab_size=128256,
            max_position_embeddings=131072,
            tied_embeddings=True,
            dtype="bf16",
        ),
        # meta-llama/Llama-3.1-70B
        _llama_like(
            name="llama-3.1-70b",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=131072,
            dtype="bf16",
        ),
        # 01-ai/Yi-34B
        _llama_like(
            name="yi-34b",
            num_layers=60,
            hidden_size=7168,
            num_attention_heads=56,
            num_kv_heads=8,
            intermediate_size=20480,
            vocab_size=64000,
            max_position_embeddings=4096,
            dtype="bf16",
        ),
        # TinyLlama/TinyLlama-1.1B-Chat-v1.0
        _llama_like(
            name="tinyllama-1.1b",
            num_layers=22,
            hidden_size=2048,
            num_attention_heads=32,
            num_kv_heads=4,
            intermediate_size=5632,
            vocab_size=32000,
            max_position_embeddings=2048,
            dtype="bf16",
        ),
        # Qwen/Qwen2.5-0.5B
        _llama_like(
            name="qwen2.5-0.5b",
            num_layers=24,
            hidden_size=896,
            num_attention_heads=14,
            num_kv_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            max_position_embeddings=32768,
            tied_embeddings=True,
            attention_bias=True,
            dtype="bf16",
        ),
        # Qwen/Qwen2.5-7B
        _llama_like(
            name="qwen2.5-7b",
            num_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_kv_heads=4,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=131072,
            attention_bias=True,
            dtype="bf16",
        ),
    )
}

# The Hugging Face repository each entry transcribes (its comment above): what a serving engine
# loads it from (`vllm serve REPOSITORY`).
HF_REPOSITORIES: dict[str, str] = {
    "gpt2": "openai-community/gpt2",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "yi-34b": "01-ai/Yi-34B",
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
}

# Total parameters, each counted once (tied embeddings once). Sources: the "total" of each Hugging
# Face repository's safetensors metadata (the figure the model page shows), except GPT-2, whose
# checkpoint also stores the 12 causal-mask buffers (1024 x 1024 each, 137M in all); its figure is
# the trainable-parameter count of GPT2LMHeadModel, the "124M" of the model card.
PUBLISHED_PARAMETER_COUNTS: dict[str, int] = {
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-3b": 3_212_749_824,
    "yi-34b": 34_388_917_248,
    "qwen2.5-0.5b": 494_032_768,
    "tinyllama-1.1b": 1_100_048_384,
    "qwen2.5-7b": 7_615_616_512,
}


def get_model(name: str) -> ModelSpec:
    """The catalog entry called ``name`` (case-insensitive).

    Raises :class:`ConfigError` on ``model`` listing the known names when there is none.
    """
    spec = CATALOG.get(str(name).lower())
    if spec is None:
        raise ConfigError("model", f"unknown model {shorten(name)}; known: {', '.join(CATALOG)}")
    return spec


_TORCH_DTYPES = {torch: name for name, torch in TORCH_DTYPE_NAMES.items()}
_LLAMA_FAMILY = ("llama", "mistral", "qwen2")
_SUPPORTED_MODEL_TYPES = (*_LLAMA_FAMILY, "gpt2")


def load_hf_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` of model_type llama, mistral, qwen2 or gpt2.

    ``name`` defaults to the file name without ``.json`` and ``.config`` (``gpt2.config.json``
    gives ``gpt2``), or to the folder name for a file called ``config.json``. A missing
    ``torch_dtype`` means fp32, as in the GPT-2 checkpoint. ``hidden_act`` is not read: the MLP's
    shape follows from the model type (SwiGLU for the Llama family, GELU MLP for GPT-2).

    The file is read by :func:`models.input_files.load_json` (UTF-8, size, depth, duplicate keys,
    no NaN); every number read must be a JSON integer (``true`` and ``12.0`` are not counts),
    checked before any arithmetic on it.

    Raises :class:`ConfigError` on ``model.config`` for a missing or unreadable file, bad JSON,
    an unsupported model_type, a missing key or an architecture :class:`ModelSpec` cannot express;
    on ``model.<field>`` when a value is invalid.
    """
    path = Path(path)
    config = load_json(path, "model.config")
    shown = shorten(str(path), keep_end=True)
    if not isinstance(config, dict):
        raise ConfigError("model.config", f"not a JSON object (got {shown})")
    model_type = config.get("model_type")

    def require(key: str) -> Any:
        if key not in config:
            raise ConfigError("model.config", f"{shown}: missing key {key!r} (got model_type {shorten(model_type)})")
        return config[key]

    def integer(key: str, value: Any) -> Any:
        # Checked before it is multiplied: "x" * 10**9 would be a string of a billion characters.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"model.config.{key}", f"must be an integer (got {shorten(value)})")
        return value

    def require_int(key: str) -> int:
        return integer(key, require(key))

    if not isinstance(model_type, str) or model_type not in _SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            "model.config",
            f"{shown}: unsupported model_type; known: {', '.join(_SUPPORTED_MODEL_TYPES)} "
            f"(got {shorten(model_type)})",
        )
    torch_dtype = config.get("torch_dtype", "float32")
    if not isinstance(torch_dtype, str) or torch_dtype not in _TORCH_DTYPES:
        raise ConfigError(
            "model.config",
            f"{shown}: unsupported torch_dtype; known: {', '.join(_TORCH_DTYPES)} (got {shorten(torch_dtype)})",
        )
    if name is None and path.name == "config.json":
        name = path.parent.name
    elif name is None:
        name = path.name.removesuffix(".json").removesuffix(".config")
    common = dict(name=name, vocab_size=require_int("vocab_size"), dtype=_TORCH_DTYPES[torch_dtype])

    if model_type == "gpt2":
        hidden_size = require_int("n_embd")
        n_inner = config.get("n_inner")
        return ModelSpec(
            **common,
            num_layers=require_int("n_layer"),
            hidden_size=hidden_size,
            num_attention_heads=require_int("n_head"),
            num_kv_heads=require_int("n_head"),
            # GPT2Config: n_inner null means 4 * n_embd.
            intermediate_size=4 * hidden_size if n_inner is None else integer("n_inner", n_inner),
            norm="layernorm",
            mlp="plain",
            tied_embeddings=config.get("tie_word_embeddings", True),
            attention_bias=True,
            linear_bias=True,
            learned_position_embeddings=True,
            max_position_embeddings=require_int("n_positions"),
        )

    hidden_size = require_int("hidden_size")
    num_attention_heads = require_int("num_attention_heads")
    head_dim = config.get("head_dim")
    if head_dim is not None and integer("head_dim", head_dim) * num_attention_heads != hidden_size:
        raise ConfigError(
            "model.config",
            f"{shown}: head_dim must equal hidden_size / num_attention_heads = "
            f"{hidden_size} / {num_attention_heads} (got {head_dim})",
        )
    if model_type == "qwen2":
        # Qwen2 always has q, k, v biases and no others; its config has no key for them.
        attention_bias, linear_bias = True, False
    else:
        # Llama's attention_bias also covers o_proj, and mlp_bias the MLP: only both or neither map.
        attention_bias = config.get("attention_bias", False)
        linear_bias = config.get("mlp_bias", False)
        if attention_bias != linear_bias:
            raise ConfigError(
                "model.config",
                f"{shown}: attention_bias without mlp_bias (or the reverse) is not supported "
                f"(got attention_bias={attention_bias}, mlp_bias={linear_bias})",
            )
    num_kv_heads = config.get("num_key_value_heads")
    return ModelSpec(
        **common,
        num_layers=require_int("num_hidden_layers"),
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        # Configs predating grouped-query attention omit it (or write null): one KV head per query
        # head. A 0 is not "omitted": ModelSpec refuses it.
        num_kv_heads=num_attention_heads if num_kv_heads is None else integer("num_key_value_heads", num_kv_heads),
        intermediate_size=require_int("intermediate_size"),
        norm="rmsnorm",
        mlp="gated",
        tied_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=attention_bias,
        linear_bias=linear_bias,
        learned_position_embeddings=False,
        max_position_embeddings=require_int("max_position_embeddings"),
    )
