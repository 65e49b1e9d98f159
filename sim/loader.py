"""Weight loads in simulated time: streamed blocks crossing the loader's links, sharing them.

A weight load of ``size_bytes`` to a rank crosses :meth:`sim.topology.Topology.loader_path` (the
host's storage, then the device's host link). It first waits the path's latency, then moves its
bytes at a max-min fair share of every channel on its path (progressive filling, Bertsekas and
Gallager, *Data Networks*, section 6.5.2), recomputed whenever a load starts or ends, so the
devices of a host that stream at once split its storage bandwidth. A calibration profile may cap
a device's load rate below the links' (the measured throughput of reading and deserialising a
block); the cap acts as one more channel private to the load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import simpy

if TYPE_CHECKING:
    from sim.engine import SegmentResult

from models.errors import ConfigError
from sim.network import max_min_rates
from sim.plan import Segment
from sim.topology import Topology


def check_loader_paths(topology: Topology, ranks: tuple[int, ...]) -> None:
    """Raise ConfigError if a rank has nowhere to stream weights from (no storage, no host link)."""
    for rank in ranks:
        if not topology.loader_path(rank):
            device = topology.devices[rank]
            raise ConfigError("memory.policy", f"sliding_window streams weights to {device.name}, but its host has "
                                               "no storage link and the device no host_link; add e.g. "
                                               "cluster.hosts[].storage: {bandwidth: 2GB/s, latency: 100us} "
                                               "(got 'sliding_window')")


class LoaderLinks:
    """The weight loads in flight in one simulated segment (one per :class:`simpy.Environment`).

    ``rate_cap(rank)`` is a per-load throughput limit (bytes/s) or None.
    """

    def __init__(self, env: simpy.Environment, topology: Topology,
                 rate_cap: Callable[[int], float | None] = lambda rank: None):
        self.env = env
        self.topology = topology
        self.rate_cap = rate_cap
        self._routes: list[tuple[int, ...]] = []  # route id -> channel ids (a cap is a channel of its own)
        self._capacity: list[float] = []
        self._channel_id: dict[str, int] = {}
        self._route_of_rank: dict[int, int] = {}
        self._flows: dict[int, list] = {}  # flow id -> [remaining bytes, route id, done event]
        self._rates: dict[int, float] = {}
        self._updated_s = 0.0
        self._generation = 0
        self._next_flow = 0

    def load(self, rank: int, size_bytes: int):
        """A simpy process body: the load of ``size_bytes`` to ``rank``, from start to arrival."""
        path = self.topology.loader_path(rank)
        yield self.env.timeout(sum(c.latency_s for c in path))
        if size_bytes <= 0:
            return
        done = self.env.event()
        self._advance()
        self._flows[self._next_flow] = [float(size_bytes), self._route(rank), done]
        self._next_flow += 1
        self._reshare()
        yield done

    def _route(self, rank: int) -> int:
        if rank not in self._route_of_rank:
            ids = []
            for channel in self.topology.loader_path(rank):
                if channel.name not in self._channel_id:
                    self._channel_id[channel.name] = len(self._capacity)
                    self._capacity.append(channel.bandwidth_bytes_per_s)
                ids.append(self._channel_id[channel.name])
            cap = self.rate_cap(rank)
            if cap is not None:
                ids.append(len(self._capacity))
                self._capacity.append(cap)
            self._route_of_rank[rank] = len(self._routes)
            self._routes.append(tuple(ids))
        return self._route_of_rank[rank]

    def _advance(self) -> None:
        elapsed = self.env.now - self._updated_s
        for flow_id, flow in self._flows.items():
            flow[0] -= self._rates.get(flow_id, 0.0) * elapsed
        self._updated_s = self.env.now

    def _reshare(self) -> None:
        counts: dict[int, int] = {}
        for _, route, _ in self._flows.values():
            counts[route] = counts.get(route, 0) + 1
        per_route = max_min_rates(counts, self._routes, self._capacity)
        self._rates = {f: per_route[flow[1]] for f, flow in self._flows.items()}
        self._generation += 1
        if self._flows:
            wait = min(max(flow[0], 0.0) / self._rates[f] for f, flow in self._flows.items())
            self.env.process(self._wake(wait, self._generation))

    def _wake(self, wait_s: float, generation: int):
        yield self.env.timeout(wait_s)
        if generation != self._generation:
            return  # a load started or ended meanwhile and rescheduled
        self._advance()
        # Relative to the clock: at a simulated time of hours (a 1 bit/s link) a float's rounding
        # leaves a remainder worth more than 1e-12 s, and an absolute tolerance would wake forever.
        tolerance_s = 1e-12 * max(1.0, self.env.now)
        finished = [f for f, flow in self._flows.items() if flow[0] / self._rates[f] <= tolerance_s]
        for f in finished:
            self._flows.pop(f)[2].succeed()
        self._reshare()


def stall_s(segment: Segment, result: SegmentResult) -> float:
    """Time the slowest rank's program waited for weight loads in one segment instance (s).

    An op waits for a load when the load ends after the op's other dependencies (its previous op);
    the wait is the op's start minus the latest end among those other dependencies.
    """
    worst = 0.0
    for rank, program in segment.programs.items():
        starts, ends = result.starts[rank], result.ends[rank]
        waited = 0.0
        for i, op in enumerate(program):
            if op.after and any(program[d].load is not None for d in op.after) and op.load is None:
                ready = max((float(ends[d]) for d in op.after if program[d].load is None), default=0.0)
                waited += max(0.0, float(starts[i]) - ready)
        worst = max(worst, waited)
    return worst
