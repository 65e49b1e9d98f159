"""The shared vocabulary and trace: metric names as results.csv writes them, one trace event and
step table, metrics computed from the trace, a collective as the master sees it."""

import math

import numpy as np
import pandas as pd
import pytest

from sim.metrics import peak_memory_bytes, run_metrics
from sim.outputs import results_csv
from sim.profile import MeasurementKind
from sim.simulate import simulate
from sim.trace import OP_COLUMNS, STEP_COLUMNS, Trace, TraceEvent, master_calls, op_table, peak_table, step_table
from sim.vocabulary import Metric, PhaseKind
from tests.conftest import make_scenario
from tests.test_streaming import _streamed


def test_metric_percentiles_keep_the_unit_last():
    assert Metric.TTFT.percentile(10) == "ttft_p10_s"
    assert Metric.DECODE_TOKENS_PER_S.percentile(90) == "decode_tokens_p90_per_s"
    assert [Metric.TTFT.unit, Metric.DECODE_TOKENS_PER_S.unit, Metric.PEAK_MEMORY.unit, Metric.REPEATS.unit] == [
        "s", "tokens/s", "bytes", "count"]


def test_results_csv_names_its_metrics_and_units_as_before():
    result = simulate(make_scenario())
    text = results_csv(result.results)
    rows = pd.read_csv(pd.io.common.StringIO(text))
    assert set(zip(rows["metric"], rows["unit"])) == {
        ("ttft_s", "s"), ("tpot_s", "s"), ("decode_tokens_per_s", "tokens/s"), ("e2e_latency_s", "s"),
        ("loader_stall_prefill_s", "s"), ("loader_stall_decode_s", "s"), ("peak_memory_bytes", "bytes"),
        ("memory_capacity_bytes", "bytes")}
    assert set(result.variants[0].trace.steps["phase"]) == {"prefill", "decode"}


def test_profile_measurement_kinds_are_the_strings_profiles_carry():
    assert [str(k) for k in MeasurementKind] == ["compute", "compute_isolated", "compute_device", "host_issue",
                                                 "device_ceiling", "op_gap", "collective",
                                                 "collective_held_out", "collective_in_place", "collective_wait",
                                                 "collective_loopback", "collective_bridged", "p2p", "reduction",
                                                 "memory_baseline", "context", "backward_input",
                                                 "backward_weight", "optimizer_step", "training_pass"]


def test_the_simulated_trace_has_the_columns_of_a_trace_event():
    trace = simulate(make_scenario()).variants[0].trace
    assert list(trace.ops.columns) == OP_COLUMNS == list(TraceEvent._fields)
    assert list(trace.steps.columns) == STEP_COLUMNS


def test_run_metrics_from_a_step_table():
    # prefill 0-2 s, then three decode steps of 1 s; the ranks waited 0.5 s in the prefill and
    # 0.1, 0.2, 0.3 s in the decode steps
    steps = step_table([0, 2, 3, 4], [2, 3, 4, 5], [0.5, 0.1, 0.2, 0.3])
    assert list(steps["phase"]) == [PhaseKind.PREFILL, PhaseKind.DECODE, PhaseKind.DECODE, PhaseKind.DECODE]
    metrics = run_metrics(Trace(op_table(()), steps, pd.DataFrame()), batch_size=4)
    assert metrics[Metric.TTFT] == 2 and metrics[Metric.TPOT] == 1 and metrics[Metric.DECODE_TOKENS_PER_S] == 4
    assert metrics[Metric.LOADER_STALL_PREFILL] == 0.5
    assert metrics[Metric.LOADER_STALL_DECODE] == pytest.approx(0.2)


def test_a_stall_known_at_some_decode_steps_averages_their_linear_interpolation():
    # the simulator gives the stall of the first and last decode steps only
    steps = step_table(np.arange(6.0), np.arange(1.0, 7.0), [0.0, 1.0, np.nan, np.nan, np.nan, 3.0])
    metrics = run_metrics(Trace(op_table(()), steps, pd.DataFrame()), batch_size=1)
    assert metrics[Metric.LOADER_STALL_DECODE] == 2.0
    single = step_table([0.0], [1.0], [0.25])
    metrics = run_metrics(Trace(op_table(()), single, pd.DataFrame()), batch_size=1)
    assert metrics[Metric.LOADER_STALL_PREFILL] == 0.25 and math.isnan(metrics[Metric.LOADER_STALL_DECODE])


def test_streamed_run_reports_the_stall_of_its_step_table():
    vr = simulate(_streamed(window=1, storage="200MB/s")).variants[0]
    steps = vr.trace.steps
    assert vr.timing[Metric.LOADER_STALL_PREFILL] == steps["stall_s"].iloc[0] > 0
    assert vr.timing[Metric.LOADER_STALL_DECODE] > 0


def test_peak_memory_is_the_higher_of_the_high_water_mark_and_the_samples():
    memory = pd.DataFrame({"rank": [0, 0, 1], "time_s": [0.0, 1.0, 0.0], "bytes": [5.0, 9.0, 4.0]})
    trace = Trace(op_table(()), step_table([0.0], [1.0]), memory, peak_table({0: 7, 1: 6}))
    assert peak_memory_bytes(trace) == {0: 9.0, 1: 6.0}
    result = simulate(make_scenario())
    for vr in result.variants:
        assert peak_memory_bytes(vr.trace) == {r: pytest.approx(b) for r, b in vr.run.peak_bytes.items()}


def test_master_calls_split_the_masters_wait_from_the_rest_of_the_call():
    def call(name, rank, start, end):
        return TraceEvent(rank, "comm", "allreduce", name, "decode", 1, 0, start, end, 1024.0, 0.0)

    ops = op_table([
        call("a", 0, 1.0, 3.0), call("a", 1, 2.0, 3.0),  # the master waits 1 s for rank 1, then 1 s
        call("b", 0, 5.0, 6.0), call("b", 1, 4.0, 6.0),  # the master arrives last: no wait
        call("c", 0, 7.0, 8.0), call("c", 1, 9.0, 9.5),  # the master leaves before rank 1 arrives
    ])
    seen = master_calls(ops).set_index("name")
    assert list(seen["rank"]) == [0, 0, 0]
    assert seen.loc["a", "wait_s"] == 1.0 and seen.loc["a", "call_s"] == 1.0
    assert seen.loc["b", "wait_s"] == 0.0 and seen.loc["b", "call_s"] == 1.0
    assert seen.loc["c", "wait_s"] == 1.0 and seen.loc["c", "call_s"] == 0.0
