"""One rank's measurement job, the same whether launched locally (forked) or by torchrun.

After the process group is up, a rank builds its model shard once, then for each variant of the
scenario lowers the same :class:`~sim.plan.Plan` the simulator prices, runs ``warmup`` untimed
generations and ``repeats`` timed ones (each after a barrier), and hands its measurements to rank
0 with ``gather_object``. Rank 0 returns them all; the others return None.

Under torchrun (a real cluster)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m runtime.worker scenarios/SCENARIO.yaml --out out/measured

reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment (env://
rendezvous), uses NCCL when CUDA is present (one GPU per local rank) and gloo otherwise, and
rank 0 writes results.csv and trace.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from runtime.comm import Communicator
from runtime.executor import Executor
from runtime.model import RankModel
from runtime.weights import prompt_tokens
from sim.plan import Plan, StrategyChoice
from sim.scenario import Scenario

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured for one variant.

    ``step_start_s``/``step_end_s``: [repeats, steps] arrays (s from each repeat's start);
    ``records``: op records of the last repeat (tuples in :data:`sim.trace.OP_COLUMNS` order);
    ``tokens``: [repeats, batch, output_tokens] generated ids (master; empty elsewhere);
    ``peak_memory_bytes``: process high-water mark (CPU: max RSS) or max CUDA memory allocated;
    ``memory_samples``: (time_s, bytes) after each step of the last repeat.
    """

    rank: int
    variant: str
    step_start_s: np.ndarray
    step_end_s: np.ndarray
    records: list[tuple]
    tokens: np.ndarray
    peak_memory_bytes: int
    memory_samples: list[tuple[float, int]]


def current_memory_bytes(device: torch.device) -> int:
    """Device memory in use now: resident set size on CPU, allocated CUDA memory on GPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory_bytes(device: torch.device) -> int:
    """High-water mark: max RSS of this process on CPU (ru_maxrss is KiB on Linux), max CUDA memory allocated on GPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(scenario: Scenario, topology, rank: int, *, repeats: int, warmup: int, seed: int,
             device: torch.device, heartbeat: Callable[[str], None] = lambda label: None) -> list | None:
    """Measure every variant of ``scenario`` on this rank; returns all ranks' measurements on rank 0.

    Requires an initialised default process group whose ranks are the plan's ranks.
    """
    from sim.simulate import tensor_parallel_ranks

    config, spec = scenario.config, scenario.model
    ranks = tensor_parallel_ranks(scenario, topology)
    workload = config.workload
    dtype = TORCH_DTYPES[spec.dtype]
    model = RankModel(spec, len(ranks), ranks.index(rank), seed=seed, batch_size=workload.batch_size,
                      max_tokens=workload.prompt_tokens + workload.output_tokens, device=device, dtype=dtype)
    prompt = prompt_tokens(spec, workload.batch_size, workload.prompt_tokens, seed).to(device)
    comm = Communicator(rank, topology.host_groups)
    measurements = []
    for variant in config.variants:
        plan = Plan(spec, ranks, workload.batch_size, workload.prompt_tokens, workload.output_tokens,
                    StrategyChoice(variant.strategy, variant.allreduce, variant.reduce, variant.broadcast))
        executor = Executor(plan, model, comm, rank, memory_probe=lambda: current_memory_bytes(device))
        for index in range(warmup):
            executor.generate(prompt, time.perf_counter(), lambda step: heartbeat(f"{variant.name} warmup {index} step {step}"))
        starts, ends, tokens = [], [], []
        for index in range(repeats):
            t0 = _common_start(device)
            generation = executor.generate(prompt, t0, lambda step: heartbeat(f"{variant.name} repeat {index} step {step}"))
            starts.append(generation.step_start_s)
            ends.append(generation.step_end_s)
            if generation.tokens:
                tokens.append(torch.stack(generation.tokens, dim=1).cpu().numpy())
        memory_samples = list(zip(generation.step_end_s, generation.memory_bytes))
        measurements.append(RankMeasurement(
            rank, variant.name, np.array(starts), np.array(ends),
            [tuple(vars(r).values()) for r in generation.records],
            np.array(tokens) if tokens else np.zeros((0,), dtype=np.int64),
            peak_memory_bytes(device), memory_samples))
    heartbeat("gather")
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(measurements, gathered, dst=0)
    return gathered if rank == 0 else None


def _common_start(device: torch.device) -> float:
    """A barrier, then rank 0's clock reading shared by all (ranks of one machine share the clock)."""
    dist.barrier()
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)  # NCCL needs device tensors
    dist.broadcast(t0, src=0)
    return float(t0.item())


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point (see the module docstring)."""
    from models.errors import ConfigError
    from runtime.measure import measured_result, write_measured_outputs
    from sim.scenario import load_scenario
    from sim.topology import build_topology

    parser = argparse.ArgumentParser(prog="python -m runtime.worker", description="one rank of hetsim measure")
    parser.add_argument("scenario")
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
        topology = build_topology(scenario.config.cluster)
    except ConfigError as error:
        print(f"hetsim: error: {error}", file=sys.stderr)
        sys.exit(2)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    try:
        gathered = run_rank(scenario, topology, dist.get_rank(), repeats=args.repeats, warmup=args.warmup,
                            seed=args.seed, device=device)
        if gathered is not None:
            result = measured_result(scenario, topology, gathered)
            write_measured_outputs(result, Path(args.out or f"out/{scenario.name}-measured"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
