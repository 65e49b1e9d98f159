"""Mixed device types in one host and one group: each host lists its devices, the slowest rank
sets the pace (the faster waits at each collective, in the trace), memory is judged per device."""

from __future__ import annotations

import pytest

from models.errors import ConfigError
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from sim.topology import build_topology
from tests.conftest import ROOT, scenario_dict

PCIE = {"bandwidth": "32GB/s", "latency": "2us"}


def _scenario(devices, model="qwen2.5-0.5b", **overrides):
    host = {"name": "h0", "interconnect": PCIE, "devices": devices}
    data = scenario_dict(model=model, cluster={"hosts": [host]},
                         workload={"batch_size": 1, "prompt_tokens": 128, "output_tokens": 4},
                         variants=[{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])
    return scenario_from_dict(data | overrides, base_dir=ROOT)


MIXED = [{"type": "rtx_4090"}, {"type": "rtx_3060_12gb", "memory": "11GiB"}]


def test_a_host_lists_devices_of_several_types_in_rank_order():
    topology = build_topology(_scenario(MIXED + [{"type": "rtx_4090", "count": 2}]).config.cluster)
    assert [(d.name, d.spec.name, d.memory_capacity_bytes // 2**30) for d in topology.devices] == [
        ("h0/dev0", "rtx_4090", 24), ("h0/dev1", "rtx_3060_12gb", 11), ("h0/dev2", "rtx_4090", 24),
        ("h0/dev3", "rtx_4090", 24)]


@pytest.mark.parametrize("devices, field", [
    ([], "cluster.hosts[0].devices"),
    ([{"type": "rtx_4090"}, {"type": "tpu_v9"}], "cluster.hosts[0].devices[1].type"),
    ([{"type": "rtx_4090"}, {"count": 2}], "cluster.hosts[0].devices[1].type"),
    ({"type": "tpu_v9"}, "cluster.hosts[0].devices.type"),
    ({"type": "rtx_4090", "memory": "0GiB"}, "cluster.hosts[0].devices.memory"),
])
def test_bad_device_lists_name_the_entry(devices, field):
    with pytest.raises(ConfigError) as error:
        build_topology(_scenario(devices).config.cluster)
    assert error.value.field == field


def test_a_slower_device_slows_the_group_and_the_faster_one_waits_at_the_collective():
    mixed = simulate(_scenario(MIXED)).variants[0]
    fast = simulate(_scenario({"type": "rtx_4090", "count": 2})).variants[0]
    for metric in ("ttft_s", "tpot_s"):
        assert mixed.timing[metric] > 1.2 * fast.timing[metric]
    ops = mixed.trace.ops
    first = ops[(ops["step"] == 0) & (ops["layer"] == 0)]
    mlp = first[first["name"] == "mlp_down"].set_index("rank")
    assert mlp.loc[1, "end_s"] - mlp.loc[1, "start_s"] > 3 * (mlp.loc[0, "end_s"] - mlp.loc[0, "start_s"])
    allreduce = first[(first["stream"] == "comm") & (first["start_s"] >= mlp["end_s"].min())].groupby("rank").first()
    # The RTX 4090 enters the collective first and waits there for the RTX 3060 to arrive.
    assert allreduce.loc[0, "start_s"] < allreduce.loc[1, "start_s"]
    assert allreduce.loc[0, "end_s"] == pytest.approx(allreduce.loc[1, "end_s"])
    assert (allreduce.loc[0, "end_s"] - allreduce.loc[0, "start_s"]) > 3 * (
        allreduce.loc[1, "end_s"] - allreduce.loc[1, "start_s"])


def test_memory_is_judged_per_device_and_shares_can_follow_it():
    even = simulate(_scenario(MIXED, model="llama-2-13b")).results
    by_memory = simulate(_scenario(MIXED, model="llama-2-13b", parallel={"shares": "memory"})).results

    def peaks(results):
        rows = results[results["metric"].isin(["peak_memory_bytes", "memory_capacity_bytes"])]
        return rows.pivot_table(index="device", columns="metric", values="value")

    even, by_memory = peaks(even), peaks(by_memory)
    # Half of Llama-2-13B in fp16 fits the 24 GiB RTX 4090 but not the 11 GiB RTX 3060 ...
    assert even.loc["h0/dev0", "peak_memory_bytes"] < even.loc["h0/dev0", "memory_capacity_bytes"]
    assert even.loc["h0/dev1", "peak_memory_bytes"] > even.loc["h0/dev1", "memory_capacity_bytes"]
    # ... while a split in proportion to memory fits both.
    assert (by_memory["peak_memory_bytes"] < by_memory["memory_capacity_bytes"]).all()
