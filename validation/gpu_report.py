"""The GPU checks' report: hetsim's predictions against what :mod:`validation.gpu_check` measured on
one GPU (the cases: :mod:`validation.gpu_cases`)::

    python -m validation.gpu_report [--measured validation/gpu-report/measured] [--out validation/gpu-report]

Reads the measurement runs under ``--measured`` (``run1``, ``run2``, ...: one device machine each,
as ``validation.gpu_check`` wrote them) and writes, under ``--out``:

* ``inference.csv``: per target, the measured TTFT and TPOT (the run that also calibrated, its
  ``async`` mode: the GPU running what the host queued, CUDA events) against hetsim with that
  run's calibration profile of the calibration model and without a profile. ``kind`` says what
  each figure is: a **prediction** of another model, or the calibrated model at a prompt the
  calibration never ran (its ops timed at other shapes): neither is a replay;
* ``spread.csv``: each target's measured medians in every run (different machines of one kind):
  how far a measurement moves between machines, the floor under any prediction's error;
* ``terms.csv``: held out, never fitted: each target's ops timed alone at its own shapes
  (``opshapes_*``) against the model's two terms, the device's kernels and the host's queuing;
* ``host_order.csv``: the targets' host times in two orders on one machine (is queuing model-dependent?);
* ``training.csv``: one training step (amp_bf16: bf16 autocast over fp32 parameters, AdamW, DDP over NCCL, world size 1) with and
  without activation checkpointing: step time, its parts and peak memory, measured against
  hetsim without a profile, with a training calibration of another model (prediction) and of the
  same model (**replay**);
* ``heldout.csv``: a training step predicted before it was measured (the predictions committed first);
* ``resimulated.csv``: that step re-simulated with today's model, from the other model's training
  calibration (a prediction, made after the measurement) and from its own (replays);
* ``attention.csv``: the attention op's peak memory, SDPA and eager, against the memory model
  (:func:`models.accounting.layer_op_costs` workspace), and whether a case that ran out of memory
  was predicted to;
* ``summary.md``: the tables and the figures of the closing note.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from models.accounting import layer_op_costs
from models.catalog import get_model
from models.ops import OpKind
from sim.async_compute import AsyncCompute, regime
from sim.profile import load_profile
from sim.simulate import simulate
from sim.training.simulate import simulate_training
from sim.vocabulary import MeasurementKind, Metric
from validation.gpu_cases import (ATTENTION_MODEL, CALIBRATION_MODEL, DTYPE, HELDOUT_TRAINING_MODEL,
                                  TRAINING_CALIBRATION_MODEL, TRAINING_MODEL, TimingMode, inference_scenario,
                                  training_scenario)

HERE = Path(__file__).resolve().parent / "gpu-report"
TRAINING_METRICS = (Metric.STEP_TIME, "forward_s", "backward_s", "optimizer_s", Metric.PEAK_MEMORY,
                    "peak_memory_activations_bytes")


def _runs(measured: Path) -> list[Path]:
    return sorted((p for p in measured.iterdir() if p.is_dir() and p.name.startswith("run")),
                  key=lambda p: int(p.name[3:]))


def _calibrated_run(measured: Path) -> Path:
    """The latest run whose calibration profile has the asynchronous device's rows (ceilings)."""
    for run in reversed(_runs(measured)):
        path = run / f"profile_{CALIBRATION_MODEL}.csv"
        if path.is_file() and len(load_profile(path).of(MeasurementKind.DEVICE_CEILING)):
            return run
    raise FileNotFoundError(f"no run under {measured} has a calibration profile with device ceilings")


def inference_table(run: Path) -> pd.DataFrame:
    """Measured (``run``'s async mode) against simulated, with and without ``run``'s profile."""
    profile = load_profile(run / f"profile_{CALIBRATION_MODEL}.csv")
    measured = pd.read_csv(run / "inference.csv")
    rows = []
    for case in measured[measured["mode"] == TimingMode.ASYNC].itertuples(index=False):
        scenario = inference_scenario(case.model, int(case.prompt_tokens), int(case.output_tokens))
        calibrated = simulate(scenario, profile=profile).variants[0].timing
        uncalibrated = simulate(scenario).variants[0].timing
        kind = ("calibrated model, prompt not calibrated" if case.model == CALIBRATION_MODEL
                else "prediction (another model)")
        for metric, value in ((Metric.TTFT, case.ttft_s), (Metric.TPOT, case.tpot_s)):
            rows.append({"model": case.model, "prompt_tokens": case.prompt_tokens, "metric": str(metric),
                         "measured": value, "calibrated": calibrated[metric], "uncalibrated": uncalibrated[metric],
                         "error": calibrated[metric] / value - 1, "uncalibrated_error": uncalibrated[metric] / value - 1,
                         "kind": kind})
    return pd.DataFrame(rows)


def spread_table(measured: Path) -> pd.DataFrame:
    """Every run's measured async medians per target and metric, and their spread (max / min - 1)."""
    frames = []
    for run in _runs(measured):
        frame = pd.read_csv(run / "inference.csv")
        frame = frame[frame["mode"] == TimingMode.ASYNC]
        frames.append(frame.melt(id_vars=["model", "prompt_tokens"], value_vars=["ttft_s", "tpot_s"],
                                 var_name="metric").assign(run=run.name))
    table = pd.concat(frames).pivot_table(index=["model", "prompt_tokens", "metric"], columns="run", values="value")
    table["spread"] = table.max(axis=1) / table.min(axis=1) - 1
    return table.reset_index()


def terms_table(run: Path) -> pd.DataFrame:
    """Held out: each target's ops timed alone against the model's kernel and host terms."""
    model = AsyncCompute(load_profile(run / f"profile_{CALIBRATION_MODEL}.csv"), DTYPE)
    rows = []
    for path in sorted(run.glob("opshapes_*.csv")):
        frame = pd.read_csv(path)
        name = path.stem.removeprefix("opshapes_")
        for row in frame.itertuples(index=False):
            if row.measurement == MeasurementKind.COMPUTE_DEVICE:
                term = "kernel"
                simulated = model.kernel_at(row.device_class, row.op, int(row.new_tokens), row.flops, row.traffic_bytes)
            elif row.measurement == MeasurementKind.HOST_ISSUE:
                term = "host"
                simulated = model.host_s.get((row.device_class, row.op, regime(int(row.new_tokens))))
            else:
                continue
            if simulated is None:
                continue
            rows.append({"model": name, "op": row.op, "new_tokens": int(row.new_tokens),
                         "context_tokens": int(row.context_tokens), "term": term, "measured": row.median,
                         "simulated": simulated, "error": simulated / row.median - 1,
                         "kind": "calibrated model" if name == CALIBRATION_MODEL else "prediction (another model)"})
    return pd.DataFrame(rows)


def host_order_table(measured: Path) -> pd.DataFrame:
    """Whether the host's queuing time depends on the model: every target's ops timed alone in one
    order (``host_order/a``) and in the reverse order (``host_order/b``) on one machine; per model
    and order, the median over op kinds and regimes of its host time over the calibration
    model's in the same order."""
    rows = []
    for order in ("a", "b"):
        folder = measured / "host_order" / order
        if not folder.is_dir():
            continue
        host = {}
        for path in sorted(folder.glob("opshapes_*.csv")):
            frame = pd.read_csv(path)
            frame = frame[frame["measurement"] == MeasurementKind.HOST_ISSUE]
            host[path.stem.removeprefix("opshapes_")] = frame.groupby(["op", "new_tokens"])["median"].median()
        reference = host.get(CALIBRATION_MODEL)
        for name, values in host.items():
            rows.append({"order": order, "model": name, "median_host_s": float(values.median()),
                         "over_calibration_model": float((values / reference).median())})
    return pd.DataFrame(rows)


def training_table(measured: Path) -> pd.DataFrame:
    """The training step measured (the run with ``training_results.csv``) against hetsim."""
    run = next(r for r in reversed(_runs(measured)) if (r / "training_results.csv").is_file())
    return _training_rows(training_scenario(), pd.read_csv(run / "training_results.csv"), {
        "uncalibrated": (None, "prediction (no profile)"),
        "other model's calibration": (run / f"training_profile_{TRAINING_CALIBRATION_MODEL}.csv",
                                      "prediction (another model)"),
        "own calibration": (run / f"training_profile_{TRAINING_MODEL}.csv", "replay")})


def resimulated_heldout_table(measured: Path) -> pd.DataFrame:
    """The held-out model's training step (``measured/heldout_training``) re-simulated with today's
    model: from the training model's calibration (a prediction of another model, but made after
    the measurement, so not held out) and from its own calibrations (replays)."""
    folder = measured / "heldout_training"
    calibrated = next((r for r in reversed(_runs(measured)) if (r / "training_results.csv").is_file()), None)
    if not (folder / "training_results.csv").is_file() or calibrated is None:
        return pd.DataFrame()
    return _training_rows(training_scenario(HELDOUT_TRAINING_MODEL), pd.read_csv(folder / "training_results.csv"), {
        f"{TRAINING_MODEL}'s training calibration ({calibrated.name})": (
            calibrated / f"training_profile_{TRAINING_MODEL}.csv", "prediction (another model), re-simulated"),
        f"own training calibration ({calibrated.name}, another machine)": (
            calibrated / f"training_profile_{HELDOUT_TRAINING_MODEL}.csv", "replay (same model, another machine)"),
        "own training calibration (same machine)": (
            folder / f"training_profile_{HELDOUT_TRAINING_MODEL}.csv", "replay")})


def _training_rows(scenario, measured_rows: pd.DataFrame, sources: dict) -> pd.DataFrame:
    """Per source (name: (profile path or None, kind)), variant and metric of
    :data:`TRAINING_METRICS`: ``scenario`` simulated with the profile against ``measured_rows``."""
    rows = []
    for source, (path, kind) in sources.items():
        simulated = simulate_training(scenario, profile=None if path is None else load_profile(path)).results
        for variant in scenario.config.variants:
            for metric in TRAINING_METRICS:
                value = _value(measured_rows, variant.name, str(metric))
                estimate = _value(simulated, variant.name, str(metric))
                rows.append({"variant": variant.name, "metric": str(metric), "source": source, "kind": kind,
                             "measured": value, "simulated": estimate, "error": estimate / value - 1})
    return pd.DataFrame(rows)


def _value(results: pd.DataFrame, variant: str, metric: str) -> float:
    rows = results[(results["variant"] == variant) & (results["metric"] == metric)]
    return float(rows["value"].iloc[0]) if len(rows) else float("nan")


def heldout_training_table(measured: Path, predictions: Path) -> pd.DataFrame:
    """Predictions written (and committed) before the training step they predict was measured
    (``predictions``: model, variant, metric, source, kind, simulated), against that measurement
    (``measured/heldout_training/training_results.csv``)."""
    folder = measured / "heldout_training"
    if not (folder / "training_results.csv").is_file() or not predictions.is_file():
        return pd.DataFrame()
    results = pd.read_csv(folder / "training_results.csv")
    table = pd.read_csv(predictions)
    table["measured"] = [_value(results, r.variant, r.metric) for r in table.itertuples()]
    table["error"] = table["simulated"] / table["measured"] - 1
    return table


def attention_table(measured: Path) -> pd.DataFrame:
    """The attention op's measured peak (bytes above what was live) against the memory model's
    workspace, SDPA and eager; an out-of-memory case against the memory left on the device."""
    run = next(r for r in reversed(_runs(measured)) if (r / "attention.csv").is_file())
    frame = pd.read_csv(run / "attention.csv")
    environment = json.loads((run / "environment.json").read_text())
    rows = []
    for row in frame.itertuples(index=False):
        spec = replace(get_model(ATTENTION_MODEL), dtype=DTYPE, attention=row.kernel)
        cost = layer_op_costs(spec, tp_degree=1, batch_size=int(row.batch_size), new_tokens=int(row.new_tokens),
                              context_tokens=int(row.context_tokens))[OpKind.ATTENTION]
        oom = isinstance(row.error, str)
        rows.append({"kernel": row.kernel, "batch_size": int(row.batch_size), "new_tokens": int(row.new_tokens),
                     "context_tokens": int(row.context_tokens),
                     "measured_bytes": np.nan if oom else row.peak_bytes, "model_bytes": cost.workspace_bytes,
                     "error": np.nan if oom else cost.workspace_bytes / row.peak_bytes - 1,
                     "out_of_memory": oom, "predicted_out_of_memory": cost.workspace_bytes > environment["memory_bytes"],
                     "time_s": np.nan if oom else row.time_s})
    return pd.DataFrame(rows)


def _shown(value: float, metric: str) -> str:
    return f"{value * 1e-9:.2f} GB" if metric.endswith("_bytes") else f"{value * 1e3:.1f} ms"


def _pct(values) -> str:
    values = np.abs(np.asarray(values, dtype=float))
    return f"{100 * np.median(values):.1f}% / {100 * np.percentile(values, 90):.1f}%"


def summary(inference: pd.DataFrame, spread: pd.DataFrame, terms: pd.DataFrame, host_order: pd.DataFrame,
            training: pd.DataFrame, heldout: pd.DataFrame, resimulated: pd.DataFrame, attention: pd.DataFrame,
            environment: dict,
            calibrated_run: str) -> str:
    """The report's markdown."""
    lines = ["# GPU checks (one H100, TP 1)", "",
             f"Device: {environment['device']}, torch {environment['torch']}, CUDA {environment['cuda']}; measured "
             f"ceilings {environment['matmul_bf16_8192_flops_per_s'] / 1e12:.0f} TFLOP/s (bf16 8192^3) and "
             f"{environment['copy_bytes_per_s'] / 1e12:.2f} TB/s (copy). Measured with `python -m validation.gpu_check "
             "--out DIR` on a lent GPU machine (one machine per run: `measured/runN`); this report with "
             "`python -m validation.gpu_report`.", "",
             "## Inference: calibrate at Qwen2.5-0.5B's shapes, predict larger models (calibration-transfer issue)", "",
             f"Calibration: `hetsim calibrate`'s rows on the GPU for {CALIBRATION_MODEL} (prompts 8-128), in "
             f"`measured/{calibrated_run}`; measured TTFT/TPOT of the same run, the executor queuing op after op "
             "(`async`: no op timed, CUDA events per step). Error = simulated / measured - 1.", "",
             "| model | prompt | metric | measured | hetsim (profile) | error | hetsim (no profile) | error | kind |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in inference.itertuples():
        lines.append(f"| {r.model} | {r.prompt_tokens} | {r.metric} | {1e3 * r.measured:.1f} ms | "
                     f"{1e3 * r.calibrated:.1f} ms | {100 * r.error:+.0f}% | {1e3 * r.uncalibrated:.1f} ms | "
                     f"{100 * r.uncalibrated_error:+.0f}% | {r.kind} |")
    predicted = inference[inference["kind"].str.startswith("prediction")]
    lines += ["", "Median / p90 |error|, predictions of other models: "
              + "; ".join(f"{m} {_pct(predicted[predicted.metric == m].error)} "
                          f"(no profile {_pct(predicted[predicted.metric == m].uncalibrated_error)})"
                          for m in (Metric.TTFT, Metric.TPOT)) + ".", "",
              "The same targets measured on different machines of the same kind (`spread.csv`, async medians):", "",
              "| model | prompt | metric | " + " | ".join(c for c in spread.columns if c.startswith("run"))
              + " | spread |", "|---|---|---|" + "---|" * (sum(c.startswith("run") for c in spread.columns) + 1)]
    for r in spread.itertuples(index=False):
        d = r._asdict()
        lines.append(f"| {d['model']} | {d['prompt_tokens']} | {d['metric']} | "
                     + " | ".join(f"{1e3 * d[c]:.1f} ms" for c in spread.columns if c.startswith("run"))
                     + f" | {100 * d['spread']:.0f}% |")
    lines += ["", "Held-out terms (`terms.csv`: each target's ops timed alone at its own shapes, never fitted), "
              "median / p90 |error| of the model's term:", ""]
    for (kind, term), group in terms.groupby(["kind", "term"]):
        lines.append(f"- {term}, {kind}: {_pct(group.error)} over {len(group)} ops "
                     f"(median signed {100 * group.error.median():+.0f}%)")
    if len(host_order):
        lines += ["", "Is the host's queuing model-dependent? The targets' ops timed alone in one order and in the "
                  "reverse order on one machine (`measured/host_order`), host time over the calibration model's, "
                  "median over op kinds:", "", "| model | " + " | ".join(f"order {o}" for o in
                                                                          sorted(host_order.order.unique())) + " |",
                  "|---|" + "---|" * host_order.order.nunique()]
        for name, group in host_order.groupby("model"):
            lines.append(f"| {name} | " + " | ".join(f"{r:.2f}" for r in group.sort_values("order").over_calibration_model)
                         + " |")
    lines += ["", "## Training step: TinyLlama-1.1B, amp_bf16 (bf16 autocast over fp32 parameters), AdamW, micro-batch 8 x 1024 (training issue)", "",
              "| variant | metric | measured | source | simulated | error | kind |", "|---|---|---|---|---|---|---|"]
    for r in training.itertuples():
        lines.append(f"| {r.variant} | {r.metric} | {_shown(r.measured, r.metric)} | {r.source} | "
                     f"{_shown(r.simulated, r.metric)} | "
                     f"{100 * r.error:+.0f}% | {r.kind} |")
    if len(heldout):
        model = heldout.model.iloc[0]
        lines += ["", f"Held out: {model} trained the same way, predicted before it was measured "
                  "(`training_predictions_*.csv`, committed first; measured in `measured/heldout_training`):", "",
                  "| variant | metric | measured | source | simulated | error | kind |", "|---|---|---|---|---|---|---|"]
        for r in heldout.itertuples():
            lines.append(f"| {r.variant} | {r.metric} | {_shown(r.measured, r.metric)} | {r.source} | "
                         f"{_shown(r.simulated, r.metric)} | {100 * r.error:+.0f}% | {r.kind} |")
    if len(resimulated):
        lines += ["", "The same measurement re-simulated with today's model (`resimulated.csv`; the training "
                  "calibration's per-call pricing, session 18: not held out, the model was changed after this "
                  "measurement):", "", "| variant | metric | measured | source | simulated | error | kind |",
                  "|---|---|---|---|---|---|---|"]
        for r in resimulated[~resimulated.metric.str.startswith("peak_memory")].itertuples():
            lines.append(f"| {r.variant} | {r.metric} | {_shown(r.measured, r.metric)} | {r.source} | "
                         f"{_shown(r.simulated, r.metric)} | {100 * r.error:+.0f}% | {r.kind} |")
    lines += ["", "## Attention memory and time (capacity-planning issue, item 4)", "",
              f"{ATTENTION_MODEL}'s attention op alone (one layer, bf16), peak bytes above what was live before "
              "the call (`max_memory_allocated`), against the memory model's workspace.", "",
              "| kernel | batch | new tokens | context | measured | model | error | OOM measured / predicted | time |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in attention.itertuples():
        measured_text = "out of memory" if r.out_of_memory else f"{r.measured_bytes / 1e6:.1f} MB"
        error_text = "" if r.out_of_memory else f"{100 * r.error:+.0f}%"
        time_text = "" if r.out_of_memory else f"{1e3 * r.time_s:.2f} ms"
        lines.append(f"| {r.kernel} | {r.batch_size} | {r.new_tokens} | {r.context_tokens} | {measured_text} | "
                     f"{r.model_bytes / 1e6:.1f} MB | {error_text} | {'yes' if r.out_of_memory else 'no'} / "
                     f"{'yes' if r.predicted_out_of_memory else 'no'} | {time_text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, default=HERE / "measured")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    run = _calibrated_run(args.measured)
    tables = {"inference": inference_table(run), "spread": spread_table(args.measured), "terms": terms_table(run),
              "host_order": host_order_table(args.measured), "training": training_table(args.measured),
              "heldout": heldout_training_table(args.measured, args.out / f"training_predictions_{HELDOUT_TRAINING_MODEL}.csv"),
              "resimulated": resimulated_heldout_table(args.measured),
              "attention": attention_table(args.measured)}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(args.out / f"{name}.csv", index=False, lineterminator="\n", float_format="%.6g")
    environment = json.loads(next(p for p in (r / "environment.json" for r in reversed(_runs(args.measured)))
                                  if p.is_file()).read_text())
    (args.out / "summary.md").write_text(summary(**tables, environment=environment, calibrated_run=run.name))
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
