"""A trainable decoder-only transformer built from a :class:`~models.spec.ModelSpec`, and its data.

:class:`DecoderLM` is an ``nn.Module`` with the shapes :mod:`models.accounting` prices and the
inference runtime shards (:class:`runtime.model.RankModel`): q, k and v fused into one
``qkv_proj`` matmul, gate and up into ``gate_up_proj`` (gated MLPs), norms, embeddings and an LM
head tied or not as the spec says. Its weights are :func:`runtime.weights.seeded_tensor`'s, so a
trained model starts from the same values as a generated one. The parameters are registered in
the order the forward pass uses them, which is what DDP's reducer assumes when it first assigns
gradients to buckets in reverse order (``torch/nn/parallel/distributed.py``).

Each op kind of a layer is a method named for its :class:`models.ops.OpKind`, so calibration can
time the backward of one op on the module that trains (:mod:`runtime.training.calibrate`).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053, section 3): given a
:class:`TensorParallel`, each layer keeps its rank's heads and MLP columns
(:class:`models.shards.TensorShard`, sliced by :func:`runtime.model.shard_slices` as the inference
runtime shards them): q, k, v, gate and up column-parallel, behind the ``f`` operator (identity
forward, allreduce of the input's gradient over the tensor-parallel group backward); o and down
row-parallel, followed by the ``g`` operator (allreduce of the partial sums forward, identity
backward), their bias added once after it. Embeddings, norms, row-parallel biases and the LM head
are whole on every rank of the group, and their gradients equal across it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.shards import TensorShard
from models.spec import ModelSpec
from runtime.model import _rotary_table, _rotate, shard_slices
from runtime.training.precision import compute_weight
from runtime.weights import _stable_seed, family_of, seeded_tensor


def _parameter(spec: ModelSpec, seed: int, *names: str) -> nn.Parameter:
    """The seeded tensors ``names`` (concatenated along dim 0 when several: a fused matmul)."""
    return nn.Parameter(torch.cat([seeded_tensor(spec, seed, name) for name in names]))


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group: its ``shard`` of every layer and the
    ``group`` (a ``torch.distributed`` process group) its partial sums are reduced over."""

    shard: TensorShard
    group: object


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward, the input's gradient summed over the group
    (each rank's column shard contributes its part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # autograd may hand the same gradient to another consumer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: forward, the row-parallel partial sums summed over the group; identity
    backward (every rank's partial sum has the whole output's gradient)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        # Reduced in place, as Megatron's _reduce does: the partial sum is nobody else's input.
        summed = partial.contiguous()
        if summed is partial:
            ctx.mark_dirty(partial)
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def shard_parameters(spec: ModelSpec, shard: TensorShard, parameters: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """``parameters`` of a :class:`DecoderLM` (named as it names them, layers' or the whole
    model's) cut to ``shard``: each fused projection split into its parts, each part narrowed by
    :func:`runtime.model.shard_slices`, the parts fused again; every other tensor (norms,
    embeddings, the LM head, row-parallel biases) whole. The tensors returned may be views."""
    slices = shard_slices(spec, shard)
    d, heads, kv = spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    sizes = {"q_proj": heads * d, "k_proj": kv * d, "v_proj": kv * d, "gate_proj": spec.intermediate_size,
             "up_proj": spec.intermediate_size}
    fused = {**_FUSED, "up_proj": ("gate_proj", "up_proj") if spec.mlp == "gated" else ("up_proj",)}
    out = {}
    for name, tensor in parameters.items():
        module, kind = name.split(".")[-2:] if name.startswith("layers.") else (None, None)
        if module not in fused:
            out[name] = tensor
            continue
        parts = fused[module]
        pieces = tensor.split([sizes[p] for p in parts]) if len(parts) > 1 else (tensor,)
        narrowed = []
        for part, piece in zip(parts, pieces):
            dim, first, count = slices[part]
            narrowed.append(piece.narrow(dim, first, count) if kind == "weight" or dim == 0 else piece)
        out[name] = torch.cat(narrowed) if len(narrowed) > 1 else narrowed[0]
    return out


class Norm(nn.Module):
    """LayerNorm (with bias) or RMSNorm (fp32 inside, as HF ``LlamaRMSNorm``) over the hidden size."""

    def __init__(self, spec: ModelSpec, seed: int, prefix: str):
        super().__init__()
        self.kind, self.eps, self.shape = spec.norm, family_of(spec).norm_eps, (spec.hidden_size,)
        self.weight = _parameter(spec, seed, f"{prefix}.weight")
        self.bias = _parameter(spec, seed, f"{prefix}.bias") if spec.norm == "layernorm" else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = compute_weight(self.weight)
        if self.kind == "layernorm":
            return F.layer_norm(h, self.shape, weight, compute_weight(self.bias), self.eps)
        return F.rms_norm(h.float(), self.shape, eps=self.eps).to(h.dtype) * weight


class Linear(nn.Module):
    """``x @ W^T + b`` with seeded (possibly fused) weights ``[out, in]``; under tensor parallelism
    (``group`` set by :class:`DecoderLayer`) column-parallel behind ``f``, or row-parallel
    (``row_parallel``) followed by ``g`` and then the bias."""

    def __init__(self, spec: ModelSpec, seed: int, prefix: str, parts: tuple[str, ...], bias: bool):
        super().__init__()
        self.weight = _parameter(spec, seed, *(f"{prefix}.{p}.weight" for p in parts))
        self.bias = _parameter(spec, seed, *(f"{prefix}.{p}.bias" for p in parts)) if bias else None
        self.group, self.row_parallel = None, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = compute_weight(self.weight), compute_weight(self.bias)
        if self.group is None:
            return F.linear(x, weight, bias)
        if not self.row_parallel:
            return F.linear(_CopyToTensorParallel.apply(x, self.group), weight, bias)
        out = _ReduceFromTensorParallel.apply(F.linear(x, weight), self.group)
        return out if bias is None else out + bias


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer; each method is one op kind of the accounting. With
    ``tensor_parallel``, the rank's shard of it (see the module)."""

    def __init__(self, spec: ModelSpec, seed: int, layer: int, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.spec = spec
        self.heads, self.kv_heads = spec.num_attention_heads, spec.num_kv_heads
        p = f"layers.{layer}"
        self.attn_norm = Norm(spec, seed, f"{p}.attn_norm")
        self.qkv_proj = Linear(spec, seed, p, ("q_proj", "k_proj", "v_proj"), spec.attention_bias)
        self.o_proj = Linear(spec, seed, p, ("o_proj",), spec.linear_bias)
        self.mlp_norm = Norm(spec, seed, f"{p}.mlp_norm")
        up = ("gate_proj", "up_proj") if spec.mlp == "gated" else ("up_proj",)
        self.up_proj = Linear(spec, seed, p, up, spec.linear_bias)
        self.down_proj = Linear(spec, seed, p, ("down_proj",), spec.linear_bias)
        if tensor_parallel is not None:
            self._shard(tensor_parallel)

    def _shard(self, tp: TensorParallel) -> None:
        """Keep only ``tp.shard`` of the weights drawn whole (one layer's at a time)."""
        whole = {f"layers.{name}": p.data for name, p in self.named_parameters()}
        cut = shard_parameters(self.spec, tp.shard, whole)
        for name, p in self.named_parameters():
            # A fresh contiguous copy, so no narrowed view keeps the whole tensor alive.
            p.data = cut[f"layers.{name}"].clone(memory_format=torch.contiguous_format)
        self.heads, self.kv_heads = len(tp.shard.query_heads), len(tp.shard.kv_heads)
        for linear in (self.qkv_proj, self.up_proj, self.o_proj, self.down_proj):
            linear.group = tp.group
        self.o_proj.row_parallel = self.down_proj.row_parallel = True

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[b, heads, t, d]``, k and v ``[b, kv_heads, t, d]`` of the normed input ``x`` ``[b, t, h]``."""
        b, t, _ = x.shape
        d = self.spec.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        return (q.view(b, t, -1, d).transpose(1, 2), k.view(b, t, -1, d).transpose(1, 2),
                v.view(b, t, -1, d).transpose(1, 2))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Causal attention ``[b, t, heads * d]``; rotary embeddings first unless positions are learned.
        Grouped-query heads share their KV head (``enable_gqa``)."""
        if rotary is not None:
            cos, sin = rotary
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        b, heads, t, d = out.shape
        return out.transpose(1, 2).reshape(b, t, heads * d)

    def mlp_up(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` (gated) or tanh-GELU of ``up`` (plain), ``[b, t, intermediate]``."""
        if self.spec.mlp == "gated":
            gate, up = self.up_proj(x).chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(self.up_proj(x), approximate="tanh")

    def forward(self, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        h = h + self.o_proj(self.attention(*self.qkv(self.attn_norm(h)), rotary))
        return h + self.down_proj(self.mlp_up(self.mlp_norm(h)))


class DecoderLM(nn.Module):
    """The whole model of ``spec`` with seeded weights; ``forward(tokens)`` gives logits.

    Args:
        checkpoint_every: None, or k: recompute each segment of k consecutive layers in backward
            (``torch.utils.checkpoint`` with ``use_reentrant=False``, keeping only the segment's
            input; :func:`models.training.recomputed_layer_count`).
        tensor_parallel: None, or this rank's :class:`TensorParallel` (see the module).

    Raises:
        ValueError: ``checkpoint_every`` below 1.
    """

    def __init__(self, spec: ModelSpec, seed: int, checkpoint_every: int | None = None,
                 tensor_parallel: TensorParallel | None = None):
        super().__init__()
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be positive (got {checkpoint_every})")
        self.spec, self.checkpoint_every = spec, checkpoint_every
        self.embed = nn.Parameter(seeded_tensor(spec, seed, "embed.weight"))
        self.pos_embed = (nn.Parameter(seeded_tensor(spec, seed, "pos_embed.weight"))
                          if spec.learned_position_embeddings else None)
        self.layers = nn.ModuleList(DecoderLayer(spec, seed, i, tensor_parallel) for i in range(spec.num_layers))
        self.final_norm = Norm(spec, seed, "final_norm")
        self.lm_head = None if spec.tied_embeddings else nn.Parameter(seeded_tensor(spec, seed, "lm_head.weight"))

    def rotary(self, t: int, device: torch.device, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin ``[t, d]`` of positions 0..t-1 in ``dtype`` (None with learned positions)."""
        if self.spec.learned_position_embeddings:
            return None
        return _rotary_table(self.spec.head_dim, family_of(self.spec).rope_theta, t, device, dtype)

    def embedding(self, tokens: torch.LongTensor) -> torch.Tensor:
        """``[b, t, h]`` embeddings of ``tokens`` ``[b, t]`` (plus learned positions)."""
        h = F.embedding(tokens, compute_weight(self.embed))
        if self.pos_embed is not None:
            h = h + compute_weight(self.pos_embed)[:tokens.shape[1]]
        return h

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, t, vocab]`` of the final-normed stream."""
        return F.linear(self.final_norm(h), compute_weight(self.embed if self.lm_head is None else self.lm_head))

    def forward(self, tokens: torch.LongTensor) -> torch.Tensor:
        h = self.embedding(tokens)
        # In the stream's dtype: bf16 under bf16_mixed's bf16 weights (Megatron's default, without
        # --rotary-position-embeddings-in-fp32), fp32 otherwise (autocast casts what it needs).
        rotary = self.rotary(tokens.shape[1], tokens.device, h.dtype)
        if self.checkpoint_every is None:
            for layer in self.layers:
                h = layer(h, rotary)
        else:
            k = self.checkpoint_every
            for first in range(0, len(self.layers), k):
                h = checkpoint(self._segment, h, rotary, first, first + k, use_reentrant=False)
        return self.lm_logits(h)

    def _segment(self, h: torch.Tensor, rotary, first: int, stop: int) -> torch.Tensor:
        for layer in self.layers[first:stop]:
            h = layer(h, rotary)
        return h


def next_token_loss(logits: torch.Tensor, targets: torch.LongTensor) -> torch.Tensor:
    """Mean cross-entropy over every position, in fp32: ``logits`` ``[b, t, vocab]``, ``targets`` ``[b, t]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def training_batch(spec: ModelSpec, global_batch_size: int, sequence_length: int, seed: int,
                   step: int) -> torch.LongTensor:
    """Step ``step``'s global batch, ``[global_batch_size, sequence_length + 1]`` token ids (int64,
    CPU) uniform over the vocabulary: inputs are ``[:, :-1]``, next-token targets ``[:, 1:]``.
    Deterministic in (``seed``, ``step``); every rank draws the same batch and takes its rows."""
    generator = torch.Generator().manual_seed(_stable_seed(seed, f"training batch {step}"))
    return torch.randint(0, spec.vocab_size, (global_batch_size, sequence_length + 1), generator=generator)
