"""One rank's measurement job, the same whether launched locally (forked) or by torchrun
(:mod:`runtime.torchrun` is the torchrun entry point).

After the process group is up, a rank builds its model shard once, lowers for each variant of the
scenario the same :class:`~sim.plan.Plan` the simulator prices, runs ``warmup`` untimed rounds
and ``repeats`` timed rounds, each round one generation of every variant in turn (each timed one
after a barrier), then one untimed generation per variant that reads its peak memory, and hands
its measurements to rank 0 with ``gather_object``. Rank 0 returns them all; the others return None.
"""

from __future__ import annotations

import math
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from models.shards import TensorShard
from runtime import clock, memory_probe
from runtime.blocks import BlockLoader, BlockStore
from runtime.comm import Communicator
from runtime.device import device_of
from runtime.executor import Executor
from runtime.model import RankModel
from runtime.pacing import LoaderLink, Pacer
from runtime.pipeline import PipelineExecutor, stage_model, stage_process_groups
from runtime.testbed.shaping import dropped_packets
from runtime.weights import block_names, prompt_tokens
from sim.parallel import ParallelPlan
from sim.replicas import replica_batch_scenario
from sim.scenario import Scenario, pipeline_plan
from sim.trace import TraceEvent

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured for one variant.

    ``step_start_s``/``step_end_s``: [repeats, steps] arrays (s from each repeat's start);
    ``records``: op records of the last repeat (:class:`sim.trace.TraceEvent`);
    ``tokens``: [repeats, batch, output_tokens] generated ids (master; empty elsewhere);
    ``peak_memory_bytes``: high-water mark of an untimed generation after the timed ones (CPU: peak
    RSS with the exact allocator; CUDA: max memory allocated), see :mod:`runtime.memory_probe`;
    ``memory_samples``: (time_s, bytes) after each step: times of the last repeat, bytes of that generation;
    ``stall_s``: [repeats, steps] time the rank's ops waited for weight loads (s);
    ``round_records``: op records of every timed repeat, in order, where the rounds kept them
    (:class:`MeasurementRounds`' ``keep_rounds``); empty otherwise;
    ``dropped_packets``: the packets the tbf queues of the rank's host dropped during the timed
    generations (:func:`runtime.testbed.shaping.dropped_packets`; None outside the testbed).
    """

    rank: int
    variant: str
    step_start_s: np.ndarray
    step_end_s: np.ndarray
    records: list[TraceEvent]
    tokens: np.ndarray
    peak_memory_bytes: int
    memory_samples: list[tuple[float, int]]
    stall_s: np.ndarray
    round_records: tuple[list[TraceEvent], ...] = ()
    dropped_packets: int | None = None


def rank_model(scenario: Scenario, ranks: tuple[int, ...], rank: int, *, seed: int, max_tokens: int,
               device: torch.device, block_dir: str | Path | None = None,
               shards: tuple[TensorShard, ...] | None = None) -> tuple[RankModel, BlockStore | None]:
    """This rank's model shard (``shards``: each rank's slice when the split is uneven,
    :attr:`sim.parallel.ParallelPlan.shards`), built the way every run of ``scenario`` builds it:
    when a variant streams weights, without its decoder-layer blocks, which are written once as
    block files (returned store) and loaded from them; otherwise whole (store None). Calibration
    builds it the same way, so the framework memory it reads is the measured runs' own."""
    spec = scenario.model
    streams = any(any(scenario.plan(v, ranks, shards=shards).streamed_blocks.values())
                  for v in scenario.config.variants)
    index = ranks.index(rank)
    model = RankModel(spec, len(ranks), index, seed=seed, batch_size=scenario.config.workload.batch_size,
                      max_tokens=max_tokens, device=device, dtype=TORCH_DTYPES[spec.dtype],
                      skip_blocks=block_names(spec) if streams else (), shard=shards[index] if shards else None)
    if not streams:
        return model, None
    store = BlockStore(model, block_dir)
    store.write_missing()
    return model, store


def timed_rounds(repeats: int, min_timed_s: float, slowest_generation_s: float) -> int:
    """Timed rounds of a measurement: ``repeats``, or more when that many generations of the
    slowest variant (``slowest_generation_s``, its warm-up generation) would time less than
    ``min_timed_s`` seconds.

    Why: on a shared machine a short case's median over a few generations follows whatever else the
    cores do for those seconds (bandwidth-bound decode on the 2-core testbed drifts by 20-30% over
    tens of seconds); a fixed span of timed generations makes the median as steady for short cases
    as for long ones.
    """
    if not min_timed_s > 0 or not slowest_generation_s > 0:
        return repeats
    return max(repeats, math.ceil(min_timed_s / slowest_generation_s))


class MeasurementRounds:
    """The measured generations of one rank: one generation of every variant of every case per
    :meth:`round`, each timed one started at one instant on the shared clock.

    Rounds over the variants, not one variant's repeats in a block: on a shared machine the speed
    drifts over tens of seconds (20-30% on the 2-core testbed), and a slow stretch then lands on
    every variant alike instead of on one, so the medians compare. Only what the measurement
    needs is kept of each generation: held op records and hidden states would count in the peak
    memory that :meth:`memory` reads.

    Args:
        cases: scenarios that differ only in their workload's prompt length (``hetsim validate``
            measures several in one launch; ``hetsim measure`` one), sharing ``model``, whose KV
            cache must hold the longest.
        loader: reads (paced) weight blocks when a variant streams; None otherwise.
        seed: of the prompts.
        shards: each rank's slice when the tensor-parallel split is uneven (None: even).
        layout, replica: the parallel layout, where it is a pipeline, and the copy of it this
            rank's stage belongs to (``cases`` then hold that replica's share of the batch).
        keep_rounds: keep every timed round's op records (:attr:`RankMeasurement.round_records`:
            where a step's time goes, over every round, :mod:`validation.terms`), not only the
            last's; only where :meth:`measurements` reads no memory, which they would count in.
    """

    def __init__(self, cases: list[Scenario], ranks: tuple[int, ...], rank: int, model: RankModel, comm: Communicator,
                 loader: BlockLoader | None, device: torch.device, seed: int,
                 heartbeat: Callable[[str], None] = lambda label: None,
                 shards: tuple[TensorShard, ...] | None = None, keep_rounds: bool = False,
                 layout: ParallelPlan | None = None, replica: int = 0):
        self.cases, self.rank, self.device, self.heartbeat = cases, rank, device, heartbeat
        self.keep_rounds = keep_rounds
        self._device = device_of(device)
        self.executors: dict[tuple[int, str], Executor | PipelineExecutor] = {}
        self.prompts: dict[int, torch.Tensor] = {}
        for index, case in enumerate(cases):
            workload = case.config.workload
            self.prompts[index] = prompt_tokens(case.model, workload.batch_size, workload.prompt_tokens, seed).to(device)
            for variant in case.config.variants:
                if layout is not None and layout.pipeline > 1:  # ``layout``: the pipeline ``model`` is a stage of
                    executor = PipelineExecutor(pipeline_plan(case, variant, layout, replica=replica), model, comm,
                                                rank, memory_probe=self._device.memory_bytes)
                else:
                    executor = Executor(case.plan(variant, ranks, shards=shards), model, comm, rank, loader=loader,
                                        memory_probe=self._device.memory_bytes)
                self.executors[index, variant.name] = executor
        self.kept = {key: {"starts": [], "ends": [], "stalls": [], "tokens": [], "records": [], "rounds": [],
                           "dropped": []}
                     for key in self.executors}

    def _generate(self, key: tuple[int, str], label: str, t0: float | None = None):
        executor = self.executors[key]
        executor.prepare()  # untimed: the weights resident when the request arrives
        start = common_start(self.device) if t0 is None else t0
        name = key[1] if len(self.cases) == 1 else f"{key[1]} at prompt {self.cases[key[0]].config.workload.prompt_tokens}"
        return executor.generate(self.prompts[key[0]], start, lambda step: self.heartbeat(f"{name} {label} step {step}"))

    def round(self, label: str, timed: bool = True) -> list[float]:
        """One generation of every variant of every case (``label``: "repeat 3" in the
        heartbeats); ``timed`` keeps them (False: a warm-up, each generation started at once).
        Returns, per case, its slowest generation's wall time on this rank (s)."""
        slowest_s = [0.0] * len(self.cases)
        for key in self.executors:
            dropped_before = dropped_packets() if timed else None  # a tc call, outside the timed generation
            began = time.perf_counter()
            generation = self._generate(key, label, t0=None if timed else began)
            slowest_s[key[0]] = max(slowest_s[key[0]], time.perf_counter() - began)
            if not timed:
                continue
            kept = self.kept[key]
            # Every rank's generation over before this rank goes on (a tc run; after the last
            # round, the memory probe's garbage collection): a pipeline's first stages finish
            # their last step while the last stage still computes its own, on the cores these
            # take. PP 4 of GPT-2 over 4 ranks on 2 cores: the last round's last decode step
            # (the kept trace's) 46-49 ms against 30-34 ms, its LM head 16-19 against 9 ms.
            dist.barrier()
            dropped_after = dropped_packets()
            kept["dropped"].append(None if dropped_before is None or dropped_after is None
                                   else dropped_after - dropped_before)
            kept["starts"].append(generation.step_start_s)
            kept["ends"].append(generation.step_end_s)
            kept["stalls"].append(generation.stall_s)
            if generation.tokens:
                kept["tokens"].append(torch.stack(generation.tokens, dim=1).cpu().numpy())
            kept["records"] = list(generation.records)
            if self.keep_rounds:
                kept["rounds"].append(kept["records"])
            del generation
        return slowest_s

    def measurements(self, memory: bool = True) -> list[list[RankMeasurement]]:
        """Per case, per variant, this rank's :class:`RankMeasurement`: the timed rounds so far,
        and (``memory``) the peak memory of one more, untimed generation with the exact
        allocator, in which RSS is the baseline plus the live tensors (:mod:`runtime.memory_probe`;
        the timed ones ran fast). With no timed round, the memory samples take the untimed
        generation's times; without ``memory``, the peak is 0 and there are no samples."""
        out: list[list[RankMeasurement]] = [[] for _ in self.cases]
        for key, executor in self.executors.items():
            kept = self.kept[key]
            peak, samples = 0, []
            if memory:
                with memory_probe.exact_allocation():
                    executor.prepare()
                    self._device.reset_peak_memory()
                    probed = self._generate(key, "memory", t0=time.perf_counter())
                    peak = self._device.peak_memory_bytes()
                samples = list(zip(kept["ends"][-1] if kept["ends"] else probed.step_end_s, probed.memory_bytes))
            out[key[0]].append(RankMeasurement(
                self.rank, key[1], np.array(kept["starts"]), np.array(kept["ends"]), kept["records"],
                np.array(kept["tokens"]) if kept["tokens"] else np.zeros((0,), dtype=np.int64),
                peak, samples, np.array(kept["stalls"]), tuple(kept["rounds"]),
                sum(kept["dropped"]) if kept["dropped"] and None not in kept["dropped"] else None))
        return out


def run_rank(scenario: Scenario, topology, rank: int, *, repeats: int, warmup: int, seed: int,
             device: torch.device, heartbeat: Callable[[str], None] = lambda label: None,
             block_dir: str | Path | None = None, min_timed_s: float = 0.0) -> list | None:
    """Measure every variant of ``scenario`` on this rank; returns all ranks' measurements on rank 0.

    ``warmup`` untimed rounds, then ``repeats`` timed rounds of :class:`MeasurementRounds`, more
    when ``min_timed_s`` asks (:func:`timed_rounds`, judged by rank 0's warm-up round; every rank
    runs the count rank 0 sends), then the memory probes. ``repeats=0, warmup=0`` measures peak
    memory only.

    Requires an initialised default process group whose ranks are the plan's ranks. With
    ``parallel.replicas``, every replica's ranks are in it and run together, generation by
    generation: each rank runs its replica's plan on its share of the batch
    (:func:`sim.replicas.replica_batch_scenario`), the replica's collectives in a process group of
    its own (a pipeline's replica: one per stage, its hops between its own stage masters); rank 0
    decides the number of timed rounds for all. When a variant
    streams weights, the model is built without its decoder-layer blocks, which are written once
    as block files under ``block_dir`` (default :func:`runtime.blocks.default_cache_dir`) and
    loaded from there, paced to the rank's loader link (ranks of one host share its storage's
    pace); each variant's executor makes its starting weights resident before its first
    generation. Raises :class:`models.errors.ConfigError` when a
    variant streams and the rank's host has no ``storage`` link.
    """
    memory_probe.configure_allocator(exact=False)  # fixed malloc settings before the model is built
    layout = ParallelPlan.of(scenario, topology)
    layout.measured_ranks  # noqa: B018  (refuses variants with layouts of their own)
    replica = layout.replica_of(rank)
    ranks, shards = layout.replica_ranks[replica], layout.replica_shards[replica]
    scenario = replica_batch_scenario(scenario, layout.replicas, replica)
    leader = 0 if layout.replicas > 1 else ranks[0]  # the rank whose word goes for the whole run
    workload = scenario.config.workload
    max_tokens = workload.prompt_tokens + workload.output_tokens
    comm = Communicator(rank, topology.host_groups)
    if layout.pipeline > 1:  # one stage's shard; every replica's stages' collectives in their own process groups
        plan = pipeline_plan(scenario, scenario.config.variants[0], layout, replica=replica)
        model, store = stage_model(plan, rank, seed=seed, max_tokens=max_tokens, device=device,
                                   dtype=TORCH_DTYPES[scenario.model.dtype]), None
        comm.process_groups = stage_process_groups(layout.replica_stage_ranks)
    else:
        if layout.replicas > 1:  # every rank creates every group, in the same order (torch.distributed.new_group)
            comm.process_groups = {group: dist.new_group(list(group)) for group in layout.replica_ranks}
        model, store = rank_model(scenario, ranks, rank, seed=seed, max_tokens=max_tokens, device=device,
                                  block_dir=block_dir, shards=shards)
    with paced_loader(store, topology, leader, rank, device) as loader:
        measured = MeasurementRounds([scenario], ranks, rank, model, comm, loader, device, seed, heartbeat,
                                     shards=shards, layout=layout, replica=replica)
        slowest_s = max((measured.round(f"warmup {index}", timed=False)[0] for index in range(warmup)), default=0.0)
        rounds = torch.tensor([timed_rounds(repeats, min_timed_s, slowest_s)], dtype=torch.int64, device=device)
        dist.broadcast(rounds, src=leader)
        for index in range(int(rounds.item())):
            measured.round(f"repeat {index}")
        measurements = measured.measurements()[0]
        heartbeat("gather")
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(measurements, gathered, dst=0)
    return gathered if rank == 0 else None


@contextmanager
def paced_loader(store: BlockStore | None, topology, leader: int, rank: int, device: torch.device):
    """A :class:`runtime.blocks.BlockLoader` paced to this rank's loader link (the ranks of this run
    on one machine share the pacing clocks of their loader channels, named by ``leader``'s run id),
    or None without ``store`` (no variant streams). Every rank of the run must enter it; on
    leaving, once no rank paces any more, the shared clock files go."""
    if store is None:
        yield None
        return
    run_id = [uuid.uuid4().hex if rank == leader else None]
    dist.broadcast_object_list(run_id, src=leader)
    pacer = Pacer(LoaderLink.of(topology, rank), store.directory.parent / f".pace-{run_id[0]}")
    try:
        yield BlockLoader(store, device, pacer)
        dist.barrier()
    finally:
        pacer.close()


def common_start(device: torch.device) -> float:
    """A barrier, then rank 0's clock reading, as this rank's ``time.perf_counter`` reads that
    instant (:mod:`runtime.clock`): one start for every rank's step and op times."""
    dist.barrier()
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)  # NCCL needs device tensors
    dist.broadcast(t0, src=0)
    return clock.to_local(float(t0.item()))
