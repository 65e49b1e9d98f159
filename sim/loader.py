"""Weight loads in simulated time: where streamed blocks come from, and the stalls they cause.

A weight load of ``size_bytes`` to a rank crosses :meth:`sim.topology.Topology.loader_path` (the
host's storage, then the device's host link) on the segment's shared network
(:meth:`sim.fabric.Fabric.load`): it first waits the path's latency, then moves its bytes at a
max-min fair share of every channel on its path, recomputed whenever any transfer starts or ends,
so the devices of a host that stream at once split its storage bandwidth, and a collective
crossing one of those channels takes its share too. A calibration profile may cap a device's
load rate below the links' (the measured throughput of reading and deserialising a block); the
cap acts as one more channel private to the rank's loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.engine import SegmentResult

from models.errors import ConfigError
from sim.plan import Segment
from sim.topology import Topology


def check_loader_paths(topology: Topology, ranks: tuple[int, ...]) -> None:
    """Raise ConfigError if a rank has nowhere to stream weights from (no storage, no host link)."""
    for rank in ranks:
        if not topology.loader_path(rank):
            device = topology.devices[rank]
            raise ConfigError("memory.policy", f"sliding_window streams weights to {device.name}, but its host has "
                                               "no storage link and the device no host_link; add e.g. "
                                               "cluster.hosts[].storage: {bandwidth: 2GB/s, latency: 100us} "
                                               "(got 'sliding_window')")


def stall_s(segment: Segment, result: SegmentResult) -> float:
    """Time the slowest rank's program waited for weight loads in one segment instance (s).

    An op waits for a load when the load ends after the op's other dependencies (its previous op);
    the wait is the op's start minus the latest end among those other dependencies.
    """
    worst = 0.0
    for rank, program in segment.programs.items():
        starts, ends = result.starts[rank], result.ends[rank]
        waited = 0.0
        for i, op in enumerate(program):
            if op.after and any(program[d].load is not None for d in op.after) and op.load is None:
                ready = max((float(ends[d]) for d in op.after if program[d].load is None), default=0.0)
                waited += max(0.0, float(starts[i]) - ready)
        worst = max(worst, waited)
    return worst
