"""A link's token bucket (issue 20): declared in the scenario, applied by the testbed's tbf, priced
by the fluid network (sim/token_bucket) and recorded in a profile's context."""

import json

import pandas as pd
import pytest
import simpy
from pydantic import ValidationError

from models.ops import OpKind
from runtime.testbed.cluster import applied_context
from runtime.testbed.links import host_links
from runtime.testbed.shaping import tbf_args
from sim.cluster_config import ClusterConfig
from sim.collectives.schedule import CommSchedule, Transfer
from sim.context import (LEGACY_TESTBED_BURST_BYTES, Link, LinkClass, Verdict, compare, context_rows,
                         profile_contexts, scenario_context)
from sim import token_bucket
from sim.engine import Engine
from sim.fabric import Fabric
from sim.network import CollectivePricer, CollectiveTiming, FlowNetwork, Links, fluid_lower_bound_s
from sim.plan import Collective, Op, Segment, Stream
from sim.scenario import config_error_from
from sim.topology import build_topology
from sim.transport import context_topology

RATE_BYTES_PER_S = 12.5e6  # 100 Mbit/s
BURST_BYTES = 32_000


@pytest.fixture
def priced(monkeypatch):
    """The fluid network prices declared buckets (sim.token_bucket.PRICED, on by default)."""
    monkeypatch.setattr(token_bucket, "PRICED", True)


def _cluster(burst: str | None = "32kB", hosts: int = 2, ranks: int = 1) -> ClusterConfig:
    nic = {"bandwidth": "100Mbit/s", "latency": "0s", **({"burst": burst} if burst is not None else {})}
    host = {"name": "h{i}", "count": hosts, "parent": "sw", "nic": nic, "devices": {"type": "cpu", "count": ranks}}
    if ranks > 1:
        host["interconnect"] = {"bandwidth": "1Gbit/s", "latency": "0s", "shared": True, "burst": "128KiB"}
    return ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [host]})


def _messages(*sizes: int, src: int = 0, dst: int = 1) -> CommSchedule:
    """One message per step from ``src`` to ``dst``, each step after the one before."""
    return CommSchedule(OpKind.SEND, "p2p", (src, dst), None, sum(sizes),
                        tuple((Transfer(src, dst, n, False),) for n in sizes))


def test_a_link_declares_its_burst_with_units():
    topology = build_topology(_cluster("32kB"))
    assert {c.burst_bytes for c in topology.channels} == {BURST_BYTES}
    assert topology.path_burst_bytes(0, 1) == BURST_BYTES
    assert build_topology(_cluster(None)).path_burst_bytes(0, 1) is None  # no bucket unless declared


@pytest.mark.parametrize("burst", ["-5kB", "lots", "0B", "3 s"])
def test_a_bad_burst_is_one_line_naming_the_field(burst):
    with pytest.raises(ValidationError) as raised:
        _cluster(burst)
    error = config_error_from(raised.value)
    assert error.field == "hosts[0].nic.burst" and burst in str(error) and "\n" not in str(error)


def test_the_testbed_shapes_with_the_declared_burst_at_least_two_mtus():
    assert tbf_args(RATE_BYTES_PER_S, 9000, 64_000)[3:5] == ["burst", "64000"]
    assert tbf_args(RATE_BYTES_PER_S, 9000, 4_000)[3:5] == ["burst", "18000"]  # tbf drops a packet above it
    assert tbf_args(RATE_BYTES_PER_S, 9000, None)[3:5] == ["burst", "18000"]
    links = host_links(build_topology(_cluster("32kB", ranks=2)), "hsabcdef")["h0"]
    assert (links.burst_bytes, links.intra_burst_bytes) == (BURST_BYTES, 131_072)


def test_a_message_within_the_burst_after_an_idle_gap_costs_no_wire_time(priced):
    bucketed, plain = FlowNetwork(build_topology(_cluster("32kB"))), FlowNetwork(build_topology(_cluster(None)))
    assert plain.time(_messages(20_000)).duration_s == pytest.approx(20_000 / RATE_BYTES_PER_S)
    assert bucketed.time(_messages(20_000)).duration_s == pytest.approx(0.0)
    # beyond the burst, only the rest goes at the rate
    assert bucketed.time(_messages(98_000)).duration_s == pytest.approx((98_000 - BURST_BYTES) / RATE_BYTES_PER_S)


def test_back_to_back_messages_share_the_links_tokens_and_a_stream_converges_to_the_rate(priced):
    network = FlowNetwork(build_topology(_cluster("32kB")))
    # 20 kB free, 12 kB of tokens left for the second, none refilled while the link is busy
    assert network.time(_messages(20_000, 20_000, 20_000)).duration_s == pytest.approx(
        (8_000 + 20_000) / RATE_BYTES_PER_S)
    stream = [1_000_000] * 20
    assert network.time(_messages(*stream)).duration_s == pytest.approx(
        (sum(stream) - BURST_BYTES) / RATE_BYTES_PER_S)
    # two senders into one receiver draw on its downlink's one bucket
    two = CommSchedule(OpKind.SEND, "p2p", (0, 1, 2), None, 2 * 20_000,
                       ((Transfer(0, 2, 20_000, False), Transfer(1, 2, 20_000, False, 20_000)),))
    three_hosts = FlowNetwork(build_topology(_cluster("32kB", hosts=3)))
    assert three_hosts.time(two).duration_s == pytest.approx((2 * 20_000 - BURST_BYTES) / RATE_BYTES_PER_S)


def test_a_message_between_hosts_draws_on_its_bottleneck_bucket_not_on_the_hosts_interconnect(priced):
    """A root's broadcast to a rank of its own host (over the interconnect, whose bucket models the
    testbed's shaped ``lo``) and to one of another host at once: the far message still gets its
    NIC's whole burst; only the NIC's bucket paces it (the near one cannot drain a bucket the far
    one does not pass through on the testbed, and a faster channel's bucket never paces it)."""
    network = FlowNetwork(build_topology(_cluster("32kB", ranks=2)))  # ranks 0, 1 on h0; 2, 3 on h1
    near, far = 120_000, 98_304  # the near one leaves the interconnect 11 kB of tokens
    both = CommSchedule(OpKind.BROADCAST, "p2p", (0, 1, 2), 0, near,
                        ((Transfer(0, 1, near, False), Transfer(0, 2, far, False)),))
    timing = network.time(both)
    assert timing.finish_s[2] == pytest.approx((far - BURST_BYTES) / RATE_BYTES_PER_S)
    assert timing.finish_s[1] < 1e-3  # the interconnect's 128 KiB bucket covers the near message
    # the far message's tokens are its NIC's: a second one right after finds them spent
    twice = _messages(far, far, src=0, dst=2)
    assert network.time(twice).duration_s == pytest.approx((2 * far - BURST_BYTES) / RATE_BYTES_PER_S)


def test_the_shared_fabric_refills_a_bucket_while_its_link_is_idle(priced):
    links = Links(build_topology(_cluster("32kB")))
    env = simpy.Environment()
    fabric = Fabric(env, links)
    arrived = []

    def sender():
        for _ in range(2):
            start = env.now
            yield fabric.send(0, 1, 40_000)
            arrived.append(env.now - start)
            yield env.timeout(1.0)  # idle long enough to fill the bucket again

    env.process(sender())
    env.run()
    assert arrived == pytest.approx([8_000 / RATE_BYTES_PER_S] * 2)


def test_unpriced_buckets_leave_the_network_as_it_was(monkeypatch):
    monkeypatch.setattr(token_bucket, "PRICED", False)
    bucketed, plain = FlowNetwork(build_topology(_cluster("32kB"))), FlowNetwork(build_topology(_cluster(None)))
    schedule = _messages(20_000, 98_000)
    assert bucketed.time(schedule).duration_s == plain.time(schedule).duration_s


def test_the_fluid_lower_bound_holds_with_buckets(priced):
    links = Links(build_topology(_cluster("32kB")))
    schedule = _messages(20_000, 50_000)
    assert fluid_lower_bound_s(schedule, links) <= FlowNetwork(links.topology).time(schedule).duration_s


def test_a_profile_records_the_burst_and_reads_old_rows_as_the_testbeds():
    topology = build_topology(_cluster("32kB", ranks=2))
    context = scenario_context("c", topology, tuple(range(4)), "fp32")
    assert {l.link_class: l.burst_bytes for l in context.links} == {LinkClass.INTER_HOST: BURST_BYTES,
                                                                     LinkClass.INTRA_HOST: 131_072}
    rows = pd.DataFrame(context_rows(context))
    (read,) = profile_contexts(rows)
    assert read.links == context.links
    # the fit's cluster keeps the buckets, so fitted terms are the link's without its burst
    assert {c.burst_bytes for c in context_topology(read).channels} == {BURST_BYTES, 131_072}
    # a link without a bucket is recorded as such, not as an old profile
    plain = scenario_context("p", build_topology(_cluster(None)), (0, 1), "fp32")
    (read_plain,) = profile_contexts(pd.DataFrame(context_rows(plain)))
    assert read_plain.links[0].burst_bytes is None
    old = rows.copy()
    old["method"] = [json.dumps({k: v for k, v in json.loads(m).items() if k != "burst_bytes"}) for m in old["method"]]
    (legacy,) = profile_contexts(old)
    assert {l.link_class: l.burst_bytes for l in legacy.links} == LEGACY_TESTBED_BURST_BYTES


def test_compare_gives_the_burst_a_verdict():
    calibrated = scenario_context("cal", build_topology(_cluster("32kB")), (0, 1), "fp32")
    same = compare((calibrated,), scenario_context("t", build_topology(_cluster("32kB")), (0, 1), "fp32"))
    other = compare((calibrated,), scenario_context("t", build_topology(_cluster("64kB")), (0, 1), "fp32"))
    assert [t.verdict for t in same if t.term.startswith("network")] == [Verdict.SAME]
    (burst,) = [t for t in other if t.term.startswith("burst")]
    assert burst.verdict == Verdict.RESCALED and "32 kB" in burst.detail
    assert not Link(LinkClass.INTER_HOST, 1.0, 0.0, None).matches(Link(LinkClass.INTER_HOST, 1.0, 0.0, 32_000))


def test_a_fit_takes_the_burst_out_of_a_ping_pongs_overhead_where_buckets_are_priced(monkeypatch):
    from sim.context import CalibrationContext
    from sim.transport import message_overhead_s

    link = Link(LinkClass.INTER_HOST, RATE_BYTES_PER_S, 1e-3, BURST_BYTES)
    context = CalibrationContext("c", (("cpu", "fp32", 2),), (1, 1), (link,))
    # 16 kB half round trip in 1.5 ms over a 1 ms link: within the burst, all of the rest is overhead
    pings = pd.DataFrame({"device_class": ["inter_host"], "size_bytes": [16_000], "median": [1.5e-3]})
    monkeypatch.setattr(token_bucket, "PRICED", False)
    assert message_overhead_s(pings, context) == 0.0  # unpriced: 1.28 ms of wire time, more than the 0.5 ms left
    monkeypatch.setattr(token_bucket, "PRICED", True)
    assert message_overhead_s(pings, context) == pytest.approx(0.5e-3)


class _Waits:
    """Compute ops that take ``gap_s`` each and free reductions: the links' idle time between
    collectives is set by the test."""

    def __init__(self, gap_s: float):
        self.gap_s = gap_s

    def duration_s(self, op, device):
        return self.gap_s

    def reduce_s_per_byte(self, device, dtype=None):
        return 0.0


def _allreduce(call: int) -> Op:
    return Op(OpKind.ALLREDUCE, f"allreduce{call}", Stream.COMM,
              collective=Collective(OpKind.ALLREDUCE, "ring", (0, 1), 40_000), call=call)


def _engine(gap_s: float, network=None) -> Engine:
    topology = build_topology(_cluster("32kB"))
    return Engine(topology, _Waits(gap_s), CollectivePricer(network or FlowNetwork(topology), topology))


class _Replayed:
    """A network replaying one measured time for every call of the first ``calls`` (plan op names
    ``allreduce0`` ...), timed in place on the cluster (:attr:`sim.network.CollectiveTiming.in_place`);
    the others priced by the fluid model."""

    def __init__(self, topology, measured_s: float, calls: int):
        self.fluid, self.measured_s, self.calls = FlowNetwork(topology), measured_s, calls

    def time(self, schedule, call=None):
        if call is not None and int(call.removeprefix("allreduce")) < self.calls:
            return CollectiveTiming(self.measured_s, dict.fromkeys(schedule.group, self.measured_s), in_place=True)
        return self.fluid.time(schedule)


def _two_allreduces(gap_s: float) -> list[float]:
    """The durations (s) of two 40 kB ring allreduces between the two hosts of :func:`_cluster`,
    ``gap_s`` of compute apart, as the engine runs them (their priced timing kept)."""
    program = (_allreduce(0), Op(OpKind.MLP_UP, "mlp_up", Stream.COMPUTE), _allreduce(1))
    result = _engine(gap_s).run_segment(Segment("two", {0: program, 1: program}))
    return [float(result.ends[0][i] - result.starts[0][i]) for i in (0, 2)]


def test_a_collective_right_after_another_finds_the_buckets_it_left(priced):
    # each direction's 40 kB: 32 kB from the full bucket, 8 kB at the rate; the second call, with
    # no idle time between, finds the bucket empty and sends all at the rate
    first, second = _two_allreduces(0.0)
    assert first == pytest.approx(8_000 / RATE_BYTES_PER_S)
    assert second == pytest.approx(40_000 / RATE_BYTES_PER_S, rel=1 / 32)  # levels of 1/32 of the depth
    # a gap long enough to refill the bucket (32 kB at 100 Mbit/s: 2.6 ms) prices both alike
    rested = _two_allreduces(0.01)
    assert rested == pytest.approx([first, first])


def test_a_call_timed_in_place_is_replayed_as_measured_and_drains_the_buckets_for_the_calls_priced_after(priced):
    # Two back-to-back allreduces replayed from their in-place timing: the second's measured time
    # holds whatever its run's buckets held (issue 18, session 20: delaying it again by the tokens
    # the first took counted them twice). A third, priced by the fluid model, finds them drained.
    measured_s = 1e-3
    topology = build_topology(_cluster("32kB"))
    program = (_allreduce(0), _allreduce(1), _allreduce(2))
    result = _engine(0.0, _Replayed(topology, measured_s, calls=2)).run_segment(Segment("three", {0: program,
                                                                                                 1: program}))
    replayed, priced_s = result.ends[0] - result.starts[0], result.ends[0][2] - result.starts[0][2]
    assert list(replayed[:2]) == pytest.approx([measured_s, measured_s])
    assert priced_s == pytest.approx(40_000 / RATE_BYTES_PER_S, rel=1 / 32)


def test_a_call_timed_in_place_on_the_shared_fabric_is_not_delayed_by_the_tokens_it_found_either(priced):
    # Two groups crossing the hosts' NICs run on the shared fabric (sim.fabric): the second call,
    # 2 ms after the first began, finds the buckets half refilled, which its measured time holds
    # (3 ms: no less than the fluid model gives 40 kB from those buckets, 1.84 ms)
    measured_s = 3e-3
    topology = build_topology(_cluster("32kB", ranks=2))
    engine = Engine(topology, _Waits(2e-3), CollectivePricer(_Replayed(topology, measured_s, calls=2), topology))

    def allreduce(call, group):
        return Op(OpKind.ALLREDUCE, f"allreduce{call}", Stream.COMM,
                  collective=Collective(OpKind.ALLREDUCE, "ring", group, 40_000), call=call)

    first, second = allreduce(0, (0, 2)), allreduce(1, (1, 3))
    wait = Op(OpKind.MLP_UP, "mlp_up", Stream.COMPUTE)
    result = engine.run_segment(Segment("two groups", {0: (first,), 2: (first,), 1: (wait, second), 3: (wait, second)}))
    assert result.ends[0][0] - result.starts[0][0] == pytest.approx(measured_s)
    assert result.ends[1][1] - result.starts[1][1] == pytest.approx(measured_s, rel=0.05)  # the levels' 1/32


def test_a_repeated_segment_is_priced_with_the_buckets_its_previous_instance_left(priced):
    program = (_allreduce(0),)
    once = _engine(0.0).run_segment(Segment("layer", {0: program, 1: program})).duration_s
    repeated = _engine(0.0).run_segment(Segment("layer", {0: program, 1: program}, repeat=12)).duration_s
    assert once == pytest.approx(8_000 / RATE_BYTES_PER_S)
    # back to back, each instance after the first finds the buckets the one before emptied
    assert repeated == pytest.approx(40_000 / RATE_BYTES_PER_S, rel=1 / 32)


def test_a_testbed_profile_records_the_buckets_the_testbed_applied():
    topology = build_topology(_cluster(None, ranks=2))  # no burst declared between hosts
    context = applied_context(scenario_context("c", topology, (0, 1, 2, 3), "fp32"))
    bursts = {link.link_class: link.burst_bytes for link in context.links}
    # tbf's two MTUs: eth0's 9000 B, lo's 65536 B (the interconnect declares 128 KiB, more than that)
    assert bursts == {LinkClass.INTER_HOST: 18_000, LinkClass.INTRA_HOST: 131_072}
    declared = applied_context(scenario_context("c", build_topology(_cluster("32kB")), (0, 1), "fp32"))
    assert [link.burst_bytes for link in declared.links] == [BURST_BYTES]
