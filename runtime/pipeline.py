"""Executes a pipeline plan (:class:`sim.pipeline.PipelinePlan`) on one rank, with torch.

The rank belongs to one stage's tensor-parallel group and runs, per step and micro-batch in the
plan's order, what the simulator prices (:mod:`sim.pipeline_run`): its master receives the
input (the prompt's rows or the tokens the last stage sent back, on the first stage; the
residual stream from the stage before, on the others), the group runs the stage's pass
(:meth:`runtime.executor.Executor.run_pass`, TP collectives inside the stage's process group),
and the master sends the result on (:class:`sim.pipeline.Hop`). Sends are ``isend``: a stage
goes on with its next micro-batch while the message travels, as GPipe's stages do (Huang et al.
2019, arXiv 1811.06965); a step waits for the sends of the step before, so buffers stay
bounded. Receives block, which is the schedule's dependency.
"""

from __future__ import annotations

import time
from itertools import accumulate
from typing import Callable

import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime.comm import Communicator
from runtime.executor import Executor, Generation
from runtime.model import RankModel
from sim.pipeline import Hop, PipelinePlan
from sim.plan import Stream
from sim.trace import TraceEvent
from sim.vocabulary import PhaseKind

_HIDDEN_TAG, _TOKENS_TAG = 1, 2  # the two kinds of message between stage masters


def stage_process_groups(replica_stage_ranks: tuple[tuple[tuple[int, ...], ...], ...]
                         ) -> dict[tuple[int, ...], object]:
    """One torch process group per stage of every replica (``replica_stage_ranks[i][s]``: replica
    i's stage s's ranks, :attr:`sim.parallel.ParallelPlan.replica_stage_ranks`), for the backend's
    own collectives (:class:`runtime.comm.Communicator`). Every rank of the run must call it, with
    the same stages in the same order (``torch.distributed.new_group``)."""
    return {ranks: dist.new_group(list(ranks)) for stages in replica_stage_ranks for ranks in stages}


def stage_model(plan: PipelinePlan, rank: int, *, seed: int, max_tokens: int, device: torch.device,
                dtype: torch.dtype) -> RankModel:
    """The shard of global rank ``rank``: its stage's layers, split over the stage's group."""
    stage = plan.stage_of(rank)
    ranks = plan.stage_ranks[stage]
    return RankModel(plan.model, len(ranks), ranks.index(rank), seed=seed, batch_size=plan.batch_size,
                     max_tokens=max_tokens, device=device, dtype=dtype, stage=plan.stages[stage])


class PipelineExecutor:
    """Runs ``plan`` on global rank ``rank`` with its stage's ``model`` (:func:`stage_model`) and a
    ``comm`` holding the stage process groups (:func:`stage_process_groups`).

    :meth:`generate` returns a :class:`runtime.executor.Generation`: the tokens on the first
    stage's master (:attr:`PipelinePlan.master`), which ends up holding them; the last stage's
    final hidden states on its master; per step, this rank's first op start and last op end.
    """

    def __init__(self, plan: PipelinePlan, model: RankModel, comm: Communicator, rank: int, *,
                 record_ops: bool = True, memory_probe: Callable[[], int] = lambda: 0):
        self.plan, self.model, self.rank = plan, model, rank
        self.stage = plan.stage_of(rank)
        self.is_master = rank == plan.stage_ranks[self.stage][0]
        self.first, self.last = self.stage == 0, self.stage == len(plan.stages) - 1
        self.record_ops = record_ops
        self.memory_probe = memory_probe
        self.executors = {j: Executor(plan.stage_plan(self.stage, j), model, comm, rank, record_ops=record_ops)
                          for j in range(len(plan.micro_batches))}

    def prepare(self) -> None:
        """Nothing to load: a pipeline's stages keep their weights resident."""

    def generate(self, prompt: torch.Tensor, t0: float, on_step: Callable[[int], None] = lambda step: None
                 ) -> Generation:
        """Prefill ``prompt`` ([batch, prompt_tokens] ids; the first stage's master reads it) and
        decode greedily, times relative to ``t0`` (``time.perf_counter``)."""
        plan, model = self.plan, self.model
        model.reset_cache()
        out = Generation()
        offsets = [0, *accumulate(plan.micro_batches)]
        tokens_back: list[list[torch.Tensor]] = []  # first master: per step, per micro-batch
        pending: list = []
        start_pos = 0
        for step in range(plan.num_phases):
            on_step(step)
            out.step_start_s.append(time.perf_counter() - t0)
            out.stall_s.append(0.0)
            previous, pending = pending, []
            hidden, sampled = [], []
            new_tokens = plan.prompt_tokens if step == 0 else 1
            for j, size in enumerate(plan.micro_batches):
                executor = self.executors[j]
                phase = executor.plan.phase(step)
                model.rows = slice(offsets[j], offsets[j + 1])
                tokens = h = None
                if self.is_master and self.first:
                    if step == 0:
                        tokens = prompt[offsets[j]:offsets[j + 1]]
                    else:
                        tokens = self._receive(step - 1, j, t0, out).view(-1, 1)
                        if j == 0:
                            tokens_back.append([])
                        tokens_back[-1].append(tokens.view(-1))
                elif self.is_master:
                    h = self._receive(step, j, t0, out, new_tokens)
                state = executor.run_pass(phase, tokens, start_pos, t0, out, h=h)
                if not self.is_master:
                    continue
                if self.last:
                    sampled.append(state.next_token)
                    hidden.append(state.last_hidden)
                    message = state.next_token.contiguous()
                else:
                    message = (state.h if state.partial is None else state.h + state.partial).contiguous()
                pending.append(self._send(plan.hop_on(self.stage, j, new_tokens), message, step, t0, out))
            out.step_end_s.append(time.perf_counter() - t0)  # the rank's last op (the last stage: its LM head)
            for request, _ in previous:
                request.wait()
            out.memory_bytes.append(self.memory_probe())
            if self.is_master and self.last:
                out.hidden.append(torch.cat(hidden))
                if not self.first:
                    out.tokens.append(torch.cat(sampled))
            start_pos += new_tokens
        if self.is_master and self.first:  # the last step's tokens
            tokens_back.append([self._receive(plan.num_phases - 1, j, t0, out).view(-1)
                                for j in range(len(plan.micro_batches))])
            out.tokens = [torch.cat(step_tokens) for step_tokens in tokens_back]
        for request, _ in pending:
            request.wait()
        return out

    def _receive(self, step: int, micro_batch: int, t0: float, out: Generation, new_tokens: int = 1) -> torch.Tensor:
        """The message this master gets for ``micro_batch``: tokens back from the last stage (on
        the first stage), else the residual stream of ``new_tokens`` per sequence."""
        plan = self.plan
        size = plan.micro_batches[micro_batch]
        if self.first:
            hop = plan.hop_on(len(plan.stages) - 1, micro_batch, new_tokens)
            buffer, tag = torch.empty(size, dtype=torch.long, device=self.model.device), _TOKENS_TAG
        else:
            hop = plan.hop_on(self.stage - 1, micro_batch, new_tokens)
            buffer = torch.empty((size, new_tokens, plan.model.hidden_size), dtype=self.model.dtype,
                                 device=self.model.device)
            tag = _HIDDEN_TAG
        start = time.perf_counter()
        dist.recv(buffer, src=hop.src, tag=tag)
        self._record(hop, step, start - t0, time.perf_counter() - t0, out)
        return buffer

    def _send(self, hop: Hop, message: torch.Tensor, step: int, t0: float, out: Generation):
        """Start sending ``message`` over ``hop``; the request and the buffer it reads."""
        start = time.perf_counter()
        request = dist.isend(message, dst=hop.dst, tag=_TOKENS_TAG if hop.tokens else _HIDDEN_TAG)
        self._record(hop, step, start - t0, time.perf_counter() - t0, out)
        return request, message

    def _record(self, hop: Hop, step: int, start_s: float, end_s: float, out: Generation) -> None:
        if self.record_ops:
            out.records.append(TraceEvent(self.rank, Stream.COMM.value, OpKind.SEND.value,
                                          "send_tokens" if hop.tokens else "send_hidden",
                                          PhaseKind.of_step(step).value, step, -1, start_s, end_s,
                                          float(hop.size_bytes), 0.0))
