"""When the data-parallel replicas of a training step run identically, so that simulating replica 0
gives every replica's times exactly.

Replica d runs replica 0's programs with its own ranks. Its times are replica 0's, bit for bit,
when everything a time depends on is the same:

* the devices at each tensor-parallel position are of one type (the compute model prices by
  type);
* each collective inside a replica (tensor parallelism) resolves to the same algorithm and
  releases each position at the same offset in every replica;
* each collective across replicas (the data-parallel buckets, parameter broadcasts or averages)
  holds one rank of every replica and releases all of them at the same offset, so that the
  replicas leave it together;
* no group is called from two streams of a rank, and every collective keeps its priced timing
  in the whole run (:mod:`sim.engine`): nothing runs on the shared fabric.

Then the engine runs replica 0 alone (:meth:`sim.engine.Engine.run_segment` with the other
replicas' rank maps, :func:`replica_images`): a collective across replicas starts when replica
0's rank arrives, which is when every replica's does, and takes its priced timing over the whole
group. Whether every collective keeps its priced timing is the engine's to check as it runs
each segment. It runs the whole run at the priced timings first and keeps that run where its
calls prove apart (:mod:`sim.engine`); by the other conditions that run is replica 0's, its
calls inside a replica repeated in every replica at the same times on that replica's ranks, so
replica 0's run with those images holds every call of the whole run with its start and timing,
and the engine decides on them as it would on the whole run. Two groups' schedules may cross a common channel (two tensor-parallel groups in a host
whose data-parallel rings hop between them) where their calls never carry bytes on it at once
(the data-parallel allreduce after the backward, without overlap); where they would, the engine
says so and every replica is simulated. Where a condition fails (a ZeRO-1 broadcast from each
rank in turn, a tree whose leaves finish before its root, two data-parallel groups behind one
NIC reducing at once), every replica is simulated.
"""

from __future__ import annotations

from models.ops import OpKind
from sim.engine import Engine
from sim.program import Op
from sim.topology import Topology
from sim.training.lower import StepShape, TrainingStep


def replica_images(shape: StepShape) -> tuple[dict[int, int], ...]:
    """Per replica after the first, its rank at each of replica 0's ranks (the same position)."""
    first = shape.replicas[0]
    return tuple(dict(zip(first, replica)) for replica in shape.replicas[1:])


def replicas_identical(shape: StepShape, step: TrainingStep, engine: Engine, topology: Topology) -> bool:
    """Whether every replica of ``shape`` runs exactly as replica 0 in ``step`` (lowered for
    replica 0 only, :func:`sim.training.lower.lower_step`) as far as can be told before it runs:
    every condition of the module docstring but that every collective keeps its priced timing,
    which the engine checks as it runs replica 0 with :func:`replica_images`.

    Raises:
        ConfigError: from the pricer (an algorithm that does not apply to a group).
    """
    replicas = shape.replicas
    if len(replicas) < 2:
        return False
    first = replicas[0]
    for replica in replicas[1:]:
        if any(topology.devices[r].spec.name != topology.devices[r0].spec.name for r0, r in zip(first, replica)):
            return False
    position = {rank: (d, t) for d, replica in enumerate(replicas) for t, rank in enumerate(replica)}
    seen: set[tuple] = set()
    for part in step.segments:
        for rank, program in part.segment.programs.items():
            streams: dict[tuple[int, ...], set] = {}
            for op in program:
                c = op.collective
                if c is None:
                    continue
                streams.setdefault(c.group, set()).add(op.stream)
                key = (c.kind, c.algorithm, c.group, c.size_bytes, c.root, op.name)
                if key in seen:
                    continue
                seen.add(key)
                if set(c.group) <= set(first):
                    if not _same_in_every_replica(op, replicas, position, engine):
                        return False
                elif not _released_together(op, replicas, position, engine):
                    return False
            if any(len(used) > 1 for used in streams.values()):
                return False
    return True


def _same_in_every_replica(op: Op, replicas, position, engine: Engine) -> bool:
    c = op.collective
    reference_algorithm, reference = engine.pricer.price(c.kind, c.algorithm, c.group, c.size_bytes, c.root, op.name,
                                                         dtype=c.dtype)
    offsets = {position[r][1]: reference.finish_s.get(r, 0.0) for r in c.group}
    for replica in replicas:
        group = tuple(replica[position[r][1]] for r in c.group)
        root = None if c.root is None else replica[position[c.root][1]]
        algorithm, timing = engine.pricer.price(c.kind, c.algorithm, group, c.size_bytes, root, op.name, dtype=c.dtype)
        if algorithm != reference_algorithm or timing.wait_s != reference.wait_s:
            return False
        if any(timing.finish_s.get(r, 0.0) != offsets[position[r][1]] for r in group):
            return False
    return True


def _released_together(op: Op, replicas, position, engine: Engine) -> bool:
    c = op.collective
    if sorted(position[r][0] for r in c.group) != list(range(len(replicas))):
        return False
    if c.kind is not OpKind.ALLREDUCE and len({position[r][1] for r in c.group}) != 1:
        return False
    _, timing = engine.pricer.price(c.kind, c.algorithm, c.group, c.size_bytes, c.root, op.name, dtype=c.dtype)
    return not timing.wait_s and len({timing.finish_s.get(r, 0.0) for r in c.group}) == 1
