"""``allreduce_ln``: partial sums are allreduced and every rank adds the residual and normalises
its own copy; the prologue broadcasts the embedded residual stream (Megatron-LM, arXiv
1909.08053, section 3)."""

from __future__ import annotations

from models.ops import OpKind
from sim.program import Carries, NormSite, ProgramBuilder
from sim.strategies.tensor_parallel import Group, TensorParallel, norm


class AllreduceLn(TensorParallel):
    """Allreduce, then residual + norm on every rank."""

    name = "allreduce_ln"
    calls = ((OpKind.ALLREDUCE, "allreduce"), (OpKind.BROADCAST, "broadcast"))

    def hand_out(self, prog: ProgramBuilder, group: Group) -> None:
        prog.collective("embed_bcast", group.call(OpKind.BROADCAST), carries=Carries.RESIDUAL)
        norm(prog, group.ranks, group, NormSite.ATTENTION, closes_layer=False)

    def combine(self, prog: ProgramBuilder, group: Group, sub: str, site: NormSite, closes_layer: bool) -> None:
        prog.collective(f"{sub}_allreduce", group.call(OpKind.ALLREDUCE))
        norm(prog, group.ranks, group, site, closes_layer)

    def combine_final(self, prog: ProgramBuilder, group: Group, sub: str) -> None:
        prog.collective(f"{sub}_allreduce", group.call(OpKind.ALLREDUCE))
