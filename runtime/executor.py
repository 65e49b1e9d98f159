"""Executes the simulator's plan for real: one rank's programs, op by op, with torch.

The executor walks the same :class:`~sim.plan.Phase` / :class:`~sim.plan.Segment` /
:class:`~sim.plan.Op` objects the simulator prices (segments repeated once per decoder layer) and
maps each op to the rank's model shard (:class:`runtime.model.RankModel`) or to its
:class:`runtime.comm.Communicator`. What flows between ops:

* ``h``: the residual stream (the master always; every rank under ``allreduce_ln``);
* ``x``: the normalised input of the next sub-layer (broadcast by the master under
  ``reduce_ln_bcast``);
* ``partial``: a row-parallel partial sum, combined in place by reduce or allreduce; the next norm
  adds it to ``h`` first (residual), except before the first layer.

Each op is timed with the host clock (after a device synchronisation on GPU) and recorded in the
trace schema of :mod:`sim.trace`, so a measured and a simulated run compare op by op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.ops import OpKind
from runtime.comm import Communicator
from runtime.model import RankModel
from sim.plan import Op, Phase, Plan


@dataclass(frozen=True)
class OpRecord:
    """One executed op, in the columns of :data:`sim.trace.OP_COLUMNS` (times: s from the run start)."""

    rank: int
    stream: str
    kind: str
    name: str
    phase: str
    step: int
    layer: int
    start_s: float
    end_s: float
    bytes: float
    flops: float


@dataclass
class Generation:
    """One prefill + decode run of a rank: tokens (master only), per-step times, op records.

    ``step_start_s[s]``/``step_end_s[s]``: first op start and last op end of phase s on this rank;
    ``hidden``: the master's final-norm hidden state of the last position, per step;
    ``memory_bytes``: the memory probe's reading after each step.
    """

    tokens: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    step_start_s: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    memory_bytes: list[int] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list)


class Executor:
    """Runs ``plan`` on one rank. ``rank`` is the global rank; ``plan.master`` embeds and samples.

    ``memory_probe`` returns the device memory in use (bytes); it is read after every step.
    """

    def __init__(self, plan: Plan, model: RankModel, comm: Communicator, rank: int, *, record_ops: bool = True,
                 memory_probe: Callable[[], int] = lambda: 0):
        self.plan, self.model, self.comm, self.rank = plan, model, comm, rank
        self.memory_probe = memory_probe
        self.is_master = rank == plan.master
        self.record_ops = record_ops
        self._sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def generate(self, prompt: torch.Tensor, t0: float, on_step: Callable[[int], None] = lambda step: None
                 ) -> Generation:
        """Prefill ``prompt`` ([batch, prompt_tokens] token ids; only the master reads it), then
        decode greedily for ``plan.output_tokens - 1`` steps. Times are relative to ``t0``
        (``time.perf_counter``); ``on_step(step)`` is called as each step begins."""
        self.model.reset_cache()
        out = Generation()
        tokens, start_pos = prompt, 0
        for step in range(self.plan.num_phases):
            on_step(step)
            phase = self.plan.phase(step)
            self._state = _State(tokens=tokens, start_pos=start_pos, shape=self._shape(phase))
            out.step_start_s.append(time.perf_counter() - t0)
            self._run_phase(phase, t0, out)
            out.step_end_s.append(time.perf_counter() - t0)
            out.memory_bytes.append(self.memory_probe())
            if self.is_master:
                out.tokens.append(self._state.next_token)
                out.hidden.append(self._state.last_hidden)
                tokens = self._state.next_token.view(-1, 1)
            start_pos += phase.new_tokens
        return out

    def _shape(self, phase: Phase) -> tuple[int, int, int]:
        return (self.plan.batch_size, phase.new_tokens, self.plan.model.hidden_size)

    def _run_phase(self, phase: Phase, t0: float, out: Generation) -> None:
        for segment, layer0 in zip(phase.segments, phase.layer_of_segment):
            program = segment.programs.get(self.rank, ())
            for instance in range(segment.repeat):
                layer = None if layer0 is None else layer0 + instance
                for op in program:
                    start = time.perf_counter()
                    self._execute(op, layer)
                    self._sync()
                    end = time.perf_counter()
                    if self.record_ops:
                        out.records.append(OpRecord(self.rank, op.stream.value, op.kind.value, op.name, phase.name,
                                                    phase.step, -1 if layer is None else layer,
                                                    start - t0, end - t0, op.traffic_bytes, op.flops))

    def _execute(self, op: Op, layer: int | None) -> None:
        s, model = self._state, self.model
        kind = op.kind
        if kind == OpKind.EMBEDDING:
            s.h = model.embedding(s.tokens, s.start_pos)
        elif kind == OpKind.LAYERNORM:
            if s.partial is not None:  # the residual: add the combined sub-layer output
                s.h = s.h + s.partial
                s.partial = None
            which = op.name.removesuffix("_norm")
            if which == "final":
                s.x = model.norm(s.h, None, "final")
            else:
                # An attention norm that closes a layer segment belongs to the next layer.
                norm_layer = 0 if layer is None else layer + (1 if which == "attn" else 0)
                s.x = model.norm(s.h, norm_layer, which)
        elif kind == OpKind.BROADCAST:
            carries_h = op.name == "embed_bcast"  # allreduce_ln hands out the residual stream
            tensor = (s.h if carries_h else s.x) if self.is_master else torch.empty(
                s.shape, dtype=model.dtype, device=model.device)
            tensor = tensor.contiguous()
            self.comm.run(op.collective, tensor)
            if carries_h:
                s.h = tensor
            else:
                s.x = tensor
        elif kind in (OpKind.REDUCE, OpKind.ALLREDUCE):
            s.partial = s.partial.contiguous()
            self.comm.run(op.collective, s.partial)
        elif kind == OpKind.QKV_PROJ:
            s.qkv = model.qkv_proj(s.x, layer)
        elif kind == OpKind.ATTENTION:
            s.o = model.attention(*s.qkv, layer, s.start_pos)
        elif kind == OpKind.OUT_PROJ:
            s.partial = model.out_proj(s.o, layer)
        elif kind == OpKind.MLP_UP:
            s.a = model.mlp_up(s.x, layer)
        elif kind == OpKind.MLP_DOWN:
            s.partial = model.mlp_down(s.a, layer)
        elif kind == OpKind.LM_HEAD:
            s.last_hidden = s.x[:, -1].clone()
            s.next_token = model.lm_head(s.last_hidden).argmax(dim=-1)
        else:
            raise ValueError(f"the runtime has no implementation of op kind {kind}")


@dataclass
class _State:
    tokens: torch.Tensor
    start_pos: int
    shape: tuple[int, int, int]
    h: torch.Tensor | None = None
    x: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    qkv: tuple | None = None
    o: torch.Tensor | None = None
    a: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    next_token: torch.Tensor | None = None
