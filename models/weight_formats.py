"""How a model's weight matrices are stored: in the model's dtype, or quantised in ggml's blocks.

llama.cpp, and the home-cluster systems built on it (its RPC backend, prima.cpp, exo's llama.cpp
engine), run GGUF files whose weight matrices are stored in blocks: a run of ``elements`` weights
packed into ``size_bytes`` bytes with the block's scale. The layouts, from ggml's
``ggml/src/ggml-common.h``:

* ``q8_0``: ``block_q8_0 {ggml_half d; int8_t qs[QK8_0];}``, ``QK8_0 = 32``: 34 bytes per 32
  weights (8.5 bits a weight);
* ``q6_k``: ``block_q6_K {uint8_t ql[QK_K/2]; uint8_t qh[QK_K/4]; int8_t scales[QK_K/16];
  ggml_half d;}``, ``QK_K = 256``: 210 bytes per 256 weights (6.5625 bits);
* ``q5_k``: ``block_q5_K {ggml_half d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K/8];
  uint8_t qs[QK_K/2];}``, ``K_SCALE_SIZE = 12``: 176 bytes per 256 weights (5.5 bits);
* ``q4_k``: ``block_q4_K {ggml_half d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K/2];}``:
  144 bytes per 256 weights (4.5 bits);
* ``q4_0``: ``block_q4_0 {ggml_half d; uint8_t qs[QK4_0/2];}``, ``QK4_0 = 32``: 18 bytes per 32
  weights (4.5 bits).

Only matrices are quantised: norms' gains and biases (one-dimensional tensors) keep the model's
dtype. The LM head (``output.weight``, or the token embedding where it is tied to the head) is
stored in ``q6_k`` unless the file is ``q8_0``: llama.cpp's quantiser raises it
(``src/llama-quant.cpp``, ``llama_tensor_get_type``: ``else if (new_type != GGML_TYPE_Q8_0)
new_type = GGML_TYPE_Q6_K``). The ``q4_k_m`` and ``q5_k_m`` files (llama.cpp's ``Q4_K_M`` and
``Q5_K_M``, the mixes most GGUF files are published in) store every matrix in ``q4_k`` or
``q5_k`` but the attention's value projection and the MLP's down projection of the layers
``use_more_bits`` picks, which they raise to ``q6_k`` (same function: ``use_more_bits(i, n) = i <
n/8 || i >= 7*n/8 || (i - n/8) % 3 == 2``, about half the layers); hetsim gives every layer the
average of those two tensors over the model's layers, so a pipeline stage's bytes are its share
of the layers (exact for the whole model, within a few percent for a stage). In a 70B model
(llama.cpp's ``LLM_TYPE_70B``: 80 layers with grouped-query attention, ``src/llama-model.cpp``)
``q4_k_m`` raises the other layers' value projections from ``q4_k`` to ``q5_k`` too ("In the 70B
model we have 8 heads sharing the same attn_v weights").
With these, Llama-2-7B takes 6.67 GiB in ``q8_0`` and 3.56 GiB in ``q4_0``, the sizes llama-bench
prints for those files (ggml-org/llama.cpp pull request #4766), Llama-3.2-3B 1.87 GiB and
Llama-3.1-70B 39.59 GiB in ``q4_k_m`` (geerlingguy/ai-benchmarks issues #53 and #21, llama-bench's
"llama 3B Q4_K - Medium" and "llama 70B Q4_K - Medium").

How a product reads quantised weights (:class:`QuantisedMatmul`): llama.cpp's CUDA backend
multiplies batches of at most :data:`DEQUANTIZE_ABOVE_TOKENS` tokens on the quantised blocks
directly (``mul_mat_vec_q``, ``mul_mat_q``), and larger ones, on GPUs with tensor cores, by first
converting the whole matrix to fp16 and calling cuBLAS (``ggml-cuda.cu`` up to pull request
#8075, 2024-06-24: ``#define MMQ_MAX_BATCH_SIZE 32 // max batch size to use MMQ kernels when
tensor cores are available``; ``ggml_cuda_op_mul_mat_cublas`` converts ``src0`` with
``ggml_get_to_fp16_cuda``), a memory-bound pass before the product at every micro-batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import StrEnum

from models.errors import ConfigError, shorten


class WeightFormat(StrEnum):
    """How the weight matrices are stored (``weights`` in a scenario): ``native``, in the model's
    dtype; or quantised in one of ggml's block formats (module docstring)."""

    NATIVE = "native"
    Q8_0 = "q8_0"
    Q6_K = "q6_k"
    Q5_K_M = "q5_k_m"
    Q5_K = "q5_k"
    Q4_K_M = "q4_k_m"
    Q4_K = "q4_k"
    Q4_0 = "q4_0"


class QuantisedMatmul(StrEnum):
    """How a product of more than :data:`DEQUANTIZE_ABOVE_TOKENS` tokens reads quantised weights
    (``quantised_matmul`` in a scenario): ``dequantize``, a pass converting the matrix to the
    model's dtype then a dense product (llama.cpp's CUDA backend with tensor cores before pull
    request #8075); ``direct``, a product on the blocks themselves, as for small batches."""

    DEQUANTIZE = "dequantize"
    DIRECT = "direct"


DEQUANTIZE_ABOVE_TOKENS = 32
"""Products of more tokens than this dequantise first under ``QuantisedMatmul.DEQUANTIZE``
(``MMQ_MAX_BATCH_SIZE`` of llama.cpp's ``ggml-cuda.cu``)."""


@dataclass(frozen=True)
class _Blocks:
    elements: int
    size_bytes: int


@dataclass(frozen=True)
class _Layout:
    """A file's matrices: ``blocks`` for most; ``raised`` for the value and down projections of
    the layers ``use_more_bits`` picks (the ``_m`` mixes); ``value_70b`` for a 70B model's other
    value projections."""

    blocks: _Blocks
    raised: _Blocks | None = None
    value_70b: _Blocks | None = None


_Q8_0, _Q6_K, _Q5_K, _Q4_K, _Q4_0 = _Blocks(32, 34), _Blocks(256, 210), _Blocks(256, 176), _Blocks(256, 144), _Blocks(32, 18)
_LAYOUTS = {
    WeightFormat.Q8_0: _Layout(_Q8_0),
    WeightFormat.Q6_K: _Layout(_Q6_K),
    WeightFormat.Q5_K_M: _Layout(_Q5_K, raised=_Q6_K),
    WeightFormat.Q5_K: _Layout(_Q5_K),
    WeightFormat.Q4_K_M: _Layout(_Q4_K, raised=_Q6_K, value_70b=_Q5_K),
    WeightFormat.Q4_K: _Layout(_Q4_K),
    WeightFormat.Q4_0: _Layout(_Q4_0),
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """Whether llama.cpp's ``_M`` mixes raise ``layer``'s value and down projections
    (``src/llama-quant.cpp``, ``use_more_bits``; C's integer division)."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def weight_format(name: object, field: str = "weights") -> WeightFormat:
    """The format called ``name``; raises :class:`ConfigError` on ``field`` listing the known ones."""
    return member(WeightFormat, name, field, "weight format")


def quantised_matmul(name: object, field: str = "quantised_matmul") -> QuantisedMatmul:
    """The product path called ``name``; raises :class:`ConfigError` on ``field`` listing them."""
    return member(QuantisedMatmul, name, field, "quantised product")


def member(kind: type[StrEnum], name: object, field: str, what: str):
    """The member of ``kind`` called ``name``; raises :class:`ConfigError` on ``field`` naming
    ``what`` and the known members."""
    try:
        return kind(name)
    except ValueError:
        raise ConfigError(field, f"unknown {what}; known: {', '.join(kind)} (got {shorten(name)})") from None


def block_shape(weights: WeightFormat) -> tuple[int, int]:
    """(elements, bytes) of one of the quantised format ``weights``'s main blocks."""
    blocks = _LAYOUTS[weights].blocks
    return blocks.elements, blocks.size_bytes


def _whole_blocks(elements: int, blocks: _Blocks) -> int:
    return -(-elements // blocks.elements) * blocks.size_bytes


def head_format(weights: WeightFormat) -> WeightFormat:
    """The format of the LM head (and of a token embedding tied to it) in a file of ``weights``:
    ``q6_k`` for every quantised format but ``q8_0`` (module docstring)."""
    if weights in (WeightFormat.NATIVE, WeightFormat.Q8_0):
        return weights
    return WeightFormat.Q6_K


@functools.cache
def _raised_share(num_layers: int) -> float:
    """The share of ``num_layers`` layers whose value and down projections the ``_m`` mixes raise."""
    return sum(use_more_bits(i, num_layers) for i in range(num_layers)) / num_layers


def matrix_bytes(elements: int, weights: WeightFormat, dtype_bytes: int, *, raised: int = 0, values: int = 0,
                 num_layers: int = 1, seventy_b: bool = False) -> int:
    """Bytes of a weight matrix (or of a layer's matrices) of ``elements`` weights stored in
    ``weights``: ``dtype_bytes`` per element when native; else whole blocks,
    ``ceil(elements / block) * block_bytes``. ``raised``: how many of the elements are value or
    down projections (``values`` of them value projections), which the ``_m`` mixes store raised
    in the share of the ``num_layers`` layers ``use_more_bits`` picks (each layer given that
    average), and, in a ``seventy_b`` model, the value projections of the other layers too."""
    if weights == WeightFormat.NATIVE:
        return elements * dtype_bytes
    layout = _LAYOUTS[weights]
    if not raised or layout.raised is None:
        return _whole_blocks(elements, layout.blocks)
    share = _raised_share(num_layers)
    base, high = layout.blocks, layout.raised
    low_value = layout.value_70b if seventy_b and layout.value_70b is not None else base

    def per_weight(low: _Blocks) -> float:
        return share * high.size_bytes / high.elements + (1 - share) * low.size_bytes / low.elements

    raised_bytes = (raised - values) * per_weight(base) + values * per_weight(low_value)
    return _whole_blocks(elements - raised, base) + math.ceil(raised_bytes)


def source_lines(weights: WeightFormat, matmul: QuantisedMatmul, dtype: str) -> tuple[str, ...]:
    """What quantised ``weights`` priced, for a run's list of what came from where; none native."""
    if weights == WeightFormat.NATIVE:
        return ()
    layout, head = _LAYOUTS[weights], head_format(weights)
    blocks = layout.blocks
    raised = (f", value and down projections of about half the layers in q6_k (llama.cpp's use_more_bits)"
              if layout.raised is not None else "")
    products = (f"dequantised to {dtype} first, then a dense product (ggml-cuda's path before llama.cpp pull "
                f"request #8075)" if matmul == QuantisedMatmul.DEQUANTIZE else "read on the blocks directly")
    return (f"weights: {weights}, {blocks.size_bytes} bytes per {blocks.elements} weights (ggml-common.h){raised}, "
            f"the LM head in {head} (llama.cpp's quantiser), norms and biases in {dtype}; products of more than "
            f"{DEQUANTIZE_ABOVE_TOKENS} tokens {products}",)
