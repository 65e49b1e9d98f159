"""The testbed: a scenario's cluster built from network namespaces, shaped links and a delay forwarder.

Layout (FIELD-NOTES section 5 for the facts, :mod:`runtime.testbed.links` for the derivation):

- one network namespace per host, ``<prefix>-<host>``; its ranks all live in it;
- ``eth0`` in each: a TUN device (MTU 9000, RPS on its receive queue so that packets arriving
  from the forwarder are not reordered across CPUs) with the host's address in 10.77.0.0/16; the
  kernel routes traffic for the other hosts into it. Ranks set ``GLOO_SOCKET_IFNAME=eth0``
  (:attr:`Testbed.interface`), else gloo binds 127.0.0.1;
- uplink: tbf on ``eth0``; downlink: tbf on the ifb ``eth0-down`` that ``eth0``'s ingress is
  redirected to (:mod:`runtime.testbed.shaping`);
- delay: one forwarder process per testbed moves packets between the TUN devices, each held for
  the path latency between the two hosts (:mod:`runtime.testbed.forwarder`); the kernel has no
  netem;
- intra-host: ranks of one host reach each other over ``lo`` even when they dial the ``eth0``
  address, so a tbf on ``lo`` at the interconnect rate shapes that traffic, one bucket per host.

State: ``/run/hetsim/<scenario>.json`` records the namespaces and the forwarder's pid, written
before anything is built; ``down`` also finds namespaces by their name prefix and forwarders by
their command line, so it cleans up after an ``up`` that was killed midway.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.testbed import forwarder
from runtime.testbed.errors import TestbedError
from runtime.testbed.links import (SUBNET_PREFIX_LENGTH, HostLinks, capacity_warnings, host_links,
                                   pair_delays_s, scenario_prefix)
from runtime.testbed.netns import ip, list_namespaces, require_privileges, write_sysfs
from runtime.testbed.shaping import shape_egress, shape_ingress, tbf_in_force

if TYPE_CHECKING:
    from sim.topology import Topology

STATE_DIR = Path("/run/hetsim")
INTERFACE = forwarder.INTERFACE
INTER_HOST_MTU_BYTES = 9000
LOOPBACK_MTU_BYTES = 65536


class Testbed:
    """The emulated cluster of one scenario; building it needs root (:func:`require_privileges`).

    Attributes:
        scenario_name: the scenario it emulates; names the state file.
        prefix: ``hs`` + 6 hex digits, the start of every namespace name of this testbed.
        hosts: each host's :class:`~runtime.testbed.links.HostLinks`, in topology order.
        interface: the device every rank must give gloo (``GLOO_SOCKET_IFNAME``), ``"eth0"``.
        warnings: one line per host whose links are faster than this machine emulates faithfully.
        state_path: ``/run/hetsim/<scenario>.json``.
    """

    __test__ = False  # not a pytest test class despite its name
    interface = INTERFACE

    def __init__(self, scenario_name: str, topology: Topology):
        """Derive the link settings; builds nothing (see :meth:`up`).

        Raises:
            TestbedError: a scenario name that cannot name a file (letters, digits, ``_.-`` only).
        """
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", scenario_name) or scenario_name in (".", ".."):
            raise TestbedError("testbed", f"the scenario name must be letters, digits, '_', '.', '-' "
                                          f"(got {scenario_name!r})")
        self.scenario_name = scenario_name
        self.prefix = scenario_prefix(scenario_name)
        self.hosts: dict[str, HostLinks] = host_links(topology, self.prefix)
        self.warnings = capacity_warnings(self.hosts)
        self.state_path = STATE_DIR / f"{scenario_name}.json"
        self._log_path = STATE_DIR / f"{scenario_name}.forwarder.log"
        self._delays_s = pair_delays_s(topology)
        self._host_index = {host: index for index, host in enumerate(self.hosts)}
        self._rank_hosts = tuple(self.hosts[device.host] for device in topology.devices)
        self._forwarder: subprocess.Popen | None = None

    def namespace_of_rank(self, rank: int) -> str:
        """The network namespace rank ``rank`` must enter. Raises IndexError for an unknown rank."""
        return self._rank_hosts[rank].namespace

    def address_of_rank(self, rank: int) -> str:
        """The IPv4 address of rank ``rank``'s host. Raises IndexError for an unknown rank."""
        return self._rank_hosts[rank].address

    def master_address(self) -> str:
        """The address of rank 0's host: the rendezvous address of the process group."""
        return self.address_of_rank(0)

    def delay_s(self, source_host: str, destination_host: str) -> float:
        """One-way delay the forwarder adds from one host to another, seconds. Raises KeyError."""
        return self._delays_s[self._host_index[source_host]][self._host_index[destination_host]]

    def up(self) -> None:
        """Build the testbed: namespaces, devices, shaping, forwarder; about 0.2 s for 2 hosts.

        Raises:
            TestbedError: not root or tools missing; this scenario's testbed (or what is left of
                a crashed one) already exists; a command failed or the forwarder did not start.
                On a failure everything built so far is removed first.
        """
        require_privileges()
        leftovers = self._leftovers()
        if leftovers:
            raise TestbedError("testbed", f"scenario {self.scenario_name!r} is already up; run down first "
                                          f"(got {', '.join(leftovers)})")
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._write_state(forwarder_pid=None)
        try:
            for links in self.hosts.values():
                self._build_host(links)
            self._forwarder = forwarder.start(
                self.prefix, [links.namespace for links in self.hosts.values()],
                [links.address for links in self.hosts.values()], self._delays_s, self._log_path)
            self._write_state(forwarder_pid=self._forwarder.pid)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove this scenario's forwarder, namespaces (with every device and qdisc in them) and
        state; also what a crashed ``up`` left. Doing nothing when nothing is there.

        Raises:
            TestbedError: not root or tools missing, or ``ip netns del`` failed.
        """
        require_privileges()
        # The forwarder holds the TUN devices, which keep their namespaces alive: stop it first.
        forwarder.stop(self.prefix)
        if self._forwarder is not None:
            self._forwarder.wait()
            self._forwarder = None
        for namespace in self._namespaces_present():
            ip("netns", "del", namespace)
        self.state_path.unlink(missing_ok=True)
        self._log_path.unlink(missing_ok=True)

    def require_up(self) -> None:
        """Check that ranks can run in the testbed now: every namespace exists, the forwarder runs.

        Raises:
            TestbedError: not root or tools missing, or the testbed is not (entirely) up, naming
                what is missing.
        """
        require_privileges()
        present = set(self._namespaces_present())
        missing = [f"namespace {links.namespace}" for links in self.hosts.values() if links.namespace not in present]
        if not forwarder.find(self.prefix):
            missing.append("the delay forwarder")
        if missing:
            raise TestbedError("testbed", f"scenario {self.scenario_name!r} is not up; run `hetsim testbed up` "
                                          f"first (got no {', no '.join(missing)})")

    def status(self) -> dict[str, Any]:
        """What is in force now, from the kernel rather than from the state file.

        Returns ``{"scenario", "prefix", "up", "forwarder_pids", "hosts"}``: ``up`` is true when
        every namespace exists and one forwarder runs; ``hosts`` maps each host to
        ``{"namespace", "exists", "address"}`` (the IPv4 address on ``eth0``, None if absent) and
        ``"uplink"``, ``"downlink"``, ``"intra"``: the tbf on ``eth0``, ``eth0-down`` and ``lo``
        as :func:`~runtime.testbed.shaping.tbf_in_force` reports it (rate in bytes/s, bytes and
        packets sent, drops), None where there is none.

        Raises:
            TestbedError: not root or tools missing.
        """
        require_privileges()
        present = set(self._namespaces_present())
        pids = forwarder.find(self.prefix)
        hosts = {}
        for host, links in self.hosts.items():
            exists = links.namespace in present
            shaping = tbf_in_force(links.namespace) if exists else {}
            hosts[host] = {
                "namespace": links.namespace,
                "exists": exists,
                "address": self._address_in_force(links.namespace) if exists else None,
                "uplink": shaping.get(INTERFACE),
                "downlink": shaping.get(f"{INTERFACE}-down"),
                "intra": shaping.get("lo"),
            }
        up = len(pids) == 1 and all(entry["exists"] for entry in hosts.values())
        return {"scenario": self.scenario_name, "prefix": self.prefix, "up": up, "forwarder_pids": pids,
                "hosts": hosts}

    def _build_host(self, links: HostLinks) -> None:
        namespace = links.namespace
        ip("netns", "add", namespace)
        ip("link", "set", "lo", "up", namespace=namespace)
        ip("tuntap", "add", "dev", INTERFACE, "mode", "tun", namespace=namespace)
        ip("link", "set", INTERFACE, "mtu", str(INTER_HOST_MTU_BYTES), namespace=namespace)
        ip("addr", "add", f"{links.address}/{SUBNET_PREFIX_LENGTH}", "dev", INTERFACE, namespace=namespace)
        ip("link", "set", INTERFACE, "up", namespace=namespace)
        # Without RPS, packets written by a forwarder that migrates between CPUs are received on
        # both CPUs' backlogs, reordered, and TCP retransmits (FIELD-NOTES section 5).
        write_sysfs(namespace, f"/sys/class/net/{INTERFACE}/queues/rx-0/rps_cpus", "1")
        if math.isfinite(links.uplink_bytes_per_s):
            shape_egress(namespace, INTERFACE, links.uplink_bytes_per_s, INTER_HOST_MTU_BYTES)
        if math.isfinite(links.downlink_bytes_per_s):
            shape_ingress(namespace, INTERFACE, links.downlink_bytes_per_s, INTER_HOST_MTU_BYTES)
        if links.intra_bytes_per_s is not None:
            shape_egress(namespace, "lo", links.intra_bytes_per_s, LOOPBACK_MTU_BYTES)

    def _namespaces_present(self) -> list[str]:
        try:
            recorded = set(json.loads(self.state_path.read_text())["namespaces"])
        except (FileNotFoundError, json.JSONDecodeError):
            recorded = set()  # none, or cut short by a crash: the prefix still finds every namespace
        return [name for name in list_namespaces() if name in recorded or name.startswith(f"{self.prefix}-")]

    def _leftovers(self) -> list[str]:
        found = [f"state file {self.state_path}"] if self.state_path.exists() else []
        found += [f"namespace {name}" for name in self._namespaces_present()]
        found += [f"forwarder pid {pid}" for pid in forwarder.find(self.prefix)]
        return found

    def _address_in_force(self, namespace: str) -> str | None:
        devices = json.loads(ip("-j", "-4", "addr", "show", "dev", INTERFACE, namespace=namespace, check=False) or "[]")
        return next((info["local"] for device in devices for info in device["addr_info"]), None)

    def _write_state(self, forwarder_pid: int | None) -> None:
        state = {
            "scenario": self.scenario_name,
            "prefix": self.prefix,
            "namespaces": [links.namespace for links in self.hosts.values()],
            "forwarder_pid": forwarder_pid,
            "hosts": {host: asdict(links) for host, links in self.hosts.items()},
        }
        self.state_path.write_text(json.dumps(state, indent=2))
