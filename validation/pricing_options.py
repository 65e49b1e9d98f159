"""The simulator's switchable pricing pieces, as on/off flags of the offline benchmarks.

Each piece is a module-level setting of the simulator, read when a run is priced; an offline
re-simulation (``benchmarks/bench_transfer_offline.py``, ``benchmarks/bench_layouts_offline.py``,
``benchmarks/bench_uneven_calls.py``, ``benchmarks/bench_training_offline.py``) sets them from its
command line, ``--FLAG`` on and ``--no-FLAG`` off, a flag not given leaving the default, and names
the flags it ran with in the command it writes beside its figures:

* ``--token-buckets``: the links' declared token buckets (:data:`sim.token_bucket.PRICED`, on by
  default);
* ``--arrival-lags``: the master's expected wait for the last rank on shared cores in a prefill
  (:data:`sim.cores.ARRIVAL_LAGS_PRICED`, on by default);
* ``--gloo-tree``: ``library``'s broadcast priced as gloo's own tree, every rank posting all its
  sends at once (:data:`sim.collectives.registry.LIBRARY_BROADCAST`, on by default; off: MPICH's
  binomial order);
* ``--core-turns``: ranks sharing cores take turns on them instead of sharing them fluidly
  (:data:`sim.cores.SCHEDULING`, off by default);
* ``--by-shape``: a prediction prices forward ops by the profile's isolated rows where it has them
  (:data:`sim.simulate.BY_SHAPE`, on by default; off: by the in-place rows).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PricingOption:
    """One switch: its flag, its help line, and how it sets the simulator (``True``: on)."""

    flag: str
    help: str
    set: Callable[[bool], None]

    @property
    def dest(self) -> str:
        """The flag's attribute on parsed arguments."""
        return self.flag.removeprefix("--").replace("-", "_")


def _token_buckets(on: bool) -> None:
    from sim import token_bucket

    token_bucket.PRICED = on


def _arrival_lags(on: bool) -> None:
    from sim import cores

    cores.ARRIVAL_LAGS_PRICED = on


def _gloo_tree(on: bool) -> None:
    from sim.collectives import registry

    registry.LIBRARY_BROADCAST = registry.LibraryBroadcast.GLOO_TREE if on else registry.LibraryBroadcast.BINOMIAL


def _core_turns(on: bool) -> None:
    from sim import cores

    cores.SCHEDULING = cores.CoreScheduling.TURNS if on else cores.CoreScheduling.PROCESSOR_SHARING


def _by_shape(on: bool) -> None:
    from sim import simulate

    simulate.BY_SHAPE = on


OPTIONS = (
    PricingOption("--token-buckets", "price the links' declared token buckets (sim.token_bucket.PRICED, on by default)",
                  _token_buckets),
    PricingOption("--arrival-lags", "the master's expected wait for the last rank on shared cores in a prefill "
                                    "(sim.cores.ARRIVAL_LAGS_PRICED, on by default)", _arrival_lags),
    PricingOption("--gloo-tree", "price library's broadcast as gloo's own tree, every rank posting all its sends "
                                 "at once (sim.collectives.registry.LIBRARY_BROADCAST, on by default; off: MPICH's "
                                 "binomial order)", _gloo_tree),
    PricingOption("--core-turns", "ranks sharing cores take turns on them (sim.cores.TakingTurns) instead of sharing "
                                  "them fluidly (off by default)", _core_turns),
    PricingOption("--by-shape", "a prediction prices forward ops by the profile's compute_isolated rows where it has "
                                "them (sim.simulate.BY_SHAPE, on by default; off: by the in-place compute rows)",
                  _by_shape),
)
"""Every switch, in the order a command names them."""


def add_pricing_options(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Add the flags of :data:`OPTIONS` (only those whose flag is in ``names`` where given) to
    ``parser``, each with its ``--no-`` form; not given, a flag parses as None (the default)."""
    for option in OPTIONS:
        if names is None or option.flag in names:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=option.help)


def apply_pricing_options(args: argparse.Namespace) -> list[str]:
    """Set the simulator as the parsed ``args`` say (an option the parser lacks, or one not given,
    is left as it is); the flags given (``--FLAG`` or ``--no-FLAG``), in :data:`OPTIONS` order, for
    the command a report names."""
    given = []
    for option in OPTIONS:
        value = getattr(args, option.dest, None)
        if value is not None:
            option.set(bool(value))
            given.append(option.flag if value else "--no-" + option.flag.removeprefix("--"))
    return given
