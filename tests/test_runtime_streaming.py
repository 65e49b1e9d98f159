"""Weight streaming in the runtime: block files written once and reused; sliding-window plans
generate the reference tokens on 1 and 2 gloo ranks; released blocks are really freed; loads are
traced and paced to the loader link, whose storage the ranks of a host share."""

import gc
import json
import time
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from models.accounting import layer_block_weight_bytes  # noqa: E402
from models.errors import ConfigError  # noqa: E402
from runtime.blocks import BlockLoader, BlockStore  # noqa: E402
from runtime.comm import Communicator  # noqa: E402
from runtime.executor import Executor  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.model import RankModel, reference_generate  # noqa: E402
from runtime.pacing import LoaderLink, Pacer  # noqa: E402
from runtime.weights import block_names, block_of, prompt_tokens  # noqa: E402
from sim.plan import MemoryPolicy, Plan, StrategyChoice  # noqa: E402
from sim.topology import build_topology  # noqa: E402
from tests.conftest import cluster, make_scenario, tiny_model_config  # noqa: E402

LLAMA_LIKE = tiny_model_config("llama", num_layers=4)
GPT2_LIKE = tiny_model_config("gpt2", num_layers=3)
POLICIES = [MemoryPolicy("sliding_window", 1), MemoryPolicy("sliding_window", 2),
            MemoryPolicy("sliding_window", 1, retain_every=3), MemoryPolicy("sliding_window", 2, retain_every=4)]
STRATEGIES = [StrategyChoice("reduce_ln_bcast", reduce="library", broadcast="library"),
              StrategyChoice("allreduce_ln", allreduce="ring", broadcast="binomial")]
WORKLOAD = {"batch_size": 2, "prompt_tokens": 5, "output_tokens": 3}
SEED = 7


def _scenario(tmp_path: Path, config: dict, tp: int, **overrides):
    path = tmp_path / f"{config['model_type']}.config.json"
    path.write_text(json.dumps(config))
    hosts = cluster(tp, 1, device="cpu")
    hosts["hosts"][0]["storage"] = {"bandwidth": "2GB/s", "latency": "100us"}
    return make_scenario(model=str(path), dtype="fp32", cluster=hosts, workload=WORKLOAD, **overrides)


def _reference(spec):
    prompt = prompt_tokens(spec, WORKLOAD["batch_size"], WORKLOAD["prompt_tokens"], seed=SEED)
    tokens, hidden = reference_generate(spec, seed=SEED, prompt=prompt, output_tokens=WORKLOAD["output_tokens"])
    return prompt, tokens, torch.stack(hidden, 1)


def _model(spec, tp, index, **kwargs):
    return RankModel(spec, tp, index, seed=SEED, batch_size=WORKLOAD["batch_size"],
                     max_tokens=WORKLOAD["prompt_tokens"] + WORKLOAD["output_tokens"], **kwargs)


def _plan(spec, tp, choice, policy):
    return Plan(spec, tuple(range(tp)), WORKLOAD["batch_size"], WORKLOAD["prompt_tokens"], WORKLOAD["output_tokens"],
                choice, {}, policy)


def _expected_state(model, plan, rank):
    """The tensors a rank holds between generations: everything but the streamed blocks past the window."""
    later = {b.name for b in plan.streamed_blocks[rank][plan.memory_policy.window:]}
    return {name for name in _model(model.spec, model.tp_degree, model.rank_index).weights
            if block_of(name) not in later}


def _expected_loads(plan, rank):
    """Per phase, the loader fetches streamed positions w..N-1, then 0..w-1 for the next phase."""
    blocks, w = plan.streamed_blocks[rank], plan.memory_policy.window
    return [f"load_{b.name}" for b in blocks[w:] + blocks[:w]]


def test_block_files_hold_the_rank_shards_and_are_written_once(tmp_path):
    spec = _scenario(tmp_path, GPT2_LIKE, 2).model
    model = _model(spec, 2, 1)
    store = BlockStore(model, tmp_path / "blocks")
    assert store.write_missing() == list(block_names(spec))
    stamps = {b: store.path(b).stat().st_mtime_ns for b in block_names(spec)}
    assert BlockStore(_model(spec, 2, 1), tmp_path / "blocks").write_missing() == []  # reused, not rewritten
    assert {b: store.path(b).stat().st_mtime_ns for b in block_names(spec)} == stamps
    assert not list(store.directory.glob(".*.tmp"))
    assert BlockStore(_model(spec, 2, 0), tmp_path / "blocks").directory != store.directory

    sizes = layer_block_weight_bytes(spec, 2)
    loader = BlockLoader(store, "cpu")
    for block in ("layer1.attention", "layer2.mlp"):
        tensors, nbytes = loader.fetch(block)
        assert nbytes == sizes[block.split(".")[1]]  # what the plan's WeightBlock says it moves
        expected = {n: t for n, t in model.weights.items() if block_of(n) == block}
        assert tensors.keys() == expected.keys() == safetensors_torch.load_file(store.path(block)).keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("config", [LLAMA_LIKE, GPT2_LIKE], ids=["llama_gqa", "gpt2"])
def test_one_rank_streams_to_the_reference_tokens_and_frees_what_it_releases(tmp_path, config):
    spec = _scenario(tmp_path, config, 1).model
    prompt, ref_tokens, ref_hidden = _reference(spec)
    model = _model(spec, 1, 0, skip_blocks=block_names(spec))
    store = BlockStore(model, tmp_path / "blocks")
    store.write_missing()
    loader = BlockLoader(store, "cpu")
    dropped = []
    drop_block = model.drop_block

    def spy(block):  # weak references to every tensor released, and to the buffer behind it
        for name, tensor in list(model.weights.items()):  # the loader thread may add meanwhile
            if block_of(name) == block:
                dropped.extend(weakref.ref(t) for t in (tensor, tensor._base) if t is not None)
        drop_block(block)

    model.drop_block = spy
    for policy in POLICIES:
        for choice in STRATEGIES:
            plan = _plan(spec, 1, choice, policy)
            assert plan.streamed_blocks[0], policy
            generation = Executor(plan, model, Communicator(0, None), 0, loader=loader).generate(
                prompt, time.perf_counter())
            label = f"{policy.label()} {choice.strategy}"
            assert torch.equal(torch.stack(generation.tokens, 1), ref_tokens), label
            torch.testing.assert_close(torch.stack(generation.hidden, 1), ref_hidden, rtol=1e-4, atol=1e-5)
            assert set(model.weights) == _expected_state(model, plan, 0), label
            loads = [r for r in generation.records if r.stream == "loader"]
            assert {r.kind for r in loads} == {"weight_load"}
            for step in range(plan.num_phases):
                assert [r.name for r in loads if r.step == step] == _expected_loads(plan, 0), label
    gc.collect()
    assert dropped and all(ref() is None for ref in dropped), "a released block is still referenced"


def test_loads_are_paced_to_the_loader_link(tmp_path):
    spec = _scenario(tmp_path, LLAMA_LIKE, 1).model
    model = _model(spec, 1, 0)
    store = BlockStore(model, tmp_path / "blocks")
    store.write_missing()
    link = LoaderLink.single(bandwidth_bytes_per_s=20e6, latency_s=0.004)
    plan = _plan(spec, 1, STRATEGIES[1], POLICIES[0])
    loader = BlockLoader(store, "cpu", Pacer(link))
    generation = Executor(plan, model, Communicator(0, None), 0, loader=loader).generate(
        _reference(spec)[0], time.perf_counter())
    loads = [r for r in generation.records if r.stream == "loader"]
    assert len(loads) == plan.num_phases * len(_expected_loads(plan, 0))
    for record in loads:
        assert record.end_s - record.start_s >= link.min_duration_s(record.bytes) * 0.999, record


def test_a_streaming_plan_needs_a_loader_and_a_storage_link(tmp_path):
    scenario = _scenario(tmp_path, LLAMA_LIKE, 1)
    model = _model(scenario.model, 1, 0)
    with pytest.raises(ValueError, match="needs a BlockLoader"):
        Executor(_plan(scenario.model, 1, STRATEGIES[0], POLICIES[0]), model, Communicator(0, None), 0)
    link = LoaderLink.of(build_topology(scenario.config.cluster), 0)
    assert (link.bandwidth_bytes_per_s, link.latency_s) == (2e9, pytest.approx(100e-6))
    bare = build_topology(make_scenario(cluster=cluster(1, 1, device="cpu")).config.cluster)
    with pytest.raises(ConfigError, match="no storage link"):
        LoaderLink.of(bare, 0)


def test_ranks_of_one_host_share_its_storage(tmp_path):
    scenario = _scenario(tmp_path, LLAMA_LIKE, 1)
    hosts = cluster(1, 2, device="cpu")
    hosts["hosts"][0]["storage"] = {"bandwidth": "10MB/s", "latency": "0s"}
    topology = build_topology(make_scenario(cluster=hosts).config.cluster)
    loads = 6

    def body(rank, heartbeat):
        store = BlockStore(_model(scenario.model, 1, 0), tmp_path / f"blocks{rank}")
        store.write_missing()
        link = LoaderLink.of(topology, rank)
        pacer = Pacer(link, tmp_path / "pace")
        loader = BlockLoader(store, "cpu", pacer)
        torch.distributed.barrier()
        start = time.perf_counter()
        nbytes = sum(loader.load("layer0.mlp")[1] for _ in range(loads))
        elapsed = time.perf_counter() - start
        torch.distributed.barrier()
        pacer.close()
        return elapsed, nbytes / link.bandwidth_bytes_per_s

    for elapsed, alone_s in launch(body, 2, hang_timeout_s=60):
        assert 1.7 * alone_s <= elapsed <= 3 * alone_s, (elapsed, alone_s)  # half the bandwidth each
    assert not (tmp_path / "pace").exists()


def test_two_ranks_stream_to_the_reference_tokens(tmp_path):
    specs = [_scenario(tmp_path, config, 2).model for config in (LLAMA_LIKE, GPT2_LIKE)]
    topology = build_topology(_scenario(tmp_path, LLAMA_LIKE, 2).config.cluster)

    def body(rank, heartbeat):
        out = []
        for spec in specs:
            model = _model(spec, 2, rank, skip_blocks=block_names(spec))
            store = BlockStore(model, tmp_path / "blocks")
            store.write_missing()
            loader = BlockLoader(store, "cpu", Pacer(LoaderLink.of(topology, rank)))
            prompt = prompt_tokens(spec, WORKLOAD["batch_size"], WORKLOAD["prompt_tokens"], seed=SEED)
            for policy in POLICIES[:3]:
                for choice in STRATEGIES:
                    heartbeat(f"{spec.name} {policy.label()} {choice.strategy}")
                    plan = _plan(spec, 2, choice, policy)
                    generation = Executor(plan, model, Communicator(rank, topology.host_groups), rank,
                                          loader=loader).generate(prompt, time.perf_counter())
                    out.append((torch.stack(generation.tokens, 1) if rank == 0 else None,
                                torch.stack(generation.hidden, 1) if rank == 0 else None,
                                set(model.weights) == _expected_state(model, plan, rank),
                                [r.name for r in generation.records if r.stream == "loader" and r.step == 1]
                                == _expected_loads(plan, rank)))
        return out

    results = launch(body, 2, hang_timeout_s=60)
    expected = [_reference(spec) for spec in specs for _ in POLICIES[:3] for _ in STRATEGIES]
    for (_, ref_tokens, ref_hidden), master, other in zip(expected, *results, strict=True):
        assert torch.equal(master[0], ref_tokens)
        torch.testing.assert_close(master[1], ref_hidden, rtol=1e-4, atol=1e-5)
        assert master[2] and other[2], "a rank holds other weights than the non-streamed ones and the window"
        assert master[3] and other[3], "loader ops differ from the plan's"


def test_measure_streams_the_variants_that_ask_for_it(tmp_path, monkeypatch):
    import tempfile

    from runtime.measure import measure_scenario

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default block cache, inherited by the ranks
    variants = [{"name": "resident", "strategy": "allreduce_ln", "allreduce": "library"},
                {"name": "window1", "strategy": "reduce_ln_bcast", "reduce": "library", "broadcast": "library",
                 "memory": {"policy": "sliding_window", "window": 1}},
                {"name": "window2_retain", "strategy": "allreduce_ln", "allreduce": "ring",
                 "memory": {"policy": "sliding_window", "window": 2, "retain_every": 3}}]
    scenario = _scenario(tmp_path, LLAMA_LIKE, 2, variants=variants)
    measured = measure_scenario(scenario, repeats=1, warmup=0, seed=SEED, hang_timeout_s=60)
    _, ref_tokens, _ = _reference(scenario.model)
    assert len(list((tmp_path / "hetsim-blocks").glob("*/layer0.attention.safetensors"))) == 2
    for variant in measured.variants:
        assert torch.equal(torch.from_numpy(variant.tokens[0]), ref_tokens), variant.name
        loads = variant.trace.ops[variant.trace.ops["stream"] == "loader"]
        assert loads.empty == (variant.name == "resident"), variant.name
        assert set(loads["kind"]) <= {"weight_load"}
