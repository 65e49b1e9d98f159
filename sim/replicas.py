"""Replicas: R copies of one layout, each serving its part of the requests.

``parallel: {replicas: R}`` places R copies of the layout (a tensor-parallel group, or a whole
pipeline of them) on consecutive blocks of devices (:attr:`sim.parallel.ParallelPlan.replica_ranks`)
and splits the batch's sequences among them (:func:`split_batch`), as a data-parallel inference
deployment behind a load balancer does (e.g. vLLM's ``--data-parallel-size``, each engine serving
its own requests). The replicas share no tensor and call no collective together. Each is
simulated on its own devices as a run of its own (a tensor-parallel replica that runs exactly as
an earlier one is that one's run, its ranks renamed: :func:`sim.alike.replica_twins`), so two
tensor-parallel replicas whose links meet (a shared uplink) do not slow each other here; a
pipeline replica's hops do share the links they cross with the other replicas'
(:mod:`sim.pipeline_run`, ``mirrors``). Replicas
whose ranks share one machine's cores (the emulated cluster, ``cluster.cores``) do: each replica
is simulated on its share of the cores (:func:`replica_pools`), as every replica's ranks compute
at once, and its collectives' messages wait for cores every replica's busy ranks want at once (the
contention floor counts them: ``copies`` of :class:`sim.transport.TransportNetwork`; TP-2 x 2
replicas on 2 cores, ``c94``: TPOT 155 ms measured, 131 predicted, 74 with one replica's ranks
counted). On the testbed four one-rank replicas on 2 cores measured TPOT 81 ms, one rank alone
39 ms (``validation/plan-check-report/replicas/``, ``close-call/``). Where the profile measured
the machine's memory bandwidth at k streams (:class:`sim.cores.CorePool`), a replica's ranks
share it too: each simulated rank stands for every replica's rank at its place (``stands_for``),
so its ops stream at the share of all of them (measured quietly, two one-thread processes
streaming on the 2 cores each took 1.40 times as long, ``benchmarks/bench_machine_sharing.py``).

Whole-run metrics of R replicas (:func:`combined_timing`): the batch's throughput is the sum of
the replicas' (``decode_tokens_per_s``); its latencies are the slowest replica's (``ttft_s``,
``tpot_s``, ``e2e_latency_s``, loader stalls): the last request of the batch sees them. Each
replica's own latency and throughput are rows of their own (:func:`replica_rows`):
``replica_ttft_s``, ``replica_tpot_s``, ``replica_decode_tokens_per_s`` and
``replica_batch_size``, whose ``device`` is the replica's master device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from models.errors import ConfigError
from models.shards import apportion
from sim.cores import CorePool, core_shares
from sim.metrics import RESULT_COLUMNS
from sim.timeline import RunResult
from sim.trace import Trace
from sim.vocabulary import Metric, unit_of

# Latency-like metrics: the batch sees its slowest replica's.
_SLOWEST = (Metric.TTFT, Metric.TPOT, Metric.E2E_LATENCY, Metric.LOADER_STALL_PREFILL, Metric.LOADER_STALL_DECODE)
# Each replica's own figures, named after the whole-run metric they break down.
REPLICA_METRICS = {Metric.TTFT: Metric.REPLICA_TTFT, Metric.TPOT: Metric.REPLICA_TPOT,
                   Metric.DECODE_TOKENS_PER_S: Metric.REPLICA_DECODE_TOKENS_PER_S}


@dataclass(frozen=True)
class ReplicaRun:
    """One replica's simulated run of a variant: its ``ranks`` (the first its master), the
    ``batch_size`` sequences it serves, its run, trace and timing metrics."""

    ranks: tuple[int, ...]
    batch_size: int
    run: RunResult
    trace: Trace
    timing: dict[str, float]


def split_batch(batch_size: int, replicas: int) -> tuple[int, ...]:
    """The sequences each of ``replicas`` serves: the batch split as evenly as it goes, earlier
    replicas taking the extra sequence.

    Raises:
        ConfigError: on ``parallel.replicas`` when the batch has fewer sequences than replicas
            (a replica would idle).
    """
    if batch_size < replicas:
        raise ConfigError("parallel.replicas", f"{replicas} replicas need at least one sequence each, but "
                                               f"workload.batch_size is {batch_size} (got {replicas})")
    return apportion(batch_size, (1.0,) * replicas)


@dataclass(frozen=True)
class ReplicaTiming:
    """One replica's measured run of a variant (``hetsim measure``): its ``ranks`` (the first its
    master), the ``batch_size`` sequences it served and its timing metrics (medians over repeats)."""

    ranks: tuple[int, ...]
    batch_size: int
    timing: dict[str, float]


def replica_batch_scenario(scenario, replicas: int, index: int):
    """``scenario`` (:class:`sim.scenario.Scenario`) as replica ``index`` of ``replicas`` runs it:
    its workload's batch is the replica's share (:func:`split_batch`), the rest unchanged.

    Raises:
        ConfigError: as :func:`split_batch`.
    """
    if replicas == 1:
        return scenario
    config = scenario.config
    workload = config.workload.model_copy(update={"batch_size": split_batch(config.workload.batch_size, replicas)[index]})
    return scenario.model_copy(update={"config": config.model_copy(update={"workload": workload})})


def replica_pools(pools: Sequence[CorePool], replicas: Sequence[tuple[int, ...]],
                  replica: tuple[int, ...], computing: int | None = None) -> tuple[CorePool, ...]:
    """The core pools ``replica``'s ranks compute on when the replicas of one layout (``replicas``,
    each's ranks in the order of the first's) are simulated one at a time, ``computing`` of them
    (``replica`` and the first others; default all) computing at once.

    Replica ``i``'s rank ``t`` mirrors the first replica's rank ``t``: it is on the machine the
    latter is on, so a pool holding some replica's rank ``t`` holds every replica's, and of its
    ranks those of the computing replicas compute (a rank of no replica idles); so do a
    pipeline's stages on one machine (:mod:`sim.pipeline_run`). All of them
    compute the same ops at once (equal work, run together), so under processor sharing
    (:mod:`sim.cores`) each rank runs at the rate it would with all of them simulated: the
    replica's share of the pool's cores (:func:`sim.cores.core_shares`). Exact for replicas of
    equal batches; where the batch splits unevenly, a smaller replica's ranks leave the cores
    early in fact and the larger's finish a little sooner than simulated.
    """
    computing = len(replicas) if computing is None else computing
    busy = [replica, *[group for group in replicas if group != replica][:computing - 1]]
    shared = []
    for pool in pools:
        places = [t for t in range(len(replica)) if any(group[t] in pool.ranks for group in replicas)]
        if not places:
            continue
        machine = CorePool(frozenset(group[t] for group in busy for t in places), pool.cores, pool.background_cores,
                           pool.stream_bytes_per_s, pool.stands_for, pool.lag_per_block)
        shared.extend(core_shares(machine, frozenset(replica)))
    return tuple(shared)


def combined_timing(timings: Sequence[dict[str, float]]) -> dict[str, float]:
    """The whole-run metrics of the replicas together, from each one's timing metrics (see the
    module docstring)."""
    timing = {metric: max(t[metric] for t in timings) for metric in timings[0]}
    rates = [t[Metric.DECODE_TOKENS_PER_S] for t in timings]
    timing[Metric.DECODE_TOKENS_PER_S] = math.nan if any(math.isnan(x) for x in rates) else sum(rates)
    for metric in _SLOWEST:
        if metric in timing and any(math.isnan(t[metric]) for t in timings):
            timing[metric] = math.nan
    return timing


def replica_rows(scenario: str, variant: str, source: str, replicas: Sequence[ReplicaRun | ReplicaTiming],
                 device_names: Sequence[str]) -> pd.DataFrame:
    """Tidy rows of each replica's latency, throughput and batch share, simulated or measured;
    ``device`` is its master device (``device_names`` by topology rank)."""
    rows = []
    for replica in replicas:
        master = device_names[replica.ranks[0]]
        for metric, name in REPLICA_METRICS.items():
            rows.append((scenario, variant, source, name, replica.timing[metric], unit_of(name), master))
        rows.append((scenario, variant, source, Metric.REPLICA_BATCH_SIZE, float(replica.batch_size),
                     unit_of(Metric.REPLICA_BATCH_SIZE), master))
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)


def idle_rows(scenario: str, variant: str, source: str, idle_devices: Sequence[str]) -> pd.DataFrame:
    """One ``idle_device`` row (value 1) per device the layout leaves unused."""
    return pd.DataFrame([(scenario, variant, source, Metric.IDLE_DEVICE, 1.0, unit_of(Metric.IDLE_DEVICE), name)
                         for name in idle_devices], columns=RESULT_COLUMNS)
