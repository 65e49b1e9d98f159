"""The GPU checks' cases: one GPU, tensor parallelism 1, as the issues' GPU checks ask.

* Inference compute transfer (calibration-transfer issue): calibrate compute on the GPU at a small
  model's shapes (:data:`CALIBRATION_MODEL`: ``hetsim calibrate``'s prompts, 8 to 128 tokens), then
  predict other models (:data:`INFERENCE_TARGETS`, the largest Llama-3.1-8B) in bf16, prefill and
  decode, measured on the same GPU.
* Training (data-parallel training issue): one optimizer step of a 1B-class model in bf16 mixed
  precision (``amp_bf16``: torch.autocast over fp32 parameters, what the runtime runs) with and
  without activation checkpointing, world size 1 over NCCL
  (:func:`training_scenario`), against a training calibration of a smaller model
  (:data:`TRAINING_CALIBRATION_MODEL`) and of the same model.
* Attention memory (capacity-planning issue): the attention op's peak memory and time for the
  fused (SDPA) and the eager kernel over batch sizes and sequence lengths (:data:`ATTENTION_CASES`).

Scenarios are built as dictionaries (:func:`sim.scenario.scenario_from_dict`), so the device-side
measurement (:mod:`validation.gpu_check`) and the report (:mod:`validation.gpu_report`) read the
same cases. No torch here.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from sim.scenario import Scenario, scenario_from_dict

class TimingMode(StrEnum):
    """How a generation was timed (``inference.csv``'s ``mode``): ``async``, no op timed, the GPU
    running what the host queued, CUDA events per step (what the report compares); ``synced``, every
    op timed after a device synchronisation (the runtime's traced runs)."""

    ASYNC = "async"
    SYNCED = "synced"


DEVICE_TYPE = "h100_sxm"
DTYPE = "bf16"
CALIBRATION_MODEL = "qwen2.5-0.5b"
INFERENCE_TARGETS = (
    ("qwen2.5-0.5b", 512),  # the calibrated model at a prompt the calibration never ran
    ("tinyllama-1.1b", 512),
    ("qwen2.5-7b", 512),
    ("llama-3.1-8b", 128),
    ("llama-3.1-8b", 512),
    ("llama-3.1-8b", 2048),
)
OUTPUT_TOKENS = 32
TRAINING_MODEL = "tinyllama-1.1b"
TRAINING_CALIBRATION_MODEL = "qwen2.5-0.5b"
HELDOUT_TRAINING_MODEL = "qwen2.5-0.5b"  # trained on the GPU after its step was predicted (--training-model)
TRAINING_MICRO_BATCH = 8
TRAINING_SEQUENCE = 1024
TRAINING_VARIANTS = ({"name": "no_checkpointing"},
                     {"name": "checkpoint_every_1", "training": {"activation_checkpointing": 1}})
ATTENTION_MODEL = "llama-3.1-8b"
ATTENTION_CASES = tuple((batch, tokens) for batch in (1, 4, 16) for tokens in (512, 2048, 8192))
"""(batch size, prompt tokens) of the attention prefill cases; each also as one decode step over
that context."""


def _cluster() -> dict:
    return {"switches": [{"name": "tor"}],
            "hosts": [{"name": "gpu0", "parent": "tor", "nic": {"bandwidth": "100Gbit/s", "latency": "2us"},
                       "devices": {"type": DEVICE_TYPE, "count": 1}}]}


def inference_scenario(model: str, prompt_tokens: int, output_tokens: int | None = None,
                       batch_size: int = 1) -> Scenario:
    """One GPU running ``model`` in bf16 at TP 1: a prefill of ``prompt_tokens`` and
    ``output_tokens - 1`` decode steps (default :data:`OUTPUT_TOKENS`), batch ``batch_size``."""
    output_tokens = OUTPUT_TOKENS if output_tokens is None else output_tokens
    name = f"gpu_{model}_p{prompt_tokens}".replace(".", "").replace("-", "_")
    return scenario_from_dict({
        "name": name, "description": f"{model} {DTYPE} on one {DEVICE_TYPE}, prompt {prompt_tokens}",
        "model": model, "dtype": DTYPE, "cluster": _cluster(),
        "workload": {"batch_size": batch_size, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens},
        "network_model": "flow",
        "variants": [{"name": "tp1", "strategy": "allreduce_ln", "allreduce": "ring"}],
    }, base_dir=Path("."))


def training_scenario(model: str = TRAINING_MODEL, steps: int = 3) -> Scenario:
    """One GPU training ``model`` with DDP (world size 1), AdamW, bf16 autocast (``amp_bf16``), one
    micro-batch of :data:`TRAINING_MICRO_BATCH` x :data:`TRAINING_SEQUENCE` tokens per step,
    without and with activation checkpointing (:data:`TRAINING_VARIANTS`)."""
    name = f"gpu_train_{model}".replace(".", "").replace("-", "_")
    return scenario_from_dict({
        "name": name, "description": f"{model} training step on one {DEVICE_TYPE}",
        "model": model, "cluster": _cluster(), "parallel": {"data": 1},
        "workload": {"kind": "training", "global_batch_size": TRAINING_MICRO_BATCH,
                     "micro_batch_size": TRAINING_MICRO_BATCH, "sequence_length": TRAINING_SEQUENCE,
                     "steps": steps},
        "training": {"optimizer": "adamw", "precision": "amp_bf16", "bucket_cap_mb": 25},
        "network_model": "flow",
        "variants": list(TRAINING_VARIANTS),
    }, base_dir=Path("."))
