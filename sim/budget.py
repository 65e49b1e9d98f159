"""Bounded work: the size of a simulation estimated before it starts, and refused past the limits.

A scenario can ask for more than any machine finishes: a thousand ranks, a hundred variants, a
million decode steps. Two quantities bound what :func:`sim.simulate.simulate` does, and both are
known from the scenario before the first event:

* **work units** ``variants x layers x ranks^1.25 x sampled steps``: the engine runs every op of
  every rank of each sampled step, and a collective's schedule grows with its group (the exponent
  fits the run time of ring, tree and doubling variants on 16 to 64 ranks). The timeline samples
  about ``3 + 2 log2(output_tokens)`` steps (:mod:`sim.timeline`). One unit takes about 25 us on
  one core of the development machine, so :data:`MAX_WORK_UNITS` is about 40 s there.
* **step rows** ``variants x ranks x output_tokens``: the trace keeps one memory sample per rank
  and step (``Trace.memory``) and the Chrome trace one event each, about 1.4 KB of memory per row,
  so :data:`MAX_STEP_ROWS` is about 1 GB.

A sweep adds up its points (:data:`MAX_SWEEP_WORK_UNITS`). The errors name the field that sets the
dominant factor (``parallel.tensor`` or ``cluster``, ``workload.output_tokens``, ``variants``).
"""

from __future__ import annotations

import math

from models.errors import ConfigError

MAX_WORK_UNITS = 1_500_000
MAX_SWEEP_WORK_UNITS = 6_000_000
MAX_STEP_ROWS = 600_000
_RANK_EXPONENT = 1.25


def sampled_steps(output_tokens: int) -> int:
    """About how many steps the timeline simulates of a run of ``output_tokens`` (prefill included)."""
    return min(output_tokens, 3 + 2 * math.ceil(math.log2(max(output_tokens, 2))))


def work_units(num_variants: int, num_layers: int, num_ranks: int, output_tokens: int) -> float:
    """The estimated engine work of a simulation (dimensionless; see the module docstring)."""
    return num_variants * num_layers * num_ranks ** _RANK_EXPONENT * sampled_steps(output_tokens)


def check_job_size(num_variants: int, num_layers: int, num_ranks: int, output_tokens: int, *,
                   ranks_field: str, variants_field: str = "variants") -> float:
    """Raise :class:`ConfigError` if the simulation would exceed :data:`MAX_WORK_UNITS` or
    :data:`MAX_STEP_ROWS`; return its work units otherwise.

    ``ranks_field`` is the field that set the number of ranks (``parallel.tensor``, or ``cluster``
    when every device of the cluster is used), ``variants_field`` the one that set the number of
    variants; the error names the variants' field when one variant alone would fit.
    """
    rows = num_variants * num_ranks * output_tokens
    if rows > MAX_STEP_ROWS:
        raise ConfigError("workload.output_tokens",
                          f"{num_variants} variants x {num_ranks} ranks x {output_tokens} output tokens = {rows} "
                          f"trace rows, more than the {MAX_STEP_ROWS} hetsim keeps in memory; simulate fewer "
                          f"tokens, ranks or variants (got {output_tokens})")
    work = work_units(num_variants, num_layers, num_ranks, output_tokens)
    if work > MAX_WORK_UNITS:
        alone_fits = work_units(1, num_layers, num_ranks, output_tokens) <= MAX_WORK_UNITS
        raise ConfigError(variants_field if alone_fits else ranks_field,
                          f"{num_variants} variants x {num_layers} layers on {num_ranks} ranks is estimated at "
                          f"{work:.3g} work units, more than the {MAX_WORK_UNITS:.3g} hetsim runs (minutes); "
                          f"use fewer ranks, variants or layers (got {num_variants} variants on {num_ranks} ranks)")
    return work
