"""The testbed: a scenario's cluster built from network namespaces, shaped links and, where the
scenario has delays, a delay forwarder.

Layout (:mod:`runtime.testbed` for the measured facts, :mod:`runtime.testbed.links` for the derivation):

- one network namespace per host, ``<prefix>-<host>``; its ranks all live in it;
- ``eth0`` in each, with the host's address in 10.77.0.0/16 and MTU 9000; ranks set
  ``GLOO_SOCKET_IFNAME=eth0`` (:attr:`Testbed.interface`), else gloo binds 127.0.0.1. What
  ``eth0`` is depends on whether the scenario's delays are injected (:attr:`Testbed.injects_delay`):

  - **delayed** (some pair of hosts more than :data:`UNDELAYED_MAX_S` apart): a TUN device; one
    forwarder process per testbed moves packets between the TUN devices, each held for the path
    latency between the two hosts (:mod:`runtime.testbed.forwarder`), since the kernel has no
    netem. Uplink: tbf on ``eth0``; downlink: tbf on the ifb ``eth0-down`` that ``eth0``'s
    ingress is redirected to (:mod:`runtime.testbed.shaping`);
  - **direct** (every delay at most :data:`UNDELAYED_MAX_S`): a veth whose peer ``p<i>`` is a port
    of the bridge ``br0`` in the switch namespace ``<prefix>-+switch`` (``+`` cannot occur in a
    host name). Uplink: tbf on ``eth0``; downlink: tbf on ``p<i>``. No process sits on the path.

  Either way RPS is on for every receive queue, so that packets are not reordered across CPUs;
- intra-host: ranks of one host reach each other over ``lo`` even when they dial the ``eth0``
  address, so a tbf on ``lo`` at the interconnect rate shapes that traffic, one bucket per host.

Why two kinds: the forwarder's own wake-ups add 0.16-0.36 ms per direction, and it takes 30-37%
of a core while a 4-rank decode runs on the 2 cores, which made the same case's TPOT move by
34-46% between launches (``benchmarks/bench_measurement_spread.py``). A path of a few tens of
microseconds needs none of that: the veth path's own latency stands in for it, and calibration
measures whatever latency the path has.

State: ``/run/hetsim/<scenario>.json`` records the namespaces and the forwarder's pid, written
before anything is built; ``down`` also finds namespaces by their name prefix and forwarders by
their command line, so it cleans up after an ``up`` that was killed midway.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime import interrupt
from runtime.testbed import forwarder
from runtime.testbed.errors import TestbedError
from runtime.testbed.links import (SUBNET_PREFIX_LENGTH, HostLinks, capacity_warnings, host_links,
                                   pair_delays_s, scenario_prefix)
from runtime.testbed.netns import ip, list_namespaces, require_privileges, write_sysfs
from runtime.testbed.shaping import burst_applied_bytes, shape_egress, shape_ingress, tbf_in_force
from sim.context import CalibrationContext, LinkClass

if TYPE_CHECKING:
    from sim.topology import Topology

STATE_DIR = Path("/run/hetsim")
INTERFACE = forwarder.INTERFACE
BRIDGE = "br0"
INTER_HOST_MTU_BYTES = 9000
LOOPBACK_MTU_BYTES = 65536
# Below this one-way delay the forwarder's own 0.16-0.36 ms per direction (measured, see the
# package docstring) would miss the configured value by more than leaving the delay out does: a
# veth path measures tens of microseconds here.
UNDELAYED_MAX_S = 0.2e-3


def applied_context(context: CalibrationContext) -> CalibrationContext:
    """``context`` (its links' declared bursts) as calibrated on the testbed: each link with the
    tbf bucket the testbed applies to it (:func:`runtime.testbed.shaping.burst_applied_bytes`:
    at least two MTUs, so 18 kB between hosts, 128 KiB on ``lo``, where a link declares none or
    less), since that is what the profile's timings ran through (:mod:`sim.token_bucket`)."""
    mtu = {LinkClass.INTER_HOST: INTER_HOST_MTU_BYTES, LinkClass.INTRA_HOST: LOOPBACK_MTU_BYTES}
    return replace(context, links=tuple(replace(link, burst_bytes=burst_applied_bytes(link.burst_bytes,
                                                                                     mtu[link.link_class]))
                                        for link in context.links))


class Testbed:
    """The emulated cluster of one scenario; building it needs root (:func:`require_privileges`).

    Attributes:
        scenario_name: the scenario it emulates; names the state file.
        prefix: ``hs`` + 6 hex digits, the start of every namespace name of this testbed.
        hosts: each host's :class:`~runtime.testbed.links.HostLinks`, in topology order.
        interface: the device every rank must give gloo (``GLOO_SOCKET_IFNAME``), ``"eth0"``.
        injects_delay: whether a forwarder holds packets for the path delays (some pair of hosts
            is more than :data:`UNDELAYED_MAX_S` apart); else hosts meet on a bridge directly.
        switch_namespace: ``<prefix>-+switch``, where the bridge lives when there is no forwarder.
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
        self.injects_delay = any(delay > UNDELAYED_MAX_S for row in self._delays_s for delay in row)
        self.switch_namespace = f"{self.prefix}-+switch"
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
        """One-way path delay from one host to another in the topology, seconds; the forwarder adds
        it when :attr:`injects_delay`, else it is left to the veth path. Raises KeyError."""
        return self._delays_s[self._host_index[source_host]][self._host_index[destination_host]]

    def up(self, *, owned: bool = False) -> None:
        """Build the testbed: namespaces, devices, shaping, forwarder or bridge; about 0.2 s for 2 hosts.

        ``owned``: the testbed lives no longer than this process (``hetsim validate`` builds and
        removes its own), so its forwarder is killed with it even when it is killed outright; the
        namespaces stay until the next ``down``. Else (``hetsim testbed up``) the forwarder
        outlives the process that started it.

        Raises:
            TestbedError: not root or tools missing; this scenario's testbed (or what is left of
                a crashed one) already exists; a command failed or the forwarder did not start.
            runtime.interrupt.Interrupted: a signal arrived (:func:`runtime.interrupt.catching`).
            On a failure or an interruption everything built so far is removed first.
        """
        require_privileges()
        leftovers = self._leftovers()
        if leftovers:
            raise TestbedError("testbed", f"scenario {self.scenario_name!r} is already up; run down first "
                                          f"(got {', '.join(leftovers)})")
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._write_state(forwarder_pid=None)
        try:
            if not self.injects_delay:
                ip("netns", "add", self.switch_namespace)
                ip("link", "add", BRIDGE, "type", "bridge", namespace=self.switch_namespace)
                ip("link", "set", BRIDGE, "up", namespace=self.switch_namespace)
            for index, links in enumerate(self.hosts.values()):
                self._build_host(links, index)
            if self.injects_delay:
                self._forwarder = forwarder.start(
                    self.prefix, [links.namespace for links in self.hosts.values()],
                    [links.address for links in self.hosts.values()], self._delays_s, self._log_path,
                    die_with_caller=owned)
                self._write_state(forwarder_pid=self._forwarder.pid)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove this scenario's forwarder, namespaces (with every device and qdisc in them) and
        state; also what a crashed ``up`` left. Doing nothing when nothing is there. A signal
        arriving meanwhile is raised once everything is removed (:func:`runtime.interrupt.deferred`).

        Raises:
            TestbedError: not root or tools missing, or ``ip netns del`` failed.
        """
        require_privileges()
        with interrupt.deferred():  # half a testbed would outlive the interrupted command
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
        """Check that ranks can run in the testbed now: every namespace exists, the forwarder runs
        (when :attr:`injects_delay`).

        Raises:
            TestbedError: not root or tools missing, or the testbed is not (entirely) up, naming
                what is missing.
        """
        require_privileges()
        present = set(self._namespaces_present())
        missing = [f"namespace {name}" for name in self._namespaces() if name not in present]
        if self.injects_delay and not forwarder.find(self.prefix):
            missing.append("the delay forwarder")
        if missing:
            raise TestbedError("testbed", f"scenario {self.scenario_name!r} is not up; run `hetsim testbed up` "
                                          f"first (got no {', no '.join(missing)})")

    def status(self) -> dict[str, Any]:
        """What is in force now, from the kernel rather than from the state file.

        Returns ``{"scenario", "prefix", "up", "injects_delay", "forwarder_pids", "hosts"}``: ``up``
        is true when every namespace exists and one forwarder runs (none without injected delay);
        ``hosts`` maps each host to ``{"namespace", "exists", "address"}`` (the IPv4 address on
        ``eth0``, None if absent) and ``"uplink"``, ``"downlink"``, ``"intra"``: the tbf on
        ``eth0``, on the downlink (``eth0-down``, or the bridge port ``p<i>``) and on ``lo`` as
        :func:`~runtime.testbed.shaping.tbf_in_force` reports it (rate in bytes/s, bytes and
        packets sent, drops), None where there is none.

        Raises:
            TestbedError: not root or tools missing.
        """
        require_privileges()
        present = set(self._namespaces_present())
        pids = forwarder.find(self.prefix)
        switch_shaping = (tbf_in_force(self.switch_namespace)
                          if not self.injects_delay and self.switch_namespace in present else {})
        hosts = {}
        for index, (host, links) in enumerate(self.hosts.items()):
            exists = links.namespace in present
            shaping = tbf_in_force(links.namespace) if exists else {}
            hosts[host] = {
                "namespace": links.namespace,
                "exists": exists,
                "address": self._address_in_force(links.namespace) if exists else None,
                "uplink": shaping.get(INTERFACE),
                "downlink": (shaping.get(f"{INTERFACE}-down") if self.injects_delay
                             else switch_shaping.get(_bridge_port(index))),
                "intra": shaping.get("lo"),
            }
        up = len(pids) == int(self.injects_delay) and all(name in present for name in self._namespaces())
        return {"scenario": self.scenario_name, "prefix": self.prefix, "up": up,
                "injects_delay": self.injects_delay, "forwarder_pids": pids, "hosts": hosts}

    def _namespaces(self) -> list[str]:
        """Every namespace this testbed builds: the hosts', then the switch's when there is a bridge."""
        hosts = [links.namespace for links in self.hosts.values()]
        return hosts if self.injects_delay else [*hosts, self.switch_namespace]

    def _build_host(self, links: HostLinks, index: int) -> None:
        namespace = links.namespace
        ip("netns", "add", namespace)
        ip("link", "set", "lo", "up", namespace=namespace)
        if self.injects_delay:
            ip("tuntap", "add", "dev", INTERFACE, "mode", "tun", namespace=namespace)
        else:
            port = _bridge_port(index)
            ip("link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", namespace,
               namespace=self.switch_namespace)
            ip("link", "set", port, "mtu", str(INTER_HOST_MTU_BYTES), "master", BRIDGE, "up",
               namespace=self.switch_namespace)
            write_sysfs(self.switch_namespace, f"/sys/class/net/{port}/queues/rx-0/rps_cpus", "1")
        ip("link", "set", INTERFACE, "mtu", str(INTER_HOST_MTU_BYTES), namespace=namespace)
        ip("addr", "add", f"{links.address}/{SUBNET_PREFIX_LENGTH}", "dev", INTERFACE, namespace=namespace)
        ip("link", "set", INTERFACE, "up", namespace=namespace)
        # Without RPS, packets that arrive from a process (the forwarder, a veth's sender)
        # migrating between CPUs are received on both CPUs' backlogs, reordered, and TCP
        # retransmits (measured here; Linux Documentation/networking/scaling.rst on RPS).
        write_sysfs(namespace, f"/sys/class/net/{INTERFACE}/queues/rx-0/rps_cpus", "1")
        if math.isfinite(links.uplink_bytes_per_s):
            shape_egress(namespace, INTERFACE, links.uplink_bytes_per_s, INTER_HOST_MTU_BYTES, links.burst_bytes)
        if math.isfinite(links.downlink_bytes_per_s):
            if self.injects_delay:
                shape_ingress(namespace, INTERFACE, links.downlink_bytes_per_s, INTER_HOST_MTU_BYTES,
                              links.burst_bytes)
            else:
                shape_egress(self.switch_namespace, _bridge_port(index), links.downlink_bytes_per_s,
                             INTER_HOST_MTU_BYTES, links.burst_bytes)
        if links.intra_bytes_per_s is not None:
            shape_egress(namespace, "lo", links.intra_bytes_per_s, LOOPBACK_MTU_BYTES, links.intra_burst_bytes)

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
            "namespaces": self._namespaces(),
            "forwarder_pid": forwarder_pid,
            "hosts": {host: asdict(links) for host, links in self.hosts.items()},
        }
        self.state_path.write_text(json.dumps(state, indent=2))


def _bridge_port(index: int) -> str:
    """The switch-side end of the ``index``-th host's veth, a port of the bridge."""
    return f"p{index}"
