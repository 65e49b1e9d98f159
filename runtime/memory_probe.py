"""Per-process memory readings a rank reports: now and peak since a reset, in bytes.

The simulator prices a rank's memory as a constant framework baseline plus the bytes of its live
tensors (weights, KV cache, activations and workspace). On CUDA the caching allocator counts
exactly the tensor bytes (``torch.cuda.memory_allocated`` / ``max_memory_allocated``, read by
:class:`runtime.device.CudaDevice`). On the CPU
there is no such counter, so this module reads the resident set size (RSS) of the process from
Linux's ``/proc`` and makes it follow the live tensors:

* :func:`configure_allocator` tunes glibc malloc (mallopt(3)). In the *exact* mode every block of
  at least :data:`EXACT_MMAP_THRESHOLD_BYTES` is an ``mmap`` of its own and goes back to the
  kernel when freed, so RSS is the baseline plus the live blocks, and a peak read over weights
  loaded and freed block by block is the true one. That holds in a heap with no free chunk such
  a block fits in: glibc carves a request from a free chunk first and maps it afresh only when no
  bin and not the top of the heap can serve it (``_int_malloc`` and ``sysmalloc`` in glibc's
  ``malloc/malloc.c``, the threshold applying in the latter), and the pages :func:`reset_peak`
  gave back of such chunks count again as the step reuses them, chunk after chunk. The fast
  mode's runs leave exactly such chunks; a training step read in the exact mode after them
  peaked 2.5-31 MB above its live tensors (:mod:`runtime.training.memory`, which therefore reads
  it before any fast-mode step). That costs an mmap, munmap and a page fault
  per page for every such tensor: prefill ops run 5-30 % slower (GPT-2 on this machine). So
  timed generations run in the *fast* mode (a fixed threshold of :data:`FAST_MMAP_THRESHOLD_BYTES`:
  activations below it stay in the heap for reuse, weight-sized blocks above it still go back to
  the kernel, so streamed weight blocks freed during timed runs do not stay in the heap and
  inflate the next reading), and the memory is read in one more, untimed generation under
  :func:`exact_allocation`. Both modes fix the threshold (a value set with mallopt turns glibc's
  dynamic threshold off, which otherwise depends on the largest block freed so far) and cap the
  malloc arenas at :data:`ARENA_MAX`, so threads started later (gloo's) do not grow arenas of
  their own.
* :func:`reset_peak` frees what is garbage, gives free malloc pages back (``malloc_trim``) and
  resets the kernel's RSS high-water mark (``VmHWM``) to the current RSS by writing ``5`` to
  ``/proc/self/clear_refs`` (proc(5), Linux 4.0 or newer), so a peak read after a generation
  excludes model building and earlier transients. ``ru_maxrss`` (getrusage(2)) cannot be reset.
* :func:`current_bytes` is RSS now (``/proc/self/statm`` resident pages x page size) and
  :func:`peak_bytes` is ``VmHWM`` of ``/proc/self/status`` (kB, x 1024), the largest RSS since
  the last reset. Both count every resident page of the process: anonymous memory (tensors, the
  Python heap, communication buffers) and the pages of shared libraries it has touched. Pages
  inherited copy-on-write from the parent at fork count too, so the baseline includes the
  parent's memory at the fork (``import torch``: about 250 MB).

Where ``/proc`` or glibc's ``mallopt`` is missing (macOS, musl), the calls degrade instead of
failing: :func:`configure_allocator` and :func:`reset_peak` return False, and :func:`peak_bytes`
falls back to ``ru_maxrss`` (the peak since the process started).
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import sys
from contextlib import contextmanager
from typing import Iterator

EXACT_MMAP_THRESHOLD_BYTES = 64 * 1024
"""Exact mode: blocks of this size or larger get an mmap of their own, returned on free."""
FAST_MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
"""Fast mode: the same, for blocks of 4 MiB or more; smaller freed blocks stay in the heap and are
reused. With glibc's ceiling (32 MiB) instead, weight blocks streamed and freed during the timed
runs stayed in the heap: the streamed peak read 6% high on a 111M model (20 MB of 358 MB); at
4 MiB it matches the resident run's baseline plus the window's blocks to 0.1 MB."""
ARENA_MAX = 2
"""malloc arenas at most: threads that first allocate after :func:`configure_allocator` share
them instead of each growing an arena of its own."""

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def _libc():
    """The C library this process runs on, or None where it has no ``mallopt`` (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def configure_allocator(exact: bool = False) -> bool:
    """Set glibc malloc's mode for this process (``mallopt``, see mallopt(3)); call again to switch.

    Call once per worker process, right after fork and before the model is built. Sets
    ``M_MMAP_THRESHOLD`` to :data:`EXACT_MMAP_THRESHOLD_BYTES` (``exact``) or
    :data:`FAST_MMAP_THRESHOLD_BYTES`, ``M_TRIM_THRESHOLD`` to twice that (free memory at the top
    of the heap beyond it goes back at once) and ``M_ARENA_MAX`` to :data:`ARENA_MAX`, then
    ``malloc_trim(0)`` gives back what is free already. Arenas that threads already hold stay.

    Returns:
        True if every setting was applied; False (nothing raised, nothing changed) without glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    threshold = EXACT_MMAP_THRESHOLD_BYTES if exact else FAST_MMAP_THRESHOLD_BYTES
    applied = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, 2 * threshold), (_M_ARENA_MAX, ARENA_MAX)))
    _trim(libc)
    return applied


@contextmanager
def exact_allocation() -> Iterator[None]:
    """Run the body with the exact allocator (:func:`configure_allocator` ``exact=True``), then go
    back to the fast one. For an untimed generation whose peak is read::

        with exact_allocation():
            reset_peak(device)
            executor.generate(...)
            peak = peak_bytes(device)

    Harmless on CUDA (the allocator counters are exact already) and without glibc.
    """
    configure_allocator(exact=True)
    try:
        yield
    finally:
        configure_allocator(exact=False)


def _trim(libc) -> None:
    """``malloc_trim(0)``: return free heap pages of every arena to the kernel (glibc only)."""
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def reset_peak() -> bool:
    """Start a new peak: :func:`peak_bytes` reads the largest use from now on.

    Collects garbage (``gc.collect``) and trims malloc's free pages so that the reset starts from
    the live data, then writes ``5`` to ``/proc/self/clear_refs``, which sets ``VmHWM`` to the
    current RSS (proc(5), Linux 4.0 or newer). (CUDA memory: :class:`runtime.device.CudaDevice`.)

    Returns:
        True if the peak was reset; False where the kernel does not allow it (then
        :func:`peak_bytes` keeps reading the peak since the process started).
    """
    gc.collect()
    libc = _libc()
    if libc is not None:
        _trim(libc)
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def current_bytes() -> int:
    """Bytes in use now: RSS of this process (``/proc/self/statm`` resident pages x page size; 0
    without ``/proc``)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_bytes() -> int:
    """Largest use since the last :func:`reset_peak`, in bytes: ``VmHWM`` of ``/proc/self/status``
    (the RSS high-water mark; ``ru_maxrss`` where ``/proc`` is missing, which macOS reports in
    bytes and Linux in KiB)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024
