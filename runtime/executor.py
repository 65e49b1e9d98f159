"""Executes the simulator's plan for real: one rank's programs, op by op, with torch.

The executor walks the same :class:`~sim.plan.Phase` / :class:`~sim.plan.Segment` /
:class:`~sim.plan.Op` objects the simulator prices (segments repeated once per decoder layer) and
maps each op to the rank's model shard (:class:`runtime.model.RankModel`) or to its
:class:`runtime.comm.Communicator`. What flows between ops:

* ``h``: the residual stream (the master always; every rank a broadcast hands it to, an op whose
  ``carries`` is :attr:`~sim.program.Carries.RESIDUAL`);
* ``x``: the normalised input of the next sub-layer (a LayerNorm op's output, at its ``norm_site``;
  or what a broadcast carrying :attr:`~sim.program.Carries.NORMALISED` hands out);
* ``partial``: a row-parallel partial sum, combined in place by reduce or allreduce; the next norm
  adds it to ``h`` first (residual), except before the first layer.

Each op is timed with the host clock (after a device synchronisation on GPU) and recorded in the
trace schema of :mod:`sim.trace` (a :class:`sim.trace.TraceEvent` each), so a measured and a
simulated run compare op by op. An executor that records no ops (``record_ops=False``) waits for
the device only at the end of each step, so that a GPU runs the kernels the host queued ahead, as a
framework does when no one times its ops (a step's time is then the host clock after a device
synchronisation).

Weight streaming: a plan whose memory policy streams has one unrolled segment per phase, each op
carrying its ``layer``, followed by ``weight_load`` ops of the loader stream. Those run on a
background thread in program order, each once its ``after`` ops are done, and load their block
through a :class:`runtime.blocks.BlockLoader`; the compute and communication ops run on the calling
thread and wait for the loads they depend on; an op with ``release`` drops its block from the model
as it ends. A phase ends when both threads are done, as in the simulator.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.ops import OpKind
from runtime.blocks import BlockLoader
from runtime.comm import Communicator
from runtime.device import device_of
from runtime.model import RankModel
from sim.plan import Op, Phase, Plan, Stream
from sim.program import Carries, NormSite
from sim.trace import TraceEvent


@dataclass
class Generation:
    """One prefill + decode run of a rank: tokens (master only), per-step times, op records.

    ``step_start_s[s]``/``step_end_s[s]``: first op start and last op end of phase s on this rank;
    ``hidden``: the master's final-norm hidden state of the last position, per step;
    ``memory_bytes``: the memory probe's reading after each step;
    ``stall_s``: per step, the time this rank's ops waited for weight loads (0 when resident).
    """

    tokens: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    step_start_s: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    memory_bytes: list[int] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    records: list[TraceEvent] = field(default_factory=list)


class Executor:
    """Runs ``plan`` on one rank. ``rank`` is the global rank; ``plan.master`` embeds and samples.

    ``memory_probe`` returns the device memory in use (bytes); it is read after every step.
    ``loader`` reads weight blocks back from their files: required when the plan streams, or when
    ``model`` was built without some blocks (:meth:`prepare` loads them). Raises ``ValueError``
    when it is needed and missing.
    """

    def __init__(self, plan: Plan, model: RankModel, comm: Communicator, rank: int, *, record_ops: bool = True,
                 memory_probe: Callable[[], int] = lambda: 0, loader: BlockLoader | None = None):
        self.plan, self.model, self.comm, self.rank = plan, model, comm, rank
        self.memory_probe = memory_probe
        self.is_master = rank == plan.master
        self.record_ops = record_ops
        self.loader = loader
        self.streams = any(plan.streamed_blocks.values())  # the plan was lowered with loader ops
        if loader is None and (self.streams or len(model.resident_blocks) < len(model.block_names)):
            raise ValueError(f"rank {rank}: a plan that streams weights ({plan.memory_policy.label()}), or a "
                             f"model built without some weight blocks, needs a BlockLoader")
        device = device_of(model.device)
        self._sync = device.synchronize
        # While streaming, wait for this thread's stream only (Device.synchronize_stream says why).
        self._sync_main = device.synchronize_stream

    def prepare(self) -> None:
        """Make the model hold the weights a generation starts with: every block except the
        streamed ones past the window (all of them for a resident plan). Blocks are read unpaced:
        this happens before timing starts. A no-op when they are already there, as after a
        streamed generation, which ends by loading the first ``window`` blocks again."""
        if self.loader is None:
            return
        window = self.plan.memory_policy.window
        streamed_later = {b.name for b in self.plan.streamed_blocks.get(self.rank, ())[window:]}
        wanted = [b for b in self.model.block_names if b not in streamed_later]
        resident = self.model.resident_blocks
        for block in resident - set(wanted):  # free first, so memory never holds both
            self.model.drop_block(block)
        for block in wanted:
            if block not in resident:
                self.model.add_block(self.loader.fetch(block)[0])

    def generate(self, prompt: torch.Tensor, t0: float, on_step: Callable[[int], None] = lambda step: None
                 ) -> Generation:
        """Prefill ``prompt`` ([batch, prompt_tokens] token ids; only the master reads it), then
        decode greedily for ``plan.output_tokens - 1`` steps. Times are relative to ``t0``
        (``time.perf_counter``); ``on_step(step)`` is called as each step begins. Calls
        :meth:`prepare` first: call it before taking ``t0`` to keep initial loads out of the timing."""
        self.prepare()
        self.model.reset_cache()
        out = Generation()
        tokens, start_pos = prompt, 0
        for step in range(self.plan.num_phases):
            on_step(step)
            phase = self.plan.phase(step)
            out.step_start_s.append(time.perf_counter() - t0)
            out.stall_s.append(0.0)
            state = self.run_pass(phase, tokens, start_pos, t0, out)
            self._sync()  # a GPU's queued kernels belong to the step
            out.step_end_s.append(time.perf_counter() - t0)
            out.memory_bytes.append(self.memory_probe())
            if self.is_master:
                out.tokens.append(state.next_token)
                out.hidden.append(state.last_hidden)
                tokens = state.next_token.view(-1, 1)
            start_pos += phase.new_tokens
        return out

    def run_pass(self, phase: Phase, tokens: torch.Tensor | None, start_pos: int, t0: float, out: Generation,
                 h: torch.Tensor | None = None) -> _State:
        """Run one forward pass ``phase`` of the rank's program on ``tokens`` ([sequences, new
        tokens] ids; the master of a pass that embeds reads them) at positions from
        ``start_pos``, or, on the master of a later pipeline stage, on the residual stream ``h``
        ([sequences, new tokens, hidden]) the stage before sent; op records go to ``out``.
        Returns the pass's end state: ``next_token`` and ``last_hidden`` on a master that samples,
        ``h`` plus ``partial`` (the residual stream to send on) on the master of an earlier stage."""
        self._state = _State(tokens=tokens, start_pos=start_pos, shape=self._shape(phase), h=h,
                             first_layer=phase.first_layer)
        self._run_phase(phase, t0, out)
        return self._state

    def _shape(self, phase: Phase) -> tuple[int, int, int]:
        return (self.plan.batch_size, phase.new_tokens, self.plan.model.hidden_size)

    def _run_phase(self, phase: Phase, t0: float, out: Generation) -> None:
        if self.streams:
            self._run_streamed(phase, t0, out)
            return
        for segment, layer0 in zip(phase.segments, phase.layer_of_segment):
            program = segment.programs.get(self.rank, ())
            for instance in range(segment.repeat):
                layer = None if layer0 is None else layer0 + instance
                for op in program:
                    if not self.record_ops:  # no op's time is wanted: a GPU queues the step's kernels ahead
                        self._execute(op, layer)
                        continue
                    start = time.perf_counter()
                    self._execute(op, layer)
                    self._sync()
                    end = time.perf_counter()
                    out.records.append(self._record(op, phase, start - t0, end - t0, layer))

    def _run_streamed(self, phase: Phase, t0: float, out: Generation) -> None:
        """Run a streaming phase: the loader ops on a thread, the others here, in program order,
        each after its ``after`` ops (``done[i]`` is set when op i has ended)."""
        (segment,) = phase.segments
        program = segment.programs.get(self.rank, ())
        done = [threading.Event() for _ in program]
        failure: list[BaseException] = []
        loads = [i for i, op in enumerate(program) if op.stream == Stream.LOADER]
        load_records: list[TraceEvent] = []
        loader = threading.Thread(target=self._load_blocks, name=f"hetsim-loader-{self.rank}", daemon=True,
                                  args=(program, loads, done, failure, phase, t0, load_records))
        loader.start()
        stall_s = 0.0
        try:
            for i, op in enumerate(program):
                if op.stream == Stream.LOADER:
                    continue
                waited = time.perf_counter()
                for dep in op.after or ():
                    done[dep].wait()
                    if failure:
                        raise RuntimeError(f"rank {self.rank}: the weight loader failed") from failure[0]
                start = time.perf_counter()
                if op.after and any(program[d].load is not None for d in op.after):
                    stall_s += start - waited  # its other dependency, the previous op, had ended
                self._execute(op, op.layer)
                self._sync_main()
                if op.release is not None:
                    self.model.drop_block(op.release.name)
                end = time.perf_counter()
                done[i].set()
                if self.record_ops:
                    out.records.append(self._record(op, phase, start - t0, end - t0))
        except BaseException:
            failure.append(RuntimeError("the compute thread failed"))  # tells the loader to stop
            for event in done:
                event.set()
            raise
        finally:
            loader.join()
        if failure:  # a load for the next phase failed after every op of this one had run
            raise RuntimeError(f"rank {self.rank}: the weight loader failed") from failure[0]
        out.records.extend(load_records)
        out.stall_s[-1] = stall_s

    def _load_blocks(self, program: tuple[Op, ...], loads: list[int], done: list[threading.Event],
                     failure: list[BaseException], phase: Phase, t0: float, records: list[TraceEvent]) -> None:
        """The loader thread: each load op of ``program`` in order, once its ``after`` ops are done."""
        try:
            for i in loads:
                op = program[i]
                for dep in op.after or ():
                    done[dep].wait()
                if failure:
                    return
                start = time.perf_counter()
                tensors, _ = self.loader.load(op.load.name)
                self.model.add_block(tensors)
                del tensors  # the model holds the only references, so a release really frees them
                end = time.perf_counter()
                done[i].set()
                if self.record_ops:
                    records.append(self._record(op, phase, start - t0, end - t0))
        except BaseException as error:  # noqa: BLE001 - handed to the compute thread, which raises it
            failure.append(error)
        finally:
            for i in loads:  # never leave the compute thread waiting for a load that will not come
                done[i].set()

    def _record(self, op: Op, phase: Phase, start_s: float, end_s: float, layer: int | None = None) -> TraceEvent:
        """The trace event of one run of ``op`` (``layer``: its layer, when its segment repeats per layer)."""
        layer = op.layer if layer is None else layer
        return TraceEvent(self.rank, op.stream.value, op.kind.value, op.name, str(phase.name), phase.step,
                          -1 if layer is None else layer, start_s, end_s, op.traffic_bytes, op.flops)

    def _execute(self, op: Op, layer: int | None) -> None:
        s, model = self._state, self.model
        kind = op.kind
        if kind == OpKind.EMBEDDING:
            s.h = model.embedding(s.tokens, s.start_pos)
        elif kind == OpKind.LAYERNORM:
            if s.partial is not None:  # the residual: add the combined sub-layer output
                s.h = s.h + s.partial
                s.partial = None
            if op.norm_site == NormSite.FINAL:
                s.x = model.norm(s.h, None, op.norm_site)
            else:
                s.x = model.norm(s.h, op.weight_block.layer(layer, s.first_layer), op.norm_site)
        elif kind == OpKind.BROADCAST:
            residual = op.carries == Carries.RESIDUAL
            tensor = (s.h if residual else s.x) if self.is_master else torch.empty(
                s.shape, dtype=model.dtype, device=model.device)
            tensor = tensor.contiguous()
            self.comm.run(op.collective, tensor)
            if residual:
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
    tokens: torch.Tensor | None
    start_pos: int
    shape: tuple[int, int, int]
    first_layer: int = 0
    h: torch.Tensor | None = None
    x: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    qkv: tuple | None = None
    o: torch.Tensor | None = None
    a: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    next_token: torch.Tensor | None = None
