"""The shared network of one simulated segment: every transfer in flight shares the links it crosses.

Semantics (what :mod:`sim.engine` relies on and the tests pin down):

* One :class:`Fabric` lives inside the simpy environment of a segment. Whatever moves bytes
  while the segment runs goes through it, whoever issued it: weight loads (:meth:`Fabric.load`,
  over :meth:`sim.topology.Topology.loader_path`), point-to-point sends (:meth:`Fabric.send`,
  over :meth:`sim.topology.Topology.path`) and the point-to-point transfers of a collective's
  schedule (:meth:`Fabric.collective`), with the dependency semantics documented at the top of
  :mod:`sim.network` (a rank's steps in order, reductions one at a time at the receiver).
* A transfer first waits its path's latency, then its bytes flow. All flowing transfers share
  every channel max-min fairly (progressive filling; Bertsekas and Gallager, *Data Networks*,
  2nd ed., section 6.5.2), rates recomputed at each arrival and departure. A calibrated ceiling
  on a rank's load rate (the measured throughput of reading and deserialising a block) is one
  more channel, private to that rank's loads.
* This is the fluid model of :class:`sim.network.FlowNetwork` (same routes, same solver and
  solution cache, :class:`sim.network.Links`, same dependency semantics,
  :class:`sim.network._ScheduleRun`), run against everything else in flight instead of an idle
  network: one fluid model, two drivers (simpy events here, a private event loop there).
* A collective run here releases each rank at ``start + fluid finish + extra_s[rank]``, never
  before its fluid finish; the engine sets ``extra_s`` to the priced timing (closed form,
  cached, or calibrated) less the idle fluid timing, so a collective that meets no other traffic
  takes exactly its priced time, and contention adds the delay the fluid model attributes to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import simpy

from sim.collectives.schedule import CommSchedule
from sim.network import Links, Route, _ScheduleRun
from sim.token_bucket import TokenBuckets

# A flow whose remaining time at its rate is below this share of the clock has arrived (rounding
# of the byte counts). Relative: at a simulated time of hours (a 1 bit/s link) a float's rounding
# leaves a remainder worth more than 1e-12 s, and an absolute tolerance would wake forever.
_ARRIVED_REL = 1e-12


class Fabric:
    """The transfers in flight in one segment (one per :class:`simpy.Environment`).

    Args:
        env: the segment's environment.
        links: routes, capacities, gamma and the rate-solution cache, shared across segments.
        load_rate_cap: ``load_rate_cap(rank)``: a calibrated ceiling on the rate of a weight load
            to ``rank`` (bytes/s), or None for none.
        buckets: the links' token buckets, at the segment's start (default: full).
    """

    def __init__(self, env: simpy.Environment, links: Links,
                 load_rate_cap: Callable[[int], float | None] = lambda rank: None,
                 buckets: TokenBuckets | None = None):
        self.env = env
        self.links = links
        self.load_rate_cap = load_rate_cap
        self._flows: dict[int, list] = {}  # flow id -> [remaining bytes, route id, on arrival]
        self._rates: dict[int, float] = {}  # flow id -> bytes/s
        self._updated_s = 0.0
        self._generation = 0
        self._next_flow = 0
        # Full at the segment's start unless given (:mod:`sim.token_bucket`, :mod:`sim.bucket_clock`).
        self._buckets = buckets if buckets is not None else links.buckets()

    def transfer(self, route: Route, size_bytes: float) -> simpy.Event:
        """An event that succeeds when ``size_bytes`` issued now over ``route`` have arrived."""
        done = self.env.event()
        self.issue(route, size_bytes, lambda: done.succeed())
        return done

    def send(self, src: int, dst: int, size_bytes: float) -> simpy.Event:
        """A point-to-point send of ``size_bytes`` from rank ``src`` to rank ``dst``, issued now."""
        return self.transfer(self.links.get(src, dst), size_bytes)

    def load(self, rank: int, size_bytes: float) -> simpy.Event:
        """A weight load of ``size_bytes`` to ``rank``, issued now (storage, host link, rate cap)."""
        return self.transfer(self.links.loader(rank, self.load_rate_cap(rank)), size_bytes)

    def collective(self, schedule: CommSchedule, extra_s: Mapping[int, float]) -> dict[int, simpy.Event]:
        """Run ``schedule`` from now; for each rank of its group, an event that succeeds at its
        finish plus ``extra_s[rank]`` (s; a negative one releases it at its finish)."""
        return _FabricRun(schedule, self, extra_s).released

    def issue(self, route: Route, size_bytes: float, on_arrival: Callable[[], None]) -> None:
        """Start a transfer now; ``on_arrival()`` is called at the simulated time its bytes are in."""
        if route.latency_s > 0:
            self.env.timeout(route.latency_s).callbacks.append(
                lambda _: self._flow(route.id, size_bytes, on_arrival))
        else:
            self._flow(route.id, size_bytes, on_arrival)

    def flow(self, route: Route, size_bytes: float, on_arrival: Callable[[], None]) -> None:
        """Let ``size_bytes`` flow over ``route`` from now, its latency already waited;
        ``on_arrival()`` is called when they are in."""
        self._flow(route.id, size_bytes, on_arrival)

    def _flow(self, route_id: int, size_bytes: float, on_arrival: Callable[[], None]) -> None:
        if size_bytes <= 0:
            on_arrival()
            return
        self._advance()
        if self._buckets:  # what the links' buckets let through at once
            size_bytes -= self._buckets.start(self.links.channels_of[route_id], size_bytes, self.env.now)
        self._flows[self._next_flow] = [float(size_bytes), route_id, on_arrival]
        self._next_flow += 1
        self._reshare()

    def _advance(self) -> None:
        elapsed = self.env.now - self._updated_s
        if elapsed:
            rates = self._rates
            for flow_id, flow in self._flows.items():
                flow[0] -= rates.get(flow_id, 0.0) * elapsed
        self._updated_s = self.env.now

    def _reshare(self) -> None:
        flows = self._flows
        self._generation += 1
        if not flows:
            self._rates = {}
            return
        per_route = self.links.rates(tuple(sorted(flow[1] for flow in flows.values())))
        self._rates = rates = {f: per_route[flow[1]] for f, flow in flows.items()}
        wait = min(max(flow[0], 0.0) / rates[f] for f, flow in flows.items())
        self.env.timeout(wait).callbacks.append(partial(self._wake, self._generation))

    def _wake(self, generation: int, _event: simpy.Event) -> None:
        if generation != self._generation:
            return  # a flow started or ended meanwhile and rescheduled
        self._advance()
        rates = self._rates
        arrived_s = _ARRIVED_REL * max(1.0, self.env.now)
        finished = [f for f, flow in self._flows.items() if flow[0] / rates[f] <= arrived_s]
        ended = [self._flows.pop(f) for f in finished]
        if self._buckets:
            for flow in ended:
                self._buckets.end(self.links.channels_of[flow[1]], self.env.now)
        arrivals = [flow[2] for flow in ended]
        self._reshare()
        for on_arrival in arrivals:
            on_arrival()


class _FabricRun(_ScheduleRun):
    """One run of a schedule on a :class:`Fabric`, started at the environment's current time."""

    def __init__(self, schedule: CommSchedule, fabric: Fabric, extra_s: Mapping[int, float]):
        super().__init__(schedule, fabric.links)
        self.fabric = fabric
        self.env = fabric.env
        self.start_s = self.env.now
        self.extra_s = extra_s
        self.released = {rank: self.env.event() for rank in schedule.group}
        self._begin()

    def _start(self, transfer: int) -> None:
        route, size_bytes = self.route[transfer], self.transfers[transfer].size_bytes
        if not self.in_order or size_bytes <= 0:
            self.fabric.issue(route, size_bytes, partial(self._on_arrival, transfer))
        elif route.latency_s > 0:
            self.env.timeout(route.latency_s).callbacks.append(partial(self._on_latency_over, transfer))
        else:
            self._latency_over(transfer)

    def _on_latency_over(self, transfer: int, _event: simpy.Event) -> None:
        self.now = self.env.now - self.start_s
        self._latency_over(transfer)

    def _flow(self, transfer: int) -> None:
        self.fabric.flow(self.route[transfer], self.transfers[transfer].size_bytes, partial(self._on_arrival, transfer))

    def _on_arrival(self, transfer: int) -> None:
        self.now = self.env.now - self.start_s
        if self.in_order and self.transfers[transfer].size_bytes > 0:
            self._flowed(transfer)
        self._arrived(transfer)

    def _reduce_until(self, time_s: float, transfer: int) -> None:
        self.env.timeout(time_s - self.now).callbacks.append(partial(self._on_reduced, transfer))

    def _on_reduced(self, transfer: int, _event: simpy.Event) -> None:
        self.now = self.env.now - self.start_s
        self._complete(self.transfers[transfer].dst, transfer)

    def _done(self, rank: int) -> None:
        extra = self.extra_s.get(rank, 0.0)
        if extra > 0:
            self.env.timeout(extra).callbacks.append(lambda _: self.released[rank].succeed())
        else:
            self.released[rank].succeed()
