"""runtime.memory_probe: a peak read after reset_peak is the live bytes at the peak (a freed tensor
counts once and is given back; weights streamed block by block count as the blocks held at once),
identical generations measure the same per-rank peak, and a rank's peak less its weights and KV
cache is the same framework baseline on ranks holding different weights.

Probes that change malloc's settings run in a forked child, so this process keeps its own."""

import json
import multiprocessing

import pytest

torch = pytest.importorskip("torch")

from runtime import memory_probe  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.model import RankModel  # noqa: E402
from sim.topology import build_topology  # noqa: E402
from tests.conftest import cluster, make_scenario  # noqa: E402

MB = 1_000_000
# Llama-like, small enough to generate in a second, big enough that weights dominate: the master
# holds embeddings and lm_head (2 x 16.8 MB) beyond its 16.8 MB of layer shards.
MODEL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
         "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 8192, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "torch_dtype": "float32"}


def _in_child(fn):
    """``fn()``'s return value, computed in a forked child (its mallopt settings die with it)."""
    receiver, sender = multiprocessing.get_context("fork").Pipe(duplex=False)

    def target():
        # GNU OpenMP's thread pool does not survive fork: once this process has run a parallel
        # op (as the runtime tests do), a forked child's first parallel op hangs.
        torch.set_num_threads(1)
        try:
            sender.send(("ok", fn()))
        except BaseException as error:  # noqa: BLE001 - reported to the test
            sender.send(("error", repr(error)))

    process = multiprocessing.get_context("fork").Process(target=target, daemon=True)
    process.start()
    sender.close()
    if not receiver.poll(60):
        process.kill()
        pytest.fail("the probe child did not answer within 60 s")
    kind, value = receiver.recv()
    process.join()
    assert kind == "ok", value
    return value


def _freed_tensor():
    memory_probe.configure_allocator(exact=True)
    torch.ones(1_000_000)  # the kernel's code pages are resident before the reset
    memory_probe.reset_peak()
    before = memory_probe.current_bytes()
    x = torch.ones(50_000_000)  # 200 MB, every page written
    held = memory_probe.current_bytes() - before
    del x
    return held, memory_probe.peak_bytes() - before, memory_probe.current_bytes() - before


def test_a_freed_200mb_tensor_raises_the_peak_by_its_size_and_is_given_back():
    held, peak, after = _in_child(_freed_tensor)
    assert held == pytest.approx(200 * MB, rel=0.05)
    assert peak == pytest.approx(200 * MB, rel=0.05)
    assert after < 5 * MB


def _streamed_blocks():
    memory_probe.configure_allocator(exact=True)
    torch.randn(1024, 2048).sum()  # the kernels' code pages are resident before the reset
    memory_probe.reset_peak()
    before = memory_probe.current_bytes()
    current, outputs = None, []
    for index in range(12):  # load the next block while the current one is in use, then drop it
        block = torch.randn(1024, 2048 + 512 * (index % 3))  # 8.4, 10.5 or 12.6 MB
        if current is not None:
            outputs.append(current.sum())  # no workspace of its own
        current = block
        del block
    return memory_probe.peak_bytes() - before


def test_weights_streamed_block_by_block_peak_at_the_blocks_held_at_once():
    # At most two blocks are live (12.6 + 10.5 MB) of the 126 MB streamed; glibc's defaults read 31 MB.
    # In a fresh interpreter: a child forked from this suite's process read 31 MB in some CI runs
    # (three times in a row once), depending on what the suite had run before; alone it reads 23 MB.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        peaks = [pool.apply(_streamed_blocks) for _ in range(3)]
    assert min(peaks) == pytest.approx(23.1 * MB, rel=0.07)


def _measure_twice(tmp_path):
    from runtime.worker import run_rank

    path = tmp_path / "llama_like.config.json"
    path.write_text(json.dumps(MODEL))
    scenario = make_scenario(model=str(path), dtype="fp32", cluster=cluster(2, 1, device="cpu"),
                             workload={"batch_size": 2, "prompt_tokens": 16, "output_tokens": 4},
                             variants=[{"name": "ring", "strategy": "allreduce_ln", "allreduce": "ring"}])
    topology = build_topology(scenario.config.cluster)

    def body(rank, heartbeat):
        return run_rank(scenario, topology, rank, repeats=1, warmup=1, seed=0, device=torch.device("cpu"),
                        heartbeat=heartbeat)

    runs = []
    for _ in range(2):
        gathered = launch(body, 2, hang_timeout_s=60)[0]
        runs.append([measurements[0].peak_memory_bytes for measurements in gathered])
    return scenario, runs


def test_identical_generations_measure_the_same_peak_and_baseline(tmp_path):
    scenario, (first, second) = _measure_twice(tmp_path)
    for a, b in zip(first, second):
        assert a == pytest.approx(b, rel=0.03)
    work = scenario.config.workload
    model_bytes = []
    for index in range(2):
        model = RankModel(scenario.model, 2, index, seed=0, batch_size=work.batch_size,
                          max_tokens=work.prompt_tokens + work.output_tokens)
        cache = sum(t.numel() * t.element_size() for t in (*model.k_cache, *model.v_cache))
        model_bytes.append(model.weight_bytes + cache)
        del model
    assert model_bytes[0] - model_bytes[1] > 30 * MB  # the master holds embeddings and lm_head too
    baselines = [peak - held for peak, held in zip(first, model_bytes)]
    assert baselines[0] == pytest.approx(baselines[1], rel=0.05)


def test_without_glibc_the_probe_degrades_instead_of_failing(monkeypatch):
    monkeypatch.setattr(memory_probe, "_libc", lambda: None)
    assert memory_probe.configure_allocator(exact=True) is False
    with memory_probe.exact_allocation():
        memory_probe.reset_peak()
        assert memory_probe.peak_bytes() >= memory_probe.current_bytes() > 0
