"""What one training step holds at its peak on the CPU, against the memory model's loss-backward
term (:func:`models.training.loss_backward_bytes`), per precision.

One process trains the runtime's model (:class:`runtime.training.model.DecoderLM`, no DDP) on a
tiny Llama (hidden 256, 2 layers, a 4096 vocabulary, 4 x 128 tokens: 2.1M logits), the memory
probe in its exact mode (:mod:`runtime.memory_probe`). Per precision (``fp32``, ``amp_bf16``,
``bf16_mixed``) it prints the peak over the resident bytes of a forward alone and of a forward
and backward, the bytes autograd saved in the forward (every distinct storage packed by
``torch.autograd.graph.saved_tensors_hooks``, parameters and their bf16 copies left out), and the
model's :func:`models.training.activation_bytes` and :func:`models.training.loss_backward_bytes`.
The loss's backward peaks at the saved tensors plus 8 bytes per logit (two fp32 gradients of
the logits' shape beside the saved log-probabilities) where the gradients (14 MB here) are not
yet allocated. A few seconds; depends on nothing but this machine's allocator.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_loss_backward_memory.py``
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import torch

from models.catalog import load_hf_config
from models.training import ActivationLayout, Precision, activation_bytes, compute_dtype, loss_backward_bytes
from runtime import memory_probe
from runtime.training.model import DecoderLM, next_token_loss, training_batch
from runtime.training.precision import Bf16Copies
from runtime.training.trainer import autocast

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 8,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 4096, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32"}
MICRO_BATCH, SEQUENCE = 4, 128


def measure(precision: Precision, spec) -> dict[str, float]:
    """Bytes of one forward (and one forward and backward) over the resident, and saved by autograd."""
    model = DecoderLM(spec, 0)
    kept = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if precision is Precision.BF16_MIXED:
        Bf16Copies(model)
        kept |= {p.compute_copy.untyped_storage().data_ptr() for p in model.parameters()}
    batch = training_batch(spec, MICRO_BATCH, SEQUENCE, 0, 0)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def step(backward: bool) -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast(precision, torch.device("cpu")):
                loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        if backward:
            loss.backward()

    step(True)  # untimed: the allocator's and autograd's first-call state
    out = {}
    for backward in (False, True):
        model.zero_grad(set_to_none=True)
        saved.clear()
        gc.collect()
        memory_probe.reset_peak()
        resident = memory_probe.current_bytes()
        step(backward)
        out["step" if backward else "forward"] = memory_probe.peak_bytes() - resident
    out["saved"] = sum(n for ptr, n in saved.items() if ptr not in kept)
    return out


def main() -> None:
    memory_probe.configure_allocator(exact=True)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(CONFIG))
        spec = load_hf_config(path)
    layout = ActivationLayout(MICRO_BATCH, SEQUENCE)
    logits = MICRO_BATCH * SEQUENCE * spec.vocab_size
    print(f"{logits / 1e6:.1f}M logits; MB over the resident")
    print("precision | forward peak | step peak | saved | saved + 8 B/logit | activation_bytes | loss_backward_bytes")
    for precision in Precision:
        got = measure(precision, spec)
        compute = spec.with_dtype(compute_dtype(precision))
        amp = precision is Precision.AMP_BF16
        print(f"{precision.value} | {got['forward'] / 1e6:.1f} | {got['step'] / 1e6:.1f} | {got['saved'] / 1e6:.1f} | "
              f"{(got['saved'] + 8 * logits) / 1e6:.1f} | {activation_bytes(compute, layout, autocast=amp) / 1e6:.1f} | "
              f"{loss_backward_bytes(compute, layout, autocast=amp) / 1e6:.1f}")


if __name__ == "__main__":
    main()
