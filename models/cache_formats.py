"""How the KV cache's elements are stored: in the model's dtype, or quantised.

Serving engines quantise the cache to hold longer contexts in the same memory: llama.cpp's
``--cache-type-k`` / ``--cache-type-v`` (``common/arg.cpp``, ``kv_cache_types``: f32, f16, bf16,
q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1), in ggml's blocks of 32 elements (``ggml-common.h``:
``block_q8_0`` 34 bytes, ``block_q4_0`` 18 bytes, :mod:`models.weight_formats`); vLLM's
``--kv-cache-dtype fp8`` one byte an element (its per-tensor scales are a few floats). Keys and
values are stored alike here. A cache row (one head of one token) is ``head_dim`` elements, a
multiple of 32 in every catalog model, so whole blocks.
"""

from __future__ import annotations

from enum import StrEnum

from models.errors import ConfigError
from models.weight_formats import WeightFormat, block_shape, member


class CacheFormat(StrEnum):
    """How the KV cache is stored (``kv_cache`` in a scenario): ``native``, in the model's dtype;
    ``q8_0`` or ``q4_0``, ggml's blocks (llama.cpp); ``fp8``, one byte (vLLM)."""

    NATIVE = "native"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    FP8 = "fp8"


# (elements, bytes) of a block: ggml's formats as the weights' blocks of the same name, fp8 a byte
_BLOCKS = {CacheFormat.Q8_0: block_shape(WeightFormat.Q8_0), CacheFormat.Q4_0: block_shape(WeightFormat.Q4_0),
           CacheFormat.FP8: (1, 1)}


def cache_format(name: object, field: str = "kv_cache") -> CacheFormat:
    """The format called ``name``; raises :class:`ConfigError` on ``field`` listing the known ones."""
    return member(CacheFormat, name, field, "KV-cache format")


def cache_bytes(elements: int, kv_cache: CacheFormat, dtype_bytes: int) -> int:
    """Bytes of ``elements`` cache elements stored in ``kv_cache`` (``dtype_bytes`` each when native,
    else whole blocks, ``ceil(elements / block) * block_bytes``)."""
    if kv_cache == CacheFormat.NATIVE:
        return elements * dtype_bytes
    block, size = _BLOCKS[kv_cache]
    return -(-elements // block) * size


def source_lines(kv_cache: CacheFormat) -> tuple[str, ...]:
    """What a quantised cache priced, for a run's list of what came from where; none native."""
    if kv_cache == CacheFormat.NATIVE:
        return ()
    block, size = _BLOCKS[kv_cache]
    return (f"kv_cache: {kv_cache}, {size} bytes per {block} elements (llama.cpp's --cache-type-k/v, "
            f"vLLM's --kv-cache-dtype fp8), keys and values alike",)


def quantised(weights: WeightFormat, kv_cache: CacheFormat) -> tuple[tuple[str, str], ...]:
    """(field, value) of each of ``weights`` and ``kv_cache`` that is not stored native: what the
    torch runtime, a calibration profile of its kernels and training cannot take."""
    return tuple((field, value) for field, value, dense in (("weights", weights, WeightFormat.NATIVE),
                                                            ("kv_cache", kv_cache, CacheFormat.NATIVE))
                 if value != dense)


def check_inference_only(weights: WeightFormat, kv_cache: CacheFormat) -> None:
    """Refuse quantised storage for a training job. Raises :class:`ConfigError` on the first of
    ``weights`` and ``kv_cache`` that is not native."""
    for field, value in quantised(weights, kv_cache):
        raise ConfigError(field, f"applies to inference: training updates dense weights and keeps no KV cache "
                                 f"(got '{value}')")
