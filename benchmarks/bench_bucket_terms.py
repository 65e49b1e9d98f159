"""Benchmark: where pricing the links' token buckets moves the transfer error (issue 18), offline.

With :data:`sim.token_bucket.PRICED` the shipped clusters' TTFT comes out lower whatever the
profile. Two tables locate it, both re-simulating the shipped reports (no testbed):

1. **Isolated collectives at prefill sizes**: every cluster's held-out isolated sweep
   (``collective_held_out`` rows: sizes the transport fit never saw, 96 KiB and 384 KiB being the
   GPT-2 fp32 prefill of 32 and 128 tokens) priced over its own calibrated links
   (:func:`sim.transport.context_topology`) with the terms fitted on each shipped profile
   (:func:`sim.transport.fit_profile`, ``same`` its own, ``other`` another's) or the gloo/tcp
   defaults (``none``), buckets off and on, each fit made as the pricing runs. Median |error|
   and median signed error per size.
2. **The prefill's terms**: each shipped target's TTFT split as :mod:`validation.terms` splits it
   (collective calls from the last arrival, the master's wait for it, compute and the rest),
   simulated (prediction: no profile, or the other clusters' pooled profiles) against the
   target's measured split (its report's ``terms.csv``); each group's contribution to the TTFT
   error, ``(simulated - measured) / measured TTFT``, median over the cases, buckets off and on.

About five minutes on the project's 2-core machine.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_bucket_terms.py [--core-turns] [--no-arrival-lags]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from sim import token_bucket
from sim.collectives.registry import build_schedule
from sim.context import profile_contexts
from sim.profile import MeasurementKind
from sim.simulate import simulate
from sim.transport import context_topology, default_terms, fit_profile, price
from validation.matrix import with_prompt
from validation.terms import metric_terms, phase_metrics, profile_gap_s
from validation.pricing_options import add_pricing_options, apply_pricing_options
from validation.transfer import NO_PROFILE, POOLED, SHIPPED, pooled_profile, shipped_clusters

TERM_GROUPS = ("collective", "wait", "compute and other")


def _group(term: str) -> str:
    if term.startswith("collective"):
        return TERM_GROUPS[0]
    return TERM_GROUPS[1] if term == "wait" else TERM_GROUPS[2]


def isolated_errors(clusters) -> pd.DataFrame:
    """Every held-out isolated collective of every cluster priced with every source's terms,
    buckets off and on: columns priced, pairs (same / other / none), size_bytes, error."""
    rows = []
    contexts = {c.name: profile_contexts(c.profile.rows)[0] for c in clusters}
    for priced in (False, True):
        token_bucket.PRICED = priced
        fits = {c.name: fit_profile(c.profile.of(MeasurementKind.COLLECTIVE), contexts[c.name], None,
                                    c.profile.of(MeasurementKind.P2P)) for c in clusters}
        for target in clusters:
            context = contexts[target.name]
            topology = context_topology(context)
            for row in target.profile.of(MeasurementKind.COLLECTIVE_HELD_OUT).itertuples(index=False):
                group = tuple(range(int(row.group_size)))
                schedule = build_schedule(row.op, row.algorithm, group, int(row.size_bytes),
                                          root=None if row.op == "allreduce" else group[0],
                                          host_groups=topology.host_groups(group))
                for source in [*fits, NO_PROFILE]:
                    terms = (default_terms(row.algorithm, kind=row.op) if source == NO_PROFILE
                             else fits[source].get((row.op, row.algorithm)))
                    if terms is None:
                        continue
                    simulated = price(schedule, topology, terms, None, context.cores).duration_s
                    pairs = NO_PROFILE if source == NO_PROFILE else "same" if source == target.name else "other"
                    rows.append({"priced": priced, "pairs": pairs, "size_bytes": int(row.size_bytes),
                                 "error": simulated / float(row.median) - 1})
    return pd.DataFrame(rows)


def prefill_term_contributions(clusters) -> pd.DataFrame:
    """Per (source, target, prompt, variant, term group): the group's contribution to the TTFT
    error with buckets off and on (columns ``off``, ``on``)."""
    rows = []
    for target in clusters:
        if target.terms is None:
            continue
        pooled = pooled_profile([c.profile for c in clusters if c.name != target.name])
        for prompt in sorted(target.measured["prompt_tokens"].unique()):
            measured = target.terms[(target.terms["prompt_tokens"] == prompt) & (target.terms["phase"] == "prefill")]
            for source, profile in ((NO_PROFILE, None), (POOLED, pooled)):
                split: dict[bool, dict[str, pd.Series]] = {}
                for priced in (False, True):
                    token_bucket.PRICED = priced
                    result = simulate(with_prompt(target.scenario, int(prompt)), profile=profile)
                    gap_s = profile_gap_s(profile, result.topology.devices[result.ranks[0]].spec.name)
                    split[priced] = {ran.variant.name: metric_terms([ran.trace], phase_metrics(ran.timing), gap_s)["prefill"]
                                     for ran in result.variants}
                for variant, of_variant in measured.groupby("variant"):
                    if variant not in split[False]:
                        continue
                    measured_s = of_variant.set_index("term")["measured_s"]
                    ttft_s = float(measured_s.sum())
                    for group in TERM_GROUPS:
                        def seconds(terms: pd.Series) -> float:
                            return float(sum(v for term, v in terms.items() if _group(term) == group))
                        rows.append({"source": source, "target": target.name, "prompt_tokens": int(prompt),
                                     "variant": variant, "group": group,
                                     **{label: (seconds(split[priced][variant]) - seconds(measured_s)) / ttft_s
                                        for label, priced in (("off", False), ("on", True))}})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pricing_options(parser, ("--arrival-lags", "--core-turns"))
    apply_pricing_options(parser.parse_args())
    started = time.perf_counter()
    clusters = shipped_clusters(SHIPPED)
    isolated = isolated_errors(clusters)
    table = isolated.groupby(["pairs", "size_bytes", "priced"])["error"].agg(
        median_abs=lambda e: np.median(np.abs(e)), median_signed="median", cases="size").unstack("priced")
    print("Isolated held-out collectives, priced with fitted terms (prediction for other / none):")
    print((table * [100, 100, 100, 100, 1, 1]).round(1).to_string())
    terms = prefill_term_contributions(clusters)
    print("\nPrefill terms' contribution to the TTFT error, % of measured TTFT, median over cases (prediction):")
    print((terms.groupby(["source", "group"])[["off", "on"]].median() * 100).round(1).to_string())
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
