"""Ranks on hosts with different monotonic clocks still time on one timeline (runtime.clock):
offsets found by ping-pong, start instants and collective spans put on rank 0's clock; and
calibration under torchrun, the way an operator runs it on a real cluster."""

import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from runtime import clock  # noqa: E402
from runtime.launch import launch  # noqa: E402
from tests.conftest import ROOT, tiny_model_config  # noqa: E402

SKEW_S = {0: 0.0, 1: 100.0, 2: -50.0}  # each rank's monotonic clock, less rank 0's


def _as_other_hosts(rank: int) -> None:
    """Make this forked rank read a clock SKEW_S[rank] away and a boot id of its own, as a rank on
    another host would."""
    real = time.perf_counter
    time.perf_counter = lambda: real() + SKEW_S[rank]
    clock.boot_id = lambda: f"host{rank}"


def test_ranks_with_skewed_clocks_agree_on_start_instants_and_collective_spans():
    from runtime.comm_timing import synchronised_times
    from runtime.worker import common_start

    def body(rank, heartbeat):
        _as_other_hosts(rank)
        offset = clock.synchronise()
        t0 = common_start(torch.device("cpu"))
        spans = synchronised_times(lambda: torch.distributed.barrier(), calls=3, period_s=0.02, lead_s=0.05)
        return offset, t0 - SKEW_S[rank], spans  # the start instant on an unskewed clock

    results = launch(body, 3, hang_timeout_s=60)
    for rank, (offset, _, _) in enumerate(results):
        assert offset == pytest.approx(SKEW_S[rank], abs=0.005)
    starts = [start for _, start, _ in results]
    assert max(starts) - min(starts) < 0.01
    for _, _, spans in results:
        assert all(0 <= span < 0.05 for span in spans)  # not the clocks' 150 s apart


def test_ranks_of_one_machine_share_the_clock_exactly():
    results = launch(lambda rank, heartbeat: clock.synchronise(), 2, hang_timeout_s=60)
    assert results == [0.0, 0.0]


def test_calibration_under_torchrun_writes_a_profile_the_simulator_prices_from(tmp_path):
    from sim.profile import load_profile
    from sim.scenario import load_scenario
    from sim.simulate import simulate

    (tmp_path / "tiny.config.json").write_text(json.dumps({**tiny_model_config("gpt2", num_layers=2), "n_positions": 256}))
    path = tmp_path / "scenario.yaml"
    path.write_text("""name: torchrun_calibration
model: tiny.config.json
dtype: fp32
cluster:
  switches: [{name: sw}]
  hosts: [{name: "n{i}", count: 2, parent: sw, nic: {bandwidth: 1Gbit/s, latency: 50us},
           devices: {type: cpu, count: 1}}]
workload: {batch_size: 1, prompt_tokens: 8, output_tokens: 4}
variants: [{name: ar, strategy: allreduce_ln, allreduce: library, broadcast: library}]
""")
    profile_path = tmp_path / "profile.csv"
    arguments = ["-m", "runtime.torchrun", "calibrate", str(path), "--out", str(profile_path), "--repeats", "2",
                 "--max-call", "0.05", "--used-only"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *arguments], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if not line.startswith("[W"))[:3000]
    profile = load_profile(profile_path)
    assert {"compute", "op_gap", "collective", "collective_in_place", "p2p", "memory_baseline"} <= set(
        profile.rows["measurement"])
    result = simulate(load_scenario(path), profile=profile)
    assert result.results.loc[result.results.metric == "tpot_s", "value"].gt(0).all()

    # Launched without torchrun (one process), the world is not the scenario's group of 2.
    profile_path.unlink()
    alone = subprocess.run([sys.executable, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and "WORLD_SIZE" in alone.stderr and "Traceback" not in alone.stderr
    assert not profile_path.exists()
