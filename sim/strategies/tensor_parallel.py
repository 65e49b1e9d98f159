"""The Megatron-style tensor-parallel forward pass both TP strategies share.

Column-parallel q/k/v and MLP-up projections, row-parallel output and MLP-down projections whose
partial sums a strategy combines after each sub-layer (Megatron-LM, arXiv 1909.08053, section 3).
A strategy module subclasses :class:`TensorParallel` and says how the first normalised input is
handed out (:meth:`TensorParallel.hand_out`) and how partial sums are combined and normalised
(:meth:`TensorParallel.combine`, :meth:`TensorParallel.combine_final`); everything else (costs,
memory effects, segments) is lowered here once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.accounting import OpCost, head_op_costs, kv_cache_bytes_per_token, layer_op_costs
from models.ops import OpKind
from models.shards import TensorShard
from models.spec import ModelSpec
from sim.program import BlockPart, BlockRef, Collective, MemoryCategory, NormSite, Phase, ProgramBuilder, Stage
from sim.vocabulary import PhaseKind

# The weight block each per-layer compute op reads (the norms get theirs where they are emitted).
ATTENTION_BLOCK = BlockRef(0, BlockPart.ATTENTION)
MLP_BLOCK = BlockRef(0, BlockPart.MLP)
NEXT_ATTENTION_BLOCK = BlockRef(1, BlockPart.ATTENTION)  # the attention norm closing a layer segment


@dataclass(frozen=True)
class Group:
    """The group a pass runs on and what its collectives need: ``ranks`` (``ranks[0]`` the
    master), ``algorithms`` by collective kind, ``size_bytes`` of the hidden state
    ([batch, new tokens, hidden] in the model's dtype) and the LayerNorm's cost."""

    ranks: tuple[int, ...]
    algorithms: dict[OpKind, str]
    size_bytes: int
    norm: OpCost

    @property
    def master(self) -> int:
        return self.ranks[0]

    def call(self, kind: OpKind) -> Collective:
        """A collective of ``kind`` over the group, rooted at the master unless an allreduce."""
        root = None if kind == OpKind.ALLREDUCE else self.master
        return Collective(kind, self.algorithms[kind], self.ranks, self.size_bytes, root)


def norm_block(site: NormSite, closes_layer: bool) -> BlockRef:
    """The weight block a norm producing ``site``'s input reads; ``closes_layer``: it ends a layer
    segment, so it belongs to the next layer."""
    if site == NormSite.MLP:
        return MLP_BLOCK
    return NEXT_ATTENTION_BLOCK if closes_layer else ATTENTION_BLOCK


class TensorParallel:
    """Shared lowering of a tensor-parallel forward pass (see the module docstring).

    Subclasses set ``name`` and ``calls`` (:class:`sim.strategies.base.Strategy`) and implement
    the three hooks.
    """

    name: str
    calls: tuple[tuple[OpKind, str], ...]

    def hand_out(self, prog: ProgramBuilder, group: Group) -> None:
        """Prologue, after the master's embedding: give every rank the first layer's normalised input."""
        raise NotImplementedError

    def combine(self, prog: ProgramBuilder, group: Group, sub: str, site: NormSite, closes_layer: bool) -> None:
        """Combine the partial sums of sub-layer ``sub`` (``attn``/``mlp``, the ops' label) and
        produce every rank's normalised input for ``site``."""
        raise NotImplementedError

    def combine_final(self, prog: ProgramBuilder, group: Group, sub: str) -> None:
        """The last combine: the master must end up with the full hidden state."""
        raise NotImplementedError

    def lower(self, model: ModelSpec, batch_size: int, ranks: tuple[int, ...], algorithms: dict[OpKind, str],
              name: PhaseKind, step: int, new_tokens: int, context_tokens: int, stage: Stage | None = None, *,
              shards: tuple[TensorShard, ...] | None = None) -> Phase:
        """See :meth:`sim.strategies.base.Strategy.lower`. Costs from
        :func:`models.accounting.layer_op_costs` / :func:`~models.accounting.head_op_costs`, per
        rank from its shard when the split is uneven; the collectives carry the full hidden state
        whatever the shards.

        ``stage``: lower one pipeline stage's part (its layers; the embedding only on the first
        stage, whose master otherwise starts from the residual stream the stage before sent it;
        the final norm and LM head only on the last, whose master otherwise ends holding the
        residual stream to send on). None: the whole model."""
        stage = stage or Stage(0, model.num_layers, embeds=True, heads=True)
        tp = len(ranks)
        ranks_of: dict[TensorShard | None, list[int]] = {}
        for i, r in enumerate(ranks):
            ranks_of.setdefault(shards[i] if shards else None, []).append(r)
        # (ranks, layer costs, KV-cache bytes of this pass) per distinct shard: one group when even.
        lowered = [(tuple(on), layer_op_costs(model, tp_degree=tp, batch_size=batch_size, new_tokens=new_tokens,
                                              context_tokens=context_tokens, shard=shard),
                    kv_cache_bytes_per_token(model, tp, shard=shard) // model.num_layers * batch_size * new_tokens)
                   for shard, on in ranks_of.items()]
        layer = lowered[0][1]  # the replicated costs (norms) are the same on every rank
        head = head_op_costs(model, batch_size=batch_size, new_tokens=new_tokens)
        hidden_bytes = batch_size * new_tokens * model.hidden_size * model.dtype_bytes
        # The residual stream and the normalised input live for the whole pass on every rank.
        activations = ((MemoryCategory.ACTIVATIONS, 2 * hidden_bytes),)
        group = Group(ranks, algorithms, hidden_bytes, layer[OpKind.LAYERNORM])
        only_master = (group.master,)

        # Prologue: the master embeds the tokens (or holds what the stage before sent) and hands
        # the first normalised input out.
        shape = (new_tokens, context_tokens)
        pro = ProgramBuilder(ranks, shape)
        if stage.embeds:
            pro.compute(only_master, OpKind.EMBEDDING, "embedding", head[OpKind.EMBEDDING], alloc=activations)
        if not stage.num_layers:
            # A first stage without layers (llama.cpp RPC's or Petals' client) only embeds: its
            # master sends the residual stream on, where the next stage's first norm takes it.
            pro.ops[group.master][-1] = replace(pro.ops[group.master][-1], free=activations)
            return Phase(name, step, new_tokens, context_tokens, (pro.segment("prologue"),), stage.first_layer)
        self.hand_out(pro, group)
        for r in ranks[0 if not stage.embeds else 1:]:
            pro.ops[r][0] = replace(pro.ops[r][0], alloc=activations)

        def sharded(prog: ProgramBuilder, kind: OpKind, name: str, *, kv_cache: bool = False, **fields) -> None:
            """``kind`` on every rank, each with the cost of its own shard (``kv_cache``: allocating
            its KV-cache entries); one call when every rank's shard is alike."""
            for on, costs, kv_bytes in lowered:
                alloc = {"alloc": ((MemoryCategory.KV_CACHE, kv_bytes),)} if kv_cache else {}
                prog.compute(on, kind, name, costs[kind], **alloc, **fields)

        def layer_program(last: bool) -> ProgramBuilder:
            prog = ProgramBuilder(ranks, shape)
            sharded(prog, OpKind.QKV_PROJ, "qkv_proj", weight_block=ATTENTION_BLOCK)
            sharded(prog, OpKind.ATTENTION, "attention", kv_cache=True)
            sharded(prog, OpKind.OUT_PROJ, "out_proj", weight_block=ATTENTION_BLOCK)
            self.combine(prog, group, "attn", NormSite.MLP, closes_layer=False)
            sharded(prog, OpKind.MLP_UP, "mlp_up", weight_block=MLP_BLOCK)
            sharded(prog, OpKind.MLP_DOWN, "mlp_down", weight_block=MLP_BLOCK)
            if last:
                # Only the master needs the final hidden state: it normalises and projects to logits
                # (or, in an earlier pipeline stage, sends it on).
                self.combine_final(prog, group, "mlp")
                if stage.heads:
                    prog.compute(only_master, OpKind.LAYERNORM, "final_norm", head[OpKind.LAYERNORM],
                                 norm_site=NormSite.FINAL)
                    prog.compute(only_master, OpKind.LM_HEAD, "lm_head", head[OpKind.LM_HEAD])
                for r in ranks:
                    prog.ops[r][-1] = replace(prog.ops[r][-1], free=activations)
            else:
                self.combine(prog, group, "mlp", NormSite.ATTENTION, closes_layer=True)
            return prog

        segments = [pro.segment("prologue")]
        if stage.num_layers > 1:
            segments.append(layer_program(last=False).segment("layer", repeat=stage.num_layers - 1, layers=1))
        segments.append(layer_program(last=True).segment("layer_last", layers=1))
        return Phase(name, step, new_tokens, context_tokens, tuple(segments), stage.first_layer)


def norm(prog: ProgramBuilder, ranks: tuple[int, ...], group: Group, site: NormSite, closes_layer: bool) -> None:
    """The residual add and LayerNorm producing ``site``'s input on ``ranks`` (labelled
    ``attn_norm``/``mlp_norm``, the names the calibration profiles key on)."""
    prog.compute(ranks, OpKind.LAYERNORM, f"{site}_norm", group.norm, norm_site=site,
                 weight_block=norm_block(site, closes_layer))
