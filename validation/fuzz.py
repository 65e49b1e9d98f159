"""Hostile-input fuzzing of ``hetsim simulate``: seeded mutations of the shipped scenarios and model
configs, each run in a forked, time- and memory-bounded child, and the outcome classified.

A case is a directory holding ``scenario.yaml`` (bytes, possibly not even text) and possibly a
``config.json`` it names. :func:`make_case` builds one from a seed scenario and a
``random.Random``; :func:`run_case` runs the CLI entry point on it in a child forked from the
caller (so the imports are paid once), with ``RLIMIT_AS`` at :data:`MEMORY_LIMIT_BYTES` and a
wall-clock limit, and :func:`classify` names the outcome:

* ``clean_error``: exit code 2, exactly one line on stderr starting ``hetsim: error:``, no
  traceback, nothing under the output directory;
* ``success``: exit code 0 and results whose every value is finite (NaN only for the per-decode
  metrics of a one-token run) with positive TTFT (a training scenario: step time) and peak memory;
* ``traceback``, ``hang`` (past the time limit), ``memory`` (MemoryError or killed by the memory
  limit), ``nonsense`` (a success whose results break the invariants above), ``partial_write``
  (an error that left files behind), ``messy_error`` (exit 2 but not one clean line).

The seeds are the shipped scenarios trimmed to at most two variants, 16 output tokens and a
two-point sweep, so that a mutation that stays valid simulates in a second or two; the mutations
keep every field the shipped files have.

Used by ``tests/test_fuzz.py`` (a few dozen examples under hypothesis) and
``benchmarks/bench_fuzz.py`` (thousands, with a report).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from sim.vocabulary import DECODE_METRICS, Metric

REPO_ROOT = Path(__file__).resolve().parent.parent
MEMORY_LIMIT_BYTES = 4 << 30
TIME_LIMIT_S = 30.0
OUTCOMES = ("clean_error", "success", "traceback", "hang", "memory", "nonsense", "partial_write", "messy_error")
BAD_OUTCOMES = ("traceback", "hang", "memory", "nonsense", "partial_write", "messy_error")


def warm_imports() -> None:
    """Import everything ``hetsim simulate`` imports lazily and build the unit registry, so that
    each case forked afterwards starts warm (about 2 s saved per case)."""
    import sim.outputs  # noqa: F401
    import sim.profile  # noqa: F401
    import sim.simulate  # noqa: F401
    import sim.sweep  # noqa: F401
    import validation.cli  # noqa: F401
    import validation.present.simulate_report  # noqa: F401
    import validation.present.sweep_report  # noqa: F401
    from sim.units import _registry

    _registry()


def seed_scenarios() -> dict[str, dict]:
    """The shipped scenarios (``scenarios/**/*.yaml``, not the sweep grids of ``scenarios/grids/``, the
    plans ``plan_*.yaml`` nor their catalogs, ``scenarios/catalogs/``), trimmed (see the module docstring), by path."""
    seeds = {}
    for path in sorted((REPO_ROOT / "scenarios").glob("**/*.yaml")):
        if {"grids", "catalogs"} & set(path.relative_to(REPO_ROOT / "scenarios").parts) or path.name.startswith("plan_"):
            # sweep grids, planning questions and their price catalogs (hetsim sweep / hetsim plan), not scenarios
            continue
        data = yaml.safe_load(path.read_text())
        data["variants"] = data["variants"][:2]
        if data.get("baseline") not in {v["name"] for v in data["variants"]}:
            data.pop("baseline", None)
        workload = data["workload"]
        for field, most in (("output_tokens", 16), ("requests", 20)):  # keep each case short
            if field in workload:
                workload[field] = min(workload[field], most)
        if "sweep" in data:
            data["sweep"] = {key: values[:2] if key != "models" else values[:1] for key, values in data["sweep"].items()}
        if str(data.get("model", "")).endswith(".json"):
            data["model"] = str((path.parent / data["model"]).resolve())
        seeds[str(path.relative_to(REPO_ROOT))] = data
    return seeds


def seed_configs() -> dict[str, dict]:
    """The model configs shipped with the tests and scenarios (Hugging Face ``config.json``)."""
    paths = sorted((REPO_ROOT / "tests" / "data").glob("*.json")) + sorted(REPO_ROOT.glob("scenarios/**/*.json"))
    return {str(p.relative_to(REPO_ROOT)): json.loads(p.read_text()) for p in paths}


# -- values a hostile user writes -----------------------------------------------------------------

NUMBERS: tuple[Any, ...] = (0, -1, 1, 2, 3, 7, 1000, 10**6, 10**9, 10**12, 2**63, -(2**63), 0.5, 0.4, 1e-300, 1e308,
                            -1e308, float("nan"), float("inf"), float("-inf"), True, False, 1.0, 12.0)
UNITS: tuple[str, ...] = ("(1/0) ms", "1e308 s", "1e-300 bit/s", "10 gbps", "0.4 byte", "((((((1))))))s", "1 bit/s",
                          "1e400 s", "-5 ms", "0 s", "nan ms", "inf GB/s", "1/0", "10 Mb/s", "5 meter", "1 bit",
                          "1e-30 s", "1e30 GB/s", "ms", "", "   ", "1 PiB", "0x10 GB", "1_000 MB", "2**64 byte",
                          "1 EiB/ns", "3 parsec", "1 s ** 2", "1 byte/s/s", "1 dimensionless")
STRINGS: tuple[Any, ...] = ("", ".", "..", "../escape", "a/b", "/etc/passwd", "x" * 5000, "nccl", "auto", "none",
                            "\u202e\u0000", "é", "gpt2", "llama-2-7b", "int4", "fp8", "bf16", "fp32", "sliding_window",
                            "resident", "flow", "alpha_beta", "ring", "star", "binomial", "{i}", "gw{i}{i}",
                            "😀" * 10, None, [], {}, [1, 2], {"a": 1})


def value_paths(data: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every value of a nested mapping/list (containers included, the root excluded)."""
    paths = [path] if path else []
    if isinstance(data, dict):
        for key, value in data.items():
            paths += value_paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            paths += value_paths(value, (*path, i))
    return paths


def set_value(data: Any, path: tuple, value: Any) -> None:
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _delete(data: Any, path: tuple) -> None:
    node = data
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]


def _hostile_value(rng: random.Random, current: Any) -> Any:
    pool = rng.choice((NUMBERS, UNITS, STRINGS))
    value = rng.choice(pool)
    if isinstance(current, (int, float)) and not isinstance(current, bool) and rng.random() < 0.3:
        value = rng.choice((current * 10**rng.randint(1, 12), -current, current + 1, current - 1, 0))
    return copy.deepcopy(value)


def _dump(data: Any) -> bytes:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()


# -- mutations: each returns (scenario bytes, config.json bytes or None, a label) -----------------

def _field_value(rng, scenario, config):
    data = copy.deepcopy(scenario)
    path = rng.choice(value_paths(data))
    old = _get(data, path)
    set_value(data, path, _hostile_value(rng, old))
    return _dump(data), None, f"{_dotted(path)}={_short(_get(data, path))}"


def _two_fields(rng, scenario, config):
    data = copy.deepcopy(scenario)
    labels = []
    for _ in range(2):
        path = rng.choice(value_paths(data))
        set_value(data, path, _hostile_value(rng, _get(data, path)))
        labels.append(f"{_dotted(path)}={_short(_get(data, path))}")
    return _dump(data), None, " ".join(labels)


def _delete_field(rng, scenario, config):
    data = copy.deepcopy(scenario)
    path = rng.choice(value_paths(data))
    _delete(data, path)
    return _dump(data), None, f"del {_dotted(path)}"


def _unknown_field(rng, scenario, config):
    data = copy.deepcopy(scenario)
    containers = [p for p in value_paths(data) if isinstance(_get(data, p), dict)] + [()]
    path = rng.choice(containers)
    node = _get(data, path) if path else data
    node[rng.choice(("colour", "bandwith", "latancy", "count ", "Name", "tensor_parallel"))] = 1
    return _dump(data), None, f"unknown field under {_dotted(path) or 'top'}"


def _duplicate_key(rng, scenario, config):
    key = rng.choice(list(scenario))
    text = _dump(scenario) + _dump({key: scenario[key]})
    return text, None, f"duplicate {key}"


def _workload(rng, scenario, config):
    data = copy.deepcopy(scenario)
    field = rng.choice(("batch_size", "prompt_tokens", "output_tokens"))
    data["workload"][field] = rng.choice((0, -1, True, 1.5, "12", 10**5, 10**6, 10**7, 10**8, 2**31, 2**63, 9 * 10**18))
    if rng.random() < 0.3:
        data["workload"]["allow_beyond_context"] = rng.choice((True, False, "yes", 1))
    return _dump(data), None, f"workload.{field}={_short(data['workload'][field])}"


def _cluster_count(rng, scenario, config):
    data = copy.deepcopy(scenario)
    entries = [("hosts", i) for i in range(len(data["cluster"]["hosts"]))]
    entries += [("switches", i) for i in range(len(data["cluster"].get("switches", [])))]
    kind, i = rng.choice(entries)
    entry = data["cluster"][kind][i]
    target = entry["devices"] if kind == "hosts" and rng.random() < 0.4 else entry
    target["count"] = rng.choice((0, -1, True, 2.0, 100, 1000, 100_000, 10**9, "8"))
    return _dump(data), None, f"cluster.{kind}[{i}] count={_short(target['count'])}"


def _link(rng, scenario, config):
    data = copy.deepcopy(scenario)
    links = [p for p in value_paths(data) if p and p[-1] in ("bandwidth", "latency", "memory")]
    path = rng.choice(links)
    set_value(data, path, rng.choice(UNITS + (0, -1, 1e308, 1e-300, float("nan"), True)))
    return _dump(data), None, f"{_dotted(path)}={_short(_get(data, path))}"


def _variant(rng, scenario, config):
    data = copy.deepcopy(scenario)
    i = rng.randrange(len(data["variants"]))
    field = rng.choice(("strategy", "allreduce", "reduce", "broadcast", "name", "memory"))
    data["variants"][i][field] = rng.choice(("nccl", "ring", "auto", "", None, 1, True, "reduce_ln_bcast",
                                             "allreduce_ln", "library", "x" * 300, {"policy": "sliding_window",
                                                                                    "window": 0}))
    return _dump(data), None, f"variants[{i}].{field}={_short(data['variants'][i][field])}"


def _sweep(rng, scenario, config):
    data = copy.deepcopy(scenario)
    sweep = data.setdefault("sweep", {})
    axis = rng.choice(("models", "devices", "memory", "parallel"))
    if axis == "models":
        sweep["models"] = [rng.choice(("gpt2", "llama-2-7b", "nope", 1, True, "x" * 200))]
    elif axis == "devices":
        sweep["devices"] = [rng.choice((0, -1, 1, 2, 1000, True, 2.5, "2"))]
    elif axis == "memory":
        sweep["memory"] = [{"policy": "sliding_window", "window": rng.choice((0, 1, -1, 10**9, True))}]
    else:
        data["parallel"] = {"tensor": rng.choice((0, 1000, 2, True, 3))}
    sweep.setdefault("devices", [1])
    if rng.random() < 0.3:
        data["workload"]["prompt_tokens"] = 10**6
    return _dump(data), None, f"sweep {axis}"


def _name(rng, scenario, config):
    data = copy.deepcopy(scenario)
    data["name"] = rng.choice(("..", ".", "a/b", "../../x", "/tmp/x", "x" * 200_000, ".hidden", "ok-name", "a\nb",
                               "con", "~", "-rf", " "))
    return _dump(data), None, f"name={_short(data['name'])}"


def _latin1_byte(rng, scenario, config):
    text = _dump(scenario)
    at = rng.randrange(len(text))
    return text[:at] + bytes([rng.randrange(0x80, 0x100)]) + text[at:], None, "a non-UTF-8 byte"


def _utf16(rng, scenario, config):
    return _dump(scenario).decode().encode(rng.choice(("utf-16", "utf-16-le", "utf-32"))), None, "UTF-16/32"


def _binary(rng, scenario, config):
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096))), None, "random bytes"


def _deep(rng, scenario, config):
    depth = rng.choice((40, 900, 5000, 100_000))
    flow = rng.random() < 0.5
    if flow:
        body = "[" * depth + "]" * depth
    else:
        body = "".join(" " * i + "- \n" for i in range(min(depth, 2000)))
    return _dump(scenario) + b"description: " + body.encode() + b"\n" if flow else b"x:\n" + body.encode(), None, \
        f"nesting {depth}"


def _huge_int(rng, scenario, config):
    digits = rng.choice((25, 400, 5000, 50_000))
    text = _dump(scenario).decode()
    counts = [name for name, value in scenario["workload"].items() if isinstance(value, int) and not isinstance(value, bool)]
    field = rng.choice(sorted(counts))  # a training workload has global and micro batches, sequence length, steps
    text = text.replace(f"{field}: {scenario['workload'][field]}", f"{field}: {'9' * digits}")
    return text.encode(), None, f"{field} of {digits} digits"


def _whole_file(rng, scenario, config):
    choice = rng.choice(("empty", "list", "scalar", "null", "alias_bomb", "tab", "nul", "huge", "bom", "tag"))
    texts = {
        "empty": b"", "list": b"- a\n- b\n", "scalar": b"42\n", "null": b"~\n",
        "alias_bomb": b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n".encode() for i in range(8)),
        "tab": b"name:\tx\n\tmodel: gpt2\n", "nul": _dump(scenario) + b"\x00",
        "huge": b"description: " + b"x" * (2 << 20) + b"\n", "bom": b"\xef\xbb\xbf" + _dump(scenario),
        "tag": b"name: !!python/object/apply:os.system ['true']\n",
    }
    return texts[choice], None, f"whole file: {choice}"


def _hf_config(rng, scenario, config):
    data = copy.deepcopy(scenario)
    data["model"] = "config.json"
    data.pop("sweep", None)
    data["dtype"] = rng.choice((None, "fp16", "fp32")) or data.get("dtype")
    if data["dtype"] is None:
        data.pop("dtype")
    cfg = copy.deepcopy(config)
    kind = rng.choice(("value", "value", "value", "delete", "binary", "deep", "not_object", "duplicate", "nan",
                       "huge_int"))
    if kind == "value":
        key = rng.choice(list(cfg) + ["num_key_value_heads", "head_dim", "n_inner", "max_position_embeddings"])
        cfg[key] = rng.choice((0, -1, True, 1.5, "64", None, 10**12, 10**6, 16, 3, [], {}, "x" * 1000))
        body, label = json.dumps(cfg).encode(), f"config {key}={_short(cfg[key])}"
    elif kind == "delete":
        key = rng.choice(list(cfg))
        del cfg[key]
        body, label = json.dumps(cfg).encode(), f"config del {key}"
    elif kind == "binary":
        body, label = bytes(rng.randrange(256) for _ in range(64)), "config binary"
    elif kind == "deep":
        body, label = ('{"model_type": "gpt2", "x": ' + "[" * 5000 + "]" * 5000 + "}").encode(), "config deep"
    elif kind == "not_object":
        body, label = rng.choice((b"[]", b"null", b"42", b'"gpt2"', b"")), "config not an object"
    elif kind == "duplicate":
        text = json.dumps(cfg)
        body, label = (text[:-1] + ', "model_type": "gpt2"}').encode(), "config duplicate key"
    elif kind == "nan":
        key = rng.choice(list(cfg))
        body, label = json.dumps(cfg | {key: float("nan")}).encode(), f"config {key}=NaN"
    else:
        text = json.dumps(cfg)
        key = rng.choice([k for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)] or ["x"])
        body, label = text.replace(f'"{key}": {cfg.get(key)}', f'"{key}": {"7" * 5000}').encode(), \
            f"config {key} of 5000 digits"
    return _dump(data), body, label


def _big_valid(rng, scenario, config):
    """Values at or near the documented limits: valid, so they must run (or be refused) quickly."""
    data = copy.deepcopy(scenario)
    choice = rng.choice(("output_tokens", "batch", "prompt", "hosts", "window", "variants", "config"))
    workload = data["workload"]
    if choice == "output_tokens":
        workload.update(output_tokens=rng.choice((2**17, 100_000, 30_000, 4096)), allow_beyond_context=True)
    elif choice == "batch":
        workload.update(batch_size=rng.choice((65536, 4096)), prompt_tokens=rng.choice((1000, 1)))
    elif choice == "prompt":
        workload.update(prompt_tokens=rng.choice((2**20, 500_000)), allow_beyond_context=True)
    elif choice == "hosts":
        host = data["cluster"]["hosts"][0]
        host["count"] = rng.choice((1024, 512, 256))
        if "{i}" not in host["name"]:
            host["name"] += "{i}"
        if host.get("parent") and "{i}" in host["parent"]:
            host["parent"] = data["cluster"]["switches"][0]["name"]
    elif choice == "window":
        data["memory"] = {"policy": "sliding_window", "window": rng.choice((65536, 1000, 2)),
                          "retain_every": rng.choice((2, 65536))}
    elif choice == "variants":
        data["variants"] = [dict(data["variants"][0], name=f"v{i}") for i in range(rng.choice((64, 20)))]
        data.pop("baseline", None)
    else:
        data["model"] = "config.json"
        data.pop("sweep", None)
        cfg = copy.deepcopy(config)
        layers = "n_layer" if cfg.get("model_type") == "gpt2" else "num_hidden_layers"
        cfg[layers] = rng.choice((1024, 200, 80))
        return _dump(data), json.dumps(cfg).encode(), f"near limits: config {layers}={cfg[layers]}"
    return _dump(data), None, f"near limits: {choice}"


def _yaml_syntax(rng, scenario, config):
    text = bytearray(_dump(scenario))
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(text))
        if rng.random() < 0.5:
            del text[at]
        else:
            text[at:at] = rng.choice((b":", b"-", b" ", b"\n", b"{", b"[", b"'", b'"', b"&a", b"*a", b"!!", b"#", b"\t"))
    return bytes(text), None, "YAML syntax damage"


def _model_path(rng, scenario, config):
    data = copy.deepcopy(scenario)
    data.pop("sweep", None)
    data["model"] = rng.choice(("/", "missing.json", ".json", "/dev/null.json", "../../../../etc/passwd.json",
                                "/proc/self/status.json", "dir.json", "x" * 300 + ".json", "/dev/zero",
                                "config.json/", "~/config.json"))
    return _dump(data), None, f"model={_short(data['model'])}"


def _out_dir(rng, scenario, config):
    return _dump(scenario), None, "out"


MUTATIONS: dict[str, Callable] = {
    "field_value": _field_value, "two_fields": _two_fields, "delete_field": _delete_field,
    "unknown_field": _unknown_field, "duplicate_key": _duplicate_key, "workload": _workload,
    "cluster_count": _cluster_count, "link": _link, "variant": _variant, "sweep": _sweep, "name": _name,
    "latin1_byte": _latin1_byte, "utf16": _utf16, "binary": _binary, "deep": _deep, "huge_int": _huge_int,
    "whole_file": _whole_file, "hf_config": _hf_config, "big_valid": _big_valid, "yaml_syntax": _yaml_syntax,
    "model_path": _model_path, "out_dir": _out_dir,
}
# ``out_dir`` cases run with one of these as --out ({workdir}: the case's directory, holding a
# regular file "afile" and a directory "dir.json").
OUT_DIRS = ("{workdir}/afile", "{workdir}/afile/out", "/proc/hetsim-fuzz", "/sys/hetsim", "/dev/null",
            "/dev/null/out", "{workdir}/a/b/c/../../out", "")
# Field-level mutations are where the variety is; the whole-file ones have few distinct outcomes.
WEIGHTS = {"field_value": 8, "two_fields": 4, "delete_field": 2, "unknown_field": 1, "duplicate_key": 1,
           "workload": 3, "cluster_count": 2, "link": 3, "variant": 2, "sweep": 2, "name": 1, "latin1_byte": 1,
           "utf16": 1, "binary": 1, "deep": 1, "huge_int": 1, "whole_file": 2, "hf_config": 5, "big_valid": 2,
           "yaml_syntax": 2, "model_path": 1, "out_dir": 1}


def _get(data: Any, path: tuple) -> Any:
    for key in path:
        data = data[key]
    return data


def _dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


@dataclass(frozen=True)
class Case:
    """One fuzz input: the seed it came from, the mutation, a label, and the files' bytes."""

    index: int
    seed: str
    mutation: str
    label: str
    scenario: bytes
    config: bytes | None
    out: str | None = None  # --out, if not the case's own out/ (see OUT_DIRS)


def make_case(index: int, rng: random.Random, seeds: dict[str, dict], configs: dict[str, dict],
              mutation: str | None = None) -> Case:
    """A case built by ``mutation`` (drawn by :data:`WEIGHTS` when None) from a seed drawn by ``rng``."""
    if mutation is None:
        mutation = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    seed = rng.choice(sorted(seeds))
    config_name = rng.choice(sorted(configs))
    scenario, config, label = MUTATIONS[mutation](rng, seeds[seed], configs[config_name])
    if mutation in ("hf_config", "big_valid"):
        seed = f"{seed} + {config_name}"
    out = rng.choice(OUT_DIRS) if mutation == "out_dir" else None
    return Case(index, seed, mutation, f"--out {out!r}" if out is not None else label, scenario, config, out)


@dataclass(frozen=True)
class Outcome:
    """What running a case gave: the class, exit code, wall time (s) and the first stderr line."""

    outcome: str
    exit_code: int | None
    wall_s: float
    stderr_line: str


def run_case(case: Case, workdir: Path, *, time_limit_s: float = TIME_LIMIT_S,
             memory_limit_bytes: int = MEMORY_LIMIT_BYTES) -> Outcome:
    """Run ``hetsim simulate`` on ``case`` in a child forked from this process; classify it.

    The child writes the case under ``workdir`` (which must exist and be empty), sets
    ``RLIMIT_AS``, sends stdout and stderr to files and calls :func:`validation.cli.main`.
    """
    from validation.cli import main

    scenario_path = workdir / "scenario.yaml"
    scenario_path.write_bytes(case.scenario)
    if case.config is not None:
        (workdir / "config.json").write_bytes(case.config)
    (workdir / "afile").write_text("a file, not a directory\n")
    (workdir / "dir.json").mkdir()
    out_arg = str(workdir / "out") if case.out is None else case.out.replace("{workdir}", str(workdir))
    out_dir = Path(out_arg)
    stdout_path, stderr_path = workdir / "stdout.txt", workdir / "stderr.txt"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            os.setsid()
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
            for fd, path in ((1, stdout_path), (2, stderr_path)):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.chdir(workdir)
            try:
                main(["simulate", str(scenario_path), "--out", out_arg])
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except MemoryError:
                sys.stderr.write("MemoryError\n")
                code = 137
            except BaseException:  # noqa: BLE001  (a traceback is what this run is looking for)
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    exit_code, timed_out = _wait(pid, time_limit_s)
    wall_s = time.monotonic() - start
    stderr = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
    # The case's directory is a fresh temporary one: named "CASE" so that reports are reproducible.
    first = stderr.strip().splitlines()[0].replace(str(workdir), "CASE") if stderr.strip() else ""
    outcome = classify(exit_code, timed_out, stderr, out_dir)
    return Outcome(outcome, exit_code, round(wall_s, 3), first[:200])


def _wait(pid: int, time_limit_s: float) -> tuple[int | None, bool]:
    deadline = time.monotonic() + time_limit_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return (os.waitstatus_to_exitcode(status), False)
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return (None, True)
        time.sleep(0.01)


def classify(exit_code: int | None, timed_out: bool, stderr: str, out_dir: Path) -> str:
    """The outcome class of one run (see the module docstring)."""
    if timed_out:
        return "hang"
    lines = stderr.strip().splitlines()
    written = out_dir.is_dir() and str(out_dir) not in ("/", ".", "") and any(out_dir.rglob("*"))
    if "MemoryError" in stderr or exit_code in (-signal.SIGKILL, 137):
        return "memory"
    if "Traceback (most recent call last)" in stderr:
        return "traceback"
    if exit_code == 2:
        if len(lines) != 1 or not lines[0].startswith("hetsim: error: "):
            return "messy_error"
        return "partial_write" if written else "clean_error"
    if exit_code == 0:
        return "success" if results_make_sense(out_dir) else "nonsense"
    return "traceback"


def results_make_sense(out_dir: Path) -> bool:
    """Whether a successful run's results hold only numbers a user can use: finite values (NaN
    only for the per-decode metrics of a one-token run), positive TTFT and peak memory, and
    every results.csv or sweep.csv row present."""
    import pandas as pd

    results = out_dir / "results.csv"
    if results.exists():
        table = pd.read_csv(results)
        if table.empty:
            return False
        values = table.set_index("metric")["value"]
        for metric, value in values.items():
            if math.isnan(value) and metric in DECODE_METRICS:
                continue
            if not math.isfinite(value):
                return False
        timed = Metric.STEP_TIME.value if Metric.STEP_TIME.value in values.index else Metric.TTFT.value
        return bool((values.loc[[timed]] > 0).all() and (values.loc[[Metric.PEAK_MEMORY.value]] > 0).all())
    sweep = out_dir / "sweep.csv"
    if sweep.exists():
        table = pd.read_csv(sweep)
        feasible = table[table["feasible"]]
        numbers = feasible[[Metric.TTFT.value, Metric.MAX_PEAK_MEMORY.value]].to_numpy(dtype=float)
        tpot = feasible[Metric.TPOT.value].to_numpy(dtype=float)
        return not table.empty and bool(((numbers > 0) & (numbers < math.inf)).all()) and bool(
            ((tpot > 0) & (tpot < math.inf) | (tpot != tpot)).all())
    return False
