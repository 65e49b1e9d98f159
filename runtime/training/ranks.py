"""Which devices train, and in which groups: the ranks of a training scenario (no torch here, so
the memory check of ``hetsim measure`` can ask before torch is imported)."""

from dataclasses import dataclass

from models.errors import ConfigError
from models.shards import check_tensor_parallel


@dataclass(frozen=True)
class TrainingRanks:
    """``tensor`` x ``data`` ranks laid out as :class:`sim.parallel.ParallelPlan` lays out a
    training plan: data-parallel replica d on ranks ``d * tensor .. (d + 1) * tensor - 1`` (its
    tensor-parallel group, consecutive ranks, so inside a host where the hosts' devices are
    consecutive), so rank r has tensor-parallel index ``r % tensor`` and data-parallel index
    ``r // tensor``; the ranks of one tensor index form a data-parallel group."""

    tensor: int
    data: int

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, 0 .. tensor x data - 1."""
        return tuple(range(self.tensor * self.data))

    def data_group(self, rank: int = 0) -> tuple[int, ...]:
        """The data-parallel group of ``rank``: the ranks of its tensor index, one per replica."""
        return tuple(range(rank % self.tensor, self.tensor * self.data, self.tensor))

    def tensor_group(self, rank: int) -> tuple[int, ...]:
        """The tensor-parallel group of ``rank``: its replica's ranks."""
        first = rank - rank % self.tensor
        return tuple(range(first, first + self.tensor))


def training_ranks(scenario, topology) -> TrainingRanks:
    """The layout of a training scenario on the runtime: ``parallel.tensor`` (default 1) and
    ``parallel.data`` (default: the devices // tensor), as :class:`sim.parallel.ParallelPlan`
    defaults them, on the first tensor x data devices.

    Raises:
        ConfigError: on ``parallel.data`` or ``parallel.tensor`` for more ranks than the cluster's
            devices; on ``parallel.tensor`` for a degree that does not split the attention heads,
            the MLP columns and the key-value heads evenly (the runtime trains whole KV-head
            groups per rank: a replicated KV head would get a different gradient on each replica).
    """
    tensor = scenario.config.parallel.tensor or 1
    data = scenario.config.parallel.data or len(topology.devices) // tensor
    if tensor * data > len(topology.devices) or data < 1:
        field = "parallel.data" if scenario.config.parallel.data else "parallel.tensor"
        raise ConfigError(field, f"tensor {tensor} x data {data} exceeds the cluster's {len(topology.devices)} "
                                 f"devices (got {scenario.config.parallel.data if field == 'parallel.data' else tensor})")
    if tensor > 1:
        check_tensor_parallel(scenario.model, tensor)
        if scenario.model.num_kv_heads % tensor:
            raise ConfigError("parallel.tensor", f"the training runtime splits whole key-value heads: the degree must "
                                                 f"divide the {scenario.model.num_kv_heads} KV heads (got {tensor})")
    return TrainingRanks(tensor, data)

