"""Programs: the typed ops a rank runs, grouped into segments and forward passes.

A strategy (:mod:`sim.strategies`) lowers a forward pass into a :class:`Phase`: a sequence of
:class:`Segment` s, each a set of per-rank programs that begins with every rank idle and ends when
the last rank is done. A segment that repeats (every decoder layer but the last) appears once with
a repeat count, which is what lets the simulator price an 80-layer model as three segments.

Ops carry their costs (FLOPs, bytes) and memory effects, never durations, and say what they do in
typed fields (:class:`NormSite`, :class:`BlockRef`, :class:`Carries`, the collective's kind and
group), so neither the simulator nor the runtime reads meaning out of an op's ``name``: names are
labels for traces and calibration rows.

* persistent allocations ``alloc`` happen when the op starts and ``free`` when it ends (weights are
  resident from the start; the KV cache is allocated by the attention op of each layer;
  hidden-state buffers live for one phase);
* transient memory (``OpCost.workspace_bytes`` of a compute op, the message of a collective) is
  held only while the op runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from models.accounting import OpCost
from models.ops import OpKind
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


class NormSite(StrEnum):
    """Which input a LayerNorm op produces: the attention or MLP sub-layer's of a decoder layer,
    or the final norm before the LM head (the values are the weights' names, ``layers.3.attn_norm``)."""

    ATTENTION = "attn"
    MLP = "mlp"
    FINAL = "final"


class Gradient(StrEnum):
    """Which gradient a training backward op computes (:func:`models.training.layer_backward_costs`
    splits each op's backward in two): its inputs' or its weights'. A calibration profile times
    them apart (``backward_input`` / ``backward_weight`` rows)."""

    INPUT = "input"
    WEIGHT = "weight"


class BlockPart(StrEnum):
    """The two streamed weight blocks of a decoder layer (:class:`WeightBlock`)."""

    ATTENTION = "attention"  # input norm, q/k/v and output projections
    MLP = "mlp"  # post-attention norm and the MLP


class Carries(StrEnum):
    """What a broadcast hands out: the normalised input of the next sub-layer, or the residual
    stream itself (from which every rank then normalises its own copy)."""

    NORMALISED = "normalised"
    RESIDUAL = "residual"


@dataclass(frozen=True, slots=True)
class BlockRef:
    """The weight block an op reads: ``part`` of the decoder layer ``layer_offset`` after the
    layer of the op's segment instance (an attention norm that closes a layer segment normalises
    the next layer's input, offset 1)."""

    layer_offset: int
    part: BlockPart

    def layer(self, segment_layer: int | None, first_layer: int = 0) -> int:
        """The decoder layer whose block is read, for an op in an instance of layer
        ``segment_layer`` (None: the prologue, which reads the first layer's blocks: layer 0, or
        ``first_layer`` of a pipeline stage's pass)."""
        return first_layer if segment_layer is None else segment_layer + self.layer_offset


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective call: ``size_bytes`` per rank (n in the alpha-beta formulas) over ``group``,
    its reductions adding in ``dtype`` (a :data:`models.dtypes.DTYPE_BYTES` name; None: the
    pricing's default, :attr:`sim.calibrated.CalibratedCompute.reduce_dtype`), whose gamma prices
    them (:class:`sim.network.ReductionCosts`)."""

    kind: OpKind
    algorithm: str
    group: tuple[int, ...]
    size_bytes: int
    root: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, slots=True)
class WeightBlock:
    """A unit of streamed weights: one decoder layer's ``attention`` block (input norm, q/k/v and
    output projections) or ``mlp`` block (post-attention norm and MLP) on one rank; ``size_bytes`` is
    :func:`models.accounting.layer_block_weight_bytes` of that part."""

    layer: int
    part: BlockPart
    size_bytes: int

    @property
    def name(self) -> str:
        """``"layer3.mlp"``: the block's name in traces and in the runtime's block files."""
        return f"layer{self.layer}.{self.part}"


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

    What the op does, typed: ``norm_site`` (a LayerNorm: which input it produces),
    ``weight_block`` (a compute op reading a decoder layer's streamed weights: which block),
    ``carries`` (a broadcast: what it hands out), ``gradient`` (a training backward op: which
    gradient it computes; None for a forward op), ``recompute`` (a training forward op run again
    inside the backward, under activation checkpointing). ``name`` is a label only.
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
    norm_site: NormSite | None = None
    weight_block: BlockRef | None = None
    carries: Carries | None = None
    gradient: Gradient | None = None
    recompute: bool = False

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
    """Per-rank programs between two points where every rank is idle. ``programs[r]`` may be empty.
    ``layers``: decoder layers one instance of the segment runs (1 for a layer segment, 0 for the
    prologue and for an unrolled pass whose ops carry their own ``layer``)."""

    name: str
    programs: dict[int, tuple[Op, ...]]
    repeat: int = 1
    layers: int = 0


@dataclass(frozen=True, slots=True)
class Stage:
    """The part of the model one pipeline stage runs (GPipe, arXiv 1811.06965): decoder layers
    ``first_layer .. first_layer + num_layers - 1``; ``embeds``: it is the first stage (embeds the
    tokens; the others receive the residual stream from the stage before), ``heads``: it is the
    last (final norm and LM head; the others hand the residual stream on)."""

    first_layer: int
    num_layers: int
    embeds: bool
    heads: bool


@dataclass(frozen=True)
class Phase:
    """One forward pass: ``new_tokens`` per sequence attending to ``context_tokens`` (cache
    included); a pipeline stage's pass runs decoder layers from ``first_layer`` on."""

    name: PhaseKind
    step: int  # 0 for prefill, then 1 .. output_tokens - 1
    new_tokens: int
    context_tokens: int
    segments: tuple[Segment, ...]
    first_layer: int = 0

    @property
    def layer_of_segment(self) -> tuple[int | None, ...]:
        """For each segment, the index of its first decoder layer (None for a segment that runs
        no decoder layer of its own)."""
        layers: list[int | None] = []
        next_layer = self.first_layer
        for seg in self.segments:
            if seg.layers:
                layers.append(next_layer)
                next_layer += seg.repeat * seg.layers
            else:
                layers.append(None)
        return tuple(layers)


class ProgramBuilder:
    """Builds the per-rank op lists of one segment, numbering collective calls.

    Args:
        ranks: the ranks that have a program in the segment (each may stay empty).
        shape: (new tokens, context tokens) of the forward pass, stamped on compute ops.
    """

    def __init__(self, ranks: tuple[int, ...], shape: tuple[int, int]):
        self.ops: dict[int, list[Op]] = {r: [] for r in ranks}
        self.ranks = ranks
        self.shape = shape
        self.calls = 0

    def compute(self, ranks: tuple[int, ...], kind: OpKind, name: str, cost: OpCost, **fields) -> None:
        """Append a compute op to each of ``ranks``' programs; ``fields``: further :class:`Op` fields."""
        for r in ranks:
            self.ops[r].append(Op(kind, name, Stream.COMPUTE, cost=cost, shape=self.shape, **fields))

    def collective(self, name: str, call: Collective, **fields) -> None:
        """Append one collective call to the program of every rank of its group."""
        for r in call.group:
            self.ops[r].append(Op(call.kind, name, Stream.COMM, collective=call, call=self.calls, **fields))
        self.calls += 1

    def segment(self, name: str, repeat: int = 1, layers: int = 0) -> Segment:
        return Segment(name, {r: tuple(ops) for r, ops in self.ops.items()}, repeat, layers)
