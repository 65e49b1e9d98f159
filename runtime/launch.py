"""Local launch: one forked worker per rank, watched until all report or one fails.

``import torch`` costs 10-15 s here, so the parent imports it once and forks; each child enters its
host's network namespace (testbed) before it creates any thread or socket, joins a gloo process
group over TCP, runs :func:`runtime.worker.run_rank` and reports through a pipe: heartbeats while
it works, then its result or its error.

Faults, bounded in time: a child that exits without a result (crash, SIGKILL) or reports an error
fails the run at once; a run in which no rank reports progress for ``hang_timeout_s`` fails naming
the rank heard from least recently (a stopped rank stalls the others inside a collective, and gloo
lets them wait at most ``hang_timeout_s``). Either way every child is killed and reaped before the
error is raised, so nothing is left running and no partial result is returned. The same holds when
the parent is interrupted (:mod:`runtime.interrupt`): SIGTERM, SIGINT or SIGHUP unwinds through
the same cleanup, and a rank dies with its parent even when the parent is killed outright.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Callable

import torch
import torch.distributed as dist

from runtime import clock, interrupt
from runtime.errors import LaunchError


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs: its network namespace (None: this one), the rendezvous address and the
    interface gloo must bind (None: gloo's default)."""

    namespace: str | None = None
    master_addr: str = "127.0.0.1"
    socket_ifname: str | None = None


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def launch(body: Callable[[int, Callable[[str], None]], object], world_size: int, *,
           placements: list[RankPlacement] | None = None, port: int | None = None,
           hang_timeout_s: float = 120.0, enter_namespace: Callable[[str], None] | None = None,
           on_beat: Callable[[int, str], None] | None = None) -> list:
    """Run ``body(rank, heartbeat)`` in ``world_size`` forked ranks of one gloo process group.

    ``on_beat(rank, label)`` is called in this process for every heartbeat (a progress display).

    Returns:
        Each rank's return value, by rank.

    Raises:
        LaunchError: a rank raised (its error and traceback's last line), died (exit code or
            signal) or the run made no progress for ``hang_timeout_s``.
        runtime.interrupt.Interrupted: a signal arrived under :func:`runtime.interrupt.catching`.
        Whatever is raised, every rank has been killed and reaped first.
    """
    placements = placements or [RankPlacement()] * world_size
    port = port or free_port()
    context = multiprocessing.get_context("fork")
    pipes, processes = [], []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, name=f"hetsim-rank{rank}", daemon=True,
                                      args=(body, rank, world_size, placements[rank], port, hang_timeout_s, sender,
                                            enter_namespace, os.getpid()))
            with interrupt.deferred():  # a rank forked but not yet listed would escape the cleanup below
                process.start()
                processes.append(process)
            sender.close()
            pipes.append(receiver)
        return _watch(pipes, processes, hang_timeout_s, on_beat or (lambda rank, label: None))
    finally:
        with interrupt.deferred():
            for process in processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGKILL)
            for process in processes:
                process.join()


def _watch(pipes: list[Connection], processes: list, hang_timeout_s: float,
           on_beat: Callable[[int, str], None]) -> list:
    results: dict[int, object] = {}
    heard = {rank: time.monotonic() for rank in range(len(processes))}
    open_pipes = dict(enumerate(pipes))
    while len(results) < len(processes):
        running = [p.sentinel for rank, p in enumerate(processes) if rank not in results]
        ready = wait(list(open_pipes.values()) + running, timeout=1.0)
        now = time.monotonic()
        for rank, pipe in list(open_pipes.items()):
            if pipe not in ready:
                continue
            try:
                kind, payload = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):  # the rank closed its end or died mid-message
                del open_pipes[rank]
                continue
            heard[rank] = now
            if kind == "beat":
                on_beat(rank, payload)
            if kind == "error":
                # A rank whose peer was killed fails too ("connection closed by peer"), often before
                # the parent sees the death: the killed rank is the cause to name.
                killed = _killed_rank(processes, exclude=rank)
                if killed is not None:
                    raise LaunchError(f"rank {killed} died: {_exit_reason(processes[killed].exitcode)}")
                raise LaunchError(f"rank {rank} failed: {payload}")
            if kind == "result":
                results[rank] = payload
        for rank, process in enumerate(processes):
            # Exited without a result: killed, crashed, or its pipe closed before reporting.
            if rank not in results and process.exitcode is not None and (process.exitcode or rank not in open_pipes):
                raise LaunchError(f"rank {rank} died: {_exit_reason(process.exitcode)}")
        if now - max(heard.values()) > hang_timeout_s:
            waiting = [r for r in heard if r not in results]
            stopped = [r for r in waiting if _process_state(processes[r].pid) == "T"]
            culprit = stopped[0] if stopped else min(waiting, key=lambda r: heard[r])
            raise LaunchError(f"rank {culprit} hung: no rank made progress for {hang_timeout_s:.0f} s"
                              + (" (the process is stopped)" if stopped else
                                 f" (rank {culprit} was heard from least recently)"))
    return [results[rank] for rank in range(len(processes))]


def _killed_rank(processes, exclude: int, grace_s: float = 1.0) -> int | None:
    """The first rank other than ``exclude`` killed by a signal, waiting up to ``grace_s`` for the
    kernel to reap it; None if none was."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, process in enumerate(processes):
            if rank != exclude and process.exitcode is not None and process.exitcode < 0:
                return rank
        if time.monotonic() > deadline:
            return None
        wait([p.sentinel for r, p in enumerate(processes) if r != exclude and p.exitcode is None], timeout=0.05)


def _process_state(pid: int) -> str:
    """The scheduler state letter of ``pid`` (R running, S sleeping, T stopped, ...) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code} before reporting"


def _send(pipe: Connection, kind: str, payload: object) -> None:
    # Plain pickle: multiprocessing's pickler would pass tensors as shared-memory handles, which
    # die with this process as it exits right after reporting.
    pipe.send_bytes(pickle.dumps((kind, payload)))


def _child(body, rank: int, world_size: int, placement: RankPlacement, port: int, timeout_s: float,
           pipe: Connection, enter_namespace, parent_pid: int) -> None:
    interrupt.as_worker(parent_pid)  # first: a parent interrupted from here on takes this rank with it
    try:
        if placement.namespace is not None:
            enter_namespace(placement.namespace)  # before any thread or socket exists in this process
        if placement.socket_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = placement.socket_ifname
        torch.set_num_threads(1)  # ranks share the machine's cores; oversubscription distorts timings
        # gloo waits longer than the parent's hang detection, so the parent names the stalled rank
        # before the ranks waiting for it time out and report errors of their own.
        dist.init_process_group("gloo", init_method=f"tcp://{placement.master_addr}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=2 * timeout_s))
        clock.synchronise()  # forked on one machine: offset 0, found from the boot ids
        result = body(rank, lambda label: _send(pipe, "beat", label))
        _send(pipe, "result", result)
        dist.destroy_process_group()
    except BaseException as error:  # reported to the parent, which names this rank
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        try:
            _send(pipe, "error", last)
        finally:
            os._exit(1)
    os._exit(0)
