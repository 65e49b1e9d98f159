"""The machine's core contention on small messages, timed on loopback after a calibration's launch.

Why: where a cluster's ranks outnumber the cores they share, a small message moves only once both
its ends are scheduled, so it costs a scheduling delay per core turn, not its wire time
(:func:`sim.calibrated.contention_floor`). A calibration over links without delay shows that delay
in its in-place calls; one whose links all have a delay cannot (the ranks sleep through the delay
and the cores are free), and its profile used to take a default fitted on another machine, which
priced this machine's clusters without delay +38..+54% TPOT from delayed-link profiles (issue 18,
session 29). The delay is the machine's, not the links': the same ranks in one loopback gloo group,
computing between calls as a decode step does, reproduce the in-place calls of the clusters without
delay (4 ranks on 2 cores: reduce 3.19-3.32 ms on loopback against 3.2 and 2.7 ms in place;
``benchmarks/bench_loopback_contention.py``). So every CPU calibration times them, as it times the
machine's memory bandwidth, after its launch: :func:`loopback_rows`.

How the delay grows with the ranks beyond the cores is the machine's too (this 2-vCPU machine: a
point-to-point turn with 3 ranks costs 0.41 of one with 4 in place, where processor sharing says
0.75 and the older machine gave 0.56-0.59), so the group is timed at several sizes
(:func:`loopback_sizes`: one rank beyond the cores, twice the cores, and the cluster's own), and a
target is priced from the size nearest its ranks on the machine.

The calls: each (kind, algorithm) of the profile's in-place calls at their smallest size (a decode
step's), over a group of every rank of the launch, each rank its own host (on loopback no schedule
has a host to keep inside; :func:`sim.calibrated.contention_floor` prices them alike). A round is a
decode step's pattern: :data:`COMPUTE_S` of one-thread matrix products before each call, a reduce's
broadcast right after it (reduce_ln_bcast: the leaves go from one to the other). Each call is
charged as an in-place call is: the last rank's start to the master's end
(:func:`runtime.comm_timing.in_place_rows`), each repeat the mean over a block of
:data:`ROUNDS_PER_BLOCK` rounds; rows of kind ``collective_loopback``, ``group_size`` and
``num_hosts`` the group's ranks.

The delay depends on the path a message takes, not on the machine alone: the same group, each rank
in its own network namespace of an emulated cluster (veth pairs and a bridge between them), costs
about half the core time a message of loopback's does and reproduces the in-place calls of the
clusters without delay (4 ranks on 2 cores, recursive doubling at 3 KiB: 1.67-1.95 ms between
namespaces, 2.85-3.29 on loopback, ``benchmarks/bench_contention_paths.py``). On the emulated
cluster inter-host messages take that path and intra-host ones loopback's, so a calibration on the
testbed also times the group between namespaces joined by a bridge without delay or shaping worth
the name (:func:`bridged_rows`, rows of kind ``collective_bridged``): the inter-host path of the
machine without the links' delay, which a cluster whose links all have one hides.
"""

from __future__ import annotations

import time

import pandas as pd
import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime.comm import Communicator
from runtime.comm_timing import CallSpan, in_place_rows
from runtime.launch import RankPlacement, launch
from sim.calibrated import one_host_each
from sim.cluster_config import ClusterConfig
from sim.plan import Collective
from sim.profile import MeasurementKind
from sim.topology import Topology, build_topology

COMPUTE_S = 0.5e-3
"""Compute before each call (s): of the order of a decode step's shard of a layer half on a CPU
core (GPT-2 at width 4). Measured: 4 ranks on 2 cores, 0.5 ms -> a 3 KiB reduce 3.19 ms, 2 ms ->
3.76 ms; the delay per turn depends on it weakly."""
MAX_RANKS = 8
"""The most processes a loopback group forks beyond the cluster's own ranks (a machine of many cores
whose cluster does not outnumber them is not timed at twice its cores)."""
ROUNDS_PER_BLOCK = 20
BLOCKS = 8
BRIDGE_RATE = "400Mbit/s"
"""The bridged group's links: within what the testbed emulates faithfully on this machine
(:func:`runtime.testbed.links.capacity_warnings`), a 3 KiB message's wire 61 us, a fifth of the
least core turn measured between namespaces (0.28 ms)."""
LOOPBACK_METHOD = ("the in-place calls' kinds and algorithms at their smallest size, over every rank of a loopback "
                   "gloo group of group_size ranks (each its own host) after the launch, 0.5 ms of compute before "
                   "each call: last rank's start to the master's end, each repeat a block of 20 rounds' mean call; "
                   "the median is charged")
BRIDGED_METHOD = LOOPBACK_METHOD.replace("a loopback gloo group of group_size ranks (each its own host)",
                                         "a gloo group of group_size ranks, each in its own testbed namespace on "
                                         "a bridge without delay")


def loopback_sizes(cores: int, cluster_ranks: int) -> tuple[int, ...]:
    """The group sizes a calibration times on loopback, on a machine of ``cores`` cores whose
    cluster had ``cluster_ranks`` ranks on it: those of one rank beyond the cores, twice the
    cores and the cluster's own that outnumber the cores, up to :data:`MAX_RANKS` or the
    cluster's ranks. Empty where none does (no rank would wait for a core)."""
    bound = max(cluster_ranks, MAX_RANKS)
    return tuple(sorted({n for n in (cores + 1, 2 * cores, cluster_ranks) if cores < n <= bound}))


def loopback_calls(profile: pd.DataFrame, group: tuple[int, ...]) -> list[Collective]:
    """The calls a loopback round makes: each (kind, algorithm) of ``profile``'s
    ``collective_in_place`` rows at their smallest size, over ``group`` rooted at its first rank,
    in the order a round makes them (each kind's reduce right before its broadcast)."""
    rows = profile[profile["measurement"] == MeasurementKind.COLLECTIVE_IN_PLACE]
    if not len(rows):
        return []
    rows = rows[rows["size_bytes"] == rows["size_bytes"].min()]
    order = {OpKind.ALLREDUCE.value: 0, OpKind.REDUCE.value: 1, OpKind.BROADCAST.value: 2}
    keys = sorted({(str(r.algorithm), order[str(r.op)], str(r.op), int(r.size_bytes))
                   for r in rows.itertuples(index=False)})
    return [Collective(OpKind(op), algorithm, group, size, root=None if op == OpKind.ALLREDUCE.value else group[0])
            for algorithm, _, op, size in keys]


def _busy(seconds: float, x: torch.Tensor, w: torch.Tensor) -> None:
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        x @ w


def time_calls(rank: int, calls: list[Collective], host_groups, world: int) -> list[CallSpan] | None:
    """One rank's part of a loopback round set (:data:`BLOCKS` x :data:`ROUNDS_PER_BLOCK` rounds of
    ``calls``, each group partitioned into hosts by ``host_groups``) in a launched gloo group of
    ``world`` ranks; rank 0 returns every rank's :class:`runtime.comm_timing.CallSpan`, the others
    None."""
    torch.set_num_threads(1)
    comm = Communicator(rank, host_groups)
    width = max(c.size_bytes for c in calls) // 4
    x, w = torch.randn(1, width), torch.randn(width, max(1, width // world))
    buffers = {c: torch.zeros(c.size_bytes // 4) for c in calls}
    spans: list[CallSpan] = []
    dist.barrier()
    # a reduce's broadcast follows it without compute between (reduce_ln_bcast's leaves)
    computes = [not (before is not None and call.kind == OpKind.BROADCAST and before.kind == OpKind.REDUCE
                     and before.algorithm == call.algorithm) for before, call in zip([None, *calls], calls)]
    for index in range(1 + BLOCKS * ROUNDS_PER_BLOCK):  # the first round warms up
        for number, call in enumerate(calls):
            if computes[number]:
                _busy(COMPUTE_S, x, w)
            if rank not in call.group:
                continue
            start = time.perf_counter()
            comm.run(call, buffers[call])
            if index:
                spans.append(CallSpan((index - 1) // ROUNDS_PER_BLOCK, (index, number), call.kind.value, rank,
                                      call.kind.value, call.algorithm, call.size_bytes, start, time.perf_counter()))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(spans, gathered, dst=0)
    return [s for part in gathered for s in part] if rank == 0 else None


def loopback_rows(profile: pd.DataFrame, cores: int, cluster_ranks: int) -> list[dict]:
    """``collective_loopback`` rows: :func:`loopback_calls` of ``profile`` timed over every rank of
    a loopback gloo group of each of :func:`loopback_sizes` (``cores``: the machine's, which
    ``cluster_ranks`` ranks shared), forked by :func:`runtime.launch.launch`; [] where the profile
    has no in-place calls, no size outnumbers the cores, or a GPU holds the ranks (NCCL's messages
    do not wait for a core). About 5 s per size with 4 ranks. Run after the launch, outside the
    ranks (and the testbed's namespaces).

    Raises:
        runtime.errors.LaunchError: a rank failed, died or hung."""
    return _timed_rows(profile, cores, cluster_ranks, MeasurementKind.COLLECTIVE_LOOPBACK, LOOPBACK_METHOD,
                       lambda world, body: launch(body, world)[0])


def bridged_topology(device_type: str, ranks: int) -> Topology:
    """``ranks`` hosts of one ``device_type`` rank each under one switch, every link
    :data:`BRIDGE_RATE` without delay: the testbed builds it as namespaces on a bridge, no
    forwarder on the path (:class:`runtime.testbed.Testbed`)."""
    hosts = [{"name": f"b{index}", "parent": "sw", "devices": {"type": device_type, "count": 1, "memory": "1TiB"},
              "nic": {"bandwidth": BRIDGE_RATE, "latency": "0s"}} for index in range(ranks)]
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": hosts}))


def bridged_rows(profile: pd.DataFrame, cores: int, cluster_ranks: int, name: str, device_type: str) -> list[dict]:
    """``collective_bridged`` rows: :func:`loopback_rows`' calls and sizes, each rank in its own
    host namespace of a testbed of :func:`bridged_topology` (``device_type``: the calibrated
    cluster's), named ``<name>.bridge<ranks>``, built and removed around its launch: the
    inter-host path of the emulated cluster without its links' delay. [] where the profile has no
    in-place calls, no size outnumbers the cores or a GPU holds the ranks. Root only, like the
    testbed; about 6 s per size with 4 ranks.

    Raises:
        runtime.testbed.TestbedError: not root, or building the testbed failed.
        runtime.errors.LaunchError: a rank failed, died or hung."""
    from runtime.testbed import Testbed, enter_namespace

    def launched(world: int, body) -> list:
        bed = Testbed(f"{name}.bridge{world}", bridged_topology(device_type, world))
        bed.down()  # what a killed calibration left
        bed.up(owned=True)
        try:
            placements = [RankPlacement(bed.namespace_of_rank(r), bed.master_address(), bed.interface)
                          for r in range(world)]
            return launch(body, world, placements=placements, enter_namespace=enter_namespace)[0]
        finally:
            bed.down()

    return _timed_rows(profile, cores, cluster_ranks, MeasurementKind.COLLECTIVE_BRIDGED, BRIDGED_METHOD, launched)


def _timed_rows(profile: pd.DataFrame, cores: int, cluster_ranks: int, kind: MeasurementKind, method: str,
                launched) -> list[dict]:
    """Rows of ``kind``: :func:`loopback_calls` timed at each of :func:`loopback_sizes` in the group
    ``launched(world, body)`` forks, as its rank 0 returns them."""
    if torch.cuda.is_available() or not loopback_calls(profile, (0,)):
        return []
    rows = []
    for world in loopback_sizes(cores, cluster_ranks):
        calls = loopback_calls(profile, tuple(range(world)))
        spans = launched(world, lambda rank, heartbeat: time_calls(rank, calls, one_host_each, world))
        rows += [{**row, "measurement": kind, "method": method}
                 for row in in_place_rows(spans, world, world, master=0)
                 if row["measurement"] == MeasurementKind.COLLECTIVE_IN_PLACE]
    return rows
