"""What a parallel strategy is to the simulator and the runtime: the :class:`Strategy` protocol."""

from __future__ import annotations

from typing import Protocol

from models.ops import OpKind
from models.shards import TensorShard
from models.spec import ModelSpec
from sim.program import Phase, Stage
from sim.vocabulary import PhaseKind


class Strategy(Protocol):
    """A way of running a forward pass over a group of ranks, lowered into per-rank programs.

    ``name`` is what a scenario's ``strategy`` field writes. ``calls`` lists the collectives the
    strategy calls, each with the field of :class:`sim.strategies.StrategyChoice` naming its
    algorithm, e.g. ``((OpKind.ALLREDUCE, "allreduce"), (OpKind.BROADCAST, "broadcast"))``:
    calibration and validation ask this which algorithms to time, and the choice is validated
    against it.
    """

    name: str
    calls: tuple[tuple[OpKind, str], ...]

    def lower(self, model: ModelSpec, batch_size: int, ranks: tuple[int, ...], algorithms: dict[OpKind, str],
              name: PhaseKind, step: int, new_tokens: int, context_tokens: int, stage: Stage | None = None, *,
              shards: tuple[TensorShard, ...] | None = None) -> Phase:
        """The forward pass ``name``/``step`` of ``batch_size`` sequences, ``new_tokens`` each
        attending to ``context_tokens`` (cache included), on ``ranks`` (``ranks[0]`` is the
        master, which embeds and samples); ``algorithms``: the algorithm of each collective kind
        in ``calls``. ``stage``: only that pipeline stage's part (:class:`sim.program.Stage`),
        passed only when the plan has more than one stage; None: the whole model. ``shards``: each
        rank's slice of the layers (:mod:`models.shards`), in the order of ``ranks``, when the split
        is uneven (None: even)."""
        ...
