"""How to run a plan's pick: the command lines ``hetsim plan`` prints beside its scenario file.

One vocabulary for every plan (:func:`pick_commands`; a line starting with ``#`` says what the
next ones do, so that the lines read as a shell script):

* ``hetsim simulate SCENARIO``: the plan's prediction of the pick again;
* ``hetsim measure SCENARIO``: its layout run for real on this machine, one process per device,
  every replica together (:mod:`runtime.measure`);
* the ``torchrun`` line that runs the same on a real cluster of the pick's hosts
  (:mod:`runtime.torchrun`);
* a **serving** pick: hetsim's runtime does not serve request loads, so the real run of the pick
  is a vLLM server with the pick's layout and scheduler settings (:func:`vllm_lines`); the measure
  and torchrun lines run its layout at the batch it decodes at its maximum rate
  (:meth:`sim.planning.search.Planner.batch_scenario_dict`), where it decodes any.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pandas as pd

from models.catalog import HF_REPOSITORIES
from models.dtypes import TORCH_DTYPE_NAMES
from sim.planning.plan_config import PlanRequest

RAY_PORT = 6379
"""The Ray head's port (Ray's default, ``ray start --head``)."""
TORCHRUN_PORT = 29500
"""The c10d rendezvous port of the torchrun line (torchrun's default master port)."""


def pick_commands(request: PlanRequest, row: pd.Series, scenario: dict, scenario_path: Path,
                  batch_path: Path | None = None) -> list[str]:
    """The lines that run ``row`` (a plan table's row) whose scenario (``scenario``, a dict for
    YAML) is at ``scenario_path``: see the module docstring. ``batch_path``: a serving pick's
    scenario at the batch it decodes at its maximum rate (None: it has none)."""
    path = shlex.quote(str(scenario_path))
    hosts, per_host = int(row["num_hosts"]), int(row["devices_per_host"])
    if not request.config.is_serving:
        return [f"hetsim simulate {path}", f"hetsim measure {path}", torchrun_line(hosts, per_host, path)]
    lines = [f"hetsim simulate {path}",
             "# hetsim's runtime does not serve request loads: on a real cluster, serve the pick with vLLM"]
    lines += vllm_lines(request, row, scenario)
    if batch_path is not None:
        batch = shlex.quote(str(batch_path))
        lines += [f"# its layout at the batch it decodes at its maximum rate ({row['decode_batch_at_max_rate']:.3g} "
                  "requests per iteration), run for real here and on the cluster:",
                  f"hetsim measure {batch}", torchrun_line(hosts, per_host, batch)]
    return lines


def torchrun_line(hosts: int, per_host: int, quoted_path: str) -> str:
    """``hetsim measure`` on a real cluster of ``hosts`` hosts of ``per_host`` devices: the same
    line on every host, ``HOST0`` the first host's address (:mod:`runtime.torchrun`)."""
    return (f"torchrun --nnodes {hosts} --nproc-per-node {per_host} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST0:{TORCHRUN_PORT} -m runtime.torchrun measure {quoted_path} --out out/measured")


def vllm_lines(request: PlanRequest, row: pd.Series, scenario: dict) -> list[str]:
    """A serving pick (``row``, its ``scenario``) as vLLM runs it: ``vllm serve MODEL`` with the
    pick's layout and scheduler settings.

    The flags are vLLM's engine arguments (``vllm/engine/arg_utils.py``, ``EngineArgs.add_cli_args``;
    docs/serving/parallelism_scaling.md): ``--tensor-parallel-size`` and ``--pipeline-parallel-size``
    (the layout's degrees), ``--max-num-batched-tokens`` and ``--max-num-seqs`` (the workload's
    token budget per iteration and running requests, the scheduler settings hetsim takes from
    vLLM, :mod:`sim.serving.config`), ``--gpu-memory-utilization`` (``memory_utilization``) and
    ``--dtype``. MODEL is the Hugging Face repository of a catalog model
    (:data:`models.catalog.HF_REPOSITORIES`), or the folder of a plan's ``config.json``. A server
    over several hosts runs on a Ray cluster (vLLM's multi-node serving,
    docs/serving/distributed_serving.md: ``ray start --head`` on the first host, ``ray start
    --address`` on the others, ``vllm serve`` on the first with ``--distributed-executor-backend
    ray``). Replicas are separate servers (one per host, or each a pipeline over its own block of
    hosts on a Ray cluster of its own), behind a round-robin balancer, as
    :mod:`sim.serving.simulate` models them (the external load balancing of
    docs/serving/data_parallel_deployment.md). vLLM splits tensor parallelism evenly: an uneven
    split has no flag, and the line runs it even.
    """
    parallel, workload = scenario["parallel"], request.config.workload
    tensor, pipeline, replicas = parallel["tensor"], parallel.get("pipeline", 1), parallel.get("replicas", 1)
    model = str(scenario["model"])
    # a plan's config.json is resolved beside the plan (Planner.scenario_dict): vLLM loads its folder
    target = str(Path(model).parent) if model.endswith(".json") else HF_REPOSITORIES.get(model.lower(), model)
    spec = next(m for m in request.models if m.name == row["model"])
    hosts_per_server = int(row["num_hosts"]) // replicas
    serve = (f"vllm serve {shlex.quote(target)} --tensor-parallel-size {tensor} --pipeline-parallel-size {pipeline} "
             f"--max-num-batched-tokens {workload.max_batch_tokens} --max-num-seqs {workload.max_num_seqs} "
             f"--gpu-memory-utilization {workload.memory_utilization:g} --dtype {TORCH_DTYPE_NAMES[spec.dtype]}")
    lines = []
    if "shares" in parallel:
        lines.append("# vLLM splits tensor parallelism evenly: the plan's uneven split has no flag; this runs it even")
    if hosts_per_server > 1:
        lines += [f"# one server over {hosts_per_server} hosts: a Ray cluster first (HOST0: the first host)",
                  f"ray start --head --port {RAY_PORT}  # on HOST0",
                  f"ray start --address HOST0:{RAY_PORT}  # on each other host",
                  f"{serve} --distributed-executor-backend ray  # on HOST0"]
    else:
        lines.append(serve)
    if replicas > 1:
        where = (f"each on its own {hosts_per_server} hosts with its own Ray cluster (HOST0: its first host)"
                 if hosts_per_server > 1 else "on each host")
        lines.append(f"# one such server per replica, {where}, {replicas} in all, behind a round-robin balancer")
    return lines
