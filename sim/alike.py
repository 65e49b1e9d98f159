"""Groups laid out alike, and replicas that run alike: what lets the simulator price work once and
reuse it, rank for rank, where it would come out the same.

:func:`group_shape` names what prices work on a group of ranks besides the work itself;
:func:`sharing_shape` a group's share of the cores it computes on (:mod:`sim.cores`). Two groups of
one shape and one sharing shape get the same times from the engine for the same ops, rank for
rank: the engine prices an op by its rank's device type, reduction cost, cores and the routes to
the other ranks, never by the rank's number (a pipeline's alike stages, :mod:`sim.pipeline_run`;
a serving replica's iteration costs, :mod:`sim.serving.simulate`).

Replicas of a tensor-parallel layout (:mod:`sim.replicas`) are simulated each as a run of its
own. :func:`replica_twins` finds those that run exactly as an earlier one; the simulator then
copies that one's run and trace to their ranks (:func:`relabel_run`, :func:`relabel_trace`)
instead of simulating them, and the outputs are those of simulating each, byte for byte
(``tests/test_replicas.py``). A replica is another's twin when everything its run depends on is
the same at each place of the group:

* the batch share (:func:`sim.replicas.split_batch`: 5 sequences over 3 replicas serve 2, 1, 1:
  the first runs alone) and the tensor shards (:attr:`sim.parallel.ParallelPlan.replica_shards`);
* the group's shape (device types, reduction costs, routes, hosts) and, per place, the device's
  memory capacity and the runtime's own memory (overflows and peaks);
* its share of the cores (:func:`sim.replicas.replica_pools`, ``cluster.cores``);
* its ranks in the same order as the other's, so that the trace, sorted by rank, lists the copied
  rows in the order the simulation would.

Not covered (every replica simulated): weights streamed from a loader (the loader paths are not
part of a group's shape), and replicas of a pipeline, whose hops share links with every other
replica's (``mirrors`` in :mod:`sim.pipeline_run`), so that a replica's run depends on where the
others' hops go.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from sim.cores import CorePool
from sim.engine import SegmentResult
from sim.memory import PhaseMemory
from sim.network import Links
from sim.plan import Plan
from sim.timeline import PhaseRun, RunResult
from sim.topology import Topology
from sim.trace import Trace


def sharing_shape(pools: tuple[CorePool, ...], ranks: tuple[int, ...]) -> tuple:
    """``pools`` (a group's share of the cores) with each rank named by its place in ``ranks``:
    two groups laid out alike whose shares have one shape are priced alike."""
    local = {r: i for i, r in enumerate(ranks)}
    return tuple((tuple(sorted(local[r] for r in pool.ranks)), pool.cores, pool.background_cores,
                  pool.stream_bytes_per_s, pool.stands_for, pool.lag_per_block) for pool in pools)


def group_shape(topology: Topology, links: Links, ranks: tuple[int, ...]) -> tuple:
    """What prices work on a group besides the work itself: its devices, reduction costs, hosts,
    and the routes between its ranks (latency, and channels numbered in order of first use with
    their capacity and latency), all by the rank's place in the group. Two groups of one shape are
    laid out alike: the engine gives the same ops on them the same times, rank for rank."""
    local = {r: i for i, r in enumerate(ranks)}
    channels: dict[int, int] = {}
    routes = []
    for a in ranks:
        for b in ranks:
            if a != b:
                route = links.get(a, b)
                routes.append((route.latency_s, tuple(channels.setdefault(c, len(channels)) for c in route.channels)))
    return (tuple(topology.devices[r].spec.name for r in ranks), tuple(links.gamma[r] for r in ranks), tuple(routes),
            tuple((links.capacity[c], topology.channels[c].latency_s) for c in channels),
            tuple(tuple(local[r] for r in group) for group in topology.host_groups(ranks)))


def replica_twins(topology: Topology, links: Links, replicas: Sequence[tuple[int, ...]], batches: Sequence[int],
                  shards: Sequence[tuple | None], pools: Sequence[tuple[CorePool, ...]],
                  runtime_memory: Mapping[int, int]) -> tuple[int, ...]:
    """For each replica (its ranks ``replicas[i]``, ``batches[i]`` sequences, tensor ``shards[i]``,
    its share of the cores ``pools[i]``), the first replica that runs exactly as it does (see the
    module docstring): itself where none does. ``runtime_memory``: the runtime's own bytes per rank."""
    first: dict[tuple, int] = {}
    twins = []
    for i, ranks in enumerate(replicas):
        key = (tuple(sorted(range(len(ranks)), key=ranks.__getitem__)), batches[i], shards[i],
               group_shape(topology, links, ranks),
               tuple(topology.devices[r].memory_capacity_bytes for r in ranks),
               tuple(runtime_memory.get(r, 0) for r in ranks), sharing_shape(pools[i], ranks))
        twins.append(first.setdefault(key, i))
    return tuple(twins)


def relabel_result(result: SegmentResult, ranks: Mapping[int, int]) -> SegmentResult:
    """``result`` with each rank ``r`` renamed ``ranks[r]`` (its memory ledgers, where built, shared)."""
    return SegmentResult({ranks[r]: v for r, v in result.starts.items()}, {ranks[r]: v for r, v in result.ends.items()},
                         result.duration_s, result.algorithms, {ranks[r]: v for r, v in result.ledgers.items()})


def _relabel_memory(memory: PhaseMemory, ranks: Mapping[int, int]) -> PhaseMemory:
    overflow = memory.overflow
    return memory if overflow is None else replace(memory, overflow=replace(overflow, rank=ranks[overflow.rank]))


def relabel_run(run: RunResult, plan: Plan, ranks: Mapping[int, int]) -> RunResult:
    """The run of ``plan`` (a tensor-parallel replica's, :func:`replica_twins`) that is ``run``
    with each rank ``r`` renamed ``ranks[r]``: the same times and memory, on ``plan``'s ranks.

    Raises:
        KeyError: a rank of ``run`` that ``ranks`` does not rename.
    """
    simulated = {step: PhaseRun(plan.phase(step), tuple(relabel_result(res, ranks) for res in phase.results),
                                phase.duration_s, {ranks[r]: _relabel_memory(m, ranks) for r, m in phase.memory.items()})
                 for step, phase in run.simulated.items()}
    overflow = run.overflow and replace(run.overflow, rank=ranks[run.overflow.rank])
    return RunResult(plan, run.step_start_s, run.step_end_s, simulated,
                     {ranks[r]: v for r, v in run.peak_bytes.items()},
                     {ranks[r]: v for r, v in run.peak_by_category.items()},
                     {ranks[r]: v for r, v in run.step_base_bytes.items()}, overflow)


def _renamed(table: pd.DataFrame, ranks: Mapping[int, int]) -> pd.DataFrame:
    if table.empty:
        return table
    column = table["rank"].to_numpy()
    found, index = np.unique(column, return_inverse=True)
    return table.assign(rank=np.array([ranks[int(r)] for r in found], dtype=column.dtype)[index])


def relabel_trace(trace: Trace, ranks: Mapping[int, int]) -> Trace:
    """``trace`` with each rank ``r`` renamed ``ranks[r]`` in its ops, memory samples and peaks
    (rows in their order: ``ranks`` must keep the ranks' order for the tables to stay sorted by
    rank, as :func:`replica_twins` ensures)."""
    return Trace(_renamed(trace.ops, ranks), trace.steps, _renamed(trace.memory, ranks), _renamed(trace.peaks, ranks))
