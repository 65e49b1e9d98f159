"""``hetsim calibrate``: microbenchmarks on the scenario's cluster, written as a profile.

Every measurement runs in the same forked ranks, over the same process group, as a real
measurement, so it sees the same CPU sharing, framework and links (on a real cluster, in the
ranks torchrun starts: :mod:`runtime.torchrun`):

* generations: the executor generates with the scenario's model at a grid of prompt lengths, once
  per distinct strategy of the scenario's variants (:func:`calibration_strategies`), each
  generation started at one instant on the shared clock. From their op records:

  * ``compute`` and ``op_gap``: each compute op is timed in place, and the gap between
    consecutive ops of a rank is the framework's dispatch time. Rows are statistics over ranks
    of one device type, strategies, layers and repeats, per op kind and shape;
  * ``collective_in_place`` and ``collective_wait``: each collective call as the master sees it,
    from the last rank's start to its own end, and its wait for that start
    (:func:`runtime.comm_timing.in_place_rows`), per plan op, kind, algorithm and size.
* ``collective``: every algorithm the registry knows for each kind (and ``library``), in
  isolation over the scenario's tensor-parallel group, at 1 KiB x 4^k up to 64 MiB
  (:class:`runtime.comm_timing.CollectiveSweep`), in rounds that take turns with the generations';
  where the group spans hosts, over the first host's ranks too (``num_hosts`` 1), which price a
  collective inside a host (:func:`sim.transport.fit_intra_host`).
* ``compute_isolated``: the model's compute ops at each tensor-parallel width up to the group's,
  timed alone on the first rank while the others wait (:mod:`runtime.shape_bench`): what an op
  of another shard shape costs on a core of its own; decode steps also at batch sizes 1, 2, 4 and
  the powers of two up to the scenario's (:func:`runtime.shape_bench.decode_batch_sizes`), which
  a plan's replicas run.
* ``reduction``: the reduction the runtime's own collectives perform, a received buffer added into
  the local one in the model's dtype, timed alone on the first rank at 64 KiB to 64 MiB
  (:mod:`runtime.reduction_bench`, under a second): what the simulator's reduction cost per byte,
  gamma, is fitted on (:mod:`sim.reduction`).
* ``p2p``: ping-pong between rank 0 and a rank on its host and on another host (half the round
  trip), 1 KiB to 4 MiB.
* ``context``: what all this was measured on (:mod:`sim.context`): device types, ranks per host,
  the cores the ranks share, each link class's rate and delay, backend and transport, torch
  version, and the load of the machine over the launch (hypervisor steal and other processes'
  share of its CPU time, :func:`runtime.cpu_steal.load_during`); on CPU ranks, the machine's
  aggregate memory bandwidth with 1 .. ranks one-thread processes streaming at once, after the
  launch (:func:`runtime.stream_bandwidth.stream_bandwidth`, up to 3 rounds, ~12 s for 4 ranks);
  and the machine's speed: a fixed reference op set timed just before and just after the launch
  (:func:`runtime.reference_timing.timed_around`, under 1 s), against which a later measurement's
  own timing tells how much faster or slower the machine ran then (:mod:`sim.machine_speed`).
* ``collective_loopback``: on CPU ranks, after the launch, the in-place calls' kinds and algorithms
  at their smallest size again, in a loopback gloo group computing between calls, at a few sizes
  beyond the cores (:mod:`runtime.loopback_contention`, ~5 s a size): the machine's delay per core
  turn on a small message, which links with a delay hide in place.
* ``memory_baseline``: what a rank holds beyond its model: its peak resident memory in one more,
  untimed generation at the shortest prompt with the exact allocator (:mod:`runtime.memory_probe`),
  less its weights and KV cache (framework, communication buffers, activations), read before the
  collective sweep.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime import memory_probe
from runtime.blocks import BlockLoader
from runtime.comm import Communicator
from runtime.comm_timing import CallSpan, CollectiveSweep, in_place_rows, p2p_rows, stats
from runtime.device import device_of
from runtime.executor import Executor
from runtime.loopback_contention import bridged_rows, loopback_rows
from runtime.reduction_bench import reduction_rows
from runtime.shape_bench import ceiling_rows, shape_rows
from runtime.stream_bandwidth import stream_bandwidth
from runtime.weights import prompt_tokens
from runtime.worker import TORCH_DTYPES, common_start, rank_model
from sim.collectives.registry import ALGORITHMS, AUTO, LIBRARY
from runtime.cpu_steal import load_during
from runtime.reference_timing import medians, timed_around
from runtime.testbed.cluster import applied_context
from sim.context import context_rows, load_rows, memory_rows, profile_contexts, scenario_context, speed_rows
from sim.parallel import ParallelPlan
from sim.plan import Plan
from sim.profile import MeasurementKind, profile_frame, with_rows
from sim.strategies import STRATEGIES, StrategyChoice
from sim.transport import Transport

CALIBRATION_PROMPTS = (8, 32, 128)
CALIBRATION_OUTPUT_TOKENS = 4
CALIBRATION_MAX_TOKENS = max(CALIBRATION_PROMPTS) + CALIBRATION_OUTPUT_TOKENS  # the KV cache its model needs


def calibrate_rank(scenario, topology, rank: int, *, repeats: int, max_call_s: float,
                   heartbeat: Callable[[str], None], used_only: bool = False,
                   held_out_sizes: tuple[int, ...] = (), testbed: bool = False,
                   device: torch.device = torch.device("cpu")) -> list[dict] | None:
    """Run every microbenchmark on this rank; returns all profile rows on rank 0, None elsewhere.

    ``repeats`` rounds, each one calibration generation per strategy and prompt
    (:class:`CalibrationGenerations`) and one call of every case of the collective sweep
    (:class:`runtime.comm_timing.CollectiveSweep`), after a warm-up round of generations; then
    the point-to-point ping-pongs; then the ``compute_isolated`` and ``reduction`` rows, on the
    first rank alone.
    ``held_out_sizes``: collective sizes timed in the sweep's
    rounds as ``collective_held_out`` rows; ``testbed``: the rank runs on the emulated testbed,
    whose links' buckets the profile's context records (:func:`runtime.testbed.cluster.applied_context`);
    ``device``: where the rank's model runs (``cuda:N`` on a GPU, whose process group is NCCL's)."""
    memory_probe.configure_allocator(exact=False)  # the measured runs' malloc settings (run_rank)
    parallel = ParallelPlan.of(scenario, topology)
    ranks = parallel.tensor_ranks
    comm = Communicator(rank, topology.host_groups)
    model, store = rank_model(scenario, tuple(ranks), rank, seed=0, max_tokens=CALIBRATION_MAX_TOKENS,
                              device=device, shards=parallel.shards)
    # A model built from block files (when the scenario streams) is loaded whole before timing.
    generations = CalibrationGenerations(scenario, ranks, topology, rank, comm, model,
                                         BlockLoader(store, model.device) if store is not None else None, heartbeat,
                                         shards=parallel.shards)
    generations.round(0, timed=False)  # warms up
    # The memory baseline is read from one more generation, before the collective sweep's large
    # buffers raise this process's high-water mark.
    framework_bytes = generations.framework_bytes()
    sweep = CollectiveSweep(ranks, topology, rank, comm, max_call_s, heartbeat,
                            algorithms=used_algorithms(scenario) if used_only else None, held_out=tuple(held_out_sizes),
                            one_host=True)
    # The generations and the sweep take turns, so that both sample the same stretch of a shared
    # machine's time (hetsim validate interleaves the measured generations too: runtime.interleaved).
    for index in range(repeats):
        generations.round(index + 1, timed=True)
        sweep.round(f"round {index + 1} of {repeats}")
    rows = sweep.rows() + p2p_rows(ranks, topology, rank, repeats, heartbeat) + alone_rows(scenario, generations, model)
    return gather_profile(generations, framework_bytes, rows, testbed)


def alone_rows(scenario, generations: "CalibrationGenerations", model) -> list[dict]:
    """The ``compute_isolated`` rows (every op at every shard width), on a GPU its two ceilings, and
    the ``reduction`` rows, timed on the group's first rank while the others wait, asleep, in a
    barrier; [] on the other ranks. Every rank of the group calls it (it ends in the barrier).
    What a calibration times alone, whichever launch runs it (:func:`calibrate_rank`,
    :func:`runtime.interleaved.interleaved_rank`): the rows an op of another shard shape or layout
    is priced by (:meth:`sim.calibrated.CalibratedCompute._by_shape`) and the reduction's gamma
    (:mod:`sim.reduction`)."""
    heartbeat, rows = generations.heartbeat, []
    if generations.rank == generations.ranks[0]:
        dtype = TORCH_DTYPES[scenario.model.dtype]
        heartbeat("timing the compute ops at each shard width, alone")
        rows += shape_rows(scenario.model, device_class=generations.device_class, batch_size=generations.batch,
                           prompts=CALIBRATION_PROMPTS, max_tokens=CALIBRATION_MAX_TOKENS,
                           ranks=len(generations.ranks), dtype=dtype, device=model.device)
        if model.device.type == "cuda":
            rows += ceiling_rows(generations.device_class, scenario.model.dtype, dtype, model.device)
        heartbeat("timing the reduction of received buffers, alone")
        rows += reduction_rows(generations.device_class, scenario.model.dtype, dtype, model.device)
    dist.barrier()
    return rows


def machine_rows(scenario, profile, repeats: int, testbed: bool = False) -> list[dict]:
    """What a calibration times of the machine after its launch, outside the ranks, where they
    ran on this machine's CPU (:func:`runtime.device.local_device`) and shared it ([] where a GPU
    holds them): its aggregate memory bandwidth at 1 .. ranks streams (``context`` memory rows,
    :func:`runtime.stream_bandwidth.stream_bandwidth`), and the in-place calls of ``profile`` (the
    launch's rows) again on loopback at a few group sizes beyond the cores the ranks shared,
    where the cores' delay on a small message shows without the links' (``collective_loopback``
    rows, :mod:`runtime.loopback_contention`), and where the launch ran on the testbed
    (``testbed``), the same between namespaces on a bridge without delay, the emulated
    inter-host path (``collective_bridged`` rows). The ranks and cores are those the launch's
    context rows record (:func:`gather_profile`)."""
    if torch.cuda.is_available():
        return []
    (context,) = profile_contexts(profile)
    ranks = sum(context.ranks_per_host)
    rows = (memory_rows(scenario.name, stream_bandwidth(ranks, rounds=min(3, max(1, repeats))))
            + loopback_rows(profile, context.cores, ranks))
    if testbed:
        rows += bridged_rows(profile, context.cores, ranks, scenario.name, context.devices[0][0])
    return rows


def gather_profile(generations: "CalibrationGenerations", framework_bytes: int, rows: list[dict],
                   testbed: bool = False):
    """Gather every rank's calibration rows on the group's first rank and fold them into the
    profile table (:func:`sim.profile.profile_frame`); None on the other ranks.

    Args:
        generations: this rank's calibration generations, their rounds done.
        framework_bytes: this rank's memory beyond its model (:meth:`CalibrationGenerations.framework_bytes`).
        rows: this rank's other rows (the collective sweep's and p2p, on the first rank).
        testbed: whether the ranks ran on the emulated testbed (its links' applied buckets recorded).
    """
    ranks = generations.ranks
    samples = [None] * len(ranks)
    dist.all_gather_object(samples, (generations.device_class, framework_bytes))
    by_class = defaultdict(list)
    for cls, value in samples:
        by_class[cls].append(value)
    rows = generations.rows() + rows
    for cls, values in by_class.items():
        rows.append({"measurement": MeasurementKind.MEMORY_BASELINE, "device_class": cls, "unit": "bytes",
                     "method": "peak resident set size of an untimed generation at the shortest prompt "
                               "(exact allocator), less the model's weights and KV cache (framework, "
                               "communication buffers, activations)",
                     **stats(values)})
    gathered = [None] * len(ranks) if generations.rank == ranks[0] else None
    dist.gather_object((rows, generations.spans), gathered, dst=ranks[0])
    if generations.rank != ranks[0]:
        return None
    merged = [row for part, _ in gathered for row in part if row.get("measurement") != MeasurementKind.MEMORY_BASELINE]
    merged += [row for row in gathered[0][0] if row.get("measurement") == MeasurementKind.MEMORY_BASELINE]
    merged += in_place_rows([span for _, part in gathered for span in part], len(ranks),
                            len(generations.topology.host_groups(ranks)), master=ranks[0])
    context = scenario_context(generations.scenario_name, generations.topology, ranks, generations.dtype,
                               cores=len(os.sched_getaffinity(0)), backend=backend_context(),
                               torch_version=torch.__version__)
    merged += context_rows(applied_context(context) if testbed else context)
    return _merge_compute(merged)


def backend_context() -> str:
    """The process group's backend and transport, as a profile's context records it: gloo talks
    TCP here (its only transport on Linux in torch 2.13.0's build); NCCL picks its own."""
    backend = str(dist.get_backend())
    return Transport.GLOO_TCP.value if backend == "gloo" else f"{backend}/auto"


def calibration_strategies(scenario) -> list[StrategyChoice]:
    """The distinct strategies of the scenario's variants that name their algorithms (``auto`` is
    resolved by the simulator's pricing, so it has no one algorithm to run), in variant order;
    the registry's default strategy with the library's algorithms when none does."""
    choices = []
    for v in scenario.config.variants:
        choice = v.choice()
        if AUTO not in choice.algorithms.values() and choice not in choices:
            choices.append(choice)
    return choices or [StrategyChoice.library(next(iter(STRATEGIES)))]


def used_algorithms(scenario) -> dict[OpKind, tuple[str, ...]]:
    """The collective algorithms the scenario's variants call, by kind (``auto`` needs them all):
    each variant's strategy says which collectives it calls (:data:`sim.strategies.STRATEGIES`)."""
    used: dict[OpKind, set[str]] = {kind: set() for kind in ALGORITHMS}
    for v in scenario.config.variants:
        for kind, algorithm in v.choice().algorithms.items():
            used[kind].add(algorithm)
    return {kind: (LIBRARY, *ALGORITHMS[kind]) if AUTO in names else tuple(sorted(names))
            for kind, names in used.items()}


class CalibrationGenerations:
    """Generations with each calibration strategy (:func:`calibration_strategies`) at each
    calibration prompt, one of each per :meth:`round`, every one started at one instant on the
    shared clock; their op records are what the profile's ``compute``, ``op_gap``,
    ``collective_in_place`` and ``collective_wait`` rows are made of.

    In rounds, not one strategy's repeats in a block: on a shared machine the pace drifts over tens
    of seconds, and a strategy timed in one block would carry whatever the machine did then into
    its collective rows; interleaved, every strategy samples the same stretch of time (and
    ``hetsim validate`` interleaves these rounds with the measured ones).

    Args:
        model: this rank's model shard, with a KV cache of at least :data:`CALIBRATION_MAX_TOKENS`.
        loader: reads weight blocks when ``model`` was built without some (the scenario streams).
        shards: each rank's slice when the tensor-parallel split is uneven (None: even).
    """

    def __init__(self, scenario, ranks, topology, rank: int, comm: Communicator, model, loader: BlockLoader | None,
                 heartbeat: Callable[[str], None], shards=None):
        spec = scenario.model
        batch = scenario.config.workload.batch_size
        self.ranks, self.topology, self.rank, self.heartbeat = tuple(ranks), topology, rank, heartbeat
        self.scenario_name = scenario.name
        self.device_class = topology.devices[rank].spec.name
        self.model, self.group_size, self.batch, self.dtype = model, len(ranks), batch, spec.dtype
        self.strategies = calibration_strategies(scenario)
        self.cases = []  # (strategy index, label, prompt length, executor, prompt, ops by step and name)
        for s_index, strategy in enumerate(self.strategies):
            label = " ".join((strategy.strategy, *strategy.algorithms.values()))
            for prompt_len in CALIBRATION_PROMPTS:
                plan = Plan(spec, self.ranks, batch, prompt_len, CALIBRATION_OUTPUT_TOKENS, strategy, shards=shards)
                executor = Executor(plan, model, comm, rank, loader=loader)
                # Ops of one name in one step share their cost (every layer has the same shapes).
                ops = [{op.name: op for seg in plan.phase(step).segments for op in seg.programs[rank]}
                       for step in range(plan.num_phases)]
                self.cases.append((s_index, label, prompt_len, executor,
                                   prompt_tokens(spec, batch, prompt_len, seed=0).to(model.device), ops))
        self.timings: list[dict] = []  # compute timings, one per op record
        self.spans: list[tuple] = []  # collective records, for runtime.comm_timing.in_place_rows
        self.gaps: list[float] = []

    def round(self, index: int, timed: bool) -> None:
        """One generation of every case; ``timed`` keeps its records (False: a warm-up)."""
        for s_index, label, prompt_len, executor, prompt, ops in self.cases:
            self.heartbeat(f"generating with {label}, prompt {prompt_len} tokens, repeat {index}")
            executor.prepare()  # untimed: another executor of this model may have streamed its blocks
            generation = executor.generate(prompt, common_start(self.model.device))
            if timed:
                self._keep(generation.records, ops, (s_index, prompt_len, index))

    def _keep(self, records, ops, generation_id: tuple) -> None:
        for before, after in zip(records, records[1:]):
            if before.step == after.step:
                self.gaps.append(after.start_s - before.end_s)
        for record in records:
            op = ops[record.step][record.name]
            if op.collective is not None:
                self.spans.append(CallSpan(generation_id, (record.step, record.layer, record.name), record.name,
                                           self.rank, str(op.collective.kind), op.collective.algorithm,
                                           op.collective.size_bytes, record.start_s, record.end_s))
                continue
            new, context = op.shape
            cost = op.cost
            self.timings.append({"measurement": MeasurementKind.COMPUTE, "device_class": self.device_class, "op": record.kind,
                                 "group_size": self.group_size, "batch_size": self.batch, "new_tokens": new,
                                 "context_tokens": context, "dtype": self.dtype, "flops": cost.flops,
                                 "traffic_bytes": cost.bytes_read + cost.bytes_written, "unit": "s",
                                 "method": "timed in place while generating (the scenario's strategies)",
                                 "median": record.end_s - record.start_s})

    def rows(self) -> list[dict]:
        """This rank's ``compute`` timings (one row each, folded by :func:`gather_profile`) and its
        ``op_gap`` row."""
        return self.timings + [{"measurement": MeasurementKind.OP_GAP, "device_class": self.device_class, "unit": "s",
                                "method": "time between consecutive ops of a rank while generating",
                                **stats(self.gaps)}]

    def framework_bytes(self) -> int:
        """What this rank holds beyond its model's weights and KV cache (bytes): its peak resident
        memory in one more, untimed generation at the shortest prompt with the exact allocator,
        in which RSS is the baseline plus the live tensors (the timed generations ran fast). At the
        shortest prompt, activations and workspace, which the simulator prices per shape, barely
        enter it. Call it before anything large (the collective sweep's buffers) is allocated."""
        _, _, _, executor, prompt, _ = self.cases[0]
        cache_bytes = sum(t.numel() * t.element_size() for t in (*self.model.k_cache, *self.model.v_cache))
        with memory_probe.exact_allocation():
            executor.prepare()
            device = device_of(self.model.device)
            device.reset_peak_memory()
            executor.generate(prompt, time.perf_counter())
            peak = device.peak_memory_bytes()
        return peak - self.model.weight_bytes - cache_bytes


def _merge_compute(rows: list[dict]):
    """Fold single timings (one per rank, layer and repeat) into one row per op and shape."""
    compute = defaultdict(list)
    gaps = defaultdict(list)
    merged = []
    for row in rows:
        if row["measurement"] == MeasurementKind.COMPUTE:
            key = tuple(row[k] for k in ("device_class", "op", "group_size", "batch_size", "new_tokens",
                                         "context_tokens", "dtype", "flops", "traffic_bytes", "method"))
            compute[key].append(row["median"])
        elif row["measurement"] == MeasurementKind.OP_GAP:
            gaps[row["device_class"]].append((row["median"], row["mean"]))
        else:
            merged.append(row)
    names = ("device_class", "op", "group_size", "batch_size", "new_tokens", "context_tokens", "dtype", "flops",
             "traffic_bytes", "method")
    for key, values in compute.items():
        merged.append({"measurement": MeasurementKind.COMPUTE, **dict(zip(names, key)), "unit": "s", **stats(values)})
    for device_class, values in gaps.items():
        medians, means = zip(*values)
        merged.append({"measurement": MeasurementKind.OP_GAP, "device_class": device_class, "unit": "s",
                       "method": "time between consecutive ops of a rank while generating (statistics over "
                                 "ranks of each rank's median; mean over ranks of each rank's mean)",
                       **stats(medians), "mean": float(sum(means) / len(means))})
    return profile_frame(merged)


def calibrate_scenario(scenario, *, testbed: bool = False, repeats: int = 5, max_call_s: float = 1.0,
                       hang_timeout_s: float = 300.0, on_beat: Callable[[int, str], None] | None = None,
                       used_only: bool = False, held_out_sizes: tuple[int, ...] = ()):
    """Calibrate on this machine (forked ranks, in the testbed's namespaces if ``testbed``).
    ``used_only``: time only the collective algorithms the scenario's variants call;
    ``held_out_sizes``: see :func:`calibrate_rank`.

    Returns:
        The profile table (:func:`sim.profile.profile_frame`), with the load the launch ran under
        and the machine's speed around it.

    Raises:
        ConfigError: invalid scenario, or testbed not up.
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    scenario.require_inference("calibrate")
    from runtime.measure import launch_scenario
    from sim.topology import build_topology

    ParallelPlan.of(scenario, build_topology(scenario.config.cluster))  # refuses a pipeline here

    def body(topology, rank: int, heartbeat) -> object:
        torch.manual_seed(0)
        return calibrate_rank(scenario, topology, rank, repeats=repeats, max_call_s=max_call_s, heartbeat=heartbeat,
                              used_only=used_only, held_out_sizes=held_out_sizes, testbed=testbed)

    (profile, spent), reference = timed_around(lambda: load_during(lambda: launch_scenario(
        scenario, body, testbed=testbed, hang_timeout_s=hang_timeout_s, on_beat=on_beat)))
    rows = load_rows(scenario.name, spent.steal_fraction, spent.other_load) + speed_rows(scenario.name,
                                                                                         medians(reference))
    return with_rows(profile, rows + machine_rows(scenario, profile, repeats, testbed))
