"""The torchrun entry point: one rank of ``hetsim measure`` or ``hetsim calibrate`` on a real cluster.

::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m runtime.torchrun measure scenarios/SCENARIO.yaml --out out/measured
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m runtime.torchrun calibrate scenarios/SCENARIO.yaml --out profile.csv

Each process reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment
(env:// rendezvous); there must be one per rank of the scenario's tensor-parallel group
(:class:`sim.parallel.ParallelPlan`), or of a training scenario's tensor x data ranks (its
data-parallel group for ``calibrate``; :mod:`runtime.training`: DDP over NCCL on GPUs, untested so far). ``measure`` runs on GPU ``LOCAL_RANK`` over NCCL where CUDA
is present, else on the CPU over gloo (:func:`runtime.device.local_device`); ``calibrate`` times
CPU ranks over gloo (NCCL calibration of GPUs is not built yet). The hosts' clocks are put on
rank 0's first (:func:`runtime.clock.synchronise`), then :func:`runtime.worker.run_rank` or
:func:`runtime.calibrate.calibrate_rank` runs, and rank 0 writes results.csv and trace.json, or
the profile. A bad scenario, or a world size other than the group's, exits with code 2 and a
one-line error.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from models.errors import ConfigError
from runtime import clock
from runtime.calibrate import calibrate_rank
from runtime.device import Device, local_device
from runtime.measure import measured_result, write_measured_outputs
from runtime.training.calibrate import calibrate_training_rank
from runtime.training.measure import measured_training, train_rank
from runtime.training.ranks import training_ranks
from runtime.worker import run_rank
from sim.outputs import write_atomic
from sim.parallel import ParallelPlan
from sim.scenario import load_scenario
from sim.topology import build_topology


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime.torchrun", description="one rank of hetsim measure "
                                                                                  "or hetsim calibrate")
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("measure", help="measure every variant of the scenario")
    measure.add_argument("--out", default=None, help="where rank 0 writes results.csv and trace.json")
    measure.add_argument("--warmup", type=int, default=1)
    measure.add_argument("--seed", type=int, default=0)
    measure.add_argument("--block-dir", default=None,
                         help="cache of weight block files for weight streaming (default: under the temp dir)")
    calibrate = commands.add_parser("calibrate", help="run the calibration microbenchmarks")
    calibrate.add_argument("--out", required=True, help="where rank 0 writes the profile (CSV)")
    calibrate.add_argument("--max-call", type=float, default=1.0, dest="max_call_s",
                           help="stop growing a collective's size once one call takes longer (s)")
    calibrate.add_argument("--used-only", action="store_true", help="time only the algorithms the variants call")
    for command in (measure, calibrate):
        command.add_argument("scenario")
        command.add_argument("--repeats", type=int, default=5)
        command.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run this process's rank (see the module docstring)."""
    args = _parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        scenario = load_scenario(args.scenario)
        topology = build_topology(scenario.config.cluster)
        training = scenario.config.is_training
        if training:
            ranks = training_ranks(scenario, topology).ranks
        else:  # a measurement runs every replica together (runtime.worker.run_rank); calibration one group
            plan = ParallelPlan.of(scenario, topology)
            ranks = plan.ranks if args.command == "measure" and plan.replicas > 1 else plan.tensor_ranks
        if world_size != len(ranks):
            what = "training ranks (tensor x data)" if training else "tensor-parallel group size"
            raise ConfigError("WORLD_SIZE", f"must be the scenario's {what} {len(ranks)} (got {world_size})")
    except ConfigError as error:
        print(f"hetsim: error: {error}", file=sys.stderr)
        sys.exit(2)
    device = local_device(int(os.environ.get("LOCAL_RANK", "0"))) if args.command == "measure" else Device("cpu")
    device.make_current()
    dist.init_process_group(device.backend, timeout=timedelta(seconds=args.timeout))
    try:
        clock.synchronise(device.torch_device)  # hosts' monotonic clocks differ: one timeline for the op records
        rank = dist.get_rank()
        if args.command == "measure" and training:
            gathered = train_rank(scenario, topology, rank, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                                  device=device.torch_device)
            if gathered is not None:
                write_measured_outputs(measured_training(scenario, topology, gathered, args.repeats),
                                       Path(args.out or f"out/{scenario.name}-measured"))
        elif args.command == "calibrate" and training:
            rows = calibrate_training_rank(scenario, topology, rank, repeats=args.repeats, device=device.torch_device,
                                           max_call_s=args.max_call_s)
            if rows is not None:
                write_atomic(Path(args.out), rows.to_csv(index=False, lineterminator="\n"))
        elif args.command == "measure":
            gathered = run_rank(scenario, topology, rank, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                                device=device.torch_device, block_dir=args.block_dir)
            if gathered is not None:
                write_measured_outputs(measured_result(scenario, topology, gathered),
                                       Path(args.out or f"out/{scenario.name}-measured"))
        else:
            torch.manual_seed(0)
            rows = calibrate_rank(scenario, topology, rank, repeats=args.repeats, max_call_s=args.max_call_s,
                                  heartbeat=lambda label: None, used_only=args.used_only)
            if rows is not None:
                write_atomic(Path(args.out), rows.to_csv(index=False, lineterminator="\n"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
