"""Whether a scenario's ranks fit in memory, checked before any weight is allocated.

A measurement builds every rank's weights, KV cache and buffers in this machine's memory. Started
on a plan that cannot fit, it ran to the end on devices too small for it (GPT-2 on 100 MB
devices reported a 586 MB peak) or allocated until the machine ran out (Llama-2-70B on two 4 GiB
ranks, 69 GB per rank). So the plan is simulated first (no torch, a few milliseconds) and its
per-rank peak (:attr:`sim.timeline.RunResult.peak_bytes`, the memory ledger of :mod:`sim.memory`,
the highest over the scenario's variants) is compared with

- each device's capacity (:attr:`sim.topology.Device.memory_capacity_bytes`): the ranks run on
  this machine's CPU, so going past it only emulates the device wrongly, and ``allow_overcommit``
  lets it through;
- this machine's available memory (``MemAvailable`` of ``/proc/meminfo``, see ``man 5 proc``) for
  all ranks together, which nothing overrides: past it the kernel kills a rank or swaps.
"""

from __future__ import annotations

from pathlib import Path

from models.errors import ConfigError
from sim.scenario import Scenario

MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """This machine's available memory (``MemAvailable``, reported in kB = 1024 bytes), or None
    where the kernel does not report it."""
    try:
        for line in meminfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _mb(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:,.0f} MB"


def check_memory_fits(scenario: Scenario, *, allow_overcommit: bool = False,
                      available_bytes: int | None = None) -> None:
    """Refuse ``scenario`` when a rank's simulated peak exceeds its device's capacity (unless
    ``allow_overcommit``) or all ranks' peaks together exceed ``available_bytes`` (default: this
    machine's ``MemAvailable``; unchecked where unknown).

    Raises:
        ConfigError: naming the device (``device h0.d0: the plan needs 586 MB at peak ...``) or
            this machine, with both numbers; also any error simulating the scenario raises.
    """
    if scenario.config.is_training:
        topology, ranks, peaks = _training_peaks(scenario)
    else:
        from sim.simulate import simulate

        result = simulate(scenario, expand_steps=())
        topology, ranks = result.topology, result.ranks
        peaks = {rank: max((vr.peak_bytes[rank], vr.variant.name) for vr in result.variants) for rank in ranks}
    if not allow_overcommit:
        for rank, (peak_bytes, variant) in peaks.items():
            device = topology.devices[rank]
            if peak_bytes > device.memory_capacity_bytes:
                raise ConfigError(f"device {device.name}", f"the plan needs {_mb(peak_bytes)} at peak (variant "
                                  f"{variant}), the device holds {_mb(device.memory_capacity_bytes)}; "
                                  "--allow-overcommit runs it anyway on this machine's CPU")
    available = available_memory_bytes() if available_bytes is None else available_bytes
    total_bytes = sum(peak for peak, _ in peaks.values())
    if available is not None and total_bytes > available:
        raise ConfigError("machine", f"the plan's {len(ranks)} ranks need {_mb(total_bytes)} at peak together, "
                                     f"this machine has {_mb(available)} available (MemAvailable)")


def _training_peaks(scenario: Scenario):
    """Topology, the layout's ranks and each rank's largest model-state and activation bytes over
    the variants (:func:`models.training.training_memory`; the runtime keeps fp32 parameters under
    autocast, so they are counted in fp32, and the embeddings and LM head on every
    tensor-parallel rank)."""
    from models.training import ActivationLayout, Precision, training_memory
    from runtime.training.ranks import training_ranks
    from sim.topology import build_topology
    from sim.training_config import micro_batching

    topology = build_topology(scenario.config.cluster)
    layout = training_ranks(scenario, topology)
    ranks = layout.ranks
    workload = scenario.config.workload
    peaks = {}
    for variant in scenario.config.variants:
        settings = scenario.training_settings(variant)
        micro, accumulation = micro_batching(workload, settings, layout.data)
        memory = training_memory(scenario.model.with_dtype("fp32"),
                                 ActivationLayout(micro, workload.sequence_length, layout.tensor),
                                 optimizer=settings.optimizer, precision=Precision.FP32, data_parallel=layout.data,
                                 zero_stage=settings.zero, gradient_as_bucket_view=settings.gradient_as_bucket_view,
                                 checkpoint_every=settings.activation_checkpointing, accumulation=accumulation)
        for rank in ranks:
            peaks[rank] = max(peaks.get(rank, (0, "")), (memory.total, variant.name))
    return topology, ranks, peaks
