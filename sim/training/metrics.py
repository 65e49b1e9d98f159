"""Metrics of a simulated training step (the tidy result table's training rows).

* ``step_time_s``: one optimizer step, from the first forward to the end of the optimizer step
  (and, under parameter averaging with period H, the mean of H - 1 local steps and one
  averaging step).
* ``samples_per_s``, ``tokens_per_s``: the global batch (sequences, and their tokens) over the
  step time.
* ``communication_s``: on one rank, the time some collective of the rank is in flight (the
  union of its collectives' intervals); ``exposed_communication_s``: the part of it during
  which the rank computes nothing, i.e. communication not hidden behind compute (reported for
  the rank where it is largest); ``overlap_ratio``: hidden over all communication on that rank,
  ``1 - exposed / communication`` (0 without communication).
* ``forward_s``, ``recompute_s``, ``optimizer_s``: compute time of each
  :class:`sim.vocabulary.TrainingPhase` on the busiest rank (the most compute in all).
* ``backward_s``: on that rank, each micro-batch's backward pass from its start to its last
  gradient computed (the end of its last op on the compute stream), summed over the step's
  micro-batches: the recomputation under checkpointing (``recompute_s``) and the gradient casts
  of compression are in it, the wait for the buckets' allreduces after the last gradient is not
  (that is ``exposed_communication_s``). The runtime measures the same span
  (:func:`runtime.training.measure.step_metrics`: to the last bucket's ready time, DDP's hook
  being called once the bucket's last gradient is computed).

The terms of a step (:data:`STEP_TERMS`, :func:`step_terms`): forward, backward less its
recomputation, recomputation and optimizer compute on the busiest rank, and the exposed
communication; they add up to about the step (the exposed communication is the rank where it is
largest, not always the busiest). :func:`bottleneck` names the largest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from models.ops import OpKind
from sim.program import Stream
from sim.vocabulary import Metric, TrainingPhase

_PHASE_METRICS = {TrainingPhase.FORWARD: Metric.FORWARD_TIME, TrainingPhase.RECOMPUTE: Metric.RECOMPUTE_TIME,
                  TrainingPhase.OPTIMIZER: Metric.OPTIMIZER_TIME}
_BACKWARD_PHASES = (TrainingPhase.BACKWARD, TrainingPhase.RECOMPUTE)
STEP_TERMS = {Metric.FORWARD_TIME: "forward compute", Metric.BACKWARD_TIME: "backward compute",
              Metric.RECOMPUTE_TIME: "recomputation", Metric.OPTIMIZER_TIME: "the optimizer step",
              Metric.EXPOSED_COMMUNICATION: "exposed communication"}
"""The terms of a training step (see the module docstring) and how reports name them. The exposed
communication is every collective of the rank no compute hides: the buckets' gradient allreduces
and, under tensor parallelism, the activations' allreduces inside the replica, so it is not named
for gradients alone."""


def step_terms(metrics: dict[str, float]) -> dict[Metric, float]:
    """Seconds of each of :data:`STEP_TERMS` in a step of ``metrics`` (:func:`step_metrics`), the
    backward less the recomputation it holds, so that no second is counted twice."""
    terms = {metric: metrics.get(metric, 0.0) for metric in STEP_TERMS}
    terms[Metric.BACKWARD_TIME] -= terms[Metric.RECOMPUTE_TIME]
    return terms


def bottleneck(metrics: dict[str, float]) -> str:
    """The term that takes most of a step (:func:`step_terms`) and its share of the step time, as
    ``backward compute (61% of the step)``; '' where the step time is not positive."""
    step = metrics[Metric.STEP_TIME]
    metric, seconds = max(step_terms(metrics).items(), key=lambda item: item[1])
    if not (step > 0 and math.isfinite(seconds)):
        return ""
    return f"{STEP_TERMS[metric]} ({100 * seconds / step:.0f}% of the step)"


def union_length_s(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of intervals ``[starts[i], ends[i])`` (s)."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    # A new run of overlapping intervals starts where an interval begins after every earlier end.
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > e[:-1]
    run_start = s[new]
    run_end = np.append(e[np.flatnonzero(new)[1:] - 1], e[-1])
    return float(np.sum(run_end - run_start))


def _segment_rank_times(segment, phases, result, rank) -> tuple[float, float, dict[TrainingPhase, float], float]:
    """(communication union, exposed communication, compute time by phase, backward span: see
    ``backward_s`` in the module docstring) of one rank in one instance of a segment (s)."""
    program = segment.programs[rank]
    starts, ends = result.starts[rank], result.ends[rank]
    # A comm thread's work on shared cores is the bucket's communication, not the rank's compute.
    is_comm = np.array([op.collective is not None or op.kind is OpKind.COMM_THREAD for op in program], dtype=bool)
    comm = union_length_s(starts[is_comm], ends[is_comm])
    both = union_length_s(starts, ends)
    compute = union_length_s(starts[~is_comm], ends[~is_comm])
    by_phase: dict[TrainingPhase, float] = {}
    durations = ends - starts
    for i in np.flatnonzero(~is_comm):
        by_phase[phases[i]] = by_phase.get(phases[i], 0.0) + float(durations[i])
    backward = np.array([op.stream is Stream.COMPUTE and phase in _BACKWARD_PHASES
                         for op, phase in zip(program, phases)], dtype=bool)
    span = float(ends[backward].max() - starts[backward].min()) if backward.any() else 0.0
    return comm, both - compute, by_phase, span


def step_metrics(steps: Sequence, weights: Sequence[int], shape, workload) -> dict[str, float]:
    """The whole-run training metrics (see the module docstring) of simulated ``steps``
    (:class:`sim.training.simulate.SimulatedStep`) that occur ``weights`` times each per period,
    for ``shape`` (:class:`sim.training.lower.StepShape`) and the training ``workload``."""
    total = sum(weights)
    ranks = sorted(steps[0].step.segments[0].segment.programs)
    comm = dict.fromkeys(ranks, 0.0)
    exposed = dict.fromkeys(ranks, 0.0)
    phase_s = {rank: dict.fromkeys(TrainingPhase, 0.0) for rank in ranks}
    backward_s = dict.fromkeys(ranks, 0.0)
    cache: dict[tuple[int, int], tuple] = {}
    step_time = 0.0
    for simulated, weight in zip(steps, weights):
        step_time += weight * simulated.duration_s / total
        for part, result in zip(simulated.step.segments, simulated.results):
            scale = weight * part.segment.repeat / total
            for rank in ranks:
                key = (id(part.segment), rank)
                if key not in cache:
                    cache[key] = _segment_rank_times(part.segment, part.phases[rank], result, rank)
                c, x, by_phase, span = cache[key]
                comm[rank] += scale * c
                backward_s[rank] += scale * span
                exposed[rank] += scale * x
                for phase, value in by_phase.items():
                    phase_s[rank][phase] += scale * value
    critical = max(ranks, key=lambda r: (exposed[r], -r))
    busiest = max(ranks, key=lambda r: (sum(phase_s[r].values()), -r))
    metrics = {
        Metric.STEP_TIME: step_time,
        Metric.SAMPLES_PER_S: workload.global_batch_size / step_time,
        Metric.TOKENS_PER_S: workload.tokens_per_step / step_time,
        Metric.COMMUNICATION_TIME: comm[critical],
        Metric.EXPOSED_COMMUNICATION: exposed[critical],
        Metric.OVERLAP_RATIO: 1.0 - exposed[critical] / comm[critical] if comm[critical] > 0 else 0.0,
    }
    metrics |= {metric: phase_s[busiest][phase] for phase, metric in _PHASE_METRICS.items()}
    metrics[Metric.BACKWARD_TIME] = backward_s[busiest]
    return metrics
