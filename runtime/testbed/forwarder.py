"""The delay forwarder: carries IP packets between the hosts' TUN devices, each after its path's delay.

The kernel here has no netem (``tc qdisc add ... netem`` fails: the module is absent), so one-way delay is added in user space.
Every host namespace has a TUN device (``eth0``) that carries its inter-host traffic: the kernel
routes packets for other hosts' addresses into it, after its tbf (the host's uplink). This
process reads each packet, looks up the destination host by the IPv4 destination address, holds
the packet in a heap until ``arrival + delays_s[src][dst]`` and writes it into the destination's
TUN, where the kernel receives it (through the host's downlink tbf on an ifb) as if from a wire.
Packets for unknown addresses, and non-IPv4 packets, are dropped as a router without a route would.

CPU: it shares the machine's 2 cores with the ranks, so it runs in the real-time FIFO class
where it may (:func:`run_before_the_ranks`), and sleeps in ``select`` until a TUN is
readable or the earliest held packet is due (``select`` takes a microsecond timeout, where
``poll``/``epoll`` round up to whole milliseconds), and reads up to ``_BATCH`` packets per device
per wake-up. Measured: 7-12% of one core at 100 Mbit/s, 15-19% at 200 Mbit/s (one transfer).

:func:`start` runs it as ``python -m runtime.testbed.forwarder <prefix>`` in a session of its
own (so it outlives the process that built the testbed), with the configuration as JSON on stdin:
``{"namespaces": [...], "addresses": [...], "delays_s": [[...], ...]}`` (one entry per host,
``delays_s[i][j]`` from host i to host j, seconds). It attaches to the TUN device of every
namespace, writes ``ready`` on stdout and forwards until killed. The prefix argument is not used
by the process itself: it lets :func:`find` recognise a testbed's forwarder after a crash.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from runtime import interrupt
from runtime.testbed.errors import TestbedError
from runtime.testbed.netns import TUN_DEVICE, inside_namespace

INTERFACE = "eth0"
_TUNSETIFF = 0x400454CA  # <linux/if_tun.h>
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_BATCH = 64
_MAX_PACKET = 65535
_MODULE = "runtime.testbed.forwarder"
_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # where ``-m runtime.testbed.forwarder`` resolves
START_TIMEOUT_S = 10.0
PRIORITY = 50  # SCHED_FIFO; above every normal task, below the kernel's own real-time threads
STOP_TIMEOUT_S = 2.0


def open_tun(namespace: str) -> int:
    """A non-blocking descriptor attached to the existing TUN device ``eth0`` of ``namespace``.

    The device must have been created as ``ip tuntap add dev eth0 mode tun`` (no packet
    information header), else the kernel refuses the flags. Raises OSError naming the namespace.
    """
    with inside_namespace(namespace):
        fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", INTERFACE.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as error:
        os.close(fd)
        raise OSError(error.errno, f"cannot attach to TUN {INTERFACE} in namespace {namespace!r}: "
                                   f"{error.strerror}") from None
    return fd


def forward(fds: list[int], addresses: list[str], delays_s: list[list[float]]) -> None:
    """Forward between the TUN descriptors ``fds`` (host i owns ``addresses[i]``) forever.

    Returns only by raising: OSError when a TUN device is deleted under it.
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


def start(prefix: str, namespaces: list[str], addresses: list[str], delays_s: list[list[float]],
          log_path: Path, *, die_with_caller: bool = False) -> subprocess.Popen:
    """Start the forwarder for a testbed and wait until it has attached to every TUN device.

    Its stderr goes to ``log_path``. With ``die_with_caller`` it is killed when this process
    dies, even by SIGKILL (:func:`runtime.interrupt.die_with_parent`); else it outlives it, as
    ``hetsim testbed up`` needs. Returns its process (the caller reaps it after :func:`stop`).

    Raises:
        TestbedError: it exited or said nothing within ``START_TIMEOUT_S``, quoting its log.
    """
    # Deferred: a signal inside Popen could leave a forked child that is not yet the forwarder
    # its command line would identify to stop().
    with open(log_path, "wb") as log, interrupt.deferred():
        caller = os.getpid()
        process = subprocess.Popen([sys.executable, "-m", _MODULE, prefix], cwd=_SOURCE_ROOT, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                   preexec_fn=(lambda: interrupt.die_with_parent(caller)) if die_with_caller else None)
    config = {"namespaces": namespaces, "addresses": addresses, "delays_s": delays_s}
    try:
        with process.stdin:
            process.stdin.write(json.dumps(config).encode())
    except BrokenPipeError:
        pass  # it died at start; its log says why, below
    with process.stdout:
        said = process.stdout.readline() if select.select([process.stdout], [], [], START_TIMEOUT_S)[0] else b""
    if said.strip() != b"ready":
        stop(prefix)
        process.wait()
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise TestbedError("testbed", f"the delay forwarder did not start (got {lines[-1] if lines else 'no output'})")
    return process


def _is_forwarder(pid: int, prefix: str) -> bool:
    """Whether ``pid`` is a live forwarder of the testbed ``prefix`` (a zombie has no command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[-3:-1] == [_MODULE.encode(), prefix.encode()]


def find(prefix: str) -> list[int]:
    """Pids of the running forwarders of the testbed ``prefix``, found by their command line."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _is_forwarder(int(entry), prefix)]


def stop(prefix: str) -> None:
    """End every forwarder of the testbed ``prefix``: SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``.

    Returns once none is left running.
    """
    running = find(prefix)
    _signal(running, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while running:
        time.sleep(0.01)
        for pid in running:
            try:
                os.waitpid(pid, os.WNOHANG)  # our own child would otherwise linger as a zombie
            except ChildProcessError:
                pass
        running = [pid for pid in running if _is_forwarder(pid, prefix)]
        if time.monotonic() > deadline:
            _signal(running, signal.SIGKILL)


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # it exited since it was found


def run_before_the_ranks() -> bool:
    """Ask for the real-time FIFO scheduling class (priority :data:`PRIORITY`), so that a held
    packet leaves when it is due rather than when a core is free of the ranks' compute: a wire
    does not wait for a CPU. Measured on v4x1_latency (4 ranks on 2 cores, 5 ms between hosts):
    a decode allreduce's p10-p90 11.2-18.6 ms against 12.4-22.5 ms without. The forwarder sleeps
    between packets, and the kernel's real-time throttling (95% of each second) bounds what a
    fault could take. Returns False where the class is refused (no CAP_SYS_NICE), which leaves the
    forwarder as it was."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(PRIORITY))
    except (PermissionError, OSError):
        return False
    return True


def main() -> None:
    """Entry point: read the configuration from stdin, attach, say ``ready``, forward."""
    config = json.load(sys.stdin)
    fds = [open_tun(namespace) for namespace in config["namespaces"]]
    run_before_the_ranks()
    print("ready", flush=True)
    forward(fds, config["addresses"], config["delays_s"])


if __name__ == "__main__":
    main()
