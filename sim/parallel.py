"""The parallel plan: how many ways a model is split, and which device runs which rank.

A :class:`ParallelPlan` is validated data: the degrees (tensor and data; pipeline is a field
already, held at 1 until that parallelism lands), the placement of the tensor-parallel ranks
on the topology's devices and, for an uneven tensor-parallel split, each rank's share of the heads
and MLP columns (:mod:`models.shards`). Data parallelism (training) and inference replicas both
copy the tensor-parallel group: copy d runs on the next ``tensor`` devices (TP inside a host, DP
across hosts when a host holds ``tensor`` devices). The simulator and the runtime both take their ranks from
it, so the runtime never asks the orchestrator (:mod:`sim.simulate`) where its ranks are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from models.errors import ConfigError
from models.shards import TensorShard, tensor_shards
from models.spec import ModelSpec


class ShareBasis(StrEnum):
    """What a device's share of an uneven tensor-parallel split follows (``parallel.shares``):
    its dense peak FLOP/s in the scenario's dtype (prefill-heavy work), or its memory capacity
    (a model that barely fits)."""

    COMPUTE = "compute"
    MEMORY = "memory"


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees and placement of one run of ``model`` on a cluster whose devices are ``devices``
    (their names, in topology rank order).

    Attributes:
        tensor: tensor-parallel degree (Megatron-LM, arXiv 1909.08053): ranks sharing each layer.
        data: data-parallel degree (training): copies of the tensor-parallel group, copy d on
            devices ``d * tensor .. (d + 1) * tensor - 1``.
        pipeline: pipeline-parallel degree; must be 1 for now.
        placement: the topology rank (index into ``devices``) of each tensor-parallel rank, the
            first one the master; default: the first ``tensor`` devices.
        shares: one positive weight per tensor-parallel rank, in group order (the same for every
            replica), or one per placed device, replica after replica: the split of heads and MLP
            columns follows them (:func:`models.shards.tensor_shards`); None: even.
        replicas: copies of the tensor-parallel group, each serving its part of the requests;
            replica i runs on the placement shifted by ``i * tensor`` devices (the default
            placement: consecutive blocks of ``tensor`` devices).

    Raises:
        ConfigError: on ``parallel.*``: a degree below 1, a pipeline degree other than 1, a data
            degree above 1 with a placement of its own,
            degrees whose product exceeds the devices, a tensor degree that cannot shard the model
            (:func:`models.shards.tensor_shards`), a placement of the wrong length, on a device
            that does not exist, or twice on one device; on ``parallel.shares``, weights that do
            not fit the degree. Messages name every degree and the devices involved.
    """

    model: ModelSpec
    devices: tuple[str, ...]
    tensor: int
    data: int = 1
    pipeline: int = 1
    placement: tuple[int, ...] | None = None
    shares: tuple[float, ...] | None = None
    replicas: int = 1
    _shards: tuple[tuple[TensorShard, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        degrees = f"tensor {self.tensor} x data {self.data} x pipeline {self.pipeline}"
        if self.replicas != 1:
            degrees += f" x replicas {self.replicas}"
        for name in ("tensor", "data", "pipeline", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name}", f"must be a positive integer ({degrees}) (got {value!r})")
        if self.pipeline != 1:
            raise ConfigError("parallel.pipeline", f"only 1 is supported so far ({degrees}) (got {self.pipeline})")
        if self.data > 1 and self.placement is not None:
            raise ConfigError("parallel.placement", f"data parallelism places replica d on the devices "
                                                    f"d * tensor .. (d + 1) * tensor - 1 ({degrees}) "
                                                    f"(got {self.placement})")
        needed = self.tensor * self.data * self.pipeline * self.replicas
        if needed > len(self.devices):
            field_name = "parallel.replicas" if self.replicas > 1 else "parallel.tensor"
            raise ConfigError(field_name, f"{degrees} = {needed} ranks exceed the cluster's "
                                          f"{len(self.devices)} devices ({', '.join(self.devices)}) "
                                          f"(got {getattr(self, field_name.split('.')[1])})")
        shares = self.shares
        if shares is not None and len(shares) == self.tensor * self.replicas and self.replicas > 1:
            per_replica = [shares[i * self.tensor:(i + 1) * self.tensor] for i in range(self.replicas)]
        else:
            per_replica = [shares] * self.replicas
        object.__setattr__(self, "_shards", tuple(tensor_shards(self.model, self.tensor, w) for w in per_replica))
        placement = tuple(range(self.tensor)) if self.placement is None else tuple(self.placement)
        if len(placement) != self.tensor:
            raise ConfigError("parallel.placement", f"must place each of the {degrees} ranks on a device "
                                                    f"(got {len(placement)} placements)")
        for rank, device in enumerate(placement):
            if not 0 <= device < len(self.devices):
                raise ConfigError("parallel.placement", f"tensor-parallel rank {rank} on device {device}, but the "
                                                        f"cluster has devices 0..{len(self.devices) - 1} "
                                                        f"({', '.join(self.devices)}) (got {device})")
            if placement.index(device) != rank:
                raise ConfigError("parallel.placement", f"tensor-parallel ranks {placement.index(device)} and "
                                                        f"{rank} both on device {self.devices[device]} (got {device})")
        object.__setattr__(self, "placement", placement)
        used = [rank for ranks in self.replica_ranks for rank in ranks]
        for rank in used:
            if not 0 <= rank < len(self.devices) or used.count(rank) > 1:
                raise ConfigError("parallel.replicas", f"the {self.replicas} replicas of the placement "
                                                       f"{placement} overlap or leave the cluster's "
                                                       f"{len(self.devices)} devices (got {self.replicas})")

    @property
    def tensor_ranks(self) -> tuple[int, ...]:
        """The topology ranks of the (first replica's) tensor-parallel group, in group order (the
        first is the master)."""
        return self.placement

    @property
    def shards(self) -> tuple[TensorShard, ...] | None:
        """Each tensor-parallel rank's slice of the layers (the first replica's), in group order,
        when ``shares`` makes the split uneven; None for the even split (every rank alike)."""
        return self.replica_shards[0]

    @property
    def replica_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The tensor-parallel group of each copy (an inference replica, or a data-parallel
        replica in training), its master first: the placement shifted by ``i * tensor``."""
        copies = self.replicas * self.data
        return tuple(tuple(p + i * self.tensor for p in self.placement) for i in range(copies))

    @property
    def replica_shards(self) -> tuple[tuple[TensorShard, ...] | None, ...]:
        """Each replica's :attr:`shards` (None for an even split)."""
        return tuple(None if self.shares is None else s for s in self._shards)

    @property
    def idle_devices(self) -> tuple[str, ...]:
        """The devices no replica uses, in topology order: what the layout leaves unused."""
        used = {rank for ranks in self.replica_ranks for rank in ranks}
        return tuple(name for rank, name in enumerate(self.devices) if rank not in used)

    @classmethod
    def of(cls, scenario, topology) -> ParallelPlan:
        """The plan a scenario (:class:`sim.scenario.Scenario`) asks for on ``topology``
        (:class:`sim.topology.Topology`): ``parallel.replicas`` (default 1) of
        ``parallel.tensor`` (default every device, divided among the replicas);
        ``parallel.shares`` resolved to weights (a :class:`ShareBasis` read from each placed
        device, or the weights written).

        Raises:
            ConfigError: see the class; on ``dtype`` for ``shares: compute`` on a device without it.
        """
        devices = tuple(d.name for d in topology.devices)
        if scenario.config.is_training:
            return cls._of_training(scenario, devices)
        written = scenario.config.parallel.tensor
        replicas = scenario.config.parallel.replicas
        degree = written or max(1, len(devices) // replicas)
        shares = scenario.config.parallel.shares
        placed = topology.devices[:degree * replicas]
        if shares == ShareBasis.COMPUTE:
            shares = tuple(d.spec.peak_flops(scenario.model.dtype) for d in placed)
        elif shares == ShareBasis.MEMORY:
            shares = tuple(float(d.memory_capacity_bytes) for d in placed)
        try:
            return cls(scenario.model, devices, degree, shares=shares, replicas=replicas)
        except ConfigError as error:
            if written is not None or error.field != "parallel.tensor":
                raise
            # The degree came from the device count: name what the user wrote.
            raise ConfigError("cluster", f"the cluster's {len(devices)} devices are the default tensor-parallel "
                                         f"degree: {error.message}; set parallel.tensor") from None

    @classmethod
    def _of_training(cls, scenario, devices: tuple[str, ...]) -> ParallelPlan:
        """A training scenario's plan: ``parallel.tensor`` (default 1) and ``parallel.data``
        (default: the devices // tensor)."""
        tensor = scenario.config.parallel.tensor or 1
        data = scenario.config.parallel.data
        if data is None:
            data = len(devices) // tensor
            if data < 1:
                raise ConfigError("parallel.tensor", f"exceeds the cluster's {len(devices)} devices "
                                                     f"({', '.join(devices)}) (got {tensor})")
        return cls(scenario.model, devices, tensor, data)
