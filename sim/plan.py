"""The plan: what each rank does, in order, independent of how long it takes.

A strategy is lowered once into a :class:`Plan`; the simulator prices it and the runtime executes
the very same ops. A forward pass (:class:`Phase`: the prefill, or one decode step) is a sequence of
:class:`Segment` s, each a set of per-rank programs that begins with every rank idle and ends when the
last rank is done. A segment that repeats (every decoder layer but the last) appears once with a
repeat count, which is what lets the simulator price an 80-layer model as three segments.

Ops carry their costs (FLOPs, bytes) and memory effects, never durations:

* persistent allocations ``alloc`` happen when the op starts and ``free`` when it ends (weights are
  resident from the start, see :attr:`Plan.initial_memory_bytes`; the KV cache is allocated by the
  attention op of each layer; hidden-state buffers live for one phase);
* transient memory (``OpCost.workspace_bytes`` of a compute op, the message of a collective) is
  held only while the op runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property

from models.accounting import (OpCost, head_op_costs, kv_cache_bytes_per_token, layer_block_weight_bytes,
                               layer_op_costs, rank_weight_bytes)
from models.ops import OpKind
from models.spec import ModelSpec
from sim.vocabulary import PhaseKind


class Stream(StrEnum):
    """Streams of a rank: ops on one stream run one at a time, in program order."""

    COMPUTE = "compute"
    COMM = "comm"
    LOADER = "loader"  # weight streaming: fetches blocks ahead of the compute stream


class MemoryCategory(StrEnum):
    """What device memory holds, for the ledger and the report."""

    RUNTIME = "runtime"  # the framework's own resident memory (calibrated), before any weight
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    ACTIVATIONS = "activations"
    WORKSPACE = "workspace"
    COMM_BUFFERS = "comm_buffers"


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective call: ``size_bytes`` per rank (n in the alpha-beta formulas) over ``group``."""

    kind: OpKind
    algorithm: str
    group: tuple[int, ...]
    size_bytes: int
    root: int | None = None


@dataclass(frozen=True, slots=True)
class WeightBlock:
    """A unit of streamed weights: one decoder layer's ``attention`` block (input norm, q/k/v and
    output projections) or ``mlp`` block (post-attention norm and MLP) on one rank; ``size_bytes`` is
    :func:`models.accounting.layer_block_weight_bytes` of that part."""

    layer: int
    part: str  # "attention" | "mlp"
    size_bytes: int

    @property
    def name(self) -> str:
        """``"layer3.mlp"``: the block's name in traces and in the runtime's block files."""
        return f"layer{self.layer}.{self.part}"


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

    policy: str = "resident"  # "resident" | "sliding_window"
    window: int = 1
    retain_every: int | None = None

    @property
    def streams(self) -> bool:
        return self.policy == "sliding_window"

    def label(self) -> str:
        """``resident``, ``sliding_window(w=2)`` or ``sliding_window(w=2, retain 1/4)``."""
        if not self.streams:
            return "resident"
        retain = f", retain 1/{self.retain_every}" if self.retain_every else ""
        return f"sliding_window(w={self.window}{retain})"


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of a rank's program.

    Exactly one of ``cost`` (compute op) and ``collective`` (communication op) is set. ``call``
    numbers the collective calls of a segment so the ranks of a group meet in the same one.
    ``after`` lists the indices (in the rank's program) of ops that must finish before this one
    starts; None means the previous op of the program. ``shape`` is (new tokens, context tokens)
    of the forward pass, what a calibrated cost model interpolates over. ``layer`` is the decoder
    layer the op belongs to in a plan lowered without repeated segments (None: the segment's).
    ``load`` is set on a ``weight_load`` op of the loader stream: it fetches that block (and
    allocates it as it starts); ``release`` names the block whose weights are freed as the op ends.
    """

    kind: OpKind
    name: str
    stream: Stream
    cost: OpCost | None = None
    collective: Collective | None = None
    call: int = -1
    alloc: tuple[tuple[MemoryCategory, int], ...] = ()
    free: tuple[tuple[MemoryCategory, int], ...] = ()
    after: tuple[int, ...] | None = None
    shape: tuple[int, int] = (0, 0)
    layer: int | None = None
    load: WeightBlock | None = None
    release: WeightBlock | None = None

    @property
    def traffic_bytes(self) -> float:
        """The trace's ``bytes``: memory traffic of a compute op, message size of a collective,
        block size of a weight load."""
        if self.collective is not None:
            return float(self.collective.size_bytes)
        if self.load is not None:
            return float(self.load.size_bytes)
        return self.cost.bytes_read + self.cost.bytes_written

    @property
    def flops(self) -> float:
        """The trace's ``flops`` (0 for a collective's local work, which gamma prices)."""
        return self.cost.flops if self.cost is not None else 0.0

    @property
    def transient_bytes(self) -> int:
        """Memory held only while the op runs (bytes)."""
        if self.collective is not None:
            return self.collective.size_bytes
        return int(self.cost.workspace_bytes) if self.cost is not None else 0

    @property
    def transient_category(self) -> MemoryCategory:
        return MemoryCategory.COMM_BUFFERS if self.collective is not None else MemoryCategory.WORKSPACE


@dataclass(frozen=True)
class Segment:
    """Per-rank programs between two points where every rank is idle. ``programs[r]`` may be empty."""

    name: str
    programs: dict[int, tuple[Op, ...]]
    repeat: int = 1


@dataclass(frozen=True)
class Phase:
    """One forward pass: ``new_tokens`` per sequence attending to ``context_tokens`` (cache included)."""

    name: PhaseKind
    step: int  # 0 for prefill, then 1 .. output_tokens - 1
    new_tokens: int
    context_tokens: int
    segments: tuple[Segment, ...]

    @property
    def layer_of_segment(self) -> tuple[int | None, ...]:
        """For each segment, the index of its first decoder layer (None for the prologue)."""
        layers: list[int | None] = []
        next_layer = 0
        for seg in self.segments:
            if seg.name.startswith("layer"):
                layers.append(next_layer)
                next_layer += seg.repeat
            else:
                layers.append(None)
        return tuple(layers)


class _Program:
    """Builds the per-rank op lists of one segment, numbering collective calls."""

    def __init__(self, ranks: tuple[int, ...], shape: tuple[int, int]):
        self.ops: dict[int, list[Op]] = {r: [] for r in ranks}
        self.ranks = ranks
        self.shape = shape
        self.calls = 0

    def compute(self, ranks: tuple[int, ...], kind: OpKind, name: str, cost: OpCost, **memory) -> None:
        for r in ranks:
            self.ops[r].append(Op(kind, name, Stream.COMPUTE, cost=cost, shape=self.shape, **memory))

    def collective(self, name: str, call: Collective) -> None:
        for r in call.group:
            self.ops[r].append(Op(call.kind, name, Stream.COMM, collective=call, call=self.calls))
        self.calls += 1

    def segment(self, name: str, repeat: int = 1) -> Segment:
        return Segment(name, {r: tuple(ops) for r, ops in self.ops.items()}, repeat)


@dataclass(frozen=True)
class StrategyChoice:
    """The variant's strategy and algorithms, as the plan needs them."""

    strategy: str  # "reduce_ln_bcast" | "allreduce_ln"
    allreduce: str | None = None
    reduce: str = "binomial"
    broadcast: str = "binomial"


@dataclass(frozen=True)
class Plan:
    """Tensor-parallel inference of ``model`` on ranks ``ranks`` (``ranks[0]`` is the master).
    ``runtime_memory_bytes``: per rank, memory the framework holds before any weight (bytes).
    ``memory_policy``: resident weights, or blocks streamed through a sliding window; a streaming
    plan is lowered with one segment per phase (the loader runs ahead across layers, so layers
    cannot be repeated segments that each start idle), its ops carrying their ``layer``.

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
    _cache: dict[int, Phase] = field(default_factory=dict, compare=False, repr=False)

    @property
    def master(self) -> int:
        return self.ranks[0]

    @property
    def num_phases(self) -> int:
        """Prefill plus one decode step per further output token."""
        return self.output_tokens

    @cached_property
    def initial_memory_bytes(self) -> dict[int, dict[MemoryCategory, int]]:
        """Memory resident before the first op: the runtime's own (``runtime_memory_bytes``, from
        calibration) and each rank's weight shard (bytes)."""
        tp = len(self.ranks)
        streamed_later = {r: sum(b.size_bytes for b in self.streamed_blocks[r][self.memory_policy.window:])
                          for r in self.ranks}
        return {
            r: {MemoryCategory.RUNTIME: self.runtime_memory_bytes.get(r, 0),
                MemoryCategory.WEIGHTS: rank_weight_bytes(self.model, tp, is_master=r == self.master)
                - streamed_later[r]}
            for r in self.ranks
        }

    @cached_property
    def streamed_blocks(self) -> dict[int, tuple[WeightBlock, ...]]:
        """Per rank, the weight blocks the loader streams, in order of use (empty when resident, or
        when the window holds every block); retained blocks are left out."""
        policy = self.memory_policy
        if not policy.streams:
            return {r: () for r in self.ranks}
        sizes = layer_block_weight_bytes(self.model, len(self.ranks))
        order = [WeightBlock(layer, part, sizes[part]) for layer in range(self.model.num_layers)
                 for part in ("attention", "mlp")]
        k = policy.retain_every
        streamed = tuple(b for n, b in enumerate(order) if not (k and (n + 1) % k == 0))
        if policy.window >= len(streamed):
            streamed = ()
        return {r: streamed for r in self.ranks}

    def phase(self, step: int) -> Phase:
        """The forward pass that produces output token ``step + 1`` (step 0 is the prefill)."""
        if not 0 <= step < self.num_phases:
            raise IndexError(f"step {step} outside 0..{self.num_phases - 1}")
        if step not in self._cache:
            if step == 0:
                self._cache[step] = self._lower(PhaseKind.PREFILL, 0, self.prompt_tokens, self.prompt_tokens)
            else:
                self._cache[step] = self._lower(PhaseKind.DECODE, step, 1, self.prompt_tokens + step)
            if any(self.streamed_blocks.values()):
                self._cache[step] = _stream_weights(self._cache[step], self.streamed_blocks,
                                                    self.memory_policy.window)
        return self._cache[step]

    def _lower(self, name: PhaseKind, step: int, new_tokens: int, context_tokens: int) -> Phase:
        spec, ranks, master = self.model, self.ranks, self.master
        tp = len(ranks)
        layer = layer_op_costs(spec, tp_degree=tp, batch_size=self.batch_size,
                               new_tokens=new_tokens, context_tokens=context_tokens)
        head = head_op_costs(spec, batch_size=self.batch_size, new_tokens=new_tokens)
        hidden_bytes = self.batch_size * new_tokens * spec.hidden_size * spec.dtype_bytes
        kv_bytes = kv_cache_bytes_per_token(spec, tp) // spec.num_layers * self.batch_size * new_tokens
        # The residual stream and the normalised input live for the whole pass on every rank.
        activations = ((MemoryCategory.ACTIVATIONS, 2 * hidden_bytes),)
        fused_ln = self.strategy.strategy == "reduce_ln_bcast"
        combine = _Combine(self.strategy, ranks, hidden_bytes)
        everyone, only_master = ranks, (master,)

        # Prologue: the master embeds the tokens and hands the first normalised input out.
        shape = (new_tokens, context_tokens)
        pro = _Program(ranks, shape)
        pro.compute(only_master, OpKind.EMBEDDING, "embedding", head[OpKind.EMBEDDING], alloc=activations)
        if fused_ln:
            pro.compute(only_master, OpKind.LAYERNORM, "attn_norm", layer[OpKind.LAYERNORM])
            pro.collective("attn_bcast", combine.bcast())
        else:
            pro.collective("embed_bcast", combine.bcast())
            pro.compute(everyone, OpKind.LAYERNORM, "attn_norm", layer[OpKind.LAYERNORM])
        for r in ranks[1:]:
            pro.ops[r][0] = replace(pro.ops[r][0], alloc=activations)

        def layer_program(last: bool) -> _Program:
            prog = _Program(ranks, shape)
            prog.compute(everyone, OpKind.QKV_PROJ, "qkv_proj", layer[OpKind.QKV_PROJ])
            prog.compute(everyone, OpKind.ATTENTION, "attention", layer[OpKind.ATTENTION],
                         alloc=((MemoryCategory.KV_CACHE, kv_bytes),))
            prog.compute(everyone, OpKind.OUT_PROJ, "out_proj", layer[OpKind.OUT_PROJ])
            combine.emit(prog, "attn", layer[OpKind.LAYERNORM])
            prog.compute(everyone, OpKind.MLP_UP, "mlp_up", layer[OpKind.MLP_UP])
            prog.compute(everyone, OpKind.MLP_DOWN, "mlp_down", layer[OpKind.MLP_DOWN])
            if last:
                # Only the master needs the final hidden state: it normalises and projects to logits.
                combine.emit_final(prog, "mlp")
                prog.compute(only_master, OpKind.LAYERNORM, "final_norm", head[OpKind.LAYERNORM])
                prog.compute(only_master, OpKind.LM_HEAD, "lm_head", head[OpKind.LM_HEAD])
                for r in ranks:
                    prog.ops[r][-1] = replace(prog.ops[r][-1], free=activations)
            else:
                combine.emit(prog, "mlp", layer[OpKind.LAYERNORM], next_name="attn")
            return prog

        segments = [pro.segment("prologue")]
        if spec.num_layers > 1:
            segments.append(layer_program(last=False).segment("layer", repeat=spec.num_layers - 1))
        segments.append(layer_program(last=True).segment("layer_last"))
        return Phase(name, step, new_tokens, context_tokens, tuple(segments))


@dataclass(frozen=True)
class _Combine:
    """How a strategy combines the row-parallel partial sums and normalises (per sub-layer)."""

    choice: StrategyChoice
    ranks: tuple[int, ...]
    size_bytes: int

    def bcast(self) -> Collective:
        return Collective(OpKind.BROADCAST, self.choice.broadcast, self.ranks, self.size_bytes, self.ranks[0])

    def _reduce(self) -> Collective:
        return Collective(OpKind.REDUCE, self.choice.reduce, self.ranks, self.size_bytes, self.ranks[0])

    def _allreduce(self) -> Collective:
        return Collective(OpKind.ALLREDUCE, self.choice.allreduce or "auto", self.ranks, self.size_bytes)

    def emit(self, prog: _Program, sub: str, norm: OpCost, next_name: str | None = None) -> None:
        """Combine the partial sums of sub-layer ``sub`` and produce the next normalised input.

        reduce_ln_bcast: reduce to the master, residual + norm there, broadcast the result.
        allreduce_ln: allreduce, then residual + norm on every rank.
        """
        norm_name = f"{next_name or ('mlp' if sub == 'attn' else 'attn')}_norm"
        if self.choice.strategy == "reduce_ln_bcast":
            prog.collective(f"{sub}_reduce", self._reduce())
            prog.compute((self.ranks[0],), OpKind.LAYERNORM, norm_name, norm)
            prog.collective(f"{norm_name.removesuffix('_norm')}_bcast", self.bcast())
        else:
            prog.collective(f"{sub}_allreduce", self._allreduce())
            prog.compute(self.ranks, OpKind.LAYERNORM, norm_name, norm)

    def emit_final(self, prog: _Program, sub: str) -> None:
        """The last combine: the master must end up with the full hidden state."""
        if self.choice.strategy == "reduce_ln_bcast":
            prog.collective(f"{sub}_reduce", self._reduce())
        else:
            prog.collective(f"{sub}_allreduce", self._allreduce())


# Which weight block an op reads, by op name: (layer offset from the op's segment, block part).
# The attention norm that closes a layer segment normalises the next layer's input.
_BLOCK_OF_OP = {"attn_norm": (1, "attention"), "qkv_proj": (0, "attention"), "out_proj": (0, "attention"),
                "mlp_norm": (0, "mlp"), "mlp_up": (0, "mlp"), "mlp_down": (0, "mlp")}


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
        users: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            if op.name in _BLOCK_OF_OP:
                offset, part = _BLOCK_OF_OP[op.name]
                layer = 0 if op.layer is None else op.layer + offset
                users.setdefault(f"layer{layer}.{part}", []).append(i)
        n = len(blocks)
        loads = []
        for p in range(window, n + window):
            block = blocks[p % n]
            before = p - window - 1
            after = (users[blocks[before].name][-1],) if before >= 0 else ()
            loads.append(Op(OpKind.WEIGHT_LOAD, f"load_{block.name}", Stream.LOADER, after=after, layer=block.layer,
                            load=block, alloc=((MemoryCategory.WEIGHTS, block.size_bytes),)))
        ops = list(ops)
        for p, block in enumerate(blocks):
            first, last = users[block.name][0], users[block.name][-1]
            if p >= window:
                load_index = len(ops) + p - window
                ops[first] = replace(ops[first], after=((first - 1,) if first else ()) + (load_index,))
            ops[last] = replace(ops[last], release=block,
                                free=ops[last].free + ((MemoryCategory.WEIGHTS, block.size_bytes),))
        programs[rank] = tuple(ops + loads)
    return Phase(phase.name, phase.step, phase.new_tokens, phase.context_tokens,
                 (Segment("forward", programs),))
