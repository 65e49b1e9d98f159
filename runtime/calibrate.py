"""``hetsim calibrate``: microbenchmarks on the scenario's cluster, written as a profile.

Every measurement runs in the same forked ranks, over the same process group, as a real
measurement, so it sees the same CPU sharing, framework and links:

* ``compute`` and ``op_gap``: the executor generates with the scenario's model at a grid of prompt
  lengths (``allreduce_ln`` with the library allreduce); each compute op is timed in place, and
  the gap between consecutive ops of a rank is the framework's dispatch time. Rows are medians
  over ranks of one device type, layers and repeats, per op kind and shape.
* ``collective``: every algorithm the registry knows for each kind (and ``library``), over the
  scenario's tensor-parallel group, at 1 KiB x 4^k up to 64 MiB; sizes stop growing once one call
  takes longer than ``max_call_s``. Back-to-back calls after a barrier (up to 8, about 50 ms);
  the time per call is the slowest rank's.
* ``p2p``: ping-pong between rank 0 and a rank on its host and on another host (half the round
  trip), 1 KiB to 4 MiB.
* ``memory_baseline``: what a rank holds beyond its model: its peak resident memory in one more,
  untimed generation at the shortest prompt with the exact allocator (:mod:`runtime.memory_probe`),
  less its weights and KV cache (framework, communication buffers, activations), read before the
  collective sweep.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime.comm import Communicator
from runtime.executor import Executor
from runtime.blocks import BlockLoader
from runtime.weights import prompt_tokens
from runtime import memory_probe
from runtime.worker import peak_memory_bytes, rank_model
from sim.collectives.registry import ALGORITHMS, LIBRARY
from sim.plan import Collective, Plan, StrategyChoice
from sim.profile import profile_frame

CALIBRATION_PROMPTS = (8, 32, 128)
CALIBRATION_OUTPUT_TOKENS = 4
SIZES_BYTES = tuple(1024 * 4**k for k in range(9))  # 1 KiB .. 64 MiB
P2P_SIZES_BYTES = tuple(1024 * 4**k for k in range(7))  # 1 KiB .. 4 MiB


def _stats(values) -> dict:
    values = np.asarray(values, dtype=float)
    return {"median": float(np.median(values)), "p10": float(np.percentile(values, 10)),
            "p90": float(np.percentile(values, 90)), "repeats": len(values)}


def calibrate_rank(scenario, topology, rank: int, *, repeats: int, max_call_s: float,
                   heartbeat: Callable[[str], None], used_only: bool = False) -> list[dict] | None:
    """Run every microbenchmark on this rank; returns all profile rows on rank 0, None elsewhere."""
    from sim.simulate import tensor_parallel_ranks

    memory_probe.configure_allocator(exact=False)  # the measured runs' malloc settings (run_rank)
    ranks = tensor_parallel_ranks(scenario, topology)
    device_class = topology.devices[rank].spec.name
    comm = Communicator(rank, topology.host_groups)
    # Compute first: the memory baseline is read from the generation's peak, before the
    # collective sweep's large buffers raise this process's high-water mark.
    rows, framework_bytes = _compute(scenario, ranks, topology, rank, comm, repeats, heartbeat)
    samples = [None] * len(ranks)
    dist.all_gather_object(samples, (device_class, framework_bytes))
    by_class = defaultdict(list)
    for cls, value in samples:
        by_class[cls].append(value)
    for cls, values in by_class.items():
        rows.append({"measurement": "memory_baseline", "device_class": cls, "unit": "bytes",
                     "method": "peak resident set size of an untimed generation at the shortest prompt "
                               "(exact allocator), less the model's weights and KV cache (framework, "
                               "communication buffers, activations)",
                     **_stats(values)})
    rows += collective_rows(ranks, topology, rank, comm, repeats, max_call_s, heartbeat,
                            algorithms=used_algorithms(scenario) if used_only else None)
    rows += _p2p(ranks, topology, rank, repeats, heartbeat)
    gathered = [None] * len(ranks) if rank == ranks[0] else None
    dist.gather_object(rows, gathered, dst=ranks[0])
    if rank != ranks[0]:
        return None
    merged = [row for part in gathered for row in part if row.get("measurement") != "memory_baseline"]
    merged += [row for row in gathered[0] if row.get("measurement") == "memory_baseline"]
    return _merge_compute(merged)


def _timed(fn: Callable[[], None], calls: int = 1) -> float:
    """Seconds one of ``calls`` back-to-back calls of ``fn`` takes, started after a barrier, as the
    slowest rank saw them. Ranks leave a barrier up to one message latency apart; over several
    calls that skew is amortised instead of being charged to the collective."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _calls_for(seconds_per_call: float) -> int:
    """Back-to-back calls per timing: enough for about 50 ms, at most 8."""
    return max(1, min(8, int(0.05 / max(seconds_per_call, 1e-6))))


def used_algorithms(scenario) -> dict[OpKind, tuple[str, ...]]:
    """The collective algorithms the scenario's variants call, by kind (``auto`` needs them all)."""
    used: dict[OpKind, set[str]] = {kind: set() for kind in (OpKind.ALLREDUCE, OpKind.REDUCE, OpKind.BROADCAST)}
    for v in scenario.config.variants:
        if v.strategy == "allreduce_ln":
            used[OpKind.ALLREDUCE].add(v.allreduce)
        else:
            used[OpKind.REDUCE].add(v.reduce)
        used[OpKind.BROADCAST].add(v.broadcast)
    return {kind: (LIBRARY, *ALGORITHMS[kind]) if "auto" in names else tuple(sorted(names))
            for kind, names in used.items()}


def collective_rows(ranks, topology, rank, comm, repeats, max_call_s, heartbeat,
                    sizes: tuple[int, ...] = SIZES_BYTES,
                    algorithms: dict[OpKind, tuple[str, ...]] | None = None) -> list[dict]:
    """Time each algorithm of each collective kind at ``sizes`` (ascending); rows on rank 0.
    ``algorithms``: which to time, by kind (default: ``library`` and every one the registry knows)."""
    rows = []
    hosts = len(topology.host_groups(ranks))
    for kind in (OpKind.ALLREDUCE, OpKind.REDUCE, OpKind.BROADCAST):
        for algorithm in (algorithms or {}).get(kind, (LIBRARY, *ALGORITHMS[kind])):
            for size in sizes:
                call = Collective(kind, algorithm, tuple(ranks), size, ranks[0] if kind != OpKind.ALLREDUCE else None)
                tensor = torch.ones(size // 4, dtype=torch.float32)
                heartbeat(f"{kind} {algorithm} {size // 1024} KiB")
                try:
                    comm.run(call, tensor)  # warm-up, and it builds the schedule
                except ValueError:  # e.g. two_level_rs on hosts with different numbers of ranks
                    break
                calls = _calls_for(_timed(lambda: comm.run(call, tensor)))
                times = [_timed(lambda: comm.run(call, tensor), calls) for _ in range(repeats)]
                if rank == ranks[0]:
                    rows.append({"measurement": "collective", "op": str(kind), "algorithm": algorithm,
                                 "group_size": len(ranks), "num_hosts": hosts, "size_bytes": size, "unit": "s",
                                 "method": "barrier, then back-to-back calls; slowest rank's time per call",
                                 **_stats(times)})
                if np.median(times) > max_call_s:
                    break
    return rows


def _p2p(ranks, topology, rank, repeats, heartbeat) -> list[dict]:
    rows = []
    master_host = topology.devices[ranks[0]].host
    peers = {"intra_host": next((r for r in ranks[1:] if topology.devices[r].host == master_host), None),
             "inter_host": next((r for r in ranks[1:] if topology.devices[r].host != master_host), None)}
    for link_class, peer in peers.items():
        if peer is None:
            continue
        for size in P2P_SIZES_BYTES:
            heartbeat(f"p2p {link_class} {size // 1024} KiB")
            buffer = torch.ones(size // 4, dtype=torch.float32)
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if rank == ranks[0]:
                    dist.send(buffer, dst=peer)
                    dist.recv(buffer, src=peer)
                elif rank == peer:
                    dist.recv(buffer, src=ranks[0])
                    dist.send(buffer, dst=ranks[0])
                times.append((time.perf_counter() - start) / 2)
            if rank == ranks[0]:
                rows.append({"measurement": "p2p", "device_class": link_class, "size_bytes": size, "unit": "s",
                             "method": "half a send/recv ping-pong round trip", **_stats(times[1:])})
    return rows


def _compute(scenario, ranks, topology, rank, comm, repeats, heartbeat) -> tuple[list[dict], int]:
    spec = scenario.model
    batch = scenario.config.workload.batch_size
    device = torch.device("cpu")
    model, store = rank_model(scenario, tuple(ranks), rank, seed=0,
                              max_tokens=max(CALIBRATION_PROMPTS) + CALIBRATION_OUTPUT_TOKENS, device=device)
    # A model built from block files (when the scenario streams) is loaded whole before timing.
    loader = BlockLoader(store, device) if store is not None else None
    device_class = topology.devices[rank].spec.name
    rows, gaps = [], []
    for prompt_len in CALIBRATION_PROMPTS:
        plan = Plan(spec, tuple(ranks), batch, prompt_len, CALIBRATION_OUTPUT_TOKENS,
                    StrategyChoice("allreduce_ln", allreduce=LIBRARY, broadcast=LIBRARY))
        executor = Executor(plan, model, comm, rank, loader=loader)
        executor.prepare()
        prompt = prompt_tokens(spec, batch, prompt_len, seed=0)
        if prompt_len == min(CALIBRATION_PROMPTS):
            smallest = (executor, prompt)
        # Ops of one name in one step share their cost (every layer has the same shapes).
        ops = [{op.name: op for seg in plan.phase(step).segments for op in seg.programs[rank]}
               for step in range(plan.num_phases)]
        for index in range(repeats + 1):
            heartbeat(f"compute, prompt {prompt_len} tokens, repeat {index}")
            generation = executor.generate(prompt, time.perf_counter())
            if index == 0:
                continue  # warm-up
            records = generation.records
            for before, after in zip(records, records[1:]):
                if before.step == after.step:
                    gaps.append(after.start_s - before.end_s)
            for record in records:
                op = ops[record.step][record.name]
                if op.collective is not None:
                    continue
                new, context = op.shape
                cost = op.cost
                rows.append({"measurement": "compute", "device_class": device_class, "op": record.kind,
                             "group_size": len(ranks), "batch_size": batch, "new_tokens": new,
                             "context_tokens": context, "dtype": spec.dtype, "flops": cost.flops,
                             "traffic_bytes": cost.bytes_read + cost.bytes_written, "unit": "s",
                             "method": "timed in place while generating (allreduce_ln, library)",
                             "median": record.end_s - record.start_s})
    rows.append({"measurement": "op_gap", "device_class": device_class, "unit": "s",
                 "method": "time between consecutive ops of a rank while generating", **_stats(gaps)})
    cache_bytes = sum(t.numel() * t.element_size() for t in (*model.k_cache, *model.v_cache))
    # Memory: one more, untimed generation with the exact allocator, in which RSS is the baseline
    # plus the live tensors (the timed ones above ran fast). At the shortest prompt: activations
    # and workspace, which the simulator prices per shape, then barely enter the baseline.
    executor, prompt = smallest
    with memory_probe.exact_allocation():
        memory_probe.reset_peak(device)
        executor.generate(prompt, time.perf_counter())
        peak = peak_memory_bytes(device)
    return rows, peak - model.weight_bytes - cache_bytes


def _merge_compute(rows: list[dict]):
    """Fold single timings (one per rank, layer and repeat) into one row per op and shape."""
    compute = defaultdict(list)
    gaps = defaultdict(list)
    merged = []
    for row in rows:
        if row["measurement"] == "compute":
            key = tuple(row[k] for k in ("device_class", "op", "group_size", "batch_size", "new_tokens",
                                         "context_tokens", "dtype", "flops", "traffic_bytes", "method"))
            compute[key].append(row["median"])
        elif row["measurement"] == "op_gap":
            gaps[row["device_class"]].append(row["median"])
        else:
            merged.append(row)
    names = ("device_class", "op", "group_size", "batch_size", "new_tokens", "context_tokens", "dtype", "flops",
             "traffic_bytes", "method")
    for key, values in compute.items():
        merged.append({"measurement": "compute", **dict(zip(names, key)), "unit": "s", **_stats(values)})
    for device_class, values in gaps.items():
        merged.append({"measurement": "op_gap", "device_class": device_class, "unit": "s",
                       "method": "time between consecutive ops of a rank while generating (median over ranks)",
                       **_stats(values)})
    return profile_frame(merged)


def calibrate_scenario(scenario, *, testbed: bool = False, repeats: int = 5, max_call_s: float = 1.0,
                       hang_timeout_s: float = 300.0, on_beat: Callable[[int, str], None] | None = None,
                       used_only: bool = False):
    """Calibrate on this machine (forked ranks, in the testbed's namespaces if ``testbed``).
    ``used_only``: time only the collective algorithms the scenario's variants call.

    Returns:
        The profile table (:func:`sim.profile.profile_frame`).

    Raises:
        ConfigError: invalid scenario, or testbed not up.
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    from runtime.launch import launch
    from runtime.measure import placements_for
    from sim.simulate import tensor_parallel_ranks
    from sim.topology import build_topology

    topology = build_topology(scenario.config.cluster)
    ranks = tensor_parallel_ranks(scenario, topology)
    placements, enter = placements_for(scenario, topology, ranks, testbed)

    def body(rank: int, heartbeat) -> object:
        torch.manual_seed(0)
        return calibrate_rank(scenario, topology, rank, repeats=repeats, max_call_s=max_call_s, heartbeat=heartbeat,
                              used_only=used_only)

    return launch(body, len(ranks), placements=placements, hang_timeout_s=hang_timeout_s,
                  enter_namespace=enter, on_beat=on_beat)[0]


def measure_collectives(scenario, sizes: tuple[int, ...], *, testbed: bool = False, repeats: int = 5,
                        max_call_s: float = 1.0, hang_timeout_s: float = 300.0,
                        on_beat: Callable[[int, str], None] | None = None):
    """Time every collective algorithm at ``sizes`` over the scenario's group (profile rows)."""
    from runtime.launch import launch
    from runtime.measure import placements_for
    from sim.simulate import tensor_parallel_ranks
    from sim.topology import build_topology

    topology = build_topology(scenario.config.cluster)
    ranks = tensor_parallel_ranks(scenario, topology)
    placements, enter = placements_for(scenario, topology, ranks, testbed)

    def body(rank: int, heartbeat) -> object:
        comm = Communicator(rank, topology.host_groups)
        return collective_rows(ranks, topology, rank, comm, repeats, max_call_s, heartbeat, tuple(sorted(sizes)))

    rows = launch(body, len(ranks), placements=placements, hang_timeout_s=hang_timeout_s,
                  enter_namespace=enter, on_beat=on_beat)[0]
    return profile_frame(rows)
