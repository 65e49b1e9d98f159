"""Compute priced by its shard shape (issues 18, 20, 21): a calibration's ``compute_isolated`` rows
(ops timed alone at several tensor-parallel widths, runtime/shape_bench.py) price a target's
forward ops by their width and tokens outside same-cluster mode (sim/calibrated.py)."""

from pathlib import Path

import pandas as pd
import pytest

from models.accounting import layer_op_costs
from models.catalog import get_model
from models.ops import OpKind
from sim.calibrated import CalibratedCompute
from sim.cost import RooflineCompute
from sim.plan import Op, Stream
from sim.profile import Profile, load_profile, profile_frame
from sim.scenario import load_scenario
from sim.simulate import simulate
from sim.cluster_config import ClusterConfig
from sim.topology import build_topology
from sim.vocabulary import MeasurementKind
from tests.conftest import cluster

ROOT = Path(__file__).resolve().parent.parent
GPT2 = get_model("gpt2")
ROOFLINE = RooflineCompute("fp32", 0.6, 0.8, 0.0)
DEVICE = build_topology(ClusterConfig.model_validate(cluster(1, 1, device="cpu"))).devices[0]
TOKENS = 32
# Time per roofline second of mlp_up at each measured width: the whole op less efficient per FLOP
RATE = {1: 3.0, 4: 2.0}


def _op(width: int, tokens: int = TOKENS) -> Op:
    cost = layer_op_costs(GPT2, tp_degree=width, batch_size=1, new_tokens=tokens, context_tokens=tokens)[OpKind.MLP_UP]
    return Op(OpKind.MLP_UP, "mlp_up", Stream.COMPUTE, cost=cost, shape=(tokens, tokens))


def _rows() -> list[dict]:
    rows = []
    for width, rate in RATE.items():
        for tokens in (8, TOKENS, 128):
            op = _op(width, tokens)
            rows.append({"measurement": MeasurementKind.COMPUTE_ISOLATED, "device_class": "cpu", "op": "mlp_up",
                         "group_size": width, "batch_size": 1, "new_tokens": tokens, "context_tokens": tokens,
                         "dtype": "fp32", "flops": op.cost.flops, "traffic_bytes": op.traffic_bytes, "unit": "s",
                         "repeats": 5, "method": "synthetic", "median": rate * ROOFLINE.roofline_s(op, DEVICE),
                         "mean": 9.0})  # the median is charged, not the mean
    return rows


def _compute(rows, by_shape: bool = True) -> CalibratedCompute:
    return CalibratedCompute(Profile(profile_frame(rows)), ROOFLINE, model=GPT2, by_shape=by_shape, scale=0.5)


def test_isolated_rows_round_trip(tmp_path):
    path = tmp_path / "profile.csv"
    profile_frame(_rows()).to_csv(path, index=False)
    rows = load_profile(path).of(MeasurementKind.COMPUTE_ISOLATED)
    assert len(rows) == 6 and set(rows["group_size"]) == {1, 4}
    assert sorted(rows["median"]) == pytest.approx(sorted(r["median"] for r in _rows()), rel=1e-12)


def test_a_measured_width_is_priced_from_its_own_rows_without_a_contention_factor():
    compute = _compute(_rows())
    for width, rate in RATE.items():
        op = _op(width)
        assert compute.duration_s(op, DEVICE) == pytest.approx(rate * ROOFLINE.roofline_s(op, DEVICE), rel=1e-9)
    assert not compute.extrapolated


def test_a_width_between_the_measured_ones_is_interpolated_in_width():
    compute = _compute(_rows())
    op = _op(2)  # half the layer: a quarter of the way from width 1/4 to 1 is 1/3 of the way
    rate = RATE[4] + (RATE[1] - RATE[4]) * (0.5 - 0.25) / (1.0 - 0.25)
    assert compute.duration_s(op, DEVICE) == pytest.approx(rate * ROOFLINE.roofline_s(op, DEVICE), rel=1e-3)
    assert not compute.extrapolated
    assert compute.duration_s(_op(6), DEVICE) == pytest.approx(RATE[4] * ROOFLINE.roofline_s(_op(6), DEVICE), rel=1e-3)
    assert any("shard width" in line for line in compute.extrapolated)


# Time per roofline second of a decode step's mlp_up at each batch size timed alone: more rows cost
# more than the roofline's memory-bound time says (benchmarks/bench_decode_rows.py)
DECODE_RATE = {1: 3.0, 2: 5.6, 4: 7.2}


def _decode_op(batch: int, width: int = 1, context: int = 9) -> Op:
    cost = layer_op_costs(GPT2, tp_degree=width, batch_size=batch, new_tokens=1,
                          context_tokens=context)[OpKind.MLP_UP]
    return Op(OpKind.MLP_UP, "mlp_up", Stream.COMPUTE, cost=cost, shape=(1, context))


def _decode_rows(batches) -> list[dict]:
    rows = []
    for batch in batches:
        for width in (1, 4):
            for context in (9, 33):
                op = _decode_op(batch, width, context)
                rows.append({"measurement": MeasurementKind.COMPUTE_ISOLATED, "device_class": "cpu",
                             "op": "mlp_up", "group_size": width, "batch_size": batch, "new_tokens": 1,
                             "context_tokens": context, "dtype": "fp32", "flops": op.cost.flops,
                             "traffic_bytes": op.traffic_bytes, "unit": "s", "repeats": 5, "method": "synthetic",
                             "median": DECODE_RATE[batch] * ROOFLINE.roofline_s(op, DEVICE)})
    return rows


def test_a_decode_op_is_priced_from_the_rows_of_its_batch_size():
    compute = _compute(_decode_rows((1, 2, 4)))
    for batch in (1, 2, 4):
        for width in (1, 4):
            op = _decode_op(batch, width)
            assert compute.duration_s(op, DEVICE) == pytest.approx(
                DECODE_RATE[batch] * ROOFLINE.roofline_s(op, DEVICE), rel=1e-9)
    # the roofline prices 2 rows about as 1 (memory-bound); the batch-2 rows do not
    assert compute.duration_s(_decode_op(2), DEVICE) > 1.8 * compute.duration_s(_decode_op(1), DEVICE)
    assert not compute.extrapolated
    # between two timed batch sizes, linearly in rows
    three = _decode_op(3)
    assert compute.duration_s(three, DEVICE) == pytest.approx(
        (DECODE_RATE[2] + DECODE_RATE[4]) / 2 * ROOFLINE.roofline_s(three, DEVICE), rel=1e-9)
    assert not compute.extrapolated
    # beyond the largest, the largest's time per roofline second, flagged
    eight = _decode_op(8)
    assert compute.duration_s(eight, DEVICE) == pytest.approx(DECODE_RATE[4] * ROOFLINE.roofline_s(eight, DEVICE),
                                                              rel=1e-9)
    assert any("decode batch sizes (1, 2, 4)" in line for line in compute.extrapolated)


def test_a_profile_timing_decode_at_one_batch_size_prices_every_batch_as_before():
    """Batch-1 decode rows alone: a batch-2 op is the batch-1 rows' time per roofline second
    times its roofline (FLOPs scaling, flagged), whatever the new rows of other batch sizes do."""
    old = _compute(_decode_rows((1,)))
    two = _decode_op(2)
    assert old.duration_s(two, DEVICE) == pytest.approx(DECODE_RATE[1] * ROOFLINE.roofline_s(two, DEVICE), rel=1e-9)
    assert any("outside the tokens" in line for line in old.extrapolated)
    new = _compute(_decode_rows((1, 2)))
    assert new.duration_s(_decode_op(1), DEVICE) == old.duration_s(_decode_op(1), DEVICE)
    assert new.duration_s(two, DEVICE) > 1.8 * old.duration_s(two, DEVICE)


def test_without_isolated_rows_or_in_a_replay_the_in_place_rows_price_as_before():
    op = _op(1)
    in_place = [{**row, "measurement": MeasurementKind.COMPUTE, "mean": row["median"]}
                for row in _rows() if row["group_size"] == 1]
    replay = _compute(_rows() + in_place, by_shape=False)
    assert replay.duration_s(op, DEVICE) == pytest.approx(0.5 * RATE[1] * ROOFLINE.roofline_s(op, DEVICE), rel=1e-9)
    old = _compute(in_place)
    assert old.duration_s(op, DEVICE) == replay.duration_s(op, DEVICE)
    # rows timed with another model's shapes say nothing of this one's widths
    other = CalibratedCompute(Profile(profile_frame(_rows() + in_place)), ROOFLINE, model=get_model("qwen2.5-0.5b"),
                              by_shape=True, scale=0.5)
    assert other.duration_s(op, DEVICE) == replay.duration_s(op, DEVICE)


def test_a_shipped_profile_simulates_as_its_report_recorded(monkeypatch):
    """The plan check's pick, priced with its profile (isolated rows: by shape), as the check predicted it."""
    scenario = load_scenario(ROOT / "validation/plan-check-report/scenarios/c0.yaml")
    profile = load_profile(ROOT / "validation/plan-check/profile_v2x2_bandwidth.csv")
    recorded = pd.read_csv(ROOT / "validation/plan-check-report/candidates.csv").set_index("candidate").loc[0]
    results = simulate(scenario, profile=profile, expand_steps=()).results
    values = results[results["device"].isna() | (results["device"] == "")].set_index("metric")["value"]
    assert values["ttft_s"] == recorded["predicted_ttft_s"]
    assert values["tpot_s"] == recorded["predicted_tpot_s"]
    # the same profile without its isolated rows prices the pick as older profiles do: differently
    older = Profile(profile.rows[profile.rows["measurement"] != MeasurementKind.COMPUTE_ISOLATED])
    results = simulate(scenario, profile=older, expand_steps=()).results
    values = results[results["device"].isna() | (results["device"] == "")].set_index("metric")["value"]
    assert values["ttft_s"] != recorded["predicted_ttft_s"]
    # the offline benches' --no-by-shape (sim.simulate.BY_SHAPE) prices it as that profile does
    from sim import simulate as simulate_module

    monkeypatch.setattr(simulate_module, "BY_SHAPE", False)
    switched = simulate(scenario, profile=profile, expand_steps=()).results
    assert switched.set_index(["metric", "device"])["value"].equals(results.set_index(["metric", "device"])["value"])


def test_calibration_times_every_op_at_each_even_width_up_to_its_ranks():
    torch = pytest.importorskip("torch")
    from models.spec import ModelSpec
    from runtime.shape_bench import shape_rows

    spec = ModelSpec(name="gpt2-tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4,
                     intermediate_size=256, vocab_size=256, norm="layernorm", mlp="plain", tied_embeddings=True,
                     attention_bias=True, linear_bias=True, learned_position_embeddings=True,
                     max_position_embeddings=32, dtype="fp32")
    rows = pd.DataFrame(shape_rows(spec, device_class="cpu", batch_size=1, prompts=(4, 8), max_tokens=12, ranks=4,
                                   dtype=torch.float32, device=torch.device("cpu")))
    assert set(rows["group_size"]) == {1, 2, 4}  # 3 does not divide the 4 heads
    assert set(rows[rows["group_size"] == 1]["op"]) == {str(k) for k in OpKind if k in (
        OpKind.EMBEDDING, OpKind.LAYERNORM, OpKind.QKV_PROJ, OpKind.ATTENTION, OpKind.OUT_PROJ, OpKind.MLP_UP,
        OpKind.MLP_DOWN, OpKind.LM_HEAD)}
    assert set(zip(rows["new_tokens"], rows["context_tokens"])) == {(4, 4), (1, 5), (8, 8), (1, 9)}
    # prefill at the scenario's batch, decode at each of decode_batch_sizes (a plan's replicas split a batch)
    assert set(rows[rows["new_tokens"] > 1]["batch_size"]) == {1}
    assert set(rows[rows["new_tokens"] == 1]["batch_size"]) == {1, 2, 4}
    head = rows[(rows["op"] == "lm_head") & (rows["new_tokens"] == 1) & (rows["context_tokens"] == 9)]
    assert sorted(head["flops"]) == [b * head["flops"].min() for b in (1, 2, 4)]
    up = rows[(rows["op"] == "mlp_up") & (rows["group_size"] == 2) & (rows["new_tokens"] == 8)].iloc[0]
    assert up["flops"] == layer_op_costs(spec, tp_degree=2, batch_size=1, new_tokens=8,
                                         context_tokens=8)[OpKind.MLP_UP].flops
    assert (rows["median"] > 0).all() and (rows["measurement"] == MeasurementKind.COMPUTE_ISOLATED).all()


def test_decode_is_timed_at_one_two_four_and_the_powers_of_two_up_to_the_scenario_batch():
    pytest.importorskip("torch")
    from runtime.shape_bench import decode_batch_sizes

    assert decode_batch_sizes(1) == (1, 2, 4)
    assert decode_batch_sizes(6) == (1, 2, 4, 6)
    assert decode_batch_sizes(32) == (1, 2, 4, 8, 16, 32)


def test_the_isolated_ops_read_enough_layers_in_turn_that_their_weights_come_from_memory():
    pytest.importorskip("torch")
    from models.catalog import get_model
    from runtime.shape_bench import CACHE_MULTIPLE, cycled_layers

    spec = get_model("gpt2")
    layer_bytes = {w: sum(c.weight_bytes for c in layer_op_costs(spec, tp_degree=w, batch_size=1, new_tokens=1,
                                                                context_tokens=1).values()) for w in (1, 2, 4)}
    cache = 32 << 20
    for width, size in layer_bytes.items():
        layers = cycled_layers(spec, width, cache)
        # between two calls of a layer's op, the other layers' shards overflow the cache
        assert (layers - 1) * size >= CACHE_MULTIPLE * cache or layers == spec.num_layers
        assert 1 < layers <= spec.num_layers
    assert cycled_layers(spec, 4, 32 << 20) > cycled_layers(spec, 1, 32 << 20)  # a narrower shard, more layers
    assert cycled_layers(spec, 1, 1 << 10) == 2  # a shard larger than the cache: one other layer evicts it
    assert cycled_layers(spec, 4, 1 << 40) == spec.num_layers  # never more than the model has
