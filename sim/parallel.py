"""The parallel plan: how many ways a model is split, and which device runs which rank.

A :class:`ParallelPlan` is validated data: the degrees (tensor and data; pipeline is a field
already, held at 1 until that parallelism lands) and the placement of the tensor-parallel ranks
on the topology's devices. Data parallelism replicates the tensor-parallel group: replica d runs
on the next ``tensor`` devices (TP inside a host, DP across hosts when a host holds ``tensor``
devices). The simulator and the runtime both take their ranks from it, so the
runtime never asks the orchestrator (:mod:`sim.simulate`) where its ranks are.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.accounting import check_tensor_parallel
from models.errors import ConfigError
from models.spec import ModelSpec


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees and placement of one run of ``model`` on a cluster whose devices are ``devices``
    (their names, in topology rank order).

    Attributes:
        tensor: tensor-parallel degree (Megatron-LM, arXiv 1909.08053): ranks sharing each layer.
        data: data-parallel degree (training): replicas of the tensor-parallel group, replica d
            on devices ``d * tensor .. (d + 1) * tensor - 1``.
        pipeline: pipeline-parallel degree; must be 1 for now.
        placement: the topology rank (index into ``devices``) of each tensor-parallel rank, the
            first one the master; default: the first ``tensor`` devices.

    Raises:
        ConfigError: on ``parallel.*``: a degree below 1, a pipeline degree other than 1, a data
            degree above 1 with a placement of its own,
            degrees whose product exceeds the devices, a tensor degree that cannot shard the model
            (:func:`models.accounting.check_tensor_parallel`), a placement of the wrong length, on
            a device that does not exist, or twice on one device. Messages name every degree and
            the devices involved.
    """

    model: ModelSpec
    devices: tuple[str, ...]
    tensor: int
    data: int = 1
    pipeline: int = 1
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        degrees = f"tensor {self.tensor} x data {self.data} x pipeline {self.pipeline}"
        for name in ("tensor", "data", "pipeline"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name}", f"must be a positive integer ({degrees}) (got {value!r})")
        if self.pipeline != 1:
            raise ConfigError("parallel.pipeline", f"only 1 is supported so far ({degrees}) (got {self.pipeline})")
        if self.data > 1 and self.placement is not None:
            raise ConfigError("parallel.placement", f"data parallelism places replica d on the devices "
                                                    f"d * tensor .. (d + 1) * tensor - 1 ({degrees}) "
                                                    f"(got {self.placement})")
        needed = self.tensor * self.data * self.pipeline
        if needed > len(self.devices):
            raise ConfigError("parallel.tensor", f"{degrees} = {needed} ranks exceed the cluster's "
                                                 f"{len(self.devices)} devices ({', '.join(self.devices)}) "
                                                 f"(got {self.tensor})")
        check_tensor_parallel(self.model, self.tensor)
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

    @property
    def tensor_ranks(self) -> tuple[int, ...]:
        """The topology ranks of the tensor-parallel group, in group order (the first is the master)."""
        return self.placement

    @property
    def replica_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The topology ranks of each data-parallel replica's tensor-parallel group (its master first)."""
        return tuple(tuple(d * self.tensor + rank for rank in self.placement) for d in range(self.data))

    @classmethod
    def of(cls, scenario, topology) -> ParallelPlan:
        """The plan a scenario (:class:`sim.scenario.Scenario`) asks for on ``topology``
        (:class:`sim.topology.Topology`): ``parallel.tensor``, default every device.

        Raises:
            ConfigError: see the class.
        """
        devices = tuple(d.name for d in topology.devices)
        if scenario.config.is_training:
            return cls._of_training(scenario, devices)
        written = scenario.config.parallel.tensor
        try:
            return cls(scenario.model, devices, written or len(devices))
        except ConfigError as error:
            if written is not None or not error.field.startswith("parallel."):
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
