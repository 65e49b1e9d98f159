"""The offline transfer evaluation (validation/transfer.py) on the shipped reports."""

from __future__ import annotations

import pytest

from validation.transfer import (NO_PROFILE, POOLED, overall_table, pooled_profile, ranking_table,
                                 shipped_clusters, transfer_errors, transfer_table)


@pytest.fixture(scope="module")
def clusters():
    return shipped_clusters()


def test_shipped_reports_hold_six_clusters_with_their_measured_cases(clusters):
    names = [c.name for c in clusters]
    assert names == ["v2x2_bandwidth", "v2x2_latency", "v4x1_bandwidth", "v4x1_latency", "h3x1_delay", "h2x2_mid"]
    assert all(len(c.measured) == 10 * c.measured["prompt_tokens"].nunique() for c in clusters)


def test_a_quiet_re_measurement_replaces_the_cluster_measured_under_load(clusters):
    import pandas as pd

    from validation.transfer import SHIPPED

    remeasured = pd.read_csv(SHIPPED[-1][1] / "errors.csv")
    v4x1 = next(c for c in clusters if c.name == "v4x1_bandwidth")
    quiet = remeasured[(remeasured["scenario"] == "v4x1_bandwidth") & remeasured["metric"].eq("tpot_s")]
    assert sorted(v4x1.measured[v4x1.measured["metric"] == "tpot_s"]["measured"]) == sorted(quiet["measured"])
    assert v4x1.machine["other_load"] < 0.1  # measured while the machine was quiet


def test_every_pair_is_compared_case_by_case(clusters):
    class Stub:  # predicts every case 10% above what the target measured
        def __init__(self, results):
            self.results = results

    import pandas as pd

    def simulate_case(scenario, profile):
        target = next(c for c in clusters if c.name == scenario.name)
        rows = target.measured[target.measured["prompt_tokens"] == scenario.config.workload.prompt_tokens]
        return Stub(pd.DataFrame({"variant": rows["variant"], "metric": rows["metric"], "device": "",
                                  "value": rows["measured"] * 1.1}))

    errors = transfer_errors(clusters[:2], simulate_case=simulate_case)
    assert set(errors["source"]) == {"v2x2_bandwidth", "v2x2_latency", NO_PROFILE, POOLED}
    assert errors["error"].round(9).eq(0.1).all()
    table = transfer_table(errors)
    assert len(table) == 2 * 4 * 2  # targets x sources x metrics
    assert table["cases"].eq(10).all()
    overall = overall_table(errors, ["v2x2_bandwidth"])
    assert set(overall["pairs"]) == {"same", "other", POOLED, NO_PROFILE}
    assert overall["median_abs_error"].round(9).eq(0.1).all()
    ranking = ranking_table(errors)  # a uniform error keeps every order
    assert ranking["compared"].sum() > 0 and ranking["agreeing"].eq(ranking["compared"]).all()


def test_shipped_profiles_say_what_they_were_measured_on_and_replay_only_on_their_own_network(clusters):
    from sim.context import profile_contexts
    from sim.simulate import simulate

    own, other = clusters[3], clusters[4]  # v4x1_latency, h3x1_delay: 5 ms and 3 ms between hosts
    (context,) = profile_contexts(own.profile.rows)
    assert context.name == own.name and context.ranks_per_host == (1, 1, 1, 1)
    assert [round(l.delay_s, 6) for l in context.links] == [0.005]
    assert context.backend == "gloo/tcp" and context.cores == 2
    same = simulate(own.scenario, profile=own.profile)
    assert same.network.same_cluster
    assert any("same-cluster mode" in line for line in same.sources)
    moved = simulate(other.scenario, profile=own.profile)
    assert not moved.network.same_cluster
    assert any("not replayed" in line for line in moved.sources)
    assert any(line.startswith("link inter_host 200 Mbit/s, 3 ms, burst 32 kB: rescaled") for line in moved.sources)
    # the profile predates recorded bursts: its testbed's 32 kB, which the target declares too
    assert any(line.startswith("burst of inter_host link (32 kB): same") for line in moved.sources)


def test_transport_terms_fitted_on_a_sweep_are_the_terms_that_made_it():
    import pandas as pd

    from sim.collectives.registry import build_schedule
    from sim.transport import TransportTerms, fit_terms, price
    from sim.topology import build_topology
    from sim.cluster_config import ClusterConfig

    topology = build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
        {"name": "h{i}", "count": 4, "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": "2.5ms"},
         "devices": {"type": "cpu", "count": 1, "memory": "4GiB"}}]}))
    truth = TransportTerms(1.5e-3, 2.0, 0.8, "")
    rows = []
    for algorithm in ("recursive_doubling", "rabenseifner"):
        for size in (1024, 16384, 262144, 4194304):
            schedule = build_schedule("allreduce", algorithm, (0, 1, 2, 3), size, host_groups=topology.host_groups((0, 1, 2, 3)))
            rows.append({"op": "allreduce", "algorithm": algorithm, "group_size": 4, "num_hosts": 4,
                         "size_bytes": size, "median": price(schedule, topology, truth).duration_s})
    # One delay between hosts: the latency count is the default's, and the rest is fitted.
    fitted = fit_terms(pd.DataFrame(rows), topology, TransportTerms(0.0, 2.0, 1.0, "default"), "synthetic")
    for terms in fitted.values():
        assert terms.latencies_per_message == 2.0
        assert abs(terms.per_message_s - 1.5e-3) < 1e-4
        assert terms.bandwidth_efficiency == pytest.approx(0.8)


def test_over_one_delayed_link_the_fitted_overhead_is_no_more_than_the_ping_pongs_show():
    # Issue 18: left free, the overhead absorbs what a delayed link's messages cost beyond the
    # default latency count and prices every message on a link without delay too slow; bounded
    # by the ping-pongs' overhead (the link's delay taken out), it transfers.
    import pandas as pd

    from sim.collectives.registry import build_schedule
    from sim.context import CalibrationContext, Link, LinkClass
    from sim.transport import TransportTerms, fit_terms, message_overhead_s, price
    from sim.topology import build_topology
    from sim.cluster_config import ClusterConfig

    def hosts(latency: str):
        return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
            {"name": "h{i}", "count": 4, "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": latency},
             "devices": {"type": "cpu", "count": 1, "memory": "4GiB"}}]}))

    delayed, plain = hosts("1.5ms"), hosts("0ms")
    context = CalibrationContext("synthetic", (("cpu", "fp32", 4),), (1, 1, 1, 1),
                                 (Link(LinkClass.INTER_HOST, 12.5e6, 3e-3),), cores=2, backend="gloo/tcp")
    # half round trips of o + delay + wire; the smallest size's median inflated by noise
    pings = pd.DataFrame([{"device_class": "inter_host", "size_bytes": n,
                           "median": 0.3e-3 + 3e-3 + n / 12.5e6 + (5e-3 if n == 1024 else 0.0)}
                          for n in (1024, 4096, 65536)])
    assert message_overhead_s(pings, context) == pytest.approx(0.3e-3 + (4096 - 1024) / 12.5e6)
    truth = TransportTerms(0.3e-3, 2.5, 1.0, "")

    def schedule(topology, size):
        return build_schedule("allreduce", "recursive_doubling", (0, 1, 2, 3), size,
                              host_groups=topology.host_groups((0, 1, 2, 3)))

    rows = pd.DataFrame([{"op": "allreduce", "algorithm": "recursive_doubling", "group_size": 4, "num_hosts": 4,
                          "size_bytes": n, "median": price(schedule(delayed, n), delayed, truth).duration_s}
                         for n in (1024, 16384, 262144, 4194304)])
    default = TransportTerms(0.0, 2.0, 1.0, "default")
    (free,) = fit_terms(rows, delayed, default, "synthetic").values()
    (bounded,) = fit_terms(rows, delayed, default, "synthetic", overhead_s=0.3e-3).values()
    assert free.per_message_s > 1e-3 and bounded.per_message_s == pytest.approx(0.3e-3)
    measured = price(schedule(plain, 1024), plain, truth).duration_s  # the target: no delay
    assert price(schedule(plain, 1024), plain, free).duration_s > 2 * measured
    assert price(schedule(plain, 1024), plain, bounded).duration_s == pytest.approx(measured, rel=0.1)


def test_calibration_records_its_context(tmp_path):
    pytest.importorskip("torch")
    import json

    from runtime.calibrate import calibrate_scenario
    from sim.context import profile_contexts, scenario_context
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology
    from tests.conftest import cluster, make_scenario, tiny_model_config

    path = tmp_path / "gpt2.config.json"
    path.write_text(json.dumps(dict(tiny_model_config("gpt2", num_layers=1), n_positions=256)))
    scenario = make_scenario(model=str(path), dtype="fp32", cluster=cluster(2, 1, device="cpu"),
                             workload={"batch_size": 1, "prompt_tokens": 5, "output_tokens": 2},
                             variants=[{"name": "a", "strategy": "allreduce_ln", "allreduce": "library",
                                        "broadcast": "library"}])
    profile = calibrate_scenario(scenario, repeats=1, max_call_s=0.01, used_only=True)
    (context,) = profile_contexts(profile)
    topology = build_topology(scenario.config.cluster)
    assert context.backend == "gloo/tcp" and context.cores >= 1 and context.torch_version
    ranks = len(ParallelPlan.of(scenario, topology).tensor_ranks)
    # the CPU ranks' machine's memory bandwidth at 1 .. ranks streams (runtime.stream_bandwidth)
    assert [k for k, _ in context.stream_bytes_per_s] == list(range(1, ranks + 1))
    assert all(b > 0 for _, b in context.stream_bytes_per_s)
    assert context.same_network(scenario_context(scenario.name, topology, ParallelPlan.of(scenario, topology).tensor_ranks,
                                                 "fp32"))


def test_uncalibrated_simulation_states_the_transport_defaults_it_used(root):
    from sim.scenario import load_scenario
    from sim.simulate import simulate

    cpu = simulate(load_scenario(root / "scenarios" / "validation" / "v4x1_latency.yaml"))
    collectives = [line for line in cpu.sources if not line.startswith(("core contention", "compute on"))]
    assert collectives and all("over gloo/tcp" in line for line in collectives)
    # 4 ranks on the testbed's 2 cores: the contention terms say they are gloo/tcp's defaults
    assert [line for line in cpu.sources if "gloo/tcp default" in line and line.startswith("core contention per")]
    gpu = simulate(load_scenario(root / "scenarios" / "h100_2x8_llama31_70b.yaml"))
    assert any("over nccl/net" in line and "tuning.cc" in line for line in gpu.sources)


def _one_variant(root, cores):
    """v2x2_bandwidth (4 CPU ranks) with one variant, its cluster declaring ``cores`` (None: none)."""
    import yaml

    from sim.scenario import scenario_from_dict

    path = root / "scenarios" / "validation" / "v2x2_bandwidth.yaml"
    data = yaml.safe_load(path.read_text())
    cluster = {key: value for key, value in data["cluster"].items() if key != "cores"}
    variant = next(v for v in data["variants"] if v["name"] == "allreduce_recursive_doubling")
    return scenario_from_dict({**data, "cluster": {**cluster, **({} if cores is None else {"cores": cores})},
                               "variants": [variant], "baseline": variant["name"]}, base_dir=path.parent)


def test_uncalibrated_ranks_beyond_their_shared_cores_take_turns_and_pay_gloos_contention_default(root):
    from sim.simulate import simulate
    from sim.transport import GLOO_CONTENTION_PER_TURN_S

    shared, enough, undeclared = (simulate(_one_variant(root, cores)) for cores in (2, 4, None))
    # cores enough for every rank: no contention, and no line saying so
    assert not [line for line in enough.sources if line.startswith("core contention")]
    # 4 ranks on 2 cores: slower than a core each, and the output says which defaults priced it
    tpot = [r.variants[0].timing["tpot_s"] for r in (shared, enough, undeclared)]
    ttft = [r.variants[0].timing["ttft_s"] for r in (shared, enough, undeclared)]
    assert tpot[0] > tpot[1] and ttft[0] > ttft[1]
    floor_ms = GLOO_CONTENTION_PER_TURN_S[False] * 1e3
    assert any(line.startswith("core contention: 4 ranks on 2 cores") for line in shared.sources)
    assert any(f"at least {floor_ms:.2f} ms" in line and "gloo/tcp default" in line for line in shared.sources)


def test_uncalibrated_cpu_ranks_on_declared_cores_compute_at_one_cores_peaks(root):
    from sim.cost import RooflineCompute
    from sim.devices import DEVICES
    from sim.simulate import simulate

    shared, enough, undeclared = (simulate(_one_variant(root, cores)) for cores in (2, 4, None))
    # a declared core per rank (single-threaded, as the runtime runs them) is slower than a whole
    # CPU each, and says so; without declared cores nothing says it
    for metric in ("ttft_s", "tpot_s"):
        assert enough.variants[0].timing[metric] > undeclared.variants[0].timing[metric]
    line = "compute on cpu: one core per rank"
    assert any(s.startswith(line) for s in enough.sources) and any(s.startswith(line) for s in shared.sources)
    assert not any(s.startswith(line) for s in undeclared.sources)
    # the LM head of GPT-2 (fp32, 154.6 MB of weights: memory-bound) at one core's bandwidth
    lm_head = next(op for segment in enough.variants[0].run.plan.phase(1).segments
                   for op in segment.programs[0] if op.name == "lm_head")
    cpu, gpu = enough.topology.devices[0], replace_spec(enough.topology.devices[0], DEVICES["rtx_3060_12gb"])
    one, whole = (RooflineCompute("fp32", 0.6, 0.8, 0.0, one_core=flag) for flag in (True, False))
    assert one.duration_s(lm_head, cpu) == pytest.approx(lm_head.traffic_bytes / (0.8 * 10e9), rel=1e-12)
    assert one.duration_s(lm_head, cpu) > whole.duration_s(lm_head, cpu)
    # an accelerator has no cores to single out: priced whole either way
    assert one.duration_s(lm_head, gpu) == whole.duration_s(lm_head, gpu)


def replace_spec(device, spec):
    """``device`` with the catalog entry ``spec``."""
    from dataclasses import replace

    return replace(device, spec=spec)


def test_uncalibrated_gloo_messages_cost_at_least_the_contention_floor_of_their_busy_ranks(root):
    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import GLOO_CONTENTION_PER_TURN_S, DefaultTransportNetwork

    topology = build_topology(_one_variant(root, 2).config.cluster)
    group = (0, 1, 2, 3)
    doubling = build_schedule("allreduce", "recursive_doubling", group, 64, host_groups=topology.host_groups(group))
    shared = DefaultTransportNetwork(topology, cores=2, ranks=4).time(doubling).duration_s
    own = DefaultTransportNetwork(topology).time(doubling).duration_s
    # 2 exchange steps, each keeping all 4 ranks busy (2 beyond the cores) for 3 core turns: one to
    # enter the step, one per message a rank sends and receives
    assert own < 2 * 3 * GLOO_CONTENTION_PER_TURN_S[False] <= shared


def test_uncalibrated_contention_defaults_follow_the_ranks_per_core(root):
    from sim.collectives.registry import LIBRARY
    from sim.topology import build_topology
    from sim.transport import GLOO_CONTENTION_PER_TURN_S, DefaultTransportNetwork

    topology = build_topology(_one_variant(root, 2).config.cluster)

    def floor_s(ranks, cores, algorithm="ring"):
        return DefaultTransportNetwork(topology, cores=cores, ranks=ranks).contention_floor_s(algorithm)

    # measured with 4 ranks on 2 cores; a point-to-point turn's core work shared among fewer or more
    assert floor_s(4, 2) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[False])
    assert floor_s(3, 2) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[False] * 0.75)
    assert floor_s(8, 2) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[False] * 2)
    assert floor_s(2, 2) == 0.0
    # gloo's own collectives wait inside the library: the same with 3 ranks as with 4
    assert floor_s(3, 2, LIBRARY) == floor_s(4, 2, LIBRARY) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[True])


def test_a_clusters_shared_cores_must_be_a_positive_count(root):
    from models.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        _one_variant(root, 0)
    assert error.value.field == "cluster.cores"


def test_group_transport_follows_devices_and_hosts():
    from sim.cluster_config import ClusterConfig
    from sim.topology import build_topology
    from sim.transport import Transport, group_transport

    def topology(device: str, hosts: int):
        return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
            {"name": "h{i}", "count": hosts, "parent": "sw", "nic": {"bandwidth": "100Gbit/s", "latency": "5us"},
             "interconnect": {"bandwidth": "900GB/s", "latency": "1us"},
             "devices": {"type": device, "count": 2}}]}))

    assert group_transport(topology("cpu", 2), (0, 2)) is Transport.GLOO_TCP
    assert group_transport(topology("h100_sxm", 2), (0, 1)) is Transport.NCCL_NVLINK
    assert group_transport(topology("h100_sxm", 2), (0, 2)) is Transport.NCCL_NET
    assert group_transport(topology("rtx_4090", 1), (0, 1)) is Transport.NCCL_PCIE
    # The A100 comes as an SXM module on NVLink and as a PCIe card (the MLC LLM benchmark's).
    assert group_transport(topology("a100_80gb", 1), (0, 1)) is Transport.NCCL_NVLINK
    assert group_transport(topology("a100_80gb_pcie", 1), (0, 1)) is Transport.NCCL_PCIE


def test_core_contention_per_message_is_fitted_where_fast_links_show_it_and_carried_to_the_targets_ranks_per_core(clusters):
    from sim.calibrated import contention_floor
    from sim.transport import GLOO_CONTENTION_PER_TURN_S
    from sim.context import profile_contexts, scenario_context
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology
    from sim.transport import fit_profile

    def floor(source, target, library=False):
        contexts = profile_contexts(source.profile.rows)
        topology = build_topology(target.scenario.config.cluster)
        context = scenario_context(target.name, topology, ParallelPlan.of(target.scenario, topology).tensor_ranks, "fp32")
        return contention_floor(source.profile, contexts, context,
                                fit_profile(source.profile.of("collective"), contexts[0]), library=library)[0]

    fast, slow, three = clusters[0], clusters[3], clusters[4]  # v2x2_bandwidth, v4x1_latency, h3x1_delay
    four_ranks = floor(fast, clusters[2])
    # 4 ranks on 2 cores: a core turn each to enter an exchange step, to send and to receive,
    # 2.0-2.4 ms in place
    assert 1.5e-3 < 3 * four_ranks < 3e-3
    # 3 ranks on the 2 cores: a point-to-point turn's core work shared among 1.5 ranks a core, not 2
    # (t3x1_bandwidth in place: 0.42-0.44 ms per turn, 4-rank clusters 0.74-0.77)
    assert floor(fast, three) == pytest.approx(four_ranks * 3 / 4)
    # 5 ms links hid it: the gloo/tcp default, measured with 4 ranks on 2 cores, carried alike
    assert floor(slow, clusters[2]) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[False])
    assert floor(slow, three) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[False] * 3 / 4)
    # gloo's own collectives wait inside the library: a turn costs less than a Python isend/irecv's,
    # and the same with 3 ranks as with 4
    library = floor(fast, clusters[2], library=True)
    assert 0.1e-3 < library < four_ranks / 2
    assert floor(fast, three, library=True) == pytest.approx(library)
    assert floor(slow, clusters[2], library=True) == pytest.approx(GLOO_CONTENTION_PER_TURN_S[True])


def test_a_step_pays_the_contention_of_its_busy_ranks_per_core_turn(clusters):
    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import TransportNetwork, TransportTerms

    topology = build_topology(clusters[0].scenario.config.cluster)  # 2 hosts of 2 ranks
    group = (0, 1, 2, 3)
    floor_s = 2e-3
    terms = TransportTerms(0.0, 1.0, 1.0, "test", min_message_s=floor_s)
    network = TransportNetwork(topology, None, {}, terms, cores=2)

    def cost(algorithm):
        return network.time(build_schedule("allreduce", algorithm, group, 3072, root=None,
                                           host_groups=topology.host_groups(group))).duration_s

    # recursive doubling: 2 exchange steps, every rank busy in each for 3 turns (enter, send, receive)
    assert 6 * floor_s <= cost("recursive_doubling") < 6 * floor_s + 0.5e-3
    # two-level tree: 4 steps; the 2 between the hosts' leaders keep 2 ranks on the 2 cores, free;
    # the gather and the broadcast inside the hosts keep all 4 busy, each rank for 2 turns (enter
    # and one message): less than recursive doubling though it has twice the steps
    assert 4 * floor_s < cost("two_level_tree") < 5 * floor_s
    # ranks with a core each: no floor at all
    alone = TransportNetwork(topology, None, {}, terms, cores=4)
    assert alone.time(build_schedule("allreduce", "recursive_doubling", group, 3072, root=None,
                                     host_groups=topology.host_groups(group))).duration_s < floor_s


def test_a_step_inside_hosts_a_delay_apart_contends_with_its_own_hosts_ranks_only():
    from sim.cluster_config import ClusterConfig
    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import TransportNetwork, TransportTerms

    def two_hosts_of_two(latency: str):
        return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
            {"name": "n{i}", "count": 2, "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": latency},
             "interconnect": {"bandwidth": "1Gbit/s", "latency": "50us"},
             "devices": {"type": "cpu", "count": 2, "memory": "4GiB"}}]}))

    group = (0, 1, 2, 3)
    floor_s = 2e-3
    terms = TransportTerms(0.0, 1.0, 1.0, "test", min_message_s=floor_s)

    def cost(topology):
        schedule = build_schedule("allreduce", "recursive_doubling", group, 3072, root=None,
                                  host_groups=topology.host_groups(group))
        return TransportNetwork(topology, None, {}, terms, cores=2).time(schedule).duration_s

    # 0.1 ms apart, the hosts' ranks meet the cores together: both exchanges (inside the hosts, then
    # between them) keep all 4 busy on the 2 cores, 3 turns each
    assert 6 * floor_s <= cost(two_hosts_of_two("50us")) < 6 * floor_s + 1e-3
    # 1.1 ms apart, each host's exchange keeps its own 2 ranks busy, on 2 cores: no floor; the one
    # between the hosts still keeps all 4
    assert 3 * floor_s <= cost(two_hosts_of_two("550us")) < 3 * floor_s + 1e-3


def test_a_message_inside_a_host_pays_the_intra_host_floor_one_between_hosts_the_other(clusters):
    from dataclasses import replace

    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import TransportNetwork, TransportTerms

    topology = build_topology(clusters[0].scenario.config.cluster)  # 2 hosts of 2 ranks
    group = (0, 1, 2, 3)
    schedule = build_schedule("allreduce", "recursive_doubling", group, 3072, root=None,
                              host_groups=topology.host_groups(group))
    # recursive doubling over 2 hosts of 2: its first exchange inside the hosts, its second between
    assert [{topology.devices[t.src].host == topology.devices[t.dst].host for t in step}
            for step in schedule.steps] == [{True}, {False}]
    terms = TransportTerms(0.0, 1.0, 1.0, "test", min_message_s=1e-3)

    def cost(terms):
        return TransportNetwork(topology, None, {}, terms, cores=2).time(schedule).duration_s

    # each exchange 3 core turns: 3 ms between the hosts and 6 ms inside them, not 6 ms each
    assert 9e-3 <= cost(replace(terms, intra_host_min_message_s=2e-3)) < 9.5e-3
    assert 6e-3 <= cost(terms) < 6.5e-3


def test_a_step_whose_busy_ranks_outnumber_the_cores_pays_whole_turns_however_many_beyond(clusters, monkeypatch):
    from sim.collectives import registry
    from sim.topology import build_topology
    from sim.transport import TransportNetwork, TransportTerms

    # gloo's broadcast tree over 4 ranks on 2 cores: its first step keeps the root and its two
    # children busy (one beyond the cores), the root for 3 turns (enter, two sends), each child for
    # 2: 7/3 turns on average, as many as with all 4 busy (a woken rank waits for a preempted one,
    # not for each rank beyond the cores); its second step, one message, leaves 2 busy: free
    monkeypatch.setattr(registry, "LIBRARY_BROADCAST", registry.LibraryBroadcast.GLOO_TREE)
    topology = build_topology(clusters[0].scenario.config.cluster)  # 2 hosts of 2 ranks
    group = (0, 1, 2, 3)
    floor_s = 2e-3
    network = TransportNetwork(topology, None, {}, TransportTerms(0.0, 1.0, 1.0, "test", min_message_s=floor_s),
                               cores=2)
    schedule = registry.build_schedule("broadcast", registry.LIBRARY, group, 3072, root=0)
    assert [len(step) for step in schedule.steps] == [2, 1]
    assert 7 / 3 * floor_s <= network.time(schedule).duration_s < 7 / 3 * floor_s + 0.5e-3


def test_a_broadcast_timed_alone_pays_the_receivers_notice_which_a_run_does_not(clusters):
    from sim.collectives.registry import build_schedule
    from sim.context import profile_contexts
    from sim.transport import TransportNetwork, fit_profile

    slow = clusters[3]  # v4x1_latency: 5 ms links, where a 2-step broadcast of 1 KiB takes 15.8 ms alone
    terms = fit_profile(slow.profile.of("collective"), profile_contexts(slow.profile.rows)[0])
    broadcast = terms[("broadcast", "library")]
    # gloo's broadcast rendezvouses like an isend/irecv: the notice is a term of its own, not
    # absorbed into the overhead (2.2 ms if it were)
    assert broadcast.latencies_per_message == 2.0 and broadcast.notice_latencies == 1.0
    assert broadcast.per_message_s < 1e-3
    topology = build_topology_of(slow)
    network = TransportNetwork(topology, None, {("broadcast", "library"): broadcast}, broadcast)
    schedule = build_schedule("broadcast", "library", (0, 1, 2, 3), 1024, root=0)
    alone = network.time(schedule).duration_s
    waited = network.time(schedule, arrivals={0: 0.0, 1: -0.01, 2: -0.01, 3: -0.01}).duration_s
    latency_s = topology.path_latency_s(0, 1)
    assert 3 * latency_s < alone < 3 * latency_s + 2e-3  # both steps, the first waiting for the notice
    assert alone - waited == pytest.approx(latency_s, abs=1e-5)  # receivers waiting since before: no notice


def build_topology_of(cluster):
    from sim.topology import build_topology

    return build_topology(cluster.scenario.config.cluster)


def test_a_profile_with_a_broken_context_row_is_refused_in_one_line(tmp_path):
    from models.errors import ConfigError
    from sim.profile import load_profile
    from validation.transfer import SHIPPED

    text = (SHIPPED[0][1] / "profiles" / "v2x2_bandwidth.csv").read_text()
    broken = tmp_path / "broken.csv"
    broken.write_text(text.replace('{""cores"": 2}', '{""cores"": ', 1))
    with pytest.raises(ConfigError) as error:
        load_profile(broken)
    assert error.value.field == "profile" and "context" in str(error.value) and "\n" not in str(error.value)


def test_simulate_with_another_clusters_profile_says_so_and_lists_what_came_from_where(root, tmp_path):
    from click.testing import CliRunner

    from validation.cli import cli

    scenario = root / "scenarios" / "validation" / "v2x2_latency.yaml"
    profiles = root / "validation" / "report" / "profiles"
    other = CliRunner().invoke(cli, ["simulate", str(scenario), "--profile", str(profiles / "v4x1_bandwidth.csv"),
                                     "--out", str(tmp_path / "other")], terminal_width=400)
    assert other.exit_code == 0, other.output
    assert "measured on another cluster" in other.output and "no prediction outside" not in other.output
    assert "in-place collective timings: not applicable" in other.output
    own = CliRunner().invoke(cli, ["simulate", str(scenario), "--profile", str(profiles / "v2x2_latency.csv"),
                                   "--out", str(tmp_path / "own")], terminal_width=400)
    assert own.exit_code == 0, own.output
    assert "measured on another cluster" not in own.output and "same-cluster mode" in own.output


def _three_hosts(latency="1.5ms"):
    from sim.cluster_config import ClusterConfig
    from sim.topology import build_topology

    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
        {"name": "h{i}", "count": 3, "parent": "sw", "nic": {"bandwidth": "200Mbit/s", "latency": latency},
         "devices": {"type": "cpu", "count": 1, "memory": "4GiB"}}]}))


def _gloo_point_to_point(**changes):
    from dataclasses import replace

    from sim.transport import TransportTerms

    # gloo/tcp isend/irecv without software overhead: 2 latencies, 1 of them the receiver's notice
    return replace(TransportTerms(0.0, 2.0, 1.0, "test", notice_latencies=1.0, sender_done_on_write=True), **changes)


@pytest.mark.parametrize("algorithm, latencies", [("recursive_doubling", 5), ("rabenseifner", 7)])
def test_a_butterfly_over_three_ranks_is_priced_as_the_runtime_runs_its_schedule(algorithm, latencies):
    """Fold, exchange(s), unfold over isend/irecv (runtime.comm.run_schedule): a receiver's ready
    notice goes out when it enters a step, so the fold costs 2 latencies, the exchanges wait for
    the notice of the rank coming from the fold, and the master, waiting since the fold, gets the
    unfold in one; h3x1_delay measured 17.6 ms (recursive doubling) and 24.0 ms (Rabenseifner)
    over 3 ms alone, 5 and 7 latencies plus overheads, where every message at 2 latencies gives
    6 and 8."""
    from sim.collectives.registry import build_schedule
    from sim.transport import TransportNetwork

    topology = _three_hosts()
    schedule = build_schedule("allreduce", algorithm, (0, 1, 2), 8)
    latency_s = topology.path_latency_s(0, 1)
    timing = TransportNetwork(topology, None, {}, _gloo_point_to_point()).time(schedule)
    assert timing.finish_s[0] == pytest.approx(latencies * latency_s, abs=1e-5)
    every_message_alike = TransportNetwork(topology, None, {}, _gloo_point_to_point(notice_latencies=0.0,
                                                                                    sender_done_on_write=False))
    assert every_message_alike.time(schedule).finish_s[0] == pytest.approx((latencies + 1) * latency_s, abs=1e-5)


def test_a_receiver_that_arrived_early_has_sent_its_notice_and_a_sender_goes_on_once_written():
    from sim.collectives.registry import build_schedule
    from sim.network import CollectivePricer
    from sim.transport import TransportNetwork

    topology = _three_hosts()
    latency_s = topology.path_latency_s(0, 1)
    network = TransportNetwork(topology, None, {}, _gloo_point_to_point())
    assert network.arrival_horizon_s((0, 1, 2)) == pytest.approx(latency_s)
    # the master comes last, as in a run where it computed more: the fold needs no notice
    pricer = CollectivePricer(network, topology)
    _, late_master = pricer.price("allreduce", "recursive_doubling", (0, 1, 2), 8,
                                  arrivals={0: 0.0, 1: -latency_s, 2: -latency_s})
    assert late_master.finish_s[0] == pytest.approx(4 * latency_s, abs=1e-5)
    _, together = pricer.price("allreduce", "recursive_doubling", (0, 1, 2), 8, arrivals={0: 0.0, 1: 0.0, 2: 0.0})
    assert together.finish_s[0] == pytest.approx(5 * latency_s, abs=1e-5)
    # a broadcast's root is done once it has written to both others, not when they have the bytes
    broadcast = network.time(build_schedule("broadcast", "binomial", (0, 1, 2), 8, root=0))
    assert broadcast.finish_s[0] < broadcast.finish_s[1] and broadcast.finish_s[0] < broadcast.finish_s[2]
    assert broadcast.duration_s - broadcast.finish_s[0] == pytest.approx(latency_s, abs=1e-5)


def _two_hosts_of_two():
    from sim.cluster_config import ClusterConfig
    from sim.topology import build_topology

    # the emulated training cluster: 1 Gbit/s inside a host, 100 Mbit/s between, no added delay
    return build_topology(ClusterConfig.model_validate({"switches": [{"name": "sw"}], "hosts": [
        {"name": "n{i}", "count": 2, "parent": "sw", "nic": {"bandwidth": "100Mbit/s", "latency": "50us"},
         "interconnect": {"bandwidth": "1Gbit/s", "latency": "50us"},
         "devices": {"type": "cpu", "count": 2, "memory": "4GiB"}}]}))


def test_a_sender_goes_on_once_its_payloads_tail_fits_its_socket_buffer():
    """bench_send_buffer.py: over 100 Mbit/s a 1.4 MB isend completed at once and an 8 MB one
    0.1 s before its receive; the receive itself takes the wire's time either way."""
    from models.ops import OpKind
    from sim.collectives.schedule import CommSchedule, Transfer
    from sim.transport import TransportNetwork

    topology = _two_hosts_of_two()
    rate = 12.5e6
    buffered = _gloo_point_to_point(send_buffer_s=0.1, send_buffer_max_bytes=2.8e6)
    unbuffered = _gloo_point_to_point()
    for size, sender_done_s in ((1.0e6, 0.0), (8.0e6, 8.0e6 / rate - 0.1)):
        schedule = CommSchedule(OpKind.SEND, "p2p", (1, 2), None, int(size), ((Transfer(1, 2, int(size), False),),))
        with_buffer = TransportNetwork(topology, None, {}, buffered).time(schedule)
        without = TransportNetwork(topology, None, {}, unbuffered).time(schedule)
        assert with_buffer.finish_s[2] == pytest.approx(without.finish_s[2], rel=1e-9)  # the wire as before
        assert without.finish_s[1] == pytest.approx(size / rate, rel=0.01)
        assert with_buffer.finish_s[1] == pytest.approx(sender_done_s, abs=2e-3)


def test_a_ring_over_fast_and_slow_links_releases_its_ranks_a_slow_transfer_apart():
    """Two hosts of two ranks: a rank whose last step sends over the slow link and receives over
    the fast one is done before the one that receives over the slow link, by the slow link's
    chunk less the fast link's; the last rank's end, the allreduce's time, is unchanged."""
    from sim.collectives.registry import build_schedule
    from sim.transport import TransportNetwork, default_terms

    topology = _two_hosts_of_two()
    size = 5 * 2**20
    schedule = build_schedule("allreduce", "ring", (0, 1, 2, 3), size, host_groups=topology.host_groups((0, 1, 2, 3)))
    gloo = default_terms("ring")
    timing = TransportNetwork(topology, None, {}, gloo).time(schedule)
    last_receive_slow = [r for r in (0, 1, 2, 3) if topology.devices[(r - 1) % 4].host != topology.devices[r].host]
    chunk = size / 4
    lag_s = chunk / 12.5e6 - chunk / 125e6
    for rank in (0, 1, 2, 3):
        expected = timing.duration_s - (0.0 if rank in last_receive_slow else lag_s)
        assert timing.finish_s[rank] == pytest.approx(expected, rel=0.02)
    from dataclasses import replace

    unbuffered = TransportNetwork(topology, None, {}, replace(gloo, send_buffer_s=0.0)).time(schedule)
    assert timing.duration_s == pytest.approx(unbuffered.duration_s, rel=1e-6)
    assert max(unbuffered.finish_s.values()) - min(unbuffered.finish_s.values()) < 1e-3


def test_gloo_defaults_carry_the_rendezvous_and_nccl_defaults_do_not():
    from sim.transport import Transport, default_terms

    point_to_point = default_terms("recursive_doubling")
    assert point_to_point.latencies_per_message == 2.0 and point_to_point.notice_latencies == 1.0
    assert point_to_point.sender_done_on_write and default_terms("library").notice_latencies == 0.0
    nccl = default_terms("ring", Transport.NCCL_NET)
    assert nccl.notice_latencies == 0.0 and not nccl.sender_done_on_write and not nccl.send_buffer_s
    assert point_to_point.send_buffer_s > 0 and point_to_point.send_buffer_max_bytes > 0


def test_ranks_idle_at_a_segments_start_have_posted_the_receive_of_its_first_collective():
    """A decode step begins with the master's embedding broadcast; the other ranks, done with the
    last step, wait in it already, so the root writes at once and they have the token one latency
    after (uncalibrated gloo/tcp terms: 2 latencies, 1 of them the notice, 0.3 ms per message)."""
    from models.ops import OpKind
    from tests.conftest import cluster, make_scenario

    from sim.simulate import simulate

    scenario = make_scenario(cluster=cluster(3, 1, device="cpu", nic="200Mbit/s", nic_latency="1.5ms"), dtype="fp32",
                             network_model="flow", variants=[{"name": "rd", "strategy": "allreduce_ln",
                                                              "allreduce": "recursive_doubling", "broadcast": "library"}])
    result = simulate(scenario)
    ops = result.variants[0].trace.ops
    latency_s = result.topology.path_latency_s(0, 1)
    broadcasts = ops[(ops["kind"] == str(OpKind.BROADCAST)) & (ops["phase"] == "decode")]
    first = broadcasts[broadcasts["step"] == broadcasts["step"].min()].set_index("rank")
    root_start = float(first.loc[0, "start_s"])
    for rank in (1, 2):  # one binomial step each over 3 ranks: (0 -> 2), then (0 -> 1)
        assert float(first.loc[rank, "end_s"]) - root_start < latency_s + 1.5e-3


def test_a_rank_arriving_early_at_gloos_ring_has_posted_both_of_its_first_segments():
    """gloo's ring posts the receives of its first two segments at once (gloo/allreduce.cc): a rank
    that arrived a latency early has sent both notices, so both of its first payloads come a
    latency after the last rank arrives, it enters the allgather then and finishes a latency
    before that rank (rendezvous terms without overhead; 32 bytes, whose wire time is negligible)."""
    from sim.collectives.registry import build_schedule
    from sim.transport import TransportNetwork

    topology = _three_hosts()
    latency_s = topology.path_latency_s(0, 1)
    schedule = build_schedule("allreduce", "library", (0, 1), 32)
    network = TransportNetwork(topology, None, {}, _gloo_point_to_point())
    together = network.time(schedule)
    assert dict(together.finish_s) == pytest.approx({0: 4 * latency_s, 1: 4 * latency_s}, abs=1e-5)
    early = network.time(schedule, arrivals={0: 0.0, 1: -latency_s})
    assert dict(early.finish_s) == pytest.approx({0: 4 * latency_s, 1: 3 * latency_s}, abs=1e-5)


@pytest.mark.parametrize("device, hop_latency_s", [("a100_80gb", 3.4e-6), ("rtx_4090", 5.7e-6)])
def test_an_uncalibrated_nccl_ring_allreduce_of_a_few_bytes_costs_nccls_ring_simple_model(device, hop_latency_s):
    """NVIDIA/nccl src/graph/tuning.cc prices a one-node Ring allreduce of p ranks at
    baseLat + 2 (p - 1) hwLat: Simple's 8.4 us, and 3.4 us per NVLink step or 5.7 us per PCI step;
    hetsim's default adds each step's path latency (here 2 links of 1 us) and the bytes (ns)."""
    from models.ops import OpKind
    from sim.cluster_config import ClusterConfig
    from sim.collectives.registry import build_schedule
    from sim.topology import build_topology
    from sim.transport import DefaultTransportNetwork, NcclProtocol, group_transport
    from validation.nccl_tests_check import nccl_ring_allreduce_s

    def ring_s(link_latency: str):
        topology = build_topology(ClusterConfig.model_validate({"hosts": [{
            "name": "h", "interconnect": {"bandwidth": "32GB/s", "latency": link_latency},
            "devices": {"type": device, "count": 4}}]}))
        schedule = build_schedule(OpKind.ALLREDUCE, "ring", (0, 1, 2, 3), 8)
        return DefaultTransportNetwork(topology).time(schedule).duration_s, group_transport(topology, (0, 1, 2, 3))

    duration_s, transport = ring_s("0us")
    assert duration_s == pytest.approx(8.4e-6 + 6 * hop_latency_s, rel=1e-3)
    assert duration_s == pytest.approx(nccl_ring_allreduce_s(transport, NcclProtocol.SIMPLE, 4), rel=1e-3)
    assert ring_s("1us")[0] - duration_s == pytest.approx(6 * 2e-6, rel=1e-3)


def test_a_delayed_link_profile_prices_core_contention_from_its_calls_timed_on_loopback(clusters):
    """Links with a delay hide the cores' delay per message in place; the same calls timed on
    loopback after the launch (``collective_loopback``) give it, in proportion, before the default,
    from the group size nearest the target's ranks on the machine, where no calibrated cluster
    shows it in place."""
    from sim.calibrated import contention_floor
    from sim.context import profile_contexts, scenario_context
    from sim.parallel import ParallelPlan
    from sim.profile import Profile, with_rows
    from sim.topology import build_topology
    from sim.transport import GLOO_CONTENTION_PER_TURN_S, fit_profile
    from sim.vocabulary import MeasurementKind

    fast, slow = clusters[0], clusters[3]  # v2x2_bandwidth, v4x1_latency (5 ms links)

    def context_of(target):
        topology = build_topology(target.scenario.config.cluster)
        return scenario_context(target.name, topology, ParallelPlan.of(target.scenario, topology).tensor_ranks, "fp32")

    four, three = context_of(clusters[2]), context_of(clusters[4])  # v4x1_bandwidth, h3x1_delay: ranks on 2 cores

    def floor(profile, library, target=four, fitted_on=None):
        contexts = profile_contexts(profile.rows)
        fitted_on = fitted_on or profile  # a pool's transport terms are its first cluster's (calibrated_network)
        return contention_floor(profile, contexts, target,
                                fit_profile(fitted_on.of("collective"), profile_contexts(fitted_on.rows)[0]),
                                library=library)[:2]

    def with_loopback(profile, scales, kind=MeasurementKind.COLLECTIVE_LOOPBACK):
        """The profile's smallest in-place calls as if timed on loopback (or as ``kind`` says),
        over each group size's ranks, times its scale."""
        rows = profile.of(MeasurementKind.COLLECTIVE_IN_PLACE)
        rows = rows[rows["size_bytes"] == rows["size_bytes"].min()]
        added = []
        for size, scale in scales.items():
            copy = rows.assign(measurement=kind.value, group_size=size, num_hosts=size)
            for column in ("median", "p10", "p90", "mean"):
                copy[column] = copy[column] * scale
            added += copy.to_dict("records")
        return Profile(with_rows(profile.rows, added))

    for library in (False, True):
        default_s, default_source = floor(slow.profile, library)
        assert default_s == pytest.approx(GLOO_CONTENTION_PER_TURN_S[library]) and "default" in default_source
        # timed twice as long, twice the floor: no delay to take out on loopback
        once_s, source = floor(with_loopback(slow.profile, {4: 0.5}), library)
        twice_s, _ = floor(with_loopback(slow.profile, {4: 1.0}), library)
        assert "on loopback over 4 ranks after the launch of v4x1_latency" in source
        assert once_s != pytest.approx(default_s) and twice_s == pytest.approx(2 * once_s)
        # a target of 3 ranks is priced from the 3-rank group, as timed: not carried from 4
        both = with_loopback(slow.profile, {4: 0.5, 3: 0.3})
        assert floor(both, library)[0] == pytest.approx(once_s)
        alone_s, source = floor(both, library, three)
        assert "over 3 ranks" in source and alone_s == pytest.approx(floor(with_loopback(slow.profile, {3: 0.3}),
                                                                           library, three)[0])
        assert alone_s != pytest.approx(floor(with_loopback(slow.profile, {4: 0.5}), library, three)[0])
        # where the links let the cores show in place, the in-place calls decide, in a pool too
        in_place = floor(fast.profile, library)
        assert floor(with_loopback(fast.profile, {4: 3.0}), library) == in_place
        assert "in place on v2x2_bandwidth" in in_place[1]
        pool = pooled_profile([with_loopback(fast.profile, {4: 3.0}), with_loopback(slow.profile, {4: 0.5})])
        _, source = floor(pool, library, fitted_on=fast.profile)
        assert "in place on v2x2_bandwidth" in source and "loopback" not in source

        # calls timed between namespaces too (a calibration on the testbed): messages between
        # hosts priced from them, those inside a host from loopback, where nothing shows in place
        bridged = with_loopback(with_loopback(slow.profile, {4: 1.0}), {4: 0.5}, MeasurementKind.COLLECTIVE_BRIDGED)
        contexts = profile_contexts(bridged.rows)
        split = contention_floor(bridged, contexts, four,
                                 fit_profile(bridged.of("collective"), contexts[0]), library=library)
        assert split.floor_s == pytest.approx(once_s) and split.intra_host_s == pytest.approx(twice_s)
        assert "between namespaces over 4 ranks and on loopback over 4" in split.source
        # the in-place calls still set the level where they show the cores, split by path in the
        # ratio of the per-path timings: a mixed cluster's (2 hosts of 2) messages between hosts
        # below its single floor, those inside a host at or above it (at it where every step of the
        # calls holds one: a step lasts as long as its slowest message, and so is it priced)
        fast_bridged = with_loopback(with_loopback(fast.profile, {4: 2.0}), {4: 1.0}, MeasurementKind.COLLECTIVE_BRIDGED)
        contexts = profile_contexts(fast_bridged.rows)
        split = contention_floor(fast_bridged, contexts, four,
                                 fit_profile(fast_bridged.of("collective"), contexts[0]), library=library)
        assert "in place on v2x2_bandwidth" in split.source
        # (about twice: the ratio of the two rows' floors, each the median of the calls bound at its scale)
        assert split.intra_host_s == pytest.approx(2 * split.floor_s, rel=0.05)
        assert split.floor_s < in_place[0] <= split.intra_host_s * (1 + 1e-9)
        if library:  # gloo's ring: every step sends one message inside each host
            assert split.intra_host_s == pytest.approx(in_place[0])
