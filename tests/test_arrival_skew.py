"""The master's wait for the last rank on shared cores as an expected maximum of arrival lags
(sim.arrival_skew): the order statistics, the engine's use of them, the fit on a calibration."""

import pandas as pd
import pytest

from sim.arrival_skew import expected_lead_s, fit_lag_per_block, off_core_share
from sim.concurrency import block_compute_s
from sim.cores import CorePool
from tests.conftest import four_rank_layer


def test_the_expected_lead_is_the_expected_maximum_of_uniform_lags_less_the_first_ranks_own():
    # m equal ranges a: E[max] = a m / (m + 1), the first rank's own lag a / 2 on average
    assert expected_lead_s([2.0] * 4) == pytest.approx(2.0 * (4 / 5 - 1 / 2))
    # a first rank that does not lag waits for the larger of the two others: 2/3 of their range
    assert expected_lead_s([0.0, 1.0, 1.0]) == pytest.approx(2 / 3)
    # unequal ranges: E[max(U(0,1/2), U(0,1))] = integral of 1 - 2x^2 to 1/2, of 1 - x beyond = 13/24
    assert expected_lead_s([0.5, 1.0]) == pytest.approx(13 / 24 - 1 / 4)
    assert expected_lead_s([0.0, 0.0]) == 0.0


def test_more_ranks_beyond_the_cores_lag_more():
    four = expected_lead_s([off_core_share(4, 2)] * 4)
    three = expected_lead_s([off_core_share(3, 2)] * 3)
    assert four > three > 0
    assert off_core_share(2, 2) == 0.0


def _layer(lag_per_block: float, phase: int):
    """A decoder layer of a 4-rank tensor-parallel generation (``phase`` 0: the prefill's, 1: a
    decode step's) run on 2 shared cores whose arrival lag coefficient is ``lag_per_block``."""
    result, _, engine = four_rank_layer((CorePool(frozenset(range(4)), 2, lag_per_block=lag_per_block),))
    segment = result.variants[0].run.simulated[phase].phase.segments[1]  # a decoder layer
    return engine.run_segment(segment), segment


@pytest.fixture
def priced(monkeypatch):
    from sim import cores

    monkeypatch.setattr(cores, "ARRIVAL_LAGS_PRICED", True)


def test_a_prefills_calls_start_the_expected_lead_after_the_last_fair_share_arrival(priced):
    plain, segment = _layer(0.0, 0)
    lagged, _ = _layer(2.0, 0)
    ops = segment.programs[0]
    first = next(i for i, op in enumerate(ops) if op.collective is not None)
    block_s = float(plain.starts[0][first])  # every rank computes its block from the segment's start
    lead_s = expected_lead_s([2.0 * off_core_share(4, 2) * block_s] * 4)
    assert lead_s > 0
    # the master waits that long in the call; the others are shown arriving then; all leave later
    assert lagged.ends[0][first] == pytest.approx(plain.ends[0][first] + lead_s, rel=1e-9)
    assert lagged.starts[1][first] == pytest.approx(plain.starts[1][first] + lead_s, rel=1e-9)
    assert lagged.starts[0][first] == plain.starts[0][first]
    assert lagged.duration_s > plain.duration_s + lead_s


def test_a_decode_step_keeps_its_fair_share_arrivals(priced):
    plain, _ = _layer(0.0, 1)
    lagged, _ = _layer(2.0, 1)
    assert lagged.duration_s == plain.duration_s


def test_without_the_option_a_lagging_pool_changes_nothing(monkeypatch):
    from sim import cores

    monkeypatch.setattr(cores, "ARRIVAL_LAGS_PRICED", False)
    plain, _ = _layer(0.0, 0)
    lagged, _ = _layer(2.0, 0)
    assert lagged.duration_s == plain.duration_s
    for rank in plain.ends:
        assert (lagged.ends[rank] == plain.ends[rank]).all()


def test_the_fitted_coefficient_gives_back_the_calibrated_wait_per_call(root):
    rows = pd.read_csv(root / "validation" / "report" / "profiles" / "v4x1_bandwidth.csv")
    fit = fit_lag_per_block(rows, 4, 2)
    assert fit is not None and fit > 0
    blocks = block_compute_s(rows)
    waits = rows[(rows["measurement"] == "collective_wait") & (rows["op"] == "allreduce")]
    # at the calibrated ranks and cores the coefficient prices a prefill's wait within the range
    # of the calls it was fitted on
    for new_tokens in (8, 32, 128):
        priced = expected_lead_s([fit * off_core_share(4, 2) * blocks[new_tokens]] * 4)
        measured = waits[waits["size_bytes"] == 3072 * new_tokens]["median"]
        assert measured.min() * 0.3 < priced < measured.max() * 3
    assert fit_lag_per_block(rows, 2, 2) is None  # ranks with cores enough do not lag
