"""The training half of the scenario schema: what a user writes for a training job, its batch
arithmetic and its one-line errors (sim/training_config.py, sim/scenario.py)."""

import copy
from pathlib import Path

import pytest
import yaml

from models.errors import ConfigError
from sim.scenario import load_scenario, scenario_from_dict
from sim.training_config import MIB, Averaging, micro_batching

SCENARIO = Path(__file__).parent / "data" / "training_small.yaml"


def _document() -> dict:
    return yaml.safe_load(SCENARIO.read_text())


def _error(mutate) -> str:
    document = _document()
    mutate(document)
    with pytest.raises(ConfigError) as caught:
        scenario_from_dict(document)
    return str(caught.value)


def test_variants_override_the_training_section_field_by_field():
    scenario = load_scenario(SCENARIO)
    base, small, accumulate = (scenario.training_settings(v) for v in scenario.config.variants)
    assert scenario.config.is_training
    assert base.bucket_cap_bytes == 25 * MIB and base.first_bucket_bytes == MIB
    assert small.bucket_cap_bytes == MIB and small.optimizer == base.optimizer
    assert accumulate.activation_checkpointing == 2 and accumulate.bucket_cap_bytes == 25 * MIB


def test_batches_follow_global_equals_micro_times_data_times_accumulation():
    scenario = load_scenario(SCENARIO)
    workload = scenario.config.workload
    base, _, accumulate = (scenario.training_settings(v) for v in scenario.config.variants)
    assert micro_batching(workload, base, 4) == (2, 2)  # the workload's micro batch kept
    assert micro_batching(workload, accumulate, 4) == (1, 4)  # the global batch kept
    with pytest.raises(ConfigError, match="global_batch_size"):
        micro_batching(workload, base, 3)


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["workload"].update(micro_batch_size=0), "workload.micro_batch_size: "),
    (lambda d: d["workload"].update(micro_batch_size=32), "workload.micro_batch_size: larger than global_batch_size"),
    (lambda d: d["workload"].update(kind="trainin"), "workload.kind: unknown workload kind"),
    (lambda d: d["workload"].update(sequence_length=5000), "workload.sequence_length: exceeds gpt2's context"),
    (lambda d: d["training"].update(bucket_cap_mb=0), "training.bucket_cap_mb: "),
    (lambda d: d["training"].update(allreduce="foo"), "training.allreduce: unknown allreduce algorithm"),
    (lambda d: d["training"].update(optimizer="lion"), "training.optimizer: "),
    (lambda d: d["training"].update(averaging_period=4), "training.averaging_period: applies to averaging: parameters"),
    (lambda d: d["training"].update(activation_checkpointing=0), "training.activation_checkpointing: "),
    (lambda d: d["variants"][1]["training"].update(zero=2), "variants[1].training.zero: "),
    (lambda d: d["variants"][1].update(memory={"policy": "resident"}), "variants[1].memory: "),
    # inference layouts the training simulator would ignore: a training job is tensor x data
    (lambda d: d.update(parallel={"pipeline": 2, "replicas": 2}), "parallel.pipeline: applies to inference workloads"),
    (lambda d: d.update(parallel={"replicas": 2}), "parallel.replicas: applies to inference workloads"),
    (lambda d: d["variants"][1].update(parallel={"shares": "compute"}),
     "variants[1].parallel.shares: applies to inference workloads; a training job runs parallel.tensor x "
     "parallel.data (got compute)"),
])
def test_bad_training_fields_are_named(mutate, expected):
    assert _error(mutate).startswith(expected)


def test_parameter_averaging_takes_a_period_and_none_turns_checkpointing_off():
    document = _document()
    document["training"].update(averaging="parameters", averaging_period=8, activation_checkpointing="none")
    settings = scenario_from_dict(document).config.training
    assert settings.averaging is Averaging.PARAMETERS and settings.averaging_period == 8
    assert settings.activation_checkpointing is None


def test_inference_scenarios_refuse_training_sections():
    document = yaml.safe_load((Path(__file__).parents[1] / "scenarios" / "low_resource_llama2_7b.yaml").read_text())
    for mutate, expected in [
        (lambda d: d.update(training={}), "training: applies to workload kind: training"),
        (lambda d: d.update(parallel={"data": 2}), "parallel.data: data parallelism applies to training"),
        (lambda d: d["variants"][0].pop("strategy"), "variants[0].strategy: Field required"),
        (lambda d: d["variants"][0].update(training={"overlap": False}), "variants[0].training: applies to"),
    ]:
        bad = copy.deepcopy(document)
        mutate(bad)
        with pytest.raises(ConfigError) as caught:
            scenario_from_dict(bad)
        assert str(caught.value).startswith(expected)
