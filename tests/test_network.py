"""Network models (sim/network): closed forms on uniform networks, link sharing, the pricer."""

import time

import pytest

from models.errors import ConfigError
from models.ops import OpKind
from sim.cluster_config import ClusterConfig
from sim.collectives.closed_form import closed_form_time_s, two_level_time_s
from sim.collectives.registry import ALGORITHMS, build_schedule
from sim.collectives.schedule import CommSchedule, Transfer
from sim.network import (NETWORK_MODELS, AlphaBetaNetwork, CollectivePricer, CollectiveTiming, FlowNetwork, channel_bytes,
                         fluid_lower_bound_s)
from sim.topology import build_topology

LINK_BYTES_PER_S, LINK_LATENCY_S = 125e6, 500e-6  # 1 Gbit/s, 0.5 ms
GAMMA = 1 / 2e9
FLAT = [(kind, name) for kind, names in ALGORITHMS.items() for name in names if not name.startswith("two_level")]


def box(p: int):
    """One host of p devices, each with its own full-duplex link to the host bus: a uniform network
    with alpha = 2 x link latency (up + down) and beta = 1 / link bandwidth."""
    config = {"hosts": [{"name": "box", "interconnect": {"bandwidth": LINK_BYTES_PER_S, "latency": LINK_LATENCY_S},
                         "devices": {"type": "cpu", "count": p}}]}
    return build_topology(ClusterConfig.model_validate(config))


def hosts(num_hosts: int, per_host: int, *, nic_per_device: bool, nic_bytes_per_s: float = 12.5e6):
    """Hosts under one switch: 100 Mbit/s, 1 ms NICs (shared by the host's devices unless
    ``nic_per_device``) and 1 Gbit/s, 20 us interconnect links."""
    host = {"name": "h{i}", "count": num_hosts, "parent": "sw", "nic_per_device": nic_per_device,
            "nic": {"bandwidth": nic_bytes_per_s, "latency": 1e-3},
            "interconnect": {"bandwidth": 125e6, "latency": 20e-6}, "devices": {"type": "cpu", "count": per_host}}
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [host]}))


def gammas(topology, gamma=GAMMA):
    return {rank: gamma for rank in range(topology.num_ranks)}


# --- the alpha-beta model reproduces the closed forms ---------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 9, 16])
@pytest.mark.parametrize("kind,name", [kn for kn in FLAT if kn[1] != "double_binary_tree"], ids=lambda v: str(v))
def test_alpha_beta_equals_the_closed_form_on_a_uniform_network(p, kind, name):
    topology = box(p)
    alpha, beta = 2 * LINK_LATENCY_S, 1 / LINK_BYTES_PER_S
    network = AlphaBetaNetwork(topology, gammas(topology))
    for size in (8 * 5040 * 16, 8 * 5040 * 16 * 100):  # divisible into p (and p') aligned chunks
        schedule = build_schedule(kind, name, range(p), size, root=p - 1)
        expected = closed_form_time_s(kind, name, p, size, alpha, beta, GAMMA)
        assert network.time(schedule).duration_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 9, 16])
def test_double_binary_tree_closed_form_bounds_the_schedule(p):
    topology = box(p)
    network = AlphaBetaNetwork(topology, gammas(topology))
    for size, tightness in ((2**12, 0.5), (2**20, 0.5), (2**26, 0.9)):
        schedule = build_schedule(OpKind.ALLREDUCE, "double_binary_tree", range(p), size)
        bound = closed_form_time_s(OpKind.ALLREDUCE, "double_binary_tree", p, size, 2 * LINK_LATENCY_S, 1 / LINK_BYTES_PER_S, GAMMA)
        assert tightness * bound <= network.time(schedule).duration_s <= bound * (1 + 1e-9)


@pytest.mark.parametrize("num_hosts,per_host", [(2, 4), (3, 2), (4, 4), (2, 1), (1, 4)])
@pytest.mark.parametrize("nic_per_device", [False, True])
@pytest.mark.parametrize("name", ["two_level_tree", "two_level_rs"])
def test_both_models_equal_the_two_level_closed_form(num_hosts, per_host, nic_per_device, name):
    topology = hosts(num_hosts, per_host, nic_per_device=nic_per_device)
    group = tuple(range(topology.num_ranks))
    intra = (topology.path_latency_s(0, 1), 1 / topology.path_bandwidth_bytes_per_s(0, 1)) if per_host > 1 else (0.0, 0.0)
    inter = (topology.path_latency_s(0, per_host), 1 / topology.path_bandwidth_bytes_per_s(0, per_host)) if num_hosts > 1 else (0.0, 0.0)
    size = 8 * 12 * 4096
    schedule = build_schedule(OpKind.ALLREDUCE, name, group, size, host_groups=topology.host_groups(group))
    expected = two_level_time_s(name, num_hosts, per_host, size, intra, inter, GAMMA, shared_nic=not nic_per_device)
    assert AlphaBetaNetwork(topology, gammas(topology)).time(schedule).duration_s == pytest.approx(expected, rel=1e-9)
    assert FlowNetwork(topology, gammas(topology)).time(schedule).duration_s == pytest.approx(expected, rel=1e-9)


# --- the flow model: equal where nothing is shared, slower where something is ---------------


@pytest.mark.parametrize("p", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("kind,name", FLAT, ids=lambda v: str(v))
def test_flow_equals_alpha_beta_on_a_uniform_network(p, kind, name):
    # Every device has its own link: only the transfers of one step can meet on a channel, and
    # they start and end together, so fair sharing equals the alpha-beta model's static split.
    topology = box(p)
    schedule = build_schedule(kind, name, range(p), 8 * 5040 * 16 * 10, root=0)
    ab = AlphaBetaNetwork(topology, gammas(topology)).time(schedule)
    flow = FlowNetwork(topology, gammas(topology)).time(schedule)
    assert flow.duration_s == pytest.approx(ab.duration_s, rel=0.01)
    if name != "double_binary_tree":
        assert flow.duration_s == pytest.approx(ab.duration_s, rel=1e-9)
        assert flow.finish_s == pytest.approx(ab.finish_s, rel=1e-9)


def two_flows(*steps):
    """2 hosts x 2 devices behind shared NICs; transfers of 1 MB from host 0 to host 1."""
    return CommSchedule(OpKind.BROADCAST, "test", (0, 1, 2, 3), 0, 10**6, steps)


def test_two_flows_on_one_channel_take_twice_as_long_as_one():
    topology = hosts(2, 2, nic_per_device=False)
    latency = topology.path_latency_s(0, 2)
    nic_s = 10**6 / 12.5e6
    one = two_flows((Transfer(0, 2, 10**6, False),))
    both = two_flows((Transfer(0, 2, 10**6, False), Transfer(1, 3, 10**6, False)))
    for model in (AlphaBetaNetwork, FlowNetwork):
        network = model(topology)
        assert network.time(one).duration_s == pytest.approx(latency + nic_s, rel=1e-9)
        assert network.time(both).duration_s == pytest.approx(latency + 2 * nic_s, rel=1e-9)
    # With a NIC per device the two flows do not meet.
    separate = hosts(2, 2, nic_per_device=True)
    assert FlowNetwork(separate).time(both).duration_s == pytest.approx(separate.path_latency_s(0, 2) + nic_s, rel=1e-9)


def test_only_the_flow_model_sees_steps_that_overlap_in_time():
    # Rank 1 has nothing to do in step 0, so its step-1 transfer runs alongside rank 0's.
    topology = hosts(2, 2, nic_per_device=False)
    overlapping = two_flows((Transfer(0, 2, 10**6, False),), (Transfer(1, 3, 10**6, False),))
    latency, nic_s = topology.path_latency_s(0, 2), 10**6 / 12.5e6
    assert AlphaBetaNetwork(topology).time(overlapping).duration_s == pytest.approx(latency + nic_s, rel=1e-9)
    assert FlowNetwork(topology).time(overlapping).duration_s == pytest.approx(latency + 2 * nic_s, rel=1e-9)


def test_max_min_fair_share_gives_spare_capacity_to_the_unconstrained_flow():
    # A = 0->2 and B = 1->4 share host0's 12.5 MB/s NIC: 6.25 MB/s each. C = 3->2 stays inside
    # host1 and shares only rank 2's 125 MB/s down-link with A, so it gets 125 - 6.25, not 62.5.
    topology = hosts(3, 2, nic_per_device=False)
    size = 10**6
    schedule = CommSchedule(OpKind.BROADCAST, "test", tuple(range(6)), 0, size,
                            ((Transfer(0, 2, size, True), Transfer(1, 4, size, False), Transfer(3, 2, size, True)),))
    timing = FlowNetwork(topology).time(schedule)
    inter, intra = topology.path_latency_s(0, 2), topology.path_latency_s(3, 2)
    assert timing.finish_s[0] == pytest.approx(inter + size / 6.25e6, rel=1e-9)
    # C runs alone at 125 MB/s until A and B start flowing, then at 118.75 MB/s.
    alone_bytes = 125e6 * (inter - intra)
    assert timing.finish_s[3] == pytest.approx(inter + (size - alone_bytes) / 118.75e6, rel=1e-9)


def test_rates_are_recomputed_when_a_flow_ends():
    # A = 0->2, B = 1->3 and C = 4->3 (half the size) all enter host1 through its 12.5 MB/s NIC:
    # a third each; when C ends, A and B share the NIC half and half.
    topology = hosts(3, 2, nic_per_device=False)
    size = 10**6
    schedule = CommSchedule(OpKind.BROADCAST, "test", tuple(range(6)), 0, size,
                            ((Transfer(0, 2, size, False), Transfer(1, 3, size, True), Transfer(4, 3, size // 2, True)),))
    timing = FlowNetwork(topology).time(schedule)
    latency = topology.path_latency_s(0, 2)
    first_end = latency + (size // 2) / (12.5e6 / 3)
    assert timing.finish_s[4] == pytest.approx(first_end, rel=1e-9)
    assert timing.finish_s[0] == pytest.approx(first_end + (size - size // 2) / 6.25e6, rel=1e-9)


def test_a_shared_nic_slows_rings_that_cross_hosts():
    # A flat ring interleaving two hosts sends four flows through each NIC per step; with a NIC
    # per device they do not meet. The host-major ring crosses each NIC once per direction.
    size = 8 * 8 * 4096
    interleaved = (0, 4, 1, 5, 2, 6, 3, 7)
    shared, own = hosts(2, 4, nic_per_device=False), hosts(2, 4, nic_per_device=True)
    ring = build_schedule(OpKind.ALLREDUCE, "ring", interleaved, size)
    nic_s = 2 * 7 / 8 * size / 12.5e6  # the ring's bandwidth term at full NIC speed
    slow = FlowNetwork(shared).time(ring).duration_s
    fast = FlowNetwork(own).time(ring).duration_s
    assert slow - fast == pytest.approx(3 * nic_s, rel=0.01)  # each flow gets a quarter of the NIC
    assert channel_bytes(ring, shared)["h0.nic:up"] == 4 * 14 * size // 8
    # The hierarchical reduce-scatter pays G times the inter-host bandwidth term on a shared NIC.
    group = tuple(range(8))
    rs = build_schedule(OpKind.ALLREDUCE, "two_level_rs", group, size, host_groups=shared.host_groups(group))
    inter = 2 * (1 / 2) * (size / 4) / 12.5e6
    assert FlowNetwork(shared).time(rs).duration_s - FlowNetwork(own).time(rs).duration_s == pytest.approx(3 * inter, rel=0.01)


# --- timing semantics ---------------------------------------------------------------------


@pytest.mark.parametrize("model", [AlphaBetaNetwork, FlowNetwork])
def test_timing_semantics(model):
    topology = box(4)
    network = model(topology)
    reduce = network.time(build_schedule(OpKind.REDUCE, "binomial", range(4), 10**5))
    hop = 2 * LINK_LATENCY_S + 10**5 / LINK_BYTES_PER_S
    # Step 0: 1->0 and 3->2; step 1: 2->0. Senders are done once their bytes have arrived.
    assert dict(reduce.finish_s) == pytest.approx({0: 2 * hop, 1: hop, 2: 2 * hop, 3: hop})
    assert reduce.duration_s == pytest.approx(2 * hop)
    # A rank idle in every step finishes at 0; one rank takes no time.
    idle = CommSchedule(OpKind.BROADCAST, "test", (0, 1, 2), 0, 8, ((Transfer(0, 1, 8, False),),))
    assert network.time(idle).finish_s[2] == 0.0
    single = network.time(build_schedule(OpKind.ALLREDUCE, "ring", (3,), 10**6))
    assert single.duration_s == 0.0 and dict(single.finish_s) == {3: 0.0}


@pytest.mark.parametrize("model", [AlphaBetaNetwork, FlowNetwork])
def test_reductions_run_one_at_a_time_after_arrival(model):
    topology = box(3)
    fan_in = CommSchedule(OpKind.REDUCE, "test", (0, 1, 2), 0, 10**5, ((Transfer(1, 0, 10**5, True), Transfer(2, 0, 10**5, True)),))
    gamma = 1e-8
    timing = model(topology, {0: gamma, 1: 0.0, 2: 0.0}).time(fan_in)
    arrival = 2 * LINK_LATENCY_S + 2 * 10**5 / LINK_BYTES_PER_S  # the two share rank 0's down-link
    assert timing.finish_s[1] == pytest.approx(arrival)
    assert timing.finish_s[0] == pytest.approx(arrival + 2 * 10**5 * gamma)


def test_zero_byte_transfers_cost_latency_only():
    topology = box(2)
    schedule = build_schedule(OpKind.ALLREDUCE, "recursive_doubling", range(2), 0)
    for model in (AlphaBetaNetwork, FlowNetwork):
        assert model(topology).time(schedule).duration_s == pytest.approx(2 * LINK_LATENCY_S)


def test_models_are_registered_and_check_gammas():
    assert NETWORK_MODELS == {"alpha_beta": AlphaBetaNetwork, "flow": FlowNetwork}
    with pytest.raises(ValueError, match="lacks ranks"):
        FlowNetwork(box(2), {0: 1e-9})


def test_flow_is_deterministic_and_fast_enough():
    topology = hosts(4, 4, nic_per_device=False)
    network = FlowNetwork(topology, gammas(topology))
    ring = build_schedule(OpKind.ALLREDUCE, "ring", range(16), 16 * 2**20)
    start = time.perf_counter()
    first = network.time(ring)
    elapsed = time.perf_counter() - start
    assert network.time(ring) == first
    assert elapsed < 0.1  # about 3 ms on a laptop core: 30 steps x 16 transfers
    tree = build_schedule(OpKind.ALLREDUCE, "double_binary_tree", range(16), 64 * 2**20)
    start = time.perf_counter()
    network.time(tree)
    assert time.perf_counter() - start < 1.0  # about 40 ms: 3840 transfers


# --- the pricer -----------------------------------------------------------------------------


def test_pricer_caches_and_resolves_explicit_names():
    topology = box(4)
    pricer = CollectivePricer(FlowNetwork(topology), topology)
    name, timing = pricer.price(OpKind.ALLREDUCE, "ring", (0, 1, 2, 3), 4096)
    assert name == "ring" and isinstance(timing, CollectiveTiming)
    assert pricer.price(OpKind.ALLREDUCE, "ring", (0, 1, 2, 3), 4096)[1] is timing
    with pytest.raises(ConfigError, match=r"unknown allreduce algorithm; known: .* \(got 'nope'\)"):
        pricer.price(OpKind.ALLREDUCE, "nope", (0, 1, 2, 3), 4096)


@pytest.mark.parametrize("model", [AlphaBetaNetwork, FlowNetwork])
def test_auto_picks_log_depth_for_tiny_messages_and_bandwidth_optimal_for_large(model):
    for p, large_choice in ((4, "rabenseifner"), (8, "rabenseifner"), (6, "ring")):
        topology = box(p)
        pricer = CollectivePricer(model(topology, gammas(topology)), topology)
        group = tuple(range(p))
        tiny, _ = pricer.price(OpKind.ALLREDUCE, "auto", group, 64)
        # star (2 steps) or recursive doubling (lg p steps): never the 2(p-1)-step ring
        assert tiny in {"recursive_doubling", "star"}
        if p == 4:
            assert tiny == "recursive_doubling"
        large, timing = pricer.price(OpKind.ALLREDUCE, "auto", group, 64 * 2**20)
        assert large == large_choice
        assert timing == min((pricer.price(OpKind.ALLREDUCE, name, group, 64 * 2**20)[1] for name in ALGORITHMS[OpKind.ALLREDUCE]),
                             key=lambda t: t.duration_s)
        assert pricer.price(OpKind.BROADCAST, "auto", group, 64 * 2**20, root=1)[0] == "binomial"


def test_auto_skips_algorithms_that_do_not_fit_the_hosts():
    # Hosts holding 3 and 1 ranks of the group: two_level_rs does not apply, the rest do.
    topology = hosts(2, 4, nic_per_device=False)
    pricer = CollectivePricer(FlowNetwork(topology), topology)
    name, _ = pricer.price(OpKind.ALLREDUCE, "auto", (0, 1, 2, 4), 2**20)
    assert name in ALGORITHMS[OpKind.ALLREDUCE] and name != "two_level_rs"
    with pytest.raises(ConfigError, match="root"):
        pricer.price(OpKind.REDUCE, "auto", (0, 1), 8, root=5)


def test_auto_breaks_ties_by_name():
    # Two ranks: ring, rabenseifner, two_level_rs and others coincide; the smallest name wins.
    topology = box(2)
    pricer = CollectivePricer(AlphaBetaNetwork(topology), topology)
    durations = {name: pricer.price(OpKind.ALLREDUCE, name, (0, 1), 4096)[1].duration_s for name in ALGORITHMS[OpKind.ALLREDUCE]}
    best = min(durations.values())
    assert pricer.price(OpKind.ALLREDUCE, "auto", (0, 1), 4096)[0] == min(n for n, d in durations.items() if d == best)


@pytest.mark.parametrize("size", [64, 2**16, 2**24])
@pytest.mark.parametrize("nic_per_device", [False, True])
def test_flow_lower_bound_never_exceeds_the_time_so_auto_skips_exactly(size, nic_per_device):
    topology = hosts(2, 4, nic_per_device=nic_per_device)
    network = FlowNetwork(topology, gammas(topology))
    pricer = CollectivePricer(network, topology)
    group = tuple(range(8))
    for kind, names in ALGORITHMS.items():
        root = None if kind == OpKind.ALLREDUCE else 0
        durations = {}
        for name in names:
            schedule = build_schedule(kind, name, group, size, root=root, host_groups=topology.host_groups(group))
            durations[name] = network.time(schedule).duration_s
            assert network.lower_bound_s(schedule) <= durations[name] * (1 + 1e-12)
        best = min(durations.values())
        assert pricer.price(kind, "auto", group, size, root)[0] == min(n for n, d in durations.items() if d == best)


# --- steps in flight: gloo's ring keeps two segments under way -------------------------------


def test_gloos_ring_costs_its_latencies_plus_one_n_over_b_where_a_segment_outlasts_no_latency():
    """4 ranks, S = 2 segments of n/8 each; each one's bytes (0.8 ms) take less than a message's
    latency (1 ms). Each segment chain waits a latency and its own bytes per round, 2(p-1) rounds;
    the other chain's bytes, one segment behind on the same connections, flow during these
    latencies: 2(p-1) alpha + n/B, where a step-by-step schedule pays 2(p-1)/p n/B = 1.5 n/B."""
    p, n = 4, 800_000
    topology = box(p)
    alpha, n_over_b = 2 * LINK_LATENCY_S, n / LINK_BYTES_PER_S
    schedule = build_schedule(OpKind.ALLREDUCE, "library", tuple(range(p)), n)
    assert schedule.bytes_sent_per_rank() == dict.fromkeys(range(p), 2 * (p - 1) * n // p)
    assert set(schedule.in_flight) == {1, 2} and schedule.num_steps == 4 * (p - 1)
    timing = FlowNetwork(topology).time(schedule)
    assert timing.duration_s == pytest.approx(2 * (p - 1) * alpha + n_over_b, rel=1e-9)
    assert fluid_lower_bound_s(schedule, FlowNetwork(topology).links) <= timing.duration_s
    # where a segment's bytes outlast a latency the links never idle: 2(p-1)/p n/B and the latencies
    large = 16 * 2**20
    timing = FlowNetwork(topology).time(build_schedule(OpKind.ALLREDUCE, "library", tuple(range(p)), large))
    assert 1.5 * large / LINK_BYTES_PER_S < timing.duration_s < 1.5 * large / LINK_BYTES_PER_S + 4 * (p - 1) * alpha


def _in_flight(*steps, windows):
    return CommSchedule(OpKind.BROADCAST, "test", (0, 1, 2), 0, 10**6, steps, windows)


@pytest.mark.parametrize("model", [AlphaBetaNetwork, FlowNetwork])
def test_a_step_in_flight_starts_before_the_earlier_ones_are_done_and_waits_for_those_before_its_window(model):
    topology = box(3)
    alpha = 2 * LINK_LATENCY_S
    big, small = 500_000 / LINK_BYTES_PER_S, 10**5 / LINK_BYTES_PER_S
    # rank 0 receives the first half of the buffer and sends from the second
    steps = ((Transfer(1, 0, 500_000, False),), (Transfer(0, 2, 10**5, False, 500_000),),
             (Transfer(0, 2, 10**5, False, 600_000),))
    timing = model(topology).time(_in_flight(*steps, windows=(1, 2, 2)))
    # step 1 leaves at once, beside step 0; step 2 waits for step 0, two steps back, not for step 1
    assert timing.finish_s[1] == pytest.approx(alpha + big)
    assert timing.finish_s[0] == pytest.approx(timing.finish_s[2]) == pytest.approx(2 * alpha + big + small)
    in_order = model(topology).time(_in_flight(*steps, windows=(1, 1, 1)))
    assert in_order.duration_s == pytest.approx(3 * alpha + big + 2 * small)
    assert in_order.duration_s == model(topology).time(CommSchedule(OpKind.BROADCAST, "test", (0, 1, 2), 0, 10**6,
                                                                     steps)).duration_s


def test_messages_in_flight_between_one_pair_move_their_bytes_one_after_the_other():
    """Two 1 MB messages from 0 to 1 in flight together: the first is in after one wire time, not
    two (sharing), so rank 1 enters step 2 (which waits for step 0 only) a wire time earlier."""
    topology = box(3)
    alpha, wire = 2 * LINK_LATENCY_S, 10**6 / LINK_BYTES_PER_S
    steps = ((Transfer(0, 1, 10**6, False),), (Transfer(0, 1, 10**6, False),), (Transfer(1, 2, 0, False),))
    timing = FlowNetwork(topology).time(_in_flight(*steps, windows=(1, 2, 2)))
    assert timing.finish_s[2] == pytest.approx(2 * alpha + wire)
    assert timing.finish_s[1] == pytest.approx(alpha + 2 * wire)


def test_a_step_in_flight_may_not_send_bytes_it_receives_in_a_step_still_under_way():
    with pytest.raises(ValueError, match="sends bytes received there"):
        _in_flight((Transfer(1, 0, 10**6, False),), (Transfer(0, 2, 10**6, False),), windows=(1, 2))
    with pytest.raises(ValueError, match="in_flight"):
        _in_flight((Transfer(1, 0, 10**6, False),), windows=(1, 2))
    # the same steps waiting for each other are fine
    assert _in_flight((Transfer(1, 0, 10**6, False),), (Transfer(0, 2, 10**6, False),), windows=(1, 1)).num_steps == 2
