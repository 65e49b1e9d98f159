"""Bounded work: the size of a simulation estimated before it starts, and refused past the limits.

A scenario can ask for more than any machine finishes: a thousand ranks, a hundred variants, a
million decode steps. Two quantities bound what :func:`sim.simulate.simulate` does, and both are
known from the scenario before the first event:

* **work units** ``variants x layers x ranks^1.25 x sampled steps``: the engine runs every op of
  every rank of each sampled step, and a collective's schedule grows with its group (the exponent
  fits the run time of ring, tree and doubling variants on 16 to 64 ranks). The timeline samples
  about ``3 + 2 log2(output_tokens)`` steps (:mod:`sim.timeline`). A variant that streams its
  weights (``sliding_window``) counts :data:`STREAMED_VARIANT_WEIGHT` times: its weight loads
  share links through the loader's events (Llama-2-7B on 8 ranks: 0.09 s resident, 1.0 to 1.4 s
  streamed). One unit takes about 12 to 25 us on one core of the development machine, so
  :data:`MAX_WORK_UNITS` is 20 to 40 s there.
* **trace rows** ``variants x ranks x (2 x output_tokens + 60 x (layers + 1))``: the trace keeps
  a step span and a memory sample per rank and step, and for the two expanded steps (prefill and
  first decode step) about 10 ops and 20 memory samples per layer and rank; the Chrome trace holds
  one event per row. A row costs about 0.8 KB of memory and 15 to 20 us to write, so
  :data:`MAX_TRACE_ROWS` is about 600 MB and 12 to 15 s.

A sweep adds up its points (:data:`MAX_SWEEP_WORK_UNITS`). The errors name the field that sets the
dominant factor: ``variants`` (or ``sweep.memory``) when one variant alone would fit, else
``workload.output_tokens`` when the tokens dominate the rows, else the ranks' field
(``parallel.tensor``, or ``cluster`` when every device is used).
"""

from __future__ import annotations

import math

from models.errors import ConfigError

MAX_WORK_UNITS = 1_500_000
MAX_SWEEP_WORK_UNITS = 12_000_000  # the shipped memory sweep is about 6e6 (95 s), with a progress bar
STREAMED_VARIANT_WEIGHT = 15
MAX_TRACE_ROWS = 750_000
_ROWS_PER_LAYER = 60
_RANK_EXPONENT = 1.25


def sampled_steps(output_tokens: int) -> int:
    """About how many steps the timeline simulates of a run of ``output_tokens`` (prefill included)."""
    return min(output_tokens, 3 + 2 * math.ceil(math.log2(max(output_tokens, 2))))


def work_units(num_variants: int, num_layers: int, num_ranks: int, output_tokens: int,
               streamed_variants: int = 0) -> float:
    """The estimated engine work of a simulation (dimensionless; see the module docstring);
    ``streamed_variants`` of the ``num_variants`` stream their weights."""
    weighted = num_variants + (STREAMED_VARIANT_WEIGHT - 1) * streamed_variants
    return weighted * num_layers * num_ranks ** _RANK_EXPONENT * sampled_steps(output_tokens)


def trace_rows(num_variants: int, num_layers: int, num_ranks: int, output_tokens: int) -> int:
    """The estimated rows of the traces of a simulation (see the module docstring)."""
    return num_variants * num_ranks * (2 * output_tokens + _ROWS_PER_LAYER * (num_layers + 1))


def check_job_size(num_variants: int, num_layers: int, num_ranks: int, output_tokens: int, *,
                   ranks_field: str, variants_field: str = "variants", streamed_variants: int = 0) -> float:
    """Raise :class:`ConfigError` if the simulation would exceed :data:`MAX_WORK_UNITS` or
    :data:`MAX_TRACE_ROWS`; return its work units otherwise.

    ``ranks_field`` is the field that set the number of ranks (``parallel.tensor``, or ``cluster``
    when every device of the cluster is used), ``variants_field`` the one that set the number of
    variants, ``streamed_variants`` how many of them stream their weights. The error names the
    field of the dominant factor (see the module docstring).
    """
    streamed = f" ({streamed_variants} streaming weights)" if streamed_variants else ""
    shape = f"{num_variants} variants{streamed} x {num_layers} layers on {num_ranks} ranks"
    rows = trace_rows(num_variants, num_layers, num_ranks, output_tokens)
    if rows > MAX_TRACE_ROWS:
        if trace_rows(1, num_layers, num_ranks, output_tokens) <= MAX_TRACE_ROWS:
            field, value = variants_field, f"{num_variants} variants"
        elif 2 * output_tokens >= _ROWS_PER_LAYER * (num_layers + 1):
            field, value = "workload.output_tokens", str(output_tokens)
        else:
            field, value = ranks_field, f"{num_ranks} ranks"
        raise ConfigError(field, f"{shape} with {output_tokens} output tokens make about {rows} trace rows, more than "
                                 f"the {MAX_TRACE_ROWS} hetsim keeps in memory; simulate fewer variants, ranks, layers "
                                 f"or tokens (got {value})")
    work = work_units(num_variants, num_layers, num_ranks, output_tokens, streamed_variants)
    if work > MAX_WORK_UNITS:
        alone_fits = work_units(1, num_layers, num_ranks, output_tokens, min(streamed_variants, 1)) <= MAX_WORK_UNITS
        field, value = (variants_field, f"{num_variants} variants") if alone_fits else (ranks_field, f"{num_ranks} ranks")
        raise ConfigError(field, f"{shape} is estimated at {work:.3g} work units, more than the {MAX_WORK_UNITS:.3g} "
                                 f"hetsim runs (minutes); use fewer variants, ranks or layers (got {value})")
    return work
