"""The pipeline plan: a model's layers in stages, a batch in micro-batches (GPipe).

GPipe (Huang et al. 2019, arXiv 1811.06965, section 2.2) splits the layers into P consecutive
stages and a batch into m micro-batches; stage s runs micro-batch j once stage s-1 has sent it
the residual stream, so the stages work at once on different micro-batches, and the pipeline
fills and drains around them (the bubble, (P - 1) stage times of m + P - 1). hetsim lowers each
stage's part of a forward pass with the variant's tensor-parallel strategy on the stage's group
(:class:`sim.plan.Plan` with a :class:`sim.program.Stage`): the first stage embeds, the last
normalises and samples; between stages the masters send the residual stream point to point
(:class:`Hop`), and in decode the last stage's master sends the sampled tokens back to the first
stage's, which embeds them for the next step (the relay of a batch-1 decode).

What a rank runs, in order, for every micro-batch: receive (not on the first stage), the stage's
phase, send. The simulator (:mod:`sim.pipeline_run`) and the runtime (:mod:`runtime.pipeline`)
walk the same :class:`PipelinePlan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from models.errors import ConfigError
from models.spec import ModelSpec
from sim.parallel import ParallelPlan, even_stages
from sim.plan import MemoryCategory, MemoryPolicy, Plan, Stage
from sim.strategies import StrategyChoice

TOKEN_BYTES = 8
"""Bytes of one sampled token id sent back from the last stage (torch.long)."""


def pipeline_stages(parallel: ParallelPlan) -> tuple[Stage, ...]:
    """The part of the model each stage of ``parallel`` runs: its layers; the first stage embeds,
    the last normalises and samples."""
    last = parallel.pipeline - 1
    return tuple(Stage(first, layers, embeds=s == 0, heads=s == last)
                 for s, (first, layers) in enumerate(zip(parallel.stage_first_layers, parallel.stages)))


def hidden_bytes(model: ModelSpec, tokens: int) -> int:
    """Bytes of the residual stream of ``tokens`` tokens that a stage sends the next: [tokens,
    hidden] in the model's dtype."""
    return tokens * model.hidden_size * model.dtype_bytes


@dataclass(frozen=True, slots=True)
class Hop:
    """A point-to-point message between two stage masters: ``size_bytes`` from ``src`` to ``dst``
    (global ranks); ``tokens``: the sampled token ids going back to the first stage (else the
    residual stream going on to the next)."""

    src: int
    dst: int
    size_bytes: int
    tokens: bool = False


@dataclass(frozen=True)
class PipelinePlan:
    """Inference of ``model`` by a pipeline of stages, each a tensor-parallel group.

    Attributes:
        stage_ranks: per stage, its group's global ranks (the first is the stage's master).
        stages: per stage, the layers it runs (:class:`sim.program.Stage`).
        micro_batches: the sequences of each micro-batch (sum: the batch), in the order every
            stage runs them.
        prompt_tokens, output_tokens, strategy, runtime_memory_bytes: as in :class:`sim.plan.Plan`.

    The first stage's master embeds the prompt and holds the generated tokens; it is
    :attr:`master`.
    """

    model: ModelSpec
    stage_ranks: tuple[tuple[int, ...], ...]
    stages: tuple[Stage, ...]
    micro_batches: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    strategy: StrategyChoice
    runtime_memory_bytes: dict[int, int] = field(default_factory=dict)
    _plans: dict[tuple[int, int], Plan] = field(default_factory=dict, compare=False, repr=False)

    memory_policy = MemoryPolicy()  # resident weights: streaming is refused with a pipeline

    @classmethod
    def of(cls, parallel: ParallelPlan, batch_size: int, prompt_tokens: int, output_tokens: int,
           strategy: StrategyChoice, micro_batches: int | None = None,
           runtime_memory_bytes: dict[int, int] | None = None, replica: int = 0) -> PipelinePlan:
        """The pipeline of ``parallel``'s replica ``replica`` (its stages and their groups,
        :attr:`sim.parallel.ParallelPlan.replica_stage_ranks`) for a batch of ``batch_size``
        sequences (the replica's share) split into ``micro_batches`` (default: the stages or the
        batch, whichever is smaller), as even as possible, the earlier micro-batches one sequence
        larger.

        Raises:
            ConfigError: on ``parallel.micro_batches``, more micro-batches than sequences.
        """
        count = micro_batches or min(parallel.pipeline, batch_size)
        if count > batch_size:
            whose = f"replica {replica}'s share of the batch" if parallel.replicas > 1 else "the batch"
            raise ConfigError("parallel.micro_batches", f"more micro-batches than the {batch_size} sequences of "
                                                        f"{whose} (got {count})")
        return cls(parallel.model, parallel.replica_stage_ranks[replica], pipeline_stages(parallel),
                   even_stages(batch_size, count), prompt_tokens, output_tokens, strategy, runtime_memory_bytes or {})

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, stage by stage."""
        return tuple(r for ranks in self.stage_ranks for r in ranks)

    @property
    def master(self) -> int:
        return self.stage_ranks[0][0]

    @property
    def batch_size(self) -> int:
        return sum(self.micro_batches)

    @property
    def num_phases(self) -> int:
        """Prefill plus one decode step per further output token."""
        return self.output_tokens

    @property
    def streamed_blocks(self) -> dict[int, tuple]:
        """Nothing is streamed (resident weights only)."""
        return {r: () for r in self.ranks}

    def stage_of(self, rank: int) -> int:
        """The stage whose group holds global rank ``rank``."""
        return next(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def stage_plan(self, stage: int, micro_batch: int) -> Plan:
        """The plan of ``stage``'s part of the forward passes of micro-batch index ``micro_batch``
        (plans are shared by micro-batches of one size)."""
        size = self.micro_batches[micro_batch]
        key = (stage, size)
        if key not in self._plans:
            self._plans[key] = Plan(self.model, self.stage_ranks[stage], size, self.prompt_tokens, self.output_tokens,
                                    self.strategy, self.runtime_memory_bytes, stage=self.stages[stage])
        return self._plans[key]

    @cached_property
    def initial_memory_bytes(self) -> dict[int, dict[MemoryCategory, int]]:
        """Memory resident before the first op: the runtime's own and the rank's stage weights (bytes)."""
        return {r: v for s in range(len(self.stages)) for r, v in self.stage_plan(s, 0).initial_memory_bytes.items()}

    def hop_on(self, stage: int, micro_batch: int, new_tokens: int) -> Hop | None:
        """The message ``stage``'s master sends after running micro-batch ``micro_batch`` of a pass
        of ``new_tokens`` per sequence: the residual stream ([sequences, new tokens, hidden] in
        the model's dtype) to the next stage's master, or from the last stage the sampled tokens
        to the first stage's master; None with a single stage."""
        if len(self.stages) == 1:
            return None
        size = self.micro_batches[micro_batch]
        src = self.stage_ranks[stage][0]
        if stage + 1 < len(self.stages):
            return Hop(src, self.stage_ranks[stage + 1][0], hidden_bytes(self.model, size * new_tokens))
        return Hop(src, self.master, size * TOKEN_BYTES, tokens=True)
