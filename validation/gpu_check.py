"""The GPU checks' measurements, run on a machine with one CUDA GPU (:mod:`validation.gpu_cases`
says what is checked; :mod:`validation.gpu_report` compares it with the simulator)::

    python -m validation.gpu_check --out DIR [--parts ceilings,calibrate,inference,training,attention]

Writes under ``DIR``, part by part (a part that fails writes its traceback to ``errors.txt`` and
the others still run):

* ``environment.json``: torch and CUDA versions, the GPU, and two measured ceilings: a bf16
  8192^3 matrix product (FLOP/s) and a device-to-device copy (bytes read plus written per s),
  each the median of CUDA-event timings after warm-ups;
* ``profile_<model>.csv``: ``hetsim calibrate``'s inference rows on this GPU
  (:func:`runtime.calibrate.calibrate_rank`, world size 1) for the calibration model;
* ``opshapes_<model>.csv``: each target's ops timed alone at its shapes (held out, for diagnosis);
* ``inference.csv``: per target, TTFT and TPOT measured two ways over repeats: ``async`` (the
  executor records no op, the GPU runs the kernels the host queued, times from CUDA events
  around each step) and ``synced`` (every op timed after a device synchronisation, as the
  runtime's traces are), with peak ``max_memory_allocated``; ``ops_<model>_p<prompt>.csv``: the
  synced run's op records;
* ``training_profile_<model>.csv`` (``hetsim calibrate`` of a training scenario on this GPU) and
  ``training_results.csv`` (``hetsim measure`` of the training scenario: DDP over NCCL, world
  size 1, ``max_memory_allocated``);
* ``attention.csv``: the attention op alone, fused (SDPA) and eager, per batch and sequence
  length, prefill and one decode step: peak memory above what was allocated before the call, and
  the median time of CUDA-event-timed calls.

Timing follows the usual GPU method: warm-up calls first, CUDA events around the region, medians
over repeats, random (never zero) inputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

PARTS = ("ceilings", "calibrate", "opshapes", "inference", "training", "attention")


def ceilings(out: Path, device: torch.device) -> None:
    """``environment.json``: versions, the GPU and its two ceilings as the calibration measures them
    (:func:`runtime.shape_bench.ceiling_rows`: a bf16 8192^3 matrix product, a 1 GiB copy)."""
    from runtime.shape_bench import ceiling_rows
    from validation.gpu_cases import DEVICE_TYPE, DTYPE

    props = torch.cuda.get_device_properties(device)
    rates = {row["op"]: row["median"] for row in ceiling_rows(DEVICE_TYPE, DTYPE, torch.bfloat16, device)}
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": props.name,
            "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
            "matmul_bf16_8192_flops_per_s": rates["matmul"], "copy_bytes_per_s": rates["copy"],
            "hostname": os.uname().nodename, "cpu_count": os.cpu_count()}
    (out / "environment.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def calibrate(out: Path, device: torch.device) -> None:
    """``profile_<model>.csv``: ``hetsim calibrate``'s inference calibration of the calibration
    model on this GPU (world size 1: compute per op in place, the op gap, the ops timed alone
    per shape, the memory baseline)."""
    from runtime.calibrate import calibrate_rank
    from sim.topology import build_topology
    from validation.gpu_cases import CALIBRATION_MODEL, inference_scenario

    scenario = inference_scenario(CALIBRATION_MODEL, 128)
    topology = build_topology(scenario.config.cluster)
    torch.manual_seed(0)
    began = time.perf_counter()
    profile = calibrate_rank(scenario, topology, 0, repeats=5, max_call_s=0.1, heartbeat=_log, device=device)
    _write(out / f"profile_{CALIBRATION_MODEL}.csv", profile)
    print(f"calibrated {CALIBRATION_MODEL} in {time.perf_counter() - began:.1f} s: {len(profile)} rows")


def opshapes(out: Path, device: torch.device) -> None:
    """``opshapes_<model>.csv``: each target's ops timed alone at its own shapes, as the
    calibration times the calibration model's (:func:`runtime.shape_bench.shape_rows`, one
    decoder layer built): held out, for the report's term-by-term comparison, never fitted."""
    from dataclasses import replace

    from models.catalog import get_model
    from runtime.shape_bench import shape_rows
    from validation.gpu_cases import DEVICE_TYPE, DTYPE, INFERENCE_TARGETS

    prompts: dict[str, list[int]] = {}
    for model_name, prompt in INFERENCE_TARGETS:
        prompts.setdefault(model_name, []).append(prompt)
    for model_name, lengths in prompts.items():
        spec = replace(get_model(model_name), dtype=DTYPE, num_layers=1)
        # decode at the targets' batch only: held-out shapes comparable with earlier runs' (batch 1)
        rows = shape_rows(spec, device_class=DEVICE_TYPE, batch_size=1, prompts=tuple(lengths),
                          max_tokens=max(lengths) + 1, ranks=1, dtype=torch.bfloat16, device=device,
                          decode_batches=(1,))
        _write(out / f"opshapes_{model_name}.csv", pd.DataFrame(rows))
        torch.cuda.empty_cache()
        print(f"op shapes of {model_name}: {len(rows)} rows")


def inference(out: Path, device: torch.device, repeats: int = 7) -> None:
    """``inference.csv`` and ``ops_*.csv``: every target of :data:`validation.gpu_cases.INFERENCE_TARGETS`."""
    from runtime.comm import Communicator
    from runtime.executor import Executor
    from runtime.weights import prompt_tokens
    from runtime.worker import rank_model
    from sim.topology import build_topology
    from validation.gpu_cases import INFERENCE_TARGETS, OUTPUT_TOKENS, TimingMode, inference_scenario

    rows, built = [], {}
    for model_name, prompt in INFERENCE_TARGETS:
        scenario = inference_scenario(model_name, prompt)
        topology = build_topology(scenario.config.cluster)
        if model_name not in built:
            built.clear()
            torch.cuda.empty_cache()
            began = time.perf_counter()
            max_tokens = max(p for m, p in INFERENCE_TARGETS if m == model_name) + OUTPUT_TOKENS
            built[model_name] = rank_model(scenario, (0,), 0, seed=0, max_tokens=max_tokens, device=device)[0]
            print(f"built {model_name} in {time.perf_counter() - began:.1f} s")
        model = built[model_name]
        plan = scenario.plan(scenario.config.variants[0], (0,))
        comm = Communicator(0, topology.host_groups)
        tokens = prompt_tokens(scenario.model, 1, prompt, seed=0).to(device)
        executors = {TimingMode.ASYNC: Executor(plan, model, comm, 0, record_ops=False),
                     TimingMode.SYNCED: Executor(plan, model, comm, 0, record_ops=True)}
        per_mode: dict[str, list[tuple[float, float]]] = {mode: [] for mode in executors}
        last = {}
        with torch.inference_mode():
            for index in range(repeats + 1):  # the first round warms up
                for mode, executor in executors.items():  # interleaved: both sample the same stretch
                    generation, events = _generate_timed(executor, tokens)
                    if index:
                        per_mode[mode].append(events)
                        last[mode] = generation
            torch.cuda.reset_peak_memory_stats(device)
            executors[TimingMode.ASYNC].generate(tokens, time.perf_counter())
            peak = torch.cuda.max_memory_allocated(device)
        for mode, values in per_mode.items():
            ttft = [v[0] for v in values]
            tpot = [v[1] for v in values]
            rows.append({"model": model_name, "prompt_tokens": prompt, "output_tokens": OUTPUT_TOKENS, "mode": mode,
                         "ttft_s": statistics.median(ttft), "ttft_min_s": min(ttft), "ttft_max_s": max(ttft),
                         "tpot_s": statistics.median(tpot), "tpot_min_s": min(tpot), "tpot_max_s": max(tpot),
                         "repeats": len(values), "peak_memory_bytes": peak,
                         "weight_bytes": model.weight_bytes})
            print(rows[-1])
        records = pd.DataFrame([r._asdict() for r in last[TimingMode.SYNCED].records])
        _write(out / f"ops_{model_name}_p{prompt}.csv", records)
        _write(out / "inference.csv", pd.DataFrame(rows))


def _generate_timed(executor, tokens: torch.Tensor):
    """One generation; (its Generation, (TTFT s, TPOT s)) from CUDA events recorded at each step's
    start (the ``on_step`` call) and at the generation's end: TTFT the prefill step, TPOT the
    mean decode step."""
    marks = []

    def on_step(step: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(event)

    generation = executor.generate(tokens, time.perf_counter(), on_step=on_step)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    marks.append(end)
    steps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    return generation, (steps[0], sum(steps[1:]) / max(1, len(steps) - 1))


def training(out: Path, device: torch.device, model: str | None = None) -> None:
    """``training_profile_<model>.csv`` for the training calibration model and the trained
    ``model`` (default :data:`validation.gpu_cases.TRAINING_MODEL`), and ``training_results.csv``:
    that model's training scenario measured (DDP, NCCL, world 1)."""
    from runtime.measure import write_measured_outputs
    from runtime.training.calibrate import calibrate_training_rank
    from runtime.training.measure import measured_training, train_rank
    from sim.topology import build_topology
    from validation.gpu_cases import TRAINING_CALIBRATION_MODEL, TRAINING_MODEL, training_scenario

    model = model or TRAINING_MODEL
    for model_name in dict.fromkeys((TRAINING_CALIBRATION_MODEL, model)):
        scenario = training_scenario(model_name)
        topology = build_topology(scenario.config.cluster)
        began = time.perf_counter()
        profile = calibrate_training_rank(scenario, topology, 0, repeats=5, device=device, heartbeat=_log)
        _write(out / f"training_profile_{model_name}.csv", profile)
        print(f"training calibration of {model_name}: {time.perf_counter() - began:.1f} s")
        torch.cuda.empty_cache()
    scenario = training_scenario(model)
    topology = build_topology(scenario.config.cluster)
    repeats = 3
    gathered = train_rank(scenario, topology, 0, repeats=repeats, warmup=2, seed=0, device=device, heartbeat=_log)
    result = measured_training(scenario, topology, gathered, repeats)
    write_measured_outputs(result, out / "training_measured")
    _write(out / "training_results.csv", result.results)
    print(result.results.to_string())


def attention(out: Path, device: torch.device) -> None:
    """``attention.csv``: the attention op of :data:`validation.gpu_cases.ATTENTION_MODEL`'s first
    layer alone (the runtime's kernel, :meth:`runtime.model.RankModel.attention`), fused and eager."""
    from dataclasses import replace

    from models.catalog import get_model
    from runtime.model import RankModel
    from sim.program import Stage
    from validation.gpu_cases import ATTENTION_CASES, ATTENTION_MODEL, DTYPE

    rows = []
    for kernel in ("sdpa", "eager"):
        spec = replace(get_model(ATTENTION_MODEL), dtype=DTYPE, attention=kernel, num_layers=1)
        for batch, tokens in ATTENTION_CASES:
            model = None
            try:
                model = RankModel(spec, 1, 0, seed=0, batch_size=batch, max_tokens=tokens + 1, device=device,
                                  dtype=torch.bfloat16, stage=Stage(0, 1, embeds=False, heads=False))
                for new, start in ((tokens, 0), (1, tokens)):
                    rows.append({"kernel": kernel, "batch_size": batch, "new_tokens": new,
                                 "context_tokens": start + new, **_attention_case(model, batch, new, start, device)})
                    print(rows[-1])
            except torch.OutOfMemoryError as error:
                rows.append({"kernel": kernel, "batch_size": batch, "new_tokens": tokens, "context_tokens": tokens,
                             "error": f"out of memory: {str(error).splitlines()[0]}"})
                print(rows[-1])
            finally:
                del model
                torch.cuda.empty_cache()
            _write(out / "attention.csv", pd.DataFrame(rows))


def _attention_case(model, batch: int, new: int, start: int, device: torch.device) -> dict:
    """Peak bytes above the live ones during one call, and the median CUDA-event time (s)."""
    from runtime.shape_bench import event_times

    spec = model.spec
    d = spec.head_dim
    q = torch.randn(batch, new, spec.num_attention_heads, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, new, spec.num_kv_heads, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with torch.inference_mode():
        model.attention(q, k, v, 0, start)  # warms the kernel up
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = model.attention(q, k, v, 0, start)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        output_bytes = out.numel() * out.element_size()
        del out
        seconds = statistics.median(event_times(lambda: model.attention(q, k, v, 0, start), repeats=10))
    return {"peak_bytes": peak, "output_bytes": output_bytes, "time_s": seconds}


def _write(path: Path, frame: pd.DataFrame) -> None:
    tmp = path.with_suffix(".tmp")
    frame.to_csv(tmp, index=False, lineterminator="\n")
    tmp.replace(path)


def _log(label: str) -> None:
    print(f"  {time.strftime('%H:%M:%S')} {label}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--training-model", default=None,
                        help="the model the training part measures (default: validation.gpu_cases.TRAINING_MODEL)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})")
    if args.training_model is not None:
        from models.catalog import get_model
        from models.errors import ConfigError

        try:
            get_model(args.training_model)  # refused before the GPU is touched
        except ConfigError as error:
            parser.error(f"--training-model: {error}")
    run = {name: globals()[name] for name in PARTS} | {
        "training": functools.partial(training, model=args.training_model)}
    if not torch.cuda.is_available():
        parser.error("no CUDA device: the GPU checks need one")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    # Calibration's agreements travel in CPU tensors (gloo); DDP's buckets in CUDA ones (NCCL).
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=device)
    failed = 0
    for part in parts:
        began = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            run[part](args.out, device)
        except Exception:  # noqa: BLE001 - one part's failure is recorded; the others still run
            failed += 1
            text = traceback.format_exc()
            print(text, flush=True)
            with open(args.out / "errors.txt", "a") as errors:
                errors.write(f"== {part}\n{text}\n")
        print(f"== {part}: {time.perf_counter() - began:.1f} s", flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
