"""The calibration's collective sweep times a call alone or queued behind others (``chain``): a
chain's row is the cost per call, and says how it was taken (issue 19: DDP's buckets run back to
back on the communication stream)."""

from __future__ import annotations

import time

import pytest

from sim.cluster_config import ClusterConfig
from sim.topology import build_topology

CALL_S = 0.02


class SleepingComm:
    """A communicator whose every call takes CALL_S, whatever it is; records the calls' sizes."""

    def __init__(self):
        self.sizes, self.process_groups = [], {}

    def run(self, call, tensor):
        self.sizes.append(call.size_bytes)
        time.sleep(CALL_S)


def _one_host_of_two():
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
        {"name": "n0", "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": "50us"},
         "interconnect": {"bandwidth": "1Gbit/s", "latency": "50us", "shared": True},
         "devices": {"type": "cpu", "count": 2, "memory": "4GiB"}}]}))


def test_a_chained_sweep_runs_its_calls_back_to_back_and_charges_the_time_per_call():
    torch = pytest.importorskip("torch")

    from models.ops import OpKind
    from runtime import clock
    from runtime.comm_timing import CollectiveSweep
    from runtime.launch import launch

    topology = _one_host_of_two()

    def body(rank, heartbeat):
        clock.synchronise()
        torch.set_num_threads(1)
        rows, calls = {}, {}
        for chain in (1, 3):
            comm = SleepingComm()
            sweep = CollectiveSweep((0, 1), topology, rank, comm, 1.0, heartbeat, sizes=(1024,),
                                    algorithms={OpKind.ALLREDUCE: ("ring",), OpKind.REDUCE: (), OpKind.BROADCAST: ()},
                                    chain=chain)
            before = len(comm.sizes)  # the warm-up and the size probe
            for index in range(2):
                sweep.round(f"round {index + 1} of 2")
            rows[chain], calls[chain] = sweep.rows(), len(comm.sizes) - before
        return rows, calls

    rows, calls = launch(body, 2, hang_timeout_s=120)[0]
    # a round warms a call of at most WARM_MAX_BYTES up with one untimed call before timing it
    assert calls == {1: 2 + 2, 3: 6 + 2}
    alone, chained = rows[1][0], rows[3][0]
    assert alone["repeats"] == chained["repeats"] == 2
    assert chained["method"].startswith("3 calls back to back")
    assert alone["method"].startswith("calls started together")
    for row in (alone, chained):  # per call, not per chain: a sleep of CALL_S plus the clocks' agreement
        assert CALL_S <= row["median"] < 2 * CALL_S


def test_a_chain_of_no_calls_is_refused():
    pytest.importorskip("torch")
    from runtime.comm_timing import CollectiveSweep

    with pytest.raises(ValueError, match="chain must be at least 1 call, got 0"):
        CollectiveSweep((0,), _one_host_of_two(), 0, None, 1.0, print, chain=0)


def test_a_round_warms_a_small_call_up_before_timing_it_and_a_large_one_not():
    """A connection idle for seconds carries a call of tens to hundreds of KiB slowly (BBR's
    ProbeRTT), which a run's busy connections do not: a small case is timed after an untimed call
    of it and a pause; the warm-up is not in its row."""
    torch = pytest.importorskip("torch")

    from models.ops import OpKind
    from runtime import clock
    from runtime.comm_timing import PROBE_RTT_S, WARM_MAX_BYTES, CollectiveSweep
    from runtime.launch import launch

    topology = _one_host_of_two()
    large = 4 * WARM_MAX_BYTES

    def body(rank, heartbeat):
        clock.synchronise()
        torch.set_num_threads(1)
        comm = SleepingComm()
        sweep = CollectiveSweep((0, 1), topology, rank, comm, 1.0, heartbeat, sizes=(1024, large),
                                algorithms={OpKind.ALLREDUCE: ("ring",), OpKind.REDUCE: (), OpKind.BROADCAST: ()})
        before = len(comm.sizes)
        began = time.perf_counter()
        sweep.round("round 1 of 1")
        return comm.sizes[before:], time.perf_counter() - began, sweep.rows()

    sizes, round_s, rows = launch(body, 2, hang_timeout_s=120)[0]
    assert sizes == [1024, 1024, large]
    assert round_s >= PROBE_RTT_S + 3 * CALL_S
    for row in rows:  # each timed once, the warm-up left out
        assert row["repeats"] == 1 and CALL_S <= row["median"] < 2 * CALL_S
