"""SIGTERM, SIGINT and SIGHUP to every hetsim command that starts workers: each child ends, the
testbed the command built comes down, nothing is written, and one line says what was interrupted
(exit code 128 + the signal). Also the pieces: deferred signals during cleanup, a rank dying with
its parent, numeric options bounded and finite, and the memory check before any rank starts.

Each command runs as a subprocess on a tiny model; the test waits until its ranks exist, records
its whole process tree from /proc, sends the signal and checks that no process of the tree is left.
Tests that build a testbed need root and iproute2; their scenario names carry this process's pid
so that concurrent runs never share a testbed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from runtime import interrupt
from runtime.testbed import forwarder
from runtime.testbed.links import scenario_prefix
from runtime.testbed.netns import list_namespaces
from tests.conftest import ROOT, tiny_model_config

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                reason="building a testbed needs root and iproute2 (ip, tc)")
START_TIMEOUT_S = 120.0  # importing torch takes 10-15 s on the shared 2-core machine, more when loaded
EXIT_TIMEOUT_S = 20.0


def _scenario_file(tmp_path: Path, name: str, *, latency: str = "50us", memory: str = "4GiB",
                   model: str | None = None) -> Path:
    """2 hosts x 1 CPU rank of ``model`` (default: a 2-layer GPT-2 of hidden size 64), a few
    tokens per generation."""
    if model is None:
        config = tiny_model_config("gpt2", num_layers=2) | {"n_positions": 1024}  # calibration's longest prompt
        (tmp_path / "tiny.config.json").write_text(json.dumps(config))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "model": model or "tiny.config.json", "dtype": "fp32",
        "cluster": {"switches": [{"name": "sw"}], "hosts": [{
            "name": "n{i}", "count": 2, "parent": "sw", "nic": {"bandwidth": "1Gbit/s", "latency": latency},
            "devices": {"type": "cpu", "count": 1, "memory": memory}}]},
        "workload": {"batch_size": 1, "prompt_tokens": 8, "output_tokens": 4},
        "variants": [{"name": "rlb", "strategy": "reduce_ln_bcast", "reduce": "library", "broadcast": "library"},
                     {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}]}))
    return path


def _hetsim(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", "from validation.cli import main; main()", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    """``pid``'s descendants, from /proc."""
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for its parent to reap it, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ranks(pid: int) -> list[int]:
    """The forked ranks among ``pid``'s children (the delay forwarder is a child too)."""
    return [child for child in _children(pid) if b"runtime.testbed.forwarder" not in _cmdline(child)]


def _wait_for_ranks(proc: subprocess.Popen, count: int) -> None:
    """Wait until ``proc`` has forked ``count`` ranks, then a moment for them to get to work."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early: {proc.communicate()}"
        if len(_ranks(proc.pid)) >= count:
            time.sleep(1.0)
            return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no {count} ranks within {START_TIMEOUT_S} s: {proc.communicate()}")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _interrupt(proc: subprocess.Popen, signum: int) -> tuple[str, list[int]]:
    """Send ``signum``; check the exit code, the one-line message and that no process of the
    tree recorded just before is left; returns the message and the tree."""
    tree = _tree(proc.pid)
    assert _ranks(proc.pid), "no rank running when the signal was sent"
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *tree]:
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"still running {EXIT_TIMEOUT_S} s after {signal.Signals(signum).name}")
    assert proc.returncode == 128 + signum, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in lines[0]
    deadline = time.monotonic() + 5.0  # an orphan killed by its death signal is reaped by init
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if _alive(pid)], f"left running: {[_cmdline(p) for p in tree if _alive(p)]}"
    return lines[0], tree


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_measure_stops_every_rank_and_writes_nothing(tmp_path, signum):
    out = tmp_path / "out"
    proc = _hetsim("measure", str(_scenario_file(tmp_path, "sig_measure")), "--out", str(out),
                   "--repeats", "10000")
    _wait_for_ranks(proc, 2)
    line, _ = _interrupt(proc, signum)
    assert line == f"hetsim: measure interrupted by {signum.name}; its ranks are stopped, nothing written"
    assert not out.exists()


def test_sigterm_to_calibrate_stops_every_rank_and_writes_no_profile(tmp_path):
    profile = tmp_path / "profile.csv"
    proc = _hetsim("calibrate", str(_scenario_file(tmp_path, "sig_calibrate")), "--out", str(profile),
                   "--repeats", "10000")
    _wait_for_ranks(proc, 2)
    line, _ = _interrupt(proc, signal.SIGTERM)
    assert line.startswith("hetsim: calibrate interrupted by SIGTERM;")
    assert list(tmp_path.glob("*.csv")) == [] and list(tmp_path.glob(".profile*")) == []


@needs_root
def test_sigterm_to_measure_on_the_testbed_stops_every_rank(tmp_path):
    from runtime.testbed import Testbed
    from sim.scenario import load_scenario
    from sim.topology import build_topology

    path = _scenario_file(tmp_path, f"sig_measure_bed_{os.getpid()}", latency="1ms")
    scenario = load_scenario(path)
    bed = Testbed(scenario.name, build_topology(scenario.config.cluster))
    bed.up()
    try:
        out = tmp_path / "out"
        proc = _hetsim("measure", str(path), "--testbed", "--out", str(out), "--repeats", "10000")
        _wait_for_ranks(proc, 2)
        _interrupt(proc, signal.SIGTERM)
        assert not out.exists()
        assert bed.status()["up"]  # the user's testbed: measure did not build it, so it stays
    finally:
        bed.down()


@needs_root
def test_sigterm_to_validate_stops_ranks_and_forwarder_and_removes_the_testbed(tmp_path):
    name = f"sig_validate_{os.getpid()}"
    _scenario_file(tmp_path, name, latency="1ms")  # over 0.2 ms: a delay forwarder runs
    (tmp_path / "matrix.yaml").write_text(yaml.safe_dump({
        "name": "sig", "testbed": True, "repeats": 10000, "calibration_repeats": 2, "prompt_tokens": [8],
        "scenarios": [f"{name}.yaml"], "calibrate_collectives": "used"}))
    out = tmp_path / "report"
    proc = _hetsim("validate", str(tmp_path / "matrix.yaml"), "--out", str(out))
    _wait_for_ranks(proc, 2)
    prefix = scenario_prefix(name)
    forwarders = forwarder.find(prefix)
    assert any(ns.startswith(prefix) for ns in list_namespaces()) and forwarders
    line, tree = _interrupt(proc, signal.SIGTERM)  # which checks that no process of the tree is left
    assert line.startswith("hetsim: validate interrupted by SIGTERM;")
    assert set(forwarders) <= set(tree) and forwarder.find(prefix) == []
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix)]
    assert not Path(f"/run/hetsim/{name}.json").exists()
    assert not out.exists() or not any(out.rglob("*"))


def _small_testbed(label: str, hosts: int, pid: int | None = None):
    """A testbed of ``hosts`` CPU hosts 1 ms apart (so a delay forwarder runs), not built yet;
    named for ``label`` and the test process ``pid`` (default: this one)."""
    from runtime.testbed import Testbed
    from sim.cluster_config import ClusterConfig
    from sim.topology import build_topology

    return Testbed(f"sig_{label}_{pid or os.getpid()}", build_topology(ClusterConfig.model_validate({
        "switches": [{"name": "sw"}], "hosts": [{"name": "n{i}", "count": hosts, "parent": "sw",
                                                 "nic": {"bandwidth": "1Gbit/s", "latency": "1ms"},
                                                 "devices": {"type": "cpu", "count": 1}}]})))


def _interrupted_from_inside(monkeypatch, action) -> list:
    """Run ``action`` under :func:`interrupt.catching`, expecting the SIGTERM that a patched step
    sends; returns what of the testbed ``bed`` is left (namespaces, forwarders), then removes it."""
    bed = action.__self__
    try:
        with pytest.raises(interrupt.Interrupted, match="SIGTERM"), interrupt.catching():
            action()
    finally:
        monkeypatch.undo()
        leftovers = [ns for ns in list_namespaces() if ns.startswith(bed.prefix)] + forwarder.find(bed.prefix)
        leftovers += [bed.state_path] if bed.state_path.exists() else []
        bed.down()
    return leftovers


@needs_root
@pytest.mark.parametrize("stage", ["netns", "forwarder"])
def test_sigterm_during_testbed_up_removes_what_was_built(monkeypatch, stage):
    """``hetsim testbed up`` interrupted midway (the signal sent from inside, at a chosen step):
    ``up`` tears down what it built, then the interruption goes on."""
    from runtime.testbed import cluster

    bed = _small_testbed(f"up_{stage}", hosts=2)
    if stage == "netns":
        real_ip = cluster.ip

        def ip(*args, **kwargs):
            result = real_ip(*args, **kwargs)
            if args[:2] == ("netns", "add"):
                os.kill(os.getpid(), signal.SIGTERM)
            return result

        monkeypatch.setattr(cluster, "ip", ip)
    else:
        real_start = forwarder.start

        def start(*args, **kwargs):
            process = real_start(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # before up() holds the process: found by its command line
            return process

        monkeypatch.setattr(forwarder, "start", start)
    assert _interrupted_from_inside(monkeypatch, bed.up) == []


@needs_root
def test_sigterm_during_testbed_down_finishes_the_teardown_first(monkeypatch):
    from runtime.testbed import cluster

    bed = _small_testbed("down", hosts=3)
    bed.up()
    real_ip = cluster.ip

    def ip(*args, **kwargs):
        if args[:2] == ("netns", "del"):
            os.kill(os.getpid(), signal.SIGTERM)  # at the first of three namespaces
        return real_ip(*args, **kwargs)

    monkeypatch.setattr(cluster, "ip", ip)
    assert _interrupted_from_inside(monkeypatch, bed.down) == []


@needs_root
@pytest.mark.parametrize("owned", [True, False], ids=["owned", "shared"])
def test_an_owned_testbeds_forwarder_dies_with_its_owner(owned):
    """``hetsim validate`` owns the testbed it builds: killed outright, its forwarder goes with it.
    ``hetsim testbed up`` does not: the forwarder outlives it, for the commands that follow."""
    bed = _small_testbed(f"owner_{owned}", hosts=2)
    code = ("import sys, time\n"
            "from tests.test_signals import _small_testbed\n"
            f"bed = _small_testbed('owner_{owned}', hosts=2, pid={os.getpid()})\n"
            f"bed.up(owned={owned})\n"
            "print('up', flush=True)\n"
            "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        assert forwarder.find(bed.prefix)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 5.0
        while forwarder.find(bed.prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bool(forwarder.find(bed.prefix)) is not owned
    finally:
        owner.kill()
        owner.wait()
        bed.down()


def test_a_signal_in_a_deferred_block_is_raised_when_it_ends():
    done, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(interrupt.Interrupted) as raised, interrupt.catching():
        with interrupt.deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)  # ignored: one interruption at a time
            done.append("cleanup")
    assert done == ["cleanup"] and raised.value.signum == signal.SIGHUP and raised.value.exit_code == 129
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


_FORK_SIGNALLED = """
import os, signal, sys
from runtime import interrupt
# a signal that arrives while CPython runs an at-fork callback in the parent (logging's releases
# its lock there): the handler's exception is printed as "Exception ignored" and lost
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM))
try:
    with interrupt.catching():
        pid = interrupt.fork_worker() if sys.argv[1] == "worker" else os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("went on")
except interrupt.Interrupted as stopped:
    print("stopped")
    sys.exit(stopped.exit_code)
"""


@pytest.mark.parametrize("fork, code, said", [("worker", 128 + signal.SIGTERM, "stopped"), ("plain", 0, "went on")])
def test_a_signal_during_a_workers_fork_is_raised_not_lost(fork, code, said):
    run = subprocess.run([sys.executable, "-c", _FORK_SIGNALLED, fork], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (run.returncode, run.stdout.strip()) == (code, said), run.stderr
    if fork == "plain":  # why forks go through fork_worker: a plain fork loses the interruption
        assert "Exception ignored" in run.stderr


def test_a_rank_dies_with_its_parent_even_when_the_parent_is_killed(tmp_path):
    """The launcher SIGKILLed (no handler runs): its ranks die with it (PR_SET_PDEATHSIG)."""
    code = ("import os, time\n"
            "from runtime.launch import launch\n"
            "def body(rank, beat):\n"
            "    time.sleep(600)\n"
            "launch(body, 2, hang_timeout_s=600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        _wait_for_ranks(proc, 2)
        tree = _tree(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5.0
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if _alive(pid)]


@pytest.mark.parametrize("args, option", [
    (["measure", "{s}", "--hang-timeout", "nan"], "--hang-timeout"),
    (["measure", "{s}", "--hang-timeout", "inf"], "--hang-timeout"),
    (["measure", "{s}", "--hang-timeout", "0"], "--hang-timeout"),
    (["measure", "{s}", "--repeats", "0"], "--repeats"),
    (["measure", "{s}", "--repeats", "-3"], "--repeats"),
    (["measure", "{s}", "--repeats", "100000000"], "--repeats"),
    (["measure", "{s}", "--warmup", "-1"], "--warmup"),
    (["measure", "{s}", "--seed", "-1"], "--seed"),
    (["calibrate", "{s}", "--out", "p.csv", "--repeats", "inf"], "--repeats"),
    (["calibrate", "{s}", "--out", "p.csv", "--max-call", "nan"], "--max-call"),
    (["calibrate", "{s}", "--out", "p.csv", "--max-call", "-inf"], "--max-call"),
    (["calibrate", "{s}", "--out", "p.csv", "--max-call", "1e309"], "--max-call"),
])
def test_numeric_options_are_finite_and_in_range(tmp_path, capsys, args, option):
    from validation.cli import main

    path = _scenario_file(tmp_path, "options")
    with pytest.raises(SystemExit) as exited:
        main([a.format(s=path) for a in args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and option in err, err


def test_interleaving_is_refused_for_an_inference_scenario_in_one_line(tmp_path, capsys):
    from validation.cli import main

    path = _scenario_file(tmp_path, "interleave")  # an inference scenario
    with pytest.raises(SystemExit) as exited:
        main(["measure", str(path), "--interleave", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code != 0 and len(err.strip().splitlines()) == 1 and "--interleave" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value", [("min_timed_s", float("nan")), ("min_timed_s", float("inf")),
                                          ("repeats", 10**9), ("calibration_repeats", 0), ("warmup", -1)])
def test_matrix_numbers_are_finite_and_in_range(tmp_path, capsys, field, value):
    from validation.cli import main

    _scenario_file(tmp_path, "matrix_case")
    (tmp_path / "matrix.yaml").write_text(yaml.safe_dump({
        "name": "m", "testbed": False, "prompt_tokens": [8], "scenarios": ["matrix_case.yaml"], field: value}))
    with pytest.raises(SystemExit) as exited:
        main(["validate", str(tmp_path / "matrix.yaml"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and field in err, err
    assert not (tmp_path / "out").exists()


def _refuses_before_any_rank(monkeypatch, capsys, args) -> str:
    import validation.cli

    def no_torch(command):
        raise AssertionError("torch imported: the check must come before any rank starts")

    monkeypatch.setattr(validation.cli, "_require_torch", no_torch)
    with pytest.raises(SystemExit) as exited:
        validation.cli.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_measure_refuses_a_plan_larger_than_its_devices(tmp_path, monkeypatch, capsys):
    """GPT-2 (124M, fp32) on two 100 MB devices: refused, naming the device and both numbers."""
    path = _scenario_file(tmp_path, "gpt2_small_devices", model="gpt2", memory="100MB")
    err = _refuses_before_any_rank(monkeypatch, capsys, ["measure", str(path), "--out", str(tmp_path / "out")])
    assert "device n0/dev0: the plan needs" in err and "the device holds 100 MB" in err
    err = _refuses_before_any_rank(monkeypatch, capsys, ["calibrate", str(path), "--out", str(tmp_path / "p.csv")])
    assert "device n0/dev0" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.csv").exists()


def test_measure_refuses_llama2_70b_on_two_small_ranks_even_when_overcommitted(tmp_path, monkeypatch, capsys):
    path = _scenario_file(tmp_path, "llama70b_small_ranks", model="llama-2-70b", memory="4GiB")
    err = _refuses_before_any_rank(monkeypatch, capsys, ["measure", str(path)])
    assert "device n0/dev0: the plan needs" in err and "the device holds 4,295 MB" in err
    # Past the device on purpose, but never past what this machine has (70B parameters in fp32).
    err = _refuses_before_any_rank(monkeypatch, capsys, ["measure", str(path), "--allow-overcommit"])
    assert "machine: the plan's 2 ranks need" in err and "available (MemAvailable)" in err


def test_overcommit_lets_a_plan_past_its_devices_but_not_past_the_machine(tmp_path):
    from validation.memory_fit import check_memory_fits
    from models.errors import ConfigError
    from sim.scenario import load_scenario

    scenario = load_scenario(_scenario_file(tmp_path, "overcommit", memory="100kB"))  # the plan needs 0.3 MB
    with pytest.raises(ConfigError, match="device n0/dev0"):
        check_memory_fits(scenario, available_bytes=2**40)
    check_memory_fits(scenario, allow_overcommit=True, available_bytes=2**40)
    with pytest.raises(ConfigError, match="machine: .* this machine has 0 MB available"):
        check_memory_fits(scenario, allow_overcommit=True, available_bytes=10**5)
