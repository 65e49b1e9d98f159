"""``bf16_mixed`` as Megatron-LM trains it: bf16 weights the kernels read, fp32 main gradients
accumulated and allreduced in fp32, fp32 master weights stepped by the optimizer and copied back.

Megatron-LM keeps the model's parameters in bf16 (``args.params_dtype = torch.bfloat16`` under
``--bf16``), and for bf16 turns on ``accumulate_allreduce_grads_in_fp32`` ("bfloat16 requires
gradient accumulation and all-reduce to be done in fp32", ``megatron/training/arguments.py``):
its DDP gives every parameter an fp32 ``main_grad`` in a contiguous fp32 gradient buffer
(``grad_dtype = torch.float if self.ddp_config.grad_reduce_in_fp32``,
``megatron/core/distributed/distributed_data_parallel.py``; ``param_and_grad_buffer.py``) into
which each backward's bf16 ``param.grad`` is added, and which the buckets allreduce in fp32;
its mixed-precision optimizer steps fp32 master copies of the
parameters and copies them back into the bf16 parameters after the step
(``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params`` in
``megatron/core/optimizer/optimizer.py``).
2 + 4 + 4 + 8 bytes per parameter under Adam (``megatron/training/theoretical_memory_usage.py``;
:func:`models.training.model_state_memory`).

The mechanism here keeps ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb``,
overlap, ``no_sync``, the comm hook): DDP's buckets take the dtype of the parameters it
registers (``Reducer::initialize_buckets``, ``torch/csrc/distributed/c10d/reducer.cpp``), so for
fp32 buckets the module's registered parameters are the fp32 masters, and the kernels read a
persistent bf16 copy of each (:class:`Bf16Copies`, ``compute_copy`` on the parameter).
:func:`compute_weight` hands a kernel that copy through an autograd function whose backward
casts the kernel's bf16 weight gradient to fp32, so ``AccumulateGrad`` accumulates ``.grad`` in
fp32 across micro-batches (Megatron's ``main_grad.add_(param.grad)``) and DDP's fp32 buckets
reduce it. The optimizer steps the masters; :meth:`Bf16Copies.refresh` copies them into the bf16
copies after the step. A DDP comm hook that upcasts a bf16 bucket was not chosen: the gradients
would accumulate in bf16 under ``no_sync`` and the bucket would be a bf16 tensor of its own.

Measured (``hetsim``'s CPU memory probe, 2 gloo ranks, a Llama of hidden 256, 2 layers, a 4096
vocabulary, AdamW, 4 x 128 tokens per rank): weights, gradients, optimizer states and buckets
equal :func:`models.training.training_memory`'s 2 / 4 / 12 / 4 bytes per parameter; the peak
-2.4% of the simulator's (one micro-batch; +0.1% with two), -10% / +0.4% without the framework.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from models.training import Precision

_COPY = "compute_copy"


class _ComputeCopy(torch.autograd.Function):
    """Forward: the parameter's bf16 copy (a view of it); backward: the copy's gradient in the
    parameter's dtype (fp32), into the parameter's ``.grad``."""

    @staticmethod
    def forward(ctx, parameter: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = parameter.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def compute_weight(parameter: torch.Tensor | None) -> torch.Tensor | None:
    """What a kernel reads for ``parameter``: its bf16 copy when :class:`Bf16Copies` gave it one
    (gradients flowing back into the fp32 parameter), else the parameter itself (None stays None)."""
    copy = getattr(parameter, _COPY, None)
    return parameter if copy is None else _ComputeCopy.apply(parameter, copy)


class Bf16Copies:
    """A bf16 copy of every parameter of ``module`` (the fp32 masters), read by the kernels
    through :func:`compute_weight` (see the module)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.parameters = list(module.parameters())
        for p in self.parameters:
            setattr(p, _COPY, p.detach().to(dtype))

    def refresh(self) -> None:
        """Copy every master into its bf16 copy (after an optimizer step or a parameter average)."""
        with torch.no_grad():
            for p in self.parameters:
                getattr(p, _COPY).copy_(p)

    def remove(self) -> None:
        """Take the copies off the parameters: the kernels read the parameters again."""
        for p in self.parameters:
            delattr(p, _COPY)

    def copy_bytes(self) -> int:
        """Bytes of the bf16 copies: the weights the kernels read."""
        return sum(getattr(p, _COPY).numel() * getattr(p, _COPY).element_size() for p in self.parameters)


def bf16_copies(module: nn.Module, precision: Precision) -> Bf16Copies | None:
    """The bf16 copies ``precision`` computes with: :class:`Bf16Copies` of ``module`` under
    ``bf16_mixed``, None under any other precision (the kernels read the parameters)."""
    return Bf16Copies(module) if precision is Precision.BF16_MIXED else None


def refresh(copies: Bf16Copies | None) -> None:
    """:meth:`Bf16Copies.refresh` where there are copies (after an optimizer step or a parameter
    average); nothing otherwise."""
    if copies is not None:
        copies.refresh()


def stream_dtype(precision: Precision) -> torch.dtype:
    """The dtype of the activations between a model's ops under ``precision``: bf16 under
    ``bf16_mixed`` (what its kernels give on the bf16 copies), fp32 under any other (under
    ``amp_bf16`` the residual stream: autocast casts to bf16 inside the ops on its list)."""
    return torch.bfloat16 if precision is Precision.BF16_MIXED else torch.float32


@contextmanager
def computing_in(module: nn.Module, precision: Precision) -> Iterator[Bf16Copies | None]:
    """Within the block, ``module``'s kernels read the weights ``precision`` computes with
    (:func:`bf16_copies`, taken off on leaving, so that one module can be timed in several
    precisions, :mod:`runtime.training.calibrate`); yields the copies (None: no copies)."""
    copies = bf16_copies(module, precision)
    try:
        yield copies
    finally:
        if copies is not None:
            copies.remove()
