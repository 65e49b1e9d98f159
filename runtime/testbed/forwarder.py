"""The delay forwarder: carries IP packets between the hosts' TUN devices, each after its path's delay.

The kernel here has no netem (FIELD-NOTES section 5), so one-way delay is added in user space.
Every host namespace has a TUN device (``eth0``) that carries its inter-host traffic: the kernel
routes packets for other hosts' addresses into it, after its tbf (the host's uplink). This
process reads each packet, looks up the destination host by the IPv4 destination address, holds
the packet in a heap until ``arrival + delays_s[src][dst]`` and writes it into the destination's
TUN, where the kernel receives it (through the host's downlink tbf on an ifb) as if from a wire.
Packets for unknown addresses, and non-IPv4 packets, are dropped as a router without a route would.

CPU: it shares the machine's 2 cores with the ranks, so it sleeps in ``select`` until a TUN is
readable or the earliest held packet is due (``select`` takes a microsecond timeout, where
``poll``/``epoll`` round up to whole milliseconds), and reads up to ``_BATCH`` packets per device
per wake-up.

Run by :class:`runtime.testbed.cluster.Testbed` as
``python -m runtime.testbed.forwarder <prefix>`` in a session of its own, with the configuration as
JSON on stdin: ``{"namespaces": [...], "addresses": [...], "delays_s": [[...], ...]}`` (one
entry per host, delays in seconds, ``delays_s[i][j]`` from host i to host j). It attaches to the
TUN device of every namespace, then writes ``ready`` on stdout and forwards until killed. The
prefix argument is unused here but lets ``Testbed.down`` find this process after a crash.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import select
import socket
import struct
import sys
import time

from runtime.testbed.netns import TUN_DEVICE, inside_namespace

INTERFACE = "eth0"
_TUNSETIFF = 0x400454CA  # <linux/if_tun.h>
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_BATCH = 64
_MAX_PACKET = 65535


def open_tun(namespace: str, interface: str = INTERFACE) -> int:
    """A non-blocking descriptor attached to the existing TUN ``interface`` of ``namespace``.

    The device must have been created as ``ip tuntap add dev <interface> mode tun`` (no packet
    information header), else the kernel refuses the flags. Raises OSError naming the namespace.
    """
    with inside_namespace(namespace):
        fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", interface.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as error:
        os.close(fd)
        raise OSError(error.errno, f"cannot attach to TUN {interface} in namespace {namespace!r}: "
                                   f"{error.strerror}") from None
    return fd


def forward(fds: list[int], addresses: list[str], delays_s: list[list[float]]) -> None:
    """Forward between the TUN descriptors ``fds`` (host i owns ``addresses[i]``) forever.

    Returns only by raising: OSError when a TUN device disappears (its namespace was deleted).
    """
    host_of = {socket.inet_aton(address): index for index, address in enumerate(addresses)}
    source_of = {fd: index for index, fd in enumerate(fds)}
    held: list[tuple[float, int, int, bytes]] = []  # (release time s, arrival order, dst fd, packet)
    arrivals = 0
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            source = source_of[fd]
            for _ in range(_BATCH):
                try:
                    packet = os.read(fd, _MAX_PACKET)
                except BlockingIOError:
                    break
                destination = host_of.get(packet[16:20]) if packet[0] >> 4 == 4 else None
                if destination is None or destination == source:
                    continue
                heapq.heappush(held, (now + delays_s[source][destination], arrivals, fds[destination], packet))
                arrivals += 1
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, fd, packet = heapq.heappop(held)
            try:
                os.write(fd, packet)
            except BlockingIOError:
                pass  # the receiver's backlog is full: the packet is lost, as on a congested wire


def main() -> None:
    """Entry point: read the configuration from stdin, attach, say ``ready``, forward."""
    config = json.load(sys.stdin)
    fds = [open_tun(namespace) for namespace in config["namespaces"]]
    print("ready", flush=True)
    forward(fds, config["addresses"], config["delays_s"])


if __name__ == "__main__":
    main()
