"""Pacing the weight loader to the scenario's loader link, as ``tc`` shapes the testbed's network.

A load crosses the channels of :meth:`sim.topology.Topology.loader_path` (the host's ``storage``,
then the device's ``host_link``). As in the simulator (:mod:`sim.loader`) it first waits the
path's latency, then moves its bytes, here in chunks: each chunk of c bytes takes the next slot
free on every channel of the path (it starts at the latest of now and each channel's next free
time, and holds each channel for c / that channel's bandwidth) and has arrived once c / (the path's
bottleneck bandwidth) has passed from its start. The reader sleeps until then, so a load of B bytes
alone on its path takes at least ``latency_s + B / bandwidth_bytes_per_s``.

A channel's next free time lives in a small file that every process of the machine opens under
the same directory, so the ranks of one host streaming at once take turns, chunk by chunk, on its
storage: each gets an equal share, as under the simulator's max-min sharing.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from models.errors import ConfigError
from sim.topology import Channel

CHUNK_BYTES = 1 << 20  # pacing granularity: small against a block, large against a syscall


@dataclass(frozen=True)
class LoaderLink:
    """The channels streamed weights cross to reach one rank, in order."""

    channels: tuple[Channel, ...]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The bottleneck: the smallest bandwidth on the path (bytes/s)."""
        return min(c.bandwidth_bytes_per_s for c in self.channels)

    @property
    def latency_s(self) -> float:
        """The sum of the channels' latencies (s)."""
        return sum(c.latency_s for c in self.channels)

    def min_duration_s(self, nbytes: float) -> float:
        """The shortest a load of ``nbytes`` bytes may take when alone on the path (s)."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def single(cls, bandwidth_bytes_per_s: float, latency_s: float) -> LoaderLink:
        """A path of one channel, private to its rank."""
        return cls((Channel("link", bandwidth_bytes_per_s, latency_s),))

    @classmethod
    def of(cls, topology, rank: int) -> LoaderLink:
        """``topology.loader_path(rank)``. Raises :class:`ConfigError` when it is empty (no
        ``storage`` on the rank's host, no ``host_link`` on its device), as the simulator does."""
        path = topology.loader_path(rank)
        if not path:
            raise ConfigError("memory.policy", f"sliding_window streams weights to rank {rank}, but its host has "
                                               "no storage link and the device no host_link; add e.g. "
                                               "cluster.hosts[].storage: {bandwidth: 2GB/s, latency: 100us} "
                                               "(got 'sliding_window')")
        return cls(tuple(path))


class _Clock:
    """When a channel is next free (``time.perf_counter`` s, CLOCK_MONOTONIC: one clock for every
    process of the machine): in memory, or in an 8-byte file locked with flock while read and set."""

    def __init__(self, path: Path | None):
        self.path, self._value, self._fd = path, 0.0, None
        if path is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> _Clock:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            raw = os.pread(self._fd, 8, 0)
            self._value = struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0  # a new file is empty
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, struct.pack("<d", self._value), 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


class Pacer:
    """Paces one rank's loads over ``link``. ``shared_dir``: where the channel clocks live, the same
    directory for every rank of the run on this machine (None: clocks private to this object)."""

    def __init__(self, link: LoaderLink, shared_dir: str | Path | None = None):
        self.link = link
        self._shared_dir = None if shared_dir is None else Path(shared_dir)
        if self._shared_dir is not None:
            self._shared_dir.mkdir(parents=True, exist_ok=True)
        # Locked in name order whatever the path's order, so two ranks never wait on each other.
        self._clocks = [(c, _Clock(None if shared_dir is None else Path(shared_dir) / f"{c.name}.clock"))
                        for c in sorted(link.channels, key=lambda c: c.name)]
        self._not_before = 0.0

    def start_load(self) -> None:
        """A load begins now: its first byte may move once the path's latency has passed."""
        self._not_before = time.perf_counter() + self.link.latency_s

    def chunk(self, nbytes: int) -> float:
        """Reserve the path for the next ``nbytes`` of the current load; returns when they have
        arrived (``time.perf_counter`` s)."""
        with ExitStack() as locked:
            for _, clock in self._clocks:
                locked.enter_context(clock)
            start = max(time.perf_counter(), self._not_before, *(clock._value for _, clock in self._clocks))
            for channel, clock in self._clocks:
                clock._value = start + nbytes / channel.bandwidth_bytes_per_s
        self._not_before = 0.0
        return start + nbytes / self.link.bandwidth_bytes_per_s

    def close(self) -> None:
        """Close (and remove) the clock files; call once every rank sharing them is done."""
        for _, clock in self._clocks:
            clock.close()
        if self._shared_dir is not None:
            try:
                self._shared_dir.rmdir()
            except OSError:  # another rank's clocks are still there; the last to close removes it
                pass
