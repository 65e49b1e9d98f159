"""``hetsim measure`` of a training scenario: every variant trained with real DDP, step by step.

Each variant in turn, in ranks forked for it alone (one per rank of the layout, tensor x data:
:func:`runtime.launch.launch`, in the testbed's host namespaces with ``--testbed``;
:class:`runtime.training.ranks.TrainingRanks`), so that no variant's memory holds what an
earlier one's training left resident. On every rank, first the memory: a
:class:`~runtime.training.trainer.Trainer` (the same seeded weights) built and trained under the
exact allocator until one step's high-water mark is read as the peak memory
(:func:`runtime.training.memory.exact_step_memory`: :mod:`runtime.memory_probe` on the CPU,
``max_memory_allocated`` on CUDA), written with that step's memory by category beside it
(``peak_memory_<category>_bytes``, :mod:`runtime.training.memory`), then dropped; then the time:
a new trainer, in the fast allocator, ``warmup`` untimed optimizer steps (the first also
rebuilds DDP's buckets in the order gradients became ready), one common start on the shared
clock (:func:`runtime.worker.common_start`) and ``repeats`` x ``workload.steps`` timed steps back
to back (with ``interleave``, all variants timed in one launch after their memory, one step of
each in turn: ``_timed``). The memory comes first because the fast allocator's steps leave free chunks in the heap
that an exact read would count again (:mod:`runtime.training.memory`); a process that trains
several variants (``variants`` of :func:`train_rank`, as ``torchrun`` does) reads every
variant's before it times any.

Metrics, per repeat from the master's (rank 0's) ``workload.steps`` steps, then the median over
repeats with p10 / p90 beside it (:func:`runtime.measure.summarise`):

* ``step_time_s``: mean optimizer step (first forward to the end of the optimizer step, or of the
  parameter average where there is one); ``samples_per_s`` and ``tokens_per_s``: the global batch's
  sequences and tokens over it;
* ``forward_s``, ``backward_s``, ``optimizer_s``: per step, the micro-batches' forward passes, their
  backward passes and the optimizer step. A backward pass counts from its start to its last
  gradient computed: where it synchronises, to its last bucket's ready time (DDP calls the hook
  once a bucket's last gradient is computed, and the last bucket holds the pass's last gradient),
  not to the end of ``loss.backward()``, which waits for the last allreduce (that wait is
  exposed communication); recomputation under checkpointing is in it. The simulator's
  ``backward_s`` is the same span (:mod:`sim.training.metrics`);
* ``exposed_communication_s``: communication not hidden behind compute: in each backward pass that
  synchronises, from the moment its last bucket became ready (the pass's last gradient) to the
  end of its last allreduce, plus the parameter average, which nothing overlaps;
* ``overlap_ratio``: the share of the buckets' communication time (the union of their allreduces'
  spans) that ran while backward still computed, 1 - exposed / communication; absent where no
  gradient is communicated (parameter averaging, one rank);
* ``tcp_retransmitted_segments_per_step``, per device: the TCP segments the rank's host
  retransmitted over the timed steps, per step (:mod:`runtime.tcp_counters`; the host's, not the
  rank's alone, where a host runs several; absent where Linux's counters cannot be read). Not
  simulated: whether a case's buckets ran slower than their isolated timings because TCP lost
  packets;
* ``dropped_packets_per_step``, per device, in the testbed: the packets the tbf queues of the
  rank's host (uplink, downlink, ``lo``) dropped over the timed steps, per step
  (:func:`runtime.testbed.shaping.dropped_packets`). Not simulated: a case measured with drops
  carries a loss the testbed's queues made.

The trace (:mod:`sim.trace`): per rank, each micro-batch's forward and backward and the optimizer
step on the compute stream, each bucket's allreduce (``bucket i``, its bytes) and the parameter
average on the comm stream, for the last repeat's steps; a ``training`` step row per step.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import pandas as pd

from models.ops import OpKind
from runtime.measure import MeasuredResult, MeasuredVariant, placements_for, summarise
from sim.metrics import peak_memory_bytes, result_rows
from sim.program import Stream
from sim.scenario import Scenario
from sim.topology import Topology, build_topology
from sim.training.simulate import MEMORY_CATEGORIES
from sim.trace import STEP_COLUMNS, Trace, TraceEvent, op_table, peak_table
from sim.vocabulary import Metric, PhaseKind


@dataclass(frozen=True)
class RankTraining:
    """What one rank measured for one variant: its timed steps
    (:class:`runtime.training.trainer.StepTiming`, times in s from the common start), the peak
    memory of the step read before them (bytes, :func:`runtime.training.memory.exact_step_memory`)
    and that step's memory by category (:func:`runtime.training.memory.memory_categories`, bytes by field of
    :class:`models.training.TrainingMemory`); ``retransmitted_segments``: the TCP segments its
    host's network namespace retransmitted over the timed steps (:mod:`runtime.tcp_counters`;
    None where they cannot be read); ``dropped_packets``: the packets its host's tbf queues dropped
    over the timed steps (:func:`runtime.testbed.shaping.dropped_packets`; None outside the
    testbed)."""

    rank: int
    variant: str
    steps: list
    peak_memory_bytes: int
    memory: dict[str, int]
    retransmitted_segments: int | None = None
    dropped_packets: int | None = None


def step_metrics(steps: list, global_batch_size: int, sequence_length: int) -> dict[str, float]:
    """The run metrics of consecutive optimizer steps of one rank (see the module): means per step."""
    n = len(steps)
    step_s = sum(s.end_s - s.start_s for s in steps) / n
    exposed, communicated = [], []
    backward_s = 0.0  # to each pass's last gradient (the module docstring)
    for s in steps:
        averaging = s.averaging[1] - s.averaging[0] if s.averaging else 0.0
        # A backward pass that synchronises (every one without no_sync) waits for its own buckets.
        bucket_exposed = 0.0
        for start, end in s.backward:
            mine = [b for b in s.buckets if start <= b.ready_s <= end]
            if mine:
                last_ready = max(b.ready_s for b in mine)
                bucket_exposed += max(0.0, max(b.end_s for b in mine) - last_ready)
                end = last_ready
            backward_s += end - start
        if s.buckets:
            communicated.append((bucket_exposed, _union_s([(b.start_s, b.end_s) for b in s.buckets])))
        exposed.append(bucket_exposed + averaging)
    metrics = {
        Metric.STEP_TIME: step_s,
        Metric.SAMPLES_PER_S: global_batch_size / step_s,
        Metric.TOKENS_PER_S: global_batch_size * sequence_length / step_s,
        Metric.FORWARD_TIME: sum(e - b for s in steps for b, e in s.forward) / n,
        Metric.BACKWARD_TIME: backward_s / n,
        Metric.OPTIMIZER_TIME: sum(s.optimizer[1] - s.optimizer[0] for s in steps) / n,
        Metric.EXPOSED_COMMUNICATION: sum(exposed) / n,
    }
    total = sum(c for _, c in communicated)
    if total > 0:
        metrics[Metric.OVERLAP_RATIO] = max(0.0, 1.0 - sum(e for e, _ in communicated) / total)
    return metrics


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans`` (s)."""
    total, reach = 0.0, -np.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def training_trace(measured: dict[int, RankTraining], steps_per_repeat: int) -> Trace:
    """The trace of the last repeat's steps on every rank (see the module)."""
    events = []
    for rank, m in sorted(measured.items()):
        for s in m.steps[-steps_per_repeat:]:
            def event(stream, kind, name, span, size=0.0):
                return TraceEvent(rank, stream.value, kind.value, name, PhaseKind.TRAINING.value, s.step, -1,
                                  span[0], span[1], float(size), 0.0)

            for j, (forward, backward) in enumerate(zip(s.forward, s.backward)):
                events.append(event(Stream.COMPUTE, OpKind.FORWARD, f"forward {j}", forward))
                events.append(event(Stream.COMPUTE, OpKind.BACKWARD, f"backward {j}", backward))
            events.append(event(Stream.COMPUTE, OpKind.OPTIMIZER_STEP, "optimizer step", s.optimizer))
            for b in sorted(s.buckets, key=lambda b: b.start_s):
                events.append(event(Stream.COMM, OpKind.ALLREDUCE, f"bucket {b.index}", (b.start_s, b.end_s),
                                    b.size_bytes))
            if s.averaging:
                events.append(event(Stream.COMM, OpKind.ALLREDUCE, "parameter average", s.averaging))
    master = measured[min(measured)]
    last = master.steps[-steps_per_repeat:]
    steps = pd.DataFrame({"step": [s.step for s in last], "phase": PhaseKind.TRAINING.value,
                          "start_s": [s.start_s for s in last], "end_s": [s.end_s for s in last],
                          "stall_s": 0.0}, columns=STEP_COLUMNS)
    ops = op_table(events).sort_values(["rank", "start_s"], kind="stable").reset_index(drop=True)
    return Trace(ops, steps, pd.DataFrame(columns=["rank", "time_s", "bytes"]),
                 peak_table({r: m.peak_memory_bytes for r, m in measured.items()}))


def measured_training(scenario: Scenario, topology: Topology, gathered: list[list[RankTraining]],
                      repeats: int) -> MeasuredResult:
    """Fold every rank's measurements (``gathered[rank][variant]``) into a :class:`MeasuredResult`."""
    workload = scenario.config.workload
    ranks = tuple(sorted(m[0].rank for m in gathered))
    variants, tables = [], []
    for v_index, variant in enumerate(scenario.config.variants):
        measured = {m[v_index].rank: m[v_index] for m in gathered}
        master = measured[ranks[0]].steps
        per_repeat = [step_metrics(master[r * workload.steps:(r + 1) * workload.steps], workload.global_batch_size,
                                   workload.sequence_length) for r in range(repeats)]
        timing = summarise(per_repeat)
        trace = training_trace(measured, workload.steps)
        peaks = peak_memory_bytes(trace)
        memory = {topology.devices[r].name: {Metric.PEAK_MEMORY: peaks[r]} | {
            metric: measured[r].memory[field] for metric, field in MEMORY_CATEGORIES.items()} | (
            {} if measured[r].retransmitted_segments is None else
            {Metric.TCP_RETRANSMITTED_SEGMENTS: measured[r].retransmitted_segments / len(measured[r].steps)}) | (
            {} if measured[r].dropped_packets is None else
            {Metric.DROPPED_PACKETS: measured[r].dropped_packets / len(measured[r].steps)})
            for r in ranks}
        variants.append(MeasuredVariant(variant.name, trace, timing, np.zeros((0,), dtype=np.int64)))
        tables.append(result_rows(scenario.name, variant.name, "measured", timing, memory))
    return MeasuredResult(scenario, topology, ranks, tuple(variants), pd.concat(tables, ignore_index=True))


def train_rank(scenario: Scenario, topology: Topology, rank: int, *, repeats: int, warmup: int, seed: int,
               device, heartbeat=lambda label: None, variants: tuple[int, ...] | None = None,
               read_memory: bool = True, timing: bool = True, interleave: bool = False) -> list | None:
    """Train and time the variants of indices ``variants`` (None: every one) on this rank (see
    the module: every variant's memory is read before any is timed); all ranks' measurements
    ``[rank][variant]`` on rank 0, None elsewhere. Needs the default process group of the
    layout's ranks (:func:`runtime.training.ranks.training_ranks`). ``read_memory`` / ``timing``:
    read the memory (else 0 and no categories) / time the steps (else none); ``interleave``:
    time the variants' steps in turn, one step of each, all trainers alive (:func:`measure_training`),
    each variant's TCP and tbf counters the timed window's share per variant."""
    import torch.distributed as dist

    from runtime import memory_probe
    from runtime.device import device_of
    from runtime.training.memory import exact_step_memory, memory_categories, state_bytes
    from runtime.training.ranks import training_ranks
    from runtime.training.trainer import Trainer, TrainingSetup, process_groups

    memory_probe.configure_allocator(exact=False)
    layout = training_ranks(scenario, topology)
    groups = process_groups(layout, rank)
    steps = scenario.config.workload.steps
    probe = device_of(device)
    chosen = scenario.config.variants if variants is None else [scenario.config.variants[i] for i in variants]
    setups = [TrainingSetup.of_ranks(scenario, variant, layout) for variant in chosen]

    def trainer(setup: TrainingSetup) -> Trainer:
        return Trainer(setup, rank, topology.host_groups, seed=seed, device=device, groups=groups)

    read = []  # every variant's memory before any step in the fast allocator (see the module)
    for setup in setups:
        if not read_memory:
            read.append((0, {}))
            continue
        heartbeat(f"{setup.name} memory")
        # Numbered after the timed steps, as the read step was when it came last.
        memory_trainer, memory = exact_step_memory(partial(trainer, setup), probe, first_step=warmup + repeats * steps)
        read.append((memory.peak_bytes,
                     memory_categories(memory.resident_bytes, memory.peak_bytes, state_bytes(memory_trainer))))
        memory_trainer.close()
        del memory_trainer
        gc.collect()
    if not timing:
        out = [RankTraining(rank, setup.name, [], peak, categories) for setup, (peak, categories) in zip(setups, read)]
    elif interleave:
        out = _timed(setups, read, trainer, rank, repeats * steps, warmup, probe, heartbeat)
    else:  # one variant after another, each from a common start of its own
        out = [timed for setup, memory in zip(setups, read)
               for timed in _timed([setup], [memory], trainer, rank, repeats * steps, warmup, probe, heartbeat)]
    heartbeat("gather")
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    return gathered if rank == 0 else None


def _timed(setups, read, trainer, rank: int, count: int, warmup: int, probe, heartbeat) -> list[RankTraining]:
    """Every variant of ``setups`` timed for ``count`` steps, one step of each in turn (after
    ``warmup`` untimed steps of each), from one common start, with its memory ``read`` beside it;
    the TCP and tbf counters over the timed window shared equally among the variants. With
    several variants, they are compared over the same stretch of the machine's load, which
    variants timed one after another are not (the 2-core testbed's overlap gain of one cluster,
    blocked in launches of their own, 1.014 in two runs days apart and 1.050 in a third;
    interleaved 1.050 and 1.061)."""
    from runtime.tcp_counters import retransmitted_segments
    from runtime.testbed.shaping import dropped_packets
    from runtime.worker import common_start

    trainers = [trainer(setup) for setup in setups]
    for setup, each in zip(setups, trainers):
        for step in range(warmup):
            heartbeat(f"{setup.name} warm-up step {step}")
            each.step(step)
    t0 = common_start(probe.torch_device)
    timed = [[] for _ in setups]
    retransmitted, dropped = retransmitted_segments(), dropped_packets()
    which = setups[0].name if len(setups) == 1 else "each variant, in turn"
    for index in range(count):
        heartbeat(f"{which}: step {index + 1} of {count}")
        for steps, each in zip(timed, trainers):
            steps.append(_shifted(each.step(warmup + index), t0))
    after, dropped_after = retransmitted_segments(), dropped_packets()
    share = len(setups)
    retransmitted = None if retransmitted is None or after is None else (after - retransmitted) / share
    dropped = None if dropped is None or dropped_after is None else (dropped_after - dropped) / share
    for each in trainers:
        each.close()
    del trainers
    gc.collect()
    return [RankTraining(rank, setup.name, steps, peak, categories, retransmitted, dropped)
            for setup, steps, (peak, categories) in zip(setups, timed, read)]


def _shifted(timing, t0: float):
    """``timing`` with every time in s from ``t0``."""
    def span(pair):
        return (pair[0] - t0, pair[1] - t0)

    return replace(timing, start_s=timing.start_s - t0, end_s=timing.end_s - t0,
                   forward=[span(p) for p in timing.forward], backward=[span(p) for p in timing.backward],
                   optimizer=span(timing.optimizer), averaging=span(timing.averaging) if timing.averaging else None,
                   buckets=[replace(b, ready_s=b.ready_s - t0, start_s=b.start_s - t0, end_s=b.end_s - t0)
                            for b in timing.buckets])


def measure_training(scenario: Scenario, *, repeats: int = 5, warmup: int = 1, seed: int = 0, testbed: bool = False,
                     hang_timeout_s: float = 120.0, interleave: bool = False) -> MeasuredResult:
    """Measure every variant of the training ``scenario`` on this machine: one forked rank per
    rank of its layout (tensor x data), inside the testbed's host namespaces when ``testbed``.
    With ``interleave``, each variant's memory is read in ranks of its own as without it, and
    then every variant is timed in one launch, one step of each in turn (`_timed`):
    every variant's trainer is alive at once there, so the machine must hold them all.

    Raises:
        ConfigError: what :class:`runtime.training.trainer.TrainingSetup` refuses, or ``testbed``
            while the scenario's testbed is not up.
        runtime.errors.LaunchError: a rank failed, died or hung (the message names it).
    """
    import torch

    from runtime.launch import launch
    from runtime.training.ranks import training_ranks
    from runtime.training.trainer import TrainingSetup

    topology = build_topology(scenario.config.cluster)
    layout = training_ranks(scenario, topology)
    for variant in scenario.config.variants:  # refused here, before any rank starts
        TrainingSetup.of_ranks(scenario, variant, layout)
    placements, enter = placements_for(scenario, topology, layout.ranks, testbed)

    # Each variant in ranks of its own: a process keeps resident what an earlier variant's
    # training left (heap pages, caches), which read as the next variant's memory (+8 to +40 MB
    # per variant on the validation model, tiny_gpt2 over 4 gloo ranks).
    gathered = [[] for _ in layout.ranks]

    def run(**kwargs) -> list:
        def body(rank: int, heartbeat):
            return train_rank(scenario, topology, rank, repeats=repeats, warmup=warmup, seed=seed,
                              device=torch.device("cpu"), heartbeat=heartbeat, **kwargs)

        return launch(body, len(layout.ranks), placements=placements, hang_timeout_s=hang_timeout_s,
                      enter_namespace=enter)[0]

    for index in range(len(scenario.config.variants)):
        for rank, measured in enumerate(run(variants=(index,), timing=not interleave)):
            gathered[rank] += measured
    if interleave:
        for rank, timed in enumerate(run(read_memory=False, interleave=True)):
            gathered[rank] = [replace(t, peak_memory_bytes=m.peak_memory_bytes, memory=m.memory)
                              for m, t in zip(gathered[rank], timed)]
    return measured_training(scenario, topology, gathered, repeats)
