"""Transport terms that transfer between networks, fitted from a profile's collective sweep.

A message of ``n`` bytes over a path of one-way latency ``L`` (the sum of its channels') and
bottleneck bandwidth ``B`` costs, once both endpoints are ready::

    per_message_s + latencies_per_message x L + n / (bandwidth_efficiency x B)

the LogP/LogGP decomposition of a message's cost into software overhead, wire latency and gap
per byte (Culler et al., "LogP: towards a realistic model of parallel computation", PPoPP 1993;
Alexandrov et al., "LogGP", SPAA 1995). ``latencies_per_message`` is more than one where the
backend pays round trips per message: a gloo ``isend``/``irecv`` pair over TCP rendezvouses
before the payload moves (gloo ``gloo/transport/tcp/pair.cc``: a receiver announces its buffer,
then the sender writes), so a message costs about two to three one-way latencies, not one.

The terms are fitted per collective implementation (kind and algorithm: gloo's own ``library``
collectives and the runtime's point-to-point schedules pay different overheads) on the isolated
``collective`` rows of a profile: every schedule is priced over the calibrated cluster's links
(rebuilt from the profile's context, :mod:`sim.context`) by the flow model
(:class:`sim.network.FlowNetwork`, max-min fair sharing, per-rank finishes so that arrival skew
emerges), and the terms are those minimising the squared log error over the rows. The latency
count is fitted only where the calibrated links have at least two distinct delays of at least
:data:`IDENTIFIABLE_DELAY_S`: over one delay ``L``, ``o + k L`` is one number and any ``k`` fits
it with its own ``o``, and below that the delay is lost in the overhead. Else the backend's
default count is kept (:func:`default_terms`) and the overhead absorbs the rest. Never fitted on
a target's measurements.

A collective on any topology is then its schedule priced with these terms by
:class:`TransportNetwork`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from sim.cluster_config import ClusterConfig
from sim.collectives.registry import build_schedule
from sim.collectives.schedule import CommSchedule
from sim.context import CalibrationContext, LinkClass
from sim.network import CollectiveTiming, _FlowRun, _Route, _Routes
from sim.topology import Topology, build_topology

IDENTIFIABLE_DELAY_S = 1e-3
_LATENCY_COUNTS = (1.0, 1.5, 2.0, 2.5, 3.0)
_EFFICIENCIES = tuple(np.round(np.arange(0.5, 1.201, 0.1), 2))
_OVERHEADS_S = np.linspace(0.0, 5e-3, 201)


@dataclass(frozen=True)
class TransportTerms:
    """The per-message cost terms of one collective implementation (see the module docstring).

    Attributes:
        per_message_s: software overhead per message (s).
        latencies_per_message: one-way path latencies a message costs.
        bandwidth_efficiency: the fraction of the bottleneck bandwidth a message's bytes reach.
        source: where the terms come from (fitted on which rows, or a documented default).
    """

    per_message_s: float
    latencies_per_message: float
    bandwidth_efficiency: float
    source: str

    def describe(self) -> str:
        return (f"{self.per_message_s * 1e3:.2f} ms + {self.latencies_per_message:g} latencies per message, "
                f"{self.bandwidth_efficiency:.0%} of the bandwidth ({self.source})")


class _TransportRoutes(_Routes):
    """Routes whose latency and capacity include a :class:`TransportTerms`."""

    def __init__(self, topology: Topology, reduce_s_per_byte: Mapping[int, float] | None, terms: TransportTerms):
        super().__init__(topology, reduce_s_per_byte)
        self.terms = terms
        self.capacity = [c * terms.bandwidth_efficiency for c in self.capacity]

    def get(self, src: int, dst: int) -> _Route:
        key = (src, dst)
        route = self._cache.get(key)
        if route is None:
            path = self.topology.path(src, dst)
            latency_s = (self.terms.per_message_s
                         + self.terms.latencies_per_message * sum(c.latency_s for c in path))
            route = _Route(len(self._cache), latency_s, tuple(self.index[c.name] for c in path))
            self._cache[key] = route
            self.by_id.append(route)
        return route


def price(schedule: CommSchedule, topology: Topology, terms: TransportTerms,
          reduce_s_per_byte: Mapping[int, float] | None = None) -> CollectiveTiming:
    """``schedule`` priced by the flow model with ``terms`` on every message."""
    return _FlowRun(schedule, _TransportRoutes(topology, reduce_s_per_byte, terms)).run()


@dataclass
class TransportNetwork:
    """A network model pricing every collective as its schedule with fitted transport terms.

    Args:
        topology: the scenario's cluster.
        reduce_s_per_byte: gamma of every rank (s/byte), as the uncalibrated models take it.
        terms: per (kind, algorithm), the terms of that implementation.
        default: the terms of an implementation the profile did not time.
        gap_s: the framework's time between two ops, added to every collective.
    """

    topology: Topology
    reduce_s_per_byte: Mapping[int, float] | None
    terms: Mapping[tuple[str, str], TransportTerms]
    default: TransportTerms
    gap_s: float = 0.0
    extrapolated: set[str] = field(default_factory=set)
    _routes: dict[TransportTerms, _TransportRoutes] = field(default_factory=dict, repr=False)

    def time(self, schedule: CommSchedule, call: str | None = None) -> CollectiveTiming:
        """The timing of ``schedule`` (``call`` is ignored: no timing of a call is replayed)."""
        if len(schedule.group) == 1:
            return CollectiveTiming(0.0, {r: 0.0 for r in schedule.group})
        terms = self.terms.get((str(schedule.kind), schedule.algorithm))
        if terms is None:
            terms = self.default
            self.extrapolated.add(f"{schedule.kind} {schedule.algorithm}: not calibrated, {terms.describe()}")
        routes = self._routes.get(terms)
        if routes is None:
            routes = self._routes[terms] = _TransportRoutes(self.topology, self.reduce_s_per_byte, terms)
        timing = _FlowRun(schedule, routes).run()
        finish = {rank: t + self.gap_s for rank, t in timing.finish_s.items()}
        return CollectiveTiming(timing.duration_s + self.gap_s, finish)


def context_topology(context: CalibrationContext) -> Topology:
    """A cluster with the calibrated group's shape and links: hosts holding ``ranks_per_host``
    ranks of the first device type under one switch, the inter-host link's delay split over the
    two NICs, the intra-host link as a shared bus (as the shipped scenarios describe the
    emulated hosts). Where the context has several links of a class, the first (slowest) one."""
    def first(link_class: LinkClass):
        return next((l for l in context.links if l.link_class == link_class), None)

    inter, intra = first(LinkClass.INTER_HOST), first(LinkClass.INTRA_HOST)
    device = context.devices[0][0]
    hosts = []
    for index, ranks in enumerate(context.ranks_per_host):
        # An inter-host message crosses both hosts' buses too, where the hosts have one.
        bus_s = intra.delay_s if ranks > 1 and intra is not None else 0.0
        host = {"name": f"h{index}", "parent": "sw", "devices": {"type": device, "count": ranks, "memory": "1TiB"},
                "nic": {"bandwidth": f"{inter.rate_bytes_per_s if inter else 1e12}B/s",
                        "latency": f"{max(0.0, inter.delay_s / 2 - bus_s) if inter else 0.0}s"}}
        if ranks > 1 and intra is not None:
            host["interconnect"] = {"bandwidth": f"{intra.rate_bytes_per_s}B/s", "latency": f"{intra.delay_s}s",
                                    "shared": True}
        hosts.append(host)
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": hosts}))


def fit_terms(rows, topology: Topology, default: TransportTerms, name: str,
              reduce_s_per_byte: Mapping[int, float] | None = None) -> dict[tuple[str, str], TransportTerms]:
    """Fit :class:`TransportTerms` per (kind, algorithm) on a profile's isolated ``collective``
    rows (median times), each priced over the first ``group_size`` ranks of ``topology`` (the
    calibrated cluster); see the module docstring.

    Args:
        rows: the profile's ``collective`` rows.
        default: the backend's default terms; its latency count is kept where the links' delays
            cannot identify it.
        name: the calibrated cluster, named in each term's ``source``.
    """
    delays = {round(topology.path_latency_s(a, b), 6) for a in range(topology.num_ranks)
              for b in range(topology.num_ranks) if a != b}
    identifiable = len({d for d in delays if d >= IDENTIFIABLE_DELAY_S}) >= 2
    counts = _LATENCY_COUNTS if identifiable else (default.latencies_per_message,)
    fitted = {}
    for (kind, algorithm), of_kind in rows.groupby(["op", "algorithm"], sort=True):
        schedules, measured = [], []
        for row in of_kind.itertuples(index=False):
            group = tuple(range(int(row.group_size)))
            if len(group) > topology.num_ranks or row.size_bytes <= 0:
                continue
            schedules.append(build_schedule(kind, algorithm, group, int(row.size_bytes),
                                            root=None if kind == "allreduce" else group[0],
                                            host_groups=topology.host_groups(group)))
            measured.append(float(row.median))
        if not schedules:
            continue
        log_measured = np.log(np.array(measured))
        best = None
        for count in counts:
            for efficiency in _EFFICIENCIES:
                base = np.array([price(s, topology, TransportTerms(0.0, count, efficiency, ""), reduce_s_per_byte)
                                 .duration_s for s in schedules])
                probe = np.array([price(s, topology, TransportTerms(1e-3, count, efficiency, ""), reduce_s_per_byte)
                                  .duration_s for s in schedules])
                slope = (probe - base) / 1e-3  # messages on each schedule's critical path
                predicted = base[None, :] + _OVERHEADS_S[:, None] * slope[None, :]
                loss = ((np.log(np.maximum(predicted, 1e-9)) - log_measured[None, :]) ** 2).sum(axis=1)
                index = int(np.argmin(loss))
                if best is None or loss[index] < best[0] - 1e-12:
                    best = (float(loss[index]), float(_OVERHEADS_S[index]), count, float(efficiency))
        loss, overhead, count, efficiency = best
        rms = float(np.sqrt(loss / len(schedules)))
        fitted[(str(kind), str(algorithm))] = TransportTerms(
            overhead, count, efficiency,
            f"fitted on {name}'s {len(schedules)} isolated timings, rms log error {rms:.2f}"
            + ("" if identifiable else f"; latency count: the {default.source}"))
    return fitted


# Defaults of the gloo backend over TCP where a profile has no timing to fit a term on: gloo's
# own collectives (``library``) are modelled with their extra round of messages in their schedule
# (:mod:`sim.collectives.gloo`), so one latency per message; a point-to-point isend/irecv pays the
# rendezvous, two (the module docstring). Checked on the shipped profiles: with these counts the
# fitted overheads come out at 0-0.7 ms per message over both 3 ms and 5 ms links, and 0.4-1.1 ms
# without delay, where other counts need overheads that differ by the delay. No overhead and the
# full bandwidth where nothing is fitted: the uncalibrated model's figures.
GLOO_LIBRARY_LATENCIES = 1.0
GLOO_P2P_LATENCIES = 2.0


def default_terms(algorithm: str, source: str = "gloo/tcp default") -> TransportTerms:
    """The terms a collective implementation gets where nothing was fitted (see above)."""
    from sim.collectives.registry import LIBRARY

    latencies = GLOO_LIBRARY_LATENCIES if algorithm == LIBRARY else GLOO_P2P_LATENCIES
    return TransportTerms(0.0, latencies, 1.0, source)


def fit_profile(rows, context: CalibrationContext,
                reduce_s_per_byte: Mapping[int, float] | None = None) -> dict[tuple[str, str], TransportTerms]:
    """:func:`fit_terms` over the cluster ``context`` describes, each implementation's latency
    count defaulting to :func:`default_terms`'s."""
    topology = context_topology(context)
    fitted = {}
    for algorithm, of_algorithm in rows.groupby("algorithm", sort=True):
        fitted.update(fit_terms(of_algorithm, topology, default_terms(str(algorithm)), context.name,
                                reduce_s_per_byte))
    return fitted
