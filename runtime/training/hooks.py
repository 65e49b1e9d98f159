"""DDP communication hooks: every bucket's allreduce, timed, by the backend or by a hetsim schedule.

DDP hands each bucket of gradients to the registered hook as soon as the bucket's last gradient
is computed (``DistributedDataParallel.register_comm_hook``; the hook returns a
``torch.futures.Future`` of the averaged bucket, and the reducer waits for every future at the
end of backward, before the optimizer may run). :class:`BucketAllreduce` is that hook:

* ``library``: the backend's allreduce, asynchronous (``dist.all_reduce(async_op=True)``, as
  torch's ``default_hooks.allreduce_hook``);
* any other algorithm: the very :class:`~sim.collectives.schedule.CommSchedule` the simulator
  prices (:func:`sim.collectives.registry.build_schedule`), executed over isend/irecv by
  :func:`runtime.comm.run_schedule`, on one communication thread, so buckets are reduced one at a
  time in the order they became ready while backward goes on (DDP's launch order);
* compression (``fp16`` / ``bf16``): the bucket travels cast to that dtype, divided by the world
  size first, and is cast back (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``,
  whatever the algorithm);
* ``overlap=False``: no bucket starts before the last one is ready (``GradBucket.is_last``): every
  allreduce after backward's compute;
* parameter averaging: gradients stay local (torch's ``debugging_hooks.noop_hook``).

Every call is recorded as a :class:`BucketCall`: when the bucket was ready (the hook was called),
when its allreduce started and ended (``time.perf_counter``), its index and bytes on the wire.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime.comm import run_schedule
from sim.collectives.registry import LIBRARY, build_schedule
from sim.collectives.schedule import CommSchedule
from sim.training_config import GradientCompression

COMPRESSED_DTYPES = {GradientCompression.FP16: torch.float16, GradientCompression.BF16: torch.bfloat16}


@dataclass(frozen=True)
class BucketCall:
    """One bucket's allreduce on one rank (times: ``time.perf_counter`` seconds).

    ``ready_s``: the hook was called (the bucket's last gradient was computed); ``start_s`` /
    ``end_s``: the allreduce ran; ``size_bytes``: the bytes each rank reduces (compressed size).
    """

    index: int
    size_bytes: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass
class BucketAllreduce:
    """The comm hook's state and the hook itself (:meth:`comm_hook`), for the ranks ``group``.

    Args:
        group: the data-parallel ranks (global ranks, the default process group's).
        rank: this process's rank.
        algorithm: ``library`` or an allreduce algorithm of :mod:`sim.collectives.registry`.
        host_groups: ``group -> group partitioned by host`` (``Topology.host_groups``), for the
            two-level algorithms.
        compression: :class:`sim.training_config.GradientCompression`.
        overlap: launch each bucket when ready (False: all after the last is ready).
        average: divide by the group size (False: local gradients, the parameter-averaging case,
            nothing is communicated).
        process_group: the ``torch.distributed`` process group of ``group``, for ``library``
            (None: the default group, which must then be ``group``).
    """

    group: tuple[int, ...]
    rank: int
    algorithm: str
    host_groups: Callable[[tuple[int, ...]], tuple[tuple[int, ...], ...]]
    compression: GradientCompression = GradientCompression.NONE
    overlap: bool = True
    average: bool = True
    process_group: object = None
    calls: list[BucketCall] = field(default_factory=list)
    _held: list[tuple] = field(default_factory=list)
    _schedules: dict[int, CommSchedule] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: ThreadPoolExecutor | None = None

    def comm_hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The DDP comm hook: returns a future of ``bucket``'s buffer, averaged over the group.
        (DDP compares the annotation of ``bucket`` with ``dist.GradBucket`` itself, so this module
        keeps its annotations evaluated: no ``from __future__ import annotations``.)"""
        ready = time.perf_counter()
        buffer = bucket.buffer()
        future: torch.futures.Future = torch.futures.Future()
        if not self.average or len(self.group) == 1:
            future.set_result(buffer)
            return future
        job = (bucket.index(), buffer, ready, future)
        if self.overlap:
            self._launch(job)
        else:
            self._held.append(job)
            if bucket.is_last():
                held, self._held = self._held, []
                for job in held:
                    self._launch(job)
        return future

    def close(self) -> None:
        """Stop the communication thread (after the last step)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def take_calls(self) -> list[BucketCall]:
        """The calls recorded since the last take, in launch order."""
        with self._lock:
            calls, self.calls = self.calls, []
        return calls

    def _launch(self, job: tuple) -> None:
        index, buffer, ready, future = job
        if self.algorithm == LIBRARY:
            start = time.perf_counter()
            wire = self._wire(buffer)
            work = dist.all_reduce(wire, group=self.process_group, async_op=True).get_future()

            def finish(done: torch.futures.Future) -> None:
                self._record(index, wire, ready, start)
                future.set_result(self._unwire(wire, buffer))

            work.then(finish)
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetsim-comm")
        self._thread.submit(self._run_schedule, index, buffer, ready, future)

    def _run_schedule(self, index: int, buffer: torch.Tensor, ready: float, future: torch.futures.Future) -> None:
        try:
            if buffer.is_cuda:  # the current device is per thread; NCCL sends from this one
                torch.cuda.set_device(buffer.device)
            start = time.perf_counter()
            wire = self._wire(buffer)
            run_schedule(self._schedule(wire), wire, self.rank)
            self._record(index, wire, ready, start)
            future.set_result(self._unwire(wire, buffer))
        except BaseException as error:  # the reducer's wait raises it on the training thread
            future.set_exception(error)

    def _wire(self, buffer: torch.Tensor) -> torch.Tensor:
        """What travels: the bucket divided by the group size, cast to the compressed dtype if any."""
        buffer.div_(len(self.group))
        dtype = COMPRESSED_DTYPES.get(self.compression)
        return buffer if dtype is None else buffer.to(dtype)

    @staticmethod
    def _unwire(wire: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        if wire is not buffer:
            buffer.copy_(wire)
        return buffer

    def _schedule(self, wire: torch.Tensor) -> CommSchedule:
        size = wire.numel() * wire.element_size()
        if size not in self._schedules:
            self._schedules[size] = build_schedule(OpKind.ALLREDUCE, self.algorithm, self.group, size,
                                                   host_groups=self.host_groups(self.group))
        return self._schedules[size]

    def _record(self, index: int, wire: torch.Tensor, ready: float, start: float) -> None:
        call = BucketCall(index, wire.numel() * wire.element_size(), ready, start, time.perf_counter())
        with self._lock:
            self.calls.append(call)


def average_parameters(parameters: list[torch.Tensor], group: tuple[int, ...], rank: int, algorithm: str,
                       host_groups: Callable, process_group=None) -> None:
    """Replace every parameter by its mean over ``group``: one flat allreduce by ``algorithm``
    (``library``: the backend's over ``process_group``, None for the default group, as
    ``torch.distributed.algorithms.model_averaging.utils.average_parameters`` does; otherwise the
    hetsim schedule over isend/irecv)."""
    flat = torch.cat([p.detach().reshape(-1) for p in parameters]).div_(len(group))
    if algorithm == LIBRARY:
        dist.all_reduce(flat, group=process_group)
    else:
        schedule = build_schedule(OpKind.ALLREDUCE, algorithm, group, flat.numel() * flat.element_size(),
                                  host_groups=host_groups(group))
        run_schedule(schedule, flat, rank)
    offset = 0
    with torch.no_grad():
        for p in parameters:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
