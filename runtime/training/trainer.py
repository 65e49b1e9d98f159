"""One data-parallel rank training one variant of a training scenario with real DDP.

:class:`TrainingSetup` resolves what a variant asks for (the batches of
:func:`sim.training_config.micro_batching`, the optimizer and precision, the reducer's settings)
and refuses what the runtime does not run, naming the field. :class:`Trainer` builds the model
(:class:`runtime.training.model.DecoderLM`), wraps it in
``torch.nn.parallel.DistributedDataParallel`` with the variant's ``bucket_cap_mb`` and
``gradient_as_bucket_view`` (the first bucket capped at ``first_bucket_mb`` through DDP's
``bucket_cap_mb_list``, whose last cap repeats; never above ``bucket_cap_mb``, since DDP's own
``_BucketCapacityConfig`` never makes the first bucket the larger), registers the comm hook of :mod:`runtime.training.hooks`, and runs
optimizer steps (under ``bf16_mixed``, DDP's parameters are fp32 masters with bf16 copies the
kernels read: :mod:`runtime.training.precision`): ``gradient_accumulation`` micro-batches each (all but the last under
``no_sync()`` when ``training.no_sync``), the loss of each scaled by 1 / accumulation so that the
accumulated gradient is the mean over the rank's rows, then the optimizer (torch.optim's, or
``ZeroRedundancyOptimizer`` for ``zero: 1``), then, under parameter averaging, the mean of the
parameters every ``averaging_period`` steps. Every phase is timed with ``time.perf_counter``
after the device finished its work.

Tensor parallelism inside each data-parallel replica (``parallel.tensor`` T above 1, ranks laid
out by :class:`runtime.training.ranks.TrainingRanks`): the model is the rank's shard
(:class:`runtime.training.model.TensorParallel`, its collectives over the replica's T ranks), and
DDP, the comm hook, ZeRO-1 and the parameter average run over the rank's data-parallel group (the
ranks of its tensor index); the T ranks of a replica train on the same rows.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch._dynamo  # noqa: F401 - DDP imports it on first use: 10 s per rank unless the parent, which forks, has
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from models.errors import ConfigError
from models.shards import tensor_shards
from models.spec import ModelSpec
from models.training import Loss, Optimizer, Precision
from runtime.device import device_of
from runtime.training.hooks import BucketAllreduce, BucketCall, average_parameters
from runtime.training.model import DecoderLM, TensorParallel, next_token_loss, training_batch
from runtime.training.precision import bf16_copies, refresh
from runtime.training.ranks import TrainingRanks
from sim.collectives.registry import AUTO
from sim.training_config import Averaging, TrainingSettings, TrainingWorkload, micro_batching

OPTIMIZERS = {Optimizer.SGD: torch.optim.SGD, Optimizer.ADAM: torch.optim.Adam, Optimizer.ADAMW: torch.optim.AdamW}
LEARNING_RATE = {Optimizer.SGD: 1e-2, Optimizer.ADAM: 1e-3, Optimizer.ADAMW: 1e-3}
"""The runtime measures time and memory, not convergence: fixed learning rates, torch.optim's other
defaults (SGD without momentum, AdamW's weight decay 0.01), as :mod:`models.training` prices them."""


@dataclass(frozen=True)
class TrainingSetup:
    """What one variant trains, resolved: ``micro_batch_size`` and ``accumulation`` per rank
    (:func:`sim.training_config.micro_batching`) over the ``group`` of data-parallel ranks (those
    of tensor index 0), each replica of ``tensor`` tensor-parallel ranks.

    Raises (from :meth:`of`): ConfigError on ``training.allreduce: auto`` (the simulator's choice,
    which no single run makes), on ``training.zero: 1`` with parameter averaging (ZeRO-1
    assumes replicas that agree after every step) and with ``bf16_mixed`` (whose fp32 masters the
    runtime does not shard).
    """

    name: str
    spec: ModelSpec
    workload: TrainingWorkload
    settings: TrainingSettings
    group: tuple[int, ...]
    micro_batch_size: int
    accumulation: int
    tensor: int = 1

    @classmethod
    def of(cls, scenario, variant, group: tuple[int, ...], tensor: int = 1) -> TrainingSetup:
        settings = scenario.training_settings(variant)
        workload = scenario.config.workload
        if settings.allreduce == AUTO:
            raise ConfigError("training.allreduce", f"variant {variant.name}: the runtime runs a named algorithm or "
                                                    f"library; auto is the simulator's choice (got {AUTO})")
        if settings.loss != Loss.AUTOGRAD:
            raise ConfigError("training.loss", f"variant {variant.name}: the runtime trains with torch's "
                                               f"cross-entropy under autograd; a fused loss is simulated only "
                                               f"(got '{settings.loss}')")
        if settings.zero == 1 and settings.averaging is Averaging.PARAMETERS:
            raise ConfigError("training.zero", f"variant {variant.name}: ZeRO-1 shards the optimizer of replicas "
                                               f"that average gradients, not parameters (got 1)")
        if settings.zero == 1 and settings.precision is Precision.BF16_MIXED:
            # The simulator shards the fp32 masters with the states (Megatron's distributed
            # optimizer); here they are DDP's parameters, whole on every rank.
            raise ConfigError("training.zero", f"variant {variant.name}: the runtime's bf16_mixed keeps its fp32 "
                                               f"master weights whole on every rank; use precision amp_bf16 or "
                                               f"zero 0 (got 1)")
        micro, accumulation = micro_batching(workload, settings, len(group))
        return cls(variant.name, scenario.model, workload, settings, group, micro, accumulation, tensor)

    @classmethod
    def of_ranks(cls, scenario, variant, ranks: TrainingRanks) -> TrainingSetup:
        """:meth:`of` for the layout ``ranks`` (:func:`runtime.training.ranks.training_ranks`)."""
        return cls.of(scenario, variant, ranks.data_group(0), ranks.tensor)

    @property
    def layout(self) -> TrainingRanks:
        """The ranks' layout: ``tensor`` x the group's replicas."""
        return TrainingRanks(self.tensor, len(self.group))

    @property
    def rank_rows(self) -> int:
        """Sequences of the global batch one rank trains on per step."""
        return self.micro_batch_size * self.accumulation

    def averages_after(self, step: int) -> bool:
        """Whether parameters are averaged after optimizer step ``step`` (0-based): every
        ``averaging_period`` steps, after the period's last (local SGD, Lin et al. 2020, arXiv
        1808.07217; ``PeriodicModelAverager`` with ``warmup_steps = period - 1``)."""
        return self.settings.averaging is Averaging.PARAMETERS and (step + 1) % self.settings.averaging_period == 0


def make_optimizer(parameters, settings: TrainingSettings, zero: bool = False,
                   process_group=None) -> torch.optim.Optimizer:
    """The variant's optimizer over ``parameters`` (a list), sharded with
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` over ``process_group`` (None: the default
    group) when ``zero``."""
    cls = OPTIMIZERS[settings.optimizer]
    if zero:
        return ZeroRedundancyOptimizer(parameters, optimizer_class=cls, process_group=process_group,
                                       lr=LEARNING_RATE[settings.optimizer])
    return cls(parameters, lr=LEARNING_RATE[settings.optimizer])


def autocast(precision: Precision, device: torch.device):
    """The forward pass's precision context: bf16 autocast under ``amp_bf16`` (fp32 parameters,
    gradients and optimizer states: torch's automatic mixed precision), else nothing (``bf16_mixed``
    computes with bf16 weights: :mod:`runtime.training.precision`)."""
    if precision is Precision.AMP_BF16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass
class StepTiming:
    """One optimizer step on one rank (``time.perf_counter`` seconds): its span, each
    micro-batch's forward and backward, the optimizer step, the parameter average (None when the
    step has none) and the bucket allreduces the comm hook ran."""

    step: int
    start_s: float
    end_s: float = 0.0
    forward: list[tuple[float, float]] = field(default_factory=list)
    backward: list[tuple[float, float]] = field(default_factory=list)
    optimizer: tuple[float, float] = (0.0, 0.0)
    averaging: tuple[float, float] | None = None
    buckets: list[BucketCall] = field(default_factory=list)


def process_groups(layout: TrainingRanks, rank: int) -> tuple[object | None, object | None]:
    """``rank``'s tensor-parallel and data-parallel process groups under ``layout``; (None, None)
    without tensor parallelism, where DDP and the hook use the default group (every rank). Every
    rank must call it, in the same order: ``dist.new_group`` creates each group on all ranks."""
    if layout.tensor == 1:
        return None, None
    tensor = data = None
    for first in range(0, len(layout.ranks), layout.tensor):
        group = dist.new_group(list(layout.tensor_group(first)))
        if rank in layout.tensor_group(first):
            tensor = group
    for index in range(layout.tensor):
        group = dist.new_group(list(layout.data_group(index)))
        if rank in layout.data_group(index):
            data = group
    return tensor, data


class Trainer:
    """Rank ``rank`` of ``setup.layout`` training with DDP (the default process group must be up
    over every rank of the layout).

    Args:
        host_groups: ``group -> group partitioned by host`` (``Topology.host_groups``).
        seed: of the weights and of every step's batch.
        groups: ``rank``'s (tensor-parallel, data-parallel) process groups
            (:func:`process_groups`, made here when None: every rank must then build its
            trainers in the same order).
    """

    def __init__(self, setup: TrainingSetup, rank: int, host_groups, *, seed: int,
                 device: torch.device | str = "cpu", groups: tuple[object | None, object | None] | None = None):
        self.setup, self.rank, self.seed = setup, rank, seed
        self.device = device_of(device)
        self.host_groups = host_groups
        layout = setup.layout
        self.data_group = layout.data_group(rank)
        tensor_group, self.process_group = groups if groups is not None else process_groups(layout, rank)
        s = setup.settings
        tensor_parallel = None
        if layout.tensor > 1:
            shard = tensor_shards(setup.spec, layout.tensor)[rank % layout.tensor]
            tensor_parallel = TensorParallel(shard, tensor_group)
        model = DecoderLM(setup.spec, seed, s.activation_checkpointing, tensor_parallel).to(self.device.torch_device)
        cuda = self.device.torch_device.type == "cuda"
        self.ddp = DistributedDataParallel(
            model, device_ids=[self.device.torch_device] if cuda else None,
            bucket_cap_mb_list=[min(s.first_bucket_mb, s.bucket_cap_mb), s.bucket_cap_mb],
            gradient_as_bucket_view=s.gradient_as_bucket_view, process_group=self.process_group)
        self.hook = BucketAllreduce(self.data_group, rank, s.allreduce, host_groups, s.gradient_compression,
                                    s.overlap, average=s.averaging is Averaging.GRADIENTS,
                                    process_group=self.process_group)
        self.ddp.register_comm_hook(None, self.hook.comm_hook)
        # After DDP's broadcast of the parameters from rank 0, so every rank copies the same.
        self.copies = bf16_copies(model, s.precision)
        self.optimizer = make_optimizer(list(self.ddp.parameters()), s, zero=s.zero == 1,
                                        process_group=self.process_group)

    def close(self) -> None:
        """Stop the comm hook's thread."""
        self.hook.close()

    def rows(self, step: int) -> torch.LongTensor:
        """This rank's rows of step ``step``'s global batch, ``[rank_rows, sequence_length + 1]``."""
        w, setup = self.setup.workload, self.setup
        batch = training_batch(setup.spec, w.global_batch_size, w.sequence_length, self.seed, step)
        # The data-parallel replica's index: its tensor-parallel ranks train on the same rows.
        index = setup.group.index(self.rank - self.rank % setup.tensor)
        return batch[index * setup.rank_rows:(index + 1) * setup.rank_rows]

    def step(self, step: int) -> StepTiming:
        """One optimizer step on step ``step``'s batch; returns its timings."""
        setup, s = self.setup, self.setup.settings
        rows = self.rows(step).to(self.device.torch_device)
        m, k = setup.micro_batch_size, setup.accumulation
        self.hook.take_calls()
        timing = StepTiming(step, self._now())
        for j in range(k):
            micro = rows[j * m:(j + 1) * m]
            local = s.no_sync and j < k - 1
            with self.ddp.no_sync() if local else nullcontext():
                start = self._now()
                with autocast(s.precision, self.device.torch_device):
                    loss = next_token_loss(self.ddp(micro[:, :-1]), micro[:, 1:]) / k
                middle = self._now()
                loss.backward()
                end = self._now()
            timing.forward.append((start, middle))
            timing.backward.append((middle, end))
        start = self._now()
        self.optimizer.step()
        self.optimizer.zero_grad()
        refresh(self.copies)
        timing.optimizer = (start, self._now())
        if setup.averages_after(step):
            start = self._now()
            average_parameters(list(self.ddp.parameters()), self.data_group, self.rank, s.allreduce, self.host_groups,
                               process_group=self.process_group)
            refresh(self.copies)
            timing.averaging = (start, self._now())
        timing.end_s = timing.averaging[1] if timing.averaging else timing.optimizer[1]
        timing.buckets = self.hook.take_calls()
        return timing

    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter, by name (the module's, without DDP's prefix; the fp32
        masters under ``bf16_mixed``)."""
        return {name: p.detach().cpu().clone() for name, p in self.ddp.module.named_parameters()}

    def _now(self) -> float:
        self.device.synchronize()
        return time.perf_counter()
