"""The cluster as a tree: devices inside hosts, hosts below switches, links with bandwidth and latency.

Bandwidth is not uniform: devices of one host talk over a fast interconnect, hosts over slower
NICs and switch uplinks. A transfer from one rank to another crosses an ordered list of
**channels**; a channel is one direction of a full-duplex link (or one medium shared by both
directions and, for a host bus, by all devices of the host). Network models price transfers by
the channels they cross, and two flows on one channel share its bandwidth.

Routing (``Topology.path``):

- Same host: the source's interconnect up-channel, then the destination's interconnect
  down-channel (through the host bus). With a shared interconnect, the one channel ``<host>.bus``.
- Different hosts: the source's way out of its host (interconnect up, then the host NIC up that
  all devices of the host share; or, with ``nic_per_device``, the device's own NIC up), the uplink
  up-channels of the switches from the source side up to the lowest common ancestor switch (not
  the ancestor's own uplink), the uplink down-channels on the destination side, and the way into
  the destination host (NIC down, then interconnect down when the NIC is shared).

Channel names: ``<host>/dev<j>.link:up|down`` (interconnect), ``<host>.bus`` (shared
interconnect), ``<host>.nic:up|down`` (shared NIC), ``<host>/dev<j>.nic:up|down`` (NIC per
device), ``<switch>.uplink:up|down``; a ``shared`` NIC or uplink is one channel without the
``:up|down`` suffix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from models.errors import ConfigError
from sim.cluster_config import ClusterConfig, HostConfig, LinkConfig, SwitchConfig
from sim.devices import DeviceSpec, get_device


@dataclass(frozen=True)
class Channel:
    """One direction of a full-duplex link, or one medium shared by all who cross it.

    Attributes:
        name: unique in the topology, e.g. ``"host0.nic:up"``, ``"host0/dev1.link:down"``,
            ``"gw3.uplink:up"``, ``"host0.bus"``.
        bandwidth_bytes_per_s: capacity of this channel, bytes/s.
        latency_s: one-way latency added once per message crossing it, seconds.
        burst_bytes: depth of the token bucket pacing it (bytes), None for none
            (:attr:`sim.cluster_config.LinkConfig.burst_bytes`, :mod:`sim.token_bucket`).
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    burst_bytes: int | None = None


@dataclass(frozen=True)
class Device:
    """One device (one rank) of the cluster.

    Attributes:
        rank: index into ``Topology.devices``.
        name: ``"<host>/dev<j>"``, e.g. ``"host0/dev1"``.
        host: name of the host holding it.
        spec: catalog entry of its kind.
        memory_capacity_bytes: the cluster description's ``memory`` override, else the spec's.
    """

    rank: int
    name: str
    host: str
    spec: DeviceSpec
    memory_capacity_bytes: int


@dataclass(frozen=True)
class _Attachment:
    """How one device reaches the others: the channels in and out of its host, and its switch."""

    to_bus: tuple[Channel, ...]
    from_bus: tuple[Channel, ...]
    to_switch: tuple[Channel, ...]
    from_switch: tuple[Channel, ...]
    switch: str | None
    loader: tuple[Channel, ...] = ()


class Topology:
    """A built cluster: devices in rank order, the channels between them and the routes.

    Built by :func:`build_topology`; treat it as immutable. ``graph`` is a ``networkx.Graph`` whose
    nodes are devices (``kind="device"``, ``rank``), host buses (``kind="host"``, only for hosts
    with an interconnect) and switches (``kind="switch"``), and whose edges carry
    ``bandwidth_bytes_per_s``, ``latency_s``, ``burst_bytes``, ``kind`` (``"interconnect"``, ``"nic"``,
    ``"uplink"``) and ``channels`` (names of the channels of that link). It is a tree except that,
    with ``nic_per_device``, a device hangs both from its host bus and from its switch.
    """

    def __init__(
        self,
        devices: Sequence[Device],
        channels: Sequence[Channel],
        graph: nx.Graph,
        attachments: Sequence[_Attachment],
        uplinks: dict[str, tuple[Channel, Channel]],
        switch_tree: nx.DiGraph,
    ):
        """Internal: use :func:`build_topology`. ``switch_tree`` has an edge parent -> child."""
        self.devices: tuple[Device, ...] = tuple(devices)
        self.hosts: tuple[str, ...] = tuple(dict.fromkeys(device.host for device in self.devices))
        self.channels: tuple[Channel, ...] = tuple(channels)
        self.graph: nx.Graph = graph
        self._attachments = tuple(attachments)
        self._uplinks = uplinks
        roots = [switch for switch, num_parents in switch_tree.in_degree() if num_parents == 0]
        # Each switch with its ancestors, bottom-up to the root: routes only strip the common part.
        self._ancestry: dict[str, tuple[str, ...]] = {
            switch: tuple(reversed(chain))
            for root in roots
            for switch, chain in nx.single_source_shortest_path(switch_tree, root).items()
        }
        self._paths: dict[tuple[int, int], tuple[Channel, ...]] = {}
        self._loader_paths = tuple(attachment.loader for attachment in self._attachments)

    @property
    def num_ranks(self) -> int:
        """Number of devices (ranks) in the cluster."""
        return len(self.devices)

    def ranks_of_host(self, host: str) -> tuple[int, ...]:
        """Ranks of the devices of ``host``, in order. Raises ValueError for an unknown host."""
        if host not in self.hosts:
            raise ValueError(f"unknown host {host!r}; known: {', '.join(self.hosts)}")
        return tuple(device.rank for device in self.devices if device.host == host)

    def same_host(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` are devices of one host. Raises ValueError for a rank out
        of range."""
        return self._device(a).host == self._device(b).host

    def host_groups(self, ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The given ranks grouped by host: hosts in topology order, ranks in the given order.

        Hosts without any of the ranks are left out. Raises ValueError for a rank out of range.
        """
        groups: dict[str, list[int]] = {host: [] for host in self.hosts}
        for rank in ranks:
            groups[self._device(rank).host].append(rank)
        return tuple(tuple(group) for group in groups.values() if group)

    def path(self, src: int, dst: int) -> tuple[Channel, ...]:
        """The directed channels a transfer from rank ``src`` to rank ``dst`` crosses, in order.

        Cached per pair. Raises ValueError if ``src == dst`` or a rank is out of range.
        """
        key = (src, dst)
        if key not in self._paths:
            self._paths[key] = self._route(src, dst)
        return self._paths[key]

    def loader_path(self, rank: int) -> tuple[Channel, ...]:
        """The channels streamed weights cross to reach ``rank``: its host's storage, then its own
        host link, either absent when not configured (empty for neither).

        Raises ValueError for a rank out of range.
        """
        self._device(rank)
        return self._loader_paths[rank]

    def path_latency_s(self, src: int, dst: int) -> float:
        """One-way latency from ``src`` to ``dst``: the sum of the channel latencies, seconds."""
        return sum(channel.latency_s for channel in self.path(src, dst))

    def path_bandwidth_bytes_per_s(self, src: int, dst: int) -> float:
        """Bottleneck bandwidth from ``src`` to ``dst``: the smallest on the path, bytes/s."""
        return min(channel.bandwidth_bytes_per_s for channel in self.path(src, dst))

    def path_burst_bytes(self, src: int, dst: int) -> int | None:
        """The token-bucket depth of the path's narrowest channel (bytes; the first of equals),
        None where that channel has no bucket: what paces a message from ``src`` to ``dst``."""
        return min(self.path(src, dst), key=lambda channel: channel.bandwidth_bytes_per_s).burst_bytes

    def _device(self, rank: int) -> Device:
        if not 0 <= rank < len(self.devices):
            raise ValueError(f"rank {rank} out of range: the topology has {len(self.devices)} ranks")
        return self.devices[rank]

    def _route(self, src: int, dst: int) -> tuple[Channel, ...]:
        if src == dst:
            raise ValueError(f"no path from rank {src} to itself")
        same_host = self.same_host(src, dst)
        source, target = self._attachments[src], self._attachments[dst]
        if same_host:
            # A shared bus is one channel both ways: the transfer crosses it once.
            if source.to_bus == target.from_bus:
                return source.to_bus
            return source.to_bus + target.from_bus
        assert source.switch is not None and target.switch is not None  # build_topology guarantees it
        up, down = self._ancestry[source.switch], self._ancestry[target.switch]
        # Dropping the shared tail (the lowest common ancestor and above) leaves the switches
        # whose uplinks the transfer climbs on the source side and descends on the other.
        shared = 0
        while shared < min(len(up), len(down)) and up[-1 - shared] == down[-1 - shared]:
            shared += 1
        climb = tuple(self._uplinks[switch][0] for switch in up[: len(up) - shared])
        descend = tuple(self._uplinks[switch][1] for switch in reversed(down[: len(down) - shared]))
        return source.to_switch + climb + descend + target.from_switch


def _link_channels(name: str, link: LinkConfig) -> tuple[Channel, Channel]:
    """The (up, down) channels of a link; the same channel twice when the link is shared."""
    if link.shared:
        channel = Channel(name, link.bandwidth_bytes_per_s, link.latency_s, link.burst_bytes)
        return channel, channel
    return (
        Channel(f"{name}:up", link.bandwidth_bytes_per_s, link.latency_s, link.burst_bytes),
        Channel(f"{name}:down", link.bandwidth_bytes_per_s, link.latency_s, link.burst_bytes),
    )


def _expand(entry: SwitchConfig | HostConfig, field: str) -> list[tuple[str, str | None]]:
    """(name, parent) of each of the ``count`` items of an entry, ``"{i}"`` replaced by the index."""
    if entry.count > 1 and "{i}" not in entry.name:
        problem = f"count is {entry.count} but the name has no '{{i}}', so names would repeat"
        raise ConfigError(f"{field}.name", f"{problem} (got {entry.name!r})")
    def at(template: str | None, index: int) -> str | None:
        return None if template is None else template.replace("{i}", str(index))

    return [(entry.name.replace("{i}", str(index)), at(entry.parent, index)) for index in range(entry.count)]


def _add_link(
    graph: nx.Graph, lower: str, upper: str, kind: str, link: LinkConfig, channels: tuple[Channel, Channel]
) -> None:
    graph.add_edge(
        lower,
        upper,
        kind=kind,
        bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
        latency_s=link.latency_s,
        burst_bytes=link.burst_bytes,
        channels=tuple(dict.fromkeys(channel.name for channel in channels)),
    )


class _Builder:
    """Accumulates switches, hosts and channels in declaration order, checking as it goes."""

    def __init__(self, field: str):
        self.field = field
        self.graph = nx.Graph()
        self.switch_tree = nx.DiGraph()
        self.channels: dict[str, Channel] = {}
        self.uplinks: dict[str, tuple[Channel, Channel]] = {}
        self.devices: list[Device] = []
        self.attachments: list[_Attachment] = []
        self._declared_at: dict[str, str] = {}

    def declare(self, name: str, entry_field: str) -> None:
        if name in self._declared_at:
            problem = f"duplicate name, already declared at {self._declared_at[name]}"
            raise ConfigError(f"{entry_field}.name", f"{problem} (got {name!r})")
        self._declared_at[name] = entry_field

    def register(self, *channels: Channel) -> None:
        for channel in channels:
            self.channels.setdefault(channel.name, channel)

    def add_switches(self, entries: Sequence[SwitchConfig]) -> None:
        switches: list[tuple[str, str | None, LinkConfig | None, str]] = []
        for index, entry in enumerate(entries):
            entry_field = f"{self.field}.switches[{index}]"
            for name, parent in _expand(entry, entry_field):
                self.declare(name, entry_field)
                switches.append((name, parent, entry.uplink, entry_field))
                self.switch_tree.add_node(name)
                self.graph.add_node(name, kind="switch")
        root: str | None = None
        for name, parent, uplink, entry_field in switches:
            if parent is None:
                if root is not None:
                    problem = f"a second root switch; only one may have no parent and {root!r} has none"
                    raise ConfigError(f"{entry_field}.parent", f"{problem} (got {name!r} without parent)")
                root = name
                continue
            self.check_parent(parent, entry_field)
            assert uplink is not None  # SwitchConfig requires an uplink with a parent
            self.switch_tree.add_edge(parent, name)
            self.uplinks[name] = _link_channels(f"{name}.uplink", uplink)
            self.register(*self.uplinks[name])
            _add_link(self.graph, name, parent, "uplink", uplink, self.uplinks[name])
        # Every non-root switch has exactly one known parent, so the switches form a tree with a
        # single root unless some of them form a cycle (which is also the case when no root exists).
        try:
            cycle = nx.find_cycle(self.switch_tree)
        except nx.NetworkXNoCycle:
            return
        loop = " -> ".join([parent for parent, _ in cycle] + [cycle[0][0]])
        parent, child = cycle[0]
        child_field = next(entry_field for name, _, _, entry_field in switches if name == child)
        problem = f"switches form a cycle {loop}"
        raise ConfigError(f"{child_field}.parent", f"{problem} (got {parent!r} as parent of {child!r})")

    def check_parent(self, parent: str, entry_field: str) -> None:
        if parent not in self.switch_tree:
            known = ", ".join(self.switch_tree) or "none"
            raise ConfigError(f"{entry_field}.parent", f"unknown switch; known: {known} (got {parent!r})")

    def add_host(
        self, host: str, parent: str | None, entry: HostConfig, specs: Sequence[DeviceSpec], entry_field: str
    ) -> None:
        """``specs``: the catalog entry of each of ``entry.device_groups``."""
        self.declare(host, entry_field)
        if parent is not None:
            self.check_parent(parent, entry_field)
        names, groups = [], []
        for group, spec in zip(entry.device_groups, specs):
            memory_capacity_bytes = group.memory_capacity_bytes
            if memory_capacity_bytes is None:
                memory_capacity_bytes = spec.memory_capacity_bytes
            for _ in range(group.count):
                name = f"{host}/dev{len(names)}"
                names.append(name)
                groups.append(group)
                self.graph.add_node(name, kind="device", rank=len(self.devices))
                self.devices.append(Device(len(self.devices), name, host, spec, memory_capacity_bytes))

        to_bus: dict[str, tuple[Channel, ...]] = {name: () for name in names}
        from_bus: dict[str, tuple[Channel, ...]] = {name: () for name in names}
        if entry.interconnect is not None:
            self.graph.add_node(host, kind="host")
            bus = _link_channels(f"{host}.bus", entry.interconnect) if entry.interconnect.shared else None
            for name in names:
                up, down = bus or _link_channels(f"{name}.link", entry.interconnect)
                to_bus[name], from_bus[name] = (up,), (down,)
                self.register(up, down)
                _add_link(self.graph, name, host, "interconnect", entry.interconnect, (up, down))

        to_switch: dict[str, tuple[Channel, ...]] = {name: () for name in names}
        from_switch: dict[str, tuple[Channel, ...]] = {name: () for name in names}
        if parent is not None:
            assert entry.nic is not None  # HostConfig requires a NIC with a parent
            if entry.nic_per_device:
                for name in names:
                    up, down = _link_channels(f"{name}.nic", entry.nic)
                    to_switch[name], from_switch[name] = (up,), (down,)
                    self.register(up, down)
                    _add_link(self.graph, name, parent, "nic", entry.nic, (up, down))
            else:
                up, down = _link_channels(f"{host}.nic", entry.nic)
                self.register(up, down)
                # Without an interconnect the host's single device is its only endpoint.
                endpoint = host if entry.interconnect is not None else names[0]
                _add_link(self.graph, endpoint, parent, "nic", entry.nic, (up, down))
                for name in names:
                    to_switch[name], from_switch[name] = to_bus[name] + (up,), (down,) + from_bus[name]
        storage = ()
        if entry.storage is not None:
            # Reads only flow from storage into memory: one channel, shared by the host's devices.
            storage = (Channel(f"{host}.storage", entry.storage.bandwidth_bytes_per_s, entry.storage.latency_s,
                                entry.storage.burst_bytes),)
            self.register(*storage)
        for name, group in zip(names, groups):
            host_link = ()
            if group.host_link is not None:
                host_link = (_link_channels(f"{name}.host_link", group.host_link)[1],)
                self.register(*host_link)
            attachment = _Attachment(to_bus[name], from_bus[name], to_switch[name], from_switch[name], parent,
                                     storage + host_link)
            self.attachments.append(attachment)

    def topology(self) -> Topology:
        channels = tuple(self.channels.values())
        return Topology(self.devices, channels, self.graph, self.attachments, self.uplinks, self.switch_tree)


def build_topology(config: ClusterConfig, field: str = "cluster") -> Topology:
    """Build the :class:`Topology` described by ``config``.

    ``field`` is the dotted path of ``config`` in the scenario, used in error messages.

    Raises:
        ConfigError: naming the field (e.g. ``cluster.hosts[0].parent``) and the value for a
            duplicate name, a name with count > 1 but no ``{i}``, an unknown parent, switches that
            form a cycle or have more than one root, a missing host parent in a multi-host
            cluster, or an unknown device type.
    """
    builder = _Builder(field)
    builder.add_switches(config.switches)
    num_hosts = sum(entry.count for entry in config.hosts)
    for index, entry in enumerate(config.hosts):
        entry_field = f"{field}.hosts[{index}]"
        several = isinstance(entry.devices, list)
        specs = [get_device(group.type, field=f"{entry_field}.devices{f'[{j}]' if several else ''}.type")
                 for j, group in enumerate(entry.device_groups)]
        if entry.parent is None and num_hosts > 1:
            problem = f"required when the cluster has more than one host ({num_hosts})"
            raise ConfigError(f"{entry_field}.parent", f"{problem} (got None)")
        for host, parent in _expand(entry, entry_field):
            builder.add_host(host, parent, entry, specs, entry_field)
    return builder.topology()
