"""What each emulated host gets from the topology: names, an address, link rates and delays.

Derivation (a host stands for all of its devices, which share its namespace and address):

- **Inter-host rates**: the host's uplink and downlink rate is the smallest bandwidth on the way
  from its first device up to the root switch: interconnect (when the NIC is shared), NIC, and
  the uplink of every switch above it. Exact for a star. In a deeper tree a switch uplink shared
  by several hosts is emulated as if each of them had it alone, and a transfer between two hosts
  under the same switch is still paced by uplinks it would not cross; emulate such trees with
  the uplinks as the bottleneck only when that is what you mean to measure.
- **Delays**: ``one_way_delay_s`` is the sum of the latencies on the same way up to the root;
  for a star, the path latency between two hosts is the sum of their two delays. The forwarder
  does not rely on that: it holds every packet for the topology's own path latency between the
  two hosts (:func:`pair_delays_s`), which is exact for any tree. Delays of at most
  ``cluster.UNDELAYED_MAX_S`` are not injected: the hosts then meet on a bridge, whose own
  latency (tens of microseconds) stands in for them.
- **Intra-host rate**: the path bandwidth between two devices of the host (the interconnect), or
  None for a single device. ``lo`` is shaped to it as one bucket shared by all devices and both
  directions (measured here, see :mod:`runtime.testbed`), which is exact for one transfer at a time and an
  approximation for concurrent ones, except with a ``shared`` interconnect, where it is exact.
  Intra-host latency (microseconds) is not emulated.
- **Bursts**: every shaped device is a tbf (:mod:`runtime.testbed.shaping`) whose bucket is the
  declared ``burst`` of the link that sets its rate (the narrowest on the way, the interconnect's
  for ``lo``); None where that link declares none.
- Links marked ``shared`` (one channel for both directions) are emulated full duplex; hosts with
  ``nic_per_device`` are emulated with one NIC of the per-device bandwidth (one address per host).

Names: a scenario's testbed is marked by the prefix ``hs`` + 6 hex digits of the SHA-1 of the
scenario name: its namespaces are ``<prefix>-<host>`` and its forwarder's command line ends with
the prefix, so two scenarios' testbeds never collide and ``down`` finds a crashed one's objects.
Its devices (``eth0``, ``eth0-down``, ``lo``) exist only inside its namespaces, where short fixed
names cannot collide, so the 15-character limit on device names never bites. Addresses are
``10.77.<i // 250>.<i % 250 + 1>/16`` for the i-th host, used only inside the testbed's namespaces.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.topology import Topology

SUBNET_PREFIX_LENGTH = 16
# Measured here (see :mod:`runtime.testbed`): the 2 cores cap what the links can emulate faithfully.
MAX_INTER_HOST_BYTES_PER_S = 500e6 / 8
MAX_INTRA_HOST_BYTES_PER_S = 1e9 / 8


@dataclass(frozen=True)
class HostLinks:
    """The emulated network of one host.

    Attributes:
        host: host name in the topology.
        namespace: its network namespace, ``<prefix>-<host>``.
        address: IPv4 address of its ``eth0``, e.g. ``"10.77.0.1"``.
        uplink_bytes_per_s: rate of its traffic to other hosts, bytes/s (inf: not shaped, for a
            cluster of one host).
        downlink_bytes_per_s: rate of its traffic from other hosts, bytes/s (inf: not shaped).
        one_way_delay_s: latency from its devices up to the root switch, seconds.
        intra_bytes_per_s: rate shared by the traffic between its own devices (``lo``), bytes/s;
            None for a host with one device.
        burst_bytes: the declared token-bucket depth of the link setting the inter-host rate
            (bytes), None where it declares none.
        intra_burst_bytes: the same for ``lo`` (the interconnect's), None where none.
    """

    host: str
    namespace: str
    address: str
    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    one_way_delay_s: float
    intra_bytes_per_s: float | None
    burst_bytes: int | None = None
    intra_burst_bytes: int | None = None


def scenario_prefix(scenario_name: str) -> str:
    """The 8-character prefix of every kernel object of the scenario's testbed, e.g. ``"hs1f3a9c"``."""
    return "hs" + hashlib.sha1(scenario_name.encode()).hexdigest()[:6]


def host_address(index: int) -> str:
    """IPv4 address of the ``index``-th host (0-based): ``10.77.0.1``, ``10.77.0.2``, ..."""
    return f"10.77.{index // 250}.{index % 250 + 1}"


def _route_to_root(topology: Topology, rank: int) -> list[dict[str, Any]]:
    """Attributes of the graph edges from device ``rank`` up to the root switch, bottom-up.

    Empty for a host without a switch (a cluster of one host). Which end of an uplink is the
    child comes from the channel names, ``<child>.uplink[:up|:down]`` (see sim.topology).
    """
    adjacency = topology.graph.adj

    def edge(node: str, kind: str) -> tuple[str, dict[str, Any]] | None:
        return next(((other, data) for other, data in adjacency[node].items() if data["kind"] == kind), None)

    node = topology.devices[rank].name
    route: list[dict[str, Any]] = []
    step = edge(node, "nic")
    bus = edge(node, "interconnect")
    if step is None and bus is not None:  # the host's shared NIC, behind the interconnect
        step = edge(bus[0], "nic")
        if step is not None:
            route.append(bus[1])
    while step is not None:
        node, data = step
        route.append(data)
        step = next(((other, data) for other, data in adjacency[node].items()
                     if data["kind"] == "uplink" and data["channels"][0].split(":")[0] == f"{node}.uplink"), None)
    return route


def host_links(topology: Topology, prefix: str) -> dict[str, HostLinks]:
    """Each host's :class:`HostLinks`, in topology order, derived as the module docstring says."""
    links = {}
    for index, host in enumerate(topology.hosts):
        ranks = topology.ranks_of_host(host)
        route = _route_to_root(topology, ranks[0])
        narrowest = min(route, key=lambda data: data["bandwidth_bytes_per_s"], default=None)
        rate = math.inf if narrowest is None else narrowest["bandwidth_bytes_per_s"]
        links[host] = HostLinks(
            host=host,
            namespace=f"{prefix}-{host}",
            address=host_address(index),
            uplink_bytes_per_s=rate,
            downlink_bytes_per_s=rate,
            one_way_delay_s=sum(data["latency_s"] for data in route),
            intra_bytes_per_s=topology.path_bandwidth_bytes_per_s(ranks[0], ranks[1]) if len(ranks) > 1 else None,
            burst_bytes=None if narrowest is None else narrowest["burst_bytes"],
            intra_burst_bytes=topology.path_burst_bytes(ranks[0], ranks[1]) if len(ranks) > 1 else None,
        )
    return links


def pair_delays_s(topology: Topology) -> list[list[float]]:
    """One-way delay between hosts i and j (topology order): the path latency between their
    first devices, seconds; 0 on the diagonal."""
    first = [topology.ranks_of_host(host)[0] for host in topology.hosts]
    return [[0.0 if i == j else topology.path_latency_s(a, b) for j, b in enumerate(first)]
            for i, a in enumerate(first)]


def capacity_warnings(links: dict[str, HostLinks]) -> tuple[str, ...]:
    """One line per host whose links are faster than this machine can emulate faithfully
    (measured here: inter-host <= 500 Mbit/s, intra-host <= about 1 Gbit/s on 2 cores);
    there the CPU, not the shaping, sets the measured times."""
    warnings = []
    for link in links.values():
        inter = max(link.uplink_bytes_per_s, link.downlink_bytes_per_s)
        if math.isfinite(inter) and inter > MAX_INTER_HOST_BYTES_PER_S:
            warnings.append(f"{link.host}: inter-host {inter * 8 / 1e6:.0f} Mbit/s exceeds the "
                            f"{MAX_INTER_HOST_BYTES_PER_S * 8 / 1e6:.0f} Mbit/s this machine can emulate")
        if link.intra_bytes_per_s is not None and link.intra_bytes_per_s > MAX_INTRA_HOST_BYTES_PER_S:
            warnings.append(f"{link.host}: intra-host {link.intra_bytes_per_s * 8 / 1e6:.0f} Mbit/s exceeds the "
                            f"{MAX_INTRA_HOST_BYTES_PER_S * 8 / 1e6:.0f} Mbit/s this machine can emulate")
    return tuple(warnings)
