"""A collective inside one host is priced from what calibration measured inside a host
(sim.transport.fit_intra_host), never from a sweep whose calls all crossed the hosts' link; and
hetsim calibrate sweeps the first host's ranks besides the whole group (issues 18, 20)."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.cluster_config import ClusterConfig
from sim.collectives.registry import build_schedule
from sim.context import CalibrationContext, Link, LinkClass
from sim.topology import build_topology
from sim.transport import (TransportNetwork, TransportTerms, context_topology, fit_intra_host, fit_profile,
                           message_overhead_s, price)

INTER = Link(LinkClass.INTER_HOST, 12.5e6, 5e-3, None)
INTRA = Link(LinkClass.INTRA_HOST, 125e6, 50e-6, None)
CONTEXT = CalibrationContext("synthetic", (("cpu", "fp32", 4),), (2, 2), (INTER, INTRA), cores=2,
                             backend="gloo/tcp")
SIZES = (1024, 16384, 262144, 4194304)


def _rows(terms: TransportTerms, group: tuple[int, ...], context: CalibrationContext = CONTEXT) -> pd.DataFrame:
    """Isolated reduce timings over ``group`` of the calibrated cluster, as ``terms`` price them."""
    topology = context_topology(context)
    hosts = topology.host_groups(group)
    return pd.DataFrame([{"op": "reduce", "algorithm": "library", "group_size": len(group), "num_hosts": len(hosts),
                          "size_bytes": n, "median": price(build_schedule("reduce", "library", group, n, root=0,
                                                                          host_groups=hosts),
                                                           topology, terms, cores=2).duration_s} for n in SIZES])


def _pings(overhead_s: float) -> pd.DataFrame:
    """Half ping-pong round trips of ``overhead_s`` + delay + wire over each link class."""
    return pd.DataFrame([{"device_class": link.link_class.value, "size_bytes": n,
                          "median": overhead_s + link.delay_s + n / link.rate_bytes_per_s}
                         for link in (INTER, INTRA) for n in (1024, 4096, 65536)])


def _two_hosts_of_two():
    """v2x2_latency's cluster: 2 hosts of 2 CPU ranks, 5 ms one way between them."""
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
        {"name": "n{i}", "count": 2, "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": "2.5ms"},
         "interconnect": {"bandwidth": "1Gbit/s", "latency": "50us", "shared": True},
         "devices": {"type": "cpu", "count": 2, "memory": "4GiB"}}]}))


def _terms(overhead_s: float) -> TransportTerms:
    return TransportTerms(overhead_s, 2.0, 1.0, "", notice_latencies=1.0, sender_done_on_write=True)


def test_a_collective_inside_a_host_takes_the_intra_host_ping_pongs_overhead_not_the_spanning_sweeps():
    # The spanning sweep's calls are their 5 ms delays: their fit keeps no overhead, while a message
    # between two ranks of one host costs 0.3 ms of software (its ping-pongs say so).
    pings = _pings(0.3e-3)
    spanning = fit_profile(_rows(_terms(0.0), (0, 1, 2, 3)), CONTEXT, pings=pings)
    assert spanning[("reduce", "library")].per_message_s < 0.1e-3
    inside = fit_intra_host(_rows(_terms(0.0), (0, 1, 2, 3)), pings, CONTEXT, spanning)
    assert inside[("reduce", "library")].per_message_s == pytest.approx(
        message_overhead_s(pings, CONTEXT, LinkClass.INTRA_HOST)) == pytest.approx(0.3e-3)
    assert inside[("reduce", "library")].latencies_per_message == spanning[("reduce", "library")].latencies_per_message


def test_a_spanning_overhead_above_the_intra_host_ping_pongs_still_prices_a_group_inside_a_host():
    # Over links without delay the spanning sweep identifies the library's own overhead (0.6 ms),
    # which a message inside a host pays too: the ping-pongs' 0.3 ms is only its floor.
    plain = CalibrationContext("plain", (("cpu", "fp32", 4),), (2, 2), (Link(LinkClass.INTER_HOST, 12.5e6, 0.0, None),
                                                                        INTRA), cores=2, backend="gloo/tcp")
    rows = _rows(_terms(0.6e-3), (0, 1, 2, 3), plain)
    spanning = fit_profile(rows, plain, pings=_pings(0.3e-3))
    assert spanning[("reduce", "library")].per_message_s > 0.3e-3
    assert fit_intra_host(rows, _pings(0.3e-3), plain, spanning) == {}


def test_the_sweep_over_one_hosts_ranks_prices_a_collective_inside_a_host_and_leaves_the_spanning_fit_alone():
    pings = _pings(0.3e-3)
    spanning_rows = _rows(_terms(0.0), (0, 1, 2, 3))
    both = pd.concat([spanning_rows, _rows(_terms(0.6e-3), (0, 1))], ignore_index=True)
    spanning = fit_profile(both, CONTEXT, pings=pings)
    assert spanning == fit_profile(spanning_rows, CONTEXT, pings=pings)
    inside = fit_intra_host(both, pings, CONTEXT, spanning)
    assert inside[("reduce", "library")].per_message_s == pytest.approx(0.6e-3, abs=0.03e-3)


def test_a_profile_with_one_host_has_no_terms_of_its_own_inside_a_host():
    one = CalibrationContext("one", (("cpu", "fp32", 2),), (2,), (INTRA,), cores=2, backend="gloo/tcp")
    assert fit_intra_host(_rows(_terms(0.3e-3), (0, 1)), _pings(0.3e-3), one, {}) == {}


def test_a_network_prices_a_group_inside_a_host_with_its_intra_host_terms_and_a_spanning_group_without():
    topology = _two_hosts_of_two()
    cheap, dear = _terms(0.0), _terms(0.3e-3)
    network = TransportNetwork(topology, None, {("reduce", "library"): cheap}, cheap,
                               intra_host={("reduce", "library"): dear})
    for group, terms in (((0, 1), dear), ((0, 1, 2, 3), cheap), ((1, 2), cheap)):
        schedule = build_schedule("reduce", "library", group, 3072, root=group[0],
                                  host_groups=topology.host_groups(group))
        assert network.time(schedule).duration_s == pytest.approx(price(schedule, topology, terms).duration_s)


def test_the_collective_sweep_also_times_the_first_hosts_ranks_where_the_group_spans_hosts():
    torch = pytest.importorskip("torch")
    from models.ops import OpKind
    from runtime import clock
    from runtime.comm import Communicator
    from runtime.comm_timing import CollectiveSweep, one_host_group
    from runtime.launch import launch

    topology = _two_hosts_of_two()
    assert one_host_group((0, 1, 2, 3), topology) == (0, 1)
    assert one_host_group((0, 2), topology) is None and one_host_group((0, 1), topology) is None

    def body(rank, heartbeat):
        clock.synchronise()
        torch.set_num_threads(1)
        sweep = CollectiveSweep((0, 1, 2, 3), topology, rank, Communicator(rank, topology.host_groups), 1.0,
                                heartbeat, sizes=(1024,), algorithms={OpKind.ALLREDUCE: ("library",),
                                                                      OpKind.REDUCE: ("library", "binomial"),
                                                                      OpKind.BROADCAST: ()}, one_host=True)
        sweep.round("round 1 of 1")
        return sweep.rows()

    rows = pd.DataFrame(launch(body, 4, hang_timeout_s=120)[0])
    shapes = set(zip(rows["op"], rows["algorithm"], rows["group_size"], rows["num_hosts"]))
    assert shapes == {(op, algorithm, n, hosts) for op, algorithm in
                      (("allreduce", "library"), ("reduce", "library"), ("reduce", "binomial"))
                      for n, hosts in ((4, 2), (2, 1))}
    assert (rows["median"] > 0).all()
