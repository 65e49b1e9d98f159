"""``hetsim calibrate`` of a training scenario: forward and backward per op kind, the optimizer
step, the buckets' allreduce and the tensor-parallel allreduce, timed on the modules that train
(:class:`runtime.training.model.DecoderLM`, the rank's tensor-parallel shard of it) and over the
groups that train, written as profile rows.

In every rank of the layout at once (tensor x data ranks, :func:`runtime.training.ranks.training_ranks`,
forked as a measurement forks them, so the ranks share the cores as they do while training), for
each distinct micro-batch size and precision of the scenario's variants:

* ``compute``: per op kind, the op's forward on layer 0 (or the head) with autograd recording, as
  a training forward runs, at ``batch_size`` sequences of ``new_tokens`` tokens, with the FLOPs
  and bytes :mod:`sim.training.lower` gives the op (:func:`models.accounting.layer_op_costs`, the
  head's :func:`models.accounting.head_op_costs` over every position). With tensor parallelism
  (``parallel.tensor`` T above 1) the layer is the rank's shard (its heads and MLP columns,
  :class:`runtime.training.model.TensorParallel`) without its allreduces, the rows' FLOPs and
  bytes the shard's, and ``group_size`` is T on these rows, the ``backward_*`` and the
  ``training_pass`` rows (1 without tensor parallelism);
* ``backward_input`` and ``backward_weight``: per op kind of :func:`models.training.layer_backward_costs`
  and :func:`models.training.head_backward_costs`, the gradient of the op's inputs and of its
  weights apart: the op's forward is run once on layer 0 (or the head) with a random upstream
  gradient, then ``torch.autograd.grad`` is asked for the inputs only, or the weights only (the
  engine computes only what the requested gradients need, ``torch/csrc/autograd/engine.cpp``).
  Each row carries the op's FLOPs and bytes from the accounting, so the simulator can scale it.
* ``training_pass``: the model's (the shard's) whole forward pass (to the loss) and backward
  pass, without DDP or any communication, whose ratio to the sum of their ops timed alone the simulator applies to
  those ops (:mod:`sim.training.step_compute`); timed in every round of the calibration,
  :data:`PASS_CALLS_PER_ROUND` calls a rank a round, so that its calls span the calibration;
* ``memory_baseline``: what each rank holds beyond its weights, optimizer states and buckets while
  it trains (:func:`framework_after_steps`), the simulator's ``framework`` memory: read as the
  measured categories are (:mod:`runtime.training.memory`). Read before any model was built
  instead, it missed the pages and threads training adds (346 MB against 321 MB on the validation
  model, tiny_gpt2 over 4 gloo ranks);
* ``optimizer_step``: one step of each of the variants' optimizers over 2^16, 2^20 parameters (one
  tensor each) and the model's count (tensors of the rank's own parameter shapes, as its step
  updates them: :func:`optimizer_timings`), fp32 parameters with gradients, the states
  initialised by an untimed first step; ``size_bytes`` is the fp32 bytes of the parameters,
  ``flops`` and ``traffic_bytes`` from :func:`models.training.optimizer_step_cost`.

* ``collective``: the allreduce algorithms of the variants' buckets (and ZeRO-1's binomial
  broadcast where a variant shards) over the data-parallel group, each size timed as
  :data:`BUCKET_CHAIN_CALLS` calls back to back per round (:class:`runtime.comm_timing.CollectiveSweep`'s
  ``chain``: DDP's buckets queue on the communication stream and run back to back), from 1 KiB
  up to the first size of the sweep
  that holds every gradient of the model (a bucket, a compressed bucket and the parameter
  average are no larger), or ``max_call_s``; the same rows an inference calibration times, so
  the simulator prices buckets with the network terms it fits on them (:mod:`sim.calibrated`).
  With tensor parallelism, rank 0's data-parallel group sweeps its buckets' allreduce, then rank
  0's tensor-parallel group (its replica) sweeps its allreduce, each alone (the other groups
  idle): the simulator prices a collective as it runs meeting no other traffic, and its fabric
  adds what concurrent groups that share a link cost each other (:mod:`sim.fabric`). The
  tensor-parallel sweep times the library's algorithm (what the model's ``f`` and ``g`` call) and
  the one the simulator prices each variant's tensor-parallel allreduces with
  (:func:`sim.training.lower.tp_allreduce_algorithm`), from 1 KiB up to the hidden state of a
  micro-batch (``b x t x h`` elements of the compute dtype, the size of every such allreduce),
  that size included.
* ``reduction``: on rank 0 alone (the other ranks waiting), a received buffer added into a local
  one at 64 KiB to 64 MiB (:func:`runtime.reduction_bench.reduction_rows`, the inference
  calibration's rows), in every dtype the variants' collectives reduce in
  (:func:`sim.training.lower.scenario_reduction_dtypes`): the gradients' (:data:`models.training.GRADIENT_DTYPE`:
  DDP's buckets hold fp32 gradients under every precision, :mod:`runtime.training.precision`), a
  compressed bucket's fp16 or bf16, and with tensor parallelism or parameter averaging the compute
  dtype: what the simulator's reduction cost per byte of each collective is fitted on
  (:mod:`sim.reduction`; on a CPU the dtypes' costs per byte differ, bf16's about twice fp32's).

Ops and passes run in each variant's precision as the trainer runs them: under ``amp_bf16``
autocast over the fp32 weights; under ``bf16_mixed`` no autocast, the kernels reading bf16
copies of the fp32 weights and a weight's gradient cast to fp32 as it flows into the parameter
(:func:`runtime.training.precision.computing_in`, Megatron-LM's scheme). Every timed row records
the precision it ran in (the profile's ``precision`` column), so a scenario whose variants train
in both keeps their bf16 timings in rows apart and the simulator prices each variant from its own
(:meth:`sim.profile.Profile.of_precision`). Statistics are over every rank's repeats (:func:`runtime.comm_timing.stats`). The profile also gets the context rows of
every rank of the layout and of the model it trained (:mod:`sim.context`), which the simulator
sets the whole passes against (:func:`sim.training.step_compute.calibrated_model`).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.accounting import head_op_costs, layer_op_costs
from models.shards import tensor_shards
from models.ops import OpKind
from models.training import (Precision, compute_dtype, head_backward_costs, layer_backward_costs,
                             optimizer_step_cost)
from runtime import memory_probe
from runtime.calibrate import backend_context
from runtime.comm import Communicator
from runtime.comm_timing import SIZES_BYTES, CollectiveSweep, stats
from runtime.device import device_of
from runtime.reduction_bench import reduction_rows
from runtime.training.model import DecoderLM, TensorParallel, next_token_loss, training_batch
from runtime.training.precision import bf16_copies, compute_weight, computing_in, refresh, stream_dtype
from runtime.training.ranks import TrainingRanks, training_ranks
from runtime.training.trainer import TrainingSetup, autocast, make_optimizer, process_groups
from runtime.worker import TORCH_DTYPES
from sim.collectives.registry import LIBRARY
from runtime.cpu_steal import load_during
from runtime.reference_timing import medians, timed_around
from runtime.testbed.cluster import applied_context
from sim.context import context_rows, load_rows, scenario_context, speed_rows
from sim.framework import Backend, backend_of
from sim.profile import profile_frame, with_rows
from sim.training.lower import scenario_reduction_dtypes, tp_allreduce_algorithm
from sim.training.step_compute import pass_costs
from sim.training_config import TrainingSettings
from sim.vocabulary import MeasurementKind

OPTIMIZER_SIZES = (1 << 16, 1 << 20)
"""Parameter counts each optimizer is timed at, besides the model's own."""

PASS_CALLS_PER_ROUND = 2
"""Timed calls of each whole pass per rank in each round of the calibration (``repeats`` rounds,
each before the collective sweep's round). A pass's timings taken back to back, a few seconds in
all, read the machine as it was in those seconds: six calibrations of v4x1_bandwidth (4 ranks
on 2 cores) on 2026-11-29 read the backward pass at micro batch 1 from 59 to 104 ms (means of 12
calls), where the same pass inside DDP's steps (the micro-batches accumulated under no_sync, no
allreduce beside them) took 71-112 ms (p10-p90), mean 87 (``validation/training-report/barrier-s27``,
its trace: 48 passes over the cluster's 4 accumulating cases without checkpointing).
Spread over the rounds, the calls sample the minutes the steps are measured over."""

BUCKET_CHAIN_CALLS = 4
"""Calls of a bucket size timed back to back per round of the data-parallel sweep: the buckets
after the first queue behind one another. Alone, a 1 MiB ring allreduce over 2 hosts x 2 ranks at
100 Mbit/s is bimodal (126 or about 160 ms) and in a chain costs 8% more than alone; the chain's
mean is what a step of many such buckets pays (``benchmarks/bench_chain_calls.py``)."""

_KEYS = ("measurement", "device_class", "op", "group_size", "batch_size", "new_tokens", "context_tokens",
         "size_bytes", "dtype", "precision", "flops", "traffic_bytes", "unit", "method")


def _at_once(tensor: int) -> str:
    """How a row's timings were taken, for its ``method``."""
    return "every data-parallel rank at once" if tensor == 1 else \
        f"every rank at once, the layer a {tensor}-way tensor-parallel shard without its allreduces"


def _together() -> None:
    """Every rank of the default process group lined up (a barrier; nothing without one): a step
    runs its whole passes and its optimizer on every rank at once, and a rank left to run on
    ahead of the others times its last calls on the cores they free while they catch up.
    Measured (the training matrix with and without, ``validation/training-report/barrier-s27``
    against the shipped run): the optimizer step over the model's parameters, 0.48-0.72 of its
    in-step time (median by cluster and accumulation) without, 0.60-0.96 with."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _timed(fn: Callable[[], object], repeats: int, synchronize: Callable[[], None], *,
           each_call: bool = False) -> list[float]:
    """``repeats`` timings of ``fn`` after one untimed call (s). The ranks line up
    (:func:`_together`) before the untimed call and, where ``each_call``, before each timed one:
    a step runs its optimizer on every rank at once, as its whole passes; an op's calls run back
    to back, as a pass runs them, each rank's beside the others' ops."""
    _together()
    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        if each_call:
            _together()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def _grad(output: torch.Tensor, inputs: list[torch.Tensor], upstream: torch.Tensor) -> Callable[[], object]:
    return lambda: torch.autograd.grad(output, inputs, upstream, retain_graph=True)


def op_cases(model: DecoderLM, micro_batch_size: int, sequence_length: int, precision: Precision,
             device: torch.device) -> dict[OpKind, tuple[Callable, Callable | None, Callable | None]]:
    """Per op kind, (forward call, input-gradient call or None, weight-gradient call or None) on
    ``model``'s layer 0 (whole, or a tensor-parallel shard) and head at ``[micro_batch_size,
    sequence_length]``, in ``precision`` as the trainer runs it: the inputs in the activations'
    dtype (:func:`runtime.training.precision.stream_dtype`), under its autocast; the forward
    records autograd's graph as a training forward does; the gradient calls are closures over one
    forward. Under ``bf16_mixed`` the calls must run inside
    :func:`runtime.training.precision.computing_in` of ``model``: the kernels then read the bf16
    copies, and a weight gradient is the copy's cast to the fp32 parameter's dtype, as the trainer's."""
    spec = model.spec
    m, t, h = micro_batch_size, sequence_length, spec.hidden_size
    layer = model.layers[0]
    generator = torch.Generator().manual_seed(0)
    stream = stream_dtype(precision)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, stream).requires_grad_()

    def case(forward, inputs: list, weights: list):
        def run():
            with autocast(precision, device):
                return forward(*inputs)

        out = run()
        upstream = torch.randn(out.shape, generator=generator).to(device, out.dtype)
        return (run, _grad(out, inputs, upstream) if inputs else None,
                _grad(out, weights, upstream) if weights else None)

    x = leaf(m, t, h)
    with autocast(precision, device):
        q, k, v = (a.detach().requires_grad_() for a in layer.qkv(x))
    rotary = model.rotary(t, device, stream)  # as DecoderLM.forward makes it
    head = model.embed if model.lm_head is None else model.lm_head
    tokens = torch.randint(0, spec.vocab_size, (m, t), generator=generator).to(device)
    return {
        OpKind.LAYERNORM: case(layer.attn_norm, [x], list(layer.attn_norm.parameters())),
        OpKind.QKV_PROJ: case(layer.qkv_proj, [x], list(layer.qkv_proj.parameters())),
        OpKind.ATTENTION: case(lambda *qkv: layer.attention(*qkv, rotary), [q, k, v], []),
        OpKind.OUT_PROJ: case(layer.o_proj, [leaf(m, t, layer.heads * spec.head_dim)],
                              list(layer.o_proj.parameters())),
        OpKind.MLP_UP: case(layer.mlp_up, [x], list(layer.up_proj.parameters())),
        OpKind.MLP_DOWN: case(layer.down_proj, [leaf(m, t, layer.down_proj.weight.shape[1])],
                              list(layer.down_proj.parameters())),
        OpKind.LM_HEAD: case(lambda a: F.linear(a, compute_weight(head)), [x], [head]),
        OpKind.EMBEDDING: case(lambda: model.embedding(tokens), [],
                               [p for p in (model.embed, model.pos_embed) if p is not None]),
    }


def timed_model(scenario, layout: TrainingRanks, rank: int, device: torch.device) -> DecoderLM:
    """The model ``rank`` trains, as the calibration times it: with tensor parallelism its shard
    (:class:`runtime.training.model.TensorParallel`) with no process group, so that its ops and
    passes run without the allreduces, which are timed apart; else the whole model."""
    tensor_parallel = None
    if layout.tensor > 1:
        tensor_parallel = TensorParallel(tensor_shards(scenario.model, layout.tensor)[rank % layout.tensor], None)
    return DecoderLM(scenario.model, seed=0, tensor_parallel=tensor_parallel).to(device)


def op_timings(scenario, setups: list[TrainingSetup], device_class: str, repeats: int,
               device: torch.device, heartbeat: Callable[[str], None], model: DecoderLM) -> list[dict]:
    """This rank's forward and backward timings on ``model`` (:func:`timed_model`), one row per
    op kind, pass (forward, input gradient, weight gradient) and distinct (micro batch,
    precision) of ``setups``, ``times`` holding its ``repeats`` timings (s). Each precision's ops
    run as the trainer runs them (:func:`op_cases`), its rows recording it (``precision``):
    ``amp_bf16`` and ``bf16_mixed`` both compute in bf16, their kernels apart (autocast casts the
    fp32 weights in every op; the bf16 copies are read as they are)."""
    synchronize = device_of(device).synchronize
    sequence = scenario.config.workload.sequence_length
    tensor = setups[0].tensor
    rows = []
    for micro, precision in dict.fromkeys((s.micro_batch_size, s.settings.precision) for s in setups):
        heartbeat(f"forward and backward per op at micro batch {micro}, {precision}")
        spec = scenario.model.with_dtype(compute_dtype(precision))
        costs = {**head_backward_costs(spec, batch_size=micro, sequence_length=sequence),
                 **layer_backward_costs(spec, tp_degree=tensor, batch_size=micro, sequence_length=sequence)}
        # The forward costs the simulator's training step gives each op (sim.training.lower).
        forward = {**head_op_costs(spec, batch_size=micro * sequence, new_tokens=1),
                   **layer_op_costs(spec, tp_degree=tensor, batch_size=micro, new_tokens=sequence,
                                    context_tokens=sequence)}
        with computing_in(model, precision):
            for kind, calls in op_cases(model, micro, sequence, precision, device).items():
                for measurement, call, cost in zip((MeasurementKind.COMPUTE, MeasurementKind.BACKWARD_INPUT,
                                                    MeasurementKind.BACKWARD_WEIGHT), calls,
                                                   (forward[kind], costs[kind].input_grad, costs[kind].weight_grad)):
                    if call is None:
                        continue
                    rows.append({"measurement": measurement, "device_class": device_class, "op": kind.value,
                                 "group_size": tensor, "batch_size": micro, "new_tokens": sequence,
                                 "context_tokens": sequence, "dtype": spec.dtype, "precision": precision.value,
                                 "flops": cost.flops,
                                 "traffic_bytes": cost.bytes_read + cost.bytes_written, "unit": "s",
                                 "method": ("the op's forward with autograd recording"
                                            if measurement == MeasurementKind.COMPUTE
                                            else "torch.autograd.grad of the op's inputs or weights alone")
                                           + f", on the training model's layer 0 or head, {_at_once(tensor)}",
                                 "times": _timed(call, repeats, synchronize)})
    return rows


def pass_timings(scenario, setups: list[TrainingSetup], device_class: str, repeats: int,
                 device: torch.device, heartbeat: Callable[[str], None], model: DecoderLM) -> list[dict]:
    """This rank's whole forward pass (to the loss) and backward pass (``loss.backward()``) of
    ``model`` (:func:`timed_model`), without DDP or any communication, per distinct (micro batch, precision)
    of ``setups``: one row per pass, ``times`` holding its ``repeats`` timings (s) after one
    untimed step. The simulator sets them against the sum of the same passes' ops timed alone
    (:mod:`sim.training.step_compute`): what a step adds to its ops (the autograd engine's
    scheduling, the loss, the gradients' accumulation)."""
    synchronize = device_of(device).synchronize
    sequence = scenario.config.workload.sequence_length
    tensor = setups[0].tensor
    rows = []
    for micro, precision in dict.fromkeys((s.micro_batch_size, s.settings.precision) for s in setups):
        heartbeat(f"whole forward and backward passes at micro batch {micro}, {precision}")
        batch = training_batch(scenario.model, micro, sequence, seed=0, step=0).to(device)
        times: dict[OpKind, list[float]] = {OpKind.FORWARD: [], OpKind.BACKWARD: []}
        with computing_in(model, precision):  # as the trainer computes (runtime.training.precision)
            for index in range(repeats + 1):
                model.zero_grad(set_to_none=True)
                synchronize()
                _together()  # a step's passes run on every rank at once
                start = time.perf_counter()
                with autocast(precision, device):
                    loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
                synchronize()
                middle = time.perf_counter()
                loss.backward()
                synchronize()
                if index:  # the first is untimed: the allocator's and autograd's first-call costs
                    times[OpKind.FORWARD].append(middle - start)
                    times[OpKind.BACKWARD].append(time.perf_counter() - middle)
        spec = scenario.model.with_dtype(compute_dtype(precision))
        costs = pass_costs(spec, TrainingSettings(precision=precision), micro, sequence, tensor)
        for kind, timed in times.items():
            rows.append({"measurement": MeasurementKind.TRAINING_PASS, "device_class": device_class, "op": kind.value,
                         "group_size": tensor, "batch_size": micro, "new_tokens": sequence, "context_tokens": sequence,
                         "dtype": spec.dtype, "precision": precision.value, "flops": costs[kind][0],
                         "traffic_bytes": costs[kind][1], "unit": "s",
                         "method": "the training model's whole pass (forward to the loss, or loss.backward()) without "
                                   f"DDP, {_at_once(tensor)}", "times": timed})
    model.zero_grad(set_to_none=True)
    return rows


def optimizer_timings(setups: list[TrainingSetup], device_class: str, shapes: list[torch.Size], repeats: int,
                      device: torch.device, heartbeat: Callable[[str], None]) -> list[dict]:
    """This rank's optimizer-step timings per distinct (optimizer, precision) of ``setups`` and
    parameter count (:data:`OPTIMIZER_SIZES`, one flat tensor each, and the model's own count),
    ``times`` in s.

    The model's count is timed over tensors of the model's own ``shapes`` (the rank's parameters,
    what its step updates), not one flat tensor: torch.optim's CPU optimizers loop over the
    parameters one tensor at a time (``foreach`` defaults to off for CPU tensors,
    ``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py``), each step's temporaries
    are the size of one tensor, and the ranks' allocator maps every block of
    :data:`runtime.memory_probe.FAST_MMAP_THRESHOLD_BYTES` or more afresh (page faults on each
    step) while it reuses smaller ones. Measured (one process, tiny GPT-2's 4.27M parameters in
    52 tensors of at most 4 MiB, AdamW): the model's tensors 56-69 ms a step, one flat tensor
    of the same count 110-119 ms.

    Under ``bf16_mixed`` each timed step also copies the fp32 masters into their bf16 copies
    (:meth:`runtime.training.precision.Bf16Copies.refresh`), as the trainer's optimizer phase
    does after every step and as :func:`models.training.optimizer_step_cost` counts the copy's
    bytes written."""
    synchronize = device_of(device).synchronize
    tensor = setups[0].tensor
    parameters = sum(shape.numel() for shape in shapes)
    rows = []
    for optimizer_kind, precision in dict.fromkeys((s.settings.optimizer, s.settings.precision) for s in setups):
        settings = TrainingSettings(optimizer=optimizer_kind, precision=precision)
        for count in sorted({*OPTIMIZER_SIZES, parameters}):
            heartbeat(f"{settings.optimizer} step over {count} parameters")
            generator = torch.Generator().manual_seed(0)
            weights = nn.ParameterList(nn.Parameter(torch.zeros(shape, device=device))
                                       for shape in (shapes if count == parameters else [torch.Size([count])]))
            for weight in weights:
                weight.grad = torch.randn(weight.shape, generator=generator).to(device)
            optimizer = make_optimizer(list(weights), settings)
            copies = bf16_copies(weights, settings.precision)  # bf16_mixed's, which each step refreshes

            def step():
                optimizer.step()
                refresh(copies)
            cost = optimizer_step_cost(count, optimizer=settings.optimizer, precision=settings.precision,
                                       gradient_dtype="fp32")
            what = "the model's parameter tensors" if count == parameters else "one tensor of fp32 parameters"
            rows.append({"measurement": MeasurementKind.OPTIMIZER_STEP, "device_class": device_class,
                         "op": settings.optimizer.value, "group_size": 1, "size_bytes": 4 * count, "dtype": "fp32",
                         "precision": settings.precision.value,
                         "flops": cost.flops, "traffic_bytes": cost.bytes_read + cost.bytes_written, "unit": "s",
                         "method": f"{settings.optimizer.value} step over {what}, size_bytes in all "
                                   f"({settings.precision.value} variants"
                                   + (", then the bf16 copies refreshed" if copies is not None else "")
                                   + f"), {_at_once(tensor)}",
                         "times": _timed(step, repeats, synchronize, each_call=True)})
    return rows


def sweep_algorithms(setups: list[TrainingSetup]) -> dict[OpKind, tuple[str, ...]]:
    """The collectives the variants' steps call over the data-parallel group, by kind (every kind
    named, an empty tuple for none): their buckets' (and parameter averages') allreduce
    algorithms, ZeRO-1's binomial broadcast."""
    return {OpKind.ALLREDUCE: tuple(dict.fromkeys(s.settings.allreduce for s in setups)), OpKind.REDUCE: (),
            OpKind.BROADCAST: ("binomial",) if any(s.settings.zero == 1 for s in setups) else ()}


def sweep_sizes(parameters: int) -> tuple[int, ...]:
    """The sweep's sizes (bytes) up to the first that holds ``parameters`` fp32 gradients."""
    largest = next((size for size in SIZES_BYTES if size >= 4 * parameters), SIZES_BYTES[-1])
    return tuple(size for size in SIZES_BYTES if size <= largest)


def tensor_parallel_sweep(scenario, setups: list[TrainingSetup],
                          backend: Backend) -> tuple[dict[OpKind, tuple[str, ...]], tuple[int, ...]]:
    """The tensor-parallel group's allreduces to time: by kind, the algorithms (the library's,
    which the model's ``f`` and ``g`` call, and what the simulator prices each variant's with,
    :func:`sim.training.lower.tp_allreduce_algorithm`); and the sizes (bytes): the sweep's up to
    the largest hidden state of a micro-batch, ``micro x sequence x hidden`` elements of each
    variant's compute dtype, and those hidden states themselves (the size of every such call).
    ``backend``: the ranks' (:func:`sim.framework.backend_of`), whose own allreduce is a
    variant's default."""
    spec, sequence = scenario.model, scenario.config.workload.sequence_length
    hidden = {s.micro_batch_size * sequence * spec.hidden_size * spec.with_dtype(compute_dtype(s.settings.precision)).dtype_bytes
              for s in setups}
    algorithms = (LIBRARY, *(tp_allreduce_algorithm(v, backend) for v in scenario.config.variants))
    # A swept call's tensor is fp32 (runtime.comm_timing.CollectiveSweep): whole 4-byte elements only.
    sizes = {size for size in SIZES_BYTES if size <= max(hidden)} | {size for size in hidden if size % 4 == 0}
    return ({OpKind.ALLREDUCE: tuple(dict.fromkeys(algorithms)), OpKind.REDUCE: (), OpKind.BROADCAST: ()},
            tuple(sorted(sizes)))


def framework_after_steps(setup: TrainingSetup, rank: int, topology, groups, device: torch.device) -> int:
    """What this rank holds beyond its tensors while it trains (bytes): a
    :class:`runtime.training.trainer.Trainer` of ``setup`` is built and trained as the measured
    ranks' are until their memory is read (:func:`runtime.training.memory.exact_step_memory`,
    :func:`runtime.training.measure.train_rank`), and the resident memory before the read step,
    less weights, optimizer states and buckets (:func:`runtime.training.memory.framework_bytes`),
    is the interpreter, torch's libraries and the kernels' pages training touched, the
    communication library's buffers and threads. Every rank of the layout calls it (its steps
    synchronise over the data-parallel group), before it trains anything else."""
    from runtime.training.memory import exact_step_memory, framework_bytes, state_bytes
    from runtime.training.trainer import Trainer

    trainer, memory = exact_step_memory(
        lambda: Trainer(setup, rank, topology.host_groups, seed=0, device=device, groups=groups), device_of(device))
    framework = framework_bytes(memory.resident_bytes, state_bytes(trainer))
    trainer.close()
    return framework


def calibrate_training_rank(scenario, topology, rank: int, *, repeats: int, device: torch.device,
                            max_call_s: float = 1.0, heartbeat: Callable[[str], None] = lambda label: None,
                            testbed: bool = False):
    """Time forward and backward per op, the optimizer steps, the buckets' collectives and
    (with tensor parallelism) the tensor-parallel allreduce on this rank; every rank's rows
    folded into the profile (:func:`sim.profile.profile_frame`) on rank 0, None elsewhere. Needs
    the default process group over every rank of the layout
    (:func:`runtime.training.ranks.training_ranks`). ``testbed``: the rank runs on the emulated
    testbed, whose links' buckets the context records (:func:`runtime.testbed.cluster.applied_context`)."""
    layout = training_ranks(scenario, topology)
    group = layout.data_group(rank)
    setups = [TrainingSetup.of_ranks(scenario, v, layout) for v in scenario.config.variants]
    device_class = topology.devices[rank].spec.name
    memory_probe.configure_allocator(exact=False)  # the measured runs' malloc settings (train_rank)
    groups = process_groups(layout, rank)
    baseline = {"measurement": MeasurementKind.MEMORY_BASELINE, "device_class": device_class, "group_size": 1,
                "unit": "bytes", "method": "resident memory of a training rank between steps beyond its weights, "
                                           "optimizer states and DDP buckets (runtime.training.memory)",
                "times": [float(framework_after_steps(setups[0], rank, topology, groups, device))]}
    model = timed_model(scenario, layout, rank, device)
    shapes = [p.shape for p in model.parameters()]  # the rank's: its shard and the replicated tensors
    parameters = sum(shape.numel() for shape in shapes)
    rows = ([baseline] + op_timings(scenario, setups, device_class, repeats, device, heartbeat, model)
            + optimizer_timings(setups, device_class, shapes, repeats, device, heartbeat))
    tensor_group, data_group = groups
    comm = Communicator(rank, topology.host_groups, {} if layout.tensor == 1 else
                        {layout.tensor_group(rank): tensor_group, group: data_group})
    # Rank 0's groups sweep; every other rank sweeps alike in a group of its own, whose calls are
    # no-ops (runtime.comm.Communicator), so that the sweep's agreements over every rank line up.
    def alone(ranks: tuple[int, ...]) -> tuple[int, ...]:
        return ranks if 0 in ranks else (rank,)

    sweeps = []
    if layout.data > 1:
        sweeps.append(CollectiveSweep(alone(group), topology, rank, comm, max_call_s, heartbeat,
                                      sizes=sweep_sizes(parameters), algorithms=sweep_algorithms(setups),
                                      chain=BUCKET_CHAIN_CALLS))
    if layout.tensor > 1:
        algorithms, sizes = tensor_parallel_sweep(scenario, setups, backend_of(topology.devices[rank].spec))
        sweeps.append(CollectiveSweep(alone(layout.tensor_group(rank)), topology, rank, comm, max_call_s, heartbeat,
                                      sizes=sizes, algorithms=algorithms))
    for index in range(repeats):
        rows += pass_timings(scenario, setups, device_class, PASS_CALLS_PER_ROUND, device, heartbeat, model)
        for sweep in sweeps:
            sweep.round(f"round {index + 1} of {repeats}")
    del model
    sweep_rows = [row for sweep in sweeps for row in sweep.rows()]  # rank 0's: it leads both groups
    if rank == 0:  # alone: the other ranks wait in the gather below
        heartbeat("timing the reduction of received buffers, alone")
        for dtype in scenario_reduction_dtypes(scenario, layout.tensor):
            sweep_rows += reduction_rows(device_class, dtype, TORCH_DTYPES[dtype], device)
    gathered = [None] * len(layout.ranks) if rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if rank != 0:
        return None
    pooled = defaultdict(list)
    for part in gathered:
        for row in part:
            pooled[tuple(row.get(k) for k in _KEYS)] += row["times"]
    merged = [{**{k: v for k, v in zip(_KEYS, key) if v is not None}, **stats(times)} for key, times in pooled.items()]
    context = scenario_context(scenario.name, topology, layout.ranks, "fp32", cores=len(os.sched_getaffinity(0)),
                               backend=backend_context(), torch_version=torch.__version__, model=scenario.model)
    merged += sweep_rows + context_rows(applied_context(context) if testbed else context)
    return profile_frame(merged)


def calibrate_training(scenario, *, testbed: bool = False, repeats: int = 5, max_call_s: float = 1.0,
                       hang_timeout_s: float = 300.0, on_beat: Callable[[int, str], None] | None = None):
    """``hetsim calibrate`` of a training scenario on this machine: one forked rank per rank of
    its layout, tensor x data (in the testbed's namespaces if ``testbed``). ``max_call_s``: the
    collective sweep stops growing a size once a call takes longer (s).

    Returns:
        The profile table (:func:`sim.profile.profile_frame`), with the load the launch ran
        under (:func:`runtime.cpu_steal.load_during`) and the machine's speed around it
        (:func:`runtime.reference_timing.timed_around`).

    Raises:
        ConfigError: what :class:`runtime.training.trainer.TrainingSetup` refuses; testbed not up.
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    from runtime.launch import launch
    from runtime.measure import placements_for
    from sim.topology import build_topology

    topology = build_topology(scenario.config.cluster)
    layout = training_ranks(scenario, topology)
    for variant in scenario.config.variants:
        TrainingSetup.of_ranks(scenario, variant, layout)
    placements, enter = placements_for(scenario, topology, layout.ranks, testbed)

    def body(rank: int, heartbeat):
        return calibrate_training_rank(scenario, topology, rank, repeats=repeats, device=torch.device("cpu"),
                                       max_call_s=max_call_s, heartbeat=heartbeat, testbed=testbed)

    (gathered, spent), reference = timed_around(lambda: load_during(lambda: launch(
        body, len(layout.ranks), placements=placements, hang_timeout_s=hang_timeout_s, enter_namespace=enter,
        on_beat=on_beat)))
    return with_rows(gathered[0], load_rows(scenario.name, spent.steal_fraction, spent.other_load)
                     + speed_rows(scenario.name, medians(reference)))
