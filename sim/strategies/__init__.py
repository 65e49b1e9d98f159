"""The strategies a scenario can name, and the validated choice of one with its algorithms.

:data:`STRATEGIES` maps the name a scenario's ``strategy`` field writes to its implementation
(:class:`sim.strategies.base.Strategy`). Adding a strategy is one module and one line here; the
plan, the scenario's validation, calibration and validation ask this registry, and the runtime
executes the lowered ops by their typed fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from models.errors import ConfigError
from models.ops import OpKind
from sim.collectives.registry import LIBRARY, known_algorithms
from sim.strategies.allreduce_ln import AllreduceLn
from sim.strategies.base import Strategy
from sim.strategies.reduce_ln_bcast import ReduceLnBcast

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (AllreduceLn(), ReduceLnBcast())}
"""Implementations by the name a scenario writes. The first is the default: calibration generates
with it (every algorithm ``library``) when no variant names its algorithms."""


def get_strategy(name: str, field: str = "strategy") -> Strategy:
    """The strategy called ``name``.

    Raises:
        ConfigError: on ``field``, an unknown name, listing the known ones.
    """
    if name not in STRATEGIES:
        raise ConfigError(field, f"unknown strategy; known: {', '.join(STRATEGIES)} (got {name!r})")
    return STRATEGIES[name]


@dataclass(frozen=True)
class StrategyChoice:
    """A strategy and the algorithms of the collectives it calls, validated on construction.

    ``allreduce``, ``reduce``, ``broadcast``: algorithm names (a key of
    :data:`sim.collectives.registry.ALGORITHMS` for the kind, ``library`` or ``auto``); only the
    kinds the strategy calls (:attr:`Strategy.calls`) are used. ``allreduce`` has no default: a
    strategy that allreduces must name it, and one that does not must leave it unset.

    Raises:
        ConfigError: an unknown strategy or algorithm (listing the known ones), an algorithm the
            strategy needs and lacks, or one it does not take.
    """

    strategy: str
    allreduce: str | None = None
    reduce: str = "binomial"
    broadcast: str = "binomial"

    def __post_init__(self) -> None:
        implementation = get_strategy(self.strategy)
        called = {name for _, name in implementation.calls}
        for kind, name in implementation.calls:
            algorithm = getattr(self, name)
            if algorithm is None:
                raise ConfigError(name, f"strategy {self.strategy} calls {kind} and needs '{name}' "
                                        f"(an algorithm or auto)")
            known = known_algorithms(kind)
            if algorithm not in known:
                raise ConfigError(name, f"unknown {kind} algorithm; known: {', '.join(known)} (got {algorithm!r})")
        for f in fields(self):
            if f.name != "strategy" and f.name not in called and f.default is None and getattr(self, f.name) is not None:
                takes = ", ".join(f"'{name}'" for _, name in implementation.calls)
                raise ConfigError(f.name, f"strategy {self.strategy} takes {takes}, not '{f.name}' "
                                          f"(got {getattr(self, f.name)!r})")

    @classmethod
    def library(cls, strategy: str) -> StrategyChoice:
        """``strategy`` with the communication backend's own algorithm for every collective it calls."""
        return cls(strategy, **{name: LIBRARY for _, name in get_strategy(strategy).calls})

    @property
    def implementation(self) -> Strategy:
        return STRATEGIES[self.strategy]

    @property
    def algorithms(self) -> dict[OpKind, str]:
        """The algorithm of each collective kind the strategy calls."""
        return {kind: getattr(self, name) for kind, name in self.implementation.calls}
