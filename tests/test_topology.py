"""The cluster description, the device catalog and routing (sim/cluster_config, sim/devices, sim/topology)."""

import pytest
import yaml
from pydantic import ValidationError

from models.errors import ConfigError
from sim.cluster_config import DEVICE_UNION_TAGS, ClusterConfig
from sim.devices import DEVICES, get_device
from sim.topology import Channel, build_topology

def _docstring_example() -> str:
    """The cluster example of sim.cluster_config's docstring: the suite checks what the docs show."""
    import textwrap

    import sim.cluster_config

    block = sim.cluster_config.__doc__.split("::\n", 1)[1].split("\n\n", 1)[0]
    return textwrap.dedent(block)


GATEWAYS = _docstring_example()

PCIE_HOSTS = """
switches: [{name: tor}]
hosts:
  - name: "host{i}"
    count: 2
    parent: tor
    nic: {bandwidth: 10Gbit/s, latency: 10us}
    interconnect: {bandwidth: 32GB/s, latency: 2us}
    devices: {type: rtx_3060_12gb, count: 4}
"""

LINK = {"bandwidth": "1Gbit/s", "latency": "1us"}


def build(text: str):
    return build_topology(ClusterConfig.model_validate(yaml.safe_load(text)))


def names(channels) -> list[str]:
    return [channel.name for channel in channels]


def two_hosts(**host_fields) -> dict:
    host = {
        "name": "host{i}",
        "count": 2,
        "parent": "tor",
        "nic": {"bandwidth": "10Gbit/s", "latency": "10us"},
        "interconnect": {"bandwidth": "32GB/s", "latency": "2us"},
        "devices": {"type": "rtx_3060_12gb", "count": 2},
    }
    host.update(host_fields)
    return {"switches": [{"name": "tor"}], "hosts": [host]}


# --- device catalog -------------------------------------------------------------------------


def test_catalog_has_every_required_device_with_a_source():
    required = {"h100_sxm", "a100_80gb", "rtx_4090", "rtx_3060_12gb", "t4", "jetson_agx_orin", "cpu"}
    assert required <= DEVICES.keys()
    for name, spec in DEVICES.items():
        assert spec.name == name
        assert spec.source and spec.description
        assert spec.peak_flops_per_s["fp32"] > 0
        assert spec.memory_bandwidth_bytes_per_s > 0
        assert spec.memory_capacity_bytes > 0


def test_catalog_datasheet_figures():
    h100 = get_device("h100_sxm")
    assert h100.peak_flops("bf16") == pytest.approx(989.4e12)
    assert h100.peak_flops("fp32") == pytest.approx(67e12)
    assert h100.memory_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    assert h100.memory_capacity_bytes == 80 * 2**30
    assert get_device("a100_80gb").peak_flops("fp16") == pytest.approx(312e12)
    assert get_device("rtx_4090").peak_flops("fp16") == pytest.approx(165.2e12)
    assert get_device("t4").peak_flops("fp16") == pytest.approx(65e12)


def test_unsupported_dtype_is_a_config_error():
    expected = r"^model\.dtype: device 't4' does not support this dtype; it supports: fp32, fp16 \(got 'bf16'\)$"
    with pytest.raises(ConfigError, match=expected):
        get_device("t4").peak_flops("bf16", field="model.dtype")


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"^type: unknown device; known: h100_sxm, .* \(got 'h200'\)$"):
        get_device("h200")


def test_device_spec_is_immutable():
    with pytest.raises(TypeError):
        get_device("cpu").peak_flops_per_s["fp32"] = 1.0


# --- routing --------------------------------------------------------------------------------


def test_gateway_cluster_ranks_and_memory_override():
    topology = build(GATEWAYS)
    assert topology.num_ranks == 8
    assert topology.hosts == tuple(f"home{i}" for i in range(8))
    assert [device.name for device in topology.devices] == [f"home{i}/dev0" for i in range(8)]
    assert [device.rank for device in topology.devices] == list(range(8))
    assert topology.devices[3].memory_capacity_bytes == 8 * 2**30
    assert topology.devices[3].spec is DEVICES["cpu"]


def test_gateway_path_meets_at_the_router():
    topology = build(GATEWAYS)
    assert names(topology.path(0, 1)) == ["home0.nic:up", "gw0.uplink:up", "gw1.uplink:down", "home1.nic:down"]
    assert topology.path_latency_s(0, 1) == pytest.approx(2 * 50e-6 + 2 * 1e-3)
    assert topology.path_bandwidth_bytes_per_s(0, 1) == pytest.approx(300e6 / 8)


def test_path_is_cached_and_directed():
    topology = build(GATEWAYS)
    assert topology.path(2, 5) is topology.path(2, 5)
    assert names(topology.path(5, 2)) == ["home5.nic:up", "gw5.uplink:up", "gw2.uplink:down", "home2.nic:down"]


def test_full_duplex_directions_are_distinct_channels_of_equal_capacity():
    topology = build(GATEWAYS)
    by_name = {channel.name: channel for channel in topology.channels}
    assert len(by_name) == len(topology.channels)
    assert by_name["gw0.uplink:up"] is not by_name["gw0.uplink:down"]
    assert by_name["gw0.uplink:up"] == Channel("gw0.uplink:up", 37.5e6, 1e-3)
    assert by_name["gw0.uplink:down"] == Channel("gw0.uplink:down", 37.5e6, 1e-3)


def test_intra_host_path_crosses_two_interconnect_channels():
    topology = build(PCIE_HOSTS)
    assert names(topology.path(0, 1)) == ["host0/dev0.link:up", "host0/dev1.link:down"]
    assert topology.path_bandwidth_bytes_per_s(0, 1) == pytest.approx(32e9)
    assert topology.path_latency_s(0, 1) == pytest.approx(4e-6)


def test_inter_host_path_with_shared_nic():
    topology = build(PCIE_HOSTS)
    expected = ["host0/dev1.link:up", "host0.nic:up", "host1.nic:down", "host1/dev2.link:down"]
    assert names(topology.path(1, 6)) == expected
    assert topology.path_bandwidth_bytes_per_s(1, 6) == pytest.approx(1.25e9)
    # Every device of host0 leaves through the same NIC channel.
    nic = {topology.path(rank, 4)[1] for rank in topology.ranks_of_host("host0")}
    assert names(nic) == ["host0.nic:up"]


def test_inter_host_path_with_nic_per_device_skips_the_interconnect():
    topology = build_topology(ClusterConfig.model_validate(two_hosts(nic_per_device=True)))
    assert names(topology.path(1, 2)) == ["host0/dev1.nic:up", "host1/dev0.nic:down"]
    assert names(topology.path(0, 1)) == ["host0/dev0.link:up", "host0/dev1.link:down"]


def test_shared_interconnect_is_one_bus_channel_both_ways():
    shared = {"bandwidth": "1Gbit/s", "latency": "20us", "shared": True}
    topology = build_topology(ClusterConfig.model_validate(two_hosts(interconnect=shared)))
    assert names(topology.path(0, 1)) == ["host0.bus"]
    assert topology.path(0, 1) == topology.path(1, 0)
    assert names(topology.path(0, 3)) == ["host0.bus", "host0.nic:up", "host1.nic:down", "host1.bus"]


def test_shared_nic_is_one_channel_both_ways():
    shared_nic = {"bandwidth": "100Mbit/s", "latency": "1ms", "shared": True}
    topology = build_topology(ClusterConfig.model_validate(two_hosts(nic=shared_nic)))
    assert names(topology.path(0, 2)) == ["host0/dev0.link:up", "host0.nic", "host1.nic", "host1/dev0.link:down"]


def test_lowest_common_ancestor_below_the_root():
    uplink = {"bandwidth": "100Gbit/s", "latency": "1us"}
    nic = {"bandwidth": "25Gbit/s", "latency": "5us"}
    config = {
        "switches": [
            {"name": "spine"},
            {"name": "agg{i}", "count": 2, "parent": "spine", "uplink": uplink},
            {"name": "a{i}", "count": 2, "parent": "agg0", "uplink": uplink},
            {"name": "b{i}", "count": 2, "parent": "agg1", "uplink": uplink},
        ],
        "hosts": [
            {"name": "ha{i}", "count": 2, "parent": "a{i}", "nic": nic, "devices": {"type": "t4"}},
            {"name": "hb{i}", "count": 2, "parent": "b{i}", "nic": nic, "devices": {"type": "t4"}},
        ],
    }
    topology = build_topology(ClusterConfig.model_validate(config))
    assert names(topology.path(0, 1)) == ["ha0.nic:up", "a0.uplink:up", "a1.uplink:down", "ha1.nic:down"]
    assert names(topology.path(0, 3)) == [
        "ha0.nic:up",
        "a0.uplink:up",
        "agg0.uplink:up",
        "agg1.uplink:down",
        "b1.uplink:down",
        "hb1.nic:down",
    ]


def test_hosts_under_the_same_switch_cross_no_uplink():
    topology = build(PCIE_HOSTS)
    assert not any("uplink" in name for name in names(topology.path(0, 7)))


def test_single_host_needs_no_switch_or_nic():
    nvlink = {"bandwidth": "900GB/s", "latency": "1us"}
    config = {"hosts": [{"name": "box", "interconnect": nvlink, "devices": {"type": "h100_sxm", "count": 8}}]}
    topology = build_topology(ClusterConfig.model_validate(config))
    assert topology.num_ranks == 8
    assert topology.ranks_of_host("box") == tuple(range(8))
    assert names(topology.path(7, 0)) == ["box/dev7.link:up", "box/dev0.link:down"]


def test_bad_ranks_are_rejected():
    topology = build(PCIE_HOSTS)
    with pytest.raises(ValueError, match="to itself"):
        topology.path(3, 3)
    with pytest.raises(ValueError, match="out of range"):
        topology.path(0, 8)
    with pytest.raises(ValueError, match="out of range"):
        topology.host_groups([-1])
    with pytest.raises(ValueError, match="unknown host 'host9'"):
        topology.ranks_of_host("host9")


def test_host_groups_keep_host_order_and_given_rank_order():
    topology = build(PCIE_HOSTS)
    assert topology.ranks_of_host("host1") == (4, 5, 6, 7)
    assert topology.host_groups([7, 0, 5, 1]) == ((0, 1), (7, 5))
    assert topology.host_groups([6]) == ((6,),)
    assert topology.host_groups([]) == ()


def test_graph_holds_devices_host_buses_and_switches():
    topology = build(PCIE_HOSTS)
    graph = topology.graph
    assert graph.nodes["tor"]["kind"] == "switch"
    assert graph.nodes["host0"]["kind"] == "host"
    assert graph.nodes["host1/dev2"] == {"kind": "device", "rank": 6}
    edge = graph.edges["host1", "tor"]
    assert edge["kind"] == "nic"
    assert edge["bandwidth_bytes_per_s"] == pytest.approx(1.25e9)
    assert edge["channels"] == ("host1.nic:up", "host1.nic:down")
    assert graph.edges["host0/dev3", "host0"]["kind"] == "interconnect"
    # Without an interconnect the single device hangs from the switch itself.
    gateway_graph = build(GATEWAYS).graph
    assert gateway_graph.edges["home4/dev0", "gw4"]["latency_s"] == pytest.approx(50e-6)
    assert gateway_graph.edges["gw4", "router"]["kind"] == "uplink"


def test_build_is_deterministic():
    first, second = build(GATEWAYS), build(GATEWAYS)
    assert first.channels == second.channels
    assert list(first.graph.nodes) == list(second.graph.nodes)


# --- semantic errors (ConfigError with the field path) --------------------------------------


def config_error(config: dict) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        build_topology(ClusterConfig.model_validate(config))
    return caught.value


def test_duplicate_names():
    config = two_hosts()
    config["hosts"].append({**config["hosts"][0], "name": "host1", "count": 1})
    error = config_error(config)
    assert error.field == "cluster.hosts[1].name"
    assert "duplicate name, already declared at cluster.hosts[0] (got 'host1')" in str(error)


def test_switch_and_host_names_share_one_namespace():
    config = two_hosts()
    config["switches"].append({"name": "host0", "parent": "tor", "uplink": LINK})
    assert config_error(config).field == "cluster.hosts[0].name"


def test_count_without_index_in_name():
    error = config_error(two_hosts(name="host"))
    assert error.field == "cluster.hosts[0].name"
    assert "no '{i}'" in str(error)


def test_unknown_parent():
    error = config_error(two_hosts(parent="spine"))
    assert error.field == "cluster.hosts[0].parent"
    assert str(error) == "cluster.hosts[0].parent: unknown switch; known: tor (got 'spine')"


def test_unknown_switch_parent():
    config = two_hosts()
    config["switches"].append({"name": "leaf", "parent": "nowhere", "uplink": LINK})
    assert config_error(config).field == "cluster.switches[1].parent"


def test_two_roots():
    config = two_hosts()
    config["switches"].append({"name": "other"})
    error = config_error(config)
    assert error.field == "cluster.switches[1].parent"
    assert "second root" in str(error)


def test_cycle_of_switches():
    config = two_hosts()
    config["switches"] += [{"name": "x", "parent": "y", "uplink": LINK}, {"name": "y", "parent": "x", "uplink": LINK}]
    error = config_error(config)
    assert error.field in {"cluster.switches[1].parent", "cluster.switches[2].parent"}
    assert "cycle" in str(error)


def test_unknown_device_type_names_the_field():
    error = config_error(two_hosts(devices={"type": "h200", "count": 2}))
    assert error.field == "cluster.hosts[0].devices.type"
    assert "unknown device; known: " in str(error)
    assert str(error).endswith("(got 'h200')")


def test_multi_host_cluster_needs_parents():
    config = two_hosts()
    del config["hosts"][0]["parent"]
    del config["hosts"][0]["nic"]
    error = config_error(config)
    assert error.field == "cluster.hosts[0].parent"


def test_error_field_prefix_is_configurable():
    with pytest.raises(ConfigError, match=r"^scenario\.cluster\.hosts\[0\]\.parent"):
        build_topology(ClusterConfig.model_validate(two_hosts(parent="spine")), field="scenario.cluster")


# --- schema errors (pydantic, with the location) --------------------------------------------


def validation_error(config: dict) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as caught:
        ClusterConfig.model_validate(config)
    (first, *_) = caught.value.errors()
    # The tag of a host's devices spelling (one type or a list) is no location a user wrote.
    return tuple(x for x in first["loc"] if x not in DEVICE_UNION_TAGS), first["msg"]


def test_bad_bandwidth_names_its_location():
    loc, msg = validation_error(two_hosts(nic={"bandwidth": "10 gbps", "latency": "10us"}))
    assert loc == ("hosts", 0, "nic", "bandwidth")
    assert "not a bandwidth; write e.g. 10Gbit/s or 1.25GB/s (got '10 gbps')" in msg


def test_zero_bandwidth_must_be_positive():
    loc, msg = validation_error(two_hosts(interconnect={"bandwidth": "0GB/s", "latency": "1us"}))
    assert loc == ("hosts", 0, "interconnect", "bandwidth")
    assert "must be positive" in msg


def test_negative_latency():
    loc, msg = validation_error(two_hosts(nic={"bandwidth": "1Gbit/s", "latency": "-1ms"}))
    assert loc == ("hosts", 0, "nic", "latency")
    assert "must not be negative" in msg


def test_bad_memory_size():
    loc, msg = validation_error(two_hosts(devices={"type": "t4", "count": 2, "memory": "8 GB/s"}))
    assert loc == ("hosts", 0, "devices", "memory")
    assert "not a size" in msg


def test_unknown_keys_are_forbidden():
    loc, _ = validation_error(two_hosts(nics=2))
    assert loc == ("hosts", 0, "nics")


def test_uplink_required_with_parent():
    config = two_hosts()
    config["switches"].append({"name": "leaf", "parent": "tor"})
    loc, msg = validation_error(config)
    assert loc == ("switches", 1)
    assert "uplink is required" in msg


def test_root_switch_has_no_uplink():
    config = two_hosts()
    config["switches"][0]["uplink"] = LINK
    loc, msg = validation_error(config)
    assert loc == ("switches", 0)
    assert "no parent" in msg


def test_nic_required_with_parent():
    config = two_hosts()
    del config["hosts"][0]["nic"]
    loc, msg = validation_error(config)
    assert loc == ("hosts", 0)
    assert "nic is required" in msg


def test_interconnect_required_for_several_devices():
    config = two_hosts()
    del config["hosts"][0]["interconnect"]
    loc, msg = validation_error(config)
    assert loc == ("hosts", 0)
    assert "interconnect is required for a host with 2 devices" in msg


@pytest.mark.parametrize("name", ["host/0", "host:0", ""])
def test_names_that_would_make_channel_names_ambiguous(name):
    loc, _ = validation_error(two_hosts(name=name, count=1))
    assert loc == ("hosts", 0, "name")


def test_at_least_one_device_and_one_host():
    loc, _ = validation_error(two_hosts(devices={"type": "t4", "count": 0}))
    assert loc == ("hosts", 0, "devices", "count")
    loc, _ = validation_error({"hosts": []})
    assert loc == ("hosts",)
