"""hetsim against published measurements (issues 18 item 5, 19, 20): clusters nobody calibrated.

``validation/published/cases.yaml`` lists published figures (inference: TPI-LLM on its Klonet
testbed, LMDeploy and MLC LLM on A100s; data-parallel training: Megatron-LM's weak-scaling table
and llm.c's GPT-2 runs), each with the scenario of ``validation/published/`` that represents its
cluster, the variant, the metric (:class:`sim.vocabulary.Metric`, SI units), the published value
and exactly where it is printed. Each scenario is simulated once, WITHOUT a calibration profile
(:func:`sim.simulate.simulate`, or :func:`sim.training.simulate.simulate_training` for a
``kind: training`` workload), so every figure here is a **prediction**; its error is
``simulated / published - 1``. Nothing is fitted to these numbers: they are a held-out check.

What dominates the simulated step: for inference, :func:`sim.bottleneck.step_breakdown` of the
step the metric is about (the prefill for TTFT, the first decode step for TPOT and decode
tokens/s), averaged over the variant's devices; for training, the terms of the optimizer step
(:func:`sim.training.metrics.step_terms`: forward, backward, recomputation, optimizer, exposed
communication). A memory figure names the device whose peak it is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd

from models.errors import ConfigError
from models.input_files import load_yaml
from models.weight_formats import WeightFormat
from sim.bottleneck import step_breakdown
from sim.outputs import device_names
from sim.plan import WeightPolicy
from sim.scenario import load_scenario
from sim.simulate import SimulationResult, VariantResult, simulate
from sim.training.metrics import STEP_TERMS, bottleneck, step_terms
from sim.training.simulate import TrainingSimulation, TrainingVariantResult, simulate_training
from sim.vocabulary import Metric
from validation.records import positive_number, records

CASES_FILE = Path(__file__).resolve().parent / "published" / "cases.yaml"
CASE_FIELDS = ("id", "scenario", "variant", "metric", "published", "published_text", "system", "source",
               "reading")
# The metrics a published figure can be compared on, and the step whose terms explain each
# (0: the prefill, 1: the first decode step; None: not a step).
STEP_OF_METRIC = {Metric.TTFT: 0, Metric.TPOT: 1, Metric.DECODE_TOKENS_PER_S: 1, Metric.MAX_PEAK_MEMORY: None}
# The metrics a published figure of a training scenario can be compared on (one optimizer step).
TRAINING_METRICS = (Metric.STEP_TIME, Metric.SAMPLES_PER_S, Metric.TOKENS_PER_S, Metric.MAX_PEAK_MEMORY)
METRICS = tuple(dict.fromkeys((*STEP_OF_METRIC, *TRAINING_METRICS)))
CSV_COLUMNS = ["id", "system", "scenario", "variant", "setup", "metric", "published", "published_text",
               "simulated", "error", "kind", "dominant", "breakdown", "source", "reading"]


@dataclass(frozen=True)
class Case:
    """One published figure: ``published`` in the SI unit of ``metric``."""

    id: str
    scenario: Path
    variant: str
    metric: Metric
    published: float
    published_text: str
    system: str
    source: str
    reading: str


def load_cases(path: Path = CASES_FILE) -> tuple[list[Case], list[dict[str, str]]]:
    """The cases of ``path`` and its ``not_represented`` entries (``source``, ``why``).

    Raises:
        ConfigError: a missing or unknown field (of a case or a ``not_represented`` entry), a
            metric not in :data:`METRICS`, a published value that is not a positive number,
            a scenario file that does not exist.
    """
    data = load_yaml(path, "cases")
    cases = []
    for where, entry in records(data, "cases", CASE_FIELDS):
        if entry["metric"] not in {m.value for m in METRICS}:
            raise ConfigError(f"{where}.metric", f"one of {', '.join(METRICS)} (got {entry['metric']!r})")
        value = positive_number(f"{where}.published", entry["published"])
        scenario = path.parent / str(entry["scenario"])
        if not scenario.is_file():
            raise ConfigError(f"{where}.scenario", f"no such file (got {str(entry['scenario'])!r})")
        cases.append(Case(id=str(entry["id"]), scenario=scenario, variant=str(entry["variant"]),
                          metric=Metric(entry["metric"]), published=float(value),
                          published_text=str(entry["published_text"]), system=str(entry["system"]),
                          source=" ".join(str(entry["source"]).split()), reading=str(entry["reading"])))
    missing = [entry for _, entry in records({"not_represented": data.get("not_represented", [])},
                                             "not_represented", ("source", "why"))]
    return cases, [{"source": str(m["source"]), "why": str(m["why"])} for m in missing]


def simulated_value(result: SimulationResult, vr: VariantResult, metric: Metric) -> float:
    """``metric`` of variant ``vr``: its timing metric, or the largest peak over its devices (bytes)."""
    if metric == Metric.MAX_PEAK_MEMORY:
        return float(max(vr.peak_bytes.values()))
    return float(vr.timing[metric])


def dominant_terms(result: SimulationResult, vr: VariantResult, metric: Metric) -> tuple[str, str]:
    """(the largest term with its share, every term's share) of the step ``metric`` is about; for
    a memory figure, the device holding the peak."""
    step = STEP_OF_METRIC[metric]
    if step is None:
        names = device_names(result.topology, sorted(vr.peak_bytes))
        rank = max(vr.peak_bytes, key=vr.peak_bytes.get)
        return f"peak on {names[rank]}", ""
    terms = step_breakdown(result, vr, step)
    total = sum(terms.values())
    shares = sorted(((seconds / total, term) for term, seconds in terms.items()), reverse=True)
    label = "decode step" if step else "prefill"
    breakdown = ", ".join(f"{term.value} {100 * share:.0f}%" for share, term in shares)
    return f"{shares[0][1].value} ({100 * shares[0][0]:.0f}% of the {label})", breakdown


def setup_line(result: SimulationResult, vr: VariantResult) -> str:
    """Model, dtype, layout, devices and workload of one variant, in a few words."""
    scenario = result.scenario
    workload = scenario.config.workload
    devices = device_names(result.topology, vr.layout.ranks)
    kinds = sorted({result.topology.devices[r].spec.name for r in vr.layout.ranks})
    memory = vr.variant.memory or scenario.config.memory
    streamed = "" if memory.policy == WeightPolicy.RESIDENT else f", weights {memory.policy.value} {memory.window}"
    stored = "" if scenario.model.weights == WeightFormat.NATIVE else f" ({scenario.model.weights} weights)"
    return (f"{scenario.model.name} {scenario.model.dtype}{stored}, TP {vr.layout.tensor} x PP {vr.layout.pipeline} over "
            f"{len(devices)} x {'/'.join(kinds)}{streamed}; batch {workload.batch_size}, prompt "
            f"{workload.prompt_tokens}, output {workload.output_tokens}")


def training_value(vr: TrainingVariantResult, metric: Metric) -> float:
    """``metric`` of training variant ``vr``: its step metric, or the largest peak over its devices
    (bytes, every category of :class:`models.training.TrainingMemory`)."""
    if metric == Metric.MAX_PEAK_MEMORY:
        return float(max(memory.total for memory in vr.memory.values()))
    return float(vr.metrics[metric])


def training_terms(result: TrainingSimulation, vr: TrainingVariantResult, metric: Metric) -> tuple[str, str]:
    """(the largest term of the optimizer step with its share, every term's share of the step);
    for a memory figure, the device holding the peak and its categories."""
    if metric == Metric.MAX_PEAK_MEMORY:
        rank = max(vr.memory, key=lambda r: vr.memory[r].total)
        memory = vr.memory[rank]
        categories = ", ".join(f"{field.name} {getattr(memory, field.name) / 1e9:.2f} GB" for field in fields(memory))
        return f"peak on {device_names(result.topology, [rank])[rank]}", categories
    step = vr.metrics[Metric.STEP_TIME]
    shares = sorted(((seconds / step, term) for term, seconds in step_terms(vr.metrics).items()), reverse=True)
    return bottleneck(vr.metrics), ", ".join(f"{STEP_TERMS[term]} {100 * share:.0f}%" for share, term in shares)


def training_setup_line(result: TrainingSimulation, vr: TrainingVariantResult) -> str:
    """Model, precision, optimizer, layout, devices, batch and the DDP settings of one training
    variant, in a few words."""
    scenario, plan, settings = result.scenario, result.plan, vr.settings
    workload = scenario.config.workload
    kinds = sorted({result.topology.devices[r].spec.name for r in result.ranks})
    zero = ", ZeRO-1" if settings.zero else ""
    checkpointing = (f"every {settings.activation_checkpointing} layer(s) recomputed"
                     if settings.activation_checkpointing else "no recomputation")
    reducer = (f"buckets of {settings.bucket_cap_mb:g} MiB, overlap {'on' if settings.overlap else 'off'}"
               if not settings.zero else "gradients allreduced, parameters broadcast after the step")
    return (f"{scenario.model.name}, {settings.precision.value} {settings.optimizer.value}{zero}, TP {plan.tensor} x "
            f"DP {plan.data} over {len(result.ranks)} x {'/'.join(kinds)}; global batch {workload.global_batch_size} x "
            f"{workload.sequence_length} tokens, micro-batch {vr.micro_batch_size} x {vr.accumulation} per rank; "
            f"{checkpointing}; {reducer}")


def _row(result: SimulationResult | TrainingSimulation, case: Case) -> dict[str, Any]:
    """The simulated value, dominant term, breakdown and setup of ``case`` in ``result``.

    Raises:
        ConfigError: on ``cases[id].variant`` for a variant the scenario lacks, on
            ``cases[id].metric`` for a metric the scenario's kind (inference or training) has not.
    """
    names = [v.variant.name for v in result.variants]
    if case.variant not in names:
        raise ConfigError(f"cases[{case.id}].variant", f"one of {', '.join(names)} (got {case.variant!r})")
    vr = result.variant(case.variant)
    training = isinstance(result, TrainingSimulation)
    metrics = TRAINING_METRICS if training else tuple(STEP_OF_METRIC)
    if case.metric not in metrics:
        kind = "training" if training else "inference"
        raise ConfigError(f"cases[{case.id}].metric", f"one of {', '.join(metrics)} for a {kind} scenario "
                                                      f"(got {case.metric.value!r})")
    if training:
        dominant, breakdown = training_terms(result, vr, case.metric)
        return {"simulated": training_value(vr, case.metric), "dominant": dominant, "breakdown": breakdown,
                "setup": training_setup_line(result, vr)}
    dominant, breakdown = dominant_terms(result, vr, case.metric)
    return {"simulated": simulated_value(result, vr, case.metric), "dominant": dominant, "breakdown": breakdown,
            "setup": setup_line(result, vr)}


def compare(cases: list[Case]) -> pd.DataFrame:
    """One row per case (:data:`CSV_COLUMNS`), each scenario simulated once without a profile."""
    results: dict[Path, SimulationResult | TrainingSimulation] = {}
    rows: list[dict[str, Any]] = []
    for case in cases:
        if case.scenario not in results:
            scenario = load_scenario(case.scenario)
            results[case.scenario] = simulate_training(scenario) if scenario.config.is_training else \
                simulate(scenario)
        row = _row(results[case.scenario], case)
        rows.append({"id": case.id, "system": case.system, "scenario": case.scenario.name,
                     "variant": case.variant, "setup": row["setup"], "metric": case.metric.value,
                     "published": case.published, "published_text": case.published_text,
                     "simulated": row["simulated"], "error": row["simulated"] / case.published - 1,
                     "kind": "prediction", "dominant": row["dominant"], "breakdown": row["breakdown"],
                     "source": case.source, "reading": case.reading})
    return pd.DataFrame(rows, columns=CSV_COLUMNS)


def _shown(value: float, metric: str) -> str:
    if metric == Metric.MAX_PEAK_MEMORY:
        return f"{value / 1e9:.2f} GB"
    if metric in (Metric.DECODE_TOKENS_PER_S, Metric.TOKENS_PER_S):
        return f"{value:.1f} tok/s"
    if metric == Metric.SAMPLES_PER_S:
        return f"{value:.1f} samples/s"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def report_markdown(table: pd.DataFrame, not_represented: list[dict[str, str]], command: str) -> str:
    """The report: the comparison table, each case's setup, terms and source, what was left out."""
    lines = ["# hetsim against published measurements (predictions, no calibration)", "",
             "Every figure is a **prediction**: the scenarios of `validation/published/` simulated without a "
             "calibration profile, datasheet devices and the documented default transports. Nothing was tuned to "
             "these numbers. Error = simulated / published - 1. Why the large errors are what they are: "
             "`diagnosis.md` (by hand; re-read it after a model change).", "", f"Reproduce: `{command}`", "",
             "| case | system | metric | published | hetsim | error | dominant term of the simulated step |",
             "|---|---|---|---|---|---|---|"]
    for row in table.itertuples():
        lines.append(f"| {row.id} | {row.system} | {row.metric} | {row.published_text} | "
                     f"{_shown(row.simulated, row.metric)} | {100 * row.error:+.0f}% | {row.dominant} |")
    lines += ["", "## Cases", ""]
    for row in table.itertuples():
        lines += [f"### {row.id}", "", f"- setup: {row.setup} (`validation/published/{row.scenario}`, variant "
                  f"`{row.variant}`)", f"- source: {row.source}", f"- reading: {row.reading}"]
        if row.breakdown and row.metric == Metric.MAX_PEAK_MEMORY:
            lines.append(f"- simulated peak by category: {row.breakdown}")
        elif row.breakdown and row.metric in TRAINING_METRICS:
            lines.append(f"- simulated optimizer step, share per term (busiest rank): {row.breakdown}")
        elif row.breakdown:
            lines.append(f"- simulated step, share per term (mean over devices): {row.breakdown}")
        lines.append("")
    lines += ["## Published figures not represented", ""]
    lines += [f"- {m['source']}: {m['why']}" for m in not_represented]
    return "\n".join(lines) + "\n"
