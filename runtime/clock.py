"""One timeline for every rank: rank 0's ``time.perf_counter``, and each rank's offset from it.

Why: calibration charges a collective from the last rank's start to the last rank's end
(:mod:`runtime.comm_timing`), and a measured run's op records are read across ranks; both need the
ranks' times on one clock. Ranks of one machine (forked by :mod:`runtime.launch`, in the testbed's
namespaces or not) read one CLOCK_MONOTONIC, so their offset is exactly zero, which a rank knows
when its boot id is rank 0's. Ranks on other hosts (torchrun on a real cluster) have monotonic
clocks that started at their own boots: each estimates its offset from rank 0 by Cristian's
algorithm (F. Cristian, "Probabilistic clock synchronization", Distributed Computing 3(3), 1989):
rank 0 reads t0 and sends, the peer replies with its reading t1, rank 0 reads t2 on receipt;
offset = t1 - (t0 + t2) / 2, wrong by at most half the round trip, taken from the exchange with
the smallest round trip.

Times here are seconds. ``local = shared + offset_s()``.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

_offset_s = 0.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def offset_s() -> float:
    """This rank's clock less rank 0's (s); 0 until :func:`synchronise` runs."""
    return _offset_s


def to_local(shared_s: float) -> float:
    """A time on rank 0's clock, read on this rank's ``time.perf_counter`` (s)."""
    return shared_s + _offset_s


def to_shared(local_s: float) -> float:
    """A reading of this rank's ``time.perf_counter``, on rank 0's clock (s)."""
    return local_s - _offset_s


def boot_id() -> str:
    """What names this machine's monotonic clock: the kernel's boot id (the host name where the
    kernel does not give one). Processes with one boot id read one CLOCK_MONOTONIC."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


def synchronise(device: torch.device = torch.device("cpu"), exchanges: int = 16) -> float:
    """Estimate this rank's offset from rank 0 and keep it (every rank of the default group calls).

    Ranks with rank 0's boot id get exactly 0 without any exchange; each other rank exchanges
    ``exchanges`` readings with rank 0 (point-to-point, so rank 0 serves one peer at a time).

    Returns:
        This rank's offset (s).
    """
    global _offset_s
    world = dist.get_world_size()
    rank = dist.get_rank()
    ids = [None] * world
    dist.all_gather_object(ids, boot_id())
    reading = torch.zeros(1, dtype=torch.float64, device=device)
    offset = 0.0
    for peer in (p for p in range(1, world) if ids[p] != ids[0]):
        if rank == 0:
            best = None  # (round trip s, offset s)
            for _ in range(exchanges):
                t0 = time.perf_counter()
                dist.send(reading, dst=peer)
                dist.recv(reading, src=peer)
                t2 = time.perf_counter()
                sample = (t2 - t0, float(reading.item()) - (t0 + t2) / 2)
                best = sample if best is None or sample[0] < best[0] else best
            reading.fill_(best[1])
            dist.send(reading, dst=peer)
        elif rank == peer:
            for _ in range(exchanges):
                dist.recv(reading, src=0)
                reading.fill_(time.perf_counter())
                dist.send(reading, dst=0)
            dist.recv(reading, src=0)
            offset = float(reading.item())
    _offset_s = offset
    return offset
