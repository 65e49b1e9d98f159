"""Signals that end a run: SIGTERM, SIGINT and SIGHUP become :class:`Interrupted` in the parent;
its workers die with it.

The default action of SIGTERM and SIGHUP ends a process at once, without running ``finally``
blocks: forked ranks were left running as orphans and a testbed's namespaces and delay forwarder
stayed up. Under :func:`catching`, the three signals raise :class:`Interrupted` in the main
thread instead (as SIGINT raises KeyboardInterrupt), so the cleanup paths that already end a
failed run (``finally``, context managers) run for an interrupted one too. Cleanup that must not
be cut in half (killing and reaping ranks, tearing a testbed down, writing a set of output files)
runs under :func:`deferred`: a signal arriving there is raised when it ends. Once one signal has
been raised, further ones are ignored, so that a second Ctrl-C cannot cut the cleanup short
(SIGKILL still ends the process).

A worker calls :func:`as_worker` first thing: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux,
``man 2 prctl``) kills it when its parent dies, even by SIGKILL, which no handler sees; and it
ignores SIGINT and SIGHUP, which a terminal sends to the whole process group, so that the parent
alone decides how the run ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Interrupted(BaseException):
    """A run ended by SIGTERM, SIGINT or SIGHUP (:attr:`signum`). A BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` swallows it on its way out."""

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(f"interrupted by {self.signum.name}")

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process ended by that signal."""
        return 128 + int(self.signum)


class _State:
    raised = False  # an Interrupted is on its way out: ignore further signals
    deferring = 0  # depth of nested deferred() blocks
    pending: int | None = None  # the first signal that arrived while deferring


def _handle(signum: int, frame) -> None:
    if _State.raised:
        return
    if _State.deferring:
        if _State.pending is None:
            _State.pending = signum
        return
    _State.raised = True
    raise Interrupted(signum)


@contextmanager
def catching() -> Iterator[None]:
    """Turn SIGTERM, SIGINT and SIGHUP into :class:`Interrupted` in the body; the previous
    handlers come back after it. Outside the main thread (where Python delivers signals) it
    changes nothing.

    Raises:
        Interrupted: one of the signals arrived in the body (outside :func:`deferred`).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; signals reach it alone anyway
        return
    previous = {signum: signal.signal(signum, _handle) for signum in SIGNALS}
    _State.raised, _State.pending = False, None
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _State.raised, _State.pending = False, None


@contextmanager
def deferred() -> Iterator[None]:
    """Hold back :func:`catching`'s signals during the body (cleanup that must finish, files
    written together); the first one that arrived is raised when the body ends.

    Raises:
        Interrupted: a signal arrived during the body (none is raised while one is on its way out).
    """
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
        signum = _State.pending
        if not _State.deferring and signum is not None:
            _State.pending = None
            _State.raised = True
            raise Interrupted(signum)  # in place of any error the body raised: the user asked to stop


def fork_worker() -> int:
    """``os.fork()`` for a worker of this process: 0 in the child, which is made a worker
    (:func:`as_worker`) before anything else; the child's pid in this one.

    The fork runs under :func:`deferred`: CPython runs the at-fork callbacks of the modules
    that registered them (``logging``'s ``_releaseLock`` after every fork, ``os.register_at_fork``),
    and an :class:`Interrupted` raised by a signal inside one is printed as "Exception ignored" and
    lost, leaving the run going with further signals ignored: a SIGTERM sent to ``hetsim
    validate`` while the calibration forked its memory-bandwidth processes
    (:mod:`runtime.stream_bandwidth`) was so swallowed once in the suite. Deferred, it is raised
    when the fork is done.

    Raises:
        Interrupted: a signal arrived during the fork (in this process; the child is a worker
            and dies with it).
    """
    parent = os.getpid()
    with deferred():
        pid = os.fork()
        if pid == 0:
            as_worker(parent)
    return pid


def as_worker(parent_pid: int) -> None:
    """Make this freshly forked process a worker of ``parent_pid``: killed when the parent dies
    (:func:`die_with_parent`), SIGINT and SIGHUP ignored, SIGTERM's default action back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _State.raised, _State.deferring, _State.pending = False, 0, None
    die_with_parent(parent_pid)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when ``parent_pid``, its parent, dies
    (PR_SET_PDEATHSIG, Linux only; kept across exec); exits at once if the parent is gone already.
    Safe in a ``subprocess`` ``preexec_fn``."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
