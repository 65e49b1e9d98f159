"""Calibration and measurement interleaved in one launch: how ``hetsim validate`` runs a cluster.

A shared machine does not hold still: on the 2-core testbed the hypervisor takes 6-24% of the
CPU time from one minute to the next, and the same case's TPOT moved 8-30% between launches a few
minutes apart. A calibration run at one time and a measurement at another then disagree by that
drift whatever the simulator does: in the shipped report of the bracketed flow (a launch before
the calibration and one after), every error of the latency-bound 4-host cluster had one sign,
and so had every TTFT and TPOT error of the hold-out matrix.

So one launch does both, in rounds. Every round runs one measured generation of every variant of
every case (:class:`runtime.worker.MeasurementRounds`); ``calibration_repeats`` rounds, spread
evenly among them, also run one calibration generation of every strategy at every calibration
prompt (:class:`runtime.calibrate.CalibrationGenerations`) and one call of every case of the
collective sweep (:class:`runtime.comm_timing.CollectiveSweep`), in reverse order every other
round. There are as many rounds as a measurement alone would time
(:func:`runtime.worker.timed_rounds`), and at least ``calibration_repeats``. The
calibration and the measurement then sample the same minutes of the machine, and what is left
between them is the sampling noise within those minutes and the simulator's own error.

What the interleaving leaves out: peak memory, which the measured runs read as the process's
resident high-water mark, and which this process's extra executors and the sweep's buffers would
raise; ``hetsim validate`` measures it in a short launch of its own per case
(:func:`runtime.measure.launch_measurement` with no timed round). The calibration's memory
baseline is read here, after the warm-up and before the sweep allocates its buffers.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from runtime import memory_probe
from runtime.calibrate import (CALIBRATION_MAX_TOKENS, CalibrationGenerations, alone_rows, gather_profile, machine_rows,
                               used_algorithms)
from runtime.comm import Communicator
from runtime.comm_timing import CollectiveSweep, p2p_rows
from runtime.cpu_steal import ZERO, cpu_sample
from runtime.reference_timing import medians, timed_around
from runtime.worker import MeasurementRounds, RankMeasurement, paced_loader, rank_model, timed_rounds
from sim.context import load_rows, speed_rows
from sim.parallel import ParallelPlan
from sim.profile import with_rows
from sim.scenario import Scenario


@dataclass(frozen=True)
class InterleavedResult:
    """What one interleaved launch gives: the calibration ``profile`` (a profile table), the
    ``measurements`` of each case (``[case][rank][variant]``, peak memory not read), the
    ``rounds`` of each part (``measurement``, ``calibration``) and the machine's CPU time during
    the measured generations and during the calibration (:mod:`runtime.cpu_steal`): the share
    the hypervisor stole (``measurement_cpu_steal``, ``calibration_cpu_steal``) and the share
    other processes on the machine took (``measurement_other_load``, ``calibration_other_load``);
    ``reference_s``: the machine's speed around the launch (the reference op set's median times,
    s by op, :mod:`runtime.reference_timing`), which the profile's ``speed`` context row records
    too: the calibration and the measurement share it, as they share the launch."""

    profile: pd.DataFrame
    measurements: list[list[list[RankMeasurement]]]
    rounds: dict[str, int]
    measurement_cpu_steal: float
    calibration_cpu_steal: float
    measurement_other_load: float = float("nan")
    calibration_other_load: float = float("nan")
    reference_s: dict[str, float] = field(default_factory=dict)


def spread(count: int, rounds: int) -> set[int]:
    """``count`` round indices out of ``rounds``, evenly spread and including the first and the
    last (all of them when ``count >= rounds``).

    Raises:
        ValueError: ``count`` or ``rounds`` below 1.
    """
    if count < 1 or rounds < 1:
        raise ValueError(f"count and rounds must be at least 1 (got {count}, {rounds})")
    return {int(i) for i in np.round(np.linspace(0, rounds - 1, min(count, rounds)))}


def interleaved_rank(scenario: Scenario, cases: list[Scenario], topology, rank: int, *, repeats: int, warmup: int,
                     min_timed_s: float, calibration_repeats: int, max_call_s: float, used_only: bool,
                     held_out_sizes: tuple[int, ...], heartbeat: Callable[[str], None], seed: int = 0,
                     testbed: bool = False):
    """This rank's part of an interleaved launch (see the module docstring); rank 0 returns the
    :class:`InterleavedResult`, the others None.

    Args:
        scenario: the cluster's scenario, which the calibration runs (its strategies).
        cases: the scenarios measured, ``scenario`` at each prompt length.
        repeats, warmup, min_timed_s: the measured rounds, as :func:`runtime.worker.run_rank` counts them.
        calibration_repeats: rounds of the calibration generations and of the collective sweep.
        max_call_s, used_only, held_out_sizes: the collective sweep's, as :func:`runtime.calibrate.calibrate_rank`'s.
        testbed: the rank runs on the emulated testbed (:func:`runtime.calibrate.gather_profile`).
    """
    memory_probe.configure_allocator(exact=False)  # the measured runs' malloc settings
    device = torch.device("cpu")
    parallel = ParallelPlan.of(scenario, topology)
    ranks, shards = parallel.tensor_ranks, parallel.shards
    longest = max(c.config.workload.prompt_tokens + c.config.workload.output_tokens for c in cases)
    model, store = rank_model(scenario, ranks, rank, seed=seed, max_tokens=max(longest, CALIBRATION_MAX_TOKENS),
                              device=device, shards=shards)
    comm = Communicator(rank, topology.host_groups)
    pids = [None] * len(ranks)
    dist.all_gather_object(pids, os.getpid())  # the ranks' processes, whose CPU time is not "other"
    spent = {"measurement": ZERO, "calibration": ZERO}

    @contextmanager
    def stolen(part: str):
        before = cpu_sample(pids)
        yield
        spent[part] = spent[part] + (cpu_sample(pids) - before)

    with paced_loader(store, topology, ranks[0], rank, device) as loader:
        measured = MeasurementRounds(cases, ranks, rank, model, comm, loader, device, seed, heartbeat, shards=shards,
                                     keep_rounds=True)
        generations = CalibrationGenerations(scenario, ranks, topology, rank, comm, model, loader, heartbeat,
                                             shards=shards)
        # The rounds a measurement alone would time (min_timed_s judged by the case whose
        # slowest warm-up generation is shortest, so that every case times that long at least).
        warm = [measured.round(f"warmup {index}", timed=False) for index in range(warmup)]
        slowest_s = min(np.max(warm, axis=0)) if warm else 0.0
        generations.round(0, timed=False)
        framework_bytes = generations.framework_bytes()  # before the sweep's buffers exist
        sweep = CollectiveSweep(ranks, topology, rank, comm, max_call_s, heartbeat,
                                algorithms=used_algorithms(scenario) if used_only else None, held_out=held_out_sizes,
                                one_host=True)
        counts = torch.tensor([max(timed_rounds(repeats, min_timed_s, slowest_s), calibration_repeats)],
                              dtype=torch.int64, device=device)
        dist.broadcast(counts, src=ranks[0])
        total = int(counts.item())
        calibrating = sorted(spread(calibration_repeats, total))
        for index in range(total):
            parts = ["measurement", "generations", "sweep"] if index in calibrating else ["measurement"]
            done = calibrating.index(index) + 1 if index in calibrating else 0
            # Every other round in reverse, so that neither part always runs first in a round.
            for part in parts if index % 2 == 0 else reversed(parts):
                with stolen("measurement" if part == "measurement" else "calibration"):
                    if part == "measurement":
                        measured.round(f"repeat {index}")
                    elif part == "generations":
                        generations.round(done, timed=True)
                    else:
                        sweep.round(f"round {done} of {calibration_repeats}")
        rows = sweep.rows() + p2p_rows(ranks, topology, rank, calibration_repeats, heartbeat)
        with stolen("calibration"):  # what hetsim calibrate times alone, so that both profiles hold the same rows
            rows += alone_rows(scenario, generations, model)
        profile = gather_profile(generations, framework_bytes, rows, testbed)
        mine = measured.measurements(memory=False)
        heartbeat("gather")
        gathered = [None] * len(ranks) if rank == ranks[0] else None
        dist.gather_object(mine, gathered, dst=ranks[0])
    if rank != ranks[0]:
        return None
    # The profile carries the load its own rounds ran under, as hetsim calibrate's does.
    profile = with_rows(profile, load_rows(scenario.name, spent["calibration"].steal_fraction,
                                           spent["calibration"].other_load))
    return InterleavedResult(profile, [[per_rank[case] for per_rank in gathered] for case in range(len(cases))],
                             {"measurement": total, "calibration": calibration_repeats},
                             spent["measurement"].steal_fraction, spent["calibration"].steal_fraction,
                             spent["measurement"].other_load, spent["calibration"].other_load)


def launch_interleaved(scenario: Scenario, cases: list[Scenario], *, testbed: bool, repeats: int, warmup: int,
                       min_timed_s: float, calibration_repeats: int, max_call_s: float = 1.0, used_only: bool = False,
                       held_out_sizes: tuple[int, ...] = (), hang_timeout_s: float = 300.0,
                       on_beat: Callable[[int, str], None] | None = None) -> InterleavedResult:
    """Run :func:`interleaved_rank` in forked ranks (in the testbed's namespaces if ``testbed``),
    the reference op set timed before and after (:func:`runtime.reference_timing.timed_around`).

    Raises:
        ConfigError: ``testbed`` while the scenario's testbed is not up.
        runtime.errors.LaunchError: a rank failed, died or hung.
    """
    from runtime.measure import launch_scenario

    def body(topology, rank: int, heartbeat) -> object:
        torch.manual_seed(0)
        return interleaved_rank(scenario, cases, topology, rank, repeats=repeats, warmup=warmup,
                                min_timed_s=min_timed_s, calibration_repeats=calibration_repeats,
                                max_call_s=max_call_s, used_only=used_only, held_out_sizes=tuple(held_out_sizes),
                                heartbeat=heartbeat, testbed=testbed)

    run, samples = timed_around(lambda: launch_scenario(scenario, body, testbed=testbed,
                                                        hang_timeout_s=hang_timeout_s, on_beat=on_beat))
    reference = medians(samples)
    # what hetsim calibrate times of the machine after its launch
    rows = speed_rows(scenario.name, reference) + machine_rows(scenario, run.profile, calibration_repeats, testbed)
    return replace(run, profile=with_rows(run.profile, rows), reference_s=reference)
