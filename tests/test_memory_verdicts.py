"""Memory verdicts as frameworks run: fused attention holds no score matrix, every rank holds its
backend's framework baseline, and the runtime runs the kernel the scenario names."""

import pytest
import torch

from models.errors import ConfigError
from runtime.model import RankModel
from sim.devices import get_device
from sim.framework import BASELINES, Backend, default_runtime_memory
from sim.program import MemoryCategory
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import cluster
from tests.test_runtime_model import SPECS


def _batch64_prompt8k(attention: str) -> dict:
    """Qwen2.5-0.5B serving 64 prompts of 8k tokens on 2 RTX 4090 (TP=2)."""
    return {"name": "b64_8k", "model": "qwen2.5-0.5b", "attention": attention,
            "cluster": cluster(1, 2, device="rtx_4090"),
            "workload": {"batch_size": 64, "prompt_tokens": 8192, "output_tokens": 4},
            "variants": [{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}]}


def test_batch_64_at_an_8k_prompt_fits_rtx_4090s_with_sdpa_and_not_with_eager_attention():
    sdpa = simulate(scenario_from_dict(_batch64_prompt8k("sdpa")), expand_steps=()).variants[0]
    assert sdpa.overflow is None
    assert max(sdpa.run.peak_bytes.values()) < 24 * 2**30
    eager = simulate(scenario_from_dict(_batch64_prompt8k("eager")), expand_steps=()).variants[0]
    assert eager.overflow is not None
    assert (eager.overflow.phase, eager.overflow.layer, eager.overflow.op_name) == ("prefill", 0, "attention")
    # The kernel changes memory only: the roofline prices both the same.
    assert eager.timing["ttft_s"] == sdpa.timing["ttft_s"]


def test_an_unknown_attention_kernel_in_a_scenario_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(_batch64_prompt8k("flash"))
    assert error.value.field == "attention" and "'flash'" in error.value.message


def test_each_rank_holds_its_backends_documented_baseline():
    gpu, cpu = get_device("rtx_4090"), get_device("cpu")
    assert default_runtime_memory({0: gpu, 1: gpu}) == {r: BASELINES[Backend.NCCL].bytes_for(2) for r in (0, 1)}
    # A lone GPU opens no communicator: its CUDA context and cuBLAS workspace only.
    alone = default_runtime_memory({0: gpu})[0]
    assert alone == BASELINES[Backend.NCCL].framework_bytes < default_runtime_memory({0: gpu, 1: gpu})[0]
    assert 500 * 2**20 < alone < 1 * 2**30
    assert default_runtime_memory({0: cpu, 1: cpu}) == {0: 268_000_000, 1: 268_000_000}


def test_without_a_profile_every_rank_starts_with_its_baseline():
    data = {"name": "gpt2_cpu", "model": "gpt2", "cluster": cluster(1, 2, device="cpu"),
            "workload": {"batch_size": 1, "prompt_tokens": 16, "output_tokens": 2},
            "variants": [{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}]}
    run = simulate(scenario_from_dict(data), expand_steps=()).variants[0].run
    assert {r: c[MemoryCategory.RUNTIME] for r, c in run.peak_by_category.items()} == {0: 268_000_000, 1: 268_000_000}


@pytest.mark.parametrize("name", ["gpt2", "qwen"])  # multi-head, grouped-query
def test_the_runtime_runs_sdpa_and_eager_to_the_same_values(name):
    """Prefill, a chunk after a prefix (the masked case) and a decode step, both kernels."""
    spec = SPECS[name]
    outputs = {}
    for attention in ("sdpa", "eager"):
        rank = RankModel(spec.with_attention(attention), 1, 0, seed=3, batch_size=2, max_tokens=12)
        q = torch.randn(2, 12, rank.num_heads, spec.head_dim, generator=torch.Generator().manual_seed(1))
        k = torch.randn(2, 12, rank.num_kv_heads, spec.head_dim, generator=torch.Generator().manual_seed(2))
        v = torch.randn(2, 12, rank.num_kv_heads, spec.head_dim, generator=torch.Generator().manual_seed(3))
        spans = ((0, 6), (6, 5), (11, 1))
        outputs[attention] = [rank.attention(q[:, s:s + t], k[:, s:s + t], v[:, s:s + t], 0, s) for s, t in spans]
    for fused, eager in zip(outputs["sdpa"], outputs["eager"]):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
