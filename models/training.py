"""Training accounting: backward FLOPs and bytes per op, recomputation, the optimizer step, and
memory by category per device for data-parallel training with optional tensor parallelism.

Units and conventions are those of :mod:`models.accounting`: bytes, FLOPs (a multiply-accumulate
counts two), tensor parallelism as in Megatron-LM (arXiv 1909.08053, section 3) with the
embeddings, final norm and LM head on the master rank only. The spec's ``dtype`` is the compute
dtype (weights as the kernels read them, activations, activation gradients); under
``bf16_mixed`` pass ``spec.with_dtype(compute_dtype(precision))``.

Backward of a linear layer ``Y = X W`` (X: (m, k), W: (k, n)) follows Narayanan et al. 2021
(arXiv 2104.04473, section 5.1 and appendix): the input gradient ``dX = dY W^T`` and the weight
gradient ``dW = X^T dY`` cost 2mnk each, twice the forward. Attention's backward follows the
standard algorithm of Dao et al. 2022 (arXiv 2205.14135, appendix B.2): ``dV = P^T dO``,
``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))``, ``dQ = dS K``, ``dK = dS^T Q``: four
matmuls over the score matrix, twice the forward's two. Elementwise backward FLOPs count one per
arithmetic operation of the closed-form derivative PyTorch's CPU kernels evaluate
(``aten/src/ATen/native/cpu/layer_norm_kernel.cpp``, ``aten/src/ATen/native/cpu/Activation.cpp``),
the forward's convention in :mod:`models.accounting`; see the constants below.
"""

import math
from dataclasses import dataclass
from enum import StrEnum

from models.accounting import (
    OpCost,
    _check_positive,
    check_tensor_parallel,
    kv_heads_per_rank,
    layer_op_costs,
    rank_parameter_count,
)
from models.dtypes import dtype_bytes
from models.errors import ConfigError, shorten
from models.ops import OpKind
from models.spec import ModelSpec

# Backward FLOPs per element, one per operation of the derivative's closed form.
# LayerNorm, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma and
# xhat = (x - mean) * rstd recomputed: g 1, xhat 2, the two row sums 3, the bracket and rstd 4.
# RMSNorm, dx = rstd * (g - xhat * mean(g * xhat)): g 1, xhat 1, the row sum 2, the rest 3.
_NORM_INPUT_GRAD_FLOPS = {"layernorm": 10, "rmsnorm": 7}
# dgamma += dy * xhat (2); LayerNorm's dbeta += dy (1).
_NORM_WEIGHT_GRAD_FLOPS = {"layernorm": 3, "rmsnorm": 2}
# The residual add's backward: the stream's gradient plus the branch's (1).
_RESIDUAL_ADD_GRAD_FLOPS = 1
# Gated: out = silu(g) * u; sigmoid(g) 4, silu 1, du = dy * silu 1, dy * u 1,
# silu'(g) = sigmoid * (1 + g * (1 - sigmoid)) 4, dg 1. Plain: tanh-GELU's derivative as
# GeluBackward evaluates it: x^2, x^3, the tanh argument (3) and tanh, 0.5x, 1 + t, 0.5(1 + t),
# 1 - t^2 (2), 0.5x(1 - t^2), the inner derivative (3), product, sum, times dy.
_ACTIVATION_GRAD_FLOPS = {"gated": 12, "plain": 18}
# Softmax backward per score: P * dP, row sum, subtract, times P.
_SOFTMAX_GRAD_FLOPS = 4

# Dropout masks are one byte per element (Korthikanti et al. 2022, arXiv 2205.05198, section 4.1).
_DROPOUT_MASK_BYTES = 1
# Adam's two moments, and the master weights of mixed precision, are fp32.
_FP32_BYTES = dtype_bytes("fp32")
GRADIENT_DTYPE = "fp32"
"""The dtype DDP's buckets hold and allreduce the gradients in, under every :class:`Precision`
unless a ``gradient_dtype`` is given (:func:`gradient_bytes_per_parameter`): the fp32 parameters'
own under ``fp32`` and ``amp_bf16``, the fp32 main gradients under ``bf16_mixed``
(:mod:`runtime.training.precision`). What a training calibration times the reduction in and the
simulator prices the buckets' reductions by (:mod:`runtime.training.calibrate`)."""


class Optimizer(StrEnum):
    """The optimizers a training workload can use (torch.optim defaults: SGD without momentum,
    Adam without L2 weight decay)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


# Per-parameter FLOPs of one step, torch.optim's single-tensor paths with those defaults:
# SGD p -= lr * g (2); Adam m.lerp_(g, 1 - b1) (3), v = b2 v + (1 - b2) g^2 (4),
# denom = sqrt(v) / sqrt(bc2) + eps (3), p.addcdiv_(m, denom, -step) (3); AdamW adds the
# decoupled decay p *= 1 - lr * wd (1) (Loshchilov and Hutter, arXiv 1711.05101, algorithm 2).
_OPTIMIZER_STEP_FLOPS = {Optimizer.SGD: 2, Optimizer.ADAM: 13, Optimizer.ADAMW: 14}
_OPTIMIZER_MOMENTS = {Optimizer.SGD: 0, Optimizer.ADAM: 2, Optimizer.ADAMW: 2}


class Precision(StrEnum):
    """``fp32``: everything fp32. ``bf16_mixed``: bf16 weights and activations, gradients
    accumulated and allreduced in fp32 (by default, :func:`gradient_bytes_per_parameter`), fp32
    master weights and optimizer states (Micikevicius et al. 2018, arXiv 1710.03740, section 3.1;
    Megatron-LM's layout; the runtime trains it so, :mod:`runtime.training.precision`).
    ``amp_bf16``: PyTorch's automatic mixed precision (``torch.autocast`` to bf16 over fp32
    parameters, "Automatic Mixed Precision" in the PyTorch docs): fp32 weights, gradients and
    optimizer states, the matrix products and the tensors they save in bf16, the residual stream
    in fp32 (measured on an H100: validation/gpu-report)."""

    FP32 = "fp32"
    BF16_MIXED = "bf16_mixed"
    AMP_BF16 = "amp_bf16"


_FP32_STATES = frozenset({Precision.FP32, Precision.AMP_BF16})  # parameters, gradients and states all fp32


class Recompute(StrEnum):
    """What a layer stores for backward (Korthikanti et al. 2022, arXiv 2205.05198, section 5):
    everything, everything but the attention score matrices (``selective``), or only its input
    (``full``)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Loss(StrEnum):
    """How the cross-entropy loss and its gradient are computed, which sets what the head holds:
    ``autograd``, PyTorch's ``F.cross_entropy`` of fp32 logits under autograd (fp32 copies, the
    saved log-probabilities and their gradients, :func:`loss_backward_bytes`); ``fused``, one
    kernel that computes the loss and writes the logits' gradient over the logits themselves, in
    their dtype, as llm.c's ``fused_classifier`` does (``llmc/fused_classifier.cuh``: "replaces
    logits with logit gradients"; no fp32 copy, nothing saved beyond the logits)."""

    AUTOGRAD = "autograd"
    FUSED = "fused"


@dataclass(frozen=True)
class BackwardCost:
    """Backward cost of one op on one rank: the gradient of its inputs and of its weights apart.

    ``weight_grad`` is all zeros for an op without parameters (attention)."""

    input_grad: OpCost
    weight_grad: OpCost


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one device holds during a training step, by category.

    ``weights``: the model's parameters as the kernels use them. ``gradients``: the ``.grad`` of
    every parameter. ``optimizer_states``: moments, fp32 master weights and fp32 gradient copies
    (sharded under ZeRO-1). ``activations``: what the forward pass keeps for backward at its peak.
    ``bucket_buffers``: DDP's flat bucket copies of the gradients. ``framework``: a fixed baseline
    (CUDA context, allocator pools) the caller supplies.
    """

    weights: float
    gradients: float
    optimizer_states: float
    activations: float
    bucket_buffers: float
    framework: float

    @property
    def total(self) -> float:
        """Sum of the categories, in bytes."""
        return (
            self.weights + self.gradients + self.optimizer_states + self.activations
            + self.bucket_buffers + self.framework
        )


def parse_optimizer(value: object, field: str = "training.optimizer") -> Optimizer:
    """The :class:`Optimizer` named ``value``; raises :class:`ConfigError` on ``field`` otherwise."""
    return _parse(Optimizer, value, field)


def parse_precision(value: object, field: str = "training.precision") -> Precision:
    """The :class:`Precision` named ``value``; raises :class:`ConfigError` on ``field`` otherwise."""
    return _parse(Precision, value, field)


def compute_dtype(precision: Precision | str) -> str:
    """The dtype weights, activations and activation gradients are computed in: ``"fp32"`` or
    ``"bf16"``. Raises :class:`ConfigError` on ``training.precision`` if it is unknown."""
    return "fp32" if parse_precision(precision) is Precision.FP32 else "bf16"


def layer_backward_costs(
    spec: ModelSpec, *, tp_degree: int, batch_size: int, sequence_length: int, gradient_dtype: str | None = None
) -> dict[OpKind, BackwardCost]:
    """Backward cost on one rank of one decoder layer for ``batch_size`` sequences of
    ``sequence_length`` tokens, per op kind of :func:`models.accounting.layer_op_costs`.

    With T = batch_size * sequence_length tokens and the widths of ``layer_op_costs``:

    - linears (QKV_PROJ, OUT_PROJ, MLP_DOWN, and the projection in MLP_UP), (T, k) @ (k, n):
      input gradient 2Tkn FLOPs, reads dY and W, writes dX; weight gradient 2Tkn (+ T per bias
      element), reads dY and X, writes dW (and the bias gradient) in ``gradient_dtype``.
    - MLP_UP's input gradient adds the activation's backward over (T, i) (gated: 12 FLOPs per
      element, reading dY, gate and up outputs; plain: 18, reading dY and the GELU input).
    - ATTENTION: input gradients only, ``scores * (8 * head_dim + 4)`` over the causal pairs;
      reads dO, q, k, v and the stored probabilities, writes dq, dk, dv; its workspace holds
      dP / dS (a naive, non-flash kernel).
    - LAYERNORM (one of the two per layer): input gradient 10 (LayerNorm) or 7 (RMSNorm) FLOPs
      per element plus 1 for the residual add, reads dy, the residual stream's gradient and x;
      weight gradient 3 or 2 per element, reads dy and x.

    ``gradient_dtype`` defaults to the spec's dtype. Raises :class:`ConfigError` if
    ``tp_degree`` cannot shard ``spec``, a count is not a positive integer or the dtype is unknown.
    """
    check_tensor_parallel(spec, tp_degree)
    _check_positive("batch_size", batch_size, "batch size")
    _check_positive("sequence_length", sequence_length, "sequence length")
    b = spec.dtype_bytes
    g = b if gradient_dtype is None else dtype_bytes(gradient_dtype, "training.gradient_dtype")
    h = spec.hidden_size
    d = spec.head_dim
    tokens = batch_size * sequence_length
    q_heads = spec.num_attention_heads // tp_degree
    q_width = q_heads * d
    kv_width = kv_heads_per_rank(spec, tp_degree) * d
    qkv_width = q_width + 2 * kv_width
    mlp_width = spec.intermediate_size // tp_degree
    projections = 2 if spec.mlp == "gated" else 1

    up = _linear_backward(tokens, h, projections * mlp_width, projections * mlp_width if spec.linear_bias else 0, b, g)
    saved = tokens * mlp_width * projections * b
    activation_flops = tokens * mlp_width * _ACTIVATION_GRAD_FLOPS[spec.mlp]
    mlp_up_input = OpCost(
        flops=up.input_grad.flops + activation_flops,
        bytes_read=up.input_grad.bytes_read + tokens * mlp_width * b + saved,
        bytes_written=up.input_grad.bytes_written,
        weight_bytes=up.input_grad.weight_bytes,
        workspace_bytes=up.input_grad.workspace_bytes + saved,
    )

    pairs = sequence_length * (sequence_length + 1) // 2
    scores = batch_size * q_heads * pairs
    square_bytes = batch_size * q_heads * sequence_length * sequence_length * b
    qkv_bytes = tokens * qkv_width * b
    attention = OpCost(
        flops=scores * (8 * d + _SOFTMAX_GRAD_FLOPS),
        bytes_read=tokens * q_width * b + qkv_bytes + square_bytes,
        bytes_written=qkv_bytes,
        weight_bytes=0,
        workspace_bytes=square_bytes + qkv_bytes,
    )

    return {
        OpKind.LAYERNORM: _norm_backward(spec, tokens, g),
        OpKind.QKV_PROJ: _linear_backward(tokens, h, qkv_width, qkv_width if spec.attention_bias else 0, b, g),
        OpKind.ATTENTION: BackwardCost(input_grad=attention, weight_grad=_NO_COST),
        OpKind.OUT_PROJ: _linear_backward(tokens, q_width, h, h if spec.linear_bias else 0, b, g),
        OpKind.MLP_UP: BackwardCost(input_grad=mlp_up_input, weight_grad=up.weight_grad),
        OpKind.MLP_DOWN: _linear_backward(tokens, mlp_width, h, h if spec.linear_bias else 0, b, g),
    }


def head_backward_costs(
    spec: ModelSpec, *, batch_size: int, sequence_length: int, gradient_dtype: str | None = None
) -> dict[OpKind, BackwardCost]:
    """Backward cost of the master-only ops around the layers, for T = batch_size *
    sequence_length tokens. Training computes the logits of every position, so the matching
    forward is :func:`models.accounting.head_op_costs` with ``batch_size=T, new_tokens=1``.

    - LM_HEAD: (T, h) @ (h, vocab), as a linear (:func:`layer_backward_costs`); tied, its weight
      gradient accumulates into the embedding table's.
    - LAYERNORM: the final norm and residual add, as a layer's norm.
    - EMBEDDING: no input gradient (token ids); the weight gradient scatter-adds the T rows of dY
      into each table (one FLOP per element; learned positions add the position table's), reading
      dY and the rows, writing the rows; its workspace is the dense gradient of the tables.

    The loss (softmax cross-entropy over the logits) is not counted. Raises :class:`ConfigError`
    if a count is not a positive integer or the dtype is unknown.
    """
    _check_positive("batch_size", batch_size, "batch size")
    _check_positive("sequence_length", sequence_length, "sequence length")
    b = spec.dtype_bytes
    g = b if gradient_dtype is None else dtype_bytes(gradient_dtype, "training.gradient_dtype")
    h = spec.hidden_size
    tokens = batch_size * sequence_length
    tables = 2 if spec.learned_position_embeddings else 1
    table_rows = spec.vocab_size + (spec.max_position_embeddings if spec.learned_position_embeddings else 0)
    rows = tables * tokens * h
    embedding = OpCost(
        flops=rows,
        bytes_read=tokens * h * b + rows * g,
        bytes_written=rows * g,
        weight_bytes=table_rows * h * b,
        workspace_bytes=table_rows * h * g,
    )
    return {
        OpKind.EMBEDDING: BackwardCost(input_grad=_NO_COST, weight_grad=embedding),
        OpKind.LAYERNORM: _norm_backward(spec, tokens, g),
        OpKind.LM_HEAD: _linear_backward(tokens, h, spec.vocab_size, 0, b, g),
    }


def recomputed_layer_count(num_layers: int, checkpoint_every: int | None) -> int:
    """Layers whose forward runs a second time, during backward, under activation checkpointing.

    ``checkpoint_every=k`` splits the layers into consecutive segments of k (the last may be
    shorter), each checkpointed as a unit: only its input is kept, and its whole forward runs
    again before its backward (Megatron-LM's ``--recompute-method uniform --recompute-num-layers
    k``, ``megatron/core/transformer/transformer_block.py``; ``torch.utils.checkpoint``). Every
    layer is in some segment, so all ``num_layers`` recompute; ``None``: none. ``k`` trades memory
    only (see :func:`activation_bytes`). Raises :class:`ConfigError` on
    ``training.activation_checkpointing`` unless ``k`` is a positive integer.
    """
    if checkpoint_every is None:
        return 0
    _check_positive("training.activation_checkpointing", checkpoint_every, "layers per checkpointed segment")
    return num_layers


def layer_step_flops(
    spec: ModelSpec, *, tp_degree: int, batch_size: int, sequence_length: int, recompute: bool = False
) -> float:
    """FLOPs one rank spends on one decoder layer in one training step: forward (the norm twice),
    backward (input and weight gradients) and, with ``recompute``, the forward again.

    Raises :class:`ConfigError` as :func:`layer_backward_costs` does.
    """
    forward = layer_op_costs(
        spec, tp_degree=tp_degree, batch_size=batch_size, new_tokens=sequence_length, context_tokens=sequence_length
    )
    backward = layer_backward_costs(spec, tp_degree=tp_degree, batch_size=batch_size, sequence_length=sequence_length)
    forward_flops = sum(cost.flops * _invocations(kind) for kind, cost in forward.items())
    backward_flops = sum(
        (cost.input_grad.flops + cost.weight_grad.flops) * _invocations(kind) for kind, cost in backward.items()
    )
    return forward_flops * (2 if recompute else 1) + backward_flops


def optimizer_step_cost(
    parameters: float, *, optimizer: Optimizer | str, precision: Precision | str, gradient_dtype: str | None = None
) -> OpCost:
    """Cost of one optimizer step over ``parameters`` parameters (the ZeRO-1 shard, P / D, where
    the states are sharded).

    FLOPs per parameter: SGD 2, Adam 13, AdamW 14 (torch.optim's ``_single_tensor_sgd``,
    ``_single_tensor_adam``; see ``_OPTIMIZER_STEP_FLOPS``). Bytes: it reads the weights it updates
    (the fp32 master under ``bf16_mixed``), the gradients and the moments and writes them back;
    under ``bf16_mixed`` it also writes the bf16 copy of the weights, and with non-fp32 gradients
    first converts them into the fp32 copy it steps with (read 2, write 4, read 4 bytes).
    ``weight_bytes``: the states and fp32 copies that must be resident. Raises
    :class:`ConfigError` on a bad optimizer, precision, gradient dtype or negative count.
    """
    optimizer = parse_optimizer(optimizer)
    precision = parse_precision(precision)
    if not isinstance(parameters, (int, float)) or isinstance(parameters, bool) or not 0 <= parameters < math.inf:
        raise ConfigError("parameters", f"must be a non-negative number (got {shorten(parameters)})")
    grad = gradient_bytes_per_parameter(precision, gradient_dtype)
    moments = _OPTIMIZER_MOMENTS[optimizer] * _FP32_BYTES
    read = _FP32_BYTES + moments
    written = _FP32_BYTES + moments
    if precision is Precision.BF16_MIXED:
        written += dtype_bytes(compute_dtype(precision))
    if grad == _FP32_BYTES:
        read += grad
    else:
        read += grad + 2 * _FP32_BYTES
        written += _FP32_BYTES
    return OpCost(
        flops=parameters * _OPTIMIZER_STEP_FLOPS[optimizer],
        bytes_read=parameters * read,
        bytes_written=parameters * written,
        weight_bytes=parameters * optimizer_state_bytes_per_parameter(optimizer, precision, gradient_dtype),
        workspace_bytes=0,
    )


def gradient_bytes_per_parameter(precision: Precision | str, gradient_dtype: str | None = None) -> int:
    """Bytes of one parameter's gradient: 4 under ``fp32`` and ``amp_bf16``; under ``bf16_mixed`` the
    ``gradient_dtype``'s size, fp32 (4) unless given: Megatron-LM accumulates and allreduces a bf16
    model's gradients in an fp32 ``main_grad`` buffer (``accumulate_allreduce_grads_in_fp32``, turned
    on for ``--bf16`` in ``megatron/training/arguments.py``), as the runtime does
    (:mod:`runtime.training.precision`); ``"bf16"`` is DeepSpeed's bf16 gradients. Raises
    :class:`ConfigError` on ``training.gradient_dtype`` for an unknown dtype or anything but fp32
    under ``fp32`` or ``amp_bf16``.
    """
    precision = parse_precision(precision)
    if gradient_dtype is None:
        return dtype_bytes(GRADIENT_DTYPE)
    size = dtype_bytes(gradient_dtype, "training.gradient_dtype")
    if precision in _FP32_STATES and size != _FP32_BYTES:
        raise ConfigError("training.gradient_dtype",
                          f"must be fp32 under {precision.value} precision (got {gradient_dtype!r})")
    return size


def optimizer_state_bytes_per_parameter(
    optimizer: Optimizer | str, precision: Precision | str, gradient_dtype: str | None = None
) -> int:
    """Optimizer-held bytes per parameter, before ZeRO sharding: fp32 moments (SGD 0, Adam and
    AdamW 2 x 4), and under ``bf16_mixed`` the fp32 master weights (4) plus, when the gradients
    are not fp32, the fp32 gradient copy the master step uses (4), as DeepSpeed's ZeRO optimizer
    keeps it (``single_partition_of_fp32_groups`` in ``deepspeed/runtime/zero/stage_1_and_2.py``).
    Raises :class:`ConfigError` as :func:`gradient_bytes_per_parameter` does.
    """
    optimizer = parse_optimizer(optimizer)
    precision = parse_precision(precision)
    state = _OPTIMIZER_MOMENTS[optimizer] * _FP32_BYTES
    if precision is Precision.BF16_MIXED:
        state += _FP32_BYTES
        if gradient_bytes_per_parameter(precision, gradient_dtype) != _FP32_BYTES:
            state += _FP32_BYTES
    return state


def model_state_memory(
    parameters: int,
    *,
    optimizer: Optimizer | str,
    precision: Precision | str,
    gradient_dtype: str | None = None,
    data_parallel: int = 1,
    zero_stage: int = 0,
    gradient_as_bucket_view: bool = False,
) -> TrainingMemory:
    """Weights, gradients, optimizer states and DDP bucket buffers of one device holding
    ``parameters`` parameters (its tensor-parallel shard), in bytes; activations and framework 0.

    Per parameter: weights 4 (``fp32``, ``amp_bf16``) or 2 (``bf16_mixed``); gradients
    :func:`gradient_bytes_per_parameter`; optimizer states
    :func:`optimizer_state_bytes_per_parameter`, divided by ``data_parallel`` under
    ``zero_stage=1`` (ZeRO-1, Rajbhandari et al. 2020, arXiv 1910.02054, section 5.1; torch's
    ``ZeroRedundancyOptimizer``), counted as an even split P / D. DDP's reducer copies every
    gradient into flat bucket buffers (``initialize_buckets`` in
    ``torch/csrc/distributed/c10d/reducer.cpp``) that together hold all gradients whatever
    ``bucket_cap_mb`` (which only sets how many there are); ``gradient_as_bucket_view`` makes each
    ``.grad`` a view into its bucket, so the buffers add nothing.

    Mixed-precision Adam with fp32 gradients and bucket views gives Megatron-LM's 18 bytes per
    parameter, and 6 + 12 / D with ZeRO-1 (``compute_weight_and_optimizer_memory`` in
    ``megatron/training/theoretical_memory_usage.py``); with bf16 gradients and ZeRO-1 it gives
    DeepSpeed's 4P + 16P / N (``estimate_zero2_model_states_mem_needs`` without offload,
    ``deepspeed/runtime/zero/stage_1_and_2.py``). Raises :class:`ConfigError` on
    ``parallel.data``, ``training.zero`` and the fields above.
    """
    precision = parse_precision(precision)
    _check_positive("parameters", parameters, "parameter count")
    _check_positive("parallel.data", data_parallel, "data-parallel degree")
    if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
        raise ConfigError("training.zero", f"must be 0 or 1 (got {shorten(zero_stage)})")
    if not isinstance(gradient_as_bucket_view, bool):
        raise ConfigError(
            "training.gradient_as_bucket_view", f"must be true or false (got {shorten(gradient_as_bucket_view)})"
        )
    gradients = parameters * gradient_bytes_per_parameter(precision, gradient_dtype)
    states = optimizer_state_bytes_per_parameter(optimizer, precision, gradient_dtype) * parameters
    if zero_stage == 1:
        states = states / data_parallel
    return TrainingMemory(
        weights=parameters * (_FP32_BYTES if precision in _FP32_STATES else dtype_bytes(compute_dtype(precision))),
        gradients=gradients,
        optimizer_states=states,
        activations=0,
        bucket_buffers=0 if gradient_as_bucket_view else gradients,
        framework=0,
    )


@dataclass(frozen=True)
class ActivationLayout:
    """How one micro-batch's activations lie on a rank: ``micro_batch_size`` sequences of
    ``sequence_length`` tokens, tensor parallelism of degree ``tp_degree`` (with Megatron's
    ``sequence_parallel`` or without), whether the model applies ``dropout`` (one-byte masks),
    and how the ``loss`` is computed (:class:`Loss`).

    Construction raises :class:`ConfigError` naming the field (``workload.micro_batch_size``,
    ``workload.sequence_length``, ``parallel.tensor``, ``training.sequence_parallel``,
    ``training.dropout``, ``training.loss``).
    """

    micro_batch_size: int
    sequence_length: int
    tp_degree: int = 1
    sequence_parallel: bool = False
    dropout: bool = False
    loss: Loss = Loss.AUTOGRAD

    def __post_init__(self) -> None:
        _check_positive("workload.micro_batch_size", self.micro_batch_size, "micro-batch size")
        _check_positive("workload.sequence_length", self.sequence_length, "sequence length")
        _check_positive("parallel.tensor", self.tp_degree, "tensor-parallel degree")
        for field in ("sequence_parallel", "dropout"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ConfigError(f"training.{field}", f"must be true or false (got {shorten(value)})")
        if self.loss not in set(Loss):
            raise ConfigError("training.loss", f"unknown loss; known: {', '.join(Loss)} (got {shorten(self.loss)})")

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch, ``micro_batch_size * sequence_length``."""
        return self.micro_batch_size * self.sequence_length


def layer_activation_bytes(
    spec: ModelSpec, layout: ActivationLayout, *, recompute: Recompute | str = Recompute.NONE,
    autocast: bool = False,
) -> float:
    """Bytes one decoder layer keeps for backward on one rank, in the spec's dtype (dropout masks
    one byte per element), after Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1).

    With s = sequence_length, b = micro_batch_size, a = heads, e = bytes per element, kept per
    layer: the inputs of the two norms, of the QKV projection and of the first MLP linear
    (4 sbh e), q and k (sb (q + k widths) e), v, the output projection's input, the MLP's
    intermediates (plain: the GELU input and the down projection's input, 2 sbi e; gated: gate,
    SiLU output, up and their product, 4 sbi e, as PyTorch's autograd saves them), the attention
    probabilities (as^2 b e; with dropout also its mask and output) and, with dropout, the masks
    after attention and MLP (2 sbh). The probabilities are an ``eager`` kernel's (``spec.attention``):
    a fused one (``sdpa``, FlashAttention) saves one fp32 logsumexp per query row (4 asb) instead
    and recomputes them in backward (Dao et al. 2022, arXiv 2205.14135, section 3.1), as
    selective recomputation would; measured on an H100 (validation/gpu-report), TinyLlama-1.1B
    at 8 x 1024 tokens held 19.0 GB of activations, against 26.2 GB counted with the
    probabilities (the rest: autocast's fp32 residual stream, ``autocast``). Tensor parallelism splits all but the first group and the
    residual-dropout masks; ``sequence_parallel`` splits those too. ``selective`` drops the
    as^2 b terms; ``full`` keeps only the layer's input, 2sbh for 2-byte elements, split only
    under sequence parallelism. For GPT-style layers (LayerNorm, plain MLP of 4h, as many KV
    heads as heads, dropout, 2 bytes) this is the paper's table 2: sbh(34 + 5as/h),
    sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh/t (34 + 5as/h) with sequence
    parallelism too.

    ``autocast``: the layer runs under automatic mixed precision with fp32 parameters (PyTorch's
    ``torch.autocast``, ``amp_bf16``): the residual stream stays fp32, so the norms'
    inputs are 4-byte (and a segment's checkpointed input); an RMSNorm's gain multiplies the fp32
    normalised tensor and saves it (as HF's ``LlamaRMSNorm`` and the runtime's ``Norm``); the linears
    save the ``spec.dtype`` copies autocast casts their inputs to. The replicated group is then
    sbh (2 x 4 + 2 x 4 + 2e) with RMSNorm, sbh (2 x 4 + 2e) with LayerNorm (which saves only its
    input), instead of 4 sbh e. Measured on an H100 (validation/gpu-report), TinyLlama-1.1B at
    8 x 1024 tokens: 19.0 GB of activations against 18.9 GB counted so (14.4 GB in bf16).

    Raises :class:`ConfigError` if ``layout.tp_degree`` cannot shard ``spec`` or ``recompute`` is
    unknown.
    """
    t = layout.tp_degree
    check_tensor_parallel(spec, t)
    recompute = _parse(Recompute, recompute, "training.recompute")
    e = spec.dtype_bytes
    tokens = layout.tokens
    h = spec.hidden_size
    sp_split = t if layout.sequence_parallel else 1
    residual = _FP32_BYTES if autocast else e
    if recompute is Recompute.FULL:
        return tokens * h * residual / sp_split
    mask = _DROPOUT_MASK_BYTES if layout.dropout else 0
    if autocast:
        normalised = 2 * _FP32_BYTES if spec.norm == "rmsnorm" else 0
        replicated = tokens * h * (2 * residual + normalised + 2 * e) + 2 * tokens * h * mask
    else:
        replicated = 4 * tokens * h * e + 2 * tokens * h * mask
    q_width = spec.num_attention_heads // t * spec.head_dim
    kv_width = kv_heads_per_rank(spec, t) * spec.head_dim
    intermediates = (4 if spec.mlp == "gated" else 2) * spec.intermediate_size // t
    split = tokens * (2 * q_width + 2 * kv_width + intermediates) * e
    rows = layout.micro_batch_size * spec.num_attention_heads // t * layout.sequence_length
    if spec.attention != "eager":  # a fused kernel saves one fp32 logsumexp per query row
        split += rows * _FP32_BYTES
    elif recompute is Recompute.NONE:
        squares = rows * layout.sequence_length
        split += squares * (2 * e + mask if layout.dropout else e)
    return replicated / sp_split + split


def activation_bytes(
    spec: ModelSpec, layout: ActivationLayout, *, checkpoint_every: int | None = None, is_master: bool = True,
    autocast: bool = False,
) -> float:
    """Peak bytes of activations kept for backward on one rank for one micro-batch.

    Without checkpointing, every layer's :func:`layer_activation_bytes`. With
    ``checkpoint_every=k`` (segments of k layers, see :func:`recomputed_layer_count`): the input of
    each of the ceil(L / k) segments, plus, while the backward of one segment runs, that
    segment's min(k, L) layers' full activations (its input counted once). On the master, the
    head's: the final norm's and the LM head's inputs (2 sbh e) and the logits of every position
    (sbV e) with the fp32 log-probabilities cross-entropy saves (sbV 4). Gradients of activations,
    transient during backward, are not counted. ``autocast``: as :func:`layer_activation_bytes`; the
    head's final norm then also keeps its fp32 input (and, an RMSNorm, its fp32 normalised
    tensor) beside the LM head's input copy. Raises :class:`ConfigError` as
    :func:`layer_activation_bytes` and :func:`recomputed_layer_count` do.
    """
    layer_total = _layers_saved_bytes(spec, layout, checkpoint_every, autocast, one_segment_recomputed=True)
    if not is_master:
        return layer_total
    return layer_total + _head_activation_bytes(spec, layout, autocast)


def _layers_saved_bytes(spec: ModelSpec, layout: ActivationLayout, checkpoint_every: int | None, autocast: bool,
                        *, one_segment_recomputed: bool) -> float:
    """The layers' part of :func:`activation_bytes`: every layer's saved tensors, or under
    checkpointing each segment's input, with one segment's min(k, L) layers' full activations in
    its place where ``one_segment_recomputed`` (a segment's backward running)."""
    full = layer_activation_bytes(spec, layout, autocast=autocast)
    layers = spec.num_layers
    if not recomputed_layer_count(layers, checkpoint_every):
        return layers * full
    segment_input = layer_activation_bytes(spec, layout, recompute=Recompute.FULL, autocast=autocast)
    segments = math.ceil(layers / checkpoint_every)
    if not one_segment_recomputed:
        return segments * segment_input
    return (segments - 1) * segment_input + min(checkpoint_every, layers) * full


def _head_activation_bytes(spec: ModelSpec, layout: ActivationLayout, autocast: bool) -> float:
    """The head's part of :func:`activation_bytes`: the final norm's and LM head's inputs and
    ``e + 4`` bytes per logit (the logits and the fp32 log-probabilities cross-entropy saves;
    ``e`` under a fused loss, :class:`Loss`)."""
    e = spec.dtype_bytes
    if autocast:
        normalised = _FP32_BYTES if spec.norm == "rmsnorm" else 0
        head_inputs = spec.hidden_size * (_FP32_BYTES + normalised + e)
    else:
        head_inputs = 2 * spec.hidden_size * e
    saved = _FP32_BYTES if layout.loss == Loss.AUTOGRAD else 0
    return layout.tokens * (head_inputs + spec.vocab_size * (e + saved))


# At the loss's backward the head holds three fp32 tensors of one element per logit: the
# log-probabilities log_softmax saved, nll_loss_backward's gradient of them and
# _log_softmax_backward_data's gradient of the logits (see loss_backward_bytes).
_LOSS_BACKWARD_LOGIT_BYTES = 3 * _FP32_BYTES


def loss_backward_bytes(
    spec: ModelSpec, layout: ActivationLayout, *, checkpoint_every: int | None = None, autocast: bool = False,
) -> float:
    """Bytes of activations live on the master while the loss's backward runs, the first thing a
    backward pass does, before any weight gradient exists: every layer's saved tensors (under
    checkpointing only each segment's input: no segment has been recomputed yet), the head's
    saved inputs (as :func:`activation_bytes`) and 12 bytes per logit of every position (under a
    fused loss, :class:`Loss`, only the head's saved inputs and the logits, overwritten in place).

    The loss is fp32 cross-entropy (``F.cross_entropy`` of the fp32 logits, which ATen computes
    as ``nll_loss(log_softmax(x))``, ``cross_entropy_loss`` in ``aten/src/ATen/native/LossNLL.cpp``).
    Autograd saves log_softmax's fp32 output (``LogSoftmaxBackward0`` keeps ``result``, which
    ``NllLossBackward0`` keeps too, ``tools/autograd/derivatives.yaml``); nothing saves the logits
    themselves (``ToCopyBackward0`` and the flattening view keep only sizes), so the ``e`` bytes
    per logit :func:`activation_bytes` counts (the forward's peak, where the logits and their
    log-probabilities coexist) are freed by then. Backward first makes ``nll_loss_backward``'s
    fp32 gradient of the log-probabilities (``LossNLL.cpp``), then
    ``_log_softmax_backward_data`` makes the logits' fp32 gradient from it and the saved output
    (``aten/src/ATen/native/SoftMax.cpp``) while both are alive: 3 x 4 bytes per logit. Measured
    with the CPU memory probe (``benchmarks/bench_loss_backward_memory.py``: one process, a tiny
    Llama, 2.1M logits), a step's peak over the resident is what autograd saved plus 8 bytes per
    logit to 0.4 MB in ``fp32``, ``amp_bf16`` and ``bf16_mixed`` (48.7, 44.6, 38.6 MB). Raises
    :class:`ConfigError` as :func:`activation_bytes` does.
    """
    layer_total = _layers_saved_bytes(spec, layout, checkpoint_every, autocast, one_segment_recomputed=False)
    head = _head_activation_bytes(spec, layout, autocast)
    if layout.loss == Loss.FUSED:  # the logits' gradient overwrites them: nothing beyond the head
        return layer_total + head
    logits = layout.tokens * spec.vocab_size
    return layer_total + head - logits * (spec.dtype_bytes + _FP32_BYTES) + logits * _LOSS_BACKWARD_LOGIT_BYTES


def accumulation_transient_bytes(
    spec: ModelSpec, layout: ActivationLayout, *, precision: Precision | str, gradient_dtype: str | None = None,
    is_master: bool = True,
) -> float:
    """Bytes a later micro-batch's backward holds at its start beyond its activations and the
    gradients accumulated so far: the step's peak under gradient accumulation, where every
    ``.grad`` is already allocated while the first operations of backward run (the first
    micro-batch's backward allocates them as its activations are freed, which the categories
    already bound). On the master, which computes the loss: the gradient the loss's backward
    hands the log-probabilities and the one log-softmax's backward makes of the logits, fp32
    elements of every position and token each (2 sbV 4, the loss is computed in fp32:
    ``nll_loss_backward`` and ``_log_softmax_backward_data`` each allocate a tensor of their
    input's shape, ``aten/src/ATen/native/LossNLL.cpp`` and ``SoftMax.cpp``), the logits' own in
    the compute dtype where that is not fp32 (sbV e), and the LM head's new weight gradient
    (Vh at the gradient's size), a tensor of its own until ``AccumulateGrad`` adds it in place to
    the ``.grad`` held (``torch/csrc/autograd/functions/accumulate_grad.h``); with tied
    embeddings it waits in autograd's input buffer until the embedding's contribution arrives
    at the end of backward (``torch/csrc/autograd/input_buffer.cpp``). The three are counted
    together, an upper bound of what coexists. ``spec`` in the compute dtype; 0 off the master.
    Raises :class:`ConfigError` as :func:`gradient_bytes_per_parameter` does.
    """
    gradient = gradient_bytes_per_parameter(precision, gradient_dtype)
    if not is_master:
        return 0
    e = spec.dtype_bytes
    logits = layout.tokens * spec.vocab_size
    # a fused loss writes the logits' gradient over them (:class:`Loss`)
    loss_grads = logits * (2 * _FP32_BYTES + (e if e != _FP32_BYTES else 0)) if layout.loss == Loss.AUTOGRAD else 0
    return loss_grads + spec.vocab_size * spec.hidden_size * gradient


def training_memory(
    spec: ModelSpec,
    layout: ActivationLayout,
    *,
    optimizer: Optimizer | str,
    precision: Precision | str,
    data_parallel: int = 1,
    gradient_dtype: str | None = None,
    zero_stage: int = 0,
    gradient_as_bucket_view: bool = False,
    checkpoint_every: int | None = None,
    framework_baseline_bytes: float = 0,
    is_master: bool = True,
    accumulation: int = 1,
) -> TrainingMemory:
    """Memory by category of one device training ``spec`` data-parallel over ``data_parallel``
    replicas of ``layout.tp_degree`` tensor-parallel ranks: :func:`model_state_memory` of the
    rank's parameters (:func:`models.accounting.rank_parameter_count`), :func:`activation_bytes`
    in the precision's compute dtype (with ``accumulation`` micro-batches per step, more than
    one, plus :func:`accumulation_transient_bytes`), and ``framework_baseline_bytes`` as given.
    The step's peak is the larger of those activations with every gradient allocated (an upper
    bound of backward, where activations are freed as gradients are made) and, on the master,
    the loss's backward (:func:`loss_backward_bytes`) before any gradient is allocated: the
    activations category is then what that moment holds beyond the gradients, so that the
    categories still add up to the peak. Measured on an H100 (validation/gpu-report), Qwen2.5-0.5B
    (152k vocabulary) peaks there; TinyLlama-1.1B (32k) with its gradients.
    Raises :class:`ConfigError` naming the offending field (``training.framework_baseline_bytes``
    for a negative baseline, ``training.gradient_accumulation`` for fewer than 1 micro-batch).
    """
    _check_positive("training.gradient_accumulation", accumulation, "micro-batch count")
    if (
        not isinstance(framework_baseline_bytes, (int, float)) or isinstance(framework_baseline_bytes, bool)
        or not 0 <= framework_baseline_bytes < math.inf
    ):
        raise ConfigError(
            "training.framework_baseline_bytes",
            f"must be a non-negative number of bytes (got {shorten(framework_baseline_bytes)})",
        )
    states = model_state_memory(
        rank_parameter_count(spec, layout.tp_degree, is_master=is_master),
        optimizer=optimizer,
        precision=precision,
        gradient_dtype=gradient_dtype,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    compute_spec = spec.with_dtype(compute_dtype(precision))
    autocast = parse_precision(precision) is Precision.AMP_BF16
    activations = activation_bytes(compute_spec, layout, checkpoint_every=checkpoint_every, is_master=is_master,
                                   autocast=autocast)
    if accumulation > 1:
        activations += accumulation_transient_bytes(compute_spec, layout, precision=precision,
                                                    gradient_dtype=gradient_dtype, is_master=is_master)
    if is_master:
        # The first micro-batch's loss backward runs before backward allocates any gradient (they
        # are freed by zero_grad; views into the buckets are resident): its peak beside the
        # resident states is loss_backward_bytes, which the categories count as activations
        # beyond the gradients allocated later.
        allocated = 0 if gradient_as_bucket_view else states.gradients
        head_peak = loss_backward_bytes(compute_spec, layout, checkpoint_every=checkpoint_every, autocast=autocast)
        activations = max(activations, head_peak - allocated)
    return TrainingMemory(
        weights=states.weights,
        gradients=states.gradients,
        optimizer_states=states.optimizer_states,
        activations=activations,
        bucket_buffers=states.bucket_buffers,
        framework=framework_baseline_bytes,
    )


_NO_COST = OpCost(flops=0, bytes_read=0, bytes_written=0, weight_bytes=0, workspace_bytes=0)


def _invocations(kind: OpKind) -> int:
    # The plan runs the residual add and norm twice per layer, before attention and before the MLP.
    return 2 if kind is OpKind.LAYERNORM else 1


def _norm_backward(spec: ModelSpec, tokens: int, g: int) -> BackwardCost:
    """Residual add and norm over (tokens, h) in the spec's dtype, weight gradients in ``g`` bytes."""
    b = spec.dtype_bytes
    elements = tokens * spec.hidden_size
    norm_weights = spec.hidden_size * (2 if spec.norm == "layernorm" else 1)
    return BackwardCost(
        input_grad=OpCost(
            flops=elements * (_NORM_INPUT_GRAD_FLOPS[spec.norm] + _RESIDUAL_ADD_GRAD_FLOPS),
            bytes_read=3 * elements * b + norm_weights * b,
            bytes_written=elements * b,
            weight_bytes=norm_weights * b,
            workspace_bytes=elements * b,
        ),
        weight_grad=OpCost(
            flops=elements * _NORM_WEIGHT_GRAD_FLOPS[spec.norm],
            bytes_read=2 * elements * b,
            bytes_written=norm_weights * g,
            weight_bytes=norm_weights * b,
            workspace_bytes=norm_weights * g,
        ),
    )


def _linear_backward(
    tokens: int, in_features: int, out_features: int, bias_features: int, b: int, g: int
) -> BackwardCost:
    """(tokens, in) @ (in, out) plus a bias: activations and weights in ``b`` bytes, gradients of
    the weights written in ``g``."""
    matmul_flops = 2 * tokens * in_features * out_features
    weight_elements = in_features * out_features + bias_features
    input_bytes = tokens * in_features * b
    output_grad_bytes = tokens * out_features * b
    return BackwardCost(
        input_grad=OpCost(
            flops=matmul_flops,
            bytes_read=output_grad_bytes + in_features * out_features * b,
            bytes_written=input_bytes,
            weight_bytes=weight_elements * b,
            workspace_bytes=input_bytes,
        ),
        weight_grad=OpCost(
            flops=matmul_flops + tokens * bias_features,
            bytes_read=output_grad_bytes + input_bytes,
            bytes_written=weight_elements * g,
            weight_bytes=weight_elements * b,
            workspace_bytes=weight_elements * g,
        ),
    )


def _parse(enum: type[StrEnum], value: object, field: str):
    try:
        return enum(value)
    except (ValueError, TypeError):
        known = ", ".join(member.value for member in enum)
        raise ConfigError(field, f"must be one of {known} (got {shorten(value)})") from None


