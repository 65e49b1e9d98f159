"""The one torchrun entry point and the runtime's device abstraction."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.device import Device, device_of  # noqa: E402
from runtime.torchrun import main  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

SCENARIO = str(ROOT / "scenarios" / "testbed_gpt2_2x2.yaml")


@pytest.mark.parametrize("command", [["measure", SCENARIO], ["calibrate", SCENARIO, "--out", "profile.csv"]])
def test_a_world_size_other_than_the_group_is_one_line_exit_2(monkeypatch, capsys, tmp_path, command):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(command)
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.strip() == "hetsim: error: WORLD_SIZE: must be the scenario's tensor-parallel group size 4 (got 3)"
    assert list(tmp_path.iterdir()) == []


def test_the_cpu_device_runs_gloo_and_reads_resident_memory():
    device = device_of("cpu")
    assert type(device) is Device and device.backend == "gloo"
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    assert device.memory_bytes() >= held.numel()
    device.reset_peak_memory()
    assert device.peak_memory_bytes() >= device.memory_bytes() - 2**20
    copy = device.to_device(device.staging(16).fill_(7), 8)
    assert copy.tolist() == [7] * 8


def test_an_unsupported_device_type_is_refused():
    with pytest.raises(ValueError, match="meta"):
        device_of("meta")
