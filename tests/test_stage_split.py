"""A pipeline's decode step split by stage (validation.stage_split), and a trace.json read back."""

import json
import math

import pandas as pd
import pytest

from sim.outputs import chrome_trace, device_names, read_chrome_trace
from sim.simulate import simulate
from sim.trace import OP_COLUMNS
from tests.conftest import cluster, make_scenario
from validation.stage_split import REST, STEP, split_step, stage_split, stages


def _tp2_pp2():
    scenario = make_scenario(cluster={**cluster(2, 2, device="cpu", nic="100Mbit/s", nic_latency="50us", memory="4GiB"),
                                      "cores": 2},
                             dtype="fp32", parallel={"tensor": 2, "pipeline": 2},
                             workload={"batch_size": 1, "prompt_tokens": 32, "output_tokens": 4},
                             variants=[{"name": "b", "strategy": "reduce_ln_bcast", "reduce": "library",
                                        "broadcast": "library"}])
    result = simulate(scenario)
    return result, result.variants[0].trace


def test_a_trace_json_reads_back_as_the_trace_it_was_written_from():
    result, trace = _tp2_pp2()
    written = json.loads(json.dumps(chrome_trace([("b", trace)], device_names(result.topology, result.ranks))))
    ops, steps = read_chrome_trace(written)
    columns = ["rank", "stream", "kind", "name", "phase", "step", "layer"]
    expected = trace.ops.sort_values(["rank", "start_s"], kind="stable", ignore_index=True)
    ops = ops.sort_values(["rank", "start_s"], kind="stable", ignore_index=True)
    pd.testing.assert_frame_equal(ops[columns], expected[columns].astype({"rank": int, "step": int, "layer": int}),
                                  check_dtype=False)
    assert ops["end_s"].to_numpy() == pytest.approx(expected["end_s"].to_numpy(), abs=1e-9)
    assert steps["step"].tolist() == trace.steps["step"].tolist()
    assert steps["end_s"].to_numpy() == pytest.approx(trace.steps["end_s"].to_numpy(), abs=1e-9)


def test_a_simulated_pipeline_step_splits_into_its_stages_and_hops_which_add_up_to_it():
    result, trace = _tp2_pp2()
    decode = trace.ops[trace.ops["phase"] == "decode"]
    assert stages(decode) == [(0, 1), (2, 3)]
    table = stage_split(trace.ops, trace.steps, trace.ops, trace.steps).set_index("term")
    # the same trace on both sides: the measured terms are the simulated ones
    assert table["measured_mean_s"].to_numpy() == pytest.approx(table["simulated_s"].to_numpy())
    parts = table.drop(index=[STEP, "stage 0 per layer", "stage 1 per layer"])["simulated_s"]
    steady = 4 * (table.loc["stage 0 per layer", "simulated_s"] + table.loc["stage 1 per layer", "simulated_s"])
    assert parts.sum() + steady == pytest.approx(table.loc[STEP, "simulated_s"])
    assert table.loc["hop 0->1", "simulated_s"] > 0
    assert table.loc[REST, "simulated_s"] >= 0


def _op(rank, kind, layer, start_ms, end_ms):
    return dict(zip(OP_COLUMNS, (rank, "compute", kind, kind, "decode", 1, layer, start_ms / 1e3, end_ms / 1e3, 0.0, 0.0)))


def test_split_step_reads_the_first_steady_and_last_layers_and_the_hop():
    ops = pd.DataFrame([_op(0, "embedding", -1, 0, 1),
                        *(_op(0, "qkv_proj", layer, start, start + 1) for layer, start in ((0, 1), (1, 5), (2, 8), (3, 11))),
                        _op(0, "mlp_down", 3, 12, 14), _op(0, "send", -1, 14, 15),
                        *(_op(1, "qkv_proj", layer, start, start + 1) for layer, start in ((4, 16), (5, 20))),
                        _op(1, "lm_head", -1, 21, 30)])
    terms = split_step(ops, 0.031, [(0,), (1,)])
    assert terms["stage 0 first layer"] == pytest.approx(0.005)  # embedding to layer 1's qkv_proj
    assert terms["stage 0 per layer"] == pytest.approx(0.003)
    assert terms["stage 0 last layer"] == pytest.approx(0.003)  # to mlp_down's end: the send is the hop's
    assert terms["hop 0->1"] == pytest.approx(0.002)
    assert math.isnan(terms["stage 1 per layer"])  # two layers: no steady one
    assert terms["stage 1 last layer"] == pytest.approx(0.010)
    assert terms[REST] == pytest.approx(0.001)


def test_a_measured_trace_of_another_layout_is_refused():
    _, trace = _tp2_pp2()
    other = trace.ops.assign(layer=trace.ops["layer"].where(trace.ops["rank"] != 3, trace.ops["layer"] + 100))
    with pytest.raises(ValueError, match="stages"):
        stage_split(trace.ops, trace.steps, other, trace.steps)
