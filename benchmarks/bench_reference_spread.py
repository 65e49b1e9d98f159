"""The reference timing's own spread (issue 18): the machine's reference op set
(:mod:`runtime.reference_timing`) timed alone, ``--samples`` times ``--interval`` seconds apart,
each with the share of the machine's CPU time the hypervisor stole and other processes took
meanwhile (:mod:`runtime.cpu_steal`). Where ``HETSIM_TESTBED_LOCK`` names a file, each timing
holds it (:func:`validation.validate.testbed_turn`), so no testbed run shares the machine then.

On a quiet machine the spread is the timing's noise plus the VM's own stretch over the span; with
other processes running it is an upper bound, driven by them (their share is printed beside).

Run: ``HETSIM_TESTBED_LOCK=/work/testbed.lock PYTHONPATH=. .venv/bin/python
benchmarks/bench_reference_spread.py [--samples 11] [--interval 60]`` (10 minutes by default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone

from runtime.cpu_steal import cpu_sample, own_ticks
from runtime.reference_timing import medians, reference_samples
from sim.machine_speed import ReferenceOp
from validation.validate import testbed_turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=11)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between the starts of two timings")
    args = parser.parse_args()
    seen: dict[str, list[float]] = {}
    print("| UTC | " + " | ".join(f"{op} ms" for op in ReferenceOp) + " | took s | steal | other load |")
    print("|---|---|---|---|---|---|")
    for index in range(args.samples):
        start = time.monotonic()
        with testbed_turn():
            before, ours = cpu_sample(()), own_ticks()
            took = time.perf_counter()
            times = medians(reference_samples())
            took = time.perf_counter() - took
            span = cpu_sample(()) - before
        # busy ticks less this process's and its reaped child's: the other processes' share
        other = max(0, span.busy - (own_ticks() - ours)) / span.total if span.total else float("nan")
        for op, seconds in times.items():
            seen.setdefault(op, []).append(seconds)
        print(f"| {datetime.now(timezone.utc):%H:%M:%S} | " + " | ".join(f"{times[op] * 1e3:.2f}" for op in ReferenceOp)
              + f" | {took:.2f} | {span.steal_fraction:.1%} | {other:.1%} |", flush=True)
        if index + 1 < args.samples:
            time.sleep(max(0.0, args.interval - (time.monotonic() - start)))
    for op, values in sorted(seen.items()):
        print(f"{op}: median {statistics.median(values) * 1e3:.2f} ms, {min(values) * 1e3:.2f}-{max(values) * 1e3:.2f} ms "
              f"(max / min {max(values) / min(values):.2f})")


if __name__ == "__main__":
    main()
