"""Single-process references of data-parallel training, for the correctness tests.

Gradient averaging over D ranks with k micro-batches each is, in exact arithmetic, one optimizer
step on the mean loss of the whole global batch: each rank's accumulated gradient is the mean over
its rows (each micro-batch's loss scaled by 1 / k), and the allreduce averages the D means of
equal-sized shards. :func:`reference_parameters` takes that step in one process, one forward over
the global batch, with no DDP, no buckets, no checkpointing, no hook and an unsharded optimizer:
whatever the variant, the same parameters must come out, up to float rounding. Under
``bf16_mixed`` both compute with bf16 copies of fp32 masters (:mod:`runtime.training.precision`).

Parameter averaging (local SGD) is not equal to that: :func:`local_sgd_reference` keeps the D
replicas in one process, each stepping its own optimizer on its own rows, and replaces their
parameters by the mean every ``averaging_period`` steps.

Under tensor parallelism a rank holds a shard of its replica: :func:`reference_shard` cuts the
reference's parameters to it (:func:`runtime.training.model.shard_parameters`), which, in exact
arithmetic, is what the rank holds after the same steps (Megatron's ``f`` and ``g`` make the
sharded forward and backward the whole model's).
"""

from __future__ import annotations

import torch

from models.shards import tensor_shards
from runtime.training.model import DecoderLM, next_token_loss, shard_parameters, training_batch
from runtime.training.precision import bf16_copies, refresh
from runtime.training.trainer import TrainingSetup, autocast, make_optimizer


def reference_parameters(setup: TrainingSetup, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` optimizer steps on the whole global batch (see the module)."""
    w = setup.workload
    model = DecoderLM(setup.spec, seed)
    copies = bf16_copies(model, setup.settings.precision)
    optimizer = make_optimizer(list(model.parameters()), setup.settings)
    for step in range(steps):
        batch = training_batch(setup.spec, w.global_batch_size, w.sequence_length, seed, step)
        with autocast(setup.settings.precision, torch.device("cpu")):
            loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        refresh(copies)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def local_sgd_reference(setup: TrainingSetup, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Each replica's parameters after ``steps`` local steps with the mean taken after every
    :meth:`TrainingSetup.averages_after` step (see the module), replica by replica."""
    w = setup.workload
    replicas = [DecoderLM(setup.spec, seed) for _ in setup.group]
    copies = [bf16_copies(m, setup.settings.precision) for m in replicas]
    optimizers = [make_optimizer(list(m.parameters()), setup.settings) for m in replicas]
    rows = setup.rank_rows
    for step in range(steps):
        batch = training_batch(setup.spec, w.global_batch_size, w.sequence_length, seed, step)
        for index, (model, optimizer) in enumerate(zip(replicas, optimizers)):
            mine = batch[index * rows:(index + 1) * rows]
            with autocast(setup.settings.precision, torch.device("cpu")):
                loss = next_token_loss(model(mine[:, :-1]), mine[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if setup.averages_after(step):
            with torch.no_grad():
                for tensors in zip(*(m.parameters() for m in replicas)):
                    mean = torch.stack(tensors).mean(dim=0)
                    for t in tensors:
                        t.copy_(mean)
        for c in copies:
            refresh(c)
    return [{name: p.detach().clone() for name, p in m.named_parameters()} for m in replicas]


def reference_shard(setup: TrainingSetup, parameters: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The part of a reference's whole-model ``parameters`` that ``rank`` holds: its
    tensor-parallel index's shard (``rank % setup.tensor``; everything when ``setup.tensor`` is 1)."""
    if setup.tensor == 1:
        return parameters
    shard = tensor_shards(setup.spec, setup.tensor)[rank % setup.tensor]
    return shard_parameters(setup.spec, shard, parameters)
