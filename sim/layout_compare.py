"""Layouts compared: which of a scenario's layouts wins each metric, and which term decides it.

Where a scenario's variants choose their own layouts (``variants[].parallel``), each row of
:func:`compare_layouts` holds a variant's layout, the devices it uses and leaves idle, its TTFT,
TPOT and decode tokens/s, and where its devices' time goes in the prefill and in the first decode
step (:func:`sim.bottleneck.step_breakdown`: per :class:`sim.bottleneck.StepTerm`, the mean over
its devices, adding up to the step).

For TTFT and TPOT the winner is the lowest among the variants that fit in memory, the runner-up
the next; the term that decides is the one whose time the runner-up's devices exceed the
winner's by most, in the step the metric times (the prefill, or the first decode step for TPOT).
Over all terms these differences add up to the two steps' difference, so the decisive term is the
largest part of the gap. Decode tokens/s is the batch over TPOT, summed over replicas: its
winner is named with what gives it the lead (a shorter TPOT, or replicas decoding side by side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sim.bottleneck import StepTerm, step_breakdown
from sim.parallel import ParallelPlan
from sim.simulate import SimulationResult, VariantResult
from sim.topology import Topology
from sim.units import bandwidth_text, duration_text, significant
from sim.vocabulary import Metric, PhaseKind

_LOWER_WINS = {Metric.TTFT: PhaseKind.PREFILL, Metric.TPOT: PhaseKind.DECODE}
COMPARED = (Metric.TTFT, Metric.TPOT, Metric.DECODE_TOKENS_PER_S)
"""The metrics a comparison names a winner of, in the order its sentences come."""
_METRIC_NAMES = {Metric.TTFT: "TTFT", Metric.TPOT: "TPOT", Metric.DECODE_TOKENS_PER_S: "decode tokens/s"}


@dataclass(frozen=True)
class LayoutRow:
    """One variant's layout and results.

    Attributes:
        variant: the variant's name; layout: its label (:attr:`sim.parallel.ParallelPlan.label`).
        used, idle: the devices it runs on and those it leaves unused (names, topology order).
        timing: TTFT, TPOT (s) and decode tokens/s (tokens/s), as the variant reports them.
        fits: whether every device's peak memory fits.
        breakdown: per phase (the prefill, the first decode step), seconds per term
            (:func:`sim.bottleneck.step_breakdown`); empty for a phase the trace does not hold.
    """

    variant: str
    layout: str
    used: tuple[str, ...]
    idle: tuple[str, ...]
    timing: dict[Metric, float]
    fits: bool
    breakdown: dict[PhaseKind, dict[StepTerm, float]]

    @property
    def title(self) -> str:
        """``tp2_pp3 (TP=2 x PP=3)``."""
        return f"{self.variant} ({self.layout})"


@dataclass(frozen=True)
class Verdict:
    """The winner of one metric among the layouts that fit, and why.

    Attributes:
        metric: TTFT, TPOT or decode tokens/s.
        winner, runner_up: the best and second-best rows (runner_up None when one fits).
        term: for TTFT and TPOT, the term whose time decides (see the module docstring); None
            for tokens/s, without a runner-up, or where no term's time is larger for it.
        term_s: the runner-up's devices' extra mean seconds in ``term`` in the metric's step.
        gap_s: the difference of the two rows' steps (s), the sum of every term's difference.
        reason: the words naming ``term`` where it is spent (``allreduce between hosts (10 Gbit/s)``),
            or what gives the tokens/s winner its lead.
        back_s, back_reason: where ``term_s`` exceeds the gap, the term the winner's devices spend
            most more time in (its extra seconds, and words for it, as ``reason``); else 0 and ''.
    """

    metric: Metric
    winner: LayoutRow
    runner_up: LayoutRow | None
    term: StepTerm | None
    term_s: float
    gap_s: float
    reason: str
    back_s: float = 0.0
    back_reason: str = ""

    def sentence(self) -> str:
        """``TPOT: pp6 (TP=1 x PP=6) wins, 12.3 ms vs 15.1 ms for tp2_pp3 (TP=2 x PP=3): per
        token, its devices spend on average 3.1 ms more in allreduce inside a host (200 Gbit/s),
        80% of the gap.``"""
        name, win = _METRIC_NAMES[self.metric], self.winner
        if self.runner_up is None:
            return f"{name}: {win.title} is the only layout that fits in memory ({_value(self.metric, win)})."
        other = self.runner_up
        if _value(self.metric, win) == _value(self.metric, other):
            return f"{name}: {win.title} and {other.title} tie ({_value(self.metric, win)})."
        head = f"{name}: {win.title} wins, {_value(self.metric, win)} vs {_value(self.metric, other)} for {other.title}"
        if self.metric == Metric.DECODE_TOKENS_PER_S:
            return f"{head}: {self.reason}."
        if self.term is None:
            return f"{head}."
        where = "in the prefill" if self.metric == Metric.TTFT else "per token"
        because = (f"{head}: {where}, {other.variant}'s devices spend on average {duration_text(self.term_s)} more in "
                   f"{self.reason}")
        if self.term_s <= self.gap_s:
            return f"{because}, {self.term_s / self.gap_s:.0%} of the {duration_text(self.gap_s)} gap."
        return (f"{because}, more than the whole {duration_text(self.gap_s)} gap: {win.variant}'s devices spend "
                f"{duration_text(self.back_s)} more in {self.back_reason}.")


@dataclass(frozen=True)
class LayoutComparison:
    """Every variant's :class:`LayoutRow` and a :class:`Verdict` per metric of :data:`COMPARED`
    that the run has (TPOT and tokens/s need two output tokens)."""

    rows: tuple[LayoutRow, ...]
    verdicts: tuple[Verdict, ...]

    def sentences(self) -> list[str]:
        """One sentence per verdict (:meth:`Verdict.sentence`), then one naming the layouts that
        do not fit in memory (never ranked); one saying so when none fits."""
        if not any(row.fits for row in self.rows):
            return ["No layout fits in memory: none wins."]
        out = [row.title for row in self.rows if not row.fits]
        return [verdict.sentence() for verdict in self.verdicts] + (
            [f"Not ranked, as they do not fit in memory: {', '.join(out)}."] if out else [])


def layouts_differ(result: SimulationResult) -> bool:
    """Whether the variants of ``result`` run on different layouts (degrees or devices)."""
    return len({(vr.layout.label, vr.layout.ranks) for vr in result.variants}) > 1


def compare_layouts(result: SimulationResult) -> LayoutComparison:
    """The comparison of ``result``'s variants' layouts (see the module docstring)."""
    rows = tuple(_row(result, vr) for vr in result.variants)
    fitting = [row for row in rows if row.fits]
    verdicts = []
    decodes = result.scenario.config.workload.output_tokens > 1
    for metric in COMPARED:
        if not fitting or (metric != Metric.TTFT and not decodes):
            continue
        lower = metric in _LOWER_WINS
        ranked = sorted(fitting, key=lambda row: (row.timing[metric] if lower else -row.timing[metric], row.variant))
        winner, runner_up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        vr = result.variant(winner.variant)
        if runner_up is None:
            verdicts.append(Verdict(metric, winner, None, None, 0.0, 0.0, ""))
        elif not lower:
            replicas = len(vr.replicas)
            reason = (f"its {replicas} replicas decode their shares of the batch side by side, their tokens/s "
                      "adding up" if replicas else
                      f"the batch of {result.scenario.config.workload.batch_size} over a shorter TPOT")
            verdicts.append(Verdict(metric, winner, runner_up, None, 0.0, 0.0, reason))
        else:
            verdicts.append(_decisive(result, metric, winner, runner_up))
    return LayoutComparison(rows, tuple(verdicts))


def _row(result: SimulationResult, vr: VariantResult) -> LayoutRow:
    names = [d.name for d in result.topology.devices]
    breakdown = {PhaseKind.of_step(step): step_breakdown(result, vr, step) for step in (0, 1)}
    return LayoutRow(vr.variant.name, vr.layout.label, tuple(names[r] for r in sorted(vr.layout.ranks)),
                     vr.layout.idle_devices, {m: vr.timing[m] for m in COMPARED}, vr.overflow is None,
                     {phase: terms for phase, terms in breakdown.items() if terms})


def _decisive(result: SimulationResult, metric: Metric, winner: LayoutRow, runner_up: LayoutRow) -> Verdict:
    """The verdict of TTFT or TPOT: the term the runner-up's devices spend most more time in."""
    phase = _LOWER_WINS[metric]
    ours, theirs = winner.breakdown.get(phase, {}), runner_up.breakdown.get(phase, {})
    differences = {term: theirs.get(term, 0.0) - ours.get(term, 0.0) for term in StepTerm}
    gap = sum(differences.values())
    term = max(differences, key=lambda t: (differences[t], -list(StepTerm).index(t)))
    if not theirs or not ours or differences[term] <= 0 or gap <= 0:
        return Verdict(metric, winner, runner_up, None, 0.0, gap, "")
    layout = result.variant(runner_up.variant).layout
    verdict = Verdict(metric, winner, runner_up, term, differences[term], gap, _where(term, layout, result.topology))
    if differences[term] <= gap:
        return verdict
    back = min(differences, key=lambda t: (differences[t], list(StepTerm).index(t)))
    return replace(verdict, back_s=-differences[back],
                   back_reason=_where(back, result.variant(winner.variant).layout, result.topology))


def _where(term: StepTerm, layout: ParallelPlan, topology: Topology) -> str:
    """Words for where ``layout`` spends ``term``: for communication, the links its groups or hops
    cross (between hosts or inside one, the narrowest bandwidth)."""
    if term == StepTerm.COMPUTE:
        return "compute-bound ops"
    if term == StepTerm.MEMORY:
        return "ops bound by memory bandwidth (reading weights and the KV cache)"
    if term == StepTerm.LOADER:
        return "waiting for streamed weights"
    if term == StepTerm.IDLE:
        return ("the pipeline bubble (stages idle, waiting for their micro-batches)" if layout.pipeline > 1 else
                "idle time (waiting for work only another device does)")
    t = layout.tensor
    stages = [copy[s * t:(s + 1) * t] for copy in layout.replica_ranks for s in range(layout.pipeline)]
    if term == StepTerm.SEND:
        pairs = [(stages[s][0], stages[(s + 1) % layout.pipeline][0]) for s in range(layout.pipeline)]
        what = "point-to-point hops between stages"
    else:
        pairs = [(a, b) for group in stages for a in group for b in group if a != b]
        what = term.value
    if not pairs:
        return what
    spans = any(not topology.same_host(a, b) for a, b in pairs)
    bandwidth = min(topology.path_bandwidth_bytes_per_s(a, b) for a, b in pairs)
    return f"{what} {'between hosts' if spans else 'inside a host'} ({bandwidth_text(bandwidth)})"


def _value(metric: Metric, row: LayoutRow) -> str:
    value = row.timing[metric]
    if metric == Metric.DECODE_TOKENS_PER_S:
        return f"{significant(value)} tokens/s" if math.isfinite(value) else "n/a"
    return duration_text(value)
