"""The cluster description as written in a scenario file: pydantic models, validated at the boundary.

A cluster is a tree of switches with hosts hanging below, each host holding devices::

    switches:
      - name: router
      - name: "gw{i}"
        count: 8
        parent: router
        uplink: {bandwidth: 300Mbit/s, latency: 1ms}
    hosts:
      - name: "home{i}"
        count: 8
        parent: "gw{i}"
        nic: {bandwidth: 1Gbit/s, latency: 50us}
        devices: {type: cpu, count: 1, memory: 8GiB}

A host with devices of several types lists them, in rank order::

        devices: [{type: rtx_4090, count: 1}, {type: rtx_3060_12gb, count: 1}]

``"{i}"`` in ``name`` and ``parent`` becomes the index 0..count-1 of the entry. Quantities are
parsed by :mod:`sim.units` here, so a bad one is reported with its location; after validation
every number is SI (``bandwidth_bytes_per_s``, ``latency_s``, ``memory_capacity_bytes``), while the
file keeps the short keys (``bandwidth``, ``latency``, ``memory``). Checks that need the whole tree
(unknown parents, duplicates, cycles, device types) live in :func:`sim.topology.build_topology`.

Counts are integers (``true`` is not a count) of at most :data:`MAX_COUNT` per entry, and the
whole cluster holds at most :data:`MAX_DEVICES` devices and :data:`MAX_HOSTS` hosts: past those
the topology alone (a route per pair of devices) would take longer than a simulation should.
Names are at most :data:`MAX_NAME_CHARS` characters.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag, field_validator,
                      model_validator)

from models.errors import ConfigError
from sim.units import parse_bandwidth, parse_duration, parse_size

MAX_COUNT = 1024
MAX_HOSTS = 1024
MAX_DEVICES = 1024
MAX_NAME_CHARS = 100

_STRICT = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
# Names end up in channel names ("host0/dev1.link:up"), so "/" and ":" would make them ambiguous.
_NAME_PATTERN = r"^([A-Za-z0-9_.-]|\{i\})+$"


class LinkConfig(BaseModel):
    """A link: ``{bandwidth: 10Gbit/s, latency: 10us, shared: false, burst: 32kB}``.

    A link is full duplex (one channel per direction, each with the full bandwidth) unless
    ``shared`` is true, in which case both directions, and for a host interconnect every device of
    the host, share one channel (shared memory, one shaped loopback, a radio medium).

    ``burst`` (bytes, optional) is the depth of a token bucket pacing the link at its bandwidth,
    as a Linux ``tbf`` qdisc shapes it (tc-tbf(8)): an idle link saves up to that many bytes'
    worth of tokens, which a message then sends at wire speed (:mod:`sim.token_bucket`). Absent:
    no bucket, the link's bandwidth at every instant (a NIC or a switch port). The emulated
    testbed's links are tbf-shaped and its scenarios declare the burst it applies.
    """

    model_config = _STRICT

    bandwidth_bytes_per_s: float = Field(alias="bandwidth")
    latency_s: float = Field(alias="latency")
    shared: StrictBool = False
    burst_bytes: int | None = Field(None, alias="burst")

    @field_validator("burst_bytes", mode="before")
    @classmethod
    def _parse_burst(cls, value: object) -> int | None:
        return None if value is None else parse_size(value)

    @field_validator("bandwidth_bytes_per_s", mode="before")
    @classmethod
    def _parse_bandwidth(cls, value: object) -> float:
        return parse_bandwidth(value)

    @field_validator("latency_s", mode="before")
    @classmethod
    def _parse_latency(cls, value: object) -> float:
        return parse_duration(value)


class SwitchConfig(BaseModel):
    """A switch (or router, gateway): ``{name, count=1, parent=None, uplink=None}``.

    ``uplink`` is the link to ``parent``; it is required exactly when ``parent`` is given.
    """

    model_config = _STRICT

    name: str = Field(pattern=_NAME_PATTERN, max_length=MAX_NAME_CHARS)
    count: StrictInt = Field(1, ge=1, le=MAX_COUNT)
    parent: str | None = Field(None, max_length=MAX_NAME_CHARS)
    uplink: LinkConfig | None = None

    @model_validator(mode="after")
    def _uplink_iff_parent(self) -> SwitchConfig:
        if self.parent is not None and self.uplink is None:
            raise ValueError(f"uplink is required because parent is given (parent {self.parent!r})")
        if self.parent is None and self.uplink is not None:
            raise ValueError("uplink given but no parent: a root switch has no uplink")
        return self


class DevicesConfig(BaseModel):
    """The devices of a host: ``{type: rtx_3060_12gb, count: 4, memory: 12GiB}``.

    ``type`` is a key of :data:`sim.devices.DEVICES`; ``memory`` overrides the catalog capacity.
    ``host_link`` is each device's own link from host memory (PCIe for a GPU), which streamed
    weights cross after the host's ``storage``; a CPU device has none (its memory is host memory).
    """

    model_config = _STRICT

    type: str = Field(max_length=MAX_NAME_CHARS)
    count: StrictInt = Field(1, ge=1, le=MAX_COUNT)
    memory_capacity_bytes: int | None = Field(None, alias="memory")
    host_link: LinkConfig | None = None

    @field_validator("memory_capacity_bytes", mode="before")
    @classmethod
    def _parse_memory(cls, value: object) -> int | None:
        return None if value is None else parse_size(value)


# The tags pydantic puts in an error's location for the two spellings of a host's devices; the
# scenario's error messages leave them out (sim.scenario.config_error_from).
DEVICE_UNION_TAGS = ("one-device-type", "device-types")


def _device_spelling(value: Any) -> str:
    return DEVICE_UNION_TAGS[1] if isinstance(value, list) else DEVICE_UNION_TAGS[0]


class HostConfig(BaseModel):
    """A host: its devices, its NIC to the parent switch, the interconnect between its devices.

    ``devices`` is one :class:`DevicesConfig` or a list of them (a host with several device
    types), numbered ``<host>/dev0, dev1, ...`` in the order written.

    ``nic`` is required when ``parent`` is given. With ``nic_per_device: false`` (the default) all
    devices of the host share one NIC, reached over the interconnect; with ``true`` each device has
    a NIC of its own (e.g. GPUDirect RDMA). ``interconnect`` is each device's link to the host bus;
    no fast shared memory is assumed, so it is required when the host has more than one device.
    ``storage`` is where weights streamed by a ``sliding_window`` memory policy are read from (a
    disk to host memory); it is one channel shared by every device of the host.
    """

    model_config = _STRICT

    name: str = Field(pattern=_NAME_PATTERN, max_length=MAX_NAME_CHARS)
    count: StrictInt = Field(1, ge=1, le=MAX_COUNT)
    parent: str | None = Field(None, max_length=MAX_NAME_CHARS)
    nic: LinkConfig | None = None
    nic_per_device: StrictBool = False
    interconnect: LinkConfig | None = None
    storage: LinkConfig | None = None
    devices: Annotated[Union[Annotated[DevicesConfig, Tag(DEVICE_UNION_TAGS[0])],
                             Annotated[list[DevicesConfig], Tag(DEVICE_UNION_TAGS[1]),
                                       Field(min_length=1, max_length=MAX_COUNT)]],
                       Discriminator(_device_spelling)]

    @property
    def device_groups(self) -> tuple[DevicesConfig, ...]:
        """The host's devices as written, one entry per type (one entry for the single spelling)."""
        return tuple(self.devices) if isinstance(self.devices, list) else (self.devices,)

    @property
    def device_count(self) -> int:
        """Devices of one such host, all types together."""
        return sum(group.count for group in self.device_groups)

    @model_validator(mode="after")
    def _required_links(self) -> HostConfig:
        if self.parent is not None and self.nic is None:
            raise ValueError(f"nic is required because parent is given (parent {self.parent!r})")
        if self.device_count > 1 and self.interconnect is None:
            raise ValueError(
                f"interconnect is required for a host with {self.device_count} devices; "
                "write e.g. interconnect: {bandwidth: 32GB/s, latency: 2us}"
            )
        return self


class ClusterConfig(BaseModel):
    """A whole cluster: ``switches`` (may be empty for a single host) and ``hosts`` (at least one).

    ``cores`` (optional): the CPU cores that every CPU rank of the cluster runs on, for a cluster
    whose hosts share one machine (the emulated testbed: network namespaces on one virtual
    machine, ``cores: 2``). Where its CPU ranks outnumber them, they take turns on the cores
    (:mod:`sim.cores`) and their messages pay the contention that costs
    (:data:`sim.transport.GLOO_CONTENTION_PER_TURN_S`). Absent: each rank has cores of its own.
    """

    model_config = _STRICT

    switches: list[SwitchConfig] = Field(default=[], max_length=MAX_COUNT)
    hosts: list[HostConfig] = Field(min_length=1, max_length=MAX_COUNT)
    cores: StrictInt | None = Field(None, ge=1, le=MAX_DEVICES)

    @model_validator(mode="after")
    def _bounded(self) -> ClusterConfig:
        """At most MAX_HOSTS hosts and MAX_DEVICES devices, naming the entry that goes past."""
        hosts = devices = 0
        for i, host in enumerate(self.hosts):
            hosts += host.count
            devices += host.count * host.device_count
            if hosts > MAX_HOSTS:
                raise ConfigError(f"hosts[{i}].count", f"the cluster would have {hosts} hosts, more than the "
                                                       f"{MAX_HOSTS} hetsim simulates (got {host.count})")
            if devices > MAX_DEVICES:
                field = f"hosts[{i}].devices.count" if host.device_count > host.count else f"hosts[{i}].count"
                value = host.device_count if field.endswith("devices.count") else host.count
                raise ConfigError(field, f"the cluster would have {devices} devices, more than the "
                                         f"{MAX_DEVICES} hetsim simulates (got {value})")
        return self
