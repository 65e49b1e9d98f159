"""``hetsim calibrate``: microbenchmarks on the scenario's cluster, written as a profile.

Every measurement runs in the same forked ranks, over the same process group, as a real
measurement, so it sees the same CPU sharing, framework and links (on a real cluster, in the
ranks torchrun starts: :func:`main`):

* generations: the executor generates with the scenario's model at a grid of prompt lengths, once
  per distinct strategy of the scenario's variants (:func:`calibration_strategies`), each
  generation started at one instant on the shared clock. From their op records:

  * ``compute`` and ``op_gap``: each compute op is timed in place, and the gap between
    consecutive ops of a rank is the framework's dispatch time. Rows are statistics over ranks
    of one device type, strategies, layers and repeats, per op kind and shape;
  * ``collective_in_place`` and ``collective_wait``: each collective call as the master sees it,
    from the last rank's start to its own end, and its wait for that start
    (:func:`runtime.comm_timing.in_place_rows`), per kind, algorithm and size.
* ``collective``: every algorithm the registry knows for each kind (and ``library``), in
  isolation over the scenario's tensor-parallel group, at 1 KiB x 4^k up to 64 MiB
  (:func:`runtime.comm_timing.collective_rows`).
* ``p2p``: ping-pong between rank 0 and a rank on its host and on another host (half the round
  trip), 1 KiB to 4 MiB.
* ``memory_baseline``: what a rank holds beyond its model: its peak resident memory in one more,
  untimed generation at the shortest prompt with the exact allocator (:mod:`runtime.memory_probe`),
  less its weights and KV cache (framework, communication buffers, activations), read before the
  collective sweep.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist

from models.ops import OpKind
from runtime import memory_probe
from runtime.blocks import BlockLoader
from runtime.comm import Communicator
from runtime.comm_timing import collective_rows, in_place_rows, p2p_rows, stats
from runtime.executor import Executor
from runtime.weights import prompt_tokens
from runtime.worker import common_start, peak_memory_bytes, rank_model
from sim.collectives.registry import ALGORITHMS, LIBRARY
from sim.network import AUTO
from sim.plan import Plan, StrategyChoice
from sim.profile import profile_frame

CALIBRATION_PROMPTS = (8, 32, 128)
CALIBRATION_OUTPUT_TOKENS = 4


def calibrate_rank(scenario, topology, rank: int, *, repeats: int, max_call_s: float,
                   heartbeat: Callable[[str], None], used_only: bool = False,
                   held_out_sizes: tuple[int, ...] = ()) -> list[dict] | None:
    """Run every microbenchmark on this rank; returns all profile rows on rank 0, None elsewhere.
    ``held_out_sizes``: collective sizes timed in the sweep's rounds as ``collective_held_out``
    rows (:func:`runtime.comm_timing.collective_rows`)."""
    from sim.simulate import tensor_parallel_ranks

    memory_probe.configure_allocator(exact=False)  # the measured runs' malloc settings (run_rank)
    ranks = tensor_parallel_ranks(scenario, topology)
    device_class = topology.devices[rank].spec.name
    comm = Communicator(rank, topology.host_groups)
    # Generations first: the memory baseline is read from one, before the collective sweep's large
    # buffers raise this process's high-water mark.
    rows, spans, framework_bytes = _generations(scenario, ranks, topology, rank, comm, repeats, heartbeat)
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
                     **stats(values)})
    rows += collective_rows(ranks, topology, rank, comm, repeats, max_call_s, heartbeat,
                            algorithms=used_algorithms(scenario) if used_only else None,
                            held_out=tuple(held_out_sizes))
    rows += p2p_rows(ranks, topology, rank, repeats, heartbeat)
    gathered = [None] * len(ranks) if rank == ranks[0] else None
    dist.gather_object((rows, spans), gathered, dst=ranks[0])
    if rank != ranks[0]:
        return None
    merged = [row for part, _ in gathered for row in part if row.get("measurement") != "memory_baseline"]
    merged += [row for row in gathered[0][0] if row.get("measurement") == "memory_baseline"]
    merged += in_place_rows([span for _, part in gathered for span in part], len(ranks),
                            len(topology.host_groups(ranks)), master=ranks[0])
    return _merge_compute(merged)


def calibration_strategies(scenario) -> list[StrategyChoice]:
    """The distinct strategies of the scenario's variants that name their algorithms (``auto`` is
    resolved by the simulator's pricing, so it has no one algorithm to run), in variant order;
    ``allreduce_ln`` with the library allreduce when none does."""
    choices = []
    for v in scenario.config.variants:
        choice = StrategyChoice(v.strategy, v.allreduce, v.reduce, v.broadcast)
        names = (choice.allreduce, choice.broadcast) if v.strategy == "allreduce_ln" else (choice.reduce, choice.broadcast)
        if AUTO not in names and choice not in choices:
            choices.append(choice)
    return choices or [StrategyChoice("allreduce_ln", allreduce=LIBRARY, broadcast=LIBRARY)]


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


def _generations(scenario, ranks, topology, rank, comm, repeats, heartbeat) -> tuple[list[dict], list[tuple], int]:
    """Generate with each calibration strategy at each calibration prompt, interleaved in rounds
    (one warm-up round, then ``ceil(repeats / strategies)`` timed, at least 2).

    Returns:
        (this rank's compute and op_gap rows; its collective spans for
        :func:`runtime.comm_timing.in_place_rows`; its framework memory in bytes).
    """
    spec = scenario.model
    batch = scenario.config.workload.batch_size
    device = torch.device("cpu")
    model, store = rank_model(scenario, tuple(ranks), rank, seed=0,
                              max_tokens=max(CALIBRATION_PROMPTS) + CALIBRATION_OUTPUT_TOKENS, device=device)
    # A model built from block files (when the scenario streams) is loaded whole before timing.
    loader = BlockLoader(store, device) if store is not None else None
    device_class = topology.devices[rank].spec.name
    strategies = calibration_strategies(scenario)
    timed = max(2, math.ceil(repeats / len(strategies)))
    rows, spans, gaps = [], [], []
    cases = []  # (strategy index, label, prompt length, executor, prompt, ops by step and name)
    for s_index, strategy in enumerate(strategies):
        label = strategy.strategy if strategy.strategy != "allreduce_ln" else f"allreduce_ln {strategy.allreduce}"
        for prompt_len in CALIBRATION_PROMPTS:
            plan = Plan(spec, tuple(ranks), batch, prompt_len, CALIBRATION_OUTPUT_TOKENS, strategy)
            executor = Executor(plan, model, comm, rank, loader=loader)
            executor.prepare()
            # Ops of one name in one step share their cost (every layer has the same shapes).
            ops = [{op.name: op for seg in plan.phase(step).segments for op in seg.programs[rank]}
                   for step in range(plan.num_phases)]
            cases.append((s_index, label, prompt_len, executor, prompt_tokens(spec, batch, prompt_len, seed=0), ops))
    # Round-robin over the cases, one generation each per round (the first round warms up): on a
    # shared machine the pace drifts over tens of seconds, and a strategy timed in one block would
    # carry whatever the machine did then into its collective rows; interleaved, every strategy
    # samples the same stretch of time.
    for index in range(timed + 1):
        for s_index, label, prompt_len, executor, prompt, ops in cases:
            heartbeat(f"generating with {label}, prompt {prompt_len} tokens, repeat {index}")
            generation = executor.generate(prompt, common_start(device))
            if index == 0:
                continue  # warm-up
            records = generation.records
            for before, after in zip(records, records[1:]):
                if before.step == after.step:
                    gaps.append(after.start_s - before.end_s)
            for record in records:
                op = ops[record.step][record.name]
                if op.collective is not None:
                    call = (s_index, prompt_len, index, record.step, record.layer, record.name)
                    spans.append((call, rank, str(op.collective.kind), op.collective.algorithm,
                                  op.collective.size_bytes, record.start_s, record.end_s))
                    continue
                new, context = op.shape
                cost = op.cost
                rows.append({"measurement": "compute", "device_class": device_class, "op": record.kind,
                             "group_size": len(ranks), "batch_size": batch, "new_tokens": new,
                             "context_tokens": context, "dtype": spec.dtype, "flops": cost.flops,
                             "traffic_bytes": cost.bytes_read + cost.bytes_written, "unit": "s",
                             "method": "timed in place while generating (the scenario's strategies)",
                             "median": record.end_s - record.start_s})
    rows.append({"measurement": "op_gap", "device_class": device_class, "unit": "s",
                 "method": "time between consecutive ops of a rank while generating", **stats(gaps)})
    cache_bytes = sum(t.numel() * t.element_size() for t in (*model.k_cache, *model.v_cache))
    # Memory: one more, untimed generation with the exact allocator, in which RSS is the baseline
    # plus the live tensors (the timed ones above ran fast). At the shortest prompt: activations
    # and workspace, which the simulator prices per shape, then barely enter the baseline.
    _, _, _, executor, prompt, _ = cases[0]
    with memory_probe.exact_allocation():
        memory_probe.reset_peak(device)
        executor.generate(prompt, time.perf_counter())
        peak = peak_memory_bytes(device)
    return rows, spans, peak - model.weight_bytes - cache_bytes


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
            gaps[row["device_class"]].append((row["median"], row["mean"]))
        else:
            merged.append(row)
    names = ("device_class", "op", "group_size", "batch_size", "new_tokens", "context_tokens", "dtype", "flops",
             "traffic_bytes", "method")
    for key, values in compute.items():
        merged.append({"measurement": "compute", **dict(zip(names, key)), "unit": "s", **stats(values)})
    for device_class, values in gaps.items():
        medians, means = zip(*values)
        merged.append({"measurement": "op_gap", "device_class": device_class, "unit": "s",
                       "method": "time between consecutive ops of a rank while generating (statistics over "
                                 "ranks of each rank's median; mean over ranks of each rank's mean)",
                       **stats(medians), "mean": float(sum(means) / len(means))})
    return profile_frame(merged)


def calibrate_scenario(scenario, *, testbed: bool = False, repeats: int = 5, max_call_s: float = 1.0,
                       hang_timeout_s: float = 300.0, on_beat: Callable[[int, str], None] | None = None,
                       used_only: bool = False, held_out_sizes: tuple[int, ...] = ()):
    """Calibrate on this machine (forked ranks, in the testbed's namespaces if ``testbed``).
    ``used_only``: time only the collective algorithms the scenario's variants call;
    ``held_out_sizes``: see :func:`calibrate_rank`.

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
                              used_only=used_only, held_out_sizes=held_out_sizes)

    return launch(body, len(ranks), placements=placements, hang_timeout_s=hang_timeout_s,
                  enter_namespace=enter, on_beat=on_beat)[0]


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: calibrate a real cluster, one process per device of the scenario's
    tensor-parallel group (CPU ranks over gloo)::

        torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
            -m runtime.calibrate scenarios/SCENARIO.yaml --out profile.csv

    The hosts' clocks are put on rank 0's first (:func:`runtime.clock.synchronise`); rank 0 writes
    the profile. A bad scenario, or a world size other than the group's, exits with code 2 and a
    one-line error.
    """
    import argparse
    import sys
    from datetime import timedelta
    from pathlib import Path

    from models.errors import ConfigError
    from runtime import clock
    from sim.outputs import write_atomic
    from sim.scenario import load_scenario
    from sim.simulate import tensor_parallel_ranks
    from sim.topology import build_topology

    parser = argparse.ArgumentParser(prog="python -m runtime.calibrate", description="one rank of hetsim calibrate")
    parser.add_argument("scenario")
    parser.add_argument("--out", required=True, help="where rank 0 writes the profile (CSV)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-call", type=float, default=1.0, dest="max_call_s",
                        help="stop growing a collective's size once one call takes longer (s)")
    parser.add_argument("--used-only", action="store_true", help="time only the algorithms the variants call")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        scenario = load_scenario(args.scenario)
        topology = build_topology(scenario.config.cluster)
        ranks = tensor_parallel_ranks(scenario, topology)
        if world_size != len(ranks):
            raise ConfigError("WORLD_SIZE", f"must be the scenario's tensor-parallel group size {len(ranks)} "
                                            f"(got {world_size})")
    except ConfigError as error:
        print(f"hetsim: error: {error}", file=sys.stderr)
        sys.exit(2)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        clock.synchronise()
        torch.manual_seed(0)
        rows = calibrate_rank(scenario, topology, dist.get_rank(), repeats=args.repeats, max_call_s=args.max_call_s,
                              heartbeat=lambda label: None, used_only=args.used_only)
        if rows is not None:
            write_atomic(Path(args.out), rows.to_csv(index=False, lineterminator="\n"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
