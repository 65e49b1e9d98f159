"""A training rank's measured memory against torch's own count of its live tensors and against the
simulator's ledger, every case of a training matrix, on this machine (issue 19, item 5: peak
memory within 5%).

Each case runs in ranks forked for it alone over gloo on loopback (the matrix's first cluster's
layout, no testbed and no network namespace: a rank's memory does not depend on its links), which
read one step's memory as ``hetsim measure`` does (:func:`runtime.training.memory.exact_step_memory`),
then train one more step under torch's profiler with ``profile_memory``: the largest running
total of the CPU allocator over that step's allocation events
(``ExtraFields<EventType::Allocation>::total_allocated_``, ``torch/csrc/profiler/collection.h``;
the calling thread's, which runs the backward on the CPU; the comm hook's thread is not profiled)
is the most bytes of tensors the step held at once beyond those alive before it.

Printed per case, MB, rank 0 and the spread over ranks: the read peak over the resident
(``peak``), the live tensors' (``live``), the ledger's gradients where the step allocates them
plus activations (``ledger``: :func:`models.training.training_memory` through
:func:`sim.training.simulate.simulate_training`), the measured and simulated activations, the
measured framework, and peak memory measured against simulated, the simulated framework being what
the calibration reads (:func:`runtime.training.calibrate.framework_after_steps` on the first
case, the median over ranks). ``--fast-steps K`` first trains K steps in the fast allocator, as
the runtime did before it read the memory first: the peak then counts the heap's free chunks again
(:mod:`runtime.training.memory`). About 15 s a case on the project's 2-core machine.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_training_memory.py [--matrix validation/training-quick.yaml] [--fast-steps K] [CASE ...]``
"""

from __future__ import annotations

import argparse
import statistics

import torch

from runtime import memory_probe
from runtime.device import device_of
from runtime.launch import launch
from runtime.training.calibrate import framework_after_steps
from runtime.training.memory import exact_step_memory, memory_categories, state_bytes
from runtime.training.ranks import training_ranks
from runtime.training.trainer import Trainer, TrainingSetup, process_groups
from sim.topology import build_topology
from sim.training.simulate import simulate_training
from validation.training_validation import load_training_matrix

MB = 1e6


def _allocations(nodes):
    for node in nodes:
        if node.tag == torch._C._profiler._EventType.Allocation:
            yield node
        yield from _allocations(node.children)


def live_tensor_peak(trainer, step: int) -> int:
    """The most bytes of tensors allocated in step ``step`` alive at once (see the module)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        trainer.step(step)
    events = profiler.profiler.kineto_results.experimental_event_tree()
    return max((node.extra_fields.total_allocated for node in _allocations(events)), default=0)


def measure_case(scenario, variant, fast_steps: int) -> list[dict]:
    """Every rank's readings of ``variant`` (bytes)."""
    topology = build_topology(scenario.config.cluster)
    layout = training_ranks(scenario, topology)

    def body(rank: int, heartbeat) -> dict:
        groups = process_groups(layout, rank)
        setup = TrainingSetup.of_ranks(scenario, variant, layout)

        def build():
            if fast_steps:  # the old order: trained in the fast allocator first
                memory_probe.configure_allocator(exact=False)
            trainer = Trainer(setup, rank, topology.host_groups, seed=0, groups=groups)
            for step in range(fast_steps):
                trainer.step(step)
            memory_probe.configure_allocator(exact=True)
            return trainer

        memory_probe.configure_allocator(exact=False)
        probe = device_of("cpu")
        trainer, memory = exact_step_memory(build, probe, first_step=fast_steps)
        categories = memory_categories(memory.resident_bytes, memory.peak_bytes, state_bytes(trainer))
        with memory_probe.exact_allocation():
            live = live_tensor_peak(trainer, fast_steps + memory.steps)
        trainer.close()
        return {"peak": memory.peak_bytes, "resident": memory.resident_bytes, "live": live, **categories}

    return launch(body, len(layout.ranks), hang_timeout_s=300)


def calibrated_framework(scenario) -> float:
    """The calibration's framework memory (bytes): the median over ranks of
    :func:`runtime.training.calibrate.framework_after_steps` on the first case."""
    topology = build_topology(scenario.config.cluster)
    layout = training_ranks(scenario, topology)
    setup_variant = scenario.config.variants[0]

    def body(rank: int, heartbeat) -> int:
        memory_probe.configure_allocator(exact=False)
        groups = process_groups(layout, rank)
        return framework_after_steps(TrainingSetup.of_ranks(scenario, setup_variant, layout), rank, topology, groups,
                                     torch.device("cpu"))

    return statistics.median(launch(body, len(layout.ranks), hang_timeout_s=300))


def _spread(values: list[float]) -> str:
    return f"{values[0] / MB:6.1f} [{min(values) / MB:5.1f}, {max(values) / MB:5.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", default="validation/training-quick.yaml")
    parser.add_argument("--fast-steps", type=int, default=0)
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    scenario = load_training_matrix(args.matrix)[1][0]
    simulated = simulate_training(scenario)
    framework = calibrated_framework(scenario)
    print(f"{scenario.name}: framework read as the calibration reads it {framework / MB:.1f} MB; "
          f"{args.fast_steps} fast-allocator steps before the read")
    print("case | peak over resident | live tensors | ledger | activations measured | simulated | "
          "framework | peak measured | simulated | error")
    errors = []
    for variant in scenario.config.variants:
        if args.cases and variant.name not in args.cases:
            continue
        ranks = measure_case(scenario, variant, args.fast_steps)
        ledger = simulated.variant(variant.name).memory[0]
        allocated = 0 if ledger.bucket_buffers == 0 else ledger.gradients  # views into the buckets allocate nothing
        predicted = ledger.total - ledger.framework + framework
        error = [(predicted - r["peak"]) / r["peak"] for r in ranks]
        errors += error
        print(f"{variant.name} | {_spread([r['peak'] - r['resident'] for r in ranks])} | {_spread([r['live'] for r in ranks])}"
              f" | {(allocated + ledger.activations) / MB:.1f} | {_spread([r['activations'] for r in ranks])}"
              f" | {ledger.activations / MB:.1f} | {_spread([r['framework'] for r in ranks])}"
              f" | {_spread([r['peak'] for r in ranks])} | {predicted / MB:.1f}"
              f" | {100 * min(error):+.1f}% to {100 * max(error):+.1f}%", flush=True)
    magnitudes = sorted(abs(e) for e in errors)
    print(f"peak_memory_bytes |error| over {len(errors)} (case, rank): median {100 * statistics.median(magnitudes):.1f}%, "
          f"max {100 * magnitudes[-1]:.1f}%")


if __name__ == "__main__":
    main()
