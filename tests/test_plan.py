"""The plan: per-rank programs of the two strategies, as Megatron tensor parallelism prescribes."""

from collections import Counter

import pytest

from models.accounting import kv_cache_bytes_per_token, parameter_count
from models.catalog import get_model
from models.ops import OpKind
from sim.plan import MemoryCategory, Plan, StrategyChoice


def _plan(strategy: StrategyChoice, tp: int = 4, model: str = "llama-2-7b", output_tokens: int = 4) -> Plan:
    return Plan(get_model(model), tuple(range(tp)), batch_size=2, prompt_tokens=16, output_tokens=output_tokens,
                strategy=strategy)


def _kinds_per_forward(plan: Plan, step: int, rank: int) -> Counter:
    counts: Counter = Counter()
    for segment in plan.phase(step).segments:
        for op in segment.programs[rank]:
            counts[op.kind] += segment.repeat
    return counts


def test_allreduce_ln_has_two_allreduces_per_layer_and_norms_everywhere():
    plan = _plan(StrategyChoice("allreduce_ln", allreduce="ring"))
    layers = plan.model.num_layers
    for rank in plan.ranks:
        kinds = _kinds_per_forward(plan, 0, rank)
        assert kinds[OpKind.ALLREDUCE] == 2 * layers
        assert kinds[OpKind.QKV_PROJ] == kinds[OpKind.MLP_DOWN] == layers
        assert kinds[OpKind.BROADCAST] == 1  # the embedding, from the master
        # every rank normalises its copy: attn_norm and mlp_norm of each layer
        assert kinds[OpKind.LAYERNORM] == 2 * layers + (1 if rank == plan.master else 0)
    assert _kinds_per_forward(plan, 0, 0)[OpKind.LM_HEAD] == 1
    assert _kinds_per_forward(plan, 0, 1)[OpKind.LM_HEAD] == 0


def test_reduce_ln_bcast_normalises_on_the_master_only():
    plan = _plan(StrategyChoice("reduce_ln_bcast"))
    layers = plan.model.num_layers
    master, worker = _kinds_per_forward(plan, 1, 0), _kinds_per_forward(plan, 1, 1)
    assert master[OpKind.REDUCE] == worker[OpKind.REDUCE] == 2 * layers
    # one broadcast per sub-layer input: attention inputs of every layer, MLP inputs of every layer
    assert master[OpKind.BROADCAST] == worker[OpKind.BROADCAST] == 2 * layers
    assert master[OpKind.LAYERNORM] == 2 * layers + 1 and worker[OpKind.LAYERNORM] == 0
    assert OpKind.ALLREDUCE not in master


def test_collective_messages_are_one_hidden_state_of_the_new_tokens():
    plan = _plan(StrategyChoice("allreduce_ln", allreduce="ring"))
    spec = plan.model
    for step, tokens in ((0, 16), (1, 1)):
        sizes = {op.collective.size_bytes for seg in plan.phase(step).segments for op in seg.programs[0]
                 if op.collective is not None}
        assert sizes == {2 * tokens * spec.hidden_size * spec.dtype_bytes}


def test_collective_calls_match_across_ranks():
    plan = _plan(StrategyChoice("reduce_ln_bcast"))
    for segment in plan.phase(0).segments:
        calls = [[(op.call, op.kind) for op in segment.programs[r] if op.collective] for r in plan.ranks]
        assert all(c == calls[0] for c in calls)


def test_weights_over_ranks_add_up_to_the_model():
    plan = _plan(StrategyChoice("allreduce_ln", allreduce="ring"))
    total = sum(m[MemoryCategory.WEIGHTS] for m in plan.initial_memory_bytes.values())
    whole = parameter_count(plan.model) * plan.model.dtype_bytes
    replicated_norms = (len(plan.ranks) - 1) * 2 * plan.model.num_layers * plan.model.hidden_size * 2
    assert total == whole + replicated_norms


def test_kv_cache_allocated_per_layer_per_new_token():
    plan = _plan(StrategyChoice("allreduce_ln", allreduce="ring"))
    for step, tokens in ((0, 16), (2, 1)):
        kv = sum(size * seg.repeat for seg in plan.phase(step).segments for op in seg.programs[1]
                 for cat, size in op.alloc if cat == MemoryCategory.KV_CACHE)
        assert kv == kv_cache_bytes_per_token(plan.model, 4) * 2 * tokens


def test_layers_are_one_repeated_segment_plus_the_last():
    phase = _plan(StrategyChoice("allreduce_ln", allreduce="ring")).phase(0)
    assert [s.name for s in phase.segments] == ["prologue", "layer", "layer_last"]
    assert phase.segments[1].repeat == 31
    assert phase.layer_of_segment == (None, 0, 31)


def test_phase_outside_the_run_is_an_error():
    plan = _plan(StrategyChoice("allreduce_ln", allreduce="ring"), output_tokens=3)
    with pytest.raises(IndexError):
        plan.phase(3)
