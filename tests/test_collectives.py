"""Collective schedules (sim/collectives): semantics executed on data, bytes per rank, closed forms."""

import dataclasses
import math

import numpy as np
import pytest

from models.errors import ConfigError
from models.ops import OpKind
from sim.collectives.chunks import ALIGNMENT_BYTES, ByteRange, split
from sim.collectives.closed_form import closed_form_time_s, two_level_time_s
from sim.collectives.double_binary_tree import MAX_SEGMENTS, SEGMENT_BYTES, nccl_double_tree, num_segments
from sim.collectives.registry import ALGORITHMS, build_schedule
from sim.collectives.schedule import (
    CommSchedule,
    Transfer,
    alg_bw_bytes_per_s,
    bus_bandwidth_factor,
    bus_bw_bytes_per_s,
    execute,
)

ALL = [(kind, name) for kind, names in ALGORITHMS.items() for name in names]
# Odd global rank ids in a scrambled order: schedules must use the group's ids, not 0..p-1.
GLOBAL_IDS = (17, 3, 11, 5, 23, 8, 14, 2, 30)
SIZES = (0, 1, 13, 64, 1000, 4104, 3 * 2 * SEGMENT_BYTES + 40)


def host_groups_for(name: str, group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Hosts of 3 (two_level_rs needs equal hosts: 3 when p divides, else one host), else of 2."""
    if name == "two_level_rs":
        width = 3 if len(group) % 3 == 0 else len(group)
    else:
        width = 2
    return tuple(group[i : i + width] for i in range(0, len(group), width))


def run(schedule: CommSchedule, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    inputs = {rank: rng.integers(-1000, 1000, schedule.size_bytes).astype(np.float64) for rank in schedule.group}
    return inputs, execute(schedule, inputs)


# --- semantics: every algorithm computes its collective ------------------------------------


@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
def test_schedule_computes_the_collective(kind, name):
    for p in range(1, 10):
        group = GLOBAL_IDS[:p]
        for size in SIZES:
            roots = [None] if kind == OpKind.ALLREDUCE else [None, group[-1]]
            for root in roots:
                schedule = build_schedule(kind, name, group, size, root=root, host_groups=host_groups_for(name, group))
                inputs, out = run(schedule, seed=p * 1000 + size)
                total = np.sum([inputs[r] for r in group], axis=0)
                where = f"{kind} {name} p={p} size={size} root={root}"
                if kind == OpKind.ALLREDUCE:
                    for rank in group:
                        np.testing.assert_array_equal(out[rank], total, err_msg=where)
                elif kind == OpKind.REDUCE:
                    np.testing.assert_array_equal(out[group[0] if root is None else root], total, err_msg=where)
                else:
                    for rank in group:
                        np.testing.assert_array_equal(out[rank], inputs[group[0] if root is None else root], err_msg=where)


@pytest.mark.parametrize("name", ["two_level_tree", "two_level_rs"])
def test_two_level_with_hosts_in_any_order(name):
    hosts = ((30, 2, 14), (5, 23, 8), (17, 3, 11))
    group = tuple(r for host in hosts for r in host)[::-1]
    schedule = build_schedule(OpKind.ALLREDUCE, name, group, 7000, host_groups=hosts)
    inputs, out = run(schedule, seed=1)
    total = np.sum(list(inputs.values()), axis=0)
    assert all(np.array_equal(out[r], total) for r in group)


def test_two_level_tree_accepts_uneven_hosts():
    hosts = ((0,), (1, 2, 3, 4, 5), (6, 7))
    schedule = build_schedule(OpKind.ALLREDUCE, "two_level_tree", range(8), 4096, host_groups=hosts)
    inputs, out = run(schedule, seed=2)
    assert all(np.array_equal(out[r], np.sum(list(inputs.values()), axis=0)) for r in range(8))


def test_execute_follows_the_step_semantics():
    # Both ranks send at the start of the step; receives apply after it: a swap, not a copy chain.
    swap = CommSchedule(OpKind.ALLREDUCE, "test", (0, 1), None, 2, ((Transfer(0, 1, 2, False), Transfer(1, 0, 2, False)),))
    out = execute(swap, {0: np.array([1.0, 2.0]), 1: np.array([3.0, 4.0])})
    assert out[0].tolist() == [3.0, 4.0] and out[1].tolist() == [1.0, 2.0]
    # Two reduce-transfers into one range in one step are both added.
    fan_in = CommSchedule(OpKind.REDUCE, "test", (0, 1, 2), 0, 1, ((Transfer(1, 0, 1, True), Transfer(2, 0, 1, True)),))
    assert execute(fan_in, {0: np.array([1.0]), 1: np.array([10.0]), 2: np.array([100.0])})[0].tolist() == [111.0]
    with pytest.raises(ValueError, match="need a buffer"):
        execute(fan_in, {0: np.zeros(1), 1: np.zeros(1)})


# --- schedule structure: bytes and steps ----------------------------------------------------


def schedule(name: str, p: int, size: int, kind: OpKind = OpKind.ALLREDUCE) -> CommSchedule:
    return build_schedule(kind, name, range(p), size)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 9, 16])
def test_ring_sends_two_p_minus_one_over_p_n_per_rank(p):
    n = ALIGNMENT_BYTES * p * 100
    ring = schedule("ring", p, n)
    assert ring.num_steps == 2 * (p - 1)
    assert set(ring.bytes_sent_per_rank().values()) == {2 * (p - 1) * n // p}
    assert set(ring.bytes_received_per_rank().values()) == {2 * (p - 1) * n // p}


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_recursive_doubling_sends_lg_p_times_n_per_rank(p):
    rd = schedule("recursive_doubling", p, 1000)
    assert rd.num_steps == int(math.log2(p))
    assert set(rd.bytes_sent_per_rank().values()) == {int(math.log2(p)) * 1000}


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_rabenseifner_is_bandwidth_optimal_on_a_power_of_two(p):
    n = ALIGNMENT_BYTES * p * 10
    rab = schedule("rabenseifner", p, n)
    assert rab.num_steps == 2 * int(math.log2(p))
    assert set(rab.bytes_sent_per_rank().values()) == {2 * (p - 1) * n // p}


@pytest.mark.parametrize("p", [3, 5, 6, 7, 9, 12])
def test_non_power_of_two_folds_the_extra_ranks(p):
    n = 8 * 64
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    rd, rab = schedule("recursive_doubling", p, n), schedule("rabenseifner", p, n)
    assert rd.num_steps == int(math.log2(p2)) + 2
    assert rab.num_steps == 2 * int(math.log2(p2)) + 2
    # The fold: the first 2r positions pair up, evens send everything to odds.
    assert rab.steps[0] == tuple(Transfer(i, i + 1, n, True) for i in range(0, 2 * extra, 2))
    assert rab.steps[-1] == tuple(Transfer(i + 1, i, n, False) for i in range(0, 2 * extra, 2))
    sent = rab.bytes_sent_per_rank()
    assert [sent[i] for i in range(0, 2 * extra, 2)] == [n] * extra  # folded ranks only fold
    assert sent[p - 1] == 2 * (p2 - 1) * n // p2


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 9])
def test_binomial_trees_move_n_per_edge_in_ceil_lg_p_steps(p):
    for kind in (OpKind.REDUCE, OpKind.BROADCAST):
        tree = build_schedule(kind, "binomial", range(p), 100, root=p // 2)
        assert tree.num_steps == math.ceil(math.log2(p))
        assert sum(1 for _ in tree.transfers()) == p - 1
        assert all(t.size_bytes == 100 and t.reduce == (kind == OpKind.REDUCE) for t in tree.transfers())
        assert tree.root == p // 2


@pytest.mark.parametrize("p", [2, 5, 8])
def test_star_hub_carries_p_minus_one_messages_each_way(p):
    star = schedule("star", p, 100)
    assert star.num_steps == 2
    assert star.bytes_received_per_rank()[0] == star.bytes_sent_per_rank()[0] == (p - 1) * 100
    assert schedule("star", p, 100, OpKind.REDUCE).bytes_received_per_rank()[0] == (p - 1) * 100
    assert schedule("star", p, 100, OpKind.BROADCAST).bytes_sent_per_rank()[0] == (p - 1) * 100


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 14, 16])
def test_double_binary_tree_moves_each_half_up_and_down_every_edge(p):
    n = 2 * 5 * SEGMENT_BYTES
    dbt = schedule("double_binary_tree", p, n)
    k = num_segments(n)
    assert k == 5
    height = max(tree.height(tree.root) for tree in nccl_double_tree(p))
    assert dbt.num_steps == k + 2 * height - 1
    # Two trees of p-1 edges; each edge carries its half up once and down once.
    assert sum(t.size_bytes for t in dbt.transfers()) == 2 * (p - 1) * n
    assert max(dbt.bytes_sent_per_rank().values()) <= 2 * n


def test_num_segments_is_bounded():
    assert num_segments(0) == num_segments(2 * SEGMENT_BYTES) == 1
    assert num_segments(2 * SEGMENT_BYTES + 1) == 2
    assert num_segments(1 << 40) == MAX_SEGMENTS


@pytest.mark.parametrize("p", range(1, 40))
def test_nccl_double_tree_shape(p):
    first, second = nccl_double_tree(p)
    assert first.root == 0 and second.root == ((1 if p > 1 else 0) if p % 2 else p - 1)  # ncclGetDtreeRoots
    for tree in (first, second):
        for v in range(p):
            assert len(tree.children[v]) <= 2
            for child in tree.children[v]:
                assert tree.parent[child] == v
        assert [v for v in range(p) if tree.parent[v] == -1] == [tree.root]
        assert all(tree.depth(v) <= tree.height(tree.root) for v in range(p))  # reaches the root: a tree
    if p % 2 == 0:  # each rank has children in at most one tree
        assert all(not (first.children[v] and second.children[v]) for v in range(p))


def test_nccl_tree_matches_the_trees_cc_illustration():
    first, _ = nccl_double_tree(14)
    assert first.children[0] == (8,)
    assert first.children[8] == (4, 12)
    assert first.children[12] == (10, 13)
    assert first.children[2] == (1, 3)
    assert first.parent[13] == 12 and first.parent[9] == 10


def test_two_level_rs_steps_and_inter_host_bytes():
    hosts = ((0, 1, 2, 3), (4, 5, 6, 7))
    n = 8 * 4 * 2 * 10
    rs = build_schedule(OpKind.ALLREDUCE, "two_level_rs", range(8), n, host_groups=hosts)
    assert rs.num_steps == 2 * 3 + 2 * 1 + 0  # RS and AG in hosts, ring of 2 across
    crossing = [t for t in rs.transfers() if (t.src < 4) != (t.dst < 4)]
    assert len(crossing) == 2 * 4 * 2  # 4 rings, 2 steps, 2 ranks each
    assert sum(t.size_bytes for t in crossing) == 2 * 2 * n // 2  # n/G per ring, 2((N-1)/N) each way


def test_two_level_tree_only_leaders_cross_hosts():
    hosts = ((0, 1, 2), (3, 4, 5), (6, 7, 8))
    tree = build_schedule(OpKind.ALLREDUCE, "two_level_tree", range(9), 900, host_groups=hosts)
    crossing = {(t.src, t.dst) for t in tree.transfers() if t.src // 3 != t.dst // 3}
    assert crossing == {(0, 3), (3, 6), (6, 0)}


# --- registry ----------------------------------------------------------------------------


def test_registry_lists_the_algorithms():
    assert set(ALGORITHMS[OpKind.ALLREDUCE]) == {
        "ring", "recursive_doubling", "rabenseifner", "star", "double_binary_tree", "two_level_tree", "two_level_rs"
    }
    assert set(ALGORITHMS[OpKind.REDUCE]) == set(ALGORITHMS[OpKind.BROADCAST]) == {"binomial", "star"}


def test_unknown_algorithm_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"^allreduce: unknown allreduce algorithm; known: ring, recursive_doubling, .* \(got 'x'\)$") as caught:
        build_schedule(OpKind.ALLREDUCE, "x", (0, 1), 8)
    assert caught.value.field == "allreduce"  # the variant's field that names it
    with pytest.raises(ConfigError, match="kind"):
        build_schedule(OpKind.LAYERNORM, "ring", (0, 1), 8)


@pytest.mark.parametrize(
    "call,field",
    [
        (dict(kind=OpKind.ALLREDUCE, algorithm="two_level_tree", group=(0, 1), size_bytes=8), "host_groups"),
        (dict(kind=OpKind.ALLREDUCE, algorithm="two_level_rs", group=(0, 1, 2), size_bytes=8, host_groups=((0,), (1, 2))), "host_groups"),
        (dict(kind=OpKind.ALLREDUCE, algorithm="two_level_tree", group=(0, 1, 2), size_bytes=8, host_groups=((0,), (1,))), "host_groups"),
        (dict(kind=OpKind.ALLREDUCE, algorithm="two_level_tree", group=(0, 1), size_bytes=8, host_groups=((0, 1), (1,))), "host_groups"),
        (dict(kind=OpKind.REDUCE, algorithm="binomial", group=(0, 1), size_bytes=8, root=5), "root"),
        (dict(kind=OpKind.ALLREDUCE, algorithm="ring", group=(), size_bytes=8), "group"),
        (dict(kind=OpKind.ALLREDUCE, algorithm="ring", group=(0, 0), size_bytes=8), "group"),
        (dict(kind=OpKind.ALLREDUCE, algorithm="ring", group=(0, 1), size_bytes=-1), "size_bytes"),
    ],
)
def test_bad_requests_are_config_errors(call, field):
    with pytest.raises(ConfigError) as caught:
        build_schedule(**call)
    assert caught.value.field == field


@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
def test_one_rank_is_an_empty_schedule(kind, name):
    single = build_schedule(kind, name, (7,), 1000, host_groups=((7,),))
    assert single.steps == () and single.group == (7,)
    assert single.root == (None if kind == OpKind.ALLREDUCE else 7)
    assert single.kind == kind and single.algorithm == name


def test_root_defaults_to_the_first_rank():
    assert build_schedule(OpKind.BROADCAST, "binomial", (4, 2, 9), 8).root == 4
    assert all(t.src == 4 for t in build_schedule(OpKind.BROADCAST, "binomial", (4, 2, 9), 8).steps[0])


# --- chunks and schedule validation ---------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4097, 10**6 + 3])
@pytest.mark.parametrize("parts", [1, 2, 3, 7, 8, 16])
def test_split_conserves_bytes_and_stays_aligned(size, parts):
    chunks = split(ByteRange(16, size), parts)
    assert len(chunks) == parts
    assert sum(c.size_bytes for c in chunks) == size
    assert chunks[0].offset_bytes == 16 and chunks[-1].end_bytes == 16 + size
    assert all(a.end_bytes == b.offset_bytes for a, b in zip(chunks, chunks[1:]))
    assert all(c.offset_bytes % ALIGNMENT_BYTES == 0 for c in chunks)
    sizes = [c.size_bytes for c in chunks]
    assert max(sizes) - min(sizes) <= 2 * ALIGNMENT_BYTES - 1


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError):
        split(ByteRange(0, 10), 0)
    with pytest.raises(ValueError):
        split(ByteRange(3, 10), 2)


@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
def test_every_transfer_is_aligned_and_inside_the_buffer(kind, name):
    size = 8 * 1234 + 5
    for p in (3, 6, 8):
        group = tuple(range(p))
        sched = build_schedule(kind, name, group, size, host_groups=host_groups_for(name, group))
        for t in sched.transfers():
            assert t.offset_bytes % ALIGNMENT_BYTES == 0
            assert 0 <= t.offset_bytes <= t.end_bytes <= size


def test_schedule_validation():
    def make(*steps, group=(0, 1, 2), size=16, root=None):
        return CommSchedule(OpKind.ALLREDUCE, "test", group, root, size, steps)

    with pytest.raises(ValueError, match="copy overlaps"):
        make((Transfer(0, 2, 8, False), Transfer(1, 2, 8, True, 4)))
    with pytest.raises(ValueError, match="outside"):
        make((Transfer(0, 1, 8, False, 12),))
    with pytest.raises(ValueError, match="endpoints"):
        make((Transfer(0, 5, 8, False),))
    with pytest.raises(ValueError, match="endpoints"):
        make((Transfer(1, 1, 8, False),))
    with pytest.raises(ValueError, match="root"):
        make(root=9)
    with pytest.raises(ValueError, match="distinct"):
        make(group=(0, 0))
    make((Transfer(0, 2, 8, True), Transfer(1, 2, 8, True)))  # reductions into one range are fine
    make((Transfer(0, 2, 8, False), Transfer(1, 2, 8, False, 8)))  # disjoint copies are fine


def test_schedule_and_transfer_are_frozen_and_slotted():
    t = Transfer(0, 1, 8, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.size_bytes = 9
    assert not hasattr(t, "__dict__")
    assert not hasattr(schedule("ring", 2, 8), "__dict__")


# --- bus bandwidth (nccl-tests) -------------------------------------------------------------


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_bandwidth_factor(OpKind.ALLREDUCE, 8) == pytest.approx(2 * 7 / 8)
    assert bus_bandwidth_factor(OpKind.ALLREDUCE, 1) == 0.0
    assert bus_bandwidth_factor(OpKind.BROADCAST, 8) == bus_bandwidth_factor(OpKind.REDUCE, 8) == 1.0
    assert alg_bw_bytes_per_s(1000, 0.5) == 2000
    assert bus_bw_bytes_per_s(OpKind.ALLREDUCE, 4, 1000, 0.5) == pytest.approx(2000 * 1.5)
    with pytest.raises(ValueError):
        bus_bandwidth_factor(OpKind.ATTENTION, 4)


# --- closed forms (MPICH cost comments, Thakur et al. 2005) ------------------------------

A, B, G = 1e-3, 1 / 37.5e6, 1 / 5e9


def cf(kind, name, p, n):
    return closed_form_time_s(kind, name, p, n, A, B, G)


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64])
@pytest.mark.parametrize("n", [1024, 10**6])
def test_closed_forms_match_the_mpich_table_on_powers_of_two(p, n):
    lg = math.log2(p)
    ar = OpKind.ALLREDUCE
    assert cf(ar, "ring", p, n) == pytest.approx(2 * (p - 1) * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G, rel=1e-12)
    assert cf(ar, "recursive_doubling", p, n) == pytest.approx(lg * (A + n * B + n * G), rel=1e-12)
    assert cf(ar, "rabenseifner", p, n) == pytest.approx(2 * lg * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G, rel=1e-12)
    assert cf(ar, "star", p, n) == pytest.approx(2 * A + 2 * (p - 1) * n * B + (p - 1) * n * G, rel=1e-12)
    assert cf(OpKind.REDUCE, "binomial", p, n) == pytest.approx(lg * (A + n * B) + lg * n * G, rel=1e-12)
    assert cf(OpKind.BROADCAST, "binomial", p, n) == pytest.approx(lg * (A + n * B), rel=1e-12)
    assert cf(OpKind.REDUCE, "star", p, n) == pytest.approx(A + (p - 1) * n * (B + G), rel=1e-12)
    assert cf(OpKind.BROADCAST, "star", p, n) == pytest.approx(A + (p - 1) * n * B, rel=1e-12)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12])
def test_closed_forms_off_powers_of_two(p):
    n = 10**6
    lg, p2 = math.floor(math.log2(p)), 2 ** math.floor(math.log2(p))
    # MPICH: (2 floor(lg p) + 2) a + (2(p'-1)/p' + 2) n b + (1 + (p'-1)/p') n g, exact with p' = 2^floor(lg p)
    rab = (2 * lg + 2) * A + (2 * (p2 - 1) / p2 + 2) * n * B + (1 + (p2 - 1) / p2) * n * G
    assert cf(OpKind.ALLREDUCE, "rabenseifner", p, n) == pytest.approx(rab, rel=1e-12)
    assert cf(OpKind.ALLREDUCE, "recursive_doubling", p, n) == pytest.approx((lg + 2) * (A + n * B) + (lg + 1) * n * G, rel=1e-12)
    assert cf(OpKind.BROADCAST, "binomial", p, n) == pytest.approx(math.ceil(math.log2(p)) * (A + n * B), rel=1e-12)


def test_double_binary_tree_closed_form_is_the_pipelined_steady_state():
    n, p = 64 * 2**20, 16  # k = 64 segments of n/128
    k, height = 64, 4
    m = n / 2 / k
    expected = (k + 2 * height - 1) * (A + 4 * m * B) + (k + height - 1) * 2 * m * G
    assert cf(OpKind.ALLREDUCE, "double_binary_tree", p, n) == pytest.approx(expected, rel=1e-12)
    # bandwidth term about 2 n b for many segments (NCCL src/graph/trees.cc)
    assert cf(OpKind.ALLREDUCE, "double_binary_tree", p, n) < 1.15 * (2 * n * B + 2 * n * G / 2 + (k + 7) * A)


def test_closed_form_of_one_rank_is_zero_and_unknowns_are_errors():
    assert cf(OpKind.ALLREDUCE, "ring", 1, 10**6) == 0.0
    with pytest.raises(ConfigError, match="no closed form"):
        cf(OpKind.ALLREDUCE, "two_level_tree", 4, 10)
    with pytest.raises(ConfigError, match="no closed form"):
        cf(OpKind.REDUCE, "ring", 4, 10)
    with pytest.raises(ConfigError):
        cf(OpKind.ALLREDUCE, "ring", 0, 10)
    with pytest.raises(ConfigError, match="two-level"):
        two_level_time_s("ring", 2, 2, 8, (A, B), (A, B), 0.0, False)


@pytest.mark.parametrize("hosts,local", [(2, 4), (4, 8), (3, 3)])
def test_two_level_closed_forms_match_field_notes(hosts, local):
    n, ai, bi, ae, be = 10**6, 2e-6, 1 / 16e9, 1e-3, 1 / 1.25e8
    tree = 2 * math.ceil(math.log2(local)) * (ai + n * bi) + 2 * (hosts - 1) * ae + 2 * (hosts - 1) / hosts * n * be
    assert two_level_time_s("two_level_tree", hosts, local, n, (ai, bi), (ae, be), 0.0, True) == pytest.approx(tree, rel=1e-12)
    for shared, be_eff in ((False, be), (True, local * be)):
        rs = 2 * ((local - 1) * ai + (local - 1) / local * n * bi) + 2 * (hosts - 1) * ae + 2 * (hosts - 1) / hosts * (n / local) * be_eff
        assert two_level_time_s("two_level_rs", hosts, local, n, (ai, bi), (ae, be), 0.0, shared) == pytest.approx(rs, rel=1e-12)


@pytest.mark.parametrize("broadcast", ["binomial", "gloo_tree"])
def test_library_is_gloos_algorithm_under_its_own_name(broadcast, monkeypatch):
    from sim.collectives import registry
    from sim.collectives.registry import LIBRARY
    from sim.collectives.schedule import execute

    monkeypatch.setattr(registry, "LIBRARY_BROADCAST", registry.LibraryBroadcast(broadcast))
    for p in (2, 3, 4, 5):
        group = tuple(range(p))
        # gloo's loops at two segments per rank: 2(p-1) iterations per ring pass, the reduce's
        # gather; MPICH's broadcast takes ceil(lg p) steps, gloo's tree as many as the most bits a
        # relative rank below p has
        tree_steps = math.ceil(math.log2(p)) if broadcast == "binomial" else max(v.bit_count() for v in range(p))
        for kind, steps in ((OpKind.ALLREDUCE, 4 * (p - 1)), (OpKind.REDUCE, 2 * (p - 1) + 1),
                            (OpKind.BROADCAST, tree_steps)):
            schedule = build_schedule(kind, LIBRARY, group, 4096, root=0)
            assert schedule.algorithm == LIBRARY
            assert schedule.num_steps == steps
            inputs = {r: np.arange(4096, dtype=np.int64) * (r + 1) for r in group}
            out = execute(schedule, inputs)
            total = sum(inputs.values())
            if kind == OpKind.ALLREDUCE:
                assert all(np.array_equal(out[r], total) for r in group)
            elif kind == OpKind.REDUCE:
                assert np.array_equal(out[0], total)
            else:
                assert all(np.array_equal(out[r], inputs[0]) for r in group)


def test_gloos_broadcast_root_posts_all_its_sends_at_once_and_forwarders_send_once_received(monkeypatch):
    from sim.collectives import registry

    # gloo/broadcast.cc over 8 ranks rooted at group[2]: vrank v receives from v minus its highest
    # bit and sends to v + 2^i for every 2^i above v; a rank's sends are one step, its depth
    monkeypatch.setattr(registry, "LIBRARY_BROADCAST", registry.LibraryBroadcast.GLOO_TREE)
    group = (17, 3, 11, 5, 23, 8, 14, 2)
    schedule = build_schedule(OpKind.BROADCAST, registry.LIBRARY, group, 1000, root=11)
    ranks = [group[(2 + v) % 8] for v in range(8)]

    def pairs(*edges):
        return {(ranks[a], ranks[b]) for a, b in edges}

    assert [{(t.src, t.dst) for t in step} for step in schedule.steps] == [
        pairs((0, 1), (0, 2), (0, 4)), pairs((1, 3), (1, 5), (2, 6)), pairs((3, 7))]
    assert schedule.in_flight == ()  # a forwarder waits for its receive before it sends
    # three ranks: the root sends to both at once (MPICH's binomial: farthest first, then the other)
    assert [[(t.src, t.dst) for t in step] for step in build_schedule(OpKind.BROADCAST, registry.LIBRARY, (4, 6, 9), 8,
                                                                       root=6).steps] == [[(6, 9), (6, 4)]]
    assert build_schedule(OpKind.BROADCAST, "binomial", (4, 6, 9), 8, root=6).num_steps == 2
    # the option is part of the built schedule's identity: switching it back builds MPICH's again
    monkeypatch.setattr(registry, "LIBRARY_BROADCAST", registry.LibraryBroadcast.BINOMIAL)
    assert build_schedule(OpKind.BROADCAST, registry.LIBRARY, (4, 6, 9), 8, root=6).num_steps == 2


def test_gloos_ring_keeps_two_segments_in_flight_and_cuts_large_buffers_into_segments_of_at_most_1_mib():
    from sim.collectives.gloo import MAX_SEGMENT_BYTES
    from sim.collectives.registry import LIBRARY
    from sim.collectives.schedule import execute

    p, n = 3, 10 * MAX_SEGMENT_BYTES + 24  # gloo/allreduce.cc: ceil(n / 1 MiB) = 11 -> 12 segments, 4 a rank
    group = (5, 2, 7)
    allreduce = build_schedule(OpKind.ALLREDUCE, LIBRARY, group, n)
    assert allreduce.num_steps == 2 * 4 * (p - 1)
    # each loop's first iteration waits for everything before it, the others keep two under way
    assert allreduce.in_flight == (1, 2, 2, 2, 2, 2, 2, 2) * 2
    assert max(t.size_bytes for t in allreduce.transfers()) <= MAX_SEGMENT_BYTES
    # member j sends to member j - 1, as gloo's rank does to rank - 1
    assert {(t.src, t.dst) for t in allreduce.transfers()} == {(5, 7), (2, 5), (7, 2)}
    reduce = build_schedule(OpKind.REDUCE, LIBRARY, group, n, root=2)
    assert reduce.num_steps == 12 - 2 + 1  # the source's loop issues numSegments - 2 iterations
    assert all(t.dst == 2 for t in reduce.steps[-1]) and reduce.in_flight[-1] == 1
    inputs = {r: np.arange(n, dtype=np.int64) * (r + 1) for r in group}
    total = sum(inputs.values())
    assert all(np.array_equal(buffer, total) for buffer in execute(allreduce, inputs).values())
    assert np.array_equal(execute(reduce, inputs)[2], total)
    # nothing to send, nothing sent (both return at once on zero elements)
    assert build_schedule(OpKind.ALLREDUCE, LIBRARY, group, 0).num_steps == 0
