"""Parsing human quantities into SI numbers (sim/units.py)."""

import pytest

from sim.units import parse_bandwidth, parse_duration, parse_flops, parse_size


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("10Gbit/s", 1.25e9),
        ("300 Mbit/s", 37.5e6),
        ("32GB/s", 32e9),
        ("25 GiB/s", 25 * 2**30),
        ("1 kbit/s", 125.0),
        ("8 MiB/ms", 8 * 2**20 * 1000),
        (1.25e9, 1.25e9),
    ],
)
def test_parse_bandwidth_bits_and_bytes(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize(
    "text",
    [
        "10 gbps",  # not a pint unit
        "1 Mbps",  # pint reads it as megabaud
        "10 Mb/s",  # pint reads 'b' as barn
        "10 mbit/s",  # millibit: a typo, not a real rate
        "10 GB",  # a size, not a rate
        "10",  # no unit
        "fast",
        True,
    ],
)
def test_parse_bandwidth_rejects_ambiguous_or_wrong_units(text):
    with pytest.raises(ValueError, match=r"not a bandwidth; write e\.g\. 10Gbit/s"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text", ["0 Gbit/s", "-1 Gbit/s", 0, -5.0])
def test_parse_bandwidth_must_be_positive(text):
    with pytest.raises(ValueError, match="must be positive"):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1ms", 1e-3), ("5us", 5e-6), ("10us", 1e-5), ("2 s", 2.0), ("0s", 0.0), (0.25, 0.25)],
)
def test_parse_duration(text, seconds):
    # Exact: 15 significant digits strip pint's one-ulp noise from decimal prefixes.
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5 GB", "1", "soon", "1 m/s"])
def test_parse_duration_rejects_non_times(text):
    with pytest.raises(ValueError, match=r"not a duration; write e\.g\. 1ms"):
        parse_duration(text)


def test_parse_duration_rejects_negative():
    with pytest.raises(ValueError, match="must not be negative"):
        parse_duration("-1ms")


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("16GiB", 16 * 2**30),
        ("8 GB", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("4Gbit", 5 * 10**8),
        ("1 PiB", 2**50),
        (1024, 1024),
    ],
)
def test_parse_size_distinguishes_mib_from_mbit(text, num_bytes):
    size = parse_size(text)
    assert size == num_bytes
    assert isinstance(size, int)


@pytest.mark.parametrize("text", ["8 KB", "8 mB", "16 GiB/s", "lots"])
def test_parse_size_rejects_bad_text(text):
    with pytest.raises(ValueError, match=r"not a size; write e\.g\. 16GiB"):
        parse_size(text)


def test_parse_size_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        parse_size("0 GiB")


@pytest.mark.parametrize(
    ("text", "flops_per_s"),
    [("989 TFLOP/s", 989e12), ("19.5TFLOPS", 19.5e12), ("1e12 FLOP/s", 1e12), ("500 GFLOPS", 5e11), (2e12, 2e12)],
)
def test_parse_flops(text, flops_per_s):
    assert parse_flops(text) == pytest.approx(flops_per_s, rel=1e-12)


@pytest.mark.parametrize("text", ["12 TOPS", "x TFLOPS", "100 GB/s", "5 XFLOPS"])
def test_parse_flops_rejects_bad_text(text):
    with pytest.raises(ValueError, match=r"not a compute rate; write e\.g\. 989 TFLOP/s"):
        parse_flops(text)


def test_parse_flops_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        parse_flops("0 TFLOP/s")
