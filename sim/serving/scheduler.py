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

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

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


class _Running:
    """A request admitted: its prompt (tokens), how much of it is prefilled, its context (the
    prompt, then plus each token generated) and the context at which it is done (prompt plus
    output), kept as plain slots since every iteration reads them."""

    __slots__ = ("request", "prompt", "end", "prefilled", "context", "first_token_s", "in_flight")

    def __init__(self, request: Request):
        self.request, self.prompt = request, request.prompt_tokens
        self.end = request.prompt_tokens + request.output_tokens
        self.prefilled = 0
        self.context = self.prompt
        self.first_token_s = 0.0
        self.in_flight = False  # in an iteration not yet back at the first stage (tracked with stages only)


_CONTEXT = attrgetter("context")


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
    decode_batches: list[int] = field(default_factory=list)
    """The requests decoding in each iteration (in launch order; with replicas, theirs one after another)."""

    @property
    def mean_decode_batch(self) -> float:
        """The mean number of requests decoding in an iteration that decodes any (0 if none does):
        the batch one iteration in flight decodes at this load."""
        decoding = [n for n in self.decode_batches if n]
        return sum(decoding) / len(decoding) if decoding else 0.0


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
    return serve_together([requests], [(cost,)], max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                          kv_capacity_tokens=[kv_capacity_tokens])[0]


@dataclass(frozen=True)
class LateLimit:
    """When a run's verdict is decided before its end: once ``requests`` of its requests certainly
    take longer than ``ttft_s`` to their first token (s)."""

    ttft_s: float
    requests: int


_LATE_MARGIN_S = 1e-9
"""How much later than ``ttft_s`` a waiting request must have arrived before it counts as late:
far above the rounding of the clock's subtractions (s), so that its TTFT, computed, exceeds the bound."""


def serve_together(shares: list[list[Request]], costs: list[tuple[ServerCost, ...]], *, max_batch_tokens: int,
                   max_num_seqs: int, kv_capacity_tokens: list[int],
                   late_limit: LateLimit | None = None) -> list[ServingRun] | None:
    """Serve each of ``shares`` on a server of its own (as :func:`serve` does), the servers' clocks
    run together: server i's iteration launched while k servers are in one, itself included,
    costs ``costs[i][k - 1]`` (its last where it has fewer), the k servers sharing something (the
    cores of one machine: :mod:`sim.serving.simulate`). An iteration keeps the cost it started
    with when another server starts or ends one meanwhile. Servers launching at one instant count
    each other.

    With ``late_limit``, the run stops, and None is returned, as soon as that many requests of all
    the servers are certainly late: their first token came more than ``late_limit.ttft_s`` after
    their arrival, or they still wait to be admitted that long after it (a request admitted now
    gets its first token after now). The requests served are the same either way, up to then.

    Raises:
        ConfigError: as :func:`serve`.
    """
    ttft_s = late_limit.ttft_s if late_limit is not None else math.inf
    servers = [_Server(share, cost, kv, ttft_s) for share, cost, kv in zip(shares, costs, kv_capacity_tokens)]
    now = 0.0
    while True:
        for server in servers:
            server.settle(now)
        if late_limit is not None and sum(server.late_first_tokens + len(server.waiting) for server in servers) \
                >= late_limit.requests and sum(server.late(now) for server in servers) >= late_limit.requests:
            return None
        live = [server for server in servers if not server.finished]
        if not live:
            break
        batches = [(server, server.next_batch(now, max_batch_tokens, max_num_seqs)) for server in live]
        launching = [(server, batch) for server, batch in batches if batch is not None]
        if launching:
            busy = len(launching) + sum(server.busy(now) for server, batch in batches if batch is None)
            for server, batch in launching:
                server.launch(now, batch, busy)
            if any(server.stage_free[0] <= now for server, _ in launching):
                continue  # an iteration of no time: something may launch again now
            # Otherwise nothing can happen at ``now`` any more (every server launched or could not,
            # and launching only fills stages): on to the next event.
        now = min(server.next_event_s(now) for server in live)
    return [server.run() for server in servers]


class _Server:
    """One server's continuous batching (the module docstring), advanced by :func:`serve_together`."""

    def __init__(self, requests: list[Request], costs: tuple[ServerCost, ...], kv_capacity_tokens: int,
                 ttft_s: float = math.inf):
        if requests:
            worst = max(requests, key=lambda r: r.prompt_tokens + r.output_tokens)
            if worst.prompt_tokens + worst.output_tokens > kv_capacity_tokens:
                raise ConfigError("workload", f"request {worst.index} needs {worst.prompt_tokens + worst.output_tokens} "
                                              f"tokens of KV cache, but the memory left beside the weights holds "
                                              f"{kv_capacity_tokens} (got {worst.prompt_tokens} + {worst.output_tokens})")
        self.requests, self.costs, self.kv_capacity_tokens = requests, costs, kv_capacity_tokens
        stages = self.stages = len(costs[0].stages)
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self.in_flight: deque[_Batch] = deque()  # in launch order, which is also the order they return in
        self.served: list[ServedRequest] = []
        self.stage_free = [0.0] * stages  # when each stage ends its last iteration (s)
        self.link_free = [0.0] * stages  # when each stage's outgoing messages are all delivered (s)
        self.stage_busy, self.link_busy = [0.0] * stages, [0.0] * stages
        self.iterations, self.kv_used, self.next_arrival, self.max_running = 0, 0, 0, 0
        self.batch_tokens: list[int] = []
        self.decode_batches: list[int] = []
        self.ttft_s, self.late_first_tokens = ttft_s, 0  # the TTFT a request is late beyond (s), and how many were
        self.arrivals = [r.arrival_s for r in requests] if ttft_s < math.inf else []

    @property
    def finished(self) -> bool:
        return len(self.served) == len(self.requests)

    def settle(self, now: float) -> None:
        """Take back the iterations returned by ``now`` and queue the requests arrived by then."""
        while self.in_flight and self.in_flight[0].return_s <= now:
            batch = self.in_flight.popleft()
            for r in batch.decoding:
                r.context += 1
            done = [r for r in batch.decoding if r.context == r.end]
            for r, n in batch.chunks:
                r.prefilled += n
                if r.prefilled == r.prompt:
                    r.context, r.first_token_s = r.prompt + 1, batch.sampled_s
                    # the expression of ServedRequest.ttft_s: the same value the metrics read
                    self.late_first_tokens += batch.sampled_s - r.request.arrival_s > self.ttft_s
                    if r.context == r.end:
                        done.append(r)
            if self.stages > 1:
                for r in batch.decoding:
                    r.in_flight = False
                for r, _ in batch.chunks:
                    r.in_flight = False
            if done:
                # every running request that is done is in this iteration: the others go on, in order
                self.running = [r for r in self.running if r.context != r.end]
            for r in done:
                self.kv_used -= r.end
                self.served.append(ServedRequest(r.request, r.first_token_s, batch.sampled_s))
        while self.next_arrival < len(self.requests) and self.requests[self.next_arrival].arrival_s <= now:
            self.waiting.append(self.requests[self.next_arrival])
            self.next_arrival += 1

    def late(self, now: float) -> int:
        """How many of its requests are certainly late at ``now`` (see :func:`serve_together`):
        those whose first token came late, and those waiting to be admitted (in arrival order:
        the arrived requests after the admitted ones) that arrived more than ``ttft_s`` ago."""
        first_waiting = self.next_arrival - len(self.waiting)
        waiting = bisect_right(self.arrivals, now - self.ttft_s - _LATE_MARGIN_S, first_waiting, self.next_arrival)
        return self.late_first_tokens + max(0, waiting - first_waiting)

    def busy(self, now: float) -> bool:
        """Whether the first stage is in an iteration at ``now``."""
        return self.stage_free[0] > now

    def next_batch(self, now: float, max_batch_tokens: int, max_num_seqs: int):
        """The iteration to launch at ``now`` (:func:`_next_batch`'s), None where none can start."""
        if len(self.in_flight) >= self.stages or self.stage_free[0] > now:
            return None
        # one stage: nothing is in flight here (the last iteration is back), so every running request is free
        free = self.running if self.stages == 1 else [r for r in self.running if not r.in_flight]
        return _next_batch(self.running, free, self.waiting, max_batch_tokens, max_num_seqs,
                           self.kv_capacity_tokens - self.kv_used)

    def launch(self, now: float, batch, busy: int) -> None:
        """Start ``batch`` at ``now`` with ``busy`` servers in an iteration (see :func:`serve_together`)."""
        cost = self.costs[min(busy, len(self.costs)) - 1]
        decoding, chunks, admitted = batch
        self.kv_used += sum(r.end for r in admitted)
        self.max_running = max(self.max_running, len(self.running))
        mean_context = sum(map(_CONTEXT, decoding)) / len(decoding) if decoding else 0.0
        parts = cost.stage_s(len(decoding), mean_context, [(n, r.prefilled + n) for r, n in chunks])
        tokens, sequences = len(decoding) + sum(n for _, n in chunks), len(decoding) + len(chunks)
        # The stages run iterations in launch order, each one at a time; a stage's messages
        # leave in that order over its link to the next (vLLM V1's batch queue keeps up to one
        # iteration in flight per stage: vllm/v1/engine/core.py, step_with_batch_queue).
        ready = now
        for s, part in enumerate(parts):
            self.stage_free[s] = max(ready, self.stage_free[s]) + part
            self.stage_busy[s] += part
            hop = cost.hop_s(s, tokens, sequences)
            self.link_busy[s] += hop
            self.link_free[s] = max(self.stage_free[s], self.link_free[s]) + hop
            ready = self.link_free[s]
        self.in_flight.append(_Batch(decoding, chunks, self.stage_free[-1], ready))
        if self.stages > 1:
            for r in decoding:
                r.in_flight = True
            for r, _ in chunks:
                r.in_flight = True
        self.iterations += 1
        self.batch_tokens.append(tokens)
        self.decode_batches.append(len(decoding))

    def next_event_s(self, now: float) -> float:
        """When something next happens to the server after ``now`` (s): an iteration's return, an
        arrival, its first stage coming free."""
        events = [self.in_flight[0].return_s] if self.in_flight else []
        if self.next_arrival < len(self.requests):
            events.append(self.requests[self.next_arrival].arrival_s)
        if self.stage_free[0] > now and len(self.in_flight) < self.stages:
            events.append(self.stage_free[0])
        return min(events)

    def run(self) -> ServingRun:
        """What the server did (:class:`ServingRun`)."""
        served = sorted(self.served, key=lambda s: s.request.index)
        return ServingRun(served, self.iterations, max(self.stage_busy), self.max_running, self.kv_capacity_tokens,
                          self.batch_tokens, tuple(self.stage_busy), tuple(self.link_busy), self.decode_batches)


def _next_batch(running: list[_Running], free: list[_Running], waiting: deque[Request], max_batch_tokens: int,
                max_num_seqs: int, kv_free_tokens: int):
    """The next iteration's decodes, prefill chunks and newly admitted requests (see the module
    docstring), from ``free``, the running requests not already in an iteration in flight (in
    their order in ``running``), and the waiting ones (admitted into ``running``); None when it
    would be empty."""
    budget = max_batch_tokens
    decoding = [r for r in free if r.prefilled == r.prompt][:budget]
    budget -= len(decoding)
    chunks: list[tuple[_Running, int]] = []
    for r in free:
        if budget and r.prefilled < r.prompt:
            n = min(r.prompt - r.prefilled, budget)
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
        n = min(r.prompt, budget)
        chunks.append((r, n))
        budget -= n
    return (decoding, chunks, admitted) if decoding or chunks else None
