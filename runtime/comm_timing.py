"""Communication microbenchmarks of ``hetsim calibrate``, timed the way the simulator charges them.

The simulator starts a collective when the last rank of its group arrives and charges its
duration from there (:mod:`sim.engine`). Every timing here is therefore *last rank's start to last
rank's end* on one clock: rank 0's ``time.perf_counter``, which every rank reads through its
offset (:mod:`runtime.clock`; exactly zero for ranks of one machine). A rank that starts early
and waits for a late peer is not charged for the wait, which a barrier followed by a per-rank
stopwatch would do: on a link with 5 ms of delay, ranks leave a barrier up to a message latency
apart, and that skew read as up to 10 ms of a 24 ms collective.

* :class:`CollectiveSweep`: each algorithm of each kind in isolation. Every call starts at a
  deadline agreed on the shared clock, so every rank starts together and a call never overlaps
  the previous one (back-to-back broadcasts would measure throughput, not latency). The repeats
  run in rounds over every (kind, algorithm, size), not in a block per size: on a shared machine
  the speed drifts over tens of seconds, and a block that fell in a slow stretch made one size's
  median slower than a larger size's (a 1 MiB reduce over 5 ms links calibrated at 275 ms in one
  run and 120 ms in the next, p10 211 ms).
* :func:`in_place_rows`: the collectives a run actually calls, at the sizes it calls them, read
  from the op records of real generations as the master rank sees them: its wait for the last
  rank, and the rest of the call from that arrival to its own end. Inside a pipeline on shared
  cores a collective costs more than alone (ranks that finished it compute on the cores the
  others need to finish it; waiting ranks sleep and must be woken), and ranks arrive apart;
  this is the measurement the simulator prices a run's collectives from when it has it.
* :func:`p2p_rows`: half a ping-pong round trip per link class.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Hashable, NamedTuple

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime import clock
from sim.collectives.registry import ALGORITHMS, LIBRARY
from sim.context import LinkClass
from sim.plan import Collective
from sim.profile import MeasurementKind
from sim.trace import master_calls

SIZES_BYTES = tuple(1024 * 4**k for k in range(9))  # 1 KiB .. 64 MiB
P2P_SIZES_BYTES = tuple(1024 * 4**k for k in range(7))  # 1 KiB .. 4 MiB
WARM_MAX_BYTES = 1 << 20
"""The largest call :meth:`CollectiveSweep.round` warms up before timing it: above it a call's own
ramp-up of the connections' windows is a small part of it (over 5 ms links, the sweep of every
algorithm timed its 4 MiB and larger calls within 0-7% of the shorter sweep of the variants' own),
and the duplicate call would cost the most."""
PROBE_RTT_S = 0.3
"""The pause after that warm-up call (s): longer than the 200 ms a TCP connection that was idle
for 10 s spends with a congestion window of 4 segments under BBR (``bbr_probe_rtt_mode_ms`` and
``bbr_min_rtt_win_sec`` in the kernel's ``net/ipv4/tcp_bbr.c``; this machine's default congestion
control), so that the timed call meets the connections as a run's calls do, busy every few
milliseconds."""
ISOLATED_METHOD = ("calls started together at deadlines on the shared clock, in rounds over every "
                   f"algorithm and size, each up to {WARM_MAX_BYTES // 2**20} MiB right after an untimed call "
                   f"of it and a pause of {PROBE_RTT_S:g} s; last rank's start to last rank's end")
IN_PLACE_METHOD = ("collectives of real generations (op records): last rank's start to the master's end, "
                   "each repeat a generation's mean call; the median is charged")
CHAIN_METHOD = ("{chain} calls back to back from deadlines on the shared clock, in rounds over every "
                "algorithm and size; last rank's start of the first to last rank's end of the last, per call")
WAIT_METHOD = ("collectives of real generations (op records): the master's wait for the last rank's start, "
               "each repeat a generation's mean call; the median is charged")


def stats(values) -> dict:
    """``median``, ``p10``, ``p90``, ``mean`` and ``repeats`` of ``values`` (a profile row's statistics)."""
    values = np.asarray(values, dtype=float)
    return {"median": float(np.median(values)), "p10": float(np.percentile(values, 10)),
            "p90": float(np.percentile(values, 90)), "mean": float(np.mean(values)), "repeats": len(values)}


def _slowest_s(fn: Callable[[], None]) -> float:
    """One call of ``fn`` after a barrier, as the slowest rank timed it (s): an upper bound on a
    call, skew included, used to space the timed calls."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _agreed_deadline(lead_s: float) -> float:
    """Rank 0's clock plus ``lead_s``, as this rank's ``time.perf_counter`` reads that instant."""
    deadline = torch.tensor([time.perf_counter() + lead_s], dtype=torch.float64)
    dist.broadcast(deadline, src=0)
    return clock.to_local(float(deadline.item()))


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def synchronised_times(fn: Callable[[], None], calls: int, period_s: float, lead_s: float,
                       members: tuple[int, ...] | None = None) -> list[float]:
    """``calls`` calls of ``fn``, the i-th started by every rank at one deadline + i x ``period_s``.
    ``members``: the ranks whose calls are timed (None: every rank); the others take part in the
    agreement and gather only (their ``fn`` a no-op).

    Returns:
        Per call, the last member's end less the last member's start (s), on every rank.
    """
    first = _agreed_deadline(lead_s)
    spans = []
    for index in range(calls):
        _sleep_until(first + index * period_s)
        start = time.perf_counter()
        fn()
        spans.append((clock.to_shared(start), clock.to_shared(time.perf_counter())))
    local = torch.tensor(spans, dtype=torch.float64)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    stacked = torch.stack(every)  # [ranks, calls, (start, end)]
    if members is not None:
        stacked = stacked[list(members)]
    return (stacked[:, :, 1].max(dim=0).values - stacked[:, :, 0].max(dim=0).values).tolist()


def one_host_group(ranks, topology) -> tuple[int, ...] | None:
    """The ranks of ``ranks`` on ``ranks[0]``'s host, where ``ranks`` span hosts and that host
    holds at least two of them; else None: the group a calibration sweeps besides the whole one,
    so that a profile prices a collective inside a host from calls that stayed inside one
    (:func:`sim.transport.fit_intra_host`), not from calls that all crossed the hosts' link."""
    ranks = tuple(ranks)
    hosts = topology.host_groups(ranks)
    if len(hosts) < 2:
        return None
    host = next(tuple(group) for group in hosts if ranks[0] in group)
    return host if len(host) >= 2 else None


class CollectiveSweep:
    """Each algorithm of each collective kind timed alone (or ``chain`` calls back to back) at
    ``sizes`` and ``held_out`` (ascending; a kind's sizes stop once a call takes longer than
    ``max_call_s``), one call (or chain) of each per :meth:`round`, so that the rounds, not blocks
    of repeats, sample the machine's drift; and so that ``hetsim validate`` can interleave them
    with its other rounds.

    Building it warms every case up (which also builds its schedule) and agrees on the lead every
    call starts after. Every rank of ``ranks`` must build it and call :meth:`round` alike.

    Args:
        algorithms: which to time, by kind (default: ``library`` and every one the registry knows).
        held_out: sizes timed in the same rounds but written as ``collective_held_out`` rows, which
            the simulator does not read: checks of its interpolation that sampled the same
            stretch of the machine's time as the sizes it interpolates between.
        one_host: also sweep, in the same rounds, the ranks of ``ranks[0]``'s host
            (:func:`one_host_group`, where ``ranks`` span hosts): rows of their group size on
            1 host, which price collectives inside a host; the other ranks sleep in the
            round's agreement meanwhile. ``ranks`` must then be every rank of the run (the
            host's process group is made over the default group). Asleep through the lead,
            a TP-2 pair's 1-64 KiB calls on the quiet testbed cost 0.6-2.4 ms (medians of 3;
            about 1.4 ms reduce, 1.1 ms broadcast), about 2 and 3 times the same pair's calls
            inside a run (3 KiB: reduce 0.64-0.81 ms from the last arrival, broadcast
            0.29-0.40 ms to the receiver, medians; ``benchmarks/bench_pair_calls.py``), though
            lo's token bucket is full at every call either way (the lead time, at least 1 ms
            plus two agreements, refills its 128 KiB at 1 Gbit/s in 1.05 ms). A run's call
            follows compute, on cores that did not go idle; that the sleep is what costs is a
            hypothesis (this VM halts an idle vCPU: ``benchmarks/bench_gloo_small.py``) not yet
            checked by a quiet re-calibration (``validation/layouts-report/progress.md``).
        chain: calls of a case timed back to back per round (1: each call alone); a round's
            time is then the chain's span over ``chain``, the cost of a call queued behind
            another (the training calibration's buckets, and why:
            :data:`runtime.training.calibrate.BUCKET_CHAIN_CALLS`).

    Raises:
        ValueError: ``chain`` below 1.
    """

    def __init__(self, ranks, topology, rank: int, comm, max_call_s: float, heartbeat,
                 sizes: tuple[int, ...] = SIZES_BYTES, algorithms: dict[OpKind, tuple[str, ...]] | None = None,
                 held_out: tuple[int, ...] = (), one_host: bool = False, chain: int = 1):
        if chain < 1:
            raise ValueError(f"chain must be at least 1 call, got {chain}")
        self.ranks, self.rank, self.comm, self.heartbeat = tuple(ranks), rank, comm, heartbeat
        self.chain = chain
        self.sizes, self.held_out = tuple(sizes), tuple(held_out)
        self.topology = topology
        groups = [self.ranks]
        host = one_host_group(self.ranks, topology) if one_host else None
        if host is not None:
            process_group = dist.new_group(list(host))  # every rank of the run makes it
            comm.process_groups.setdefault(host, process_group)
            groups.append(host)
        # How long an agreed deadline takes to reach every rank: the lead every call starts after.
        self.lead_s = 2 * _slowest_s(lambda: _agreed_deadline(0.0)) + 1e-3
        self.cases = []  # (call, tensor): what is timed, found by warming each up in ascending sizes
        buffers: dict[int, torch.Tensor] = {}  # one per size, shared by the algorithms
        for group in groups:
            for kind in (OpKind.ALLREDUCE, OpKind.REDUCE, OpKind.BROADCAST):
                for algorithm in (algorithms or {}).get(kind, (LIBRARY, *ALGORITHMS[kind])):
                    for size in sorted(set(sizes) | set(held_out)):
                        call = Collective(kind, algorithm, group, size, group[0] if kind != OpKind.ALLREDUCE else None)
                        if size not in buffers:
                            buffers[size] = torch.empty(size // 4, dtype=torch.float32)
                        tensor = buffers[size].fill_(1.0)
                        heartbeat(f"warming up {kind} {algorithm} {size // 1024} KiB over {len(group)} ranks")
                        # warm-up, and it builds the schedule; every rank agrees whether it could
                        # (e.g. two_level_rs on hosts with different numbers of ranks cannot)
                        if not _everyone(self._warm(call, tensor)):
                            break
                        self.cases.append((call, tensor))
                        if _slowest_s(lambda: self._run(call, tensor)) > max_call_s:
                            break
        self.times: list[list[float]] = [[] for _ in self.cases]

    def _run(self, call: Collective, tensor: torch.Tensor) -> None:
        if self.rank in call.group:  # a rank outside the call's group sleeps in the agreement
            self.comm.run(call, tensor)

    def _warm(self, call: Collective, tensor: torch.Tensor) -> bool:
        try:
            self._run(call, tensor)
        except ValueError:
            return False
        return True

    def round(self, label: str) -> None:
        """Time every case once; ``label`` ("round 2 of 5") goes into the heartbeats.

        A case of at most :data:`WARM_MAX_BYTES` is timed after an untimed call of it and a pause
        of :data:`PROBE_RTT_S`: in a round of every algorithm a connection a case uses may have
        been idle for tens of seconds (the other cases' calls, up to a second each, over other
        pairs), and an idle connection is slow to carry a call of tens to hundreds of KiB, which
        a run's connections, busy every few milliseconds, are not. Measured on v4x1_latency's
        testbed (5 ms links; session 32 of ``validation/transfer-report/progress.md``): a
        256 KiB recursive-doubling allreduce 58 ms after 3 s idle, 103-122 ms after 12 s, 58 ms
        after 12 s with a warm-up call 0.3 s before; ``hetsim calibrate``'s sweep of every
        algorithm timed 64 KiB-1 MiB calls 12-33% slower than ``hetsim validate``'s sweep of the
        variants' algorithms, whose rounds are shorter, and priced the other clusters' TTFT
        10 / 23% off (median / p90) where the validation's profile of the same cluster gave
        4 / 12%."""
        for (call, tensor), spans in zip(self.cases, self.times):
            self.heartbeat(f"{call.kind} {call.algorithm} {call.size_bytes // 1024} KiB over {len(call.group)} "
                           f"ranks, {label}")
            tensor.fill_(1.0)  # sums of sums would overflow to inf over many rounds
            if call.size_bytes <= WARM_MAX_BYTES:
                self._run(call, tensor)
                time.sleep(PROBE_RTT_S)
            spans += [span / self.chain for span in synchronised_times(
                lambda: self._chain(call, tensor), 1, 0.0, self.lead_s, members=call.group)]

    def _chain(self, call: Collective, tensor: torch.Tensor) -> None:
        for _ in range(self.chain):
            self._run(call, tensor)

    def rows(self) -> list[dict]:
        """Profile rows of every round so far on ``ranks[0]``; an empty list elsewhere. Each row
        records its call's group shape (``group_size``, ``num_hosts``)."""
        if self.rank != self.ranks[0]:
            return []
        return [{"measurement": MeasurementKind.COLLECTIVE_HELD_OUT if call.size_bytes in self.held_out
                 and call.size_bytes not in self.sizes else MeasurementKind.COLLECTIVE, "op": str(call.kind),
                 "algorithm": call.algorithm, "group_size": len(call.group),
                 "num_hosts": len(self.topology.host_groups(call.group)),
                 "size_bytes": call.size_bytes, "unit": "s",
                 "method": ISOLATED_METHOD if self.chain == 1 else CHAIN_METHOD.format(chain=self.chain), **stats(spans)}
                for (call, _), spans in zip(self.cases, self.times)]


def _everyone(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective over the default group)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class CallSpan(NamedTuple):
    """One rank's record of one collective call of a real generation (times: s on the shared clock)."""

    generation: Hashable  # which generation the call belongs to
    call: Hashable  # which call of that generation (its step, layer and op name): one across ranks
    name: str  # the plan op's name ("attn_allreduce", "embed_bcast"): the call's place in a step
    rank: int
    kind: str
    algorithm: str
    size_bytes: int
    start_s: float
    end_s: float


def in_place_rows(spans: list[CallSpan], group_size: int, num_hosts: int, master: int) -> list[dict]:
    """Profile rows (``collective_in_place`` and ``collective_wait``) from the collectives of real
    generations, as the master sees them, per plan op (``call``: the op's name).

    The master's time inside a call splits into its wait for the last rank to arrive and the
    rest, from that arrival to its own end; its step is its compute, its gaps and these two, so
    charging both, per call, adds up to its step. The last rank's end is not the master's: a
    broadcast's root leaves before its leaves have received, and the master then waits for them
    at the next call, which is where this charges it.

    Per plan op, because both parts depend on where in a step the call sits, not only on its
    kind, algorithm and size: under reduce_ln_bcast the master broadcasts after its own
    LayerNorm, arriving last, and leaves at once (0.7 ms at 96 KiB over 5 ms links); allreduce_ln's
    one broadcast of a prefill, of the same size, starts the step before the other ranks have
    left the barrier (5.8 ms, and 5 ms of wait). Pooled, the second set the median that the first
    was charged 25 times a step.

    The statistics are over generations, each sample a generation's mean call: TTFT and TPOT are
    medians over generations of a step that sums many calls, so the simulator charges the median
    of these means (:data:`sim.calibrated.CHARGED`). Pooling every call instead lets one slow
    generation's calls weigh in its mean, or a fast majority of calls in its median, where the
    measured step has neither (on the 2-core testbed a slow stretch lasts about 20 s, the length
    of a few generations).

    Args:
        spans: every rank's collective records.
        group_size, num_hosts: the tensor-parallel group the calls ran over.
        master: the group's first rank.

    Returns:
        Per (op name, kind, algorithm, size), statistics over generations of the mean over the
        generation's calls of the master's end less the last start (``collective_in_place``) and
        of its wait (``collective_wait``: the last start, or its own end if earlier, less its
        start), as :func:`sim.trace.master_calls` splits a call. A call some rank did not record
        is left out.
    """
    table = pd.DataFrame(spans, columns=CallSpan._fields)
    keys = ["generation", "call"]
    ranks = table.groupby(keys, sort=False)["rank"]
    complete = table[(ranks.transform("nunique") == group_size) & ranks.transform(lambda r: (r == master).any())]
    seen = master_calls(complete, keys, master)
    spent: dict[tuple, dict[object, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in seen.itertuples(index=False):
        spent[(row.name, row.kind, row.algorithm, row.size_bytes)][row.generation].append((row.call_s, row.wait_s))
    rows = []
    for (name, kind, algorithm, size_bytes), generations in sorted(spent.items()):
        means = np.array([np.mean(calls, axis=0) for calls in generations.values()])  # [generations, 2]
        for index, (measurement, method) in enumerate(((MeasurementKind.COLLECTIVE_IN_PLACE, IN_PLACE_METHOD),
                                                       (MeasurementKind.COLLECTIVE_WAIT, WAIT_METHOD))):
            rows.append({"measurement": measurement, "call": name, "op": kind, "algorithm": algorithm,
                         "group_size": group_size, "num_hosts": num_hosts, "size_bytes": size_bytes, "unit": "s",
                         "method": method, **stats(means[:, index])})
    return rows


def p2p_rows(ranks, topology, rank, repeats: int, heartbeat) -> list[dict]:
    """Half a send/recv round trip between ``ranks[0]`` and a peer on its host and on another host,
    1 KiB to 4 MiB; profile rows on ``ranks[0]``."""
    rows = []
    master_host = topology.devices[ranks[0]].host
    peers = {LinkClass.INTRA_HOST: next((r for r in ranks[1:] if topology.devices[r].host == master_host), None),
             LinkClass.INTER_HOST: next((r for r in ranks[1:] if topology.devices[r].host != master_host), None)}
    for link_class, peer in peers.items():
        if peer is None:
            continue
        for size in P2P_SIZES_BYTES:
            heartbeat(f"p2p {link_class.value} {size // 1024} KiB")
            buffer = torch.ones(size // 4, dtype=torch.float32)
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if rank == ranks[0]:
                    dist.send(buffer, dst=peer)
                    dist.recv(buffer, src=peer)
                elif rank == peer:
                    dist.recv(buffer, src=ranks[0])
                    dist.send(buffer, dst=ranks[0])
                times.append((time.perf_counter() - start) / 2)
            if rank == ranks[0]:
                rows.append({"measurement": MeasurementKind.P2P, "device_class": link_class.value, "size_bytes": size, "unit": "s",
                             "method": "half a send/recv ping-pong round trip", **stats(times[1:])})
    return rows
