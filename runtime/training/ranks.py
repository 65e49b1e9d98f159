"""Which devices train: the data-parallel group of a training scenario (no torch here, so the
memory check of ``hetsim measure`` can ask before torch is imported)."""

from models.errors import ConfigError


def data_parallel_ranks(scenario, topology) -> tuple[int, ...]:
    """The ranks of a training scenario's data-parallel group: the first ``parallel.data`` devices
    (default: every device, as the simulator's :class:`sim.parallel.ParallelPlan` defaults it).

    Raises:
        ConfigError: on ``parallel.tensor`` above 1 (the runtime trains data-parallel only), or on
            ``parallel.data`` beyond the cluster's devices.
    """
    tensor = scenario.config.parallel.tensor or 1
    data = scenario.config.parallel.data or len(topology.devices) // tensor
    if tensor != 1:
        raise ConfigError("parallel.tensor", f"the training runtime runs data parallelism only (tensor 1) (got {tensor})")
    if data > len(topology.devices):
        raise ConfigError("parallel.data", f"exceeds the cluster's {len(topology.devices)} devices (got {data})")
    return tuple(range(data))
