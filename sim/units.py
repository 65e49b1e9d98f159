"""Human-written quantities ("10Gbit/s", "5us", "16GiB", "989 TFLOP/s") parsed into SI numbers,
and SI numbers written back for people (:func:`duration_text`, :func:`bandwidth_text`).

Everything inside hetsim is SI: seconds, bytes, bytes per second, FLOP per second. These parsers
are the only place where a unit is read; they are called at the input boundary (pydantic field
validators) so that a bad value is reported with its location.

pint does the arithmetic, but it treats bit and byte as dimensionless, reads ``b`` as barn and
``Mbps`` as megabaud, and ``mbit`` as millibit. So each parser checks the unit *names*, not only
the dimensionality, and accepts only whole-bit multiples (k, M, G, T, P and Ki, Mi, Gi, Ti, Pi).

Plain numbers (int or float) are taken as already being in SI units. Bad input raises
``ValueError`` with a one-line message that shows an example of correct input and the value
(shortened to 60 characters).

Every quantity is bounded to a physical range (:data:`BANDWIDTH_RANGE_BYTES_PER_S`,
:data:`MAX_DURATION_S`, :data:`SIZE_RANGE_BYTES`, :data:`FLOPS_RANGE`), wide enough for any real
link, device or disk, and narrow enough that no sum, product or quotient the simulator forms of
them overflows to inf or NaN (``latency: 1e308 s`` or ``bandwidth: 1e-300 bit/s`` would).
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections.abc import Iterable

import pint

from models.errors import shorten

_INFORMATION_UNIT = re.compile(r"^(|kilo|mega|giga|tera|peta|kibi|mebi|gibi|tebi|pebi)(bit|byte)$")
_FLOPS_SUFFIX = re.compile(r"FLOP(?:S|/s)$", re.IGNORECASE)
# Text longer than this is no quantity anyone writes; pint's parser recurses on parentheses.
_MAX_TEXT_CHARS = 64
BANDWIDTH_RANGE_BYTES_PER_S = (0.125, 1e18)  # 1 bit/s .. 8 Ebit/s
MAX_DURATION_S = 3600.0  # a link latency or per-op overhead of an hour is no cluster's
SIZE_RANGE_BYTES = (1, 2**60)  # 1 byte .. 1 EiB
FLOPS_RANGE = (1.0, 1e21)  # 1 FLOP/s .. 1 ZFLOP/s per device
_FLOP_PREFIX_FACTOR = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


@functools.cache
def _registry() -> pint.UnitRegistry:
    # Built once, on first use: constructing a registry costs about 0.1 s.
    return pint.UnitRegistry()


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> pint.Quantity | float:
    # A sweep validates the same few quantities at every point; pint's parser is most of that.
    return _registry().Quantity(text)


def _quantity(text: str | int | float, what: str, example: str) -> pint.Quantity | float:
    """Parse ``text`` with pint, or return a plain number unchanged."""
    if isinstance(text, bool) or not isinstance(text, (int, float, str)) or (
            isinstance(text, str) and len(text) > _MAX_TEXT_CHARS):
        raise ValueError(f"not {what}; write e.g. {example} (got {shorten(text)})")
    if isinstance(text, (int, float)):
        return _as_float(text, what, example)
    if not any(c.isdigit() for c in text):  # pint reads a bare "ms" as 1 ms: a unit is not a value
        raise ValueError(f"not {what}; write e.g. {example} (got {shorten(text)})")
    try:
        quantity = _parsed(text.strip())
    except Exception:  # noqa: BLE001  (pint's parser raises anything: ZeroDivisionError for "(1/0) ms", ...)
        raise ValueError(f"not {what}; write e.g. {example} (got {shorten(text)})") from None
    if not isinstance(quantity, pint.Quantity):
        return _as_float(quantity, what, example)
    return quantity


def _as_float(number: object, what: str, example: str) -> float:
    try:
        return float(number)
    except (OverflowError, TypeError, ValueError):  # an int too large for a float
        raise ValueError(f"not {what}; write e.g. {example} (got {shorten(number)})") from None


def _to_si(quantity: pint.Quantity, unit: str, text: object, what: str, *, exact: bool = False) -> float:
    # pint's prefix arithmetic leaves one-ulp noise ("10us" -> 9.999999999999999e-06); 15
    # significant digits give back the exact decimal value without losing real precision
    # (``exact``: sizes, whose binary prefixes are exact in a float but have 16 digits).
    try:
        value = float(quantity.to(unit).magnitude)
        return value if exact else float(f"{value:.15g}")
    except Exception:  # noqa: BLE001  (a magnitude pint computed but cannot convert: overflow, complex)
        raise ValueError(f"not {what} (got {shorten(text)})") from None


def _is_time_unit(name: str) -> bool:
    return _registry().Unit(name).dimensionality == _registry().second.dimensionality


def _check_value(value: float, text: object, what: str, low: float, high: float, unit: str, *,
                 allow_zero: bool = False) -> float:
    """``value`` if finite and within [low, high] (or exactly 0 with ``allow_zero``)."""
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite (got {shorten(text)})")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "must not be negative" if allow_zero else "must be positive"
        raise ValueError(f"{what} {bound} (got {shorten(text)})")
    if value != 0 and not low <= value <= high:
        raise ValueError(f"{what} must be between {low:g} and {high:g} {unit} (got {shorten(text)})")
    return value


def parse_bandwidth(text: str | int | float) -> float:
    """Parse a bandwidth such as ``"10Gbit/s"``, ``"300 Mbit/s"``, ``"32GB/s"``, ``"25 GiB/s"``.

    Returns bytes per second (float, > 0). A plain number is taken as bytes per second.
    Raises ValueError for anything else, including ambiguous spellings like ``"10 gbps"`` or
    ``"10 Mb/s"`` (pint reads ``b`` as barn).
    """
    example = "10Gbit/s or 1.25GB/s"
    quantity = _quantity(text, "a bandwidth", example)
    if isinstance(quantity, float):
        return _check_value(quantity, text, "bandwidth", *BANDWIDTH_RANGE_BYTES_PER_S, "bytes/s")
    units = dict(quantity.unit_items())
    information = [name for name, power in units.items() if power == 1 and _INFORMATION_UNIT.match(name)]
    time = [name for name, power in units.items() if power == -1 and _is_time_unit(name)]
    if len(units) != 2 or len(information) != 1 or len(time) != 1:
        raise ValueError(f"not a bandwidth; write e.g. {example} (got {shorten(text)})")
    value = _to_si(quantity, "byte / second", text, "a bandwidth")
    return _check_value(value, text, "bandwidth", *BANDWIDTH_RANGE_BYTES_PER_S, "bytes/s")


def parse_duration(text: str | int | float) -> float:
    """Parse a duration such as ``"1ms"``, ``"5us"``, ``"2 s"``.

    Returns seconds (float, >= 0: a zero latency is a legitimate idealisation). A plain number is
    taken as seconds. Raises ValueError for text that is not a time or is negative.
    """
    example = "1ms, 50us or 2s"
    quantity = _quantity(text, "a duration", example)
    if isinstance(quantity, float):
        return _check_value(quantity, text, "duration", 0.0, MAX_DURATION_S, "s", allow_zero=True)
    units = dict(quantity.unit_items())
    if len(units) != 1 or next(iter(units.values())) != 1 or not _is_time_unit(next(iter(units))):
        raise ValueError(f"not a duration; write e.g. {example} (got {shorten(text)})")
    value = _to_si(quantity, "second", text, "a duration")
    return _check_value(value, text, "duration", 0.0, MAX_DURATION_S, "s", allow_zero=True)


def parse_size(text: str | int | float) -> int:
    """Parse a size such as ``"16GiB"``, ``"8 GB"``, ``"512MiB"``, ``"4Gbit"``.

    Returns bytes as an int (rounded to the nearest byte, > 0). A plain number is taken as bytes.
    Raises ValueError for text that is not an amount of information or is not positive.
    """
    example = "16GiB or 8GB"
    quantity = _quantity(text, "a size", example)
    if isinstance(quantity, float):
        return round(_check_value(quantity, text, "size", *SIZE_RANGE_BYTES, "bytes"))
    units = dict(quantity.unit_items())
    if len(units) != 1 or next(iter(units.values())) != 1 or not _INFORMATION_UNIT.match(next(iter(units))):
        raise ValueError(f"not a size; write e.g. {example} (got {shorten(text)})")
    value = _to_si(quantity, "byte", text, "a size", exact=True)
    # At least one byte, so "0.4 byte" is refused rather than rounded to an empty device.
    return round(_check_value(value, text, "size", *SIZE_RANGE_BYTES, "bytes"))


def parse_flops(text: str | int | float) -> float:
    """Parse a compute rate such as ``"989 TFLOP/s"``, ``"19.5TFLOPS"``, ``"1e12 FLOP/s"``.

    Returns FLOP per second (float, > 0). pint has no FLOP unit, so the SI prefix (k, M, G, T,
    P, E) is read here. A plain number is taken as FLOP/s. Raises ValueError otherwise.
    """
    example = "989 TFLOP/s or 19.5TFLOPS"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)) or (
            isinstance(text, str) and len(text) > _MAX_TEXT_CHARS):
        raise ValueError(f"not a compute rate; write e.g. {example} (got {shorten(text)})")
    if isinstance(text, (int, float)):
        return _check_value(_as_float(text, "a compute rate", example), text, "compute rate", *FLOPS_RANGE, "FLOP/s")
    stripped = _FLOPS_SUFFIX.sub("", text.strip())
    if stripped == text.strip():
        raise ValueError(f"not a compute rate; write e.g. {example} (got {shorten(text)})")
    number = stripped.rstrip()
    prefix = ""
    if number and number[-1] in _FLOP_PREFIX_FACTOR:
        number, prefix = number[:-1].rstrip(), number[-1]
    try:
        magnitude = float(number)
    except ValueError:
        raise ValueError(f"not a compute rate; write e.g. {example} (got {shorten(text)})") from None
    return _check_value(magnitude * _FLOP_PREFIX_FACTOR[prefix], text, "compute rate", *FLOPS_RANGE, "FLOP/s")


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, never in exponent form (``1234.5`` -> ``1235``)."""
    if not math.isfinite(value):
        return ""
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value)))) if value else 0
    return f"{value:.{decimals}f}"


_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))


def time_unit(values_s: Iterable[float]) -> tuple[float, str]:
    """(seconds per unit, unit name) of the unit that shows the median of the finite positive
    ``values_s`` (seconds) as at least 1: a column or an axis of durations in one unit."""
    finite = [v for v in values_s if isinstance(v, int | float) and math.isfinite(v) and v > 0]
    median = statistics.median(finite) if finite else 1.0
    return next(((size, name) for size, name in _TIME_UNITS if median >= size), _TIME_UNITS[-1])


def duration_text(seconds: float) -> str:
    """A duration for people, three significant digits in the unit that suits it, never in
    exponent form: ``19.3 s`` from 1 s up, ``138 ms``, ``45.6 us``; '' when not finite."""
    if not math.isfinite(seconds):
        return ""
    size, unit = next(((size, unit) for size, unit in ((1.0, "s"), (1e-3, "ms")) if abs(seconds) >= size),
                      (1e-6, "us"))
    return f"{significant(seconds / size)} {unit}"


def bandwidth_text(bytes_per_s: float) -> str:
    """A bandwidth for people, in bits as links are sold: ``10 Gbit/s``, ``300 Mbit/s``."""
    bits = bytes_per_s * 8
    size, unit = next(((size, unit) for size, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"),
                                                       (1e3, "kbit/s")) if bits >= size), (1.0, "bit/s"))
    return f"{significant(bits / size)} {unit}"
