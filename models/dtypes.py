"""Element sizes of the floating-point formats a model can be stored and run in."""

from models.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}

TORCH_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""Each dtype as torch names it: a Hugging Face config's ``torch_dtype``, vLLM's ``--dtype``."""


def dtype_bytes(name: str, field: str = "dtype") -> int:
    """Bytes per element of the dtype called ``name`` (``"fp32"``, ``"fp16"`` or ``"bf16"``).

    Raises :class:`ConfigError` on ``field`` listing the known dtypes when ``name`` is unknown.
    """
    try:
        return DTYPE_BYTES[name]
    except (KeyError, TypeError):
        known = ", ".join(DTYPE_BYTES)
        raise ConfigError(field, f"unknown dtype; known: {known} (got {name!r})") from None
