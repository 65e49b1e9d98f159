"""The framework's own memory on each device before any weight: the documented default baselines.

A rank holds more than its model: the framework, the communication library's buffers, the
kernels' workspaces. A calibration profile measures it (``memory_baseline`` rows, see
:mod:`sim.profile`); without one the simulator charges the default of the device's backend, so
that an out-of-memory verdict is the one a framework run would meet:

* **gloo on CPU** (a CPU device, torch.distributed over gloo): 268 MB, the median (267.7 MB) of the
  ``memory_baseline`` rows of the shipped profiles (``validation/*/profiles/*.csv``: 259-284 MB
  over eleven calibrations, torch 2.13.0, peak resident set of an untimed generation less the
  model's weights and KV cache): the interpreter, torch's libraries and gloo's buffers.
* **NCCL on CUDA** (any GPU): the CUDA context, 500 MiB (created by the first CUDA call; 723 MiB
  measured on a V100-era driver before lazy module loading, https://discuss.pytorch.org/t/73021;
  lazy loading, default since CUDA 11.7 and set by PyTorch, loads only the kernels used: CUDA C++
  Programming Guide, "Lazy Loading"), plus cuBLAS's workspace, 32 MiB (cuBLAS documentation,
  ``cublasSetWorkspace``: 32 MiB recommended on Hopper, 4 MiB before; taken at the larger), plus
  NCCL's buffers, 128 MiB (``NCCL_BUFFSIZE``, 4 MiB by default, per channel and ring neighbour:
  16 channels x 2 neighbours; NCCL documentation, Environment Variables). A group of one rank
  creates no communicator, so it holds no NCCL buffers.

:func:`framework_memory` is the one definition every caller charges (the inference and training
simulators through :func:`sim.simulate.build_pricing`, the planner's memory stages): the profile's
``memory_baseline`` median of the device's class where a profile has one, else the default above.

The caching allocator's rounding (blocks of 512 bytes, segments of 2 MiB, PyTorch
``c10/cuda/CUDACachingAllocator.cpp``) is not charged: the ledger counts live tensors, as
``torch.cuda.max_memory_allocated`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from sim.devices import DeviceSpec
from sim.vocabulary import MeasurementKind

if TYPE_CHECKING:
    from sim.profile import Profile

_MIB = 2**20


class Backend(StrEnum):
    """The framework and communication backend a device runs under by default."""

    GLOO = "gloo"  # torch on CPU, torch.distributed over gloo
    NCCL = "nccl"  # torch on CUDA, torch.distributed over NCCL


@dataclass(frozen=True)
class FrameworkBaseline:
    """Bytes a rank holds before its model: ``framework_bytes`` always, ``communication_bytes``
    when its group has more than one rank; ``source`` says where the numbers come from."""

    framework_bytes: int
    communication_bytes: int
    source: str

    def bytes_for(self, group_size: int) -> int:
        """The baseline of a rank in a group of ``group_size`` ranks (bytes)."""
        return self.framework_bytes + (self.communication_bytes if group_size > 1 else 0)


BASELINES: dict[Backend, FrameworkBaseline] = {
    Backend.GLOO: FrameworkBaseline(268_000_000, 0, "gloo on CPU: median of the shipped profiles' memory_baseline"),
    Backend.NCCL: FrameworkBaseline(500 * _MIB + 32 * _MIB, 128 * _MIB,
                                    "CUDA context 500 MiB + cuBLAS workspace 32 MiB + NCCL buffers 128 MiB"),
}
"""The default baseline of each backend (the module docstring gives the sources)."""


def backend_of(spec: DeviceSpec) -> Backend:
    """The backend a device runs under: gloo for a CPU, NCCL for a GPU."""
    return Backend.GLOO if spec.name == "cpu" else Backend.NCCL


def default_runtime_memory(specs: dict[int, DeviceSpec]) -> dict[int, int]:
    """Per rank (``specs``: the device of each rank of one group), the default baseline in bytes."""
    return {rank: BASELINES[backend_of(spec)].bytes_for(len(specs)) for rank, spec in specs.items()}


def framework_memory(specs: dict[int, DeviceSpec], profile: Profile | None = None) -> dict[int, int]:
    """Per rank (``specs``: the device of each rank of one group), the framework baseline in bytes:
    the median of ``profile``'s ``memory_baseline`` rows of the rank's device class (what the
    calibration measured a rank to hold beyond its tensors), else :func:`default_runtime_memory`."""
    default = default_runtime_memory(specs)
    if profile is None:
        return default
    baseline = profile.of(MeasurementKind.MEMORY_BASELINE).groupby("device_class")["median"].median()
    return {rank: int(baseline.get(spec.name, default[rank])) for rank, spec in specs.items()}
