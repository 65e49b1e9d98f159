"""A pipeline's run in simulated time: stages priced by the engine, composed GPipe-style.

Each stage's pass over one micro-batch is its own tensor-parallel phase (:mod:`sim.pipeline`),
priced by the :class:`sim.engine.Engine` as any phase is (its collectives stay inside the
stage's group). The pipeline composes those durations in one simpy environment with a
:class:`sim.fabric.Fabric`: stage s runs its micro-batches in order, micro-batch j once the
stage before has sent it (:meth:`sim.engine.Engine.send`, on the shared network, so hops that
cross one link at once share it); from the last stage the sampled tokens go back to the first,
which embeds them for the next step (GPipe, arXiv 1811.06965, section 2.2; the relay of
llama.cpp RPC or prima.cpp with one micro-batch).

* The prefill is one round from idle stages: it lasts until the last stage's last LM head
  (TTFT); its bubble, every stage idle while the pipeline fills and drains, is in the trace.
* A decode step is the steady state of rounds that follow each other without a barrier: the
  first stage starts micro-batch j of step k+1 as soon as its token of step k is back, while
  later stages still work on step k. The step's duration is the period between the last
  tokens of two consecutive rounds, simulated over :data:`DECODE_ROUNDS` identical rounds from
  idle stages, and where stages share cores :data:`FOLLOWING_ROUNDS` more (with m <= P micro-batches of equal stages, the second round is already
  periodic: the period is max(m x the slowest stage, one micro-batch's trip around the ring)).
  The trace shows the last round, ending at the step's end; its first ops start before the
  step's start, overlapping the step before, as they do in a pipeline.

Stages whose ranks share one machine's cores (``cluster.cores``, :mod:`sim.cores`) share them
and its memory bandwidth with the stages computing at the same moment of the schedule. Each pass
is priced with ``k`` = 1, 2, ... of those stages computing (:func:`sim.replicas.replica_pools`,
the stages as groups, ``computing=k``: its share of the pool, memory streams included), and in
the schedule a pass progresses at ``1 / d_k`` of its work per second, its duration ``d_k`` at
the number ``k`` of passes running at that moment (processor sharing at the pass's grain, as
:class:`sim.cores.ProcessorSharing` is at the op's). Where the machine's cores are not shared
(no ``cluster.cores``, GPUs) a pass has its one duration: nothing changes. The count is the
schedule's own: with equal stages, ``min(m, S)`` in decode's steady state (a batch-1 relay: 1)
and the fill and drain's ramp in the prefill; with GPT-2's last stage (its LM head) 2.7 times
the others' pass, the others idle part of each step. Judged offline on the plan check's PP-4
candidates (4 one-rank stages, batch 4, 2 cores; a prediction): TTFT -36% -> -20%, TPOT -39% ->
-19% (``benchmarks/bench_layouts_offline.py``; the batch-1 relay, alone, misses -15%). The trace shows each pass as priced alone,
stretched evenly to the time it took shared.

Contention between a hop and the stages' own collectives is not modelled (each is priced on
its own network); hops share the fabric among themselves. Replicas of a pipeline
(``parallel.replicas``, :mod:`sim.replicas`) are simulated one at a time, each on its own block of
devices, and their hops share the links they cross: a replica's schedule issues, beside each of
its own hops, the hop its mirror stage in every other replica (``mirrors``) sends for the same
micro-batch, at the same moment, on the same fabric. The replicas are taken to run in lockstep,
as :func:`sim.replicas.replica_pools` takes them to share the cores: exact for replicas laid out
alike on equal batches; where the batch splits unevenly, the hops of a micro-batch the simulated
replica does not have are left out. Op times of a stage's pass are the
engine's, so every quantity stays piecewise linear in the decode step, as
:mod:`sim.timeline` needs to interpolate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from weakref import WeakKeyDictionary

import numpy as np
import simpy

from models.ops import OpKind
from sim.alike import group_shape, relabel_result, sharing_shape
from sim.cores import SharedProgress
from sim.engine import Engine
from sim.network import CollectivePricer, CollectiveTiming, Links
from sim.fabric import Fabric
from sim.memory import CATEGORIES, PhaseMemory, phase_memory
from sim.pipeline import Hop, PipelinePlan
from sim.plan import MemoryCategory, Stream
from sim.replicas import replica_pools
from sim.timeline import PhaseRun, RunResult, simulate_run
from sim.topology import Topology
from sim.trace import MEMORY_COLUMNS, OP_COLUMNS, TraceStrings, phase_columns, phase_ops
from sim.vocabulary import PhaseKind

_SHAPES: WeakKeyDictionary = WeakKeyDictionary()  # engine -> {group: its shape} (PipelineRunner._shape)

DECODE_ROUNDS = 3
"""Identical rounds simulated to find a decode step's steady-state period (two for one micro-batch)."""

FOLLOWING_ROUNDS = 1
"""Rounds simulated after those of :data:`DECODE_ROUNDS` where stages share cores, so that the
last measured round computes beside the next one's first passes, as in the steady state."""


@dataclass(frozen=True)
class Task:
    """Stage ``stage`` running micro-batch ``micro_batch`` in round ``round`` from ``start_s`` to
    ``end_s``, then its hop (:meth:`sim.pipeline.PipelinePlan.hop_on`) from ``end_s`` to
    ``hop_end_s`` (s from the schedule's start)."""

    round: int
    stage: int
    micro_batch: int
    start_s: float
    end_s: float
    hop: Hop | None
    hop_end_s: float


@dataclass(frozen=True)
class PipelinePhaseRun:
    """A simulated pipeline phase: each stage's passes (``passes[stage, size, computing]``: per
    micro-batch size and how many stages sharing its machine's cores computed, 1: alone), the
    schedule of the rounds, the phase's duration (prefill: to the last LM head; decode: the
    steady-state period) and per-rank memory over one round."""

    plan: PipelinePlan
    step: int
    passes: dict[tuple[int, int, int], PhaseRun]
    tasks: tuple[Task, ...]
    duration_s: float
    origin_s: float
    memory: dict[int, PhaseMemory]
    twins: dict[tuple[int, int, int], tuple[int, int, int]]  # pass -> the pass it shares (a stage laid out alike), or itself

    def signature(self) -> np.ndarray:
        """Every simulated time of the phase as one vector (for :mod:`sim.timeline`'s linearity
        test): the duration, the schedule and each pass's op times. Memory is left out: the
        timeline takes a step's resident bytes as linear in the step by construction and the
        peaks from the extreme steps (a peak is convex in the step), and a pass's peak changes
        regime (another op's workspace becomes the largest) where no time does."""
        parts = [np.array([self.duration_s])]
        parts.append(np.array([x for t in self.tasks for x in (t.start_s, t.end_s, t.hop_end_s)]))
        for key in sorted(self.passes):
            for result in self.passes[key].results:
                parts += [result.starts[rank] for rank in sorted(result.starts)]
                parts += [result.ends[rank] for rank in sorted(result.ends)]
        return np.concatenate(parts)

    @property
    def results(self) -> tuple:
        """Every stage pass's segment results (:class:`sim.engine.SegmentResult`)."""
        return tuple(res for key in sorted(self.passes) for res in self.passes[key].results)

    def stall_s(self) -> float:
        """Weights are resident in a pipeline: no rank waits for a load."""
        return 0.0

    def expand(self, start_s: float, base_bytes: dict[int, float], strings: TraceStrings
               ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Op rows and memory samples (column arrays, strings coded by ``strings``) of the last
        round (each stage pass's columns, :func:`sim.trace.phase_columns`, shifted to its start,
        and a ``send`` row on the sender and the receiver of each hop), times from the run's
        start; the phase starts at ``start_s`` with ``base_bytes`` per rank."""
        last = max(t.round for t in self.tasks)
        columns: dict[tuple[int, int, int], tuple] = {}
        op_parts, memory_parts, hops = [], [], []
        base = dict(base_bytes)
        shift = start_s - self.origin_s
        name = PhaseKind.of_step(self.step).value
        for task in (t for t in self.tasks if t.round == last):
            key = (task.stage, self.plan.micro_batches[task.micro_batch], 1)
            run = self.passes[key]
            if key not in columns:
                twin = self.twins[key]
                if twin not in columns:
                    phase = self.plan.stage_plan(twin[0], task.micro_batch).phase(self.step)
                    ops, memory = phase_columns(PhaseRun(phase, run.results, run.duration_s, run.memory), 0.0,
                                                dict.fromkeys(run.memory, 0.0), strings)
                    ranks, index = np.unique(memory["rank"], return_inverse=True)
                    columns[twin] = ops, memory, ranks, index
                if twin != key:  # the shared pass's rows, on this stage's ranks and layers
                    ops, memory, ranks, index = columns[twin]
                    stage_ranks = self.plan.stage_ranks
                    rename = dict(zip(stage_ranks[twin[0]], stage_ranks[key[0]]))
                    layers = self.plan.stages[key[0]].first_layer - self.plan.stages[twin[0]].first_layer
                    renamed = np.array([rename[r] for r in ranks])
                    op_ranks, op_index = np.unique(ops["rank"], return_inverse=True)
                    columns[key] = (ops | {"rank": np.array([rename[r] for r in op_ranks])[op_index],
                                           "layer": np.where(ops["layer"] >= 0, ops["layer"] + layers, ops["layer"])},
                                    memory | {"rank": renamed[index]}, renamed, index)
            ops, memory, ranks, index = columns[key]
            at = shift + task.start_s
            # the pass as priced alone, stretched to the time it took sharing the cores (1 elsewhere)
            stretch = (task.end_s - task.start_s) / run.duration_s if run.duration_s > 0 else 1.0
            op_parts.append(ops | {"start_s": ops["start_s"] * stretch + at, "end_s": ops["end_s"] * stretch + at})
            memory_parts.append({"rank": memory["rank"], "time_s": memory["time_s"] * stretch + at,
                                 "bytes": memory["bytes"] + np.array([base[r] for r in ranks])[index]})
            for r, mem in run.memory.items():
                base[r] += sum(mem.end_by_category.values())
            if task.hop is not None:
                label = "send_tokens" if task.hop.tokens else "send_hidden"
                for rank in (task.hop.src, task.hop.dst):
                    hops.append((rank, strings.code(Stream.COMM.value), strings.code(OpKind.SEND.value),
                                 strings.code(label), strings.code(name), self.step, -1,
                                 shift + task.end_s, shift + task.hop_end_s, float(task.hop.size_bytes), 0.0))
        ops = phase_ops({c: np.concatenate([part[c] for part in op_parts]) for c in op_parts[0]}, name, self.step,
                        strings)
        if hops:
            hop_columns = dict(zip(OP_COLUMNS, zip(*hops)))
            ops = {c: np.concatenate([ops[c], np.array(hop_columns[c])]) for c in OP_COLUMNS}
        return ops, {c: np.concatenate([part[c] for part in memory_parts]) for c in MEMORY_COLUMNS}


class PipelineRunner:
    """Prices the phases of a :class:`PipelinePlan` (the runner :func:`sim.timeline.simulate_run`
    takes); ``mirrors``: the other replicas' plans, whose hops share the fabric with the plan's
    (see the module docstring)."""

    def __init__(self, plan: PipelinePlan, engine: Engine, topology: Topology, mirrors: tuple[PipelinePlan, ...] = ()):
        self.plan, self.engine, self.topology, self.mirrors = plan, engine, topology, mirrors
        self._shapes = _SHAPES.setdefault(engine, {})  # the variants of a simulation share them

    def run_phase(self, step: int, start: dict[int, dict[MemoryCategory, int]], start_s: float) -> PipelinePhaseRun:
        """Phase ``step`` with ``start`` bytes resident per rank when it begins at ``start_s``."""
        plan = self.plan
        passes: dict[tuple[int, int, int], PhaseRun] = {}
        memory: dict[int, PhaseMemory] = {}
        empty = dict.fromkeys(CATEGORIES, 0)
        alike: dict[tuple, tuple[int, int, int]] = {}  # what sets a pass's times -> the first pass priced
        twins: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        cores = self.engine.cores
        stages = len(plan.stages)
        on_pools = frozenset().union(*(pool.ranks for pool in cores))
        # the stages whose ranks are all on the machine (cluster.cores: one pool), where they mirror each other
        sharing = frozenset(s for s in range(stages) if on_pools.issuperset(plan.stage_ranks[s])) if cores else frozenset()
        for s in range(stages):
            ring = [plan.stage_ranks[b] for b in (*range(s + 1, stages), *range(s)) if b in sharing]
            counts = range(1, len(ring) + 2 if s in sharing else 2)  # stages computing with this one's pass
            for j, k in ((j, k) for j in range(len(plan.micro_batches)) for k in counts):
                key = (s, plan.micro_batches[j], k)
                if key in passes:
                    continue
                pools = replica_pools(cores, [plan.stage_ranks[s], *ring], plan.stage_ranks[s], computing=k)
                stage = plan.stages[s]
                twin = twins[key] = alike.setdefault((self._shape(s), stage.num_layers, stage.embeds, stage.heads,
                                                      key[1], sharing_shape(pools, plan.stage_ranks[s])), key)
                if twin != key:
                    # A stage whose group is laid out as an earlier one's runs the same ops in the same
                    # times: its pass is that one's, rank for rank (lowered again only for the trace).
                    ranks = dict(zip(plan.stage_ranks[twin[0]], plan.stage_ranks[s]))
                    run = passes[twin]
                    passes[key] = PhaseRun(run.phase, tuple(relabel_result(res, ranks) for res in run.results),
                                           run.duration_s, {ranks[r]: mem for r, mem in run.memory.items()})
                    continue
                phase = plan.stage_plan(s, j).phase(step)
                self.engine.cores = pools
                try:
                    results = tuple(self.engine.run_segment(seg) for seg in phase.segments)
                finally:
                    self.engine.cores = cores
                duration = sum(seg.repeat * res.duration_s for seg, res in zip(phase.segments, results))
                # Memory of the pass alone (from nothing resident): from any start, a pass's memory is
                # that start plus this (sim.memory.phase_memory adds every event to the start).
                same_ledgers: dict = {}  # ranks whose ledgers are equal share one
                passes[key] = PhaseRun(phase, results, duration, {
                    r: phase_memory(phase, results, r, empty, 1 << 62, 0.0, same_ledgers) for r in plan.stage_ranks[s]})
            # A stage runs its micro-batches one after another: its memory is their ledgers in turn.
            for r in plan.stage_ranks[s]:
                current, capacity = dict(start[r]), self.topology.devices[r].memory_capacity_bytes
                peak, peak_by_category, overflow = sum(current.values()), dict(current), None
                for j in range(len(plan.micro_batches)):
                    run = passes[s, plan.micro_batches[j], 1]
                    alone = run.memory[r]
                    if sum(current.values()) + alone.peak_bytes > peak:
                        peak = sum(current.values()) + alone.peak_bytes
                        peak_by_category = {c: current[c] + alone.peak_by_category[c] for c in CATEGORIES}
                    if overflow is None and peak > capacity:
                        overflow = phase_memory(plan.stage_plan(s, j).phase(step), run.results, r, current,
                                                capacity, start_s).overflow
                    current = {c: current[c] + alone.end_by_category[c] for c in CATEGORIES}
                memory[r] = PhaseMemory(peak, peak_by_category, current, overflow)
        phase_kind = PhaseKind.of_step(step)
        # One micro-batch is a relay, periodic from its second round on: two rounds give the period.
        rounds = 1 if phase_kind == PhaseKind.PREFILL else 2 if len(plan.micro_batches) == 1 else DECODE_ROUNDS
        # Stages sharing cores: the measured round's tail shares them with the next round's head, as
        # every step but the last does (the last round simulated would have them to itself).
        following = FOLLOWING_ROUNDS if rounds > 1 and len(sharing) > 1 else 0
        new_tokens = plan.prompt_tokens if step == 0 else 1
        pass_s = {(s, j): tuple(passes[s, plan.micro_batches[j], k].duration_s
                                for k in range(1, (len(sharing) if s in sharing else 1) + 1))
                  for s in range(stages) for j in range(len(plan.micro_batches))}
        tasks = self._schedule(pass_s, rounds + following, new_tokens)
        last_stage = len(plan.stages) - 1
        token_s = [max(t.end_s for t in tasks if t.round == r and t.stage == last_stage) for r in range(rounds)]
        if rounds == 1:
            duration, origin = token_s[0], 0.0
        else:
            duration, origin = token_s[-1] - token_s[-2], token_s[-2]
        return PipelinePhaseRun(plan, step, passes, tuple(t for t in tasks if t.round < rounds), duration, origin,
                                memory, twins)

    def _shape(self, stage: int) -> tuple:
        """The layout of ``stage``'s group (:func:`group_shape`), computed once per simulation."""
        ranks = self.plan.stage_ranks[stage]
        if ranks not in self._shapes:
            self._shapes[ranks] = group_shape(self.topology, self.engine.links, ranks)
        return self._shapes[ranks]

    def _schedule(self, pass_s: dict[tuple[int, int], tuple[float, ...]], rounds: int,
                  new_tokens: int) -> tuple[Task, ...]:
        """``rounds`` rounds of every micro-batch through every stage, from idle stages, with hops
        on one fabric; the first round's inputs are at hand at time 0. ``pass_s[stage,
        micro_batch][k - 1]``: the pass's duration (s) with ``k`` stages sharing the cores computing
        (one duration: a stage that shares them with no other); while ``k`` of them compute, each
        does ``1 / d_k`` of its pass per second (see the module docstring)."""
        plan, engine = self.plan, self.engine
        stages, count = len(plan.stages), len(plan.micro_batches)
        env = simpy.Environment()
        fabric = Fabric(env, engine.links, engine.load_rate_cap)
        ready = {(r, s, j): env.event() for r in range(rounds) for s in range(stages) for j in range(count)}
        for j in range(count):
            ready[0, 0, j].succeed()
        tasks: list[Task] = []
        passes_sharing = _PassSharing(env, pass_s)

        def compute(s: int, j: int) -> simpy.Event:
            if len(pass_s[s, j]) == 1 or pass_s[s, j][0] <= 0:
                return env.timeout(pass_s[s, j][0])  # nothing shared: its one duration
            return passes_sharing.run((s, j))

        def stage(s: int):
            for r in range(rounds):
                for j in range(count):
                    yield ready[r, s, j]
                    start = env.now
                    yield compute(s, j)
                    end = env.now
                    hop = plan.hop_on(s, j, new_tokens)
                    if hop is None:
                        tasks.append(Task(r, s, j, start, end, None, end))
                        continue
                    # The last round's tokens go back too (for the step after): the trace shows the relay.
                    arrival = engine.send(fabric, hop.src, hop.dst, hop.size_bytes)
                    for mirror in self.mirrors:  # the other replicas' hops at this moment: traffic on shared links
                        if j < len(mirror.micro_batches):
                            twin = mirror.hop_on(s, j, new_tokens)
                            engine.send(fabric, twin.src, twin.dst, twin.size_bytes)
                    arrival.callbacks.append(partial(arrived, Task(r, s, j, start, end, hop, 0.0),
                                                     ready.get((r + hop.tokens, (s + 1) % stages, j))))

        def arrived(task: Task, target: simpy.Event | None, _event: simpy.Event) -> None:
            tasks.append(replace(task, hop_end_s=env.now))
            if target is not None:
                target.succeed()

        for s in range(stages):
            env.process(stage(s))
        env.run()
        return tuple(sorted(tasks, key=lambda t: (t.round, t.stage, t.micro_batch)))


class _PassSharing(SharedProgress):
    """Stage passes sharing one machine's cores in a pipeline's schedule: a pass, one unit of work,
    progresses at ``1 / d_k`` per second while ``k`` passes run (``pass_s[stage, micro_batch][k - 1]``
    = ``d_k``, see the module docstring)."""

    def __init__(self, env: simpy.Environment, pass_s: dict[tuple[int, int], tuple[float, ...]]):
        super().__init__(env)
        self.pass_s = pass_s

    def run(self, stage_micro_batch: tuple[int, int]) -> simpy.Event:
        """An event that succeeds once the pass of ``(stage, micro-batch)``, started now, is done."""
        return self._start(1.0, stage_micro_batch)

    def _set_rates(self) -> None:
        for job in self._jobs.values():
            job[2] = 1.0 / self.pass_s[job[3]][len(self._jobs) - 1]


class AlikeGroups:
    """A :class:`sim.network.CollectivePricer` that prices a collective over a group laid out
    like one it priced before (:func:`group_shape`: a pipeline's stages on alike nodes) as that
    one's, ranks renamed: the same timing, without running the network model again."""

    def __init__(self, pricer: CollectivePricer, topology: Topology, links: Links):
        self.pricer, self.topology, self.links = pricer, topology, links
        self.network = pricer.network
        self._first: dict[tuple, tuple[int, ...]] = {}  # shape -> the first group of that shape
        self._groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # group -> the first group of its shape
        self._timings: dict[tuple, tuple[str, CollectiveTiming]] = {}

    def price(self, kind, algorithm: str, group: tuple[int, ...], size_bytes: int, root: int | None = None,
              call: str | None = None, arrivals: dict[int, float] | None = None,
              dtype: str | None = None) -> tuple[str, CollectiveTiming]:
        """See :meth:`sim.network.CollectivePricer.price`."""
        group = tuple(group)
        first = self._groups.get(group)
        if first is None:
            first = self._groups[group] = self._first.setdefault(group_shape(self.topology, self.links, group), group)
        if first == group:
            return self.pricer.price(kind, algorithm, group, size_bytes, root, call, arrivals, dtype)
        key = (kind, algorithm, group, size_bytes, root, call,
               None if arrivals is None else tuple(arrivals[r] for r in group), dtype)
        if key not in self._timings:
            to_first = dict(zip(group, first))
            resolved, timing = self.pricer.price(kind, algorithm, first, size_bytes,
                                                 None if root is None else to_first[root], call,
                                                 None if arrivals is None
                                                 else {to_first[r]: a for r, a in arrivals.items()}, dtype)
            back = dict(zip(first, group))
            self._timings[key] = resolved, replace(timing, finish_s={back[r]: t for r, t in timing.finish_s.items()})
        return self._timings[key]

    def schedule(self, *key):
        """See :meth:`sim.network.CollectivePricer.schedule`."""
        return self.pricer.schedule(*key)


def simulate_pipeline_run(plan: PipelinePlan, engine: Engine, topology: Topology,
                          mirrors: tuple[PipelinePlan, ...] = ()) -> RunResult:
    """Price every phase of ``plan``: :func:`sim.timeline.simulate_run` with a :class:`PipelineRunner`
    (``mirrors``: the other replicas' plans, whose hops share the links)."""
    return simulate_run(plan, engine, topology, PipelineRunner(plan, engine, topology, mirrors))
