"""Collectives in the runtime: the backend's own, or a simulator schedule over isend/irecv.

A plan's :class:`~sim.plan.Collective` names an algorithm. ``library`` calls the backend's
collective (``dist.all_reduce`` / ``reduce`` / ``broadcast``: gloo on CPU, NCCL on GPU). Any other
name builds the very :class:`~sim.collectives.schedule.CommSchedule` the simulator prices
(:func:`sim.collectives.registry.build_schedule`) and executes its steps with point-to-point
messages, following the buffer semantics in :mod:`sim.collectives.schedule`: per step, every
receive lands in scratch space and is copied or added only after all of the step's messages are
done, so a send always reads the buffer as it was when the step began. There is no second copy of
any algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from models.ops import OpKind
from sim.collectives.registry import LIBRARY, build_schedule
from sim.collectives.schedule import CommSchedule
from sim.plan import Collective


@dataclass
class Communicator:
    """Runs the plan's collectives for one rank.

    Args:
        rank: this process's global rank (the plan's rank ids are global ranks).
        host_groups: callable ``group -> group partitioned by host`` for two-level algorithms
            (``Topology.host_groups``).
        process_groups: the torch process group of each group of ranks that is not the whole
            run (a pipeline stage's, :func:`runtime.pipeline.stage_process_groups`), for the
            backend's own collectives.
    """

    rank: int
    host_groups: object
    process_groups: dict[tuple[int, ...], object] = field(default_factory=dict)
    _schedules: dict[tuple, CommSchedule] = field(default_factory=dict)

    def run(self, call: Collective, tensor: torch.Tensor) -> None:
        """Apply ``call`` in place to ``tensor`` (contiguous, ``call.size_bytes`` bytes).

        Raises:
            ValueError: the tensor's size does not match the call's ``size_bytes``.
        """
        if tensor.numel() * tensor.element_size() != call.size_bytes:
            raise ValueError(f"{call.kind} expects {call.size_bytes} bytes, tensor has "
                             f"{tensor.numel() * tensor.element_size()}")
        if len(call.group) == 1:
            return
        if call.algorithm == LIBRARY:
            self._library(call, tensor)
        else:
            run_schedule(self._schedule(call), tensor.view(-1), self.rank)

    def _library(self, call: Collective, tensor: torch.Tensor) -> None:
        group = self.process_groups.get(tuple(call.group))  # None: every rank of the run
        if call.kind == OpKind.ALLREDUCE:
            dist.all_reduce(tensor, group=group)
        elif call.kind == OpKind.REDUCE:
            dist.reduce(tensor, dst=call.root, group=group)
        elif call.kind == OpKind.BROADCAST:
            dist.broadcast(tensor, src=call.root, group=group)
        else:
            raise ValueError(f"no library collective for {call.kind}")

    def _schedule(self, call: Collective) -> CommSchedule:
        key = (call.kind, call.algorithm, call.group, call.size_bytes, call.root)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(call.kind, call.algorithm, call.group, call.size_bytes,
                                                  root=call.root, host_groups=self.host_groups(call.group))
        return self._schedules[key]


def run_schedule(schedule: CommSchedule, flat: torch.Tensor, rank: int) -> None:
    """Execute ``rank``'s part of ``schedule`` on the 1-D buffer ``flat`` with isend/irecv.

    Byte ranges become element ranges (chunk boundaries are multiples of 8 bytes, so they fall on
    element boundaries for every dtype of up to 8 bytes).

    Raises:
        ValueError: a byte range that does not fall on an element boundary.
    """
    size = flat.element_size()
    for index, step in enumerate(schedule.steps):
        sends = [t for t in step if t.src == rank]
        recvs = [t for t in step if t.dst == rank]
        if not sends and not recvs:
            continue
        requests, scratch = [], []
        for t in recvs:
            start, stop = _elements(t.offset_bytes, t.end_bytes, size)
            buffer = torch.empty(stop - start, dtype=flat.dtype, device=flat.device)
            scratch.append((t, start, stop, buffer))
            requests.append(dist.irecv(buffer, src=t.src, tag=index))
        for t in sends:
            start, stop = _elements(t.offset_bytes, t.end_bytes, size)
            requests.append(dist.isend(flat[start:stop], dst=t.dst, tag=index))
        for request in requests:  # sends drain before any receive is applied
            request.wait()
        for t, start, stop, buffer in scratch:
            if not t.reduce:
                flat[start:stop].copy_(buffer)
        for t, start, stop, buffer in scratch:
            if t.reduce:
                flat[start:stop].add_(buffer)


def _elements(offset_bytes: int, end_bytes: int, element_bytes: int) -> tuple[int, int]:
    if offset_bytes % element_bytes or end_bytes % element_bytes:
        raise ValueError(f"byte range [{offset_bytes}, {end_bytes}) is not aligned to {element_bytes}-byte elements")
    return offset_bytes // element_bytes, end_bytes // element_bytes
