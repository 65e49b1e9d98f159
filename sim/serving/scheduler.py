"""Continuous batching (Yu et al. 2022, Orca, OSDI; vLLM's scheduler) with chunked prefill under a
token budget per iteration, as a discrete-event simulation of iterations.

Each iteration, in order: every running request whose prompt is done contributes one decode token;
requests still prefilling continue with a chunk of their prompt; then waiting requests are admitted
first come, first served, each with a chunk, while the iteration's token budget
(``max_batch_tokens``), the number of running requests (``max_num_seqs``) and the KV cache allow.
This is vLLM V1's policy (``vllm/v1/core/sched/scheduler.py``: running requests first, then
waiting ones, one token budget shared by decode and prefill). A request's first token comes out of
the iteration that completes its prompt; each later iteration gives it one more token.

A pipeline of S stages (:class:`sim.serving.iteration.ServerCost`) keeps up to S iterations in
flight, each its own batch: vLLM V1's batch queue (``vllm/v1/engine/core.py``,
``step_with_batch_queue``, as many batches in flight as the executor's ``max_concurrent_batches``,
the pipeline's size), the serving counterpart of GPipe's micro-batches (Huang et al. 2019, arXiv
1811.06965). A new iteration starts once the first stage is free and fewer than S are in flight,
from the requests in none (a request waits for its token to come back before it can go on, as
vLLM V1's scheduler finds no new token to schedule for it until then), with its own token budget;
``max_num_seqs`` and the KV cache bound the requests running over all of them. An iteration passes
the stages in order; each stage runs one iteration at a time, in launch order, then sends its
residual stream on to the next stage over its link, one message at a time; the last stage sends
the sampled tokens back to the first (a message holds its link for its whole priced time, latency
included: an upper bound where messages could overlap on the wire; links of different stages, and
a stage's messages and its group's collectives, do not slow each other). A token comes out when the last stage samples it; its
request can go on once it is back at the first stage. Under load every stage is busy on a
different iteration, so the server runs an iteration per slowest stage (or slowest link); alone, a
request relays through every stage and link per token (llama.cpp RPC, prima.cpp). One stage is
the plain loop: one iteration at a time.

Memory: a request is admitted only when the KV cache can hold its whole prompt and output, so
nothing is ever preempted. vLLM allocates KV blocks as tokens come and preempts (recomputes) when
it runs out; reserving ahead admits fewer requests only when memory is the bottleneck.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from models.errors import ConfigError
from sim.serving.iteration import ServerCost
from sim.serving.requests import Request


@dataclass(frozen=True)
class ServedRequest:
    """When a request's tokens came out (s from the start of the run).

    ``first_token_s``: end of the iteration that completed its prompt; ``finish_s``: end of the
    iteration that gave its last token."""

    request: Request
    first_token_s: float
    finish_s: float

    @property
    def ttft_s(self) -> float:
        """Time to first token: from arrival to the first token (queueing included)."""
        return self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (NaN with a single output token)."""
        n = self.request.output_tokens
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else float("nan")

    @property
    def e2e_s(self) -> float:
        """From arrival to the last token."""
        return self.finish_s - self.request.arrival_s


@dataclass
class _Running:
    request: Request
    prefilled: int = 0
    generated: int = 0
    first_token_s: float = 0.0
    in_flight: bool = False  # in an iteration not yet back at the first stage

    @property
    def context(self) -> int:
        return self.request.prompt_tokens + self.generated


@dataclass
class ServingRun:
    """The outcome of serving a list of requests: every request's times, the iterations run and
    the busy time of the servers (s; a pipeline's: its busiest stage's compute)."""

    served: list[ServedRequest]
    iterations: int
    busy_s: float
    max_running: int = 0
    kv_capacity_tokens: int = 0
    batch_tokens: list[int] = field(default_factory=list)
    stage_busy_s: tuple[float, ...] = ()
    """Each stage's compute over the run (s)."""
    link_busy_s: tuple[float, ...] = ()
    """The messages each stage sent over the run (s; 0 with a single stage)."""


@dataclass
class _Batch:
    """An iteration in flight: its requests, the tokens it returns to the first stage at
    ``return_s``, and when its last stage sampled them (``sampled_s``)."""

    decoding: list[_Running]
    chunks: list[tuple[_Running, int]]
    sampled_s: float
    return_s: float


def serve(requests: list[Request], cost: ServerCost, *, max_batch_tokens: int, max_num_seqs: int,
          kv_capacity_tokens: int) -> ServingRun:
    """Serve ``requests`` (in arrival order) by continuous batching; see the module docstring.

    Args:
        requests: arrival times (s) and lengths (tokens).
        cost: iteration times of the variant, stage by stage, and the messages between stages.
        max_batch_tokens: tokens one iteration may process (decode tokens plus prefill chunks).
        max_num_seqs: requests running at once (over every iteration in flight).
        kv_capacity_tokens: tokens the KV cache holds (on the fullest rank).

    Raises:
        ConfigError: on ``workload``: a request whose prompt plus output does not fit the KV cache
            even alone.
    """
    worst = max(requests, key=lambda r: r.prompt_tokens + r.output_tokens)
    if worst.prompt_tokens + worst.output_tokens > kv_capacity_tokens:
        raise ConfigError("workload", f"request {worst.index} needs {worst.prompt_tokens + worst.output_tokens} tokens "
                                      f"of KV cache, but the memory left beside the weights holds "
                                      f"{kv_capacity_tokens} (got {worst.prompt_tokens} + {worst.output_tokens})")
    stages = len(cost.stages)
    waiting: deque[Request] = deque()
    running: list[_Running] = []
    in_flight: deque[_Batch] = deque()  # in launch order, which is also the order they return in
    served: list[ServedRequest] = []
    stage_free = [0.0] * stages  # when each stage ends its last iteration (s)
    link_free = [0.0] * stages  # when each stage's outgoing messages are all delivered (s)
    stage_busy, link_busy = [0.0] * stages, [0.0] * stages
    now, iterations, kv_used, next_arrival, max_running = 0.0, 0, 0, 0, 0
    batch_tokens: list[int] = []
    while True:
        while in_flight and in_flight[0].return_s <= now:
            batch = in_flight.popleft()
            for r in batch.decoding:
                r.generated += 1
            for r, n in batch.chunks:
                r.prefilled += n
                if r.prefilled == r.request.prompt_tokens:
                    r.generated, r.first_token_s = 1, batch.sampled_s
            members = batch.decoding + [r for r, _ in batch.chunks]
            for r in members:
                r.in_flight = False
            for r in [r for r in members if r.generated == r.request.output_tokens]:
                running.remove(r)
                kv_used -= r.request.prompt_tokens + r.request.output_tokens
                served.append(ServedRequest(r.request, r.first_token_s, batch.sampled_s))
        if len(served) == len(requests):
            break
        while next_arrival < len(requests) and requests[next_arrival].arrival_s <= now:
            waiting.append(requests[next_arrival])
            next_arrival += 1
        if len(in_flight) < stages and stage_free[0] <= now:
            batch = _next_batch(running, waiting, max_batch_tokens, max_num_seqs, kv_capacity_tokens - kv_used)
            if batch is not None:
                decoding, chunks, admitted = batch
                kv_used += sum(r.request.prompt_tokens + r.request.output_tokens for r in admitted)
                max_running = max(max_running, len(running))
                mean_context = sum(r.context for r in decoding) / len(decoding) if decoding else 0.0
                parts = cost.stage_s(len(decoding), mean_context, [(n, r.prefilled + n) for r, n in chunks])
                tokens, sequences = len(decoding) + sum(n for _, n in chunks), len(decoding) + len(chunks)
                # The stages run iterations in launch order, each one at a time; a stage's messages
                # leave in that order over its link to the next (vLLM V1's batch queue keeps up to one
                # iteration in flight per stage: vllm/v1/engine/core.py, step_with_batch_queue).
                ready = now
                for s, part in enumerate(parts):
                    stage_free[s] = max(ready, stage_free[s]) + part
                    stage_busy[s] += part
                    hop = cost.hop_s(s, tokens, sequences)
                    link_busy[s] += hop
                    link_free[s] = max(stage_free[s], link_free[s]) + hop
                    ready = link_free[s]
                in_flight.append(_Batch(decoding, chunks, stage_free[-1], ready))
                for r in decoding:
                    r.in_flight = True
                for r, _ in chunks:
                    r.in_flight = True
                iterations += 1
                batch_tokens.append(tokens)
                continue
        events = [in_flight[0].return_s] if in_flight else []
        if next_arrival < len(requests):
            events.append(requests[next_arrival].arrival_s)
        if stage_free[0] > now and len(in_flight) < stages:
            events.append(stage_free[0])
        now = min(events)
    served.sort(key=lambda s: s.request.index)
    return ServingRun(served, iterations, max(stage_busy), max_running, kv_capacity_tokens, batch_tokens,
                      tuple(stage_busy), tuple(link_busy))


def _next_batch(running: list[_Running], waiting: deque[Request], max_batch_tokens: int, max_num_seqs: int,
                kv_free_tokens: int):
    """The next iteration's decodes, prefill chunks and newly admitted requests (see the module
    docstring), from the running requests not already in an iteration in flight and the waiting
    ones (admitted into ``running``); None when it would be empty."""
    budget = max_batch_tokens
    free = [r for r in running if not r.in_flight]
    decoding = [r for r in free if r.prefilled == r.request.prompt_tokens][:budget]
    budget -= len(decoding)
    chunks: list[tuple[_Running, int]] = []
    for r in free:
        if budget and r.prefilled < r.request.prompt_tokens:
            n = min(r.request.prompt_tokens - r.prefilled, budget)
            chunks.append((r, n))
            budget -= n
    admitted = []
    while waiting and budget and len(running) < max_num_seqs:
        need = waiting[0].prompt_tokens + waiting[0].output_tokens
        if need > kv_free_tokens:
            break
        kv_free_tokens -= need
        r = _Running(waiting.popleft())
        admitted.append(r)
        running.append(r)
        n = min(r.request.prompt_tokens, budget)
        chunks.append((r, n))
        budget -= n
    return (decoding, chunks, admitted) if decoding or chunks else None
