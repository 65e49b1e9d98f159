"""One rank's compute device, CPU or CUDA, behind one interface.

Everything the runtime does differently on a GPU lives here: the process group's backend (gloo on
the CPU, NCCL on CUDA, as ``torch.distributed`` recommends), waiting for queued work, memory
readings (the CPU's resident set size, :mod:`runtime.memory_probe`, against the CUDA caching
allocator's exact counters) and copying host buffers onto the device. Callers hold a
:class:`Device` (:func:`device_of`, :func:`local_device`) instead of branching on the device type.
"""

from __future__ import annotations

import torch

from runtime import memory_probe


class Device:
    """The CPU: work is done when the call returns; memory is the process's resident set size."""

    backend = "gloo"

    def __init__(self, torch_device: torch.device | str = "cpu"):
        self.torch_device = torch.device(torch_device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device})"

    def make_current(self) -> None:
        """Make this the calling process's default device (before the process group starts)."""

    def synchronize(self) -> None:
        """Wait for all work queued on the device (every stream)."""

    def synchronize_stream(self) -> None:
        """Wait for the work the calling thread queued on its current stream only (while weights
        are streamed, a device-wide wait would also wait for the loader's copies and hide the
        overlap being measured)."""

    def reset_peak_memory(self) -> bool:
        """Start a new peak for :meth:`peak_memory_bytes`; False where the platform cannot
        (:func:`runtime.memory_probe.reset_peak`)."""
        return memory_probe.reset_peak()

    def memory_bytes(self) -> int:
        """Device memory in use now (bytes): RSS of this process (:func:`runtime.memory_probe.current_bytes`)."""
        return memory_probe.current_bytes()

    def peak_memory_bytes(self) -> int:
        """High-water mark since :meth:`reset_peak_memory` (bytes): peak RSS (:func:`runtime.memory_probe.peak_bytes`)."""
        return memory_probe.peak_bytes()

    def staging(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes to read into before :meth:`to_device` (page-locked on
        CUDA, so the copy can run asynchronously)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def uses_staging(self) -> bool:
        """Whether host reads go through :meth:`staging` and :meth:`to_device` (False: the host
        buffer is the device buffer)."""
        return False

    def to_device(self, staging: torch.Tensor, nbytes: int) -> torch.Tensor:
        """A device copy of the first ``nbytes`` of ``staging``, complete when this returns (so
        ``staging`` may be reused at once)."""
        return staging[:nbytes].clone()


class CudaDevice(Device):
    """A CUDA GPU: NCCL, stream synchronisation, the caching allocator's exact counters, and
    host-to-device copies on a stream of their own from a pinned buffer."""

    backend = "nccl"

    def __init__(self, torch_device: torch.device | str):
        super().__init__(torch_device)
        self._copy_stream: torch.cuda.Stream | None = None

    def make_current(self) -> None:
        torch.cuda.set_device(self.torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def synchronize_stream(self) -> None:
        torch.cuda.current_stream(self.torch_device).synchronize()

    def reset_peak_memory(self) -> bool:
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        return True

    def memory_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device)

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)

    def staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def uses_staging(self) -> bool:
        return True

    def to_device(self, staging: torch.Tensor, nbytes: int) -> torch.Tensor:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.torch_device)
        with torch.cuda.stream(self._copy_stream):
            # Allocated on the copy stream; the compute stream frees it only after a stream
            # synchronisation (the executor syncs after every op), so no copy can overwrite it early.
            on_device = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
            on_device.copy_(staging[:nbytes], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()
        return on_device


def device_of(torch_device: torch.device | str) -> Device:
    """The :class:`Device` of a torch device (``cpu`` or ``cuda:N``).

    Raises:
        ValueError: another device type.
    """
    torch_device = torch.device(torch_device)
    if torch_device.type == "cpu":
        return Device(torch_device)
    if torch_device.type == "cuda":
        return CudaDevice(torch_device)
    raise ValueError(f"the runtime runs on cpu or cuda devices (got {torch_device})")


def local_device(local_rank: int) -> Device:
    """The device of the process with ``local_rank`` on its host: GPU ``local_rank`` where CUDA is
    available (one GPU per local rank), else the CPU."""
    return device_of(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
