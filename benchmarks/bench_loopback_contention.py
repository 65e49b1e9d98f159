"""Whether a machine's core contention shows on loopback as in place: a calibration's loopback rows
(:mod:`runtime.loopback_contention`, what every CPU calibration now times after its launch) against
the in-place calls of a profile whose links have no delay, at a few compute times between calls
(issue 18).

Why: a calibration whose links all have a delay cannot show the cost of a message between ranks
that outnumber their cores (:func:`sim.calibrated.contention_floor`), so its profile prices that
cost from the same calls timed on loopback; this says how close loopback comes to in place, and
how much the compute between calls (:data:`runtime.loopback_contention.COMPUTE_S`) matters.

For each ``--compute-ms``: :func:`runtime.loopback_contention.loopback_rows` of ``--profile`` (its
in-place calls' kinds and algorithms at their smallest size, at each group size of
:func:`runtime.loopback_contention.loopback_sizes`), printed per group size beside the profile's own
in-place medians (ms). Then the contention floor per core turn ``contention_floor`` fits on each
(point-to-point, gloo's own), at the profile's cluster.

Measured 2026-11-30 06:36 UTC on the project's 2-vCPU VM (AMD EPYC), nothing else running, the
session-29 profile of v2x2_bandwidth (4 ranks on 2 hosts, 2 cores, no delay): in place, gloo's
allreduce 4.57 ms, recursive doubling 2.09, Rabenseifner 5.16, reduce 2.86, broadcast 0.39; fitted
per core turn 0.51 ms (point-to-point) and 0.25 ms (gloo's own). On loopback over 4 ranks with 0.35 /
0.5 / 1 ms of compute between calls: gloo's allreduce 4.50 / 4.68 / 5.62, recursive doubling 3.68 /
3.42 / 4.02, Rabenseifner 7.77 / 8.15 / 8.29, reduce 2.92 / 2.46 / 3.18, broadcast 0.45 / 0.63 /
0.83; per core turn 0.61 / 0.57 / 0.67 ms and 0.25 / 0.26 / 0.31 ms. gloo's own calls come out as in
place; the point-to-point ones 10-30% dearer per turn, whatever the compute (in place on 4 hosts of
1 rank, v4x1_bandwidth in ``validation/transfer-report/fresh-s30b``: 0.28 ms).

Run: ``PYTHONPATH=. python benchmarks/bench_loopback_contention.py [--profile CSV] [--compute-ms 0.35 0.5 1]``
"""

from __future__ import annotations

import argparse
import os
import platform

import pandas as pd

import runtime.loopback_contention as loopback
from sim.calibrated import contention_floor
from sim.context import profile_contexts
from sim.profile import Profile, load_profile, with_rows
from sim.transport import fit_profile
from sim.vocabulary import MeasurementKind

DEFAULT_PROFILE = "validation/transfer-report/fresh-s29/profiles/v2x2_bandwidth.csv"


def _medians_ms(rows: pd.DataFrame) -> str:
    return "; ".join(f"{r.op} {r.algorithm} {r.median * 1e3:.2f}" for r in rows.itertuples(index=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[0.35, 0.5, 1.0])
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    profile = load_profile(args.profile)
    (context,) = profile_contexts(profile.rows)
    in_place = profile.of(MeasurementKind.COLLECTIVE_IN_PLACE)
    in_place = in_place[in_place["size_bytes"] == in_place["size_bytes"].min()]
    print(f"in place on {context.name}: {_medians_ms(in_place.groupby(['op', 'algorithm'], as_index=False).median(numeric_only=True))}")
    without = Profile(profile.rows[profile.rows["measurement"] != MeasurementKind.COLLECTIVE_LOOPBACK])
    fitted = fit_profile(profile.of(MeasurementKind.COLLECTIVE), context)
    floors = [contention_floor(without, (context,), context, fitted, library=library)[0] for library in (False, True)]
    print(f"  per core turn, in place: {floors[0] * 1e3:.2f} ms point-to-point, {floors[1] * 1e3:.2f} ms gloo's own")
    for compute_ms in args.compute_ms:
        loopback.COMPUTE_S = compute_ms / 1e3
        rows = pd.DataFrame(loopback.loopback_rows(profile.rows, context.cores, sum(context.ranks_per_host)))
        timed = Profile(with_rows(without.rows[without.rows["measurement"] != MeasurementKind.COLLECTIVE_IN_PLACE],
                                  rows.to_dict("records")))
        for size, group in rows.groupby("group_size"):
            print(f"{compute_ms} ms of compute, loopback over {size} ranks: {_medians_ms(group)}")
        floors = [contention_floor(timed, (context,), context, fitted, library=library)[0] for library in (False, True)]
        print(f"  per core turn, from loopback: {floors[0] * 1e3:.2f} ms point-to-point, "
              f"{floors[1] * 1e3:.2f} ms gloo's own")


if __name__ == "__main__":
    main()
