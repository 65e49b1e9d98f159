"""The discrete-event engine: executes one segment of a plan in simulated time (simpy).

Semantics (what the tests pin down):

* One simpy process per rank and stream, created in rank order then stream order, so a run is
  deterministic. Ops of one stream run one at a time in program order; an op also waits for the
  ops named in ``Op.after`` (default: the previous op of its rank's program).
* A compute op holds its stream for the compute model's duration.
* A collective is a rendezvous: it starts when the last rank of its group arrives, and each rank is
  released at ``start + finish_s[rank]`` of the network model's timing of the collective's
  point-to-point schedule (so a broadcast's root leaves before its leaves do). A timing's
  ``wait_s`` (calibrated arrival skew) is the group's first rank waiting for the others: the
  trace shows the others arriving ``wait_s`` after the simulated last arrival. Timings are priced
  once per (kind, algorithm, group, size, root) and cached by the :class:`CollectivePricer`.
* A weight load (``Op.load``) crosses the rank's loader path, sharing it with the loads of other
  ranks in flight (:class:`sim.loader.LoaderLinks`).
* A segment starts with every rank idle at time 0 and lasts until its last op ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import simpy

from sim.cost import ComputeModel
from sim.loader import LoaderLinks
from sim.network import CollectivePricer, CollectiveTiming
from sim.plan import Op, Segment, Stream
from sim.topology import Topology


@dataclass(frozen=True)
class SegmentResult:
    """Op times of one segment instance, relative to its start (s).

    ``starts[r][i]`` / ``ends[r][i]``: start and end of op ``i`` of rank ``r``'s program;
    ``algorithms[call]``: (kind, algorithm) a collective call resolved to (``auto`` becomes a name).
    """

    starts: dict[int, np.ndarray]
    ends: dict[int, np.ndarray]
    duration_s: float
    algorithms: dict[int, tuple[str, str]]


class Engine:
    """Executes segments over a topology with a compute model and a collective pricer."""

    def __init__(self, topology: Topology, compute: ComputeModel, pricer: CollectivePricer,
                 load_rate_cap: Callable[[int], float | None] = lambda rank: None):
        """``load_rate_cap(rank)``: a calibrated ceiling on a weight load's rate (bytes/s), or None."""
        self.topology = topology
        self.compute = compute
        self.pricer = pricer
        self.load_rate_cap = load_rate_cap

    def run_segment(self, segment: Segment) -> SegmentResult:
        """Simulate one instance of ``segment``; see the module docstring for the semantics."""
        env = simpy.Environment()
        self._loads = LoaderLinks(env, self.topology, self.load_rate_cap)
        starts = {r: np.zeros(len(p)) for r, p in segment.programs.items()}
        ends = {r: np.zeros(len(p)) for r, p in segment.programs.items()}
        calls: dict[int, list] = {}
        algorithms: dict[int, tuple[str, str]] = {}
        for rank in sorted(segment.programs):
            program = segment.programs[rank]
            if all(op.after is None for op in program):
                # Every op waits for the previous one: one process runs the program, the same
                # schedule as one process per stream, with half the simpy events.
                groups = [list(range(len(program)))] if program else []
            else:
                groups = [[i for i, op in enumerate(program) if op.stream == stream] for stream in Stream]
            done = [env.event() for _ in program]
            for indices in groups:
                if indices:
                    env.process(self._stream(env, rank, program, indices, done, starts[rank], ends[rank],
                                             calls, algorithms))
        env.run()
        duration = max((float(e.max()) for e in ends.values() if len(e)), default=0.0)
        return SegmentResult(starts, ends, duration, algorithms)

    def _stream(self, env, rank, program, indices, done, starts, ends, calls, algorithms):
        device = self.topology.devices[rank]
        for i in indices:
            op: Op = program[i]
            for dep in op.after if op.after is not None else ((i - 1,) if i else ()):
                if not done[dep].processed:
                    yield done[dep]
            starts[i] = env.now
            if op.load is not None:
                yield from self._loads.load(rank, op.load.size_bytes)
            elif op.collective is None:
                yield env.timeout(self.compute.duration_s(op, device))
            else:
                timing = self._timing(op, algorithms)
                entry = calls.setdefault(op.call, [0, env.event()])
                entry[0] += 1
                if entry[0] == len(op.collective.group):
                    entry[1].succeed(env.now)
                start = yield entry[1]
                if timing.wait_s and rank != op.collective.group[0]:
                    starts[i] = max(starts[i], start + timing.wait_s)
                yield env.timeout(start + timing.finish_s.get(rank, 0.0) - env.now)
            ends[i] = env.now
            done[i].succeed()

    def _timing(self, op: Op, algorithms: dict[int, tuple[str, str]]) -> CollectiveTiming:
        c = op.collective
        algorithm, timing = self.pricer.price(c.kind, c.algorithm, c.group, c.size_bytes, c.root, op.name)
        algorithms[op.call] = (c.kind.value, algorithm)
        return timing
