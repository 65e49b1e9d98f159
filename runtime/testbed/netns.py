"""Network namespaces: entering one, running ``ip``/``tc`` inside one, listing them, privileges.

One network namespace per emulated host (ip-netns(8), namespaces(7)). ``ip netns add NAME`` creates the
namespace and bind-mounts it at ``/run/netns/NAME``; a process joins it with
``setns(fd, CLONE_NEWNET)``, which Python 3.11's ``os`` lacks, hence ctypes. A process must join
before it creates threads or sockets: sockets stay in the namespace they were created in, and
setns only moves the calling thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from runtime.testbed.errors import TestbedError

NETNS_DIR = Path("/run/netns")
TUN_DEVICE = Path("/dev/net/tun")
_CLONE_NEWNET = 0x40000000  # <sched.h>
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns(CLONE_NEWNET) into {what} failed: {os.strerror(code)}")


def enter_namespace(name: str) -> None:
    """Move the calling thread into the network namespace ``/run/netns/<name>`` for good.

    Call it in a fresh process (e.g. a forked rank) before it creates any thread or socket: only
    the calling thread moves, and sockets keep the namespace they were created in.

    Raises:
        FileNotFoundError: no such namespace (the testbed is not up), naming it.
        OSError: setns failed (e.g. EPERM when not root), naming the namespace and the reason.
    """
    path = NETNS_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no network namespace {name!r}; is the testbed up?",
                                str(path)) from None
    try:
        _setns(fd, f"network namespace {name!r}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside_namespace(name: str) -> Iterator[None]:
    """Run the body with the calling thread in namespace ``name``, then move it back.

    For opening descriptors that belong to a namespace (a TUN device) from a process that lives
    elsewhere. Raises as :func:`enter_namespace`.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_namespace(name)
        try:
            yield
        finally:
            _setns(own, "the original network namespace")
    finally:
        os.close(own)


def list_namespaces() -> list[str]:
    """Names of the network namespaces under ``/run/netns`` (as ``ip netns list``), sorted."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def require_privileges() -> None:
    """Check that this process can build a testbed: root, ``ip`` and ``tc`` on PATH, a TUN device.

    Raises:
        TestbedError: naming what is missing, e.g. ``testbed: needs root ... (got uid 1000)``.
    """
    uid = os.geteuid()
    if uid != 0:
        raise TestbedError("testbed", f"needs root to create network namespaces and shape links (got uid {uid})")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedError("testbed", f"needs iproute2's ip and tc on PATH (got no {', '.join(missing)})")
    if not TUN_DEVICE.exists():
        raise TestbedError("testbed", f"needs the TUN driver for delay emulation (got no {TUN_DEVICE})")


def run(*argv: str, check: bool = True) -> str:
    """Run a command (``ip``, ``tc``, ...) and return its stdout.

    Raises:
        TestbedError: with ``check``, when it exits non-zero, quoting the command and its stderr.
    """
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        detail = result.stderr.strip().replace("\n", "; ") or f"exit code {result.returncode}"
        raise TestbedError("testbed", f"command failed: {' '.join(argv)} (got {detail})")
    return result.stdout


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """``ip [-n namespace] args...``; raises as :func:`run`."""
    return run("ip", *(("-n", namespace) if namespace else ()), *args, check=check)


def tc(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """``tc [-n namespace] args...``; raises as :func:`run`."""
    return run("tc", *(("-n", namespace) if namespace else ()), *args, check=check)


def write_sysfs(namespace: str, path: str, value: str) -> None:
    """Write ``value`` to ``/sys/...`` as seen from ``namespace``.

    ``ip netns exec`` mounts the namespace's own sysfs, where its devices (all named ``eth0``...)
    appear; this process's ``/sys`` shows only its own namespace's. Raises as :func:`run`.
    """
    run("ip", "netns", "exec", namespace, "sh", "-c", f'echo {value} > "$1"', "sh", path)
