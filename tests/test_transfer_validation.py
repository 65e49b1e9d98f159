"""``hetsim validate`` with ``transfer: true``: after calibrating and measuring every cluster, each is
predicted from every other cluster's profile, the others pooled and none, and the report carries
the source x target heat map. Exercised on a copy of the shipped matrix report (no testbed)."""

from __future__ import annotations

import shutil

import pandas as pd
from rich.console import Console

from validation.matrix import load_matrix


def test_transfer_step_writes_every_pair_and_the_heat_map(root, tmp_path):
    from validation.cli import _transfer

    out = tmp_path / "report"
    shutil.copytree(root / "validation" / "report", out)
    written = _transfer(root / "validation" / "matrix.yaml", out, Console(file=open(tmp_path / "log", "w")))
    names = {p.name for p in written}
    assert {"transfer.csv", "summary.md", "errors.csv", "overall.csv", "report.html"} <= names
    table = pd.read_csv(out / "transfer" / "transfer.csv")
    clusters = [s.name for s in load_matrix(root / "validation" / "matrix.yaml")[1]]
    sources = set(table["source"])
    assert set(clusters) | {"none", "pooled"} == sources
    assert set(table["target"]) == set(clusters)
    # every ordered pair of distinct clusters is predicted, for TTFT and TPOT
    pairs = {(s, t) for s, t in zip(table["source"], table["target"]) if s in clusters and s != t}
    assert len(pairs) == len(clusters) * (len(clusters) - 1)
    assert {"ttft_s", "tpot_s"} <= set(table["metric"])
    page = (out / "transfer" / "report.html").read_text()
    assert 'id="transfer-heatmap"' in page and '"type":"heatmap"' in page


def test_the_transfer_matrix_names_new_clusters_of_each_kind_the_issue_asks_for(root):
    matrix, scenarios = load_matrix(root / "validation" / "transfer.yaml")
    assert matrix.transfer
    by_name = {s.name: s for s in scenarios}
    shipped = {s.name for path in ("matrix.yaml", "holdout.yaml") for s in load_matrix(root / "validation" / path)[1]}
    assert shipped <= set(by_name)
    from sim.topology import build_topology

    hosts = {name: [len(g) for g in build_topology(s.config.cluster).host_groups(
        tuple(range(build_topology(s.config.cluster).num_ranks)))] for name, s in by_name.items()}
    new = set(by_name) - shipped
    assert any(len(h) & (len(h) - 1) for name, h in hosts.items() if name in new)  # host count not a power of 2
    assert any(len(set(h)) > 1 for name, h in hosts.items() if name in new)  # hosts of unequal rank counts


def test_an_offline_rerun_switches_pieces_on_and_off_and_names_the_flags_it_ran_with(monkeypatch):
    import argparse

    from sim import cores, token_bucket
    from sim.collectives import registry
    from validation.pricing_options import add_pricing_options, apply_pricing_options

    for module, name in ((token_bucket, "PRICED"), (cores, "ARRIVAL_LAGS_PRICED"), (registry, "LIBRARY_BROADCAST")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    parser = argparse.ArgumentParser()
    add_pricing_options(parser, ("--token-buckets", "--gloo-tree"))
    assert apply_pricing_options(parser.parse_args(["--gloo-tree", "--token-buckets"])) == ["--token-buckets",
                                                                                            "--gloo-tree"]
    assert token_bucket.PRICED and registry.LIBRARY_BROADCAST is registry.LibraryBroadcast.GLOO_TREE
    cores.ARRIVAL_LAGS_PRICED = True  # a flag the parser lacks is left as it is
    assert apply_pricing_options(parser.parse_args(["--no-gloo-tree", "--no-token-buckets"])) == [
        "--no-token-buckets", "--no-gloo-tree"]
    assert not token_bucket.PRICED and registry.LIBRARY_BROADCAST is registry.LibraryBroadcast.BINOMIAL
    assert cores.ARRIVAL_LAGS_PRICED
    assert apply_pricing_options(parser.parse_args([])) == []  # not given: left as they are
    assert not token_bucket.PRICED and cores.ARRIVAL_LAGS_PRICED


def test_the_pricing_pieces_are_on_by_default():
    """The links' token buckets, the prefill's arrival lags and gloo's broadcast tree price every
    run unless an offline re-run switches them off."""
    from sim import cores, token_bucket
    from sim.collectives import registry

    assert token_bucket.PRICED and cores.ARRIVAL_LAGS_PRICED
    assert registry.LIBRARY_BROADCAST is registry.LibraryBroadcast.GLOO_TREE
