"""One rank's shard of a decoder-only transformer, and two generators that check it.

:class:`RankModel` runs the compute ops of ``sim/plan.py`` on one rank of a tensor-parallel group,
sharded exactly as ``models/accounting.py`` prices it (Megatron-LM, arXiv 1909.08053, section 3):
q, k, v and the MLP up (and gate) projections split by output features, the attention output and
MLP down projections by input features, norms replicated, the embeddings, final norm and LM head on
the master (rank index 0) only. The executor combines the row-parallel partial sums with
collectives; :func:`tensor_parallel_generate` emulates that in one process by adding them, and
:func:`reference_generate` is an independent, unsharded implementation to compare against.

Weights come from :mod:`runtime.weights`; norm epsilon and rotary base from its family table.
"""

import math
from collections.abc import Callable, Collection, Iterable

import torch
import torch.nn.functional as F

from models.shards import TensorShard, tensor_shards
from models.spec import ModelSpec
from runtime.weights import (block_names, block_of, family_of, prompt_tokens, seeded_tensor, seeded_weights,
                             weight_shapes)
from sim.program import NormSite, Stage

# The weight and prompt helpers are re-exported: callers need only this module.
__all__ = ["RankModel", "prompt_tokens", "reference_generate", "seeded_tensor", "seeded_weights",
           "tensor_parallel_generate"]
_NORMS = tuple(NormSite)


class RankModel:
    """Rank ``rank_index`` of a tensor-parallel group of ``tp_degree`` ranks running ``spec``.

    Builds only its own shards (each drawn with :func:`seeded_tensor`, sliced, cast to ``dtype``
    and moved to ``device``) and preallocates its KV cache, ``k_cache[layer]`` and
    ``v_cache[layer]`` of shape ``[batch_size, local_kv_heads, max_tokens, head_dim]``.

    Sharding: the rank holds ``shard`` (:class:`models.shards.TensorShard`: its query heads, the KV
    heads they use, its MLP features), by default its slice of the even split: query heads
    ``[r * H/tp, (r + 1) * H/tp)`` and the KV heads they use, ``kv/tp`` of them, or, when ``tp``
    exceeds the KV heads, a replica of KV head ``r // (tp/kv)``; MLP features
    ``[r * I/tp, (r + 1) * I/tp)``. An uneven shard is sliced the same way from its ranges.
    q, k and v are stored fused as ``layers.i.qkv_proj``, and gate and up as
    ``layers.i.gate_up_proj``, so each is one matmul as the accounting prices it; every other
    tensor keeps its :func:`runtime.weights.weight_shapes` name.

    Weight streaming: the tensors of each decoder layer form two blocks (``layer3.attention``,
    ``layer3.mlp``, :func:`runtime.weights.block_of`). Blocks named in ``skip_blocks`` are not built
    (their tensors are absent from ``weights``); :meth:`block_shard` draws one block for its file,
    :meth:`add_block` and :meth:`drop_block` move blocks in and out of ``weights``.

    Pipeline parallelism: with ``stage`` (:class:`sim.program.Stage`) the rank holds only that
    stage's layers (their KV cache included), and its master the embeddings on the first stage,
    the final norm and LM head on the last (with tied embeddings, its own copy of the embedding
    matrix). A micro-batch's pass sets :attr:`rows`, the KV-cache rows of its sequences.

    Ops take and return activations ``[batch, new_tokens, ...]`` in ``dtype`` on ``device``; the
    new tokens sit at positions ``start_pos, start_pos + 1, ...``. Raises
    :class:`models.errors.ConfigError` if ``tp_degree`` cannot shard ``spec`` evenly and no ``shard``
    is given, ``ValueError`` for
    a rank index outside the group, a non-positive batch size or ``max_tokens``, or ``max_tokens``
    beyond ``spec.max_position_embeddings``.
    """

    def __init__(self, spec: ModelSpec, tp_degree: int, rank_index: int, *, seed: int, batch_size: int,
                 max_tokens: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 skip_blocks: Collection[str] = (), shard: TensorShard | None = None, stage: Stage | None = None):
        if not 0 <= rank_index < tp_degree:
            raise ValueError(f"rank index must be in 0..{tp_degree - 1} (got {rank_index})")
        if batch_size < 1 or max_tokens < 1:
            raise ValueError(f"batch size and max tokens must be positive (got {batch_size}, {max_tokens})")
        if max_tokens > spec.max_position_embeddings:
            raise ValueError(f"max tokens exceed the {spec.max_position_embeddings} positions of "
                             f"{spec.name} (got {max_tokens})")
        self.spec, self.tp_degree, self.rank_index, self.seed = spec, tp_degree, rank_index, seed
        self.is_master = rank_index == 0
        self.stage = stage or Stage(0, spec.num_layers, embeds=True, heads=True)
        self.layers = range(self.stage.first_layer, self.stage.first_layer + self.stage.num_layers)
        # The KV-cache rows the next pass writes and reads: a pipeline's micro-batch sets its own.
        self.rows = slice(None)
        self.max_tokens = max_tokens
        self.device, self.dtype = torch.device(device), dtype
        self.norm_eps = family_of(spec).norm_eps
        self.shard = shard if shard is not None else tensor_shards(spec, tp_degree)[rank_index]
        self.num_heads = len(self.shard.query_heads)
        self.num_kv_heads = len(self.shard.kv_heads)
        skip = set(skip_blocks) | (set(block_names(spec)) - set(self.block_names))
        self.weights = self._build_shards((n for n in weight_shapes(spec) if block_of(n) not in skip
                                           and self._holds(n)), self.device)
        cache_shape = (batch_size, self.num_kv_heads, max_tokens, spec.head_dim)
        # Indexed by the model's layer; None for the layers of other pipeline stages.
        self.k_cache = [torch.zeros(cache_shape, device=self.device, dtype=dtype) if i in self.layers else None
                        for i in range(spec.num_layers)]
        self.v_cache = [torch.zeros(cache_shape, device=self.device, dtype=dtype) if i in self.layers else None
                        for i in range(spec.num_layers)]
        if not spec.learned_position_embeddings:
            self._cos, self._sin = _rotary_table(spec.head_dim, family_of(spec).rope_theta, max_tokens,
                                                 self.device, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds: ``rank_weight_bytes`` of the accounting, scaled
        from ``spec.dtype`` to this model's dtype."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def embedding(self, tokens: torch.LongTensor, start_pos: int) -> torch.Tensor:
        """Token embeddings ``[batch, t, hidden]`` of ``tokens`` ``[batch, t]``, plus the learned
        position embeddings of positions ``start_pos .. start_pos + t - 1`` (GPT-2). Master only."""
        self._require_master("embedding")
        h = F.embedding(tokens.to(self.device), self.weights["embed.weight"])
        if self.spec.learned_position_embeddings:
            self._check_span(start_pos, tokens.shape[1])
            h = h + self.weights["pos_embed.weight"][start_pos:start_pos + tokens.shape[1]]
        return h

    def norm(self, h: torch.Tensor, layer: int | None, which: NormSite | str) -> torch.Tensor:
        """LayerNorm or RMSNorm of the residual stream ``h`` ``[batch, t, hidden]``.

        ``which`` (a :class:`sim.program.NormSite` or its value) is ``"attn"`` or ``"mlp"`` (the
        norm before that sub-layer of ``layer``, on every rank) or ``"final"`` (``layer`` None,
        master only). RMSNorm normalises in fp32 and casts
        back before the gain, as HF ``LlamaRMSNorm`` does. Raises ``ValueError`` on another ``which``.
        """
        if which not in _NORMS:
            raise ValueError(f"norm must be one of {', '.join(_NORMS)} (got {which!r})")
        if which == NormSite.FINAL:
            self._require_master("the final norm")
            prefix = "final_norm"
        else:
            prefix = f"layers.{layer}.{which}_norm"
        gain, shape = self.weights[f"{prefix}.weight"], (self.spec.hidden_size,)
        if self.spec.norm == "layernorm":
            return F.layer_norm(h, shape, gain, self.weights[f"{prefix}.bias"], self.norm_eps)
        return F.rms_norm(h.float(), shape, eps=self.norm_eps).to(h.dtype) * gain

    def qkv_proj(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q ``[b, t, local_heads, head_dim]``, k and v ``[b, t, local_kv_heads,
        head_dim]`` from the normalised input ``x`` ``[b, t, hidden]``, in one matmul."""
        b, t, _ = x.shape
        d = self.spec.head_dim
        qkv = self._linear(x, f"layers.{layer}.qkv_proj")
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        kv_shape = (b, t, self.num_kv_heads, d)
        return q.view(b, t, self.num_heads, d), k.view(kv_shape), v.view(kv_shape)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  start_pos: int) -> torch.Tensor:
        """Causal attention of the new tokens over the cache, ``[b, t, local_heads * head_dim]``.

        Applies rotary embeddings to q and k (unless positions are learned), writes k and v into
        the cache at positions ``[start_pos, start_pos + t)``, then attends over the cache's first
        ``start_pos + t`` positions; each local KV head serves ``local_heads / local_kv_heads``
        query heads (grouped-query attention). The kernel is ``spec.attention``, as the accounting
        charges it: ``sdpa`` calls ``torch.nn.functional.scaled_dot_product_attention`` (a fused
        kernel that does not materialise the scores); ``eager`` materialises the scores and
        soft-maxes them in fp32. Raises ``ValueError`` past ``max_tokens``.
        """
        b, t, _, d = q.shape
        end = start_pos + t
        self._check_span(start_pos, t)
        if not self.spec.learned_position_embeddings:
            cos, sin = self._cos[start_pos:end, None, :], self._sin[start_pos:end, None, :]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rows = self.rows
        self.k_cache[layer][rows, :, start_pos:end] = k.transpose(1, 2)
        self.v_cache[layer][rows, :, start_pos:end] = v.transpose(1, 2)
        keys, values = self.k_cache[layer][rows, :, :end], self.v_cache[layer][rows, :, :end]
        if self.spec.attention == "sdpa":
            return self._fused_attention(q, keys, values, start_pos)
        # Fold each KV head's query heads into the query axis, so K and V are read once per KV head.
        kv_heads, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        queries = q.view(b, t, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, d)
        scores = queries @ keys.transpose(-1, -2) * d**-0.5
        query_pos = torch.arange(start_pos, end, device=self.device).repeat(group)
        future = torch.arange(end, device=self.device) > query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(future, float("-inf")).float(), dim=-1).to(q.dtype)
        out = (probs @ values).view(b, kv_heads, group, t, d)
        return out.permute(0, 3, 1, 2, 4).reshape(b, t, self.num_heads * d)

    def _fused_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         start_pos: int) -> torch.Tensor:
        """``scaled_dot_product_attention`` of ``q`` ``[b, t, heads, d]`` over the cached ``keys`` /
        ``values`` ``[b, kv_heads, start_pos + t, d]``, causal from ``start_pos``."""
        b, t, _, d = q.shape
        # A prefill from position 0 is plain causal; one new token sees the whole cache. Only a
        # chunk after a prefix needs an explicit mask (its rows end start_pos positions later).
        mask, causal = None, start_pos == 0 and t > 1
        if start_pos and t > 1:
            mask = torch.ones(t, start_pos + t, dtype=torch.bool, device=self.device).tril(diagonal=start_pos)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(b, t, self.num_heads * d)

    def out_proj(self, o: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's partial sum ``[b, t, hidden]`` of the attention output projection."""
        return self._row_parallel(o, f"layers.{layer}.o_proj")

    def mlp_up(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """``[b, t, intermediate / tp]``: ``silu(gate) * up`` (gated, one fused matmul), or
        tanh-approximated GELU of ``up`` (plain, GPT-2's ``gelu_new``)."""
        if self.spec.mlp == "gated":
            gate, up = self._linear(x, f"layers.{layer}.gate_up_proj").chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(self._linear(x, f"layers.{layer}.up_proj"), approximate="tanh")

    def mlp_down(self, a: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's partial sum ``[b, t, hidden]`` of the MLP down projection."""
        return self._row_parallel(a, f"layers.{layer}.down_proj")

    def lm_head(self, x_last: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, vocab]`` in the model dtype from the final-normed last positions ``[b, hidden]``
        (the embedding matrix when tied). Master only."""
        self._require_master("lm_head")
        return F.linear(x_last, self.weights["embed.weight" if self.spec.tied_embeddings else "lm_head.weight"])

    @property
    def block_names(self) -> tuple[str, ...]:
        """Every weight block of the rank's layers, in order of use (``layer0.attention``,
        ``layer0.mlp``, ...)."""
        return tuple(b for b in block_names(self.spec) if int(b.split(".")[0].removeprefix("layer")) in self.layers)

    def _holds(self, name: str) -> bool:
        """Whether the rank holds tensor ``name`` (its layers' shards; on the master the embeddings
        if its stage embeds, the final norm and LM head if it samples; tied, the embedding matrix
        for the head)."""
        if name.startswith("layers."):
            return True  # skip_blocks left out the other stages' layers
        if not self.is_master:
            return False
        if name.startswith("final_norm") or name == "lm_head.weight":
            return self.stage.heads
        if name == "embed.weight":
            return self.stage.embeds or (self.stage.heads and self.spec.tied_embeddings)
        return self.stage.embeds

    @property
    def resident_blocks(self) -> set[str]:
        """The blocks whose tensors ``weights`` holds now."""
        return {b for b in map(block_of, list(self.weights)) if b is not None}

    def block_shard(self, block: str) -> dict[str, torch.Tensor]:
        """The tensors of ``block`` (``"layer3.mlp"``) on this rank, named as in ``weights``, drawn
        and sharded as the constructor does, on the CPU in the model's dtype; not stored."""
        names = [n for n in weight_shapes(self.spec) if block_of(n) == block]
        if not names:
            raise ValueError(f"{block!r} is not a weight block of {self.spec.name} (e.g. 'layer0.mlp')")
        return self._build_shards(names, torch.device("cpu"))

    def add_block(self, tensors: dict[str, torch.Tensor]) -> None:
        """Make a block's tensors (named as in ``weights``, on ``device``) available to the ops."""
        self.weights.update(tensors)  # one dict update: the loader thread adds while ops read

    def drop_block(self, block: str) -> None:
        """Forget the tensors of ``block``; the model keeps no reference, so their memory is freed
        once the caller's references are gone."""
        # list() copies the keys in one step: the loader thread may add a block meanwhile.
        for name in [n for n in list(self.weights) if block_of(n) == block]:
            del self.weights[name]

    def reset_cache(self) -> None:
        """Zero the KV cache, for a new batch of sequences."""
        for cache in (*self.k_cache, *self.v_cache):
            if cache is not None:
                cache.zero_()

    def _build_shards(self, names: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's shards of the tensors ``names`` (of :func:`weight_shapes`), fused where the
        ops want one matmul. A fused group's parts always share a block, so any selection by block
        fuses completely."""
        spec = self.spec
        slices = shard_slices(spec, self.shard)
        shards = {}
        for name in names:
            tensor = seeded_tensor(spec, self.seed, name)
            proj, kind = name.split(".")[-2:]
            if proj in slices:
                dim, first, count = slices[proj]
                if kind == "weight":
                    tensor = tensor.narrow(dim, first, count)
                elif dim == 0:  # a column-parallel bias follows its output features
                    tensor = tensor.narrow(0, first, count)
            # copy=True so a narrowed view does not keep the full tensor's storage alive.
            shards[name] = tensor.to(device, self.dtype, copy=True)
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
        if spec.mlp == "gated":
            fused["gate_up_proj"] = ("gate_proj", "up_proj")
        for layer in range(spec.num_layers):
            for target, parts in fused.items():
                for kind in ("weight", "bias"):
                    names = [f"layers.{layer}.{p}.{kind}" for p in parts]
                    if names[0] in shards:
                        shards[f"layers.{layer}.{target}.{kind}"] = torch.cat([shards.pop(n) for n in names])
        return shards

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.weights[f"{prefix}.weight"], self.weights.get(f"{prefix}.bias"))

    def _row_parallel(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        # Every rank holds the bias (the accounting replicates it), but only the master adds it,
        # so that the reduced sum contains it exactly once.
        bias = self.weights.get(f"{prefix}.bias") if self.is_master else None
        return F.linear(x, self.weights[f"{prefix}.weight"], bias)

    def _require_master(self, op: str) -> None:
        if not self.is_master:
            raise RuntimeError(f"{op} runs on the master (rank index 0) only (got rank index {self.rank_index})")

    def _check_span(self, start_pos: int, new_tokens: int) -> None:
        if start_pos < 0 or start_pos + new_tokens > self.max_tokens:
            raise ValueError(f"positions {start_pos}..{start_pos + new_tokens - 1} outside the "
                             f"{self.max_tokens}-token cache (got start_pos {start_pos})")


def shard_slices(spec: ModelSpec, shard: TensorShard) -> dict[str, tuple[int, int, int]]:
    """Where ``shard`` lies in each sharded projection's weight ``[out, in]`` (Megatron-LM, arXiv
    1909.08053, section 3): projection name -> (dimension, first index, count). q, k, v, gate and
    up are column-parallel (dimension 0, their output features: the shard's heads or MLP columns),
    o and down row-parallel (dimension 1, their input features). A column-parallel bias follows
    dimension 0; a row-parallel bias is whole on every rank."""
    d = spec.head_dim
    q, kv, mlp = shard.query_heads, shard.kv_heads, shard.mlp_columns
    return {
        "q_proj": (0, q.start * d, len(q) * d),
        "k_proj": (0, kv.start * d, len(kv) * d),
        "v_proj": (0, kv.start * d, len(kv) * d),
        "o_proj": (1, q.start * d, len(q) * d),
        "gate_proj": (0, mlp.start, len(mlp)),
        "up_proj": (0, mlp.start, len(mlp)),
        "down_proj": (1, mlp.start, len(mlp)),
    }


def tensor_parallel_generate(spec: ModelSpec, tp_degree: int, *, seed: int, prompt: torch.LongTensor,
                             output_tokens: int, dtype: torch.dtype = torch.float32,
                             shards: tuple[TensorShard, ...] | None = None,
                             ) -> tuple[torch.LongTensor, list[torch.Tensor]]:
    """Greedy generation by ``tp_degree`` :class:`RankModel` shards in one process, on the CPU
    (``shards``: each rank's slice when uneven, :func:`models.shards.tensor_shards`).

    Follows the op order of the ``allreduce_ln`` strategy (``sim/strategies/allreduce_ln.py``):
    the partial sums of ``out_proj`` and ``mlp_down`` are added in rank order (what an allreduce
    computes) and every rank normalises its own copy of the residual stream. Returns what :func:`reference_generate`
    returns, and raises what it and :class:`RankModel` raise.
    """
    batch, prompt_len = prompt.shape
    _check_generation(spec, prompt_len, output_tokens)
    ranks = [RankModel(spec, tp_degree, r, seed=seed, batch_size=batch, max_tokens=prompt_len + output_tokens - 1,
                       dtype=dtype, shard=shards[r] if shards else None) for r in range(tp_degree)]
    master = ranks[0]

    def forward(tokens: torch.LongTensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = master.embedding(tokens, start_pos)
        x = [rank.norm(h, 0, NormSite.ATTENTION) for rank in ranks]
        for layer in range(spec.num_layers):
            h = h + sum(rank.out_proj(rank.attention(*rank.qkv_proj(x_r, layer), layer, start_pos), layer)
                        for rank, x_r in zip(ranks, x))
            x = [rank.norm(h, layer, NormSite.MLP) for rank in ranks]
            h = h + sum(rank.mlp_down(rank.mlp_up(x_r, layer), layer) for rank, x_r in zip(ranks, x))
            if layer + 1 < spec.num_layers:
                x = [rank.norm(h, layer + 1, NormSite.ATTENTION) for rank in ranks]
        hidden = master.norm(h, None, NormSite.FINAL)[:, -1]
        return hidden, master.lm_head(hidden)

    return _greedy(forward, prompt, output_tokens)


def reference_generate(spec: ModelSpec, *, seed: int, prompt: torch.LongTensor, output_tokens: int,
                       dtype: torch.dtype = torch.float32) -> tuple[torch.LongTensor, list[torch.Tensor]]:
    """Greedy generation by the whole model in one process, on the CPU: the reference.

    A plain pre-norm decoder written after HF ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` (eager
    attention with ``repeat_kv``, a KV cache grown by concatenation), sharing nothing with
    :class:`RankModel` but the weights of :func:`seeded_weights`. Prefills ``prompt`` ``[batch,
    prompt_len]`` then decodes. Returns the tokens ``[batch, output_tokens]`` (int64; the first from
    the prefill) and, per step, the final-normed hidden state of the last position ``[batch,
    hidden]``. Raises ``ValueError`` if ``output_tokens`` < 1 or the sequence outgrows
    ``spec.max_position_embeddings``.
    """
    _check_generation(spec, prompt.shape[1], output_tokens)
    w = seeded_weights(spec, seed, dtype=dtype)
    family = family_of(spec)
    heads, kv_heads, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    past: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: keys, values [b, kv_heads, context, d]

    def linear(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, w[f"{prefix}.weight"], w.get(f"{prefix}.bias"))

    def norm(x: torch.Tensor, prefix: str) -> torch.Tensor:
        if spec.norm == "layernorm":
            return F.layer_norm(x, (spec.hidden_size,), w[f"{prefix}.weight"], w[f"{prefix}.bias"],
                                family.norm_eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + family.norm_eps)
        return w[f"{prefix}.weight"] * x32.to(x.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def attention(x: torch.Tensor, i: int, start_pos: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = linear(x, f"layers.{i}.q_proj").view(b, t, heads, d).transpose(1, 2)
        k = linear(x, f"layers.{i}.k_proj").view(b, t, kv_heads, d).transpose(1, 2)
        v = linear(x, f"layers.{i}.v_proj").view(b, t, kv_heads, d).transpose(1, 2)
        if not spec.learned_position_embeddings:
            inv_freq = 1.0 / family.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
            freqs = torch.arange(start_pos, start_pos + t, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if i < len(past):
            k, v = torch.cat((past[i][0], k), dim=2), torch.cat((past[i][1], v), dim=2)
            past[i] = (k, v)
        else:
            past.append((k, v))
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
        context = k.shape[2]
        visible = torch.ones(t, context, dtype=torch.bool).tril(diagonal=context - t)
        probs = F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32).to(dtype)
        return linear(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, heads * d), f"layers.{i}.o_proj")

    def mlp(x: torch.Tensor, i: int) -> torch.Tensor:
        if spec.mlp == "gated":
            hidden = F.silu(linear(x, f"layers.{i}.gate_proj")) * linear(x, f"layers.{i}.up_proj")
        else:
            hidden = F.gelu(linear(x, f"layers.{i}.up_proj"), approximate="tanh")
        return linear(hidden, f"layers.{i}.down_proj")

    def forward(tokens: torch.LongTensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = w["embed.weight"][tokens]
        if spec.learned_position_embeddings:
            h = h + w["pos_embed.weight"][start_pos:start_pos + tokens.shape[1]]
        for i in range(spec.num_layers):
            h = h + attention(norm(h, f"layers.{i}.attn_norm"), i, start_pos)
            h = h + mlp(norm(h, f"layers.{i}.mlp_norm"), i)
        hidden = norm(h, "final_norm")[:, -1]
        return hidden, F.linear(hidden, w["embed.weight" if spec.tied_embeddings else "lm_head.weight"])

    return _greedy(forward, prompt, output_tokens)


def _greedy(forward: Callable[[torch.LongTensor, int], tuple[torch.Tensor, torch.Tensor]],
            prompt: torch.LongTensor, output_tokens: int) -> tuple[torch.LongTensor, list[torch.Tensor]]:
    """Prefill, then feed back the argmax; ``forward(tokens, start_pos)`` gives (hidden, logits)."""
    generated, hiddens = [], []
    tokens, start_pos = prompt, 0
    for _ in range(output_tokens):
        hidden, logits = forward(tokens, start_pos)
        start_pos += tokens.shape[1]
        tokens = logits.argmax(dim=-1, keepdim=True)
        generated.append(tokens)
        hiddens.append(hidden)
    return torch.cat(generated, dim=1), hiddens


def _check_generation(spec: ModelSpec, prompt_len: int, output_tokens: int) -> None:
    if output_tokens < 1:
        raise ValueError(f"output tokens must be positive (got {output_tokens})")
    # The last generated token is never fed back, so it needs no position.
    if prompt_len + output_tokens - 1 > spec.max_position_embeddings:
        raise ValueError(f"{prompt_len} prompt and {output_tokens} output tokens exceed the "
                         f"{spec.max_position_embeddings} positions of {spec.name}")


def _rotary_table(head_dim: int, theta: float, max_tokens: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_tokens, head_dim]`` of the rotary angles, computed in fp32 (HF
    ``LlamaRotaryEmbedding``: frequencies ``theta^(-2j/head_dim)``, each used by both halves)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(max_tokens, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[b, t, heads, head_dim]``, pairing the two halves of each head
    (the HF convention, ``rotate_half``)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
