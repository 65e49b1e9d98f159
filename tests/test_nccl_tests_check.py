"""The published small-message NCCL latencies and their comparison (validation.nccl_tests_check)."""

from __future__ import annotations

import pytest

from models.errors import ConfigError
from validation.nccl_tests_check import compare, load_rows, nccl_ring_allreduce_s, ring_line


def test_nccls_ring_model_is_its_base_latency_plus_one_hop_latency_per_step():
    from sim.transport import NcclProtocol, Transport

    # NVIDIA/nccl src/graph/tuning.cc: Ring LL 6.6 us + 0.6 us per NVLink step, Simple 8.4 + 5.7 per PCI step.
    assert nccl_ring_allreduce_s(Transport.NCCL_NVLINK, NcclProtocol.LL, 8) == pytest.approx(6.6e-6 + 14 * 0.6e-6)
    assert nccl_ring_allreduce_s(Transport.NCCL_PCIE, NcclProtocol.SIMPLE, 2) == pytest.approx(8.4e-6 + 2 * 5.7e-6)


def test_the_shipped_rows_are_priced_on_the_transport_of_their_gpus_and_the_published_ring_grows_per_step():
    table = compare(load_rows())
    transports = dict(zip(table["id"], table["transport"]))
    assert transports["dgx_a100_ring_8gpu"] == "nccl/nvlink" and transports["rtx4090_pcie_8gpu_8b"] == "nccl/pcie"
    assert (table["hetsim_auto_s"] <= table["hetsim_ring_s"] * (1 + 1e-9)).all()  # auto is the fastest schedule
    from sim.transport import Transport

    per_call_s, per_step_s, rows = ring_line(table, Transport.NCCL_NVLINK)
    assert rows == 7 and 1e-6 < per_step_s < 3e-6 and 0 < per_call_s < 10e-6


@pytest.mark.parametrize("field, value, named", [("gpus", 1, "rows[0].gpus"), ("time_s", -1, "rows[0].time_s"),
                                                 ("algorithm", "tree", "rows[0].algorithm"),
                                                 ("interconnect", {"bandwidth": "fast"}, "rows[0].interconnect")])
def test_a_bad_row_is_refused_naming_its_field(tmp_path, field, value, named):
    import yaml

    row = {"id": "x", "gpus": 2, "time_s": 1e-5, "device": "a100_80gb",
           "interconnect": {"bandwidth": "300GB/s", "latency": "2us"}, "size_bytes": 8, "algorithm": "ring",
           "source": "s", "reading": "r"}
    row[field] = value
    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump({"rows": [row]}))
    with pytest.raises(ConfigError) as error:
        load_rows(path)
    assert error.value.field == named


def test_a_cpu_row_is_refused_in_one_line(tmp_path):
    import yaml

    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump({"rows": [{
        "id": "x", "gpus": 2, "time_s": 1e-5, "device": "cpu", "interconnect": {"bandwidth": "1GB/s", "latency": "2us"},
        "size_bytes": 8, "algorithm": "ring", "source": "s", "reading": "r"}]}))
    with pytest.raises(ConfigError) as error:
        compare(load_rows(path))
    assert error.value.field == "device"
