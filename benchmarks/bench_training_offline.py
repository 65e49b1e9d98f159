"""Offline re-simulation of a training validation report (issue 19): every cluster's cases
simulated with every cluster's shipped profile, against its shipped measurement; no testbed.

``hetsim validate`` of a training matrix saves each cluster's calibration and measurement under
``REPORT/clusters/<cluster>/`` (``profile.csv``, ``measured.csv``, ``load.json``); here they are
read back and compared as the validation compares them
(:func:`validation.training_validation.compare_clusters`): a cluster's cases with its own
profile are a **replay**, with another cluster's a **prediction**; where the matrix says
``transfer: true``, also with the others' pooled and with none, and the transfer figure per
(source, target) pair (:mod:`validation.training_transfer`; ``--out`` writes it under ``transfer/``). Prints
the summary table (median, p90 and max |error| per mode and metric, the ranking, the overlap
gains) and the signed error of every case per phase; where the report kept each case's measured
ops (``clusters/<cluster>/trace.csv``, which ``hetsim validate`` writes since session 14), also
each case's chain of bucket allreduces on rank 0, measured against simulated
(:func:`bucket_chains`: where a case's communication departs from the calibrated collectives
that price it) and each of its buckets against its replayed isolated price, before and after the
backward's last gradient (:func:`bucket_excess`: what a queued bucket pays per message beyond
it, beside the TCP retransmissions measured since session 15); and every calibrated collective
row against the transport terms fitted on each cluster's sweep (:func:`transport_rows`: whether
a cluster's terms describe its own rows, and the other's). ``--out`` writes the report's tables
(``errors.csv``, ``overlap.csv``, ``summary.md``, ...) there. Depends on nothing but the stored
files, not on the machine's load. Under a minute on the project's 2-core machine.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_training_offline.py [--matrix validation/training.yaml] [--report validation/training-report] [--out DIR] [--core-turns ...]`` (the pricing switches of :mod:`validation.pricing_options`, each with its ``--no-`` form)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from models.ops import OpKind
from sim.collectives.registry import build_schedule
from sim.context import profile_contexts
from sim.program import Stream
from sim.training.metrics import union_length_s
from sim.profile import ISOLATED, MeasurementKind
from sim.training.simulate import simulate_training
from sim.transport import context_topology, fit_profile, price
from sim.vocabulary import Metric
from validation.pricing_options import add_pricing_options, apply_pricing_options
from validation.training_transfer import summary_markdown as training_transfer_summary, transfer_cases
from validation.training_validation import (compare_clusters, load_report_clusters, load_training_matrix,
                                            summary_markdown, write_training_validation)

ROOT = Path(__file__).resolve().parent.parent
PHASES = (Metric.STEP_TIME, Metric.FORWARD_TIME, Metric.BACKWARD_TIME, Metric.OPTIMIZER_TIME,
          Metric.EXPOSED_COMMUNICATION)
"""The per-case columns printed: the step and where its error comes from."""


def signed_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Per (cluster, profile, case): the signed error of each of :data:`PHASES`, in percent."""
    chosen = errors[errors["metric"].isin([str(m) for m in PHASES])]
    table = chosen.pivot_table(index=["cluster", "calibrated_on", "case"], columns="metric", values="error",
                               sort=False)
    return (100 * table[[str(m) for m in PHASES if str(m) in table.columns]]).round(1)


def _chain(ops: pd.DataFrame) -> tuple[int, float, float, float]:
    """(allreduces, first start to last end, union of their intervals, sum of their durations;
    s) of rank 0's allreduces on the communication stream in the last step of a trace's ``ops``.
    A simulated bucket's comm-thread work (:mod:`sim.training.comm_thread`) counts with its
    allreduce, as the measured call spans the comm thread's whole schedule."""
    ops = ops[(ops["rank"] == 0) & (ops["stream"] == Stream.COMM.value)
              & ops["kind"].isin([OpKind.ALLREDUCE.value, OpKind.COMM_THREAD.value])]
    ops = ops[ops["step"] == ops["step"].max()]
    count = int((ops["kind"] == OpKind.ALLREDUCE.value).sum())
    if not count:
        return 0, 0.0, 0.0, 0.0
    starts, ends = ops["start_s"].to_numpy(float), ops["end_s"].to_numpy(float)
    return count, float(ends.max() - starts.min()), union_length_s(starts, ends), float((ends - starts).sum())


def bucket_chains(scenarios, runs) -> pd.DataFrame:
    """Per cluster with a kept trace, profile and case: rank 0's chain of bucket allreduces in the
    case's last measured step and in its simulation with the profile (:func:`_chain`); empty
    where no cluster kept its trace."""
    rows = []
    for scenario in scenarios:
        measured = runs[scenario.name].trace
        if measured is None:
            continue
        for source, run in runs.items():
            simulated = simulate_training(scenario, run.profile)
            for variant in scenario.config.variants:
                m = _chain(measured[measured["variant"] == variant.name])
                s = _chain(simulated.variant(variant.name).trace.ops)
                rows.append({"cluster": scenario.name, "calibrated_on": source, "case": variant.name,
                             "buckets": m[0], "measured_span_s": m[1], "simulated_span_s": s[1],
                             "measured_busy_s": m[2], "simulated_busy_s": s[2],
                             "measured_mean_bucket_s": m[3] / m[0] if m[0] else float("nan"),
                             "simulated_mean_bucket_s": s[3] / s[0] if s[0] else float("nan")})
    return pd.DataFrame(rows)


def bucket_excess(scenarios, runs) -> pd.DataFrame:
    """Per cluster with a kept trace and case: rank 0's measured bucket allreduces of the last
    step set against each bucket's replayed price (its allreduce op in the simulation with the
    cluster's own profile: the calibrated isolated ``collective`` rows, interpolated at its size),
    split into the buckets that started while the backward still computed and those that started
    after its last gradient (without overlap, the first bucket's start; with it, the backward's
    start in the trace plus the case's measured median ``backward_s`` per micro-batch: an
    estimate, the trace keeps no ready times). ``excess_per_step_ms``:
    the after-backward buckets' measured less priced time over the schedule steps rank 0 takes part
    in: what each step of a queued bucket
    costs beyond its isolated timing; ``tcp_retransmitted_segments_per_step``: the TCP segments the
    cluster's hosts retransmitted per timed step, mean over its devices
    (:mod:`runtime.tcp_counters`), and ``dropped_packets_per_step``: the packets their tbf queues
    dropped per timed step (:func:`runtime.testbed.shaping.dropped_packets`), mean over its
    devices, where the report measured them. Empty where no cluster kept its trace."""
    rows = []
    for scenario in scenarios:
        run = runs[scenario.name]
        if run.trace is None:
            continue
        simulated = simulate_training(scenario, run.profile)
        group = tuple(replica[0] for replica in simulated.plan.replica_ranks)
        for variant in scenario.config.variants:
            result = simulated.variant(variant.name)
            ops = result.trace.ops
            ops = ops[(ops["rank"] == 0) & (ops["kind"] == OpKind.ALLREDUCE.value)
                      & (ops["stream"] == Stream.COMM.value) & ops["name"].str.startswith("bucket")]
            priced = {int(name[len("bucket"):-len("_allreduce")]): (end - start, size)
                      for name, start, end, size in zip(ops["name"], ops["start_s"], ops["end_s"], ops["bytes"])}
            trace = run.trace[(run.trace["variant"] == variant.name) & (run.trace["rank"] == 0)]
            buckets = trace[trace["kind"] == OpKind.ALLREDUCE.value]
            buckets = buckets[buckets["name"].str.startswith("bucket ")]
            if buckets.empty or not priced:
                continue
            backward = trace[trace["kind"] == OpKind.BACKWARD.value]
            backward_s = run.measured[(run.measured["variant"] == variant.name)
                                      & (run.measured["metric"] == str(Metric.BACKWARD_TIME))]["value"]
            last_gradient_s = float(backward["start_s"].max()) + float(backward_s.iloc[0]) / result.accumulation
            if not result.settings.overlap:  # every bucket waits for the last gradient
                last_gradient_s = float(buckets["start_s"].min())
            during, after, steps = [], [], 0
            for name, start, end in zip(buckets["name"], buckets["start_s"], buckets["end_s"]):
                price_s, size = priced[int(name.split()[1])]
                ratio = (end - start) / price_s
                if start < last_gradient_s:
                    during.append(ratio)
                    continue
                after.append((end - start, price_s))
                schedule = build_schedule(OpKind.ALLREDUCE, result.settings.allreduce, group, int(size),
                                          host_groups=simulated.topology.host_groups(group))
                steps += sum(1 for step in schedule.steps if any(group[0] in (t.src, t.dst) for t in step))
            case = run.measured[run.measured["variant"] == variant.name]
            rows.append({"cluster": scenario.name, "case": variant.name,
                         "during_backward": len(during),
                         "during_measured_over_priced": float(np.mean(during)) if during else float("nan"),
                         "after_backward": len(after),
                         "after_measured_over_priced": float(np.mean([m / p for m, p in after])) if after
                         else float("nan"),
                         "after_excess_s": sum(m - p for m, p in after),
                         "excess_per_step_ms": 1e3 * sum(m - p for m, p in after) / steps if steps else float("nan"),
                         # measured since session 15 (mean over the devices); NaN in reports measured before
                         **{str(metric): float(case[case["metric"] == str(metric)]["value"].mean())
                            for metric in (Metric.TCP_RETRANSMITTED_SEGMENTS, Metric.DROPPED_PACKETS)}})
    return pd.DataFrame(rows)


def transport_rows(runs) -> pd.DataFrame:
    """Per calibrated cluster, each isolated ``collective`` row of its profile against its
    schedule priced over that cluster's links and cores (:func:`sim.transport.context_topology`)
    with the transport terms fitted on each cluster's own sweep (:func:`sim.transport.fit_profile`:
    what a prediction from that profile prices every collective with, less the contention floor
    a prediction adds and the reduction, about 20 us per 256 KiB chunk here). The cluster's own
    fit shows whether its terms describe the rows they were fitted on; another's, whether they
    transfer. Empty where no profile records its context."""
    clusters = {}
    for name, run in runs.items():
        contexts = profile_contexts(run.profile.rows)
        if len(contexts) == 1:
            rows = run.profile.of(MeasurementKind.COLLECTIVE)
            clusters[name] = (contexts[0], rows, fit_profile(rows, contexts[0]))
    out = []
    for name, (context, rows, _) in clusters.items():
        topology = context_topology(context)
        for source, (_, _, fitted) in clusters.items():
            for row in rows.itertuples(index=False):
                terms = fitted.get((str(row.op), str(row.algorithm)))
                group = tuple(range(int(row.group_size)))
                if terms is None or row.size_bytes <= 0 or len(group) > topology.num_ranks:
                    continue
                schedule = build_schedule(row.op, row.algorithm, group, int(row.size_bytes),
                                          root=None if row.op == "allreduce" else group[0],
                                          host_groups=topology.host_groups(group))
                measured = float(getattr(row, ISOLATED))
                fitted_s = price(schedule, topology, terms, None, context.cores).duration_s
                out.append({"cluster": name, "fitted_on": source, "op": row.op, "algorithm": row.algorithm,
                            "size_bytes": int(row.size_bytes), "measured_s": measured, "p10_s": float(row.p10),
                            "p90_s": float(row.p90), "fitted_s": fitted_s, "error": fitted_s / measured - 1})
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, default=ROOT / "validation" / "training.yaml",
                        help="the training matrix file the report was run from")
    parser.add_argument("--report", type=Path, default=ROOT / "validation" / "training-report",
                        help="the report directory whose clusters/ hold the saved profiles and measurements")
    parser.add_argument("--out", type=Path, default=None, help="write the re-simulated report's tables here")
    add_pricing_options(parser)
    args = parser.parse_args()
    flags = apply_pricing_options(args)
    command = ("PYTHONPATH=. .venv/bin/python benchmarks/bench_training_offline.py "
               f"--matrix {args.matrix} --report {args.report}" + (f" --out {args.out}" if args.out else "")
               + "".join(f" {flag}" for flag in flags))
    started = time.perf_counter()
    matrix, scenarios = load_training_matrix(args.matrix)
    runs = load_report_clusters(scenarios, args.report)
    report = compare_clusters(scenarios, runs, on_progress=lambda text: print(text, file=sys.stderr),
                              transfer=matrix.transfer)
    print(summary_markdown(report, matrix.name))
    if matrix.transfer:
        print(training_transfer_summary(transfer_cases(report.errors), report.ranking, matrix.name, command))
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print("Signed errors per case (%, simulated / measured - 1):")
        print(signed_table(report.errors).to_string())
    fits = transport_rows(runs)
    if len(fits):
        with pd.option_context("display.width", 200, "display.max_rows", 500):
            print("\nIsolated collective rows against the transport terms fitted on each cluster's sweep (s):")
            print(fits.round(4).to_string(index=False))
            rms = fits.groupby(["cluster", "fitted_on"], sort=False)["error"].apply(
                lambda e: float(np.sqrt(np.mean(np.log1p(e) ** 2))))
            print("rms log error per cluster's rows and fit:")
            print(rms.round(2).to_string())
    chains = bucket_chains(scenarios, runs)
    if len(chains):
        with pd.option_context("display.width", 200, "display.max_rows", 500):
            print("\nBucket allreduces on rank 0, last measured step against the simulation (s):")
            print(chains.round(3).to_string(index=False))
    excess = bucket_excess(scenarios, runs)
    if len(excess):
        with pd.option_context("display.width", 200, "display.max_rows", 500):
            print("\nEach measured bucket (rank 0, last step) against its replayed isolated price, started while the "
                  "backward computed or after it:")
            print(excess.round(3).to_string(index=False))
    if args.out is not None:
        written = write_training_validation(report, args.out, matrix.name,
                                            transfer_command=command if matrix.transfer else None)
        print("wrote " + ", ".join(str(p) for p in written))
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
