"""The time of one iteration of a continuous-batching server: one forward pass over the decode
tokens of the running requests and the prefill chunks scheduled with them.

Each pass is priced by the simulator itself: the variant's strategy lowers a forward pass
(:data:`sim.strategies.STRATEGIES`) and the engine prices it on the cluster (compute roofline or
calibration, collectives on the network model), exactly as an inference scenario's steps are.

A mixed iteration (decodes plus prefill chunks, Sarathi-Serve's hybrid batch: Agrawal et al. 2024,
arXiv 2403.02310) is priced as the decode pass plus each chunk's *marginal* cost over the smallest
pass: ``D(b, c) + sum_i [G(n_i, k_i) - D(1, 1)]``, where ``D(b, c)`` is a decode pass of ``b``
sequences at mean context ``c`` and ``G(n, k)`` a prefill pass of ``n`` new tokens ending at
context ``k``. What every pass pays once (reading the weights, the collectives' latencies, per-op
overheads) is counted once; what grows with tokens (FLOPs, activation bytes, KV reads) adds. This is
exact where a pass's time is a sum of a fixed and a per-token part, and an approximation where a
roofline ``max`` switches regime inside the fused pass.

Per-sequence attention cost is linear in its context, so a decode pass over sequences of unequal
contexts costs what one at their mean context costs. Passes are evaluated on a grid (contexts every
:data:`CONTEXT_STEP` tokens, prefill chunks every :data:`CHUNK_STEP` tokens) and interpolated
linearly between grid points; each grid point is simulated once and cached.
"""

from __future__ import annotations

import math

from models.shards import TensorShard
from models.spec import ModelSpec
from sim.engine import Engine
from sim.pipeline import TOKEN_BYTES, hidden_bytes
from sim.program import Stage
from sim.strategies import StrategyChoice
from sim.vocabulary import PhaseKind

CONTEXT_STEP = 256
CHUNK_STEP = 64


class IterationCost:
    """Iteration times (s) of one variant on one group of ranks.

    Args:
        model: the model served.
        ranks: the tensor-parallel group (topology ranks, the master first).
        choice: the variant's strategy and algorithms.
        engine: the engine pricing passes on the scenario's cluster.
        shards: each rank's slice of the layers when the split is uneven (:mod:`models.shards`, in
            the order of ``ranks``); None: even.
        stage: a pipeline stage's part of the model (:class:`sim.program.Stage`); None: all of it.
    """

    def __init__(self, model: ModelSpec, ranks: tuple[int, ...], choice: StrategyChoice, engine: Engine,
                 shards: tuple[TensorShard, ...] | None = None, stage: Stage | None = None):
        self.model, self.ranks, self.choice, self.engine, self.shards = model, ranks, choice, engine, shards
        # Only a pipeline stage passes a stage (as sim.plan._lowered): a strategy that knows no pipeline still lowers.
        self._stage = {} if stage is None else {"stage": stage}
        self._passes: dict[tuple[int, int, int], float] = {}
        self._smallest: float | None = None  # the smallest pass, D(1, 1)

    def _pass_s(self, batch: int, new_tokens: int, context: int) -> float:
        key = (batch, new_tokens, context)
        if key not in self._passes:
            # A one-token pass is a decode step whatever its context; the lowering prices both alike.
            kind, step = (PhaseKind.DECODE, 1) if new_tokens == 1 else (PhaseKind.PREFILL, 0)
            phase = self.choice.implementation.lower(self.model, batch, self.ranks, self.choice.algorithms, kind, step,
                                                     new_tokens, context, shards=self.shards, **self._stage)
            self._passes[key] = sum(seg.repeat * self.engine.run_segment(seg).duration_s for seg in phase.segments)
        return self._passes[key]

    def decode_s(self, batch: int, mean_context: float) -> float:
        """A decode pass: ``batch`` sequences, one new token each, at ``mean_context`` tokens."""
        lo, hi, w = _bracket(max(mean_context, 1.0), CONTEXT_STEP)
        return (1 - w) * self._pass_s(batch, 1, lo) + w * self._pass_s(batch, 1, hi) if w else self._pass_s(batch, 1, lo)

    def prefill_s(self, new_tokens: int, context_end: int) -> float:
        """A prefill pass of one sequence: ``new_tokens`` tokens ending at ``context_end`` tokens."""
        n_lo, n_hi, wn = _bracket(new_tokens, CHUNK_STEP)
        total = 0.0
        for n, weight_n in ((n_lo, 1 - wn), (n_hi, wn)):
            if not weight_n:
                continue
            k_lo, k_hi, wk = _bracket(max(context_end, n), CONTEXT_STEP)
            k_lo = max(k_lo, n)
            value = self._pass_s(1, n, k_lo)
            if wk:
                value = (1 - wk) * value + wk * self._pass_s(1, n, max(k_hi, n))
            total += weight_n * value
        return total

    def iteration_s(self, decodes: int, mean_context: float, chunks: list[tuple[int, int]]) -> float:
        """One iteration: ``decodes`` decode tokens at ``mean_context``, plus prefill ``chunks``
        (``(new_tokens, context_end)`` each), by the marginal composition of the module docstring."""
        if self._smallest is None:
            self._smallest = self.decode_s(1, 1)
        smallest = self._smallest
        total = self.decode_s(decodes, mean_context) if decodes else smallest
        return total + sum(self.prefill_s(n, k) - smallest for n, k in chunks)

    @property
    def passes_simulated(self) -> int:
        """How many distinct forward passes were simulated (grid points)."""
        return len(self._passes)


class ServerCost:
    """What one server's iterations cost: each pipeline stage's part (one stage: a tensor-parallel
    group running the whole model) and the messages between stages.

    A stage's part of an iteration is its :class:`IterationCost` (its layers, on its group). After
    its part, stage s's master sends the residual stream of every token of the iteration to stage
    s + 1's master, and the last stage's master sends the sampled token of every sequence back to
    the first stage's master (:meth:`sim.pipeline.PipelinePlan.hop_on`), each message priced by
    the network model (:meth:`sim.engine.Engine.message_s`) and cached by size: alone, or at once
    with the same hop of each pipeline of ``beside`` (other replicas' stage masters, in stage
    order), the links they cross shared with them.

    Args:
        model: the model served.
        stages: each stage's iteration costs, in order.
        masters: each stage's master (topology rank), in order.
        engine: the engine pricing the messages.
        beside: the stage masters of the other pipelines whose hops go at once with this one's
            (:func:`sim.serving.simulate.serve_replicas`: the replicas in an iteration at once).
    """

    def __init__(self, model: ModelSpec, stages: tuple[IterationCost, ...], masters: tuple[int, ...], engine: Engine,
                 beside: tuple[tuple[int, ...], ...] = ()):
        self.model, self.stages, self.masters, self.engine = model, stages, masters, engine
        self.beside = beside
        self._hops: dict[tuple[int, int], float] = {}
        self._hop_of: dict[tuple[int, int, int], float] = {}  # (stage, tokens, sequences) -> its message (s)
        # alike stages share one cost (sim.serving.simulate): each is priced once per iteration
        self._distinct = list({id(stage): stage for stage in stages}.values())
        self._index = [self._distinct.index(stage) for stage in stages]

    def stage_s(self, decodes: int, mean_context: float, chunks: list[tuple[int, int]]) -> list[float]:
        """Each stage's part (s) of one iteration (:meth:`IterationCost.iteration_s`)."""
        if len(self.stages) == 1:
            return [self.stages[0].iteration_s(decodes, mean_context, chunks)]
        times = [stage.iteration_s(decodes, mean_context, chunks) for stage in self._distinct]
        return [times[i] for i in self._index]

    def hop_s(self, stage: int, tokens: int, sequences: int) -> float:
        """The message (s) ``stage`` sends after its part of an iteration of ``tokens`` tokens over
        ``sequences`` sequences: their residual stream to the next stage, or from the last stage
        their sampled tokens to the first; 0 with a single stage."""
        if len(self.stages) == 1:
            return 0.0
        known = self._hop_of.get((stage, tokens, sequences))
        if known is not None:
            return known
        last = stage == len(self.stages) - 1
        size = sequences * TOKEN_BYTES if last else hidden_bytes(self.model, tokens)
        key = (stage, size)
        if key not in self._hops:
            to = 0 if last else stage + 1
            self._hops[key] = self.engine.message_s(self.masters[stage], self.masters[to], size,
                                                    tuple((other[stage], other[to]) for other in self.beside))
        self._hop_of[stage, tokens, sequences] = self._hops[key]
        return self._hops[key]


def _bracket(x: float, step: int) -> tuple[int, int, float]:
    """Grid points around ``x`` (1, step, 2 step, ...) and the weight of the upper one."""
    if x <= 1:
        return 1, 1, 0.0
    lo = max(1, int(math.floor(x / step)) * step)
    if lo == x:
        return lo, lo, 0.0
    hi = lo + step if lo > 1 else step
    return lo, hi, (x - lo) / (hi - lo)
