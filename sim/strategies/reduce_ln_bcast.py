"""``reduce_ln_bcast``: partial sums are reduced to the master, which adds the residual and
normalises, then broadcasts the normalised input (LayerNorm commutes with broadcast, so every rank
computes with the values ``allreduce_ln`` gives it; Megatron-LM, arXiv 1909.08053, section 3)."""

from __future__ import annotations

from models.ops import OpKind
from sim.program import Carries, NormSite, ProgramBuilder
from sim.strategies.tensor_parallel import Group, TensorParallel, norm


class ReduceLnBcast(TensorParallel):
    """Reduce to the master, residual + norm there, broadcast the normalised input."""

    name = "reduce_ln_bcast"
    calls = ((OpKind.REDUCE, "reduce"), (OpKind.BROADCAST, "broadcast"))

    def hand_out(self, prog: ProgramBuilder, group: Group) -> None:
        norm(prog, (group.master,), group, NormSite.ATTENTION, closes_layer=False)
        prog.collective("attn_bcast", group.call(OpKind.BROADCAST), carries=Carries.NORMALISED)

    def combine(self, prog: ProgramBuilder, group: Group, sub: str, site: NormSite, closes_layer: bool) -> None:
        prog.collective(f"{sub}_reduce", group.call(OpKind.REDUCE))
        norm(prog, (group.master,), group, site, closes_layer)
        prog.collective(f"{site}_bcast", group.call(OpKind.BROADCAST), carries=Carries.NORMALISED)

    def combine_final(self, prog: ProgramBuilder, group: Group, sub: str) -> None:
        prog.collective(f"{sub}_reduce", group.call(OpKind.REDUCE))
