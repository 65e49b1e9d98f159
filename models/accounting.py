"""Parameters, weight bytes, KV-cache bytes and per-op FLOPs and bytes of a :class:`ModelSpec`.

Everything is in SI units: bytes, FLOPs (one multiply or add counts one; a multiply-accumulate two).
Tensor parallelism follows Megatron-LM (arXiv 1909.08053, section 3): q, k, v and the MLP up (and
gate) projections are split by columns, the attention output and MLP down projections by rows;
norms, and the biases of row-parallel linears (added after the reduction), are replicated. The
embedding, the final norm and the LM head live on the master rank only, unsharded.

Matmul FLOPs follow the Megatron-LM accounting (arXiv 2104.04473, appendix): a (m x k) @ (k x n)
product costs 2mkn. Elementwise FLOPs (norms, activations, softmax) follow the conventions below;
those ops are memory-bound, so a roofline prices them by bytes and their exact count barely matters.
"""

from dataclasses import dataclass

from models.cache_formats import cache_bytes
from models.errors import ConfigError
from models.ops import OpKind
# check_tensor_parallel and kv_heads_per_rank are re-exported: the accounting's callers use them.
from models.shards import TensorShard, check_tensor_parallel, kv_heads_per_rank  # noqa: F401
from models.spec import ModelSpec
from models.weight_formats import DEQUANTIZE_ABOVE_TOKENS, QuantisedMatmul, WeightFormat, head_format, matrix_bytes

# FLOPs per element, one per arithmetic operation of the textbook formula.
_RESIDUAL_ADD_FLOPS = 1
_NORM_FLOPS = {"rmsnorm": 4, "layernorm": 7}  # RMS: square, sum, scale, gain; LN adds mean, centre, bias
_ACTIVATION_FLOPS = {"gated": 5, "plain": 9}  # SiLU (4) times the up projection (1); tanh-GELU (9)
_SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide (the 1/sqrt(head_dim) scale folded into QK^T)
_SOFTMAX_STATISTIC_BYTES = 4  # a fused kernel's fp32 logsumexp per query row (see layer_op_costs)
_FP32_BYTES = 4
# Query-sized tensors live during attention: the rotated query, its copy in the kernel's head-major
# layout and the output (measured on an H100 in bf16, SDPA and eager alike: 3.0 query sizes
# beyond the scores or statistics, validation/gpu-report).
_QUERY_COPIES = 3


@dataclass(frozen=True)
class OpCost:
    """What one op costs on one rank.

    ``flops``: floating-point operations. ``bytes_read``: device-memory bytes read, counting the
    weights, the input activations and KV-cache reads (for a lookup, only the gathered rows).
    ``bytes_written``: output activations and KV-cache writes. ``weight_bytes``: bytes of the
    parameters the op uses, which must be resident while it runs. ``workspace_bytes``: transient
    device memory the op needs beyond its persistent inputs: its output plus intermediates.
    ``prepass_bytes``: bytes a memory-bound kernel moves before the op's own, in sequence with it
    (a product dequantising quantised weights first reads their blocks and writes them in the
    model's dtype, :mod:`models.weight_formats`), so priced after the op's roofline, not under it.
    """

    flops: float
    bytes_read: float
    bytes_written: float
    weight_bytes: float
    workspace_bytes: float
    prepass_bytes: float = 0.0


def parameter_count(spec: ModelSpec) -> int:
    """Exact number of parameters, tied embeddings counted once.

    Token (and learned position) embeddings, per layer two norms (LayerNorm: gain and bias;
    RMSNorm: gain), q/k/v/o projections and the MLP with the biases the spec names, the final norm
    and the LM head unless tied. Matches the published counts of the catalog exactly.
    """
    whole = _shard(spec, 1, None)
    per_layer = _layer_params(_attention_block_parts(spec, whole)) + _layer_params(_mlp_block_parts(spec, whole))
    return spec.num_layers * per_layer + _master_params(spec)


def layer_block_weight_bytes(spec: ModelSpec, tp_degree: int, *, shard: TensorShard | None = None
                             ) -> dict[str, int]:
    """Weight bytes of one decoder layer on one rank, split into the blocks loaded as units.

    ``"attention"``: input norm, q/k/v and output projections; ``"mlp"``: post-attention norm and
    the MLP. ``shard``: the rank's slice (:mod:`models.shards`) when the split is uneven; default
    the even split of ``tp_degree``. Raises :class:`ConfigError` if ``tp_degree`` cannot shard
    ``spec`` evenly and no ``shard`` is given.
    """
    shard = _shard(spec, tp_degree, shard)
    return {
        "attention": _stored_bytes(spec, *_attention_block_parts(spec, shard)),
        "mlp": _stored_bytes(spec, *_mlp_block_parts(spec, shard)),
    }


def rank_parameter_count(spec: ModelSpec, tp_degree: int, *, is_master: bool,
                         shard: TensorShard | None = None) -> int:
    """Parameters one rank holds: its shard of every layer, plus on the master the embeddings,
    final norm and LM head (once if tied).

    With ``tp_degree=1`` and ``is_master=True`` this is ``parameter_count(spec)``. ``shard``: as
    in :func:`layer_block_weight_bytes`. Raises :class:`ConfigError` if ``tp_degree`` cannot shard
    ``spec`` evenly and no ``shard`` is given.
    """
    shard = _shard(spec, tp_degree, shard)
    per_layer = _layer_params(_attention_block_parts(spec, shard)) + _layer_params(_mlp_block_parts(spec, shard))
    return spec.num_layers * per_layer + (_master_params(spec) if is_master else 0)


def rank_weight_bytes(spec: ModelSpec, tp_degree: int, *, is_master: bool, shard: TensorShard | None = None) -> int:
    """Resident weight bytes of one rank: ``rank_parameter_count * dtype_bytes`` for native
    weights; quantised, its matrices in their blocks (:mod:`models.weight_formats`).

    Raises :class:`ConfigError` as :func:`rank_parameter_count` does.
    """
    return stage_weight_bytes(spec, tp_degree, spec.num_layers, embeds=is_master, heads=is_master, shard=shard)


def stage_weight_bytes(spec: ModelSpec, tp_degree: int, num_layers: int, *, embeds: bool, heads: bool,
                       shard: TensorShard | None = None) -> int:
    """Resident weight bytes of the master of a pipeline stage's tensor-parallel group running
    ``num_layers`` decoder layers; ``embeds``: the first stage (token and learned position
    embeddings), ``heads``: the last stage (final norm and LM head; with tied embeddings a copy of
    the token embedding matrix, as Megatron-LM keeps one on the last stage:
    ``megatron/core/models/common/language_module/language_module.py``,
    ``setup_embeddings_and_output_layer``). Another rank of the group holds only its layer shards,
    ``stage_weight_bytes(..., embeds=False, heads=False)``. A single stage with both flags is
    :func:`rank_weight_bytes` of the master. ``shard``: as in :func:`layer_block_weight_bytes`.

    Raises :class:`ConfigError` if ``tp_degree`` cannot shard ``spec`` evenly and no ``shard`` is given.
    """
    shard = _shard(spec, tp_degree, shard)
    size = num_layers * sum(layer_block_weight_bytes(spec, tp_degree, shard=shard).values())
    if embeds:
        size += _embedding_bytes(spec)
    if heads:
        # Tied and both on this stage: the one table is the embedding's, stored as the head.
        lm_head = 0 if spec.tied_embeddings and embeds else spec.vocab_size * spec.hidden_size
        size += _norm_params(spec) * spec.dtype_bytes + _head_matrix_bytes(spec, lm_head)
    return size


def kv_cache_bytes_per_token(spec: ModelSpec, tp_degree: int = 1, *, shard: TensorShard | None = None) -> int:
    """KV-cache bytes one token adds on one rank: K and V, every layer.

    ``2 * num_layers * kv_heads * head_dim * dtype_bytes`` (or the cache's quantised blocks,
    :mod:`models.cache_formats`) with the rank's KV heads (its
    ``shard``'s, replicas included; default the even split of ``tp_degree``). Raises
    :class:`ConfigError` if ``tp_degree`` cannot shard ``spec`` evenly and no ``shard`` is given.
    """
    shard = _shard(spec, tp_degree, shard)
    return 2 * spec.num_layers * _cache_bytes(spec, len(shard.kv_heads) * spec.head_dim)


def layer_op_costs(
    spec: ModelSpec, *, tp_degree: int, batch_size: int, new_tokens: int, context_tokens: int,
    shard: TensorShard | None = None,
) -> dict[OpKind, OpCost]:
    """Cost on one rank of one decoder layer processing ``new_tokens`` per sequence.

    Each of ``batch_size`` sequences feeds ``new_tokens`` tokens that attend causally to
    ``context_tokens`` keys, those tokens included: prefill has ``context_tokens == new_tokens``,
    decode ``new_tokens == 1`` and ``context_tokens`` the cache length with the new token. With
    T = batch_size * new_tokens tokens, h = hidden size, d = head dim, q = heads / tp, k = KV heads
    per rank, i = intermediate size / tp (or the widths of ``shard``, a rank's uneven slice,
    :mod:`models.shards`):

    - LAYERNORM: residual add and norm over (T, h), replicated; the plan runs it twice per layer.
    - QKV_PROJ: (T, h) @ (h, (q + 2k) d), column-parallel.
    - ATTENTION: QK^T and AV over the causal (query, key) pairs of q heads, softmax; reads q and
      the cached K, V of the context, writes the output (T, q d) and appends the new K, V. Its
      workspace is three query-sized tensors (the rotated query, its copy in the kernel's
      layout, the output) plus what the kernel (``spec.attention``) holds: ``sdpa``, a fused
      kernel, keeps one fp32 softmax statistic per query row (batch, q, new_tokens) and never
      the scores (FlashAttention, Dao et al. 2022, arXiv 2205.14135, Algorithm 1: O(N) extra
      memory; PyTorch ``torch.nn.functional.scaled_dot_product_attention``, whose flash and
      memory-efficient backends return only a logsumexp); ``eager`` materialises the score
      matrix (batch, q, new_tokens, context_tokens) in the model's dtype and soft-maxes it in
      fp32, its fp32 copy and probabilities live with it (:func:`_eager_bytes_per_score`).
    - OUT_PROJ: (T, q d) @ (q d, h), row-parallel: a partial sum of (T, h) for the reduction.
    - MLP_UP: (T, h) @ (h, 2i) for gate and up then SiLU-gating (gated), or (T, h) @ (h, i) then
      GELU (plain); writes (T, i); its workspace holds the projections and the output.
    - MLP_DOWN: (T, i) @ (i, h), row-parallel: a partial sum of (T, h).

    Rotary embeddings (a few FLOPs per q and k element) are not counted; the bias of a
    row-parallel linear is counted on every rank, as each adds it after the reduction. Raises :class:`ConfigError` if ``tp_degree`` cannot
    shard ``spec``, a count is not a positive integer, or ``context_tokens < new_tokens``.
    """
    shard = _shard(spec, tp_degree, shard)
    _check_positive("batch_size", batch_size, "batch size")
    _check_positive("new_tokens", new_tokens, "new tokens per sequence")
    _check_positive("context_tokens", context_tokens, "context tokens per sequence")
    if context_tokens < new_tokens:
        raise ConfigError(
            "context_tokens", f"must be at least new_tokens = {new_tokens} (got {context_tokens})"
        )
    b = spec.dtype_bytes
    h = spec.hidden_size
    tokens = batch_size * new_tokens
    q_width = len(shard.query_heads) * spec.head_dim
    kv_width = len(shard.kv_heads) * spec.head_dim
    qkv_width = q_width + 2 * kv_width
    mlp_width = len(shard.mlp_columns)
    projections = 2 if spec.mlp == "gated" else 1

    up = _linear_cost(spec, tokens, h, projections * mlp_width, projections * mlp_width if spec.linear_bias else 0)
    mlp_up = OpCost(
        flops=up.flops + tokens * mlp_width * _ACTIVATION_FLOPS[spec.mlp],
        bytes_read=up.bytes_read,
        bytes_written=tokens * mlp_width * b,
        weight_bytes=up.weight_bytes,
        workspace_bytes=up.workspace_bytes + tokens * mlp_width * b,
        prepass_bytes=up.prepass_bytes,
    )
    return {
        OpKind.LAYERNORM: _norm_cost(spec, tokens),
        OpKind.QKV_PROJ: _linear_cost(spec, tokens, h, qkv_width, qkv_width if spec.attention_bias else 0,
                                      value=h * kv_width),
        OpKind.ATTENTION: _attention_cost(
            spec, shard, batch_size=batch_size, new_tokens=new_tokens, context_tokens=context_tokens
        ),
        OpKind.OUT_PROJ: _linear_cost(spec, tokens, q_width, h, h if spec.linear_bias else 0),
        OpKind.MLP_UP: mlp_up,
        OpKind.MLP_DOWN: _linear_cost(spec, tokens, mlp_width, h, h if spec.linear_bias else 0,
                                      down=mlp_width * h),
    }


def head_op_costs(spec: ModelSpec, *, batch_size: int, new_tokens: int) -> dict[OpKind, OpCost]:
    """Cost of the master-only ops around the layers, for T = batch_size * new_tokens tokens.

    - EMBEDDING: gathers T rows of the (vocab, h) table, plus T rows of the position table and
      their sum if positions are learned; writes (T, h).
    - LAYERNORM: the last residual add and the final norm over (T, h).
    - LM_HEAD: (batch_size, h) @ (h, vocab) for the last position of each sequence only, as
      generation needs; writes the logits (batch_size, vocab) in the model dtype.

    Raises :class:`ConfigError` if a count is not a positive integer.
    """
    _check_positive("batch_size", batch_size, "batch size")
    _check_positive("new_tokens", new_tokens, "new tokens per sequence")
    b = spec.dtype_bytes
    h = spec.hidden_size
    tokens = batch_size * new_tokens
    tables = 2 if spec.learned_position_embeddings else 1
    table_rows = spec.vocab_size + (spec.max_position_embeddings if spec.learned_position_embeddings else 0)
    table_bytes = _embedding_bytes(spec)
    embedding = OpCost(
        flops=tokens * h * (tables - 1),
        # the gathered rows, as stored (a quantised row is dequantised as it is gathered)
        bytes_read=table_bytes * tokens * tables / table_rows,
        bytes_written=tokens * h * b,
        weight_bytes=table_bytes,
        workspace_bytes=tokens * h * b,
    )
    return {
        OpKind.EMBEDDING: embedding,
        OpKind.LAYERNORM: _norm_cost(spec, tokens),
        OpKind.LM_HEAD: _linear_cost(spec, batch_size, h, spec.vocab_size, 0, head=True),
    }


def forward_flops(spec: ModelSpec, tokens: int) -> float:
    """Estimated FLOPs of one forward pass over a single causal sequence of ``tokens`` tokens.

    ``2 * parameter_count * tokens`` (Kaplan et al., arXiv 2001.08361, section 2.1) plus QK^T and
    AV over the causal half of the attention matrix, ``4 * h * tokens (tokens + 1) / 2`` per layer
    (Megatron-LM, arXiv 2104.04473, appendix). It counts every parameter as a matmul for every
    token, embeddings and LM head included, so it is a cross-check for the per-op costs, not their
    sum. Raises :class:`ConfigError` if ``tokens`` is not a positive integer.
    """
    _check_positive("tokens", tokens, "token count")
    attention = spec.num_layers * 4 * spec.hidden_size * tokens * (tokens + 1) / 2
    return 2.0 * parameter_count(spec) * tokens + attention


def _check_positive(field: str, value: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(field, f"{what} must be a positive integer (got {value!r})")


def _norm_params(spec: ModelSpec) -> int:
    return spec.hidden_size * (2 if spec.norm == "layernorm" else 1)


def _shard(spec: ModelSpec, tp_degree: int, shard: TensorShard | None) -> TensorShard:
    """``shard``, or the slice every rank of an even split of ``tp_degree`` holds (its widths are
    all the accounting reads)."""
    if shard is not None:
        return shard
    check_tensor_parallel(spec, tp_degree)
    kv = kv_heads_per_rank(spec, tp_degree)
    return TensorShard(range(spec.num_attention_heads // tp_degree), range(kv),
                       range(spec.intermediate_size // tp_degree))


def _attention_block_parts(spec: ModelSpec, shard: TensorShard) -> tuple[int, int, int, int]:
    """(matrix, of which down projection: none, of which value projection, vector) parameters of
    a layer's attention block on ``shard``: the q/k/v and output projections (v alone); the input
    norm and the biases."""
    q_width = len(shard.query_heads) * spec.head_dim
    kv_width = len(shard.kv_heads) * spec.head_dim
    qkv_width = q_width + 2 * kv_width
    vectors = _norm_params(spec)
    if spec.attention_bias:
        vectors += qkv_width
    if spec.linear_bias:
        vectors += spec.hidden_size  # the output projection's bias, replicated
    return spec.hidden_size * qkv_width + q_width * spec.hidden_size, 0, spec.hidden_size * kv_width, vectors


def _mlp_block_parts(spec: ModelSpec, shard: TensorShard) -> tuple[int, int, int, int]:
    """(matrix, of which down projection, of which value projection: none, vector) parameters of
    a layer's MLP block on ``shard``: the projections (down alone); the post-attention norm and
    the biases."""
    mlp_width = len(shard.mlp_columns)
    projections = 2 if spec.mlp == "gated" else 1
    vectors = _norm_params(spec)
    if spec.linear_bias:
        vectors += projections * mlp_width + spec.hidden_size  # down bias replicated
    return (projections + 1) * spec.hidden_size * mlp_width, mlp_width * spec.hidden_size, 0, vectors


def _layer_params(parts: tuple[int, int, int, int]) -> int:
    """Parameters of a block's (matrix, down, value, vector) parts: the down and value
    projections are among the matrix's."""
    matrix, _down, _value, vector = parts
    return matrix + vector


def _stored_bytes(spec: ModelSpec, matrix: int, down: int, value: int, vector: int) -> int:
    """Bytes of a layer's ``matrix`` weights in the spec's format (``down`` and ``value`` of them
    down and value projections, :func:`_layer_matrix_bytes`) and ``vector`` ones (norms, biases)
    in its dtype."""
    return _layer_matrix_bytes(spec, matrix, down, value) + vector * spec.dtype_bytes


def _layer_matrix_bytes(spec: ModelSpec, elements: int, down: int = 0, value: int = 0) -> int:
    """Bytes of ``elements`` weights of a decoder layer's matrices, ``down`` and ``value`` of them
    down and value projections (stored higher in the ``_m`` mixes,
    :func:`models.weight_formats.matrix_bytes`)."""
    return matrix_bytes(elements, spec.weights, spec.dtype_bytes, raised=down + value, values=value,
                        num_layers=spec.num_layers, seventy_b=_llama_70b(spec))


def _llama_70b(spec: ModelSpec) -> bool:
    """Whether llama.cpp types ``spec`` a 70B model: 80 layers with grouped-query attention
    (``src/llama-model.cpp``, ``load_hparams``: ``case 80: type = hparams.n_head() ==
    hparams.n_head_kv() ? LLM_TYPE_65B : LLM_TYPE_70B``)."""
    return spec.num_layers == 80 and spec.num_kv_heads < spec.num_attention_heads


def _head_matrix_bytes(spec: ModelSpec, elements: int) -> int:
    """Bytes of ``elements`` weights of the LM head (or a token table tied to it), in the head's format."""
    return matrix_bytes(elements, head_format(spec.weights), spec.dtype_bytes)


def _embedding_bytes(spec: ModelSpec) -> int:
    """Bytes of the token table (in the head's format where tied to it) and any learned position table."""
    token = spec.vocab_size * spec.hidden_size
    size = _head_matrix_bytes(spec, token) if spec.tied_embeddings else matrix_bytes(
        token, spec.weights, spec.dtype_bytes)
    if spec.learned_position_embeddings:
        size += matrix_bytes(spec.max_position_embeddings * spec.hidden_size, spec.weights, spec.dtype_bytes)
    return size


def _embedding_params(spec: ModelSpec) -> int:
    embeddings = spec.vocab_size * spec.hidden_size
    if spec.learned_position_embeddings:
        embeddings += spec.max_position_embeddings * spec.hidden_size
    return embeddings


def _master_params(spec: ModelSpec) -> int:
    embeddings = _embedding_params(spec)
    lm_head = 0 if spec.tied_embeddings else spec.vocab_size * spec.hidden_size
    return embeddings + _norm_params(spec) + lm_head


def _linear_cost(spec: ModelSpec, tokens: int, in_features: int, out_features: int, bias_features: int, *,
                 head: bool = False, down: int = 0, value: int = 0) -> OpCost:
    """(tokens, in) @ (in, out) plus a bias of ``bias_features`` elements: activations and bias in
    the spec's dtype, the matrix as stored (``head``: the LM head's format,
    :mod:`models.weight_formats`). A quantised matrix multiplied by more than
    ``DEQUANTIZE_ABOVE_TOKENS`` tokens under ``QuantisedMatmul.DEQUANTIZE`` is first converted to
    the dtype (``prepass_bytes``: its blocks read, the dense copy written, that copy held as
    workspace), and the product reads the dense copy. ``down``, ``value``: how many of the matrix's
    weights are down and value projections (:func:`_layer_matrix_bytes`)."""
    b = spec.dtype_bytes
    elements = in_features * out_features
    weights = head_format(spec.weights) if head else spec.weights
    stored_bytes = (_head_matrix_bytes(spec, elements) if head
                    else _layer_matrix_bytes(spec, elements, down, value))
    output_bytes = tokens * out_features * b
    dequantize = (weights != WeightFormat.NATIVE and tokens > DEQUANTIZE_ABOVE_TOKENS
                  and spec.quantised_matmul == QuantisedMatmul.DEQUANTIZE)
    dense_bytes = elements * b if dequantize else 0
    return OpCost(
        flops=2 * tokens * in_features * out_features + tokens * bias_features,
        bytes_read=(dense_bytes or stored_bytes) + bias_features * b + tokens * in_features * b,
        bytes_written=output_bytes,
        weight_bytes=stored_bytes + bias_features * b,
        workspace_bytes=output_bytes + dense_bytes,
        prepass_bytes=stored_bytes + dense_bytes if dequantize else 0.0,
    )


def _norm_cost(spec: ModelSpec, tokens: int) -> OpCost:
    """Residual add then norm over (tokens, h): reads both addends, writes the sum and the norm."""
    elements = tokens * spec.hidden_size
    activation_bytes = 2 * elements * spec.dtype_bytes
    weight_bytes = _norm_params(spec) * spec.dtype_bytes
    return OpCost(
        flops=elements * (_RESIDUAL_ADD_FLOPS + _NORM_FLOPS[spec.norm]),
        bytes_read=activation_bytes + weight_bytes,
        bytes_written=activation_bytes,
        weight_bytes=weight_bytes,
        workspace_bytes=activation_bytes,
    )


def _attention_cost(
    spec: ModelSpec, shard: TensorShard, *, batch_size: int, new_tokens: int, context_tokens: int
) -> OpCost:
    b = spec.dtype_bytes
    d = spec.head_dim
    q_heads = len(shard.query_heads)
    kv_width = len(shard.kv_heads) * d
    # New token j (0-based) sits at position context - new + j and sees the keys up to itself.
    pairs = new_tokens * (context_tokens - new_tokens) + new_tokens * (new_tokens + 1) // 2
    scores = batch_size * q_heads * pairs
    query_bytes = batch_size * new_tokens * q_heads * d * b  # the output has the same shape
    if spec.attention == "eager":
        held_bytes = batch_size * q_heads * new_tokens * context_tokens * _eager_bytes_per_score(b)
    else:
        held_bytes = batch_size * q_heads * new_tokens * _SOFTMAX_STATISTIC_BYTES
    return OpCost(
        flops=scores * (4 * d + _SOFTMAX_FLOPS),
        bytes_read=query_bytes + batch_size * context_tokens * 2 * _cache_bytes(spec, kv_width),
        bytes_written=query_bytes + batch_size * new_tokens * 2 * _cache_bytes(spec, kv_width),
        weight_bytes=0,
        workspace_bytes=held_bytes + _QUERY_COPIES * query_bytes,
    )


def _cache_bytes(spec: ModelSpec, elements: int) -> int:
    """Bytes of ``elements`` KV-cache elements (one token's keys or values of some heads) as stored."""
    return cache_bytes(elements, spec.kv_cache, spec.dtype_bytes)


def _eager_bytes_per_score(dtype_bytes: int) -> int:
    """Bytes live per score element while eager attention soft-maxes: the scores in the model's
    dtype, then (below fp32) their fp32 copy and the fp32 probabilities, as the runtime's kernel
    and transformers' ``eager_attention_forward`` soft-max in fp32 (the masked scores' copy is
    freed by then); in fp32 the upcast is the masked copy itself, so scores, masked scores and
    probabilities. Measured on an H100 in bf16: 10.0 bytes per score (validation/gpu-report)."""
    return dtype_bytes + 2 * _FP32_BYTES if dtype_bytes < _FP32_BYTES else 3 * _FP32_BYTES
