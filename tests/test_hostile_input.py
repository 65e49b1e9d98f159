"""Hostile input to ``hetsim simulate``: every class of malformed scenario or model config gives one
line on stderr naming the field the user wrote, exit code 2, and nothing written (issue 17)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from models.errors import ConfigError
from sim.budget import check_job_size, work_units
from sim.simulate import check_finite
from tests.conftest import ROOT, cluster, scenario_dict, tiny_model_config
from tests.test_cli import _run


def _refused(tmp_path: Path, capsys, scenario: str | bytes | dict, *extra: str) -> str:
    """Run ``scenario`` and assert the clean refusal; return the error line."""
    path = tmp_path / "scenario.yaml"
    if isinstance(scenario, dict):
        scenario = yaml.safe_dump(scenario)
    path.write_bytes(scenario if isinstance(scenario, bytes) else scenario.encode())
    out = tmp_path / "out"
    code, _, stderr = _run(["simulate", str(path), "--out", str(out), *extra], capsys)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hetsim: error: "), stderr
    assert not out.exists()
    return lines[0].removeprefix("hetsim: error: ")


def _with(data: dict, path: tuple, value) -> dict:
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


# -- decoding, size, depth, numbers --------------------------------------------------------------

@pytest.mark.parametrize("content", [
    yaml.safe_dump(scenario_dict()).encode() + b"# caf\xe9\n",
    yaml.safe_dump(scenario_dict()).encode("utf-16"),
])
def test_bytes_that_are_not_utf8_are_one_line(tmp_path, capsys, content):
    assert "not UTF-8 text" in _refused(tmp_path, capsys, content)


def test_binary_model_config_is_not_utf8(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff")
    error = _refused(tmp_path, capsys, scenario_dict(model="config.json"))
    assert error.startswith("model.config: not UTF-8 text")


def test_deep_nesting_is_refused_without_recursion_error(tmp_path, capsys):
    assert "nested deeper than" in _refused(tmp_path, capsys, "name: " + "[" * 900 + "]" * 900 + "\n")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "x": ' + "[" * 900 + "]" * 900 + "}")
    assert "nested deeper than" in _refused(tmp_path, capsys, scenario_dict(model="config.json"))


def test_huge_integer_is_refused(tmp_path, capsys):
    text = yaml.safe_dump(scenario_dict()).replace("prompt_tokens: 32", "prompt_tokens: " + "9" * 5000)
    error = _refused(tmp_path, capsys, text)
    assert error == "workload.prompt_tokens: Input should be a valid integer (got a 5000-digit number)"
    config = tiny_model_config("llama", 2)
    (tmp_path / "config.json").write_text(json.dumps(config).replace('"vocab_size": 256', '"vocab_size": ' + "7" * 5000))
    error = _refused(tmp_path, capsys, scenario_dict(model="config.json"))
    assert error == "model.config.vocab_size: must be an integer (got a 5000-digit number)"


def test_duplicate_keys_are_refused(tmp_path, capsys):
    text = yaml.safe_dump(scenario_dict()) + "name: again\n"
    assert "duplicate key 'name'" in _refused(tmp_path, capsys, text)


@pytest.mark.parametrize("path", [("workload", "batch_size"), ("cluster", "hosts", 0, "count")])
def test_true_is_not_a_count(tmp_path, capsys, path):
    error = _refused(tmp_path, capsys, _with(scenario_dict(), path, True))
    dotted = ".".join(p if isinstance(p, str) else f"[{p}]" for p in path).replace(".[", "[")
    assert error.startswith(f"{dotted}: ")


def test_unit_arithmetic_errors_and_sub_byte_sizes_are_refused(tmp_path, capsys):
    data = scenario_dict(cluster=cluster(nic_latency="(1/0) ms"))
    assert _refused(tmp_path, capsys, data).startswith("cluster.hosts[0].nic.latency: not a duration")
    data = scenario_dict(cluster=cluster(memory="0.4 byte"))
    assert _refused(tmp_path, capsys, data).startswith("cluster.hosts[0].devices.memory: size must be between 1")


@pytest.mark.parametrize("link", [{"nic_latency": "1e308 s"}, {"nic": "1e-300 bit/s"}])
def test_magnitudes_that_would_give_nan_or_inf_are_refused_at_input(tmp_path, capsys, link):
    error = _refused(tmp_path, capsys, scenario_dict(cluster=cluster(**link)))
    assert error.startswith("cluster.hosts[0].nic.") and error.count("(got") == 1


def test_a_non_finite_metric_is_never_a_row():
    with pytest.raises(ConfigError, match=r"^variants\[1\]: the simulated ttft_s is not a finite number"):
        check_finite({"ttft_s": math.inf, "tpot_s": 1.0}, "variants[1]", decodes=True)
    check_finite({"ttft_s": 1.0, "tpot_s": math.nan}, "variants[0]", decodes=False)  # one token: no decode


def test_zero_kv_heads_in_a_model_config_is_refused(tmp_path, capsys):
    config = tiny_model_config("llama", 2) | {"num_key_value_heads": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _refused(tmp_path, capsys, scenario_dict(model="config.json")).startswith("model.num_kv_heads: ")


# -- context, names, output directory, sweeps ----------------------------------------------------

def test_prompt_beyond_the_context_is_refused_unless_allowed(tmp_path, capsys):
    workload = {"batch_size": 1, "prompt_tokens": 1020, "output_tokens": 8}
    error = _refused(tmp_path, capsys, scenario_dict(workload=workload))
    assert error.startswith("workload.output_tokens: prompt_tokens + output_tokens = 1028 exceeds gpt2's context")
    path = tmp_path / "allowed.yaml"
    path.write_text(yaml.safe_dump(scenario_dict(workload=workload | {"allow_beyond_context": True})))
    assert _run(["simulate", str(path), "--out", str(tmp_path / "ok")], capsys)[0] == 0


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../escape"])
def test_names_that_are_not_safe_file_names_are_refused(tmp_path, capsys, name):
    assert _refused(tmp_path, capsys, scenario_dict(name=name)).startswith("name: ")


def test_a_long_value_is_shown_shortened_once(tmp_path, capsys):
    error = _refused(tmp_path, capsys, scenario_dict(name="x" * 200_000))
    assert error.startswith("name: ") and len(error) < 300 and error.count("(got") == 1 and "…" in error


def test_out_under_a_file_or_proc_is_refused_before_any_work(tmp_path, capsys):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario_dict()))
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file" / "out", Path("/proc/hetsim-out"), ""):
        code, _, stderr = _run(["simulate", str(path), "--out", str(out)], capsys)
        assert code == 2 and stderr.startswith("hetsim: error: --out: ") and len(stderr.splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_out_in_a_read_only_directory_is_refused(tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o500)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario_dict()))
    code, _, stderr = _run(["simulate", str(path), "--out", str(tmp_path / "ro" / "out")], capsys)
    assert code == 2 and "no permission" in stderr


def test_sweep_validates_parallel_tensor_and_every_axis_value(tmp_path, capsys):
    data = scenario_dict(parallel={"tensor": 1000}, sweep={"devices": [2, 4]})
    assert _refused(tmp_path, capsys, data).startswith("parallel.tensor: ")
    data = scenario_dict(sweep={"devices": [2, True]})
    assert _refused(tmp_path, capsys, data).startswith("sweep.devices[1]: ")
    data = scenario_dict(workload={"batch_size": 1, "prompt_tokens": 5000, "output_tokens": 8},
                         sweep={"models": ["llama-2-7b", "gpt2"]})
    data["workload"]["allow_beyond_context"] = False
    data["dtype"] = "fp16"
    assert "exceeds gpt2's context" in _refused(tmp_path, capsys, data)


# -- bounded work --------------------------------------------------------------------------------

def test_a_huge_host_count_names_the_count(tmp_path, capsys):
    data = scenario_dict(cluster=cluster(num_hosts=1_000_000_000))
    assert _refused(tmp_path, capsys, data).startswith("cluster.hosts[0].count: ")


def test_output_tokens_beyond_the_limit_are_refused(tmp_path, capsys):
    data = scenario_dict(workload={"batch_size": 1, "prompt_tokens": 8, "output_tokens": 100_000_000,
                                   "allow_beyond_context": True})
    assert _refused(tmp_path, capsys, data).startswith("workload.output_tokens: ")


def test_a_job_estimated_past_the_work_limit_is_refused_naming_what_makes_it_large(tmp_path, capsys):
    # llama-2-70b on 64 ranks: one variant fits the work limit, forty do not.
    variants = [{"name": f"v{i}", "strategy": "allreduce_ln", "allreduce": "ring"} for i in range(40)]
    data = scenario_dict(model="llama-2-70b", cluster=cluster(num_hosts=64, devices_per_host=1), variants=variants)
    error = _refused(tmp_path, capsys, data)
    assert error.startswith("variants: 40 variants x 80 layers on 64 ranks") and "trace rows" in error
    # 1,024 ranks: even one variant is too much, and the ranks come from the cluster.
    config = tiny_model_config("llama", 80) | {"hidden_size": 1024 * 64, "num_attention_heads": 1024,
                                               "num_key_value_heads": 1024, "intermediate_size": 1024 * 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = scenario_dict(model="config.json", cluster=cluster(num_hosts=1024, devices_per_host=1),
                         variants=variants[:1], workload={"batch_size": 1, "prompt_tokens": 8, "output_tokens": 8})
    assert _refused(tmp_path, capsys, data).startswith("cluster: 1 variants x 80 layers on 1024 ranks")


def test_the_job_limits_name_the_dominant_factor():
    with pytest.raises(ConfigError, match=r"^sweep\.memory: 60 variants x 80 layers on 8 ranks with 1024 output"):
        check_job_size(60, 80, 8, 1024, ranks_field="cluster", variants_field="sweep.memory")
    with pytest.raises(ConfigError, match=r"^workload\.output_tokens: .* \(got 131072\)$"):
        check_job_size(1, 80, 4, 2**17, ranks_field="cluster")
    with pytest.raises(ConfigError, match=r"^parallel\.tensor: .* \(got 64 ranks\)$"):
        check_job_size(1, 1024, 64, 16, ranks_field="parallel.tensor")
    assert check_job_size(5, 32, 8, 128, ranks_field="cluster") == work_units(5, 32, 8, 128)


def test_weights_streamed_over_a_one_bit_per_second_disk_finish(tmp_path, capsys):
    # The loader's completion test was absolute (1e-12 s): at a simulated time of 1e12 s float
    # rounding left more than that and the simulator woke forever.
    data = scenario_dict(cluster=cluster(devices_per_host=1), memory={"policy": "sliding_window", "window": 1})
    data["cluster"]["hosts"][0]["storage"] = {"bandwidth": "1 bit/s", "latency": "100us"}
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(data))
    code, _, stderr = _run(["simulate", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, stderr
    import pandas as pd
    values = pd.read_csv(tmp_path / "out" / "results.csv")["value"]
    assert values.map(math.isfinite).all()


# -- errors name the field the user wrote --------------------------------------------------------

def test_errors_name_the_field_the_user_wrote(tmp_path, capsys):
    data = scenario_dict()
    data["variants"][1]["allreduce"] = "nccl"
    message = _refused(tmp_path, capsys, data)
    assert message.startswith("variants[1].allreduce: unknown allreduce algorithm; known: ring,")
    assert message.count("'nccl'") == 1
    assert _refused(tmp_path, capsys, scenario_dict(baseline="nope")).startswith("baseline: ")
    assert _refused(tmp_path, capsys, scenario_dict(dtype="int4")).startswith("dtype: ")
    data = scenario_dict()
    del data["variants"][1]["allreduce"]
    assert _refused(tmp_path, capsys, data).startswith("variants[1].allreduce: ")


def test_shipped_scenarios_and_plans_still_load():
    from sim.planning.catalog import load_catalog
    from sim.planning.plan_config import load_plan
    from sim.scenario import load_scenario
    for path in sorted(ROOT.glob("scenarios/**/*.yaml")):
        if "grids" in path.relative_to(ROOT / "scenarios").parts:  # sweep grids are not scenarios
            continue
        if "catalogs" in path.relative_to(ROOT / "scenarios").parts:  # the plans' price catalogs
            assert load_catalog(path).devices
            continue
        assert (load_plan(path) if path.name.startswith("plan_") else load_scenario(path)).name


def test_a_device_count_that_does_not_shard_the_model_names_the_cluster(tmp_path, capsys):
    # No parallel.tensor: the degree is the device count, so the error names what the user wrote.
    # (5 devices would split GPT-2's 12 heads unevenly by default; 13 leave a device without a head.)
    error = _refused(tmp_path, capsys, scenario_dict(cluster=cluster(num_hosts=13, devices_per_host=1)))
    assert error.startswith("cluster: the cluster's 13 devices are the default tensor-parallel degree: "
                            "13 ranks but only 12 attention heads")


def test_a_model_config_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "config.json")
    assert _refused(tmp_path, capsys, scenario_dict(model="config.json")).startswith("model.config: not a regular file")


def test_a_variant_streaming_its_weights_counts_as_more_work():
    assert work_units(2, 32, 8, 128, streamed_variants=1) == work_units(1, 32, 8, 128) * 16


def test_a_sweep_of_more_policies_than_colours_is_plotted(tmp_path, capsys):
    # The memory report's palette has 8 colours; 40 lines once raised a KeyError.
    variants = [{"name": f"v{i}", "strategy": "allreduce_ln", "allreduce": "ring"} for i in range(40)]
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(scenario_dict(variants=variants, sweep={"devices": [2]})))
    code, _, stderr = _run(["simulate", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, stderr
    assert (tmp_path / "out" / "memory_report.html").exists()


def test_micro_batches_beyond_a_pipeline_replicas_share_of_the_batch_are_one_line(tmp_path, capsys):
    # 3 sequences over 2 replicas of a 2-stage pipeline: the second replica has 1, too few for 2 micro-batches
    data = scenario_dict(cluster=cluster(num_hosts=4, devices_per_host=1),
                         parallel={"tensor": 1, "pipeline": 2, "replicas": 2, "micro_batches": 2},
                         workload={"batch_size": 3, "prompt_tokens": 8, "output_tokens": 2})
    assert _refused(tmp_path, capsys, data) == ("parallel.micro_batches: more micro-batches than the 1 sequences "
                                                "of replica 1's share of the batch (got 2)")


@pytest.mark.parametrize("layout, why", [
    ({"tensor": 5, "pipeline": 2}, "a pipeline's stages split evenly only"),
    ({"tensor": 5, "data": 2}, "training splits evenly only"),
])
def test_an_uneven_degree_where_only_even_splits_run_names_the_reason(tmp_path, capsys, layout, why):
    # GPT-2's 12 heads: an uneven split would serve 5 ranks, but neither a pipeline nor training takes
    # one, so the refusal must not send the user to parallel.shares
    data = scenario_dict(cluster=cluster(num_hosts=5, devices_per_host=2), parallel=layout)
    if "data" in layout:
        data |= {"workload": {"kind": "training", "global_batch_size": 4, "micro_batch_size": 1,
                              "sequence_length": 16}, "variants": [{"name": "ddp"}]}
    line = _refused(tmp_path, capsys, data)
    assert line.startswith("parallel.tensor: tensor-parallel degree 5 cannot split gpt2 evenly") and why in line
    assert "parallel.shares (compute" not in line
