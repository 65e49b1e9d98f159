"""A training rank's memory by category, as measured around one optimizer step (bytes).

The categories are those the simulator charges (:class:`models.training.TrainingMemory`), read
from the live tensors where the runtime can count them and from the device's readings
(:class:`runtime.device.Device`: resident set size on the CPU, the caching allocator's counters on
CUDA) for the rest:

* ``weights``: the bytes of the model's parameters (the rank's shard; under ``bf16_mixed`` their
  bf16 copies, :mod:`runtime.training.precision`);
* ``optimizer_states``: the tensors the optimizer keeps per parameter (``torch.optim``'s
  ``state``; the rank's shard under ``ZeroRedundancyOptimizer``, whose local optimizer is
  ``optim``), and under ``bf16_mixed`` the fp32 master parameters it steps;
* ``bucket_buffers``: DDP's flat bucket buffers, the sum of the reducer's ``bucket_sizes``
  (``DistributedDataParallel._get_ddp_logging_data``, filled by ``Logger::set_comm_hook`` and the
  bucket rebuild in ``torch/csrc/distributed/c10d/logger.cpp``); 0 under
  ``gradient_as_bucket_view``, where every ``.grad`` is a view into its bucket
  (``Reducer::initialize_bucket_views`` in ``torch/csrc/distributed/c10d/reducer.cpp``), so the
  buckets are the gradients;
* ``gradients``: the ``.grad`` of every parameter, which ``zero_grad()`` frees after each step
  (``set_to_none``, torch.optim's default) and backward allocates again;
* ``framework``: what the rank holds beyond those tensors between steps, ``memory_bytes()`` once
  the step before has freed its gradients and activations, less weights, optimizer states and
  bucket buffers (the interpreter, torch's libraries and the pages of the kernels training ran,
  the communication library's buffers and threads);
* ``activations``: the rest of the step's peak, ``peak - resident - gradients``: what forward kept
  for backward with the transients at the peak.

:func:`framework_bytes` is the one definition the calibration's ``memory_baseline`` (what the
simulator charges as ``framework``) and the measured categories share, and :func:`exact_step_memory`
the one way both read a rank's memory: under the exact allocator from the trainer's construction
on, before the rank has trained in the fast one (:mod:`runtime.memory_probe`). glibc serves a
request from a free chunk of the heap before it considers ``mmap`` (``_int_malloc`` in glibc's
``malloc/malloc.c`` reaches ``sysmalloc``, where ``M_MMAP_THRESHOLD`` applies, only when no bin
and not the top chunk can serve it), and the fast mode's steps leave the activations' blocks below
4 MiB as such chunks; ``malloc_trim`` in the reset gives their pages back, and the exact step
then touches them again as it reuses them, chunk after chunk. Read after the timed steps, a step
of the validation model (tiny_gpt2 over 4 gloo ranks) peaked above the resident memory plus
torch's own count of its live tensors (the CPU allocator's running total in the profiler's
allocation events) by 2.6 to 31 MB in the stored validation (``validation/training-report/blocked-s20``,
median 12 MB, different on every rank; 2.5 to 22 MB on loopback with
``benchmarks/bench_training_memory.py --fast-steps 4``); read first, by at most 0.8 MB on every
rank of the 11 cases of ``validation/training-quick.yaml`` (the same benchmark).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

import torch

from models.training import TrainingMemory
from runtime import memory_probe

if TYPE_CHECKING:
    from runtime.device import Device
    from runtime.training.trainer import Trainer

MEMORY_WARMUP_STEPS = 2
"""Optimizer steps a rank trains before the step whose memory is read: DDP rebuilds its buckets
(in the order gradients became ready) at the start of the second step's forward, freeing the
first step's (``_rebuild_buckets`` in ``torch/nn/parallel/distributed.py``), and the first step
allocates the optimizer's states, so the read step holds what every later step holds."""


@dataclass(frozen=True)
class StateBytes:
    """A rank's tensors, bytes, in the simulator's categories: weights, optimizer states, bucket
    buffers and gradients; ``gradient_views``: the gradients are views into the buckets
    (``gradient_as_bucket_view``), which stay allocated between steps, where ``.grad`` tensors of
    their own are freed by ``zero_grad()`` and allocated by backward."""

    weights: int
    optimizer_states: int
    bucket_buffers: int
    gradients: int
    gradient_views: bool


def state_bytes(trainer) -> StateBytes:
    """:class:`StateBytes` of a :class:`runtime.training.trainer.Trainer` that has run a step (DDP
    reports its buckets' sizes once it has built them)."""
    parameters = [p for p in trainer.ddp.module.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in trainer.ddp.module.parameters())
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer's local one
    states = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                 if torch.is_tensor(t) and t.dim() > 0)  # Adam's step counts are scalars of a few bytes
    if trainer.copies is not None:  # bf16_mixed: the kernels' weights are the bf16 copies, the fp32 masters the optimizer's
        states += weights
        weights = trainer.copies.copy_bytes()
    logged = trainer.ddp._get_ddp_logging_data()
    buckets = sum(int(size) for size in str(logged.get("bucket_sizes", "")).split(",") if size.strip())
    if trainer.setup.settings.gradient_as_bucket_view:
        return StateBytes(weights, states, 0, buckets, True)
    return StateBytes(weights, states, buckets, sum(p.numel() * p.element_size() for p in parameters), False)


def framework_bytes(resident_bytes: int, states: StateBytes) -> int:
    """What a rank holds beyond its tensors (bytes): ``resident_bytes`` read between steps (no
    gradient, no activation alive) less weights, optimizer states and the gradients' buckets
    (under ``gradient_as_bucket_view`` the buckets, counted as gradients, stay allocated)."""
    kept = states.weights + states.optimizer_states + states.bucket_buffers
    return resident_bytes - kept - (states.gradients if states.gradient_views else 0)


@dataclass(frozen=True)
class StepMemory:
    """One step's memory readings (bytes): ``resident_bytes`` just before it, ``peak_bytes`` its
    high-water mark; ``steps``: the optimizer steps the trainer ran, the read one included."""

    resident_bytes: int
    peak_bytes: int
    steps: int


def exact_step_memory(build: Callable[[], Trainer], device: Device, first_step: int = 0) -> tuple[Trainer, StepMemory]:
    """Build a :class:`runtime.training.trainer.Trainer` with ``build()`` and read one step's
    memory on ``device`` (a :class:`runtime.device.Device`), all under the exact allocator
    (:func:`runtime.memory_probe.exact_allocation`, the fast one again on return): the trainer
    trains :data:`MEMORY_WARMUP_STEPS` steps, the peak is reset (garbage collected, free pages
    given back), then one more step is read. Steps are numbered from ``first_step`` (their
    batches). Call it before the process trains in the fast allocator (see the module): the read
    is the resident memory plus the step's live bytes only while the heap holds no free chunk the
    step's blocks can be carved from. Returns the trainer and the readings."""
    with memory_probe.exact_allocation():
        trainer = build()
        for step in range(first_step, first_step + MEMORY_WARMUP_STEPS):
            trainer.step(step)
        device.reset_peak_memory()
        resident = device.memory_bytes()
        trainer.step(first_step + MEMORY_WARMUP_STEPS)
        peak = device.peak_memory_bytes()
    return trainer, StepMemory(resident, peak, MEMORY_WARMUP_STEPS + 1)


def memory_categories(resident_bytes: int, peak_bytes: int, states: StateBytes) -> dict[str, int]:
    """The step's memory by category (the :class:`models.training.TrainingMemory` field names;
    see the module): ``resident_bytes`` just before the step, ``peak_bytes`` its high-water mark."""
    allocated = 0 if states.gradient_views else states.gradients  # views allocate nothing
    return asdict(TrainingMemory(
        weights=states.weights, gradients=states.gradients, optimizer_states=states.optimizer_states,
        activations=peak_bytes - resident_bytes - allocated, bucket_buffers=states.bucket_buffers,
        framework=framework_bytes(resident_bytes, states)))
