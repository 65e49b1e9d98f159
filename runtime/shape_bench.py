"""The ``compute_isolated`` rows of a calibration: the model's compute ops at several shard widths,
timed one at a time in one process while the other ranks wait, asleep, in a barrier.

Compute timed in place (``compute`` rows) holds two things at once: the contention of the ranks
sharing the cores, and the efficiency of the op's shape. A GEMM's time per FLOP depends on its
shape (its weights' fit in cache, its arithmetic intensity: the roofline, Williams, Waterman and
Patterson, CACM 52(4), 2009), so the in-place times of a 4-way shard do not say what the whole op
costs (measured here, 32 prompt tokens, one process: a 768 x 3072 linear took 1.31 times the time
of its four 768 x 768 shards together). These rows time the op of each shape itself, on a core of
its own, as Vidur profiles each operator per shape (Agrawal et al., MLSys 2024, arXiv 2405.05187),
so that a target's contention comes only from the simulation's processor sharing
(:mod:`sim.cores`) and its ops from the shape it runs (:class:`sim.calibrated.CalibratedCompute`).

What is timed, on the group's first rank, with the scenario's model, dtype and batch: for every
tensor-parallel width ``k`` from 1 to the calibrated ranks that splits the model evenly
(:func:`models.shards.check_tensor_parallel`), rank 0's shard of a decoder layer's ops
(``layernorm``, ``qkv_proj``, ``attention``, ``out_proj``, ``mlp_up``, ``mlp_down``), of as many
layers in turn as it takes for each call to read its weights from memory (:func:`cycled_layers`,
as a generation reads them), and at width 1
the master's ``embedding`` and ``lm_head``; each at every calibration prompt as a prefill of the
scenario's batch (``p`` new tokens over ``p``) and as one decode step after it (1 over ``p + 1``)
at each batch size of :func:`decode_batch_sizes`. A few seconds in all.

Decode is timed at several batch sizes because its cost per row is not the roofline's: a decode
step's linear layers are memory-bound, so the roofline prices 2 rows about as 1, but on one torch
CPU thread one row goes to a matrix-vector kernel and more rows to a matrix-matrix kernel that
streams the weights more slowly at these sizes (measured here, GPT-2's decode linear layers: 2 rows
x1.89 one row's time, 4 rows x2.44, 8 rows x2.86; ``benchmarks/bench_decode_rows.py``). A plan
that splits a batch among replicas runs decode at batch sizes the scenario's calibration did not.

On a CUDA device each call is also split in two, as ``compute_device`` and ``host_issue`` rows: a
GPU runs the kernels its host queued ahead, so a step costs the host's queuing and the device's
kernels overlapped, not their sum (PyTorch, "CUDA semantics: asynchronous execution"). The device
time is read with CUDA events while the stream is held busy by a spin kernel
(``torch.cuda._sleep``) until the host has queued the whole op, so it holds no wait for the host;
the host time is the call's return, without waiting for the device.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch

from models.accounting import head_op_costs, layer_op_costs
from models.errors import ConfigError
from models.ops import OpKind
from models.shards import check_tensor_parallel
from runtime.comm_timing import stats
from runtime.device import device_of
from runtime.model import RankModel
from sim.program import NormSite, Stage
from sim.vocabulary import MeasurementKind

SHAPE_REPEATS = 15  # timed calls per op and shape, after WARMUP_CALLS untimed ones
WARMUP_CALLS = 3
METHOD = ("one op at a time in one process, the other ranks asleep in a barrier (contention-free), "
          "rank 0's shard at this tensor-parallel width; the calling thread's CPU time on a CPU (preemptions "
          "by other processes left out), else the synchronised host clock; statistics over calls")


def bench_widths(spec, ranks: int) -> tuple[int, ...]:
    """The tensor-parallel widths 1..``ranks`` that split ``spec`` evenly."""
    widths = []
    for k in range(1, ranks + 1):
        try:
            check_tensor_parallel(spec, k)
        except ConfigError:
            continue
        widths.append(k)
    return tuple(widths)


DECODE_BATCHES = (1, 2, 4)  # decode batch sizes timed whatever the scenario's: replicas split a batch


def decode_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """The batch sizes a decode step is timed at for a scenario of ``batch_size`` sequences:
    :data:`DECODE_BATCHES`, the powers of two up to ``batch_size`` and ``batch_size`` itself, so
    that any batch a plan splits the scenario's into lies between two timed ones (module docstring)."""
    powers = {2**k for k in range(batch_size.bit_length()) if 2**k <= batch_size}
    return tuple(sorted({*DECODE_BATCHES, *powers, batch_size}))


def shape_rows(spec, *, device_class: str, batch_size: int, prompts: tuple[int, ...], max_tokens: int,
               ranks: int, dtype: torch.dtype, device: torch.device,
               decode_batches: tuple[int, ...] | None = None) -> list[dict]:
    """The ``compute_isolated`` profile rows (see the module docstring): one per op kind, width,
    batch size and shape, its statistics over :data:`SHAPE_REPEATS` calls (s). Prefill at
    ``batch_size``; decode at ``decode_batches`` (default :func:`decode_batch_sizes`)."""
    decode_batches = decode_batch_sizes(batch_size) if decode_batches is None else decode_batches
    rows = []
    cache = cache_bytes(device)
    for width in bench_widths(spec, ranks):
        layers = cycled_layers(spec, width, cache)
        model = RankModel(spec, width, 0, seed=0, batch_size=max(batch_size, *decode_batches), max_tokens=max_tokens,
                          device=device, dtype=dtype, stage=Stage(0, layers, embeds=width == 1, heads=width == 1))
        for prompt in prompts:
            for new, start, batch in ((prompt, 0, batch_size), *((1, prompt, b) for b in decode_batches)):
                model.rows = slice(0, batch)  # the KV-cache rows of this batch (the cache holds the largest)
                times, split = time_layer_ops(model, batch, new, start)
                costs = layer_op_costs(spec, tp_degree=width, batch_size=batch, new_tokens=new,
                                       context_tokens=start + new, shard=model.shard)
                if width == 1:
                    costs.update({k: v for k, v in head_op_costs(spec, batch_size=batch, new_tokens=new).items()
                                  if k != OpKind.LAYERNORM})
                for kind, values in times.items():
                    cost = costs[kind]
                    shape = {"device_class": device_class, "op": str(kind), "group_size": width,
                             "batch_size": batch, "new_tokens": new, "context_tokens": start + new,
                             "dtype": spec.dtype, "flops": cost.flops,
                             "traffic_bytes": cost.bytes_read + cost.bytes_written, "unit": "s"}
                    rows.append({"measurement": MeasurementKind.COMPUTE_ISOLATED, **shape, "method": METHOD,
                                 **stats(values)})
                    for measurement, (method, parts) in split.items():
                        rows.append({"measurement": measurement, **shape, "method": method, **stats(parts[kind])})
    return rows


FALLBACK_CACHE_BYTES = 64 << 20  # a server CPU's last-level cache, where the machine does not say
CACHE_MULTIPLE = 2  # the other layers read between two calls of one layer's op: this many caches' worth


def cache_bytes(device: torch.device) -> int:
    """The largest cache between ``device``'s compute and its memory (bytes): a CUDA device's L2
    (``torch.cuda.get_device_properties``), a CPU's last-level cache as Linux reports it
    (``/sys/devices/system/cpu/cpu0/cache/index*/size``); :data:`FALLBACK_CACHE_BYTES` where
    neither can be read."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size) or FALLBACK_CACHE_BYTES
    sizes = []
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except ValueError:
            continue
    return max(sizes, default=FALLBACK_CACHE_BYTES)


def cycled_layers(spec, width: int, cache: int) -> int:
    """How many decoder layers the bench builds at ``width`` and calls in turn: enough that, between
    two calls of one layer's op, the others' weights fill :data:`CACHE_MULTIPLE` caches of
    ``cache`` bytes (capped at the model's layers), so every call reads its weights from memory
    as a generation does. A generation reads the model layer after layer, and the ranks of a
    machine share its last-level cache, so a layer's weights are gone from it when that layer
    comes round again; one layer called over and over keeps its shard there once the shard fits
    (measured on the 2-core testbed, a 32 MiB L3: GPT-2's decode ``qkv_proj`` at width 2 took
    0.064 ms called on one layer, 0.222 ms on 6 layers in turn, about half of width 1's 0.420 ms;
    ``benchmarks/bench_shape_cache.py``)."""
    costs = layer_op_costs(spec, tp_degree=width, batch_size=1, new_tokens=1, context_tokens=1)
    layer_bytes = sum(cost.weight_bytes for cost in costs.values())
    if layer_bytes <= 0:
        return 1
    return int(min(spec.num_layers, 1 + math.ceil(CACHE_MULTIPLE * cache / layer_bytes)))


def time_layer_ops(model: RankModel, batch: int, new: int, start: int
                ) -> tuple[dict[OpKind, list[float]], dict[MeasurementKind, tuple[str, dict[OpKind, list[float]]]]]:
    """Each op of the model's layers in turn, one layer per round (and, on a model that embeds,
    the embedding and LM head), in :data:`WARMUP_CALLS` + :data:`SHAPE_REPEATS` rounds, on ``new``
    tokens from position ``start``; the timed calls' durations (s) per op kind, and on CUDA the
    device and host parts of each call by measurement kind (with their method); empty elsewhere.
    The layers in turn, so that each call reads its weights from memory (:func:`cycled_layers`)."""
    sync = device_of(model.device).synchronize
    # On a CPU, the calling thread's CPU time: what the op costs a core of its own even where other
    # processes preempt it (a shared machine's scheduler hands out slices of milliseconds, so the
    # wall time of an op longer than a slice holds whatever else ran; torch runs single-threaded
    # in the ranks, runtime.launch). On an accelerator, the host clock around a synchronised call.
    clock = time.thread_time if model.device.type == "cpu" else time.perf_counter
    tokens = torch.zeros((batch, new), dtype=torch.long, device=model.device)
    h = torch.randn(batch, new, model.spec.hidden_size, device=model.device).to(model.dtype)
    x = model.norm(h, 0, NormSite.ATTENTION)
    q, k, v = model.qkv_proj(x, 0)
    o = model.attention(q, k, v, 0, start)
    a = model.mlp_up(x, 0)
    calls = {OpKind.LAYERNORM: lambda layer: model.norm(h, layer, NormSite.ATTENTION),
             OpKind.QKV_PROJ: lambda layer: model.qkv_proj(x, layer),
             OpKind.ATTENTION: lambda layer: model.attention(q, k, v, layer, start),
             OpKind.OUT_PROJ: lambda layer: model.out_proj(o, layer),
             OpKind.MLP_UP: lambda layer: model.mlp_up(x, layer),
             OpKind.MLP_DOWN: lambda layer: model.mlp_down(a, layer)}
    if model.stage.embeds:
        calls[OpKind.EMBEDDING] = lambda layer: model.embedding(tokens, start)
        calls[OpKind.LM_HEAD] = lambda layer: model.lm_head(x[:, -1])
    times: dict[OpKind, list[float]] = {kind: [] for kind in calls}
    cuda = model.device.type == "cuda"
    device_s: dict[OpKind, list[float]] = {kind: [] for kind in calls}
    host_s: dict[OpKind, list[float]] = {kind: [] for kind in calls}
    with torch.inference_mode():
        for index in range(WARMUP_CALLS + SHAPE_REPEATS):
            layer = model.layers[index % len(model.layers)]
            for kind, op in calls.items():  # interleaved: every op samples the same stretch of time
                call = partial(op, layer)
                sync()
                began = clock()
                call()
                sync()
                if index >= WARMUP_CALLS:
                    times[kind].append(clock() - began)
                if cuda:
                    device, host = _split_call(call)
                    if index >= WARMUP_CALLS:
                        device_s[kind].append(device)
                        host_s[kind].append(host)
    if not cuda:
        return times, {}
    return times, {MeasurementKind.COMPUTE_DEVICE: (DEVICE_METHOD, device_s),
                   MeasurementKind.HOST_ISSUE: (HOST_METHOD, host_s)}


HOLD_CYCLES = 20_000_000  # the spin holding the stream while the host queues: 10 ms at 2 GHz, > 9 calls' queuing
HOST_BURST = 8  # calls queued back to back for the host's time, as a generation queues op after op
DEVICE_METHOD = ("the op's kernels on the device alone: CUDA events around them, queued behind a spin kernel "
                 "(torch.cuda._sleep) so the device never waited for the host; statistics over calls")
HOST_METHOD = (f"the host's time to queue the op's kernels: {HOST_BURST} calls queued back to back while the device "
               "was busy (so the queue never blocked the host), per call; statistics over repeats")


def _split_call(call) -> tuple[float, float]:
    """(device s, host s) of ``call`` on the current CUDA stream (module docstring): one call's
    kernels timed by CUDA events, then :data:`HOST_BURST` more calls queued back to back for the
    host's time per call; all of them behind one spin kernel."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOLD_CYCLES)
    start.record()
    call()
    end.record()
    began = time.perf_counter()
    for _ in range(HOST_BURST):
        call()
    host = (time.perf_counter() - began) / HOST_BURST
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, host


CEILING_REPEATS = 10
MATMUL_SIZE = 8192  # square operands: large enough to run at the device's matrix rate
COPY_BYTES = 1 << 30


def ceiling_rows(device_class: str, dtype: str, torch_dtype: torch.dtype, device: torch.device) -> list[dict]:
    """The ``device_ceiling`` rows of a CUDA device: a ``MATMUL_SIZE``-cubed matrix product in the
    model's dtype (FLOP/s: 2 n^3 per product) and a ``COPY_BYTES`` device-to-device copy (bytes
    read plus written per s), each the median of :data:`CEILING_REPEATS` CUDA-event timings after
    warm-ups, on random data. The rates the device's large kernels reach, measured rather than
    taken from a datasheet (the roofline's two ceilings, Williams, Waterman and Patterson, CACM
    52(4), 2009); what prices kernels beyond the shapes timed (:mod:`sim.async_compute`)."""
    n = MATMUL_SIZE
    matmul_s = event_times(lambda a, b: a @ b, *(torch.randn(n, n, device=device).to(torch_dtype) for _ in range(2)))
    src = torch.randn(COPY_BYTES // 4, device=device)
    copy_s = event_times(lambda dst, src: dst.copy_(src), torch.empty_like(src), src)
    del src
    torch.cuda.empty_cache()
    method = f"CUDA events, median of {CEILING_REPEATS} after 3 warm-ups, random data"
    common = {"measurement": MeasurementKind.DEVICE_CEILING, "device_class": device_class, "dtype": dtype}
    return [{**common, "op": "matmul", "flops": 2.0 * n**3, "unit": "FLOP/s", "method": f"{n}^3 matrix product; {method}",
             **stats([2.0 * n**3 / t for t in matmul_s])},
            {**common, "op": "copy", "traffic_bytes": 2.0 * COPY_BYTES, "unit": "bytes/s",
             "method": f"{COPY_BYTES} B device-to-device copy, read plus written; {method}",
             **stats([2.0 * COPY_BYTES / t for t in copy_s])}]


def event_times(call, *operands, repeats: int = CEILING_REPEATS, warmup: int = 3) -> list[float]:
    """CUDA-event times (s) of ``repeats`` calls of ``call(*operands)`` on the current stream, after
    ``warmup`` untimed ones (each call's kernels between two events, the host waiting for the last)."""
    for _ in range(warmup):
        call(*operands)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(*operands)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times
