"""The plan: what each rank does, in order, independent of how long it takes.

A strategy (:mod:`sim.strategies`) is lowered once into a :class:`Plan`; the simulator prices it
and the runtime executes the very same ops (:mod:`sim.program`: typed ops, segments and phases).
A plan whose memory policy streams weights gets, per phase, loader ops that fetch each decoder
layer's weight blocks ahead of the ops that read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property, lru_cache

from models.accounting import layer_block_weight_bytes, rank_weight_bytes, stage_weight_bytes
from models.errors import ConfigError
from models.ops import OpKind
from models.shards import TensorShard
from models.spec import ModelSpec
from sim.vocabulary import PhaseKind
# Collective, Segment and Stream are re-exported: the plan's users read its ops through them.
from sim.program import BlockPart, Collective, MemoryCategory, Op, Phase, Segment, Stage, Stream, WeightBlock  # noqa: F401
from sim.strategies import StrategyChoice  # noqa: F401 - re-exported: the plan's callers build one


LOWERED_PHASES = 4096
"""How many lowered phases :func:`_lowered` keeps: a plan search's distinct (strategy, model,
batch, ranks, prompt, shards, stage, step) lowerings are a few thousand."""


class WeightPolicy(StrEnum):
    """How a rank keeps its weight shard in device memory (:class:`MemoryPolicy`)."""

    RESIDENT = "resident"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class MemoryPolicy:
    """How a rank keeps its weight shard in device memory.

    ``resident``: the whole shard stays in memory. ``sliding_window``: every decoder layer's weights
    are split into an attention and an MLP block (:class:`WeightBlock`); ``window`` blocks are
    resident and a loader stream fetches block i+w while block i computes, so at most w+1 block
    buffers are held (w=1 is double buffering); a block is freed as its last op ends. With
    ``retain_every`` k, every k-th block (the k-th, 2k-th, ... in order of use) stays resident and
    is never streamed, which relieves a slow loader. The KV cache, the embeddings and the LM head
    always stay resident. Each forward pass streams its blocks and, at its end, the first w blocks
    of the next pass, so every pass starts with the same w blocks resident (the first is preloaded
    with the resident weights, before the request arrives).
    """

    policy: WeightPolicy = WeightPolicy.RESIDENT
    window: int = 1
    retain_every: int | None = None

    def __post_init__(self) -> None:
        """Raises ConfigError: an unknown policy (listing the known ones), a window below 1 or a
        ``retain_every`` below 2."""
        if self.policy not in tuple(WeightPolicy):
            raise ConfigError("memory.policy", f"unknown policy; known: {', '.join(WeightPolicy)} "
                                               f"(got {self.policy!r})")
        object.__setattr__(self, "policy", WeightPolicy(self.policy))
        if self.window < 1:
            raise ConfigError("memory.window", f"must be at least 1 (got {self.window})")
        if self.retain_every is not None and self.retain_every < 2:
            raise ConfigError("memory.retain_every", f"must be at least 2 (got {self.retain_every})")

    @property
    def streams(self) -> bool:
        return self.policy == WeightPolicy.SLIDING_WINDOW

    def label(self) -> str:
        """``resident``, ``sliding_window(w=2)`` or ``sliding_window(w=2, retain 1/4)``."""
        if not self.streams:
            return "resident"
        retain = f", retain 1/{self.retain_every}" if self.retain_every else ""
        return f"sliding_window(w={self.window}{retain})"


@dataclass(frozen=True)
class Plan:
    """Inference of ``model`` on ranks ``ranks`` (``ranks[0]`` is the master) by ``strategy``,
    whose implementation (:data:`sim.strategies.STRATEGIES`) lowers each phase.
    ``runtime_memory_bytes``: per rank, memory the framework holds before any weight (bytes).
    ``memory_policy``: resident weights, or blocks streamed through a sliding window; a streaming
    plan is lowered with one segment per phase (the loader runs ahead across layers, so layers
    cannot be repeated segments that each start idle), its ops carrying their ``layer``.
    ``shards``: each rank's slice of the layers in the order of ``ranks`` (:mod:`models.shards`)
    when the tensor-parallel split is uneven; None for the even split.

    Phases are lowered on demand (:meth:`phase`): the simulator prices only the decode steps it
    samples, so a long decode costs a handful of phases, not one per token.
    """

    model: ModelSpec
    ranks: tuple[int, ...]
    batch_size: int
    prompt_tokens: int
    output_tokens: int
    strategy: StrategyChoice
    runtime_memory_bytes: dict[int, int] = field(default_factory=dict)
    memory_policy: MemoryPolicy = MemoryPolicy()
    shards: tuple[TensorShard, ...] | None = None
    stage: Stage | None = None
    _cache: dict[int, Phase] = field(default_factory=dict, compare=False, repr=False)

    @property
    def master(self) -> int:
        return self.ranks[0]

    def shard_of(self, rank: int) -> TensorShard | None:
        """The slice of ``rank`` (a member of ``ranks``) when the split is uneven; None when even."""
        return None if self.shards is None else self.shards[self.ranks.index(rank)]

    @property
    def num_phases(self) -> int:
        """Prefill plus one decode step per further output token."""
        return self.output_tokens

    @cached_property
    def initial_memory_bytes(self) -> dict[int, dict[MemoryCategory, int]]:
        """Memory resident before the first op: the runtime's own (``runtime_memory_bytes``, from
        calibration) and each rank's weight shard (bytes)."""
        streamed_later = {r: sum(b.size_bytes for b in self.streamed_blocks[r][self.memory_policy.window:])
                          for r in self.ranks}
        return {
            r: {MemoryCategory.RUNTIME: self.runtime_memory_bytes.get(r, 0),
                MemoryCategory.WEIGHTS: self._weight_bytes(r) - streamed_later[r]}
            for r in self.ranks
        }

    def _weight_bytes(self, rank: int) -> int:
        """The weight shard ``rank`` holds (bytes): its share of every layer, or of its stage's."""
        tp, master, shard = len(self.ranks), rank == self.master, self.shard_of(rank)
        if self.stage is None:
            return rank_weight_bytes(self.model, tp, is_master=master, shard=shard)
        return stage_weight_bytes(self.model, tp, self.stage.num_layers, embeds=master and self.stage.embeds,
                                  heads=master and self.stage.heads, shard=shard)

    @cached_property
    def streamed_blocks(self) -> dict[int, tuple[WeightBlock, ...]]:
        """Per rank, the weight blocks the loader streams, in order of use (empty when resident, or
        when the window holds every block); retained blocks are left out."""
        policy = self.memory_policy
        if not policy.streams:
            return {r: () for r in self.ranks}
        k = policy.retain_every
        out = {}
        for r in self.ranks:
            sizes = layer_block_weight_bytes(self.model, len(self.ranks), shard=self.shard_of(r))
            order = [WeightBlock(layer, part, sizes[part]) for layer in range(self.model.num_layers)
                     for part in BlockPart]
            streamed = tuple(b for n, b in enumerate(order) if not (k and (n + 1) % k == 0))
            out[r] = () if policy.window >= len(streamed) else streamed
        return out

    def phase(self, step: int) -> Phase:
        """The forward pass that produces output token ``step + 1`` (step 0 is the prefill)."""
        if not 0 <= step < self.num_phases:
            raise IndexError(f"step {step} outside 0..{self.num_phases - 1}")
        if step not in self._cache:
            self._cache[step] = _lowered(self.strategy, self.model, self.batch_size, self.ranks, self.prompt_tokens,
                                         self.shards, self.stage, step)
            if any(self.streamed_blocks.values()):
                self._cache[step] = _stream_weights(self._cache[step], self.streamed_blocks,
                                                    self.memory_policy.window)
        return self._cache[step]


@lru_cache(maxsize=LOWERED_PHASES)
def _lowered(strategy: StrategyChoice, model: ModelSpec, batch_size: int, ranks: tuple[int, ...], prompt_tokens: int,
             shards: tuple[TensorShard, ...] | None, stage: Stage | None, step: int) -> Phase:
    """``strategy``'s lowering of step ``step`` (0: the prefill of ``prompt_tokens``; else a decode
    step of one token), from exactly what the lowering reads: plans that differ only elsewhere
    (memory policy, output length, runtime memory) share it, as a plan search's many clusters of
    the same size do. Phases are immutable (:mod:`sim.program`), so sharing one is safe."""
    lower = strategy.implementation.lower
    args = (model, batch_size, ranks, strategy.algorithms)
    # Only a pipeline stage's plan passes a stage: a strategy that knows no pipeline still lowers.
    kwargs = {"shards": shards} | ({} if stage is None else {"stage": stage})
    if step == 0:
        return lower(*args, PhaseKind.PREFILL, 0, prompt_tokens, prompt_tokens, **kwargs)
    return lower(*args, PhaseKind.DECODE, step, 1, prompt_tokens + step, **kwargs)


def _unroll(phase: Phase) -> dict[int, list[Op]]:
    """Every rank's program of ``phase`` as one list: segment instances in order, each op tagged with
    its decoder layer, collective calls renumbered so they stay unique."""
    programs: dict[int, list[Op]] = {}
    calls = 0
    for segment, layer0 in zip(phase.segments, phase.layer_of_segment):
        seg_calls = 1 + max((op.call for ops in segment.programs.values() for op in ops), default=-1)
        for instance in range(segment.repeat):
            layer = None if layer0 is None else layer0 + instance
            for rank, ops in segment.programs.items():
                out = programs.setdefault(rank, [])
                for op in ops:
                    assert op.after is None, "unrolling keeps program order only"
                    out.append(replace(op, layer=layer, call=op.call + calls if op.call >= 0 else -1))
            calls += seg_calls
    return programs


def _stream_weights(phase: Phase, streamed: dict[int, tuple[WeightBlock, ...]], window: int) -> Phase:
    """Lower ``phase`` for weight streaming: one segment, each rank's program followed by its loader
    ops.

    The loader fetches streamed block positions w .. N-1 of this pass, then positions 0 .. w-1 of the
    next one; position p may start once position p-w-1 is freed (w blocks resident plus one in
    flight). The first op to read a block fetched in this pass waits for its load; the last op to
    read a block frees it.
    """
    programs = {}
    for rank, ops in _unroll(phase).items():
        blocks = streamed[rank]
        users: dict[tuple[int, BlockPart], list[int]] = {}  # (layer, part) -> indices of the ops reading it
        for i, op in enumerate(ops):
            if op.weight_block is not None:
                users.setdefault((op.weight_block.layer(op.layer), op.weight_block.part), []).append(i)
        n = len(blocks)
        loads = []
        for p in range(window, n + window):
            block = blocks[p % n]
            before = p - window - 1
            after = (users[blocks[before].layer, blocks[before].part][-1],) if before >= 0 else ()
            loads.append(Op(OpKind.WEIGHT_LOAD, f"load_{block.name}", Stream.LOADER, after=after, layer=block.layer,
                            load=block, alloc=((MemoryCategory.WEIGHTS, block.size_bytes),)))
        ops = list(ops)
        for p, block in enumerate(blocks):
            first, last = users[block.layer, block.part][0], users[block.layer, block.part][-1]
            if p >= window:
                load_index = len(ops) + p - window
                ops[first] = replace(ops[first], after=((first - 1,) if first else ()) + (load_index,))
            ops[last] = replace(ops[last], release=block,
                                free=ops[last].free + ((MemoryCategory.WEIGHTS, block.size_bytes),))
        programs[rank] = tuple(ops + loads)
    return Phase(phase.name, phase.step, phase.new_tokens, phase.context_tokens,
                 (Segment("forward", programs),))
