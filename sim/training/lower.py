"""A training step as per-rank ops: what each rank computes and communicates, on which stream,
after what.

Layout: D replicas of T tensor-parallel ranks (``replicas[d]``); data-parallel group t is the
t-th rank of every replica. Every rank of a replica holds the embeddings, the final norm and the
LM head whole and computes them on the whole batch (replicated inside the tensor-parallel group,
as the reference runtime trains: ``runtime/training/model.py``), so no rank waits for another's
embedding or loss gradient; only the decoder layers are sharded.

One optimizer step is, per micro-batch (``accumulation`` of them per step):

* **forward**: the embedding (every rank), every decoder layer
  (norm, QKV, attention, output projection, norm, MLP up, MLP down) with the two allreduces of
  the row-parallel partial sums under T > 1 (Megatron-LM, arXiv 1909.08053, section 3; the
  pattern of :mod:`sim.strategies.allreduce_ln`), the final norm and the LM head over every
  position (every rank). One layer is one segment repeated L times.
* **backward**: the LM head and final norm (every rank), then layers L-1 .. 0, each op's input
  gradient and weight gradient
  as two ops (:func:`models.training.layer_backward_costs`), the allreduce of the column-parallel
  inputs' gradients under T > 1 (the conjugate of the forward's), and the embedding's weight
  gradient (every rank). Under activation checkpointing every k layers, the forward of each segment
  of k layers runs again (``recompute``) before its backward (``torch.utils.checkpoint``).
* **DDP's reducer** (on the micro-batch that synchronises: the last under ``no_sync``, every one
  without it): the parameters' gradients in gradient-ready order are fused into buckets
  (:func:`sim.training.buckets.bucket_assignment`); bucket i's allreduce runs on the
  communication stream once the backward op that produces its last gradient is done, after
  bucket i-1's (one process group: one stream, launches in bucket order, Reducer::mark_bucket_ready
  in ``torch/csrc/distributed/c10d/reducer.cpp``). With ``overlap: false`` every bucket waits for
  the whole backward. Gradient compression (fp16 / bf16 hooks,
  ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``) casts the bucket (and
  divides by the world size) on the compute stream, allreduces half the bytes of an fp32
  gradient, and casts back on the communication stream. Where the ranks share cores with their
  comm threads (``StepShape.comm_thread``), each allreduce is followed on the communication
  stream by its messages' work on those cores (:mod:`sim.training.comm_thread`).

Then the **optimizer** step (after every bucket: DDP's backward returns once all are reduced),
over the rank's parameters, or with ZeRO-1 over its 1/D shard followed by a broadcast of each DP
rank's shard to its group (``ZeroRedundancyOptimizer._sync_params``,
``torch/distributed/optim/zero_redundancy_optimizer.py``); under parameter averaging, no
gradient is synchronised and every H-th step ends with one allreduce of all parameters
(``torch.distributed.algorithms.model_averaging.utils.average_parameters``, which flattens them
into one buffer).

Tensor-parallel collectives run on the compute stream: the next op needs their result, so the
compute stream waits for them in any case, and they do not queue behind the reducer's buckets
(a separate process group, a separate stream in NCCL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.accounting import OpCost, head_op_costs, kv_heads_per_rank, layer_op_costs, rank_parameter_count
from models.ops import OpKind
from models.spec import ModelSpec
from models.training import (
    GRADIENT_DTYPE,
    compute_dtype,
    gradient_bytes_per_parameter,
    head_backward_costs,
    layer_backward_costs,
    optimizer_step_cost,
)
from sim.collectives.registry import LIBRARY
from sim.framework import Backend
from sim.program import Collective, Gradient, Op, Segment, Stream
from sim.training.buckets import bucket_assignment
from sim.training_config import Averaging, GradientCompression, TrainingSettings
from sim.vocabulary import TrainingPhase

_COMPRESSED_BYTES = 2  # fp16 and bf16
_TP_ALGORITHM_DEFAULT = "ring"


def tp_allreduce_algorithm(variant, backend: Backend) -> str:
    """The algorithm a variant's tensor-parallel allreduces are priced with: its ``allreduce``
    (the inference variants' field) where it names one; else, under gloo (CPU ranks), the
    backend's own (:data:`sim.collectives.registry.LIBRARY`, priced as gloo's allreduce,
    :func:`sim.collectives.registry.library_model`), which is what the runtime's ``f`` and ``g``
    call (``dist.all_reduce`` in ``runtime/training/model.py``); under NCCL ring, NCCL's own
    allreduce algorithm for one node's GPUs."""
    if variant.allreduce:
        return variant.allreduce
    return LIBRARY if backend is Backend.GLOO else _TP_ALGORITHM_DEFAULT


def bucket_dtype(settings: TrainingSettings) -> str:
    """The dtype a DDP bucket's allreduce reduces in: the gradients' own
    (:data:`models.training.GRADIENT_DTYPE`), or under compression the dtype the hook casts them to
    (``fp16_compress_hook`` / ``bf16_compress_hook`` hand the process group fp16 / bf16 tensors)."""
    if settings.gradient_compression is GradientCompression.NONE:
        return GRADIENT_DTYPE
    return settings.gradient_compression.value


def reduction_dtypes(settings: TrainingSettings, tensor: int) -> tuple[str, ...]:
    """The dtypes a variant's collectives reduce in, its buckets' first (:func:`bucket_dtype`);
    then the compute dtype of its precision where tensor parallelism (``tensor`` > 1) allreduces
    activations and their gradients, or a parameter average (:class:`Averaging`) sums the weights."""
    computed = tensor > 1 or settings.averaging is Averaging.PARAMETERS
    return tuple(dict.fromkeys((bucket_dtype(settings), *((compute_dtype(settings.precision),) if computed else ()))))


def scenario_reduction_dtypes(scenario, tensor: int) -> tuple[str, ...]:
    """The dtypes the collectives of any of a training ``scenario``'s variants reduce in
    (:func:`reduction_dtypes`, ``tensor`` the layout's tensor degree), in order of first appearance:
    what its calibration times the reduction in (:mod:`runtime.training.calibrate`) and the
    simulator's sources account for (:mod:`sim.training.simulate`)."""
    return tuple(dict.fromkeys(dtype for variant in scenario.config.variants
                               for dtype in reduction_dtypes(scenario.training_settings(variant), tensor)))


@dataclass(frozen=True)
class Parameter:
    """One parameter tensor of a rank: its name and ``numel`` elements."""

    name: str
    numel: int


@dataclass(frozen=True)
class StepSegment:
    """A segment of a training step and, per rank and op, the training phase the op belongs to."""

    segment: Segment
    phases: dict[int, tuple[TrainingPhase, ...]]
    micro_batch: int


@dataclass(frozen=True)
class TrainingStep:
    """One optimizer step as segments run one after another (each with ``segment.repeat``
    instances), and DDP's buckets of each data-parallel group: ``buckets[t]`` is a tuple of
    (parameter names, gradient bytes) of TP position t's buckets, in launch order."""

    segments: tuple[StepSegment, ...]
    buckets: tuple[tuple[tuple[tuple[str, ...], int], ...], ...]


@dataclass(frozen=True)
class StepShape:
    """What the lowering needs of a scenario's variant: the model in its compute dtype, the
    micro-batch, sequence length and accumulation, the replicas' ranks and the settings."""

    model: ModelSpec
    settings: TrainingSettings
    micro_batch_size: int
    sequence_length: int
    accumulation: int
    replicas: tuple[tuple[int, ...], ...]
    tp_algorithm: str = _TP_ALGORITHM_DEFAULT
    comm_thread: bool = False
    """The ranks share cores with their comm threads: each bucket's allreduce is followed on the
    communication stream by its messages' work on the cores (:mod:`sim.training.comm_thread`)."""

    @property
    def tensor(self) -> int:
        return len(self.replicas[0])

    @property
    def data(self) -> int:
        return len(self.replicas)

    def data_group(self, position: int) -> tuple[int, ...]:
        """The ranks of data-parallel group ``position`` (the TP position's rank in each replica)."""
        return tuple(replica[position] for replica in self.replicas)


def layer_parameters(spec: ModelSpec, tp_degree: int) -> list[tuple[OpKind, int, Parameter]]:
    """The parameter tensors of one decoder layer on one rank in gradient-ready order, each with
    the op whose weight gradient writes it and, for the two norms, which (1: the MLP's, 0: the
    attention's): ``(kind, norm index or 0, parameter)``. Shapes as :mod:`models.accounting`
    shards them (q, k, v and gate, up column-parallel; out and down row-parallel).

    A linear layer's bias is ready before its weight: ``F.linear``'s backward hands the bias its
    gradient directly and the weight its own through a transpose node, so the autograd engine
    accumulates the bias first; a norm's weight comes before its bias (its backward returns them
    in that order). Recorded with ``register_post_accumulate_grad_hook`` on
    :class:`runtime.training.model.DecoderLM` (torch 2.13): the order DDP's reducer rebuilds its
    buckets in after the first iteration (``Reducer::rebuild_buckets``)."""
    h, d = spec.hidden_size, spec.head_dim
    q_width = spec.num_attention_heads // tp_degree * d
    kv_width = kv_heads_per_rank(spec, tp_degree) * d
    mlp = spec.intermediate_size // tp_degree
    norm = [Parameter("weight", h)] + ([Parameter("bias", h)] if spec.norm == "layernorm" else [])

    def linear(kind: OpKind, name: str, weight_numel: int, bias_numel: int, bias: bool):
        weight = [(kind, 0, Parameter(f"{name}.weight", weight_numel))]
        return ([(kind, 0, Parameter(f"{name}.bias", bias_numel))] if bias else []) + weight

    params = linear(OpKind.MLP_DOWN, "mlp.down", mlp * h, h, spec.linear_bias)
    for part in (("up", "gate") if spec.mlp == "gated" else ("up",)):
        params += linear(OpKind.MLP_UP, f"mlp.{part}", h * mlp, mlp, spec.linear_bias)
    params += [(OpKind.LAYERNORM, 1, Parameter(f"mlp_norm.{p.name}", p.numel)) for p in norm]
    params += linear(OpKind.OUT_PROJ, "attn.out", q_width * h, h, spec.linear_bias)
    for part, width in (("q", q_width), ("k", kv_width), ("v", kv_width)):
        params += linear(OpKind.QKV_PROJ, f"attn.{part}", h * width, width, spec.attention_bias)
    params += [(OpKind.LAYERNORM, 0, Parameter(f"attn_norm.{p.name}", p.numel)) for p in norm]
    return params


def head_parameters(spec: ModelSpec) -> tuple[list[Parameter], list[Parameter], list[Parameter]]:
    """Every rank's parameters outside the layers: (LM head's, final norm's, embeddings'), in
    gradient-ready order; a tied LM head's gradient accumulates into the embedding table, ready
    once the embedding's backward is done. Learned position embeddings are ready before the token
    embedding table, tied or not (the same recording as :func:`layer_parameters`): with
    ``first_bucket_mb`` 1 and a cap of 1 or 5 MiB, the tiny GPT-2's position table shares the
    last bucket with the token table, as the measured run's buckets show, instead of a bucket of
    its own."""
    h = spec.hidden_size
    head = [] if spec.tied_embeddings else [Parameter("lm_head.weight", spec.vocab_size * h)]
    norm = [Parameter("final_norm.weight", h)] + ([Parameter("final_norm.bias", h)] if spec.norm == "layernorm"
                                                  else [])
    embeddings = [Parameter("embed_tokens.weight", spec.vocab_size * h)]
    if spec.learned_position_embeddings:
        embeddings.insert(0, Parameter("embed_positions.weight", spec.max_position_embeddings * h))
    return head, norm, embeddings


class _Program:
    """One rank's ops of a segment, with the training phase of each."""

    def __init__(self):
        self.ops: list[Op] = []
        self.phases: list[TrainingPhase] = []

    def add(self, op: Op, phase: TrainingPhase) -> int:
        self.ops.append(op)
        self.phases.append(phase)
        return len(self.ops) - 1


class _Calls:
    """Numbers the collective calls of a segment: the ranks of a group meet in the same call."""

    def __init__(self):
        self.ids: dict[tuple, int] = {}

    def __call__(self, key: tuple) -> int:
        return self.ids.setdefault(key, len(self.ids))


def lower_step(shape: StepShape, *, sync_gradients: bool, average_parameters: bool,
               first_replica_only: bool = False) -> TrainingStep:
    """The segments of one optimizer step (see the module docstring).

    Args:
        shape: the model (in its compute dtype), settings, batch and ranks.
        first_replica_only: programs for replica 0's ranks only (their collectives keep their
            whole groups), for a run in which the other replicas are identical to it.
        sync_gradients: DDP synchronises gradients in this step (gradient averaging); False for
            a local step under parameter averaging.
        average_parameters: the step ends with the allreduce of all parameters (every H-th step
            under parameter averaging).

    Raises:
        ConfigError: from the accounting (a tensor degree that cannot shard the model).
    """
    lowering = _Lowering(shape, (0,) if first_replica_only else tuple(range(shape.data)))
    forward = lowering.forward_segments()
    k = shape.accumulation
    settings = shape.settings
    sync_every = sync_gradients and not settings.no_sync
    quiet = lowering.backward_segment(sync=False) if k > 1 and not sync_every else None
    loud = lowering.backward_segment(sync=True) if sync_gradients else lowering.backward_segment(sync=False)
    sequence: list[StepSegment] = []
    for micro in range(k):
        backward = loud if (micro == k - 1 or sync_every) else quiet
        sequence += [_retag(s, micro) for s in forward] + [_retag(backward, micro)]
    sequence.append(_retag(lowering.optimizer_segment(average_parameters), k - 1))
    return TrainingStep(tuple(sequence), lowering.bucket_table())


def _retag(segment: StepSegment, micro: int) -> StepSegment:
    return segment if segment.micro_batch == micro else StepSegment(segment.segment, segment.phases, micro)


class _Lowering:
    def __init__(self, shape: StepShape, lowered: tuple[int, ...] | None = None):
        self.shape = shape
        self.lowered = tuple(range(shape.data)) if lowered is None else lowered
        spec = shape.model
        self.spec = spec
        t, b, s = shape.tensor, shape.micro_batch_size, shape.sequence_length
        self.forward_costs = layer_op_costs(spec, tp_degree=t, batch_size=b, new_tokens=s, context_tokens=s)
        self.backward_costs = layer_backward_costs(spec, tp_degree=t, batch_size=b, sequence_length=s)
        self.head_forward = head_op_costs(spec, batch_size=b * s, new_tokens=1)
        self.head_backward = head_backward_costs(spec, batch_size=b * s, sequence_length=1)
        self.hidden_bytes = b * s * spec.hidden_size * spec.dtype_bytes
        settings = shape.settings
        self.gradient_bytes = gradient_bytes_per_parameter(settings.precision)
        self.compressed = settings.gradient_compression is not GradientCompression.NONE
        self.wire_bytes = _COMPRESSED_BYTES if self.compressed else self.gradient_bytes
        self._buckets: list[tuple[list[Parameter], tuple]] | None = None

    def _replicas(self):
        return ((d, self.shape.replicas[d]) for d in self.lowered)

    # -- forward ---------------------------------------------------------------------------
    def forward_segments(self) -> tuple[StepSegment, ...]:
        calls = _Calls()
        prologue: dict[int, _Program] = {}
        layer: dict[int, _Program] = {}
        epilogue: dict[int, _Program] = {}
        for d, replica in self._replicas():
            for rank in replica:
                p = prologue[rank] = _Program()
                p.add(self._compute(OpKind.EMBEDDING, "embedding", self.head_forward[OpKind.EMBEDDING]),
                      TrainingPhase.FORWARD)
                p = layer[rank] = _Program()
                self._layer_forward(p, replica, calls, ("fwd", d), TrainingPhase.FORWARD, None)
                p = epilogue[rank] = _Program()
                p.add(self._compute(OpKind.LAYERNORM, "final_norm", self.head_forward[OpKind.LAYERNORM]),
                      TrainingPhase.FORWARD)
                p.add(self._compute(OpKind.LM_HEAD, "lm_head", self.head_forward[OpKind.LM_HEAD]),
                      TrainingPhase.FORWARD)
        return tuple(StepSegment(Segment(name, {r: tuple(p.ops) for r, p in programs.items()}, repeat, layers),
                                 {r: tuple(p.phases) for r, p in programs.items()}, 0)
                     for name, programs, repeat, layers in (("forward_prologue", prologue, 1, 0),
                                                            ("forward_layer", layer, self.spec.num_layers, 1),
                                                            ("forward_epilogue", epilogue, 1, 0)))

    def _layer_forward(self, p: _Program, replica, calls: _Calls, key: tuple, phase: TrainingPhase,
                       layer: int | None) -> None:
        costs = self.forward_costs
        suffix = "_recompute" if phase is TrainingPhase.RECOMPUTE else ""
        sequential = phase is TrainingPhase.FORWARD  # the forward segment runs in program order
        for kind, name in ((OpKind.LAYERNORM, "attn_norm"), (OpKind.QKV_PROJ, "qkv_proj"),
                           (OpKind.ATTENTION, "attention"), (OpKind.OUT_PROJ, "out_proj")):
            p.add(self._compute(kind, name + suffix, costs[kind], layer, sequential,
                                recompute=phase is TrainingPhase.RECOMPUTE), phase)
        if self.shape.tensor > 1:
            p.add(self._tp_allreduce("attn_allreduce" + suffix, replica, calls((*key, layer, 0)), layer, sequential),
                  phase)
        for kind, name in ((OpKind.LAYERNORM, "mlp_norm"), (OpKind.MLP_UP, "mlp_up"), (OpKind.MLP_DOWN, "mlp_down")):
            p.add(self._compute(kind, name + suffix, costs[kind], layer, sequential,
                                recompute=phase is TrainingPhase.RECOMPUTE), phase)
        if self.shape.tensor > 1:
            p.add(self._tp_allreduce("mlp_allreduce" + suffix, replica, calls((*key, layer, 1)), layer, sequential),
                  phase)

    # -- backward --------------------------------------------------------------------------
    def ready_parameters(self) -> list[tuple[Parameter, tuple]]:
        """A rank's parameters (every TP position holds the same shapes) in gradient-ready order,
        each with the key of the backward op writing its gradient: ``("lm_head",)``,
        ``("final_norm",)``, ``(layer, kind, norm)`` or ``("embedding",)``."""
        spec = self.spec
        head, norm, embeddings = head_parameters(spec)
        ready: list[tuple[Parameter, tuple]] = [(param, ("lm_head",)) for param in head]
        ready += [(param, ("final_norm",)) for param in norm]
        per_layer = layer_parameters(spec, self.shape.tensor)
        for layer in reversed(range(spec.num_layers)):
            ready += [(Parameter(f"layers.{layer}.{param.name}", param.numel), (layer, kind, norm))
                      for kind, norm, param in per_layer]
        ready += [(param, ("embedding",)) for param in embeddings]
        return ready

    def buckets(self) -> list[tuple[list[Parameter], tuple]]:
        """DDP's buckets of a rank (the same at every TP position) in launch order: their
        parameters and the key of the op that writes the last gradient of each
        (:meth:`ready_parameters`)."""
        if self._buckets is None:
            settings = self.shape.settings
            ready = self.ready_parameters()
            sizes = [param.numel * self.gradient_bytes for param, _ in ready]
            indices = bucket_assignment(sizes, [settings.first_bucket_bytes, settings.bucket_cap_bytes])
            self._buckets = [([ready[i][0] for i in bucket], ready[bucket[-1]][1]) for bucket in indices]
        return self._buckets

    def backward_segment(self, sync: bool) -> StepSegment:
        shape, spec = self.shape, self.spec
        calls = _Calls()
        programs: dict[int, _Program] = {}
        every = shape.settings.activation_checkpointing
        layers = spec.num_layers
        for d, replica in self._replicas():
            for position, rank in enumerate(replica):
                p = programs[rank] = _Program()
                group = shape.data_group(position)
                reduce = sync and len(group) > 1  # DDP over one rank: nothing crosses a link
                pending: dict[tuple, list[int]] = {}
                if reduce:
                    for index, (_, writer) in enumerate(self.buckets()):
                        pending.setdefault(writer if shape.settings.overlap else ("end",), []).append(index)

                def wrote(key: tuple, op_index: int) -> None:
                    for bucket in pending.get(key, ()):
                        self._launch(p, position, bucket, op_index, calls)

                wrote(("lm_head",), self._grad_pair(p, OpKind.LM_HEAD, "lm_head",
                                                    self.head_backward[OpKind.LM_HEAD], None))
                wrote(("final_norm",), self._grad_pair(p, OpKind.LAYERNORM, "final_norm",
                                                       self.head_backward[OpKind.LAYERNORM], None))
                for layer in reversed(range(layers)):
                    if every and (layer == layers - 1 or (layer + 1) % every == 0):
                        for again in range(layer - layer % every, layer + 1):
                            self._layer_forward(p, replica, calls, ("re", d), TrainingPhase.RECOMPUTE, again)
                    self._layer_backward(p, replica, calls, d, layer, wrote)
                cost = self.head_backward[OpKind.EMBEDDING].weight_grad
                wrote(("embedding",), p.add(self._compute(OpKind.EMBEDDING, "embedding_grad_weight", cost, None,
                                                          False, after=self._compute_tail(p),
                                                          gradient=Gradient.WEIGHT),
                                            TrainingPhase.BACKWARD))
                wrote(("end",), self._compute_tail(p)[0])
        return StepSegment(Segment("backward_sync" if sync else "backward",
                                   {r: tuple(p.ops) for r, p in programs.items()}),
                           {r: tuple(p.phases) for r, p in programs.items()}, 0)

    def _layer_backward(self, p: _Program, replica, calls: _Calls, d: int, layer: int, wrote) -> None:
        costs = self.backward_costs
        for kind, name in ((OpKind.MLP_DOWN, "mlp_down"), (OpKind.MLP_UP, "mlp_up")):
            wrote((layer, kind, 0), self._grad_pair(p, kind, name, costs[kind], layer))
        if self.shape.tensor > 1:
            p.add(self._tp_allreduce("mlp_grad_allreduce", replica, calls(("bwd", d, layer, 1)), layer, False,
                                     after=self._compute_tail(p)), TrainingPhase.BACKWARD)
        wrote((layer, OpKind.LAYERNORM, 1), self._grad_pair(p, OpKind.LAYERNORM, "mlp_norm",
                                                            costs[OpKind.LAYERNORM], layer))
        wrote((layer, OpKind.OUT_PROJ, 0), self._grad_pair(p, OpKind.OUT_PROJ, "out_proj",
                                                           costs[OpKind.OUT_PROJ], layer))
        p.add(self._compute(OpKind.ATTENTION, "attention_grad_input", costs[OpKind.ATTENTION].input_grad, layer,
                            False, after=self._compute_tail(p), gradient=Gradient.INPUT), TrainingPhase.BACKWARD)
        wrote((layer, OpKind.QKV_PROJ, 0), self._grad_pair(p, OpKind.QKV_PROJ, "qkv_proj",
                                                           costs[OpKind.QKV_PROJ], layer))
        if self.shape.tensor > 1:
            p.add(self._tp_allreduce("attn_grad_allreduce", replica, calls(("bwd", d, layer, 0)), layer, False,
                                     after=self._compute_tail(p)), TrainingPhase.BACKWARD)
        wrote((layer, OpKind.LAYERNORM, 0), self._grad_pair(p, OpKind.LAYERNORM, "attn_norm",
                                                            costs[OpKind.LAYERNORM], layer))

    @staticmethod
    def _compute_tail(p: _Program) -> tuple[int, ...]:
        """The last op of the compute stream so far (the backward chain's previous link)."""
        for index in range(len(p.ops) - 1, -1, -1):
            if p.ops[index].stream is Stream.COMPUTE:
                return (index,)
        return ()

    def _grad_pair(self, p: _Program, kind: OpKind, name: str, cost, layer: int | None) -> int:
        """Append the input-gradient and weight-gradient ops; the index of the latter."""
        first = p.add(self._compute(kind, f"{name}_grad_input", cost.input_grad, layer, False,
                                    after=self._compute_tail(p), gradient=Gradient.INPUT), TrainingPhase.BACKWARD)
        return p.add(self._compute(kind, f"{name}_grad_weight", cost.weight_grad, layer, False, after=(first,),
                                   gradient=Gradient.WEIGHT), TrainingPhase.BACKWARD)

    # -- DDP's reducer ---------------------------------------------------------------------
    def _launch(self, p: _Program, position: int, index: int, trigger: int, calls: _Calls) -> None:
        """Bucket ``index``'s allreduce (with its casts under compression), once op ``trigger`` is done."""
        settings = self.shape.settings
        numel = sum(param.numel for param in self.buckets()[index][0])
        if self.compressed:
            # The hook casts (and divides by the world size) where the backward runs, queued behind it.
            cast = OpCost(flops=2 * numel, bytes_read=numel * self.gradient_bytes,
                          bytes_written=numel * _COMPRESSED_BYTES, weight_bytes=0,
                          workspace_bytes=numel * _COMPRESSED_BYTES)
            trigger = p.add(Op(OpKind.GRADIENT_CAST, f"bucket{index}_compress", Stream.COMPUTE, cost=cast,
                               after=(trigger,)), TrainingPhase.BACKWARD)
        collective = Collective(OpKind.ALLREDUCE, settings.allreduce, self.shape.data_group(position),
                                numel * self.wire_bytes, dtype=bucket_dtype(settings))
        p.add(Op(OpKind.ALLREDUCE, f"bucket{index}_allreduce", Stream.COMM, collective=collective,
                 call=calls(("bucket", position, index)), after=(trigger,)), TrainingPhase.BACKWARD)
        if self.shape.comm_thread:
            # Its messages' scheduling on the shared cores, priced by the bucket's bytes on the wire.
            wire = OpCost(flops=0, bytes_read=collective.size_bytes, bytes_written=0, weight_bytes=0,
                          workspace_bytes=0)
            p.add(Op(OpKind.COMM_THREAD, f"bucket{index}_comm_thread", Stream.COMM, cost=wire,
                     after=(len(p.ops) - 1,)), TrainingPhase.BACKWARD)
        if self.compressed:
            back = OpCost(flops=numel, bytes_read=numel * _COMPRESSED_BYTES,
                          bytes_written=numel * self.gradient_bytes, weight_bytes=0, workspace_bytes=0)
            p.add(Op(OpKind.GRADIENT_CAST, f"bucket{index}_decompress", Stream.COMM, cost=back,
                     after=(len(p.ops) - 1,)), TrainingPhase.BACKWARD)

    def bucket_table(self) -> tuple[tuple[tuple[tuple[str, ...], int], ...], ...]:
        table = tuple((tuple(param.name for param in params), sum(param.numel for param in params)
                       * self.gradient_bytes) for params, _ in (self._buckets or ()))
        return (table,) * self.shape.tensor

    # -- optimizer -------------------------------------------------------------------------
    def optimizer_segment(self, average_parameters: bool) -> StepSegment:
        shape, spec = self.shape, self.spec
        settings = shape.settings
        calls = _Calls()
        programs: dict[int, _Program] = {}
        for d, replica in self._replicas():
            for position, rank in enumerate(replica):
                p = programs[rank] = _Program()
                params = rank_parameter_count(spec, shape.tensor, is_master=True)  # the head on every rank
                group = shape.data_group(position)
                shard = params / shape.data if settings.zero == 1 else params
                cost = optimizer_step_cost(shard, optimizer=settings.optimizer, precision=settings.precision)
                p.add(Op(OpKind.OPTIMIZER_STEP, "optimizer_step", Stream.COMPUTE, cost=cost), TrainingPhase.OPTIMIZER)
                if settings.zero == 1 and len(group) > 1:
                    size = math.ceil(params / shape.data) * spec.dtype_bytes
                    for root in group:
                        collective = Collective(OpKind.BROADCAST, "binomial", group, size, root=root)
                        p.add(Op(OpKind.BROADCAST, f"zero_broadcast{group.index(root)}", Stream.COMM,
                                 collective=collective, call=calls(("zero", position, root))), TrainingPhase.OPTIMIZER)
                if average_parameters and len(group) > 1:
                    collective = Collective(OpKind.ALLREDUCE, settings.allreduce, group, params * spec.dtype_bytes,
                                            dtype=spec.dtype)
                    p.add(Op(OpKind.ALLREDUCE, "parameter_average", Stream.COMM, collective=collective,
                             call=calls(("average", position))), TrainingPhase.OPTIMIZER)
        return StepSegment(Segment("optimizer", {r: tuple(p.ops) for r, p in programs.items()}),
                           {r: tuple(p.phases) for r, p in programs.items()}, 0)

    # -- op constructors -------------------------------------------------------------------
    def _compute(self, kind: OpKind, name: str, cost: OpCost, layer: int | None = None, sequential: bool = True,
                 after: tuple[int, ...] | None = None, gradient: Gradient | None = None,
                 recompute: bool = False) -> Op:
        return Op(kind, name, Stream.COMPUTE, cost=cost, layer=layer,
                  after=None if sequential else (after if after is not None else ()), gradient=gradient,
                  recompute=recompute)

    def _tp_allreduce(self, name: str, replica, call: int, layer: int | None, sequential: bool,
                      after: tuple[int, ...] | None = None) -> Op:
        collective = Collective(OpKind.ALLREDUCE, self.shape.tp_algorithm, tuple(replica), self.hidden_bytes,
                                dtype=self.spec.dtype)
        return Op(OpKind.ALLREDUCE, name, Stream.COMPUTE, collective=collective, call=call, layer=layer,
                  after=None if sequential else (after if after is not None else ()))

