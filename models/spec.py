"""The architecture of a decoder-only transformer, as far as cost and memory depend on it."""

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from models.cache_formats import CacheFormat, cache_format
from models.dtypes import dtype_bytes
from models.errors import ConfigError, shorten
from models.weight_formats import QuantisedMatmul, WeightFormat, quantised_matmul, weight_format

Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gated", "plain"]
# How attention is computed, which decides what it holds in memory (:mod:`models.accounting`):
# "sdpa", a fused kernel (PyTorch's ``scaled_dot_product_attention``, FlashAttention) that never
# materialises the (query, key) score matrix; "eager", scores materialised then soft-maxed.
Attention = Literal["sdpa", "eager"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(Attention)

# Upper bounds, a few times the largest published models' (Llama-3.1-405B: 126 layers, hidden
# 16384, intermediate 53248, 128 heads; vocabularies of 256k; contexts of 1M tokens), so that no
# count of parameters, FLOPs or bytes the accounting forms of them leaves a 64-bit integer.
_POSITIVE_INT_FIELDS = {
    "num_layers": 1024,
    "hidden_size": 1 << 17,
    "num_attention_heads": 1 << 12,
    "num_kv_heads": 1 << 12,
    "intermediate_size": 1 << 19,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}
_BOOL_FIELDS = ("tied_embeddings", "attention_bias", "linear_bias", "learned_position_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: pre-norm blocks of attention then MLP, a final norm, an LM head.

    ``mlp="gated"`` is SwiGLU (gate and up projections, then down); ``"plain"`` is up, GELU, down.
    ``attention_bias`` puts a bias on the q, k and v projections (Qwen2, GPT-2); ``linear_bias`` on
    the attention output projection and the MLP linears (GPT-2). Without learned position
    embeddings the model is taken to use rotary embeddings, which have no parameters.
    ``dtype`` is the element type of weights, activations and KV cache; ``weights`` how the weight
    matrices are stored (:class:`models.weight_formats.WeightFormat`: ``native``, in ``dtype``, or
    quantised in ggml's blocks, norms and biases staying in ``dtype``), and ``quantised_matmul``
    how a large product reads them (:class:`models.weight_formats.QuantisedMatmul`); ``kv_cache``
    how the KV cache's elements are stored (:class:`models.cache_formats.CacheFormat`). ``attention`` is how the
    attention op runs (:data:`Attention`): a fused ``sdpa`` kernel (the default, as PyTorch and
    vLLM run it) or ``eager`` matmul-softmax-matmul; it changes memory, not FLOPs.

    Construction validates every field and raises :class:`ConfigError` naming it
    (``model.<field>``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    norm: Norm
    mlp: Mlp
    tied_embeddings: bool
    attention_bias: bool
    linear_bias: bool
    learned_position_embeddings: bool
    max_position_embeddings: int
    dtype: str = "fp16"
    attention: Attention = "sdpa"
    weights: WeightFormat = WeightFormat.NATIVE
    quantised_matmul: QuantisedMatmul = QuantisedMatmul.DEQUANTIZE
    kv_cache: CacheFormat = CacheFormat.NATIVE

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("model.name", f"must be a non-empty string (got {shorten(self.name)})")
        for field, most in _POSITIVE_INT_FIELDS.items():
            value = getattr(self, field)
            # bool is an int subclass; True must not pass as 1 layer.
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most:
                raise ConfigError(f"model.{field}", f"must be an integer between 1 and {most} (got {shorten(value)})")
        for field in _BOOL_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ConfigError(f"model.{field}", f"must be true or false (got {shorten(value)})")
        for field, allowed in (("norm", get_args(Norm)), ("mlp", get_args(Mlp)), ("attention", ATTENTION_KERNELS)):
            value = getattr(self, field)
            if value not in allowed:
                raise ConfigError(f"model.{field}", f"must be one of {', '.join(allowed)} (got {shorten(value)})")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "model.num_attention_heads",
                f"must divide hidden size {self.hidden_size} (got {self.num_attention_heads})",
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                "model.num_kv_heads",
                f"must divide the {self.num_attention_heads} attention heads (got {self.num_kv_heads})",
            )
        dtype_bytes(self.dtype, "model.dtype")
        # Stored as the enums so that equal specs compare (and hash) equal however they were spelled.
        object.__setattr__(self, "weights", weight_format(self.weights, "model.weights"))
        object.__setattr__(self, "quantised_matmul", quantised_matmul(self.quantised_matmul, "model.quantised_matmul"))
        object.__setattr__(self, "kv_cache", cache_format(self.kv_cache, "model.kv_cache"))

    @property
    def head_dim(self) -> int:
        """Width of one attention head, in elements."""
        return self.hidden_size // self.num_attention_heads

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of activations, and of weights and KV cache stored ``native``."""
        return dtype_bytes(self.dtype, "model.dtype")

    def with_dtype(self, dtype: str) -> "ModelSpec":
        """The same architecture in another dtype; raises :class:`ConfigError` if it is unknown."""
        return dataclasses.replace(self, dtype=dtype)

    def with_weights(self, weights: str, matmul: str = QuantisedMatmul.DEQUANTIZE) -> "ModelSpec":
        """The same model with its matrices stored in ``weights``, large products reading them by
        ``matmul``; raises :class:`ConfigError` on an unknown format or path."""
        return dataclasses.replace(self, weights=weights, quantised_matmul=matmul)

    def with_kv_cache(self, kv_cache: str) -> "ModelSpec":
        """The same model with its KV cache stored in ``kv_cache``; raises :class:`ConfigError` on
        an unknown format."""
        return dataclasses.replace(self, kv_cache=kv_cache)

    def with_attention(self, attention: str) -> "ModelSpec":
        """The same model with another attention kernel; raises :class:`ConfigError` on an unknown one."""
        return dataclasses.replace(self, attention=attention)

    def same_architecture(self, other: "ModelSpec") -> bool:
        """Whether ``other`` is this model under any name and in any dtype: every other field equal
        (the same ops at the same shapes, whatever a scenario or a checkpoint calls it)."""
        return dataclasses.replace(self, name=other.name, dtype=other.dtype) == other
