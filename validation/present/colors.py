"""One colour per op kind, step term, training term and memory category, and one per variant (or
device type) by its place in a sorted list, so that every report of hetsim draws the same thing in
the same colour."""

from __future__ import annotations

from collections.abc import Iterable

import plotly.express as px

from models.ops import OpKind
from sim.bottleneck import StepTerm
from sim.vocabulary import Metric

# Compute ops in blues and greens, collectives and hops in reds, oranges and purples, the loader
# in grey; a training pass and the optimizer like the compute they are; a rank's lag pale.
OP_KIND_COLORS: dict[str, str] = {
    OpKind.EMBEDDING.value: "#9ecae1",
    OpKind.LAYERNORM.value: "#6baed6",
    OpKind.QKV_PROJ.value: "#3182bd",
    OpKind.ATTENTION.value: "#08519c",
    OpKind.OUT_PROJ.value: "#74c476",
    OpKind.MLP_UP.value: "#31a354",
    OpKind.MLP_DOWN.value: "#006d2c",
    OpKind.LM_HEAD.value: "#756bb1",
    OpKind.ALLREDUCE.value: "#de2d26",
    OpKind.REDUCE.value: "#fc9272",
    OpKind.BROADCAST.value: "#fd8d3c",
    OpKind.SEND.value: "#9e9ac8",
    OpKind.WEIGHT_LOAD.value: "#969696",
    OpKind.FORWARD.value: "#6baed6",
    OpKind.BACKWARD.value: "#08519c",
    OpKind.OPTIMIZER_STEP.value: "#54278f",
    OpKind.GRADIENT_CAST.value: "#fdae6b",
    OpKind.COMM_THREAD.value: "#a50f15",
    OpKind.STEP_LAG.value: "#d9d9d9",  # asleep, waiting on the step before: pale as idle time
}
_PALETTE = px.colors.qualitative.Plotly + px.colors.qualitative.D3
# The terms of a step (sim.bottleneck.StepTerm): compute as its ops, collectives as their op kinds,
# a pipeline's hops in purple, the loader grey, idle time pale.
STEP_TERM_COLORS: dict[str, str] = {
    StepTerm.COMPUTE.value: "#3182bd",
    StepTerm.MEMORY.value: "#31a354",
    StepTerm.ALLREDUCE.value: OP_KIND_COLORS[OpKind.ALLREDUCE.value],
    StepTerm.REDUCE.value: OP_KIND_COLORS[OpKind.REDUCE.value],
    StepTerm.BROADCAST.value: OP_KIND_COLORS[OpKind.BROADCAST.value],
    StepTerm.SEND.value: OP_KIND_COLORS[OpKind.SEND.value],
    StepTerm.LOADER.value: OP_KIND_COLORS[OpKind.WEIGHT_LOAD.value],
    StepTerm.IDLE.value: "#e0e0e0",
}
# The terms of a training step (sim.training.metrics.STEP_TERMS): each pass as its op kind, the
# recomputation paler than the forward it repeats, exposed communication as an allreduce.
TRAINING_TERM_COLORS: dict[str, str] = {
    Metric.FORWARD_TIME.value: OP_KIND_COLORS[OpKind.FORWARD.value],
    Metric.BACKWARD_TIME.value: OP_KIND_COLORS[OpKind.BACKWARD.value],
    Metric.RECOMPUTE_TIME.value: "#c6dbef",
    Metric.OPTIMIZER_TIME.value: OP_KIND_COLORS[OpKind.OPTIMIZER_STEP.value],
    Metric.EXPOSED_COMMUNICATION.value: OP_KIND_COLORS[OpKind.ALLREDUCE.value],
}
# What a training device holds (sim.training.simulate.MEMORY_CATEGORIES), the framework's baseline grey.
MEMORY_CATEGORY_COLORS: dict[str, str] = {
    Metric.PEAK_MEMORY_WEIGHTS.value: "#3182bd",
    Metric.PEAK_MEMORY_GRADIENTS.value: "#e6550d",
    Metric.PEAK_MEMORY_OPTIMIZER_STATES.value: "#756bb1",
    Metric.PEAK_MEMORY_ACTIVATIONS.value: "#31a354",
    Metric.PEAK_MEMORY_BUCKET_BUFFERS.value: "#fdae6b",
    Metric.PEAK_MEMORY_FRAMEWORK.value: "#969696",
}
CAPACITY_LINE = {"dash": "dash", "color": "black"}
"""How every report draws a device's memory capacity."""


def op_kind_color(kind: str) -> str:
    """The colour of an op kind (``OpKind`` value); black for one without its own."""
    return OP_KIND_COLORS.get(kind, "#000000")


def term_color(term: str) -> str:
    """The colour of a step term (:class:`sim.bottleneck.StepTerm` value)."""
    return STEP_TERM_COLORS[term]


def category_colors(names: Iterable[str]) -> dict[str, str]:
    """A colour per name (variants, device types, memory policies), by sorted order: the same
    names get the same colours in every figure and report."""
    return {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(sorted(set(names)))}
