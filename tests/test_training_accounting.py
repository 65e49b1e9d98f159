"""Training accounting against the published formulas: Korthikanti et al. 2022 (arXiv 2205.05198,
table 2), Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` and DeepSpeed's
``estimate_zero2_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py``). Each
published expression is written out here, independently of hetsim's code, and compared exactly."""

import dataclasses
import math

import pytest

from models.accounting import head_op_costs, layer_op_costs, parameter_count, rank_parameter_count
from models.catalog import get_model
from models.errors import ConfigError
from models.ops import OpKind
from models.training import (
    ActivationLayout,
    Optimizer,
    accumulation_transient_bytes,
    Precision,
    Recompute,
    activation_bytes,
    head_backward_costs,
    layer_activation_bytes,
    layer_backward_costs,
    layer_step_flops,
    loss_backward_bytes,
    model_state_memory,
    optimizer_step_cost,
    recomputed_layer_count,
    training_memory,
)

MODELS = ("llama-2-7b", "gpt2", "llama-3.1-8b")
SHAPES = ((1, 512), (4, 2048), (8, 1024))  # (micro-batch b, sequence s)
TP_DEGREES = (1, 2, 4)
DP_DEGREES = (1, 2, 4, 8, 64)


def gpt_layer(name: str) -> "object":
    """The catalog model's h, a and L in the layer the paper analyses: LayerNorm, a plain 4h MLP,
    multi-head attention, 2-byte activations (section 4.1's assumptions)."""
    spec = get_model(name)
    return dataclasses.replace(
        spec,
        norm="layernorm",
        mlp="plain",
        intermediate_size=4 * spec.hidden_size,
        num_kv_heads=spec.num_attention_heads,
        dtype="bf16",
        attention="eager",  # the paper's kernel materialises the attention probabilities
    )


# --- Korthikanti et al. 2022, section 4, table 2 -------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("b, s", SHAPES)
def test_activations_without_parallelism_are_the_papers_sbh_34_plus_5as_over_h(name, b, s):
    spec = gpt_layer(name)
    h, a = spec.hidden_size, spec.num_attention_heads
    published = s * b * h * (34 + 5 * a * s / h)
    assert layer_activation_bytes(spec, ActivationLayout(b, s, dropout=True)) == published


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("b, s", SHAPES)
@pytest.mark.parametrize("t", TP_DEGREES)
def test_activations_under_tensor_parallelism_follow_table_2(name, b, s, t):
    spec = gpt_layer(name)
    h, a = spec.hidden_size, spec.num_attention_heads
    tensor = ActivationLayout(b, s, tp_degree=t, dropout=True)
    sequence = ActivationLayout(b, s, tp_degree=t, sequence_parallel=True, dropout=True)
    assert layer_activation_bytes(spec, tensor) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(spec, sequence) == s * b * h / t * (34 + 5 * a * s / h)
    assert layer_activation_bytes(spec, tensor, recompute="selective") == s * b * h * (10 + 24 / t)
    assert layer_activation_bytes(spec, sequence, recompute=Recompute.SELECTIVE) == (
        s * b * h * 34 / t
    )
    assert layer_activation_bytes(spec, tensor, recompute=Recompute.FULL) == 2 * s * b * h


@pytest.mark.parametrize("name", ("gpt2", "llama-2-7b", "llama-3.1-8b"))
@pytest.mark.parametrize("t", TP_DEGREES)
def test_activations_match_megatron_per_layer_estimators_with_the_models_own_mlp_width(name, t):
    # compute_activation_memory (sequence parallel, selective): s b h (18 + 4 ffn / h) / t;
    # compute_activation_memory_without_sp: s b h (10 + 24 / t), which assumes ffn = 4h.
    spec = dataclasses.replace(
        get_model(name), norm="layernorm", mlp="plain", dtype="bf16",
        num_kv_heads=get_model(name).num_attention_heads, attention="eager",
    )
    b, s, h, ffn = 2, 1024, spec.hidden_size, spec.intermediate_size
    sequence = ActivationLayout(b, s, tp_degree=t, sequence_parallel=True, dropout=True)
    assert layer_activation_bytes(spec, sequence, recompute="selective") == (s * b * h) * (18 + 4 * (ffn / h)) / t
    gpt = gpt_layer(name)
    tensor = ActivationLayout(b, s, tp_degree=t, dropout=True)
    assert layer_activation_bytes(gpt, tensor, recompute="selective") == s * b * gpt.hidden_size * (10 + 24 / t)


def test_gated_mlp_and_grouped_query_attention_keep_what_autograd_saves():
    spec = get_model("llama-3.1-8b").with_dtype("bf16").with_attention("eager")
    b, s, h, i = 1, 256, spec.hidden_size, spec.intermediate_size
    kv = spec.num_kv_heads * spec.head_dim
    squares = b * spec.num_attention_heads * s * s
    # norm inputs, qkv and up inputs (4 sbh); q, k, v, o; gate, silu, up, product; probabilities.
    expected = 2 * (4 * s * b * h + s * b * (2 * h + 2 * kv) + 4 * s * b * i + squares)
    assert layer_activation_bytes(spec, ActivationLayout(b, s)) == expected


def test_autocast_keeps_the_residual_stream_and_an_rmsnorms_output_in_fp32():
    # torch.autocast with fp32 parameters: the norms see the fp32 residual, an RMSNorm's gain saves
    # its fp32 normalised input, the linears save their bf16 casts (sbh (8 + 8 + 4) for RMSNorm).
    spec = get_model("tinyllama-1.1b").with_dtype("bf16")
    layout = ActivationLayout(8, 1024)
    sbh = 8 * 1024 * spec.hidden_size
    plain = layer_activation_bytes(spec, layout)
    assert layer_activation_bytes(spec, layout, autocast=True) - plain == sbh * (8 + 8 + 4) - 4 * sbh * 2
    layernorm = dataclasses.replace(spec, norm="layernorm")
    assert layer_activation_bytes(layernorm, layout, autocast=True) - layer_activation_bytes(layernorm, layout) == (
        sbh * (8 + 4) - 4 * sbh * 2)
    # A checkpointed segment keeps its fp32 input.
    assert layer_activation_bytes(spec, layout, recompute=Recompute.FULL, autocast=True) == sbh * 4


def test_a_fused_attention_kernel_saves_a_logsumexp_per_row_not_the_probabilities():
    # FlashAttention (arXiv 2205.14135) recomputes the probabilities in backward from an fp32
    # logsumexp per query row: the s^2 term is gone, whatever the sequence length.
    fused = get_model("llama-3.1-8b").with_dtype("bf16")
    assert fused.attention == "sdpa"
    eager = fused.with_attention("eager")
    b, s = 2, 4096
    rows = b * fused.num_attention_heads * s
    saved_fused = layer_activation_bytes(fused, ActivationLayout(b, s))
    assert layer_activation_bytes(eager, ActivationLayout(b, s)) - saved_fused == rows * s * 2 - rows * 4
    assert saved_fused == layer_activation_bytes(eager, ActivationLayout(b, s), recompute="selective") + rows * 4


@pytest.mark.parametrize("k", (1, 4, 5, 32, 100))
def test_checkpointing_every_k_layers_keeps_segment_inputs_and_one_segment(k):
    spec = get_model("llama-2-7b").with_dtype("bf16")
    layout = ActivationLayout(2, 1024, tp_degree=2)
    full = layer_activation_bytes(spec, layout)
    segment_input = 2 * 1024 * 2 * spec.hidden_size
    layers = spec.num_layers
    expected = (math.ceil(layers / k) - 1) * segment_input + min(k, layers) * full
    assert activation_bytes(spec, layout, checkpoint_every=k, is_master=False) == expected
    assert activation_bytes(spec, layout, is_master=False) == layers * full
    # One segment of every layer saves nothing: the whole model is recomputed at once.
    assert expected < layers * full if k < layers else expected == layers * full


def test_the_master_also_keeps_the_heads_inputs_and_logits():
    spec = get_model("gpt2").with_dtype("bf16")
    layout = ActivationLayout(2, 128)
    head = activation_bytes(spec, layout) - activation_bytes(spec, layout, is_master=False)
    tokens = 2 * 128
    assert head == tokens * (2 * spec.hidden_size * 2 + spec.vocab_size * (2 + 4))


# --- Megatron-LM, megatron/training/theoretical_memory_usage.py ----------------------------------


def megatron_parameter_count(spec) -> int:
    """``compute_weight_and_optimizer_memory``'s num_total_parameters (dense, no MTP, untied)."""
    norm_size = 1 if spec.norm == "rmsnorm" else 2
    gated_linear_multiplier = 3 / 2 if spec.mlp == "gated" else 1
    query_projection_to_hidden_size_ratio = spec.head_dim * spec.num_attention_heads / spec.hidden_size
    self_attn_term = 2 * spec.hidden_size * spec.hidden_size * (
        (1 + spec.num_kv_heads / spec.num_attention_heads) * query_projection_to_hidden_size_ratio
    )
    layer = 2 * spec.hidden_size * (spec.intermediate_size * gated_linear_multiplier + norm_size) + self_attn_term
    embedding_size = spec.hidden_size * spec.vocab_size
    block = layer * spec.num_layers + norm_size * spec.hidden_size
    return block + (2 * embedding_size if not spec.tied_embeddings else embedding_size)


@pytest.mark.parametrize("name", ("llama-2-7b", "llama-3.1-8b"))
def test_parameter_count_is_megatrons_for_bias_free_models(name):
    spec = get_model(name)
    assert parameter_count(spec) == megatron_parameter_count(spec)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("t", TP_DEGREES)
@pytest.mark.parametrize("d", DP_DEGREES)
def test_mixed_precision_adam_is_megatrons_18_bytes_and_6_plus_12_over_d_distributed(name, t, d):
    spec = get_model(name)
    params = rank_parameter_count(spec, t, is_master=True)
    common = dict(optimizer="adam", precision="bf16_mixed", gradient_dtype="fp32", gradient_as_bucket_view=True)
    for use_distributed_optimizer in (False, True):
        num_bytes_per_parameter = 18 if not use_distributed_optimizer else 6 + (12 / d)
        memory = model_state_memory(params, data_parallel=d, zero_stage=int(use_distributed_optimizer), **common)
        assert memory.total == params * num_bytes_per_parameter


# --- DeepSpeed, estimate_zero2_model_states_mem_needs ---------------------------------------------


def deepspeed_zero2_gpu_bytes(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=False,
                              additional_buffer_factor=1.5):
    """The estimator's GPU figure; ``additional_buffer_factor`` scales only its CPU figure."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
    return int(gpu_mem)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("gpus_per_node, nodes", ((1, 1), (2, 1), (8, 1), (8, 4), (3, 1), (4, 3)))
def test_zero_1_with_bf16_gradients_is_deepspeeds_4p_plus_16p_over_n(name, gpus_per_node, nodes):
    params = parameter_count(get_model(name))
    n = gpus_per_node * nodes
    memory = model_state_memory(
        params, optimizer=Optimizer.ADAM, precision=Precision.BF16_MIXED, gradient_dtype="bf16",
        data_parallel=n, zero_stage=1, gradient_as_bucket_view=True,
    )
    assert int(memory.total) == deepspeed_zero2_gpu_bytes(params, gpus_per_node, nodes)


# --- model states by category ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer, precision, per_parameter",
    (
        ("sgd", "fp32", (4, 4, 0)),
        ("adam", "fp32", (4, 4, 8)),
        ("adamw", "fp32", (4, 4, 8)),
        ("sgd", "bf16_mixed", (2, 4, 4)),  # fp32 master; gradients in fp32 (Megatron's main_grad)
        ("adamw", "bf16_mixed", (2, 4, 12)),
    ),
)
def test_model_states_per_parameter(optimizer, precision, per_parameter):
    memory = model_state_memory(1000, optimizer=optimizer, precision=precision)
    assert (memory.weights, memory.gradients, memory.optimizer_states) == tuple(1000 * x for x in per_parameter)
    assert memory.bucket_buffers == memory.gradients  # DDP's separate bucket copy


def test_gradient_as_bucket_view_removes_the_bucket_copy_and_zero_1_shards_only_the_states():
    base = dict(optimizer="adamw", precision="bf16_mixed", data_parallel=8)
    plain = model_state_memory(10**6, **base)
    viewed = model_state_memory(10**6, gradient_as_bucket_view=True, **base)
    sharded = model_state_memory(10**6, zero_stage=1, **base)
    assert viewed.bucket_buffers == 0 and plain.total - viewed.total == plain.gradients
    assert sharded.optimizer_states == plain.optimizer_states / 8
    assert (sharded.weights, sharded.gradients, sharded.bucket_buffers) == (
        plain.weights, plain.gradients, plain.bucket_buffers,
    )


def test_training_memory_puts_every_category_together_per_device():
    spec = get_model("llama-2-7b")
    layout = ActivationLayout(1, 1024, tp_degree=4)
    common = dict(optimizer="adamw", precision="bf16_mixed", data_parallel=2, framework_baseline_bytes=500e6,
                  checkpoint_every=4)
    memory = training_memory(spec, layout, is_master=False, **common)
    params = rank_parameter_count(spec, 4, is_master=False)
    assert memory.weights == 2 * params and memory.optimizer_states == 12 * params
    assert memory.framework == 500e6
    assert memory.activations == activation_bytes(spec.with_dtype("bf16"), layout, checkpoint_every=4, is_master=False)
    assert memory.total == sum(dataclasses.astuple(memory))
    assert training_memory(spec, layout, is_master=True, **common).total > memory.total


def test_torch_amp_keeps_fp32_parameters_gradients_and_states_and_an_fp32_residual_stream():
    # torch.autocast over fp32 parameters (what the runtime trains): Adam holds 4 + 4 + 8 bytes per
    # parameter and DDP's fp32 buckets 4 more; activations as autocast saves them.
    spec = get_model("tinyllama-1.1b")
    layout = ActivationLayout(8, 1024)
    memory = training_memory(spec, layout, optimizer="adamw", precision="amp_bf16")
    params = rank_parameter_count(spec, 1, is_master=True)
    assert (memory.weights, memory.gradients, memory.optimizer_states, memory.bucket_buffers) == (
        4 * params, 4 * params, 8 * params, 4 * params)
    assert memory.activations == activation_bytes(spec.with_dtype("bf16"), layout, autocast=True)
    with pytest.raises(ConfigError, match="training.gradient_dtype.*amp_bf16"):
        training_memory(spec, layout, optimizer="adamw", precision="amp_bf16", gradient_dtype="bf16")


@pytest.mark.parametrize("precision, logit_bytes, gradient_bytes", [("fp32", 2 * 4, 4), ("bf16_mixed", 2 * 4 + 2, 4)])
def test_accumulation_adds_the_losss_gradients_and_the_heads_new_weight_gradient_on_the_master(
        precision, logit_bytes, gradient_bytes):
    """With gradients already held, a later micro-batch's backward starts with the fp32 gradients of
    the log-probabilities and logits (and the logits' own in a 2-byte compute dtype) of every
    position and token, and the LM head's new V x h weight gradient beside them."""
    spec = get_model("gpt2")
    layout = ActivationLayout(2, 128)
    compute = spec.with_dtype("fp32" if precision == "fp32" else "bf16")
    expected = 2 * 128 * spec.vocab_size * logit_bytes + spec.vocab_size * spec.hidden_size * gradient_bytes
    assert accumulation_transient_bytes(compute, layout, precision=precision) == expected
    assert accumulation_transient_bytes(compute, layout, precision=precision, is_master=False) == 0
    common = dict(optimizer="adamw", precision=precision)
    once = training_memory(spec, layout, **common)
    assert training_memory(spec, layout, accumulation=1, **common) == once
    assert training_memory(spec, layout, accumulation=4, **common).activations == once.activations + expected
    with pytest.raises(ConfigError, match="training.gradient_accumulation"):
        training_memory(spec, layout, accumulation=0, **common)


@pytest.mark.parametrize(
    "kwargs, field",
    (
        (dict(optimizer="lion"), "training.optimizer"),
        (dict(precision="fp16"), "training.precision"),
        (dict(zero_stage=2), "training.zero"),
        (dict(data_parallel=0), "parallel.data"),
        (dict(precision="fp32", gradient_dtype="bf16"), "training.gradient_dtype"),
        (dict(gradient_dtype="fp8"), "training.gradient_dtype"),
        (dict(gradient_as_bucket_view="yes"), "training.gradient_as_bucket_view"),
    ),
)
def test_bad_training_settings_name_their_field(kwargs, field):
    args = dict(optimizer="adam", precision="bf16_mixed") | kwargs
    with pytest.raises(ConfigError) as error:
        model_state_memory(100, **args)
    assert error.value.field == field


def test_bad_checkpointing_and_baseline_name_their_field():
    with pytest.raises(ConfigError, match="training.activation_checkpointing"):
        recomputed_layer_count(32, 0)
    with pytest.raises(ConfigError, match="training.framework_baseline_bytes"):
        training_memory(get_model("gpt2"), ActivationLayout(1, 8), optimizer="sgd", precision="fp32",
                        framework_baseline_bytes=-1)


@pytest.mark.parametrize(
    "kwargs, field",
    (
        (dict(micro_batch_size=0), "workload.micro_batch_size"),
        (dict(sequence_length=2.5), "workload.sequence_length"),
        (dict(tp_degree=-1), "parallel.tensor"),
        (dict(sequence_parallel="no"), "training.sequence_parallel"),
        (dict(dropout=1), "training.dropout"),
    ),
)
def test_bad_activation_layouts_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as error:
        ActivationLayout(**(dict(micro_batch_size=1, sequence_length=8) | kwargs))
    assert error.value.field == field


def test_a_tensor_parallel_degree_the_model_cannot_take_is_refused():
    with pytest.raises(ConfigError, match="parallel.tensor"):
        layer_activation_bytes(get_model("gpt2"), ActivationLayout(1, 8, tp_degree=5))


# --- backward and optimizer FLOPs and bytes -------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("t", (1, 2, 4))
def test_backward_of_a_gemm_costs_2mnk_for_the_input_and_2mnk_for_the_weights(name, t):
    spec = get_model(name)
    b, s = 2, 256
    m = b * s
    h, d = spec.hidden_size, spec.head_dim
    q = spec.num_attention_heads // t * d
    kv = max(spec.num_kv_heads // t, 1) * d
    i = spec.intermediate_size // t
    gemms = {
        OpKind.QKV_PROJ: (h, q + 2 * kv, q + 2 * kv if spec.attention_bias else 0),
        OpKind.OUT_PROJ: (q, h, h if spec.linear_bias else 0),
        OpKind.MLP_DOWN: (i, h, h if spec.linear_bias else 0),
    }
    backward = layer_backward_costs(spec, tp_degree=t, batch_size=b, sequence_length=s)
    for kind, (k, n, bias) in gemms.items():
        assert backward[kind].input_grad.flops == 2 * m * n * k
        assert backward[kind].weight_grad.flops == 2 * m * n * k + m * bias
    projections = 2 if spec.mlp == "gated" else 1
    activation = {"gated": 12, "plain": 18}[spec.mlp]
    up = backward[OpKind.MLP_UP]
    assert up.input_grad.flops == 2 * m * projections * i * h + m * i * activation
    assert up.weight_grad.flops == 2 * m * projections * i * h + (m * projections * i if spec.linear_bias else 0)


@pytest.mark.parametrize("name", MODELS)
def test_attention_backward_is_four_matmuls_over_the_causal_scores_and_has_no_weights(name):
    spec = get_model(name)
    b, s, t = 2, 300, 2
    scores = b * spec.num_attention_heads // t * s * (s + 1) // 2
    attention = layer_backward_costs(spec, tp_degree=t, batch_size=b, sequence_length=s)[OpKind.ATTENTION]
    assert attention.input_grad.flops == scores * (4 * 2 * spec.head_dim + 4)
    assert attention.weight_grad.flops == 0 and attention.weight_grad.bytes_written == 0


@pytest.mark.parametrize("name, per_element", (("gpt2", (11, 3)), ("llama-2-7b", (8, 2))))
def test_norm_backward_factors(name, per_element):
    spec = get_model(name)
    norm = layer_backward_costs(spec, tp_degree=1, batch_size=3, sequence_length=5)[OpKind.LAYERNORM]
    elements = 15 * spec.hidden_size
    assert (norm.input_grad.flops, norm.weight_grad.flops) == (elements * per_element[0], elements * per_element[1])


def test_weight_gradients_are_written_in_the_gradient_dtype():
    spec = get_model("llama-2-7b").with_dtype("bf16")
    h = spec.hidden_size
    bf16 = layer_backward_costs(spec, tp_degree=1, batch_size=1, sequence_length=4)
    fp32 = layer_backward_costs(spec, tp_degree=1, batch_size=1, sequence_length=4, gradient_dtype="fp32")
    assert bf16[OpKind.OUT_PROJ].weight_grad.bytes_written == h * h * 2
    assert fp32[OpKind.OUT_PROJ].weight_grad.bytes_written == h * h * 4


@pytest.mark.parametrize("name", MODELS)
def test_head_backward_prices_the_logits_of_every_position_twice_and_embeddings_by_scatter_add(name):
    spec = get_model(name)
    b, s = 2, 64
    tokens = b * s
    backward = head_backward_costs(spec, batch_size=b, sequence_length=s)
    forward = head_op_costs(spec, batch_size=tokens, new_tokens=1)
    assert forward[OpKind.LM_HEAD].flops == 2 * tokens * spec.hidden_size * spec.vocab_size
    assert backward[OpKind.LM_HEAD].input_grad.flops == forward[OpKind.LM_HEAD].flops
    assert backward[OpKind.LM_HEAD].weight_grad.flops == forward[OpKind.LM_HEAD].flops
    embedding = backward[OpKind.EMBEDDING]
    assert embedding.input_grad.flops == 0 and embedding.input_grad.bytes_written == 0
    tables = 2 if spec.learned_position_embeddings else 1
    assert embedding.weight_grad.flops == tables * tokens * spec.hidden_size


@pytest.mark.parametrize("name", MODELS)
def test_recomputation_runs_the_forward_of_every_checkpointed_layer_again(name):
    spec = get_model(name)
    common = dict(tp_degree=1, batch_size=1, sequence_length=128)
    forward = layer_op_costs(spec, tp_degree=1, batch_size=1, new_tokens=128, context_tokens=128)
    forward_flops = sum(c.flops for c in forward.values()) + forward[OpKind.LAYERNORM].flops
    assert layer_step_flops(spec, recompute=True, **common) - layer_step_flops(spec, **common) == forward_flops
    assert recomputed_layer_count(spec.num_layers, 4) == spec.num_layers
    assert recomputed_layer_count(spec.num_layers, None) == 0


def test_gemm_dominated_step_is_about_three_forwards_and_four_with_recomputation():
    spec = get_model("llama-2-7b")
    common = dict(tp_degree=1, batch_size=1, sequence_length=512)
    forward = layer_op_costs(spec, tp_degree=1, batch_size=1, new_tokens=512, context_tokens=512)
    forward_flops = sum(c.flops for c in forward.values()) + forward[OpKind.LAYERNORM].flops
    assert layer_step_flops(spec, **common) / forward_flops == pytest.approx(3, rel=0.01)
    assert layer_step_flops(spec, recompute=True, **common) / forward_flops == pytest.approx(4, rel=0.01)


def test_a_large_vocabularys_loss_backward_peaks_before_any_gradient_is_allocated():
    # Qwen2.5-0.5B at 8 x 1024 tokens (152k vocabulary, 0.5B parameters), amp_bf16: the loss's
    # backward holds 12 fp32 bytes per logit where the activations count the bf16 logits and
    # their fp32 log-probabilities (6), and no gradient exists yet; measured on an H100 the step
    # peaked there (validation/gpu-report).
    spec, layout = get_model("qwen2.5-0.5b"), ActivationLayout(8, 1024)
    compute, logits = spec.with_dtype("bf16"), 8 * 1024 * spec.vocab_size
    head_peak = loss_backward_bytes(compute, layout, autocast=True)
    assert head_peak == activation_bytes(compute, layout, autocast=True) + logits * (12 - 6)
    memory = training_memory(spec, layout, optimizer="adamw", precision="amp_bf16")
    assert memory.activations == head_peak - memory.gradients  # the categories add up to that moment
    # Gradients that are views into the buckets are resident: nothing of the peak is theirs.
    views = training_memory(spec, layout, optimizer="adamw", precision="amp_bf16", gradient_as_bucket_view=True)
    assert views.activations == head_peak
    # Checkpointed, no segment has been recomputed yet when the loss's backward runs.
    checkpointed = loss_backward_bytes(compute, layout, checkpoint_every=1, autocast=True)
    segment = layer_activation_bytes(compute, layout, autocast=True)
    segment_input = layer_activation_bytes(compute, layout, recompute=Recompute.FULL, autocast=True)
    assert checkpointed == (activation_bytes(compute, layout, checkpoint_every=1, autocast=True) + logits * 6
                            - segment + segment_input)
    # TinyLlama-1.1B (32k vocabulary, 1.1B parameters): its gradients outweigh the loss's transient.
    tiny = get_model("tinyllama-1.1b")
    assert training_memory(tiny, layout, optimizer="adamw", precision="amp_bf16").activations == activation_bytes(
        tiny.with_dtype("bf16"), layout, autocast=True)


@pytest.mark.parametrize(
    "optimizer, precision, gradient_dtype, flops, read, written",
    (
        ("sgd", "fp32", None, 2, 8, 4),
        ("adam", "fp32", None, 13, 16, 12),
        ("adamw", "fp32", None, 14, 16, 12),
        ("adam", "bf16_mixed", "fp32", 13, 16, 14),  # also writes the bf16 weights
        ("adamw", "bf16_mixed", None, 14, 16, 14),  # fp32 gradients by default (Megatron's)
        ("adamw", "bf16_mixed", "bf16", 14, 22, 18),  # bf16 grads into the fp32 copy first
    ),
)
def test_optimizer_step_flops_and_bytes_per_parameter(optimizer, precision, gradient_dtype, flops, read, written):
    cost = optimizer_step_cost(1000, optimizer=optimizer, precision=precision, gradient_dtype=gradient_dtype)
    assert (cost.flops, cost.bytes_read, cost.bytes_written) == (1000 * flops, 1000 * read, 1000 * written)


def test_optimizer_step_rejects_a_bad_count():
    with pytest.raises(ConfigError, match="parameters"):
        optimizer_step_cost(-1, optimizer="adam", precision="fp32")
