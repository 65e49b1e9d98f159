"""A quantised KV cache (``kv_cache: q8_0 | q4_0 | fp8``): the bytes a token adds, the context a
device holds, and the cache a decode step reads."""

from __future__ import annotations

import pytest

from models.accounting import kv_cache_bytes_per_token, layer_op_costs
from models.cache_formats import cache_bytes
from models.catalog import get_model
from models.errors import ConfigError
from sim.profile import load_profile
from sim.scenario import scenario_from_dict
from sim.simulate import simulate
from tests.conftest import cluster, scenario_dict

GIB = 2 ** 30


@pytest.mark.parametrize("kv_cache, per_token", [
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims, keys and values
    ("native", 2 * 32 * 1024 * 2), ("fp8", 2 * 32 * 1024), ("q8_0", 2 * 32 * 32 * 34), ("q4_0", 2 * 32 * 32 * 18),
])
def test_a_token_adds_its_keys_and_values_in_the_caches_format(kv_cache, per_token):
    spec = get_model("llama-3.1-8b").with_dtype("fp16").with_kv_cache(kv_cache)
    assert kv_cache_bytes_per_token(spec) == per_token
    assert cache_bytes(33, "q4_0", 2) == 36  # whole blocks


def test_a_decode_step_reads_the_cache_as_stored():
    spec = get_model("llama-3.1-8b").with_dtype("fp16")
    step = dict(tp_degree=1, batch_size=1, new_tokens=1, context_tokens=32768)
    dense = layer_op_costs(spec, **step)["attention"].bytes_read
    quantised = layer_op_costs(spec.with_kv_cache("q4_0"), **step)["attention"].bytes_read
    assert dense / quantised == pytest.approx(2 / (18 / 32), rel=0.01)


def _peak_and_tpot(kv_cache: str) -> tuple[float, float]:
    data = scenario_dict(model="llama-3.1-8b", dtype="fp16", weights="q4_k_m", kv_cache=kv_cache,
                         cluster=cluster(1, 1, device="rtx_3060_12gb"),
                         workload={"batch_size": 1, "prompt_tokens": 65536, "output_tokens": 4},
                         variants=[{"name": "one", "strategy": "allreduce_ln", "allreduce": "ring"}])
    result = simulate(scenario_from_dict(data))
    table = result.results
    return (table.loc[table["metric"] == "peak_memory_bytes", "value"].max() / GIB,
            table.loc[table["metric"] == "tpot_s", "value"].iloc[0])


def test_a_64k_context_holds_a_quarter_of_the_cache_in_q4_0_and_decodes_faster():
    dense_peak, dense_tpot = _peak_and_tpot("native")
    quantised_peak, quantised_tpot = _peak_and_tpot("q4_0")
    # 65540 tokens x 128 KiB of fp16 keys and values (8.0 GiB), x 18 / 64 in q4_0 (2.25 GiB)
    assert dense_peak - quantised_peak == pytest.approx(65540 * 131072 * (1 - 18 / 64) / GIB, rel=0.01)
    assert quantised_tpot < dense_tpot


def test_the_simulation_says_how_it_priced_the_cache():
    data = scenario_dict(model="llama-2-7b", kv_cache="fp8", cluster=cluster(1, 1, device="rtx_4090"),
                         variants=[{"name": "tp1", "strategy": "allreduce_ln", "allreduce": "ring"}])
    assert any(line.startswith("kv_cache: fp8, 1 bytes per 1 elements")
               for line in simulate(scenario_from_dict(data)).network.sources)


def test_bad_cache_settings_name_the_field(root):
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(scenario_dict(kv_cache="q2_k"))
    assert error.value.field == "kv_cache"
    training = scenario_dict(kv_cache="q8_0", variants=[{"name": "ddp"}],
                             workload={"kind": "training", "global_batch_size": 4, "micro_batch_size": 1,
                                       "sequence_length": 16})
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(training)
    assert error.value.field == "kv_cache"
    profile = load_profile(root / "validation/report/profiles/v2x2_bandwidth.csv")
    with pytest.raises(ConfigError) as error:
        simulate(scenario_from_dict(scenario_dict(kv_cache="q8_0")), profile=profile)
    assert error.value.field == "kv_cache"
