"""Where a pipeline's decode step goes: its stages, their first, steady and last layers, and the
hops between them, split alike in a simulated and a measured trace.

:mod:`validation.terms` splits the master rank's step into op kinds; in a pipeline the master
waits out the other stages, so its split says little. Here a decode step splits stage by stage (a
stage: the ranks computing the same layers, read from the trace itself) into:

* ``stage s first layer``: from the stage's first compute op to its lowest rank's second layer's
  ``qkv_proj``: the stage's start, whose first collectives wake ranks that slept through the
  other stages' time;
* ``stage s per layer``: the lowest rank's ``qkv_proj`` to ``qkv_proj`` over the stage's later
  layers, per layer (its collectives and compute in steady state);
* ``stage s last layer``: from the last layer's ``qkv_proj`` to the stage's last op before its
  send (with the final norm and LM head on the last stage);
* ``hop s->s+1``: from that to the next stage's first compute op;
* ``rest``: the step less all of these (the sampled tokens' way back, what runs between steps).

TPOT is the mean decode step, so a measured term's mean is what it adds to it.
"""

from __future__ import annotations

import statistics

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.trace import COLLECTIVE_KINDS

STEP = "step"
REST = "rest"
COLUMNS = ["term", "simulated_s", "measured_median_s", "measured_mean_s"]


def stages(ops: pd.DataFrame) -> list[tuple[int, ...]]:
    """The ranks of each pipeline stage in layer order (ranks whose ``qkv_proj`` ops cover the
    same layers), from an ops table (:data:`sim.trace.OP_COLUMNS`)."""
    layers = ops[ops["kind"] == OpKind.QKV_PROJ.value].groupby("rank")["layer"].agg(lambda s: tuple(sorted(set(s))))
    by_layers: dict[tuple, list[int]] = {}
    for rank, own in layers.items():
        by_layers.setdefault(own, []).append(int(rank))
    return [tuple(sorted(ranks)) for _, ranks in sorted(by_layers.items())]


def split_step(ops: pd.DataFrame, step_s: float, groups: list[tuple[int, ...]]) -> dict[str, float]:
    """One decode step's terms (s, module docstring), in order, from its ``ops``; ``step_s`` is
    its span and ``groups`` its stages (:func:`stages`). A stage of fewer than 3 layers has no
    steady layer: its ``per layer`` is NaN and its second layer counts as its last.

    Raises:
        ValueError: a stage without ops in ``ops``.
    """
    terms: dict[str, float] = {}
    compute = ops[~ops["kind"].isin(COLLECTIVE_KINDS)]  # sends and receives are communication too
    previous_end = None
    covered = 0.0
    for index, ranks in enumerate(groups):
        own = compute[compute["rank"].isin(ranks)]
        lead = ops[ops["rank"] == ranks[0]]
        qkv = lead[lead["kind"] == OpKind.QKV_PROJ.value].sort_values("layer")["start_s"].to_numpy()
        if own.empty or len(qkv) < 2:
            raise ValueError(f"stage {index} (ranks {ranks}): no decode step of two layers in the trace")
        start = float(own["start_s"].min())
        after = lead[(lead["start_s"] >= start) & (lead["kind"] != OpKind.SEND.value)]
        end = float(max(after["end_s"].max(), own["end_s"].max()))
        if previous_end is not None:
            terms[f"hop {index - 1}->{index}"] = start - previous_end
            covered += start - previous_end
        terms[f"stage {index} first layer"] = qkv[1] - start
        terms[f"stage {index} per layer"] = (qkv[-1] - qkv[1]) / (len(qkv) - 2) if len(qkv) > 2 else float("nan")
        terms[f"stage {index} last layer"] = end - qkv[-1]
        covered += end - start
        previous_end = end
    terms[REST] = step_s - covered
    terms[STEP] = step_s
    return terms


def stage_split(simulated_ops: pd.DataFrame, simulated_steps: pd.DataFrame,
                measured_ops: pd.DataFrame, measured_steps: pd.DataFrame) -> pd.DataFrame:
    """A pipeline's decode step split (:func:`split_step`) in a simulated trace (its first decode
    step with ops) and a measured one (median and mean over its decode steps with ops, but the
    first, which warms up where there are others); columns :data:`COLUMNS` (s), one row per term.

    Raises:
        ValueError: no decode step in either trace, or stages that differ between them (the
            measured trace is not of the simulated layout), or a single stage.
    """
    decode = simulated_ops[simulated_ops["phase"] == "decode"]
    measured_decode = measured_ops[measured_ops["phase"] == "decode"]
    if decode.empty or measured_decode.empty:
        raise ValueError("no decode step in the " + ("simulated" if decode.empty else "measured") + " trace")
    groups = stages(decode)
    if len(groups) < 2 or stages(measured_decode) != groups:
        raise ValueError(f"the measured trace's stages {stages(measured_decode)} are not the simulated {groups} "
                         "(a pipeline's trace of the same layout is needed)")
    first = int(decode["step"].min())
    row = simulated_steps[simulated_steps["step"] == first].iloc[0]
    simulated = split_step(decode[decode["step"] == first], float(row.end_s - row.start_s), groups)
    steps = sorted(set(measured_decode["step"]))
    steps = steps[1:] if len(steps) > 1 else steps
    spans = measured_steps.set_index("step")
    measured = [split_step(measured_decode[measured_decode["step"] == step],
                           float(spans.loc[step, "end_s"] - spans.loc[step, "start_s"]), groups) for step in steps]
    rows = []
    for term, value in simulated.items():
        values = [m[term] for m in measured if not np.isnan(m[term])]
        rows.append({"term": term, "simulated_s": value,
                     "measured_median_s": statistics.median(values) if values else float("nan"),
                     "measured_mean_s": statistics.mean(values) if values else float("nan")})
    return pd.DataFrame(rows, columns=COLUMNS)
