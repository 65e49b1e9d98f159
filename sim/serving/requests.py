"""The requests of a serving workload: when each arrives and how long its prompt and output are.

Arrivals are a Poisson process (exponential inter-arrival times at ``rate_per_s``) drawn from
``numpy.random.default_rng(seed)``, so the same workload gives the same requests. A trace file gives
the lengths (and optionally the arrival times) of real requests instead.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.errors import ConfigError
from models.input_files import read_text
from models.spec import ModelSpec
from sim.serving.config import MAX_REQUESTS, ServingWorkload

TRACE_COLUMNS = ("prompt_tokens", "output_tokens")
"""Columns a trace must have; ``arrival_s`` (seconds from the start, non-decreasing) is optional."""
MAX_TRACE_BYTES = 16 << 20


@dataclass(frozen=True)
class Request:
    """One request: ``index`` in arrival order, ``arrival_s`` (s from the start of the run), its
    prompt and output lengths (tokens, > 0)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_arrivals(rate_per_s: float, count: int, seed: int) -> np.ndarray:
    """``count`` arrival times (s, increasing, the first after 0) of a Poisson process of rate
    ``rate_per_s`` requests per second, from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=count))


def read_trace(path: Path, model: ModelSpec, field: str = "workload.trace") -> list[tuple[int, int, float | None]]:
    """``(prompt_tokens, output_tokens, arrival_s or None)`` per row of a CSV trace.

    Raises:
        ConfigError: on ``field``: an unreadable, oversized or empty file, a missing column, a row
            whose lengths are not positive integers or exceed ``model``'s context, arrival times on
            some rows only, decreasing or negative, or more than :data:`MAX_REQUESTS` rows. The
            message names the row.
    """
    text = read_text(path, field, MAX_TRACE_BYTES)
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(field, f"a trace needs the columns {', '.join(TRACE_COLUMNS)} (and optionally arrival_s); "
                                 f"missing {', '.join(missing)} (got {path.name})")
    rows: list[tuple[int, int, float | None]] = []
    for number, row in enumerate(reader, start=2):  # line 1 is the header
        if len(rows) >= MAX_REQUESTS:
            raise ConfigError(field, f"more than {MAX_REQUESTS} requests (got {path.name})")
        lengths = []
        for column in TRACE_COLUMNS:
            value = (row.get(column) or "").strip()
            if not value.isdigit() or int(value) == 0 or len(value) > 9:
                raise ConfigError(field, f"line {number}: {column} must be a positive integer (got {value!r})")
            lengths.append(int(value))
        if sum(lengths) > model.max_position_embeddings:
            raise ConfigError(field, f"line {number}: prompt_tokens + output_tokens = {sum(lengths)} exceeds "
                                     f"{model.name}'s context of {model.max_position_embeddings} tokens")
        arrival = _arrival(row.get("arrival_s"), number, field, rows[-1][2] if rows else None, bool(rows))
        rows.append((lengths[0], lengths[1], arrival))
    if not rows:
        raise ConfigError(field, f"no requests in the trace (got {path.name})")
    if len({r[2] is None for r in rows}) > 1:
        raise ConfigError(field, "arrival_s is given on some rows only; give it on every row or none")
    return rows


def _arrival(text: str | None, number: int, field: str, previous: float | None, has_previous: bool) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(field, f"line {number}: arrival_s must be a number of seconds (got {text!r})") from None
    if not np.isfinite(value) or value < 0 or (previous is not None and value < previous):
        raise ConfigError(field, f"line {number}: arrival_s must be finite, >= 0 and non-decreasing (got {text!r})")
    return value


def workload_requests(workload: ServingWorkload, model: ModelSpec, base_dir: Path = Path(".")) -> list[Request]:
    """The requests of ``workload`` in arrival order: ``requests`` Poisson arrivals with the inline
    lengths, or the trace's rows (its arrival times, else Poisson arrivals at ``rate_per_s``).

    Raises:
        ConfigError: see :func:`read_trace`.
    """
    if workload.trace is None:
        arrivals = poisson_arrivals(workload.rate_per_s, workload.requests, workload.seed)
        return [Request(i, float(t), workload.prompt_tokens, workload.output_tokens) for i, t in enumerate(arrivals)]
    path = Path(workload.trace)
    rows = read_trace(path if path.is_absolute() else base_dir / path, model)
    if rows[0][2] is None:
        arrivals = poisson_arrivals(workload.rate_per_s, len(rows), workload.seed)
        rows = [(p, o, float(t)) for (p, o, _), t in zip(rows, arrivals)]
    return [Request(i, t, p, o) for i, (p, o, t) in enumerate(rows)]


def at_rate(requests: list[Request], rate_per_s: float, seed: int, count: int | None = None) -> list[Request]:
    """The same request lengths arriving as a Poisson process at ``rate_per_s`` (for a search over
    rates: only the arrival times change); ``count`` requests (default: as many as given), the
    lengths repeated in order where it is more."""
    count = len(requests) if count is None else count
    arrivals = poisson_arrivals(rate_per_s, count, seed)
    return [Request(i, float(t), requests[i % len(requests)].prompt_tokens, requests[i % len(requests)].output_tokens)
            for i, t in enumerate(arrivals)]
