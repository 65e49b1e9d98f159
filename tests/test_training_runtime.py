"""The training runtime: real DDP on 2 and 4 gloo ranks on loopback ends every gradient-averaging
variant (bucket sizes, accumulation with and without no_sync, checkpointing, hetsim schedules in
the comm hook, no overlap, compression, ZeRO-1) with the parameters of one process stepping on the
whole global batch; parameter averaging ends with its own single-process reference; hetsim
measure writes the training metrics and a trace of buckets."""

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

torch = pytest.importorskip("torch")

from models.errors import ConfigError  # noqa: E402
from models.ops import OpKind  # noqa: E402
from models.shards import tensor_shards  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.reduction_bench import REDUCTION_SIZES  # noqa: E402
from runtime.training.calibrate import PASS_CALLS_PER_ROUND, calibrate_training  # noqa: E402
from runtime.training.hooks import BucketCall  # noqa: E402
from runtime.training.measure import measure_training, step_metrics  # noqa: E402
from runtime.training.model import DecoderLM, TensorParallel, next_token_loss, training_batch  # noqa: E402
from runtime.training.ranks import training_ranks  # noqa: E402
from runtime.training.reference import local_sgd_reference, reference_parameters, reference_shard  # noqa: E402
from runtime.training.trainer import StepTiming, Trainer, TrainingSetup, process_groups  # noqa: E402
from sim.collectives.registry import AUTO, known_algorithms  # noqa: E402
from sim.context import profile_contexts  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.scenario import scenario_from_dict  # noqa: E402
from sim.topology import build_topology  # noqa: E402
from sim.training.simulate import simulate_training  # noqa: E402
from sim.vocabulary import MeasurementKind  # noqa: E402
from tests.conftest import ROOT, cluster, run_cli, tiny_model_config  # noqa: E402
from validation.cli import main  # noqa: E402
from validation.memory_fit import check_memory_fits  # noqa: E402

SEED = 3
STEPS = 2
CLUSTERS = {2: cluster(2, 1, device="cpu"), 4: cluster(2, 2, device="cpu")}
SMALL_BUCKETS = {"bucket_cap_mb": 0.02, "first_bucket_mb": 0.005}  # several buckets of the tiny models
HOOK_ALGORITHMS = tuple(a for a in known_algorithms(OpKind.ALLREDUCE) if a != AUTO)
"""Every allreduce the comm hook runs: the backend's own and each schedule of the registry."""


def _scenario(tmp_path: Path, model_type: str, data: int, training: dict, variants: list[dict], *,
              global_batch: int = 8, steps: int = STEPS, tensor: int = 1):
    path = tmp_path / f"{model_type}.config.json"
    path.write_text(json.dumps(tiny_model_config(model_type, num_layers=2)))
    return scenario_from_dict({
        "name": "train_test", "model": str(path), "dtype": "fp32", "cluster": CLUSTERS[data] if tensor == 1 else cluster(data, tensor, device="cpu"),
        "parallel": {"data": data, "tensor": tensor},
        "workload": {"kind": "training", "global_batch_size": global_batch, "micro_batch_size": global_batch // data,
                     "sequence_length": 16, "steps": steps},
        "training": training, "variants": variants}, base_dir=ROOT)


def _train(scenario, steps: int = STEPS):
    """Every variant trained ``steps`` steps on every rank: [rank][variant] -> (parameters, step timings)."""
    topology = build_topology(scenario.config.cluster)
    layout = training_ranks(scenario, topology)

    def body(rank, heartbeat):
        out = []
        groups = process_groups(layout, rank)
        for variant in scenario.config.variants:
            trainer = Trainer(TrainingSetup.of_ranks(scenario, variant, layout), rank, topology.host_groups, seed=SEED,
                              groups=groups)
            timings = [trainer.step(step) for step in range(steps)]
            trainer.close()
            out.append((trainer.parameters(), timings))
        return out

    def gather(rank, heartbeat):
        import torch.distributed as dist

        mine = body(rank, heartbeat)
        every = [None] * len(layout.ranks)
        dist.all_gather_object(every, mine)
        return every

    return launch(gather, len(layout.ranks), hang_timeout_s=120)[0]


def _assert_same(got: dict, expected: dict, atol: float, label: str) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=f"{label}: {name}")


def _check_against_reference(scenario, atol: float) -> list:
    """Every rank's parameters after :data:`STEPS` steps equal its part (its tensor-parallel
    shard) of the single-process reference's."""
    ranks = _train(scenario)
    layout = training_ranks(scenario, build_topology(scenario.config.cluster))
    for index, variant in enumerate(scenario.config.variants):
        setup = TrainingSetup.of_ranks(scenario, variant, layout)
        expected = reference_parameters(setup, STEPS, SEED)
        for rank, per_variant in enumerate(ranks):
            _assert_same(per_variant[index][0], reference_shard(setup, expected, rank), atol,
                         f"{variant.name} rank {rank}")
    return ranks


def test_two_ranks_average_gradients_as_one_process_over_the_global_batch(tmp_path):
    scenario = _scenario(tmp_path, "gpt2", 2, {"optimizer": "sgd", "allreduce": "library"}, [
        {"name": "library"},
        {"name": "ring_small_buckets", "training": {"allreduce": "ring", **SMALL_BUCKETS}},
        {"name": "rd_no_sync_checkpointed", "training": {"allreduce": "recursive_doubling", "gradient_accumulation": 2,
                                                         "activation_checkpointing": 1}},
        {"name": "naive_accumulation_views", "training": {"gradient_accumulation": 2, "no_sync": False,
                                                          "gradient_as_bucket_view": True, **SMALL_BUCKETS}},
        {"name": "no_overlap", "training": {"overlap": False, "allreduce": "star", **SMALL_BUCKETS}},
        {"name": "zero1", "training": {"zero": 1}},
    ])
    ranks = _check_against_reference(scenario, atol=1e-6)
    buckets = [len(timing.buckets) for timing in ranks[0][1][1]]
    assert buckets[-1] > 1  # small buckets: several allreduces per step
    no_overlap = ranks[0][4][1][-1].buckets
    assert min(b.start_s for b in no_overlap) >= max(b.ready_s for b in no_overlap)


def test_four_ranks_on_two_hosts_run_every_allreduce_of_the_registry_in_the_hook_as_one_process(tmp_path):
    """One launch: each allreduce the comm hook accepts (every algorithm of the collectives
    registry but ``auto``) with adamw, with accumulation, checkpointing and ZeRO-1 on some, and
    both compressions over hetsim schedules (with SGD: Adam's first steps take the sign of a
    gradient, which rounding can flip where it is near zero)."""
    combined = [
        {"name": "library", "training": {"allreduce": "library"}},
        {"name": "two_level_rs_no_sync_checkpointed", "training": {"allreduce": "two_level_rs",
                                                                   "gradient_accumulation": 2,
                                                                   "activation_checkpointing": 2}},
        {"name": "recursive_doubling_zero1", "training": {"allreduce": "recursive_doubling", "zero": 1}},
    ]
    compressed = [
        {"name": "bf16_rabenseifner", "training": {"allreduce": "rabenseifner", "gradient_compression": "bf16",
                                                   "optimizer": "sgd"}},
        {"name": "fp16_two_level_tree", "training": {"allreduce": "two_level_tree", "gradient_compression": "fp16",
                                                     "optimizer": "sgd"}},
    ]
    covered = {variant["training"]["allreduce"] for variant in combined}
    plain = [{"name": algorithm, "training": {"allreduce": algorithm}} for algorithm in HOOK_ALGORITHMS
             if algorithm not in covered]
    scenario = _scenario(tmp_path, "llama", 4, {"optimizer": "adamw", "allreduce": "ring", **SMALL_BUCKETS},
                         plain + combined + compressed)
    uncompressed = scenario.config.variants[:len(plain) + len(combined)]
    assert {scenario.training_settings(v).allreduce for v in uncompressed} == set(HOOK_ALGORITHMS)
    # measured once: bf16 over rabenseifner 3.2e-6 off, fp16 over two_level_tree 0.4e-6, double_binary_tree 2.2e-6
    ranks = _check_against_reference(scenario, atol=1e-5)
    for index, variant in enumerate(scenario.config.variants):  # several buckets through the hook in every step
        for per_variant in ranks:
            calls = [timing.buckets for timing in per_variant[index][1]]
            assert all(len(buckets) > 1 for buckets in calls), variant.name
    parameters = sum(p.numel() for p in ranks[0][0][0].values())
    for index in range(len(scenario.config.variants) - len(compressed), len(scenario.config.variants)):
        assert sum(b.size_bytes for b in ranks[0][index][1][-1].buckets) == 2 * parameters  # two bytes a gradient


def test_compressed_gradients_match_within_their_precision(tmp_path):
    scenario = _scenario(tmp_path, "gpt2", 2, {"optimizer": "sgd", "allreduce": "ring"}, [
        {"name": "fp16_ring", "training": {"gradient_compression": "fp16"}},
        {"name": "bf16_library", "training": {"gradient_compression": "bf16", "allreduce": "library"}},
        {"name": "bf16_mixed_fp16_rd", "training": {"gradient_compression": "fp16", "precision": "bf16_mixed",
                                                    "allreduce": "recursive_doubling"}},
    ])
    ranks = _check_against_reference(scenario, atol=2e-5)
    fp16, bf16 = ranks[0][0][1][0].buckets, ranks[0][1][1][0].buckets
    parameters = sum(p.numel() for p in ranks[0][0][0].values())
    # Each gradient travels once per step, in two bytes.
    assert sum(b.size_bytes for b in fp16) == sum(b.size_bytes for b in bf16) == 2 * parameters


def test_bf16_mixed_trains_bf16_copies_of_fp32_masters_with_fp32_buckets_as_one_process(tmp_path):
    # Megatron's bf16_mixed: every variant ends where one process stepping the same scheme on the
    # whole batch ends, and each gradient travels once per step in fp32.
    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "sgd", "allreduce": "ring", "precision": "bf16_mixed",
                                               **SMALL_BUCKETS}, [
        {"name": "ring"},
        {"name": "no_sync_checkpointed", "training": {"gradient_accumulation": 2, "activation_checkpointing": 1}},
        {"name": "library_views_no_overlap", "training": {"allreduce": "library", "gradient_as_bucket_view": True,
                                                          "overlap": False}},
        {"name": "local_sgd", "training": {"averaging": "parameters", "averaging_period": 1}},
    ])
    ranks = _train(scenario)
    layout = training_ranks(scenario, build_topology(scenario.config.cluster))
    for index, variant in enumerate(scenario.config.variants[:3]):
        expected = reference_parameters(TrainingSetup.of_ranks(scenario, variant, layout), STEPS, SEED)
        for rank, per_variant in enumerate(ranks):
            _assert_same(per_variant[index][0], expected, 1e-5, f"{variant.name} rank {rank}")
            parameters = sum(p.numel() for p in per_variant[index][0].values())
            assert sum(b.size_bytes for b in per_variant[index][1][-1].buckets) == 4 * parameters
    replicas = local_sgd_reference(TrainingSetup.of_ranks(scenario, scenario.config.variants[3], layout), STEPS, SEED)
    for rank, per_variant in enumerate(ranks):
        _assert_same(per_variant[3][0], replicas[rank], 1e-5, f"local_sgd rank {rank}")


def test_bf16_copies_compute_in_bf16_and_accumulate_gradients_in_fp32(tmp_path):
    from models.catalog import load_hf_config
    from runtime.training.precision import Bf16Copies

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(tiny_model_config("llama", num_layers=1)))
    model = DecoderLM(load_hf_config(path), SEED)
    copies = Bf16Copies(model)
    assert copies.copy_bytes() == 2 * sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 9), generator=generator) for _ in range(2)]

    def backward(tokens):
        logits = model(tokens[:, :-1])
        assert logits.dtype == torch.bfloat16  # the kernels read the bf16 copies
        next_token_loss(logits, tokens[:, 1:]).backward()

    alone = []
    for tokens in batches:
        model.zero_grad(set_to_none=True)
        backward(tokens)
        alone.append(model.lm_head.grad.clone())
    model.zero_grad(set_to_none=True)
    for tokens in batches:  # two micro-batches: the second's gradient added to the first's in fp32
        backward(tokens)
    fp32_sum = alone[0] + alone[1]
    assert model.lm_head.grad.dtype == torch.float32 and torch.equal(model.lm_head.grad, fp32_sum)
    assert not torch.equal(fp32_sum, fp32_sum.to(torch.bfloat16).float())  # a bf16 sum would differ
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.001)
    copies.refresh()  # after the step: the masters copied into the bf16 copies
    for p in model.parameters():
        assert p.dtype == torch.float32
        assert p.compute_copy.dtype == torch.bfloat16 and torch.equal(p.compute_copy, p.detach().to(torch.bfloat16))


def test_a_calibration_times_bf16_mixeds_ops_on_the_bf16_copies_and_then_takes_them_off(tmp_path):
    """As the trainer runs them: bf16 inputs and kernels without autocast, each weight's gradient
    cast to its fp32 parameter's dtype; the next precision timed on the same model reads fp32."""
    from models.catalog import load_hf_config
    from models.training import Precision
    from runtime.training.calibrate import op_cases
    from runtime.training.precision import computing_in

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(tiny_model_config("llama", num_layers=1)))
    model = DecoderLM(load_hf_config(path), SEED)
    cpu = torch.device("cpu")
    with computing_in(model, Precision.BF16_MIXED):
        for kind, (forward, _, weight_grad) in op_cases(model, 2, 8, Precision.BF16_MIXED, cpu).items():
            assert forward().dtype == torch.bfloat16, kind
            if weight_grad is not None:
                assert all(g.dtype == torch.float32 for g in weight_grad()), kind
    assert not any(hasattr(p, "compute_copy") for p in model.parameters())
    forward = op_cases(model, 2, 8, Precision.FP32, cpu)[OpKind.MLP_DOWN][0]
    assert forward().dtype == torch.float32


@pytest.mark.parametrize("allreduce", ["ring", "library"])
def test_parameter_averaging_matches_local_sgd_in_one_process(tmp_path, allreduce):
    steps = 3
    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "adamw", "allreduce": allreduce,
                                               "averaging": "parameters", "averaging_period": 2},
                         [{"name": "local_sgd"}], steps=steps)
    ranks = _train(scenario, steps)
    replicas = local_sgd_reference(TrainingSetup.of(scenario, scenario.config.variants[0], (0, 1)), steps, SEED)
    for rank, per_variant in enumerate(ranks):
        parameters, timings = per_variant[0]
        _assert_same(parameters, replicas[rank], 1e-5, f"rank {rank}")
        assert [t.averaging is not None for t in timings] == [False, True, False]
        assert all(not t.buckets for t in timings)  # gradients stay local
    # The third step was local: the replicas differ again, so the comparison above is per replica.
    assert any(not torch.allclose(replicas[0][n], replicas[1][n]) for n in replicas[0])


def test_measure_writes_training_metrics_and_a_trace_of_buckets(tmp_path):
    scenario = _scenario(tmp_path, "gpt2", 2, {"optimizer": "adamw", "allreduce": "ring", **SMALL_BUCKETS}, [
        {"name": "ring"},
        {"name": "local_sgd", "training": {"averaging": "parameters", "averaging_period": 1}},
        {"name": "views", "training": {"gradient_as_bucket_view": True}},
        {"name": "bf16_mixed", "training": {"precision": "bf16_mixed"}},
    ], steps=1)
    result = measure_training(scenario, repeats=1, warmup=1, seed=SEED)
    rows = result.results
    ring = rows[rows["variant"] == "ring"].set_index("metric")["value"]
    for metric in ("step_time_s", "samples_per_s", "tokens_per_s", "forward_s", "backward_s", "optimizer_s",
                   "exposed_communication_s", "step_time_p90_s"):
        assert ring[metric] > 0, metric
    assert 0 <= ring["overlap_ratio"] <= 1
    assert ring["samples_per_s"] == pytest.approx(8 / ring["step_time_s"])
    assert set(rows[rows["metric"] == "peak_memory_bytes"]["device"]) == {"h0/dev0", "h1/dev0"}
    assert "overlap_ratio" not in set(rows[rows["variant"] == "local_sgd"]["metric"])
    ops = result.variants[0].trace.ops
    buckets = ops[ops["name"].str.startswith("bucket")]
    parameters = 4 * sum(p.numel() for p in DecoderLM(scenario.model, 0).parameters())
    assert set(buckets["stream"]) == {"comm"} and set(buckets["rank"]) == {0, 1}
    assert buckets[buckets["rank"] == 0]["bytes"].sum() == parameters  # every gradient reduced once
    assert set(ops["kind"]) == {"forward", "backward", "optimizer_step", "allreduce"}
    averaged = result.variants[1].trace.ops
    assert list(averaged[averaged["stream"] == "comm"]["name"].unique()) == ["parameter average"]
    # Memory by category beside the peak, per device: the tensors counted, the rest read.
    for device, memory in rows[rows["variant"] == "ring"].groupby("device"):
        if not device:
            continue
        memory = memory.set_index("metric")["value"]
        categories = memory[memory.index.str.startswith("peak_memory_") & (memory.index != "peak_memory_bytes")]
        assert memory["peak_memory_weights_bytes"] == parameters
        assert memory["peak_memory_gradients_bytes"] == parameters == memory["peak_memory_bucket_buffers_bytes"]
        assert memory["peak_memory_optimizer_states_bytes"] == 2 * parameters  # AdamW's two fp32 moments
        assert memory["peak_memory_framework_bytes"] > 50e6  # torch alone holds more
        assert memory["peak_memory_activations_bytes"] > 0
        assert categories.sum() == memory["peak_memory_bytes"]
        assert memory["tcp_retransmitted_segments_per_step"] >= 0  # the host's TCP losses beside its timings
    # Gradients that are views into DDP's buckets: the buckets are the gradients, nothing beside them.
    views = rows[(rows["variant"] == "views") & (rows["device"] == "h0/dev0")].set_index("metric")["value"]
    assert views["peak_memory_gradients_bytes"] == parameters and views["peak_memory_bucket_buffers_bytes"] == 0
    # Megatron's bf16_mixed: bf16 weights, fp32 gradients and buckets, fp32 masters beside AdamW's moments.
    mixed = rows[(rows["variant"] == "bf16_mixed") & (rows["device"] == "h0/dev0")].set_index("metric")["value"]
    assert mixed["peak_memory_weights_bytes"] == parameters / 2
    assert mixed["peak_memory_gradients_bytes"] == parameters == mixed["peak_memory_bucket_buffers_bytes"]
    assert mixed["peak_memory_optimizer_states_bytes"] == 3 * parameters


def test_interleaved_measurement_times_the_variants_in_turn_on_one_clock(tmp_path):
    # What a validation compares (overlap on and off) timed over the same stretch of the machine:
    # one step of each in turn, every variant's memory still read in ranks of its own.
    scenario = _scenario(tmp_path, "gpt2", 2, {"optimizer": "adamw", "allreduce": "ring", **SMALL_BUCKETS}, [
        {"name": "overlap"}, {"name": "no_overlap", "training": {"overlap": False}}], steps=1)
    result = measure_training(scenario, repeats=2, warmup=1, seed=SEED, interleave=True)
    rows = result.results
    for name in ("overlap", "no_overlap"):
        values = rows[(rows["variant"] == name) & (rows["device"] == "h0/dev0")].set_index("metric")["value"]
        assert values["peak_memory_bytes"] > 0 and values["peak_memory_optimizer_states_bytes"] > 0
    spans = []
    for variant in result.variants:  # the trace holds each variant's last repeat, on the common clock
        ops = variant.trace.ops
        ops = ops[ops["rank"] == 0]
        spans.append((float(ops["start_s"].min()), float(ops["end_s"].max())))
    (first_start, first_end), (second_start, second_end) = spans
    assert first_end <= second_start  # the second variant's last step follows the first's
    assert second_start - first_start < 2 * (first_end - first_start) + 1.0  # in the same round, not a block later


def test_measure_reads_a_steps_peak_as_the_resident_memory_plus_the_tensors_it_holds():
    # The validation model (tiny_gpt2, 4.3M parameters) on one rank, 4 x 128 tokens (2.1M logits):
    # its step peaks in the loss's backward, before any gradient exists, holding what autograd
    # saved and two fp32 gradients of the logits' shape (models.training.loss_backward_bytes).
    # Read after the timed steps, as it was, the peak also counted the heap chunks the fast
    # allocator's steps had freed (+3 MB here, 2.5-31 MB over 4 ranks: runtime.training.memory).
    scenario = scenario_from_dict({
        "name": "memory_test", "model": "scenarios/validation/models/tiny_gpt2.json", "dtype": "fp32",
        "cluster": cluster(1, 1, device="cpu"), "parallel": {"data": 1},
        "workload": {"kind": "training", "global_batch_size": 4, "micro_batch_size": 4, "sequence_length": 128,
                     "steps": 1},
        "training": {"optimizer": "adamw", "allreduce": "ring"}, "variants": [{"name": "adamw"}]}, base_dir=ROOT)
    model = DecoderLM(scenario.model, SEED)
    tokens = training_batch(scenario.model, 4, 128, SEED, 0)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
    held = sum(n for ptr, n in saved.items() if ptr not in parameters) + 2 * 4 * tokens[:, 1:].numel() * 4096
    del loss
    rows = measure_training(scenario, repeats=1, warmup=1, seed=SEED).results
    memory = rows[rows["device"] == "h0/dev0"].set_index("metric")["value"]
    read = memory["peak_memory_activations_bytes"] + memory["peak_memory_gradients_bytes"]  # the peak over the resident
    # 1.5 MB: alone this reads within 4 kB, after the rest of the suite in one process within 0.7 MB
    # (heap pages of earlier tests); the old order read 3.0-4.1 MB over.
    assert read == pytest.approx(held, abs=1.5e6)


def test_measure_runs_tensor_parallel_training_on_every_rank_of_the_layout(tmp_path):
    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "adamw", "allreduce": "ring", **SMALL_BUCKETS},
                         [{"name": "ring"}], steps=1, tensor=2)
    check_memory_fits(scenario)
    result = measure_training(scenario, repeats=1, warmup=1, seed=SEED)
    ring = result.results.set_index("metric")["value"]
    for metric in ("step_time_s", "forward_s", "backward_s", "optimizer_s", "exposed_communication_s"):
        assert ring[metric] > 0, metric
    assert set(result.results[result.results["metric"] == "peak_memory_bytes"]["device"]) == {
        "h0/dev0", "h0/dev1", "h1/dev0", "h1/dev1"}
    ops = result.variants[0].trace.ops
    buckets = ops[ops["name"].str.startswith("bucket")]
    assert set(buckets["rank"]) == {0, 1, 2, 3}
    layout = training_ranks(scenario, build_topology(scenario.config.cluster))
    shard = tensor_shards(scenario.model, 2)[0]
    parameters = 4 * sum(p.numel() for p in DecoderLM(scenario.model, 0, tensor_parallel=TensorParallel(shard, None))
                         .parameters())
    assert layout.data_group(1) == (1, 3)
    assert buckets[buckets["rank"] == 0]["bytes"].sum() == parameters  # the shard's gradients, reduced once


@pytest.mark.parametrize("training, field", [
    ({"allreduce": "auto"}, "training.allreduce"),
    ({"zero": 1, "averaging": "parameters", "averaging_period": 2}, "training.zero"),
    ({"zero": 1, "precision": "bf16_mixed"}, "training.zero"),  # its fp32 masters are not sharded
])
def test_what_the_runtime_cannot_run_is_refused_naming_the_field(tmp_path, training, field):
    scenario = _scenario(tmp_path, "gpt2", 2, training, [{"name": "v"}])
    with pytest.raises(ConfigError) as caught:
        measure_training(scenario)
    assert caught.value.field == field


def test_tensor_parallel_shards_match_the_reference_with_data_parallelism_across_them(tmp_path):
    # TP 2 x DP 2 on 4 ranks: ranks 0 and 1 are replica 0's shards (one KV head each of the tiny
    # Llama's 2, half the gated MLP), ranks 0 and 2 a data-parallel group.
    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "sgd", "allreduce": "ring", **SMALL_BUCKETS}, [
        {"name": "ring"},
        {"name": "library", "training": {"allreduce": "library"}},
        {"name": "rd_no_sync_checkpointed", "training": {"allreduce": "recursive_doubling", "gradient_accumulation": 2,
                                                         "activation_checkpointing": 1}},
        {"name": "zero1_no_overlap", "training": {"zero": 1, "overlap": False}},
    ], tensor=2)
    ranks = _check_against_reference(scenario, atol=1e-6)
    parameters = [ranks[r][0][0] for r in range(4)]
    # q of 4 of the 8 heads, k and v of 1 of the 2 KV heads, of head_dim 8: half the fused rows.
    assert parameters[0]["layers.0.qkv_proj.weight"].shape == parameters[1]["layers.0.qkv_proj.weight"].shape == (
        (4 + 1 + 1) * 8, 64)
    assert not torch.equal(parameters[0]["layers.0.qkv_proj.weight"], parameters[1]["layers.0.qkv_proj.weight"])
    torch.testing.assert_close(parameters[0]["embed"], parameters[1]["embed"], rtol=0, atol=0)  # replicated
    torch.testing.assert_close(parameters[0]["layers.0.qkv_proj.weight"], parameters[2]["layers.0.qkv_proj.weight"],
                               rtol=0, atol=0)  # data-parallel replicas agree
    # The buckets hold a shard's gradients: half the layers' weights, all the replicated tensors.
    bucket_bytes = sum(b.size_bytes for b in ranks[0][0][1][-1].buckets)
    assert bucket_bytes == 4 * sum(p.numel() for p in parameters[0].values())


def test_tensor_parallel_alone_matches_the_reference_with_adamw(tmp_path):
    # TP 2 x DP 1 of GPT-2 (tied embeddings, learned positions, biases: the row-parallel ones added
    # once, after the reduction).
    scenario = _scenario(tmp_path, "gpt2", 1, {"optimizer": "adamw"}, [
        {"name": "adamw"}, {"name": "checkpointed", "training": {"activation_checkpointing": 1}}], tensor=2)
    _check_against_reference(scenario, atol=2e-5)


def test_tensor_parallel_bf16_autocast_and_compressed_buckets_match_within_their_precision(tmp_path):
    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "sgd", "allreduce": "ring"}, [
        {"name": "bf16_mixed", "training": {"precision": "bf16_mixed"}},  # the TP allreduces carry bf16
        {"name": "fp16_buckets", "training": {"gradient_compression": "fp16"}},
    ], tensor=2)
    _check_against_reference(scenario, atol=2e-5)


def test_parameter_averaging_with_tensor_parallelism_matches_local_sgd_shards(tmp_path):
    steps = 3
    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "sgd", "allreduce": "library",
                                               "averaging": "parameters", "averaging_period": 2},
                         [{"name": "local_sgd"}], steps=steps, tensor=2)
    ranks = _train(scenario, steps)
    setup = TrainingSetup.of(scenario, scenario.config.variants[0], (0, 2), tensor=2)
    replicas = local_sgd_reference(setup, steps, SEED)
    for rank, per_variant in enumerate(ranks):
        _assert_same(per_variant[0][0], reference_shard(setup, replicas[rank // 2], rank), 1e-6, f"rank {rank}")


@pytest.mark.parametrize("parallel, field, message", [
    ({"data": 1, "tensor": 4}, "parallel.tensor", "whole key-value heads"),  # 2 KV heads
    ({"data": 3, "tensor": 2}, "parallel.data", "exceeds the cluster's 4 devices"),
])
def test_a_layout_the_training_runtime_cannot_run_is_refused_naming_the_field(tmp_path, parallel, field, message):
    document = _scenario(tmp_path, "llama", 2, {}, [{"name": "v"}], tensor=2).config.model_dump(mode="json",
                                                                                                by_alias=True)
    document["parallel"] = parallel
    scenario = scenario_from_dict(document, base_dir=ROOT)
    with pytest.raises(ConfigError, match=message) as caught:
        training_ranks(scenario, build_topology(scenario.config.cluster))
    assert caught.value.field == field


def test_a_tensor_parallel_calibration_times_the_shard_and_both_groups_allreduces_and_prices_the_step(tmp_path):
    from models.accounting import layer_op_costs
    from models.training import layer_backward_costs
    from sim.profile import Profile

    scenario = _scenario(tmp_path, "llama", 2, {"optimizer": "sgd", "allreduce": "ring"}, [{"name": "ddp"}],
                         tensor=2)
    profile = Profile(calibrate_training(scenario, repeats=1, max_call_s=0.05))
    spec, sequence = scenario.model, scenario.config.workload.sequence_length
    micro = scenario.config.workload.micro_batch_size
    forward = layer_op_costs(spec, tp_degree=2, batch_size=micro, new_tokens=sequence, context_tokens=sequence)
    backward = layer_backward_costs(spec, tp_degree=2, batch_size=micro, sequence_length=sequence)
    for measurement, flops in [(MeasurementKind.COMPUTE, forward["mlp_down"].flops),
                               (MeasurementKind.BACKWARD_WEIGHT, backward["mlp_down"].weight_grad.flops)]:
        rows = profile.of(measurement)
        row = rows[rows["op"] == "mlp_down"].iloc[0]
        assert row["flops"] == flops and row["group_size"] == 2, measurement  # the 2-way shard's op
    passes = profile.of(MeasurementKind.TRAINING_PASS)
    assert set(passes["op"]) == {"forward", "backward"} and (passes["group_size"] == 2).all()
    sweep = profile.of(MeasurementKind.COLLECTIVE)
    hidden = micro * sequence * spec.hidden_size * 4
    tensor_parallel = sweep[sweep["num_hosts"] == 1]  # a replica's 2 ranks share a host
    # f and g call dist.all_reduce: gloo's own, the default of a CPU tensor-parallel allreduce
    assert set(tensor_parallel["algorithm"]) == {"library"} and (tensor_parallel["group_size"] == 2).all()
    assert hidden in set(tensor_parallel["size_bytes"]) and tensor_parallel["size_bytes"].max() == hidden
    buckets = sweep[sweep["num_hosts"] == 2]  # a data-parallel group spans the 2 hosts
    assert set(buckets["algorithm"]) == {"ring"} and not buckets.empty

    calibrated = simulate_training(scenario, profile)
    assert any(line.startswith("tensor-parallel layer ops (2-way shard): compute and backward rows timed at tensor 2")
               and "scaled" not in line for line in calibrated.sources)
    assert any(line.startswith(f"tensor-parallel allreduce library over 2 ranks on 1 hosts at {hidden} bytes: collective "
                               "rows") and "the size itself timed" in line for line in calibrated.sources)
    assert not any("outside the calibrated shapes" in line and "mlp_down" in line for line in calibrated.extrapolated)
    step = calibrated.variants[0].metrics["step_time_s"]
    assert step > 0 and step != simulate_training(scenario).variants[0].metrics["step_time_s"]


def test_calibration_times_forward_and_backward_per_op_kind_whole_passes_the_optimizer_step_and_the_buckets_allreduce(
        tmp_path):
    scenario = _scenario(tmp_path, "gpt2", 2, {"optimizer": "sgd"}, [
        {"name": "fp32"},
        {"name": "adamw_bf16", "training": {"optimizer": "adamw", "precision": "bf16_mixed"}},
        {"name": "amp", "training": {"precision": "amp_bf16"}},
        {"name": "bf16_buckets", "training": {"gradient_compression": "bf16"}},
    ])
    profile = calibrate_training(scenario, repeats=1, max_call_s=0.05)
    path = tmp_path / "profile.csv"
    path.write_text(profile.to_csv(index=False))
    rows = load_profile(path).rows
    timed = rows[~rows["measurement"].isin([MeasurementKind.CONTEXT, MeasurementKind.COLLECTIVE,
                                            MeasurementKind.MEMORY_BASELINE, MeasurementKind.REDUCTION])]
    # the reduction the buckets' ring performs, in the gradients' dtype (fp32 under every precision)
    # and in the compressed buckets' bf16, each at every size
    reductions = rows[rows["measurement"] == MeasurementKind.REDUCTION]
    for dtype in ("fp32", "bf16"):
        assert list(reductions[reductions["dtype"] == dtype]["size_bytes"]) == list(REDUCTION_SIZES), dtype
    assert set(reductions["dtype"]) == {"fp32", "bf16"} and (reductions["median"] > 0).all()
    baseline = rows[rows["measurement"] == MeasurementKind.MEMORY_BASELINE]
    assert len(baseline) == 1 and baseline["median"].iloc[0] > 50e6  # torch alone holds more
    # Read beside a trainer: beyond its tensors, not with them (the model is far below 50 MB).
    assert baseline["median"].iloc[0] < 1e9
    assert (timed["median"] > 0).all() and (timed["flops"] > 0).all()
    # 2 ranks x 1 repeat; the whole passes are timed in every round, PASS_CALLS_PER_ROUND calls each
    whole = timed["measurement"] == MeasurementKind.TRAINING_PASS
    assert (timed[~whole]["repeats"] == 2).all() and (timed[whole]["repeats"] == 2 * PASS_CALLS_PER_ROUND).all()
    kinds = {"layernorm", "qkv_proj", "attention", "out_proj", "mlp_up", "mlp_down", "lm_head", "embedding"}
    for measurement, expected in [(MeasurementKind.COMPUTE, kinds),
                                  (MeasurementKind.BACKWARD_INPUT, kinds - {"embedding"}),
                                  (MeasurementKind.BACKWARD_WEIGHT, kinds - {"attention"})]:
        # each precision's rows apart: autocast's and the bf16 copies' bf16 timings do not pool
        for precision, dtype in (("fp32", "fp32"), ("bf16_mixed", "bf16"), ("amp_bf16", "bf16")):
            of = timed[(timed["measurement"] == measurement) & (timed["precision"] == precision)]
            assert set(of["op"]) == expected and set(of["dtype"]) == {dtype}, (measurement, precision)
            assert len(of) == len(expected)
    passes = timed[timed["measurement"] == MeasurementKind.TRAINING_PASS]  # whole passes, without DDP
    assert sorted(zip(passes["op"], passes["precision"])) == [
        (kind, precision) for kind in ("backward", "forward") for precision in ("amp_bf16", "bf16_mixed", "fp32")]
    steps = timed[timed["measurement"] == MeasurementKind.OPTIMIZER_STEP]
    # 2^16, 2^20 and the model's parameters per (optimizer, precision) of the variants
    assert sorted(set(zip(steps["op"], steps["precision"]))) == [("adamw", "bf16_mixed"), ("sgd", "amp_bf16"),
                                                                 ("sgd", "fp32")] and len(steps) == 9
    # the model's count is timed over the model's own tensors, as its step loops over them
    own = ~steps["size_bytes"].isin([4 << 16, 4 << 20])
    assert own.sum() == 3
    assert steps[own]["method"].str.contains("the model's parameter tensors").all()
    assert steps[~own]["method"].str.contains("one tensor").all()
    # bf16_mixed's step writes its bf16 copies after the masters, as the trainer's does
    refreshed = steps["method"].str.contains("then the bf16 copies refreshed")
    assert (refreshed == (steps["precision"] == "bf16_mixed")).all()
    sweep = rows[rows["measurement"] == MeasurementKind.COLLECTIVE]
    assert set(sweep["op"]) == {"allreduce"} and set(sweep["algorithm"]) == {"ring"}  # the buckets' algorithm
    assert (sweep["group_size"] == 2).all() and sweep["size_bytes"].min() == 1024 and (sweep["median"] > 0).all()
    (context,) = profile_contexts(rows)  # the model it trained, which prices its passes
    assert context.model == scenario.model
    assert {op for op, _ in context.reference_s} == {"matmul", "stream"}  # the machine's speed around it
    simulated = simulate_training(scenario, load_profile(path))
    assert [(t.term, t.verdict.value) for t in simulated.network.terms if t.term.startswith("model")] == [
        (f"model {scenario.model.name}", "same")]
    assert any("in-step backward pass on cpu bf16" in line and "timed on" not in line for line in simulated.sources)
    for precision in ("amp_bf16", "bf16_mixed"):  # each bf16 variant's passes from its own rows
        assert any(line.startswith("in-step backward pass on cpu bf16") and line.endswith(f"({precision} rows)")
                   for line in simulated.sources), precision
    assert not any("the profile times no" in line for line in simulated.sources)
    assert any(line.startswith("reduction on cpu fp32: same (gamma") for line in simulated.sources)
    assert any(line.startswith("reduction on cpu bf16: same (gamma") for line in simulated.sources)


def test_hetsim_measure_trains_a_training_scenario_and_refuses_auto_in_one_line(tmp_path, capsys):
    document = _scenario(tmp_path, "gpt2", 2, {"optimizer": "sgd", "allreduce": "ring"}, [{"name": "ring"}],
                         steps=1).config.model_dump(mode="json", by_alias=True, exclude_none=True)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    code, stdout, _ = run_cli(main, ["measure", str(path), "--out", str(out), "--repeats", "1", "--warmup", "0"], capsys)
    assert code == 0 and "step ms" in stdout
    results = pd.read_csv(out / "results.csv")
    assert set(results["source"]) == {"measured"}
    assert results.set_index("metric").loc["samples_per_s", "unit"] == "samples/s"
    assert any(e.get("name") == "bucket 0" for e in json.loads((out / "trace.json").read_text())["traceEvents"])
    document["training"]["allreduce"] = "auto"
    path.write_text(yaml.safe_dump(document))
    code, _, stderr = run_cli(main, ["measure", str(path), "--out", str(tmp_path / "bad")], capsys)
    assert code == 2 and stderr.startswith("hetsim: error: training.allreduce: ") and stderr.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_a_training_plan_that_cannot_fit_is_refused_before_any_rank_starts(tmp_path):
    scenario = _scenario(tmp_path, "gpt2", 2, {"optimizer": "adamw"}, [{"name": "v"}])
    check_memory_fits(scenario)  # a few MB per rank
    document = scenario.config.model_dump(mode="json", by_alias=True, exclude_none=True)
    document["cluster"] = cluster(2, 1, device="cpu", memory="1MiB")
    with pytest.raises(ConfigError, match="device h0/dev0: the plan needs"):
        check_memory_fits(scenario_from_dict(document, base_dir=ROOT))


def test_exposed_communication_is_what_each_synchronising_backward_waits_for():
    # Two micro-batches synchronising each (no_sync off): backward 0-10 ms with buckets ready at 4
    # and 9 ms, reduced 4-8 and 9-12 ms (3 ms exposed); backward 12-20 ms, one bucket ready at 19,
    # reduced 19-25 ms (6 ms exposed); then a parameter average of 3 ms.
    ms = 1e-3
    step = StepTiming(0, 0.0, 28 * ms, forward=[(0, 0), (10 * ms, 12 * ms)],
                      backward=[(0, 12 * ms), (12 * ms, 25 * ms)], optimizer=(25 * ms, 25 * ms),
                      averaging=(25 * ms, 28 * ms),
                      buckets=[BucketCall(0, 8, 4 * ms, 4 * ms, 8 * ms), BucketCall(1, 8, 9 * ms, 9 * ms, 12 * ms),
                               BucketCall(0, 8, 19 * ms, 19 * ms, 25 * ms)])
    metrics = step_metrics([step], global_batch_size=4, sequence_length=10)
    assert metrics["exposed_communication_s"] == pytest.approx(12 * ms)
    assert metrics["overlap_ratio"] == pytest.approx(1 - 9 / 13)  # 13 ms on the wire, 9 of them exposed
    assert metrics["step_time_s"] == pytest.approx(28 * ms) and metrics["tokens_per_s"] == pytest.approx(40 / 0.028)
