"""The strategy registry, validated choices and policies, the parallel plan and typed ops."""

from __future__ import annotations

import pytest

from models.catalog import get_model
from models.errors import ConfigError
from models.ops import OpKind
from sim.parallel import ParallelPlan
from sim.plan import MemoryPolicy, Plan
from sim.program import Carries, NormSite, ProgramBuilder
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from sim.strategies import STRATEGIES, StrategyChoice
from sim.strategies.tensor_parallel import Group, TensorParallel, norm
from tests.conftest import ROOT, scenario_dict


class ResidualBcastReduceLn(TensorParallel):
    """A strategy as a new module would write it: allreduce_ln's prologue (the master broadcasts
    the embedded residual stream, every rank normalises it), reduce_ln_bcast's combines."""

    name = "residual_bcast_reduce_ln"
    calls = ((OpKind.REDUCE, "reduce"), (OpKind.BROADCAST, "broadcast"))

    def hand_out(self, prog: ProgramBuilder, group: Group) -> None:
        prog.collective("embed_bcast", group.call(OpKind.BROADCAST), carries=Carries.RESIDUAL)
        norm(prog, group.ranks, group, NormSite.ATTENTION, closes_layer=False)

    def combine(self, prog, group, sub, site, closes_layer) -> None:
        prog.collective(f"{sub}_reduce", group.call(OpKind.REDUCE))
        norm(prog, (group.master,), group, site, closes_layer)
        prog.collective(f"{site}_bcast", group.call(OpKind.BROADCAST), carries=Carries.NORMALISED)

    def combine_final(self, prog, group, sub) -> None:
        prog.collective(f"{sub}_reduce", group.call(OpKind.REDUCE))


def test_a_new_strategy_is_one_module_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(STRATEGIES, ResidualBcastReduceLn.name, ResidualBcastReduceLn())  # the registry line
    variants = [{"name": "new", "strategy": "residual_bcast_reduce_ln", "reduce": "star"},
                {"name": "old", "strategy": "reduce_ln_bcast", "reduce": "star"}]
    scenario = scenario_from_dict(scenario_dict(variants=variants), base_dir=ROOT)
    result = simulate(scenario)
    new, old = (result.variant(n) for n in ("new", "old"))
    assert new.timing["ttft_s"] > 0 and new.algorithms == ("broadcast=binomial", "reduce=star")
    # The prologue hands out the residual stream, which every rank normalises; the layers are
    # reduce_ln_bcast's.
    new_phase, old_phase = (scenario.plan(v, result.ranks).phase(0) for v in scenario.config.variants)
    assert [op.name for op in new_phase.segments[0].programs[1]] == ["embed_bcast", "attn_norm"]
    assert new_phase.segments[1:] == old_phase.segments[1:]


def test_calibration_asks_the_registry_which_collectives_a_strategy_calls(monkeypatch):
    pytest.importorskip("torch")
    from runtime.calibrate import used_algorithms

    monkeypatch.setitem(STRATEGIES, ResidualBcastReduceLn.name, ResidualBcastReduceLn())
    scenario = scenario_from_dict(scenario_dict(variants=[
        {"name": "new", "strategy": "residual_bcast_reduce_ln", "reduce": "star", "broadcast": "library"},
        {"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}]), base_dir=ROOT)
    assert used_algorithms(scenario) == {OpKind.ALLREDUCE: ("ring",), OpKind.REDUCE: ("star",),
                                         OpKind.BROADCAST: ("binomial", "library")}


@pytest.mark.parametrize("kwargs,field,needles", [
    ({"strategy": "reduce_ln_bcst"}, "strategy", ["'reduce_ln_bcst'", "reduce_ln_bcast", "allreduce_ln"]),
    ({"strategy": "allreduce_ln"}, "allreduce", ["needs 'allreduce'"]),
    ({"strategy": "allreduce_ln", "allreduce": "telepathy"}, "allreduce", ["'telepathy'", "ring", "library", "auto"]),
    ({"strategy": "reduce_ln_bcast", "broadcast": "ring"}, "broadcast", ["'ring'", "binomial", "star"]),
    ({"strategy": "reduce_ln_bcast", "allreduce": "ring"}, "allreduce", ["not 'allreduce'"]),
])
def test_an_unknown_or_misplaced_name_fails_at_construction(kwargs, field, needles):
    with pytest.raises(ConfigError) as error:
        StrategyChoice(**kwargs)
    assert error.value.field == field
    assert all(needle in error.value.message for needle in needles), error.value.message


def test_an_unknown_memory_policy_fails_at_construction():
    with pytest.raises(ConfigError) as error:
        MemoryPolicy("slidng_window")
    assert error.value.field == "memory.policy"
    assert "'slidng_window'" in error.value.message and "sliding_window" in error.value.message
    assert MemoryPolicy("sliding_window", 2).streams


def test_a_scenario_names_the_variant_field_of_an_unknown_strategy():
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(scenario_dict(variants=[{"name": "x", "strategy": "pipeline_magic"}]), base_dir=ROOT)
    assert error.value.field == "variants[0].strategy"
    assert "pipeline_magic" in error.value.message and "allreduce_ln" in error.value.message


@pytest.mark.parametrize("strategy", [StrategyChoice("reduce_ln_bcast"), StrategyChoice("allreduce_ln", "ring")])
def test_ops_say_what_they_do(strategy):
    plan = Plan(get_model("llama-2-7b"), (0, 1, 2, 3), 1, 16, 2, strategy)
    for seg in plan.phase(0).segments:
        for ops in seg.programs.values():
            for op in ops:
                assert (op.norm_site is not None) == (op.kind == OpKind.LAYERNORM)
                assert (op.carries is not None) == (op.kind == OpKind.BROADCAST)
                if op.kind in (OpKind.QKV_PROJ, OpKind.OUT_PROJ, OpKind.MLP_UP, OpKind.MLP_DOWN, OpKind.LAYERNORM):
                    assert (op.weight_block is None) == (op.norm_site == NormSite.FINAL)


DEVICES = ("h0/dev0", "h0/dev1", "h1/dev0", "h1/dev1")


def test_parallel_plan_places_the_first_devices_by_default():
    plan = ParallelPlan(get_model("gpt2"), DEVICES, tensor=2)
    assert plan.tensor_ranks == (0, 1) and (plan.data, plan.pipeline) == (1, 1)
    assert ParallelPlan(get_model("gpt2"), DEVICES, tensor=2, placement=(2, 0)).tensor_ranks == (2, 0)


@pytest.mark.parametrize("kwargs,field,needles", [
    ({"tensor": 0}, "parallel.tensor", ["tensor 0 x data 1 x pipeline 1"]),
    ({"tensor": 2, "data": 2, "placement": (1, 0)}, "parallel.placement", ["tensor 2 x data 2 x pipeline 1"]),
    ({"tensor": 2, "data": 3}, "parallel.tensor", ["6 ranks", "4 devices"]),
    ({"tensor": 6}, "parallel.tensor", ["6 ranks", "4 devices", "h1/dev1"]),
    ({"tensor": 5}, "parallel.tensor", ["5 ranks"]),
    ({"tensor": 2, "placement": (0, 4)}, "parallel.placement", ["device 4", "h1/dev1"]),
    ({"tensor": 2, "placement": (1, 1)}, "parallel.placement", ["h0/dev1"]),
    ({"tensor": 2, "placement": (1,)}, "parallel.placement", ["1 placements"]),
])
def test_parallel_plan_names_degrees_and_devices_in_its_errors(kwargs, field, needles):
    with pytest.raises(ConfigError) as error:
        ParallelPlan(get_model("gpt2"), DEVICES, **kwargs)
    assert error.value.field == field
    assert all(needle in error.value.message for needle in needles), error.value.message


def test_tensor_degree_must_shard_the_heads():
    with pytest.raises(ConfigError, match="12 attention heads"):
        ParallelPlan(get_model("gpt2"), DEVICES * 2, tensor=8)
