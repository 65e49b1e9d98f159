"""``training.loss: fused``: a classifier that writes the logits' gradient over the logits (llm.c's
``fused_classifier``) holds one tensor of logits in the compute dtype where PyTorch's autograd
cross-entropy holds fp32 copies, log-probabilities and their gradients."""

from __future__ import annotations

import pytest

from models.catalog import get_model
from models.errors import ConfigError
from models.training import ActivationLayout, Loss, activation_bytes, loss_backward_bytes, training_memory
from sim.scenario import load_scenario, scenario_from_dict
from sim.training.simulate import simulate_training
from tests.conftest import ROOT, scenario_dict

GB = 1e9


def test_a_fused_loss_holds_the_logits_once_in_their_dtype():
    spec = get_model("gpt2").with_dtype("bf16")
    autograd = ActivationLayout(4, 512)
    fused = ActivationLayout(4, 512, loss=Loss.FUSED)
    logits = 4 * 512 * spec.vocab_size
    # the forward's peak: the logits (2 bytes) without the fp32 log-probabilities (4)
    assert activation_bytes(spec, autograd) - activation_bytes(spec, fused) == logits * 4
    # the loss's backward adds nothing: the gradient overwrites the logits
    assert loss_backward_bytes(spec, fused) == activation_bytes(spec, fused)
    assert loss_backward_bytes(spec, autograd) - loss_backward_bytes(spec, fused) == logits * (12 - 2)
    states = dict(optimizer="adamw", precision="bf16_mixed", accumulation=4)
    assert (training_memory(spec, fused, **states).activations
            < training_memory(spec, autograd, **states).activations)


def test_llm_c_gpt2_350m_fits_the_80_gb_a100_it_ran_on_only_with_its_fused_classifier():
    # karpathy/llm.c scripts/run_gpt2_350M.sh: micro-batch 64 x 1024 tokens per A100 80GB SXM
    scenario = load_scenario(ROOT / "validation/published/llmc_gpt2_350m_8x_a100.yaml")
    variant = scenario.config.variants[0]
    assert scenario.training_settings(variant).loss == Loss.FUSED

    def peak_bytes(loss: str) -> float:
        data = scenario.config.model_dump(mode="json", by_alias=True, exclude_none=True)
        data["training"]["loss"] = loss
        data["model"] = str(ROOT / "validation/published" / data["model"])
        memory = simulate_training(scenario_from_dict(data)).variants[0].memory
        return max(m.total for m in memory.values())

    assert peak_bytes("fused") < 80 * GB < peak_bytes("autograd")


def test_an_unknown_loss_names_the_field_and_the_runtime_refuses_a_fused_one():
    training = {"workload": {"kind": "training", "global_batch_size": 4, "micro_batch_size": 1, "sequence_length": 16},
                "variants": [{"name": "ddp"}]}
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(scenario_dict(**training, training={"loss": "chunked"}))
    assert error.value.field == "training.loss"
    pytest.importorskip("torch")
    from runtime.training.trainer import TrainingSetup

    scenario = scenario_from_dict(scenario_dict(**training, training={"loss": "fused"}))
    with pytest.raises(ConfigError) as error:
        TrainingSetup.of(scenario, scenario.config.variants[0], (0, 1))
    assert error.value.field == "training.loss" and "'fused'" in error.value.message
