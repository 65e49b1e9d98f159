"""Measured results: per-rank measurements folded into the simulator's table and trace schema.

Run metrics are computed per repeat with :func:`sim.metrics.run_metrics`, the simulator's own,
from a step table (:func:`sim.trace.step_table`) of the master's step times (the master embeds the
first token and samples the last, so its steps span the forward pass) and the slowest rank's wait
for streamed weights per step, then summarised over repeats: the metric itself is the median
(``ttft_s``), with ``ttft_p10_s`` / ``ttft_p90_s`` beside the timing metrics
(:meth:`sim.vocabulary.Metric.percentile`), so a simulated and a measured run of one scenario join
on (scenario, variant, metric, device). Per device: ``peak_memory_bytes`` (the process's
high-water mark on CPU, max CUDA memory allocated on GPU) and, in the testbed,
``dropped_packets_per_step`` (the packets its host's tbf queues dropped during the timed
generations, per timed step: measured only, a case measured with losses the testbed's queues made;
:func:`runtime.testbed.shaping.dropped_packets`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pandas as pd

from models.cache_formats import quantised
from models.errors import ConfigError
from sim.metrics import peak_memory_bytes, result_rows, run_metrics
from sim.outputs import chrome_trace, device_names, results_csv, write_files
from sim.parallel import ParallelPlan
from sim.replicas import ReplicaTiming, combined_timing, idle_rows, replica_rows, split_batch
from sim.scenario import Scenario
from sim.topology import Topology
from sim.trace import MEMORY_COLUMNS, Trace, op_table, peak_table, step_table
from sim.vocabulary import TIMING_METRICS, TRAINING_TIMING_METRICS, Accumulation, Metric

if TYPE_CHECKING:
    from runtime.worker import RankMeasurement


@dataclass(frozen=True)
class MeasuredVariant:
    """One variant's measured trace (last repeat), median timing, tokens ([repeats, batch, tokens]);
    ``rounds``: the trace of every timed repeat (ops and steps, no memory) where the ranks kept
    their records of each (:attr:`runtime.worker.RankMeasurement.round_records`), else empty."""

    name: str
    trace: Trace
    timing: dict[str, float]
    tokens: np.ndarray
    rounds: tuple[Trace, ...] = ()


@dataclass(frozen=True)
class MeasuredResult:
    """A measured run of every variant: the tidy result table (source=measured) and traces."""

    scenario: Scenario
    topology: Topology
    ranks: tuple[int, ...]
    variants: tuple[MeasuredVariant, ...]
    results: pd.DataFrame

    @property
    def idle_devices(self) -> tuple[str, ...]:
        """The devices of the cluster no rank ran on, in topology order."""
        return tuple(d.name for d in self.topology.devices if d.rank not in self.ranks)


def summarise(per_repeat: list[dict[str, float]]) -> dict[str, float]:
    """Median of each metric over repeats; for the timing metrics also p10 / p90
    (:meth:`sim.vocabulary.Metric.percentile`); ``repeats``."""
    summary: dict[str, float] = {}
    for metric in per_repeat[0]:
        values = np.array([r[metric] for r in per_repeat], dtype=float)
        summary[metric] = float(np.median(values))
        if metric in TIMING_METRICS or metric in TRAINING_TIMING_METRICS:
            summary[Metric(metric).percentile(10)] = float(np.percentile(values, 10))
            summary[Metric(metric).percentile(90)] = float(np.percentile(values, 90))
    summary[Metric.REPEATS] = float(len(per_repeat))
    return summary


def repeat_traces(measured: list[RankMeasurement], master: int) -> list[Trace]:
    """Per timed repeat, the step table of the run (ops and memory left empty): the master's step
    times, and per step the slowest rank's wait for streamed weights.

    Args:
        measured: one measurement per rank of one variant; ``master``: the master's rank.
    """
    lead = next(m for m in measured if m.rank == master)
    stalls = np.max(np.stack([m.stall_s for m in measured]), axis=0)  # [repeats, steps]
    return [Trace(op_table(()), step_table(s, e, stall), pd.DataFrame(columns=MEMORY_COLUMNS))
            for s, e, stall in zip(lead.step_start_s, lead.step_end_s, stalls)]


def prefill_start_s(measured: list[RankMeasurement]) -> np.ndarray:
    """Per timed repeat, when its prefill began (s from the repeat's common start on the shared
    clock): the first rank's first step start.

    The common start (:func:`runtime.worker.common_start`) is rank 0's clock reading before it
    broadcasts that reading, so rank 0 begins its prefill only once the broadcast returns: gloo's
    root waits for the receiver's ready notice. On the 2-host testbed at 2.5 ms per NIC that took
    11 ms (two one-way latencies) or under 1 ms by the generation before, up to 24 ms under load:
    in rounds of three variants, the middle one's TTFT was 10 ms shorter for it in every round.
    That wait is the harness's, not the generation's; the simulator starts every rank at 0.

    Args:
        measured: one measurement per rank of one variant (every rank of a replica or pipeline).
    """
    return np.min(np.stack([np.asarray(m.step_start_s)[:, 0] for m in measured]), axis=0)


def repeat_timings(measured: list[RankMeasurement], master: int, batch_size: int) -> list[dict[str, float]]:
    """Per timed repeat, its run metrics (:func:`sim.metrics.run_metrics`: ``ttft_s``, ``tpot_s``,
    ``loader_stall_decode_s``, ...) from :func:`repeat_traces`, timed from the start of its prefill
    (:func:`prefill_start_s`), as the metrics define TTFT and the end-to-end latency
    (:mod:`sim.metrics`). The traces keep the common start, their op records' origin."""
    timings = []
    for trace, start_s in zip(repeat_traces(measured, master), prefill_start_s(measured)):
        steps = trace.steps.assign(start_s=trace.steps["start_s"] - start_s, end_s=trace.steps["end_s"] - start_s)
        timings.append(run_metrics(replace(trace, steps=steps), batch_size))
    return timings


def measured_result(scenario: Scenario, topology: Topology, gathered: list[list[RankMeasurement]]) -> MeasuredResult:
    """Fold every rank's measurements (``gathered[rank][variant]``) into a :class:`MeasuredResult`.

    Replicas (``parallel.replicas``) are folded as the simulator folds them
    (:func:`sim.replicas.combined_timing`), repeat by repeat since they ran together: each
    repeat's latencies are its slowest replica's, its decode tokens/s the sum of theirs; then the
    medians over repeats. Each replica's own medians are rows of their own
    (:func:`sim.replicas.replica_rows`, source ``measured``); the trace holds every rank's ops and
    the first replica's steps, and the tokens every replica's sequences, replica after replica.
    """
    ranks = tuple(sorted(m[0].rank for m in gathered))
    layout = ParallelPlan.of(scenario, topology)
    layout.measured_ranks  # noqa: B018  (refuses variants with layouts of their own)
    # Each replica's steps end with its last stage's LM head: that stage's master times them (a
    # pipeline's first stage master holds the tokens; without a pipeline, one master does both).
    groups = layout.replica_ranks
    clocks = [stages[-1][0] for stages in layout.replica_stage_ranks]
    batches = split_batch(scenario.config.workload.batch_size, layout.replicas)
    names = [d.name for d in topology.devices]
    variants, tables = [], []
    for v_index, variant in enumerate(scenario.config.variants):
        measured = {m[v_index].rank: m[v_index] for m in gathered}
        lead = measured[groups[0][0]]
        per_replica = [repeat_timings([measured[r] for r in group], clock, batch)
                       for group, clock, batch in zip(groups, clocks, batches)]
        timing = summarise(per_replica[0] if len(groups) == 1 else
                           [combined_timing(repeat) for repeat in zip(*per_replica)])
        ops = op_table(r for rank in ranks for r in measured[rank].records)
        memory = pd.DataFrame([(rank, t, b) for rank in ranks for t, b in measured[rank].memory_samples],
                              columns=MEMORY_COLUMNS)
        per_repeat = repeat_traces([measured[r] for r in groups[0]], clocks[0])
        trace = Trace(ops, per_repeat[-1].steps, memory, peak_table({r: measured[r].peak_memory_bytes for r in ranks}))
        kept = [measured[rank].round_records for rank in ranks]
        rounds = ()
        if kept[0] and all(len(k) == len(per_repeat) for k in kept):
            rounds = tuple(Trace(op_table(r for rank_rounds in kept for r in rank_rounds[index]), repeat.steps,
                                 repeat.memory) for index, repeat in enumerate(per_repeat))
        peaks = peak_memory_bytes(trace)
        memory_by_device = {topology.devices[r].name: {Metric.PEAK_MEMORY: peaks[r]} | (
            {} if measured[r].dropped_packets is None or not measured[r].step_start_s.size else
            {Metric.DROPPED_PACKETS: measured[r].dropped_packets / measured[r].step_start_s.size})
            for r in ranks}
        tokens = lead.tokens if len(groups) == 1 else np.concatenate([measured[g[0]].tokens for g in groups], axis=1)
        variants.append(MeasuredVariant(variant.name, trace, timing, tokens, rounds))
        tables.append(result_rows(scenario.name, variant.name, "measured", timing, memory_by_device))
        if len(groups) > 1:
            replicas = [ReplicaTiming(group, batch, summarise(repeats))
                        for group, batch, repeats in zip(groups, batches, per_replica)]
            tables.append(replica_rows(scenario.name, variant.name, "measured", replicas, names))
        idle = [d.name for d in topology.devices if d.rank not in ranks]
        if idle:
            tables.append(idle_rows(scenario.name, variant.name, "measured", idle))
    return MeasuredResult(scenario, topology, ranks, tuple(variants), pd.concat(tables, ignore_index=True))


def write_measured_outputs(result: MeasuredResult, out_dir: Path) -> list[Path]:
    """Write results.csv (source=measured) and trace.json into ``out_dir``."""
    trace = chrome_trace([(v.name, v.trace) for v in result.variants], device_names(result.topology, result.ranks))
    return write_files(out_dir, {"results.csv": results_csv(result.results),
                                 "trace.json": json.dumps(trace, separators=(",", ":"))})


def measure_scenario(scenario: Scenario, *, repeats: int = 5, warmup: int = 1, seed: int = 0,
                     testbed: bool = False, hang_timeout_s: float = 120.0) -> MeasuredResult:
    """Measure every variant of ``scenario`` on this machine: one forked rank per device of the
    tensor-parallel group (of every replica's, which run together: :func:`runtime.worker.run_rank`),
    inside the testbed's host namespaces when ``testbed`` is true (a training
    scenario: :func:`runtime.training.measure.measure_training`).

    Raises:
        ConfigError: an invalid scenario, or ``testbed`` while the scenario's testbed is not up.
        runtime.errors.LaunchError: a rank failed, died or hung (the message names it).
    """
    from sim.topology import build_topology

    gathered = launch_measurement(scenario, repeats=repeats, warmup=warmup, seed=seed, testbed=testbed,
                                  hang_timeout_s=hang_timeout_s)
    return measured_result(scenario, build_topology(scenario.config.cluster), gathered)


def launch_measurement(scenario: Scenario, *, repeats: int, warmup: int = 1, seed: int = 0, testbed: bool = False,
                       hang_timeout_s: float = 120.0, min_timed_s: float = 0.0) -> list[list[RankMeasurement]]:
    """One launch of :func:`measure_scenario`'s ranks (``min_timed_s``: see
    :func:`runtime.worker.timed_rounds`; ``repeats=0`` reads peak memory only); every rank's
    measurements, ``[rank][variant]``, for :func:`measured_result` or :func:`with_memory`.
    Raises as :func:`measure_scenario`."""
    scenario.require_inference("measure")
    import torch

    from runtime.worker import run_rank
    from sim.scenario import pipeline_plan
    from sim.topology import build_topology

    layout = ParallelPlan.of(scenario, build_topology(scenario.config.cluster))
    if layout.pipeline > 1:  # refuse what a pipeline cannot run (streamed weights...) before any rank starts
        for variant in scenario.config.variants:
            for replica, batch in enumerate(split_batch(scenario.config.workload.batch_size, layout.replicas)):
                pipeline_plan(scenario, variant, layout, replica=replica, batch_size=batch)

    def body(topology: Topology, rank: int, heartbeat) -> list | None:
        return run_rank(scenario, topology, rank, repeats=repeats, warmup=warmup, seed=seed, device=torch.device("cpu"),
                        heartbeat=heartbeat, min_timed_s=min_timed_s)

    return launch_scenario(scenario, body, testbed=testbed, hang_timeout_s=hang_timeout_s, replicas=True)


def launch_scenario(scenario: Scenario, body: Callable[[Topology, int, Callable[[str], None]], object], *,
                    testbed: bool, hang_timeout_s: float, on_beat: Callable[[int, str], None] | None = None,
                    replicas: bool = False) -> object:
    """``body(topology, rank, heartbeat)`` in one forked rank per device of the scenario's
    tensor-parallel group (:func:`runtime.launch.launch`), or of every replica's group where
    ``replicas`` (a ``body`` that runs replicas, :func:`runtime.worker.run_rank`), inside the
    testbed's host namespaces when ``testbed``; returns rank 0's result.

    Raises:
        ConfigError: ``testbed`` while the scenario's testbed is not up; more than one replica
            where ``body`` runs one group (calibration), or replicas not on the cluster's first
            devices in order (each process's rank is its device's).
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    from runtime.launch import launch
    from sim.topology import build_topology

    if scenario.config.compute.accumulation != Accumulation.FP32:
        # torch's fp16 matmuls accumulate in fp32 (cuBLAS CUBLAS_COMPUTE_32F): a run of them is not
        # the framework the scenario describes
        raise ConfigError("compute.accumulation", f"the reference runtime multiplies with torch, which "
                                                  f"accumulates fp16 products in fp32; remove the setting to "
                                                  f"run it (got '{scenario.config.compute.accumulation}')")
    for field, value in quantised(scenario.config.weights, scenario.config.kv_cache):
        raise ConfigError(field, f"the reference runtime runs dense {scenario.model.dtype} weights and cache in "
                                 f"torch, not quantised blocks; remove the setting to run it (got '{value}')")
    topology = build_topology(scenario.config.cluster)
    parallel = ParallelPlan.of(scenario, topology)
    ranks = parallel.measured_ranks
    if parallel.replicas > 1:
        if not replicas:  # replicas share nothing: calibrating one group is what there is to calibrate
            raise ConfigError("parallel.replicas", f"this runs one tensor-parallel group; set replicas: 1 to run "
                                                   f"the first replica (got {parallel.replicas})")
        ranks = parallel.ranks
        if ranks != tuple(range(len(ranks))):
            raise ConfigError("parallel.replicas", f"the runtime runs replicas on the cluster's first "
                                                   f"{len(ranks)} devices in order (got ranks {list(ranks)})")
    placements, enter = placements_for(scenario, topology, ranks, testbed)
    return launch(lambda rank, heartbeat: body(topology, rank, heartbeat), len(ranks), placements=placements,
                  hang_timeout_s=hang_timeout_s, enter_namespace=enter, on_beat=on_beat)[0]


def with_memory(timed: list[list[RankMeasurement]], memory: list[list[RankMeasurement]]) -> list[list[RankMeasurement]]:
    """Timings of one launch joined with the memory of another (each ``[rank][variant]``): per
    rank and variant, ``timed``'s measurement with ``memory``'s peak, and its memory samples'
    bytes at ``timed``'s step times (the last timed repeat's, as :class:`runtime.worker.RankMeasurement`
    holds them). ``hetsim validate`` times its cases interleaved with the calibration, in a
    process that holds more than a measured run does, and reads their memory in a launch of
    their own (:mod:`runtime.interleaved`).

    Raises:
        ValueError: the two measured different ranks or variants.
    """
    layout = [[(m.rank, m.variant) for m in per_rank] for per_rank in timed]
    if layout != [[(m.rank, m.variant) for m in per_rank] for per_rank in memory]:
        raise ValueError("timings and memory must come from the same ranks and variants")

    def join(time_part: RankMeasurement, memory_part: RankMeasurement) -> RankMeasurement:
        ends = time_part.step_end_s[-1] if len(time_part.step_end_s) else [t for t, _ in memory_part.memory_samples]
        return replace(time_part, peak_memory_bytes=memory_part.peak_memory_bytes,
                       memory_samples=list(zip(ends, [b for _, b in memory_part.memory_samples])))

    return [[join(t, m) for t, m in zip(t_rank, m_rank)] for t_rank, m_rank in zip(timed, memory)]


def placements_for(scenario: Scenario, topology: Topology, ranks: tuple[int, ...], testbed: bool):
    """Where each rank runs: this machine's namespace, or its host's testbed namespace.

    Returns:
        (placements or None, the function that enters a namespace or None).

    Raises:
        ConfigError: ``testbed`` is set but the scenario's testbed is not up.
    """
    if not testbed:
        return None, None
    from runtime.launch import RankPlacement
    from runtime.testbed import Testbed, enter_namespace

    bed = Testbed(scenario.name, topology)
    bed.require_up()
    return [RankPlacement(bed.namespace_of_rank(r), bed.master_address(), bed.interface) for r in ranks], enter_namespace

