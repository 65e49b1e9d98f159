"""The ``reduction`` rows of a calibration: the cost of combining a received buffer into a local one.

The runtime's own collectives (every algorithm but ``library``, :func:`runtime.comm.run_schedule`)
reduce each received buffer into the rank's buffer with ``flat[start:stop].add_(buffer)``, in the
activations' dtype, on the rank's device. The simulator prices that as gamma seconds per received
byte, the gamma of the alpha-beta-gamma model (Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005);
these rows are what :func:`sim.reduction.fit_reductions` fits it on.

What is timed, on the group's first rank with the other ranks asleep in a barrier (as the
``compute_isolated`` rows, :mod:`runtime.shape_bench`): that very ``add_`` of one buffer into
another, at :data:`REDUCTION_SIZES` bytes, each :data:`WARMUP_CALLS` untimed then
:data:`REDUCTION_REPEATS` timed calls; on a CPU the calling thread's CPU time (what it costs a core
of its own; torch runs single-threaded in the ranks, :mod:`runtime.launch`), on CUDA with events
(:func:`runtime.shape_bench.event_times`). Under a second on a CPU (measured here: 0.4 s in fp32,
0.7 s in bf16, allocation included).
"""

from __future__ import annotations

import time

import torch

from runtime.comm_timing import stats
from runtime.shape_bench import event_times
from sim.vocabulary import MeasurementKind

REDUCTION_SIZES = tuple((64 << 10) << (2 * k) for k in range(6))  # 64 KiB, 256 KiB, .. 64 MiB of each operand
REDUCTION_REPEATS = 7
WARMUP_CALLS = 2
METHOD = ("the runtime schedules' reduction, buffer.add_(received) in the activations' dtype, one call at a time "
          "in one process (the other ranks asleep in a barrier); the calling thread's CPU time on a CPU, CUDA "
          f"events on a GPU; {WARMUP_CALLS} warm-up calls, statistics over {REDUCTION_REPEATS} calls")


def reduction_rows(device_class: str, dtype: str, torch_dtype: torch.dtype, device: torch.device,
                   sizes: tuple[int, ...] = REDUCTION_SIZES) -> list[dict]:
    """The ``reduction`` profile rows (see the module docstring): one per size in ``sizes``
    (bytes of each operand, multiples of the dtype's element size), its statistics over
    :data:`REDUCTION_REPEATS` calls (s).

    Raises:
        ValueError: a size that is not a whole number of ``torch_dtype`` elements.
    """
    element = torch.empty((), dtype=torch_dtype).element_size()
    if any(size % element for size in sizes):
        raise ValueError(f"reduction sizes must be multiples of {element} bytes (got {sizes})")
    largest = max(sizes) // element
    # Small values of one sign: repeated additions stay finite and normal in every dtype.
    local = torch.full((largest,), 1.0, dtype=torch_dtype, device=device)
    received = torch.full((largest,), 2.0**-10, dtype=torch_dtype, device=device)
    rows = []
    with torch.inference_mode():
        for size in sizes:
            target, source = local[: size // element], received[: size // element]
            if device.type == "cuda":
                times = event_times(lambda a, b: a.add_(b), target, source, repeats=REDUCTION_REPEATS,
                                    warmup=WARMUP_CALLS)
            else:
                times = _thread_times(lambda: target.add_(source))
            rows.append({"measurement": MeasurementKind.REDUCTION, "device_class": device_class, "op": "add",
                         "size_bytes": size, "dtype": dtype, "traffic_bytes": 3.0 * size, "unit": "s",
                         "method": METHOD, **stats(times)})
    return rows


def _thread_times(call) -> list[float]:
    """The calling thread's CPU time (s) of :data:`REDUCTION_REPEATS` calls of ``call`` after
    :data:`WARMUP_CALLS` untimed ones."""
    for _ in range(WARMUP_CALLS):
        call()
    times = []
    for _ in range(REDUCTION_REPEATS):
        began = time.thread_time()
        call()
        times.append(time.thread_time() - began)
    return times
