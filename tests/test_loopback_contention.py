"""The machine's core contention timed on loopback after a calibration's launch (issue 18): the
calls of a delayed-link calibration again, where links hide nothing, as rows the simulator fits."""

import os
import shutil

import pytest

from models.ops import OpKind
from runtime.loopback_contention import bridged_rows, bridged_topology, loopback_calls, loopback_rows, loopback_sizes
from runtime.testbed import Testbed
from sim.profile import load_profile
from sim.vocabulary import MeasurementKind
from tests.conftest import ROOT

DELAYED = ROOT / "validation" / "holdout-report" / "profiles" / "h3x1_delay.csv"  # 3 hosts x 1 rank, 5 ms


def test_a_round_makes_each_in_place_call_at_its_smallest_size_a_broadcast_right_after_its_reduce():
    profile = load_profile(DELAYED)
    in_place = profile.of(MeasurementKind.COLLECTIVE_IN_PLACE)
    smallest = in_place[in_place["size_bytes"] == in_place["size_bytes"].min()]
    calls = loopback_calls(profile.rows, (0, 1, 2))
    assert {(c.kind.value, c.algorithm) for c in calls} == set(zip(smallest["op"], smallest["algorithm"]))
    assert {c.size_bytes for c in calls} == {int(smallest["size_bytes"].iloc[0])}
    kinds = [c.kind for c in calls if c.algorithm == "library"]
    assert kinds.index(OpKind.BROADCAST) == kinds.index(OpKind.REDUCE) + 1
    assert all(c.root == (None if c.kind == OpKind.ALLREDUCE else 0) for c in calls)


def test_the_group_is_timed_beyond_the_cores_up_to_twice_them_and_at_the_clusters_ranks():
    assert loopback_sizes(2, 4) == (3, 4) and loopback_sizes(2, 3) == (3, 4) and loopback_sizes(2, 6) == (3, 4, 6)
    assert loopback_sizes(4, 4) == (5, 8)
    # a machine whose cores no rank would wait for is not timed
    assert loopback_sizes(16, 4) == ()


def test_loopback_rows_time_every_call_at_each_size_as_in_place_calls_are_timed():
    profile = load_profile(DELAYED)
    rows = loopback_rows(profile.rows, cores=2, cluster_ranks=3)
    calls = {(c.kind.value, c.algorithm) for c in loopback_calls(profile.rows, (0, 1, 2))}
    for size in (3, 4):
        mine = [r for r in rows if r["group_size"] == size]
        assert sorted((r["op"], r["algorithm"]) for r in mine) == sorted(calls)
        for row in mine:
            assert row["measurement"] == MeasurementKind.COLLECTIVE_LOOPBACK and row["num_hosts"] == size
            # a few KiB on loopback: milliseconds, where the 5 ms links took tens
            assert 0 < row["p10"] <= row["median"] <= row["p90"] < 0.1
            assert row["repeats"] == 8


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="building a testbed needs root and iproute2 (ip, tc)")
def test_bridged_rows_time_the_same_calls_between_namespaces_and_remove_their_testbed():
    profile = load_profile(DELAYED)
    name = f"pytest_bridge_{os.getpid()}"
    rows = bridged_rows(profile.rows, cores=2, cluster_ranks=3, name=name, device_type="cpu")
    calls = {(c.kind.value, c.algorithm) for c in loopback_calls(profile.rows, (0, 1, 2))}
    for size in (3, 4):
        mine = [r for r in rows if r["group_size"] == size]
        assert sorted((r["op"], r["algorithm"]) for r in mine) == sorted(calls)
        for row in mine:
            assert row["measurement"] == MeasurementKind.COLLECTIVE_BRIDGED and row["num_hosts"] == size
            assert 0 < row["p10"] <= row["median"] <= row["p90"] < 0.1
        bed = Testbed(f"{name}.bridge{size}", bridged_topology("cpu", size))
        assert not bed.injects_delay  # a bridge, no forwarder on the path
        assert not bed.state_path.exists()  # built for the launch, removed after it
