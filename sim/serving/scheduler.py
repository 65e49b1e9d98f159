"""Continuous batching (Yu et al. 2022, Orca, OSDI; vLLM's scheduler) with chunked prefill under a
token budget per iteration, as a discrete-event simulation of iterations.

Each iteration, in order: every running request whose prompt is done contributes one decode token;
requests still prefilling continue with a chunk of their prompt; then waiting requests are admitted
first come, first served, each with a chunk, while the iteration's token budget
(``max_batch_tokens``), the number of running requests (``max_num_seqs``) and the KV cache allow.
This is vLLM V1's policy (``vllm/v1/core/sched/scheduler.py``: running requests first, then
waiting ones, one token budget shared by decode and prefill). A request's first token comes out of
the iteration that completes its prompt; each later iteration gives it one more token.

Memory: a request is admitted only when the KV cache can hold its whole prompt and output, so
nothing is ever preempted. vLLM allocates KV blocks as tokens come and preempts (recomputes) when
it runs out; reserving ahead admits fewer requests only when memory is the bottleneck.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from models.errors import ConfigError
from sim.serving.iteration import IterationCost
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

    @property
    def context(self) -> int:
        return self.request.prompt_tokens + self.generated


@dataclass
class ServingRun:
    """The outcome of serving a list of requests: every request's times, the iterations run and
    the busy time of the servers (s)."""

    served: list[ServedRequest]
    iterations: int
    busy_s: float
    max_running: int = 0
    kv_capacity_tokens: int = 0
    batch_tokens: list[int] = field(default_factory=list)


def serve(requests: list[Request], cost: IterationCost, *, max_batch_tokens: int, max_num_seqs: int,
          kv_capacity_tokens: int) -> ServingRun:
    """Serve ``requests`` (in arrival order) by continuous batching; see the module docstring.

    Args:
        requests: arrival times (s) and lengths (tokens).
        cost: iteration times of the variant.
        max_batch_tokens: tokens one iteration may process (decode tokens plus prefill chunks).
        max_num_seqs: requests running at once.
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
    waiting: deque[Request] = deque()
    running: list[_Running] = []
    served: list[ServedRequest] = []
    now, busy, iterations, kv_used, next_arrival, max_running = 0.0, 0.0, 0, 0, 0, 0
    batch_tokens: list[int] = []
    while len(served) < len(requests):
        while next_arrival < len(requests) and requests[next_arrival].arrival_s <= now:
            waiting.append(requests[next_arrival])
            next_arrival += 1
        if not running and not waiting:
            now = requests[next_arrival].arrival_s
            continue
        budget = max_batch_tokens
        decoding = [r for r in running if r.prefilled == r.request.prompt_tokens][:budget]
        budget -= len(decoding)
        chunks: list[tuple[_Running, int]] = []
        for r in running:
            if budget and r.prefilled < r.request.prompt_tokens:
                n = min(r.request.prompt_tokens - r.prefilled, budget)
                chunks.append((r, n))
                budget -= n
        while waiting and budget and len(running) < max_num_seqs:
            need = waiting[0].prompt_tokens + waiting[0].output_tokens
            if kv_used + need > kv_capacity_tokens:
                break
            admitted = _Running(waiting.popleft())
            kv_used += need
            running.append(admitted)
            n = min(admitted.request.prompt_tokens, budget)
            chunks.append((admitted, n))
            budget -= n
        max_running = max(max_running, len(running))
        mean_context = sum(r.context for r in decoding) / len(decoding) if decoding else 0.0
        duration = cost.iteration_s(len(decoding), mean_context, [(n, r.prefilled + n) for r, n in chunks])
        now += duration
        busy += duration
        iterations += 1
        batch_tokens.append(max_batch_tokens - budget)
        for r in decoding:
            r.generated += 1
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled == r.request.prompt_tokens:
                r.generated, r.first_token_s = 1, now
        for r in [r for r in running if r.generated == r.request.output_tokens]:
            running.remove(r)
            kv_used -= r.request.prompt_tokens + r.request.output_tokens
            served.append(ServedRequest(r.request, r.first_token_s, now))
    served.sort(key=lambda s: s.request.index)
    return ServingRun(served, iterations, busy, max_running, kv_capacity_tokens, batch_tokens)
