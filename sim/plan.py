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

from models.accounting import OpCost, head_op_costs, kv_cache_bytes_per_token, layer_op_costs, rank_weight_bytes
from models.ops import OpKind
from models.spec import ModelSpec


class Stream(StrEnum):
    """Streams of a rank: ops on one stream run one at a time, in program order."""

    COMPUTE = "compute"
    COMM = "comm"


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
class Op:
    """One operation of a rank's program.

    Exactly one of ``cost`` (compute op) and ``collective`` (communication op) is set. ``call``
    numbers the collective calls of a segment so the ranks of a group meet in the same one.
    ``after`` lists the indices (in the rank's program) of ops that must finish before this one
    starts; None means the previous op of the program. ``shape`` is (new tokens, context tokens)
    of the forward pass, what a calibrated cost model interpolates over.
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

    @property
    def traffic_bytes(self) -> float:
        """The trace's ``bytes``: memory traffic of a compute op, message size of a collective."""
        if self.collective is not None:
            return float(self.collective.size_bytes)
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

    name: str  # "prefill" or "decode"
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
        return {
            r: {MemoryCategory.RUNTIME: self.runtime_memory_bytes.get(r, 0),
                MemoryCategory.WEIGHTS: rank_weight_bytes(self.model, tp, is_master=r == self.master)}
            for r in self.ranks
        }

    def phase(self, step: int) -> Phase:
        """The forward pass that produces output token ``step + 1`` (step 0 is the prefill)."""
        if not 0 <= step < self.num_phases:
            raise IndexError(f"step {step} outside 0..{self.num_phases - 1}")
        if step not in self._cache:
            if step == 0:
                self._cache[step] = self._lower("prefill", 0, self.prompt_tokens, self.prompt_tokens)
            else:
                self._cache[step] = self._lower("decode", step, 1, self.prompt_tokens + step)
        return self._cache[step]

    def _lower(self, name: str, step: int, new_tokens: int, context_tokens: int) -> Phase:
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
