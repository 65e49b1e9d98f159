"""The offline transfer evaluation (validation/transfer.py) on the shipped reports."""

from __future__ import annotations

import pytest

from validation.transfer import (NO_PROFILE, POOLED, overall_table, shipped_clusters, transfer_errors,
                                 transfer_table)


@pytest.fixture(scope="module")
def clusters():
    return shipped_clusters()


def test_shipped_reports_hold_six_clusters_with_their_measured_cases(clusters):
    names = [c.name for c in clusters]
    assert names == ["v2x2_bandwidth", "v2x2_latency", "v4x1_bandwidth", "v4x1_latency", "h3x1_delay", "h2x2_mid"]
    assert all(len(c.measured) == 10 * c.measured["prompt_tokens"].nunique() for c in clusters)


def test_every_pair_is_compared_case_by_case(clusters):
    class Stub:  # predicts every case 10% above what the target measured
        def __init__(self, results):
            self.results = results

    import pandas as pd

    def simulate_case(scenario, profile):
        target = next(c for c in clusters if c.name == scenario.name)
        rows = target.measured[target.measured["prompt_tokens"] == scenario.config.workload.prompt_tokens]
        return Stub(pd.DataFrame({"variant": rows["variant"], "metric": rows["metric"], "device": "",
                                  "value": rows["measured"] * 1.1}))

    errors = transfer_errors(clusters[:2], simulate_case=simulate_case)
    assert set(errors["source"]) == {"v2x2_bandwidth", "v2x2_latency", NO_PROFILE, POOLED}
    assert errors["error"].round(9).eq(0.1).all()
    table = transfer_table(errors)
    assert len(table) == 2 * 4 * 2  # targets x sources x metrics
    assert table["cases"].eq(10).all()
    overall = overall_table(errors, ["v2x2_bandwidth"])
    assert set(overall["pairs"]) == {"same", "other", POOLED, NO_PROFILE}
    assert overall["median_abs_error"].round(9).eq(0.1).all()
