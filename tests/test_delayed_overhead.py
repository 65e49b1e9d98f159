"""What a calibration over delayed links carries to links without delay, and a pipeline hop's
overhead from the small ping-pongs (sim.transport; issues 18, 20)."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.cluster_config import ClusterConfig
from sim.collectives.registry import build_schedule
from sim.context import CalibrationContext, Link, LinkClass
from sim.topology import build_topology
from sim.transport import (TransportNetwork, TransportTerms, context_topology, default_terms, fit_hops, fit_profile,
                           hop_overhead_s, price)

DELAYED = Link(LinkClass.INTER_HOST, 12.5e6, 5e-3, None)
# v4x1_latency's shape: 4 hosts of 1 rank, every path over the 5 ms link
CONTEXT = CalibrationContext("delayed", (("cpu", "fp32", 4),), (1, 1, 1, 1), (DELAYED,), cores=2,
                             backend="gloo/tcp")
SIZES = (1024, 16384, 262144, 4194304)
GROUP = (0, 1, 2, 3)


def _terms(overhead_s: float) -> TransportTerms:
    return TransportTerms(overhead_s, 2.0, 1.0, "", notice_latencies=1.0, sender_done_on_write=True)


def _rows(terms: TransportTerms) -> pd.DataFrame:
    """Isolated allreduce timings of gloo's own ring over the delayed cluster, as ``terms`` price them."""
    topology = context_topology(CONTEXT)
    return pd.DataFrame([{"op": "allreduce", "algorithm": "library", "group_size": 4, "num_hosts": 4, "size_bytes": n,
                          "median": price(build_schedule("allreduce", "library", GROUP, n), topology, terms,
                                          cores=2).duration_s} for n in SIZES])


def _pings(overhead_s: float, excess_s: dict[int, float] | None = None) -> pd.DataFrame:
    """Half ping-pong round trips over the delayed link: overhead + delay + wire (+ an excess per size)."""
    excess_s = excess_s or {}
    return pd.DataFrame([{"device_class": LinkClass.INTER_HOST.value, "size_bytes": n,
                          "median": overhead_s + DELAYED.delay_s + n / DELAYED.rate_bytes_per_s + excess_s.get(n, 0.0)}
                         for n in (1024, 4096, 16384, 65536, 262144)])


def _four_hosts(latency: str):
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
        {"name": "n{i}", "count": 4, "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": latency},
         "devices": {"type": "cpu", "count": 1, "memory": "4GiB"}}]}))


def test_an_overhead_fitted_over_delayed_links_is_charged_there_and_not_over_links_without_delay():
    # Over one delay the overhead absorbs what the latency count leaves (0.7 ms here, above gloo's
    # default 0.3 ms); a message over a link without delay pays the default.
    fitted = fit_profile(_rows(_terms(0.7e-3)), CONTEXT, pings=_pings(1.0e-3))[("allreduce", "library")]
    default_s = default_terms("library", kind="allreduce").per_message_s
    assert fitted.per_message_s == pytest.approx(0.7e-3, abs=0.03e-3)
    assert fitted.undelayed_per_message_s == pytest.approx(default_s)
    schedule = build_schedule("allreduce", "library", GROUP, 3072)
    for latency, overhead_s in (("2.5ms", fitted.per_message_s), ("25us", default_s)):
        topology = _four_hosts(latency)
        network = TransportNetwork(topology, None, {("allreduce", "library"): fitted}, fitted)
        expected = price(schedule, topology, TransportTerms(overhead_s, 2.0, fitted.bandwidth_efficiency, "",
                                                            notice_latencies=1.0, sender_done_on_write=True))
        assert network.time(schedule).duration_s == pytest.approx(expected.duration_s)


def test_an_overhead_at_or_below_the_default_is_charged_everywhere():
    fitted = fit_profile(_rows(_terms(0.1e-3)), CONTEXT, pings=_pings(1.0e-3))[("allreduce", "library")]
    assert fitted.undelayed_per_message_s is None


def test_a_hops_overhead_comes_from_the_small_ping_pongs_not_from_a_mid_size_excess():
    # Ping-pongs of tens to hundreds of KiB cost more over a delayed link than overhead + delay +
    # wire (TCP's window growth); a 3 KiB hop still costs what the small ones show.
    pings = _pings(0.4e-3, {65536: 3.5e-3, 262144: 1.8e-3})
    assert hop_overhead_s(pings, CONTEXT, LinkClass.INTER_HOST) == pytest.approx(0.4e-3)
    hop = fit_hops(pings, CONTEXT)[LinkClass.INTER_HOST]
    assert hop.per_message_s == pytest.approx(0.4e-3)
    assert hop.latencies_per_message == 1.0
