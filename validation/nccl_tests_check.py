"""The uncalibrated NCCL transport defaults against published small-message allreduce latencies.

``validation/published/nccl_tests/rows.yaml`` lists nccl-tests ``all_reduce_perf`` times of
messages of 8 to 128 bytes on one host (latency only), each with where it is printed. Each is priced three ways:

* hetsim's uncalibrated default (:class:`sim.transport.DefaultTransportNetwork`) of the ring
  schedule, what NCCL runs (NCCL's tree on one host is a chain of as many hops), and of ``auto``
  (the fastest of hetsim's schedules, what a scenario writing ``allreduce: auto`` gets);
* NCCL's own tuning model of its Ring allreduce, ``baseLat + 2 (p - 1) hwLat``
  (NVIDIA/nccl ``src/graph/tuning.cc``, ``ncclTopoTuneModel``; the constants
  :data:`sim.transport.NCCL_RING_BASE_LATENCY_S` and :data:`sim.transport.NCCL_RING_HOP_LATENCY_S`)
  for the LL protocol (NCCL's choice at these sizes) and Simple (hetsim's default's).

Every hetsim figure is a **prediction** (no calibration profile); error = model / published - 1.
Also given: the least-squares line ``a + b x steps`` through the published ring times (what the
published figures say one call and one ring step cost), a description of them, fitted on nothing
else and used by nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from models.errors import ConfigError
from models.input_files import load_yaml
from models.ops import OpKind
from sim.cluster_config import ClusterConfig, LinkConfig
from sim.collectives.registry import AUTO
from sim.network import CollectivePricer
from sim.topology import build_topology
from sim.transport import (NCCL_RING_BASE_LATENCY_S, NCCL_RING_HOP_LATENCY_S, DefaultTransportNetwork, NcclProtocol,
                           Transport, group_transport)
from validation.records import positive_number, records

ROWS_FILE = Path(__file__).resolve().parent / "published" / "nccl_tests" / "rows.yaml"
ROW_FIELDS = ("id", "gpus", "time_s", "device", "interconnect", "size_bytes", "algorithm", "source", "reading")
NCCL_ALGORITHMS = ("ring", AUTO)  # what nccl-tests was told to run: NCCL_ALGO=Ring, or NCCL's choice
MAX_GPUS = 64
CSV_COLUMNS = ["id", "device", "gpus", "size_bytes", "nccl_algorithm", "transport", "published_s",
               "hetsim_ring_s", "hetsim_ring_error", "hetsim_auto_s", "hetsim_auto_algorithm", "hetsim_auto_error",
               "nccl_model_ll_s", "nccl_model_ll_error", "nccl_model_simple_s", "nccl_model_simple_error",
               "source", "reading"]


@dataclass(frozen=True)
class Row:
    """One published allreduce time (s) of ``size_bytes`` per rank over ``gpus`` GPUs of one host."""

    id: str
    gpus: int
    time_s: float
    device: str
    interconnect: LinkConfig
    size_bytes: int
    algorithm: str
    source: str
    reading: str


def load_rows(path: Path = ROWS_FILE) -> list[Row]:
    """The rows of ``path`` (see the module docstring).

    Raises:
        ConfigError: a missing or unknown field, a GPU count outside 2..:data:`MAX_GPUS`, a time
            or size that is not a positive number, an algorithm not in :data:`NCCL_ALGORITHMS`, a
            bad interconnect.
    """
    data = load_yaml(path, "rows")
    rows = []
    for where, entry in records(data, "rows", ROW_FIELDS):
        gpus = entry["gpus"]
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 2 <= gpus <= MAX_GPUS:
            raise ConfigError(f"{where}.gpus", f"an integer in 2..{MAX_GPUS} is required (got {gpus!r})")
        time_s = positive_number(f"{where}.time_s", entry["time_s"])
        size = positive_number(f"{where}.size_bytes", entry["size_bytes"])
        if entry["algorithm"] not in NCCL_ALGORITHMS:
            raise ConfigError(f"{where}.algorithm", f"one of {', '.join(NCCL_ALGORITHMS)} (got {entry['algorithm']!r})")
        try:
            link = LinkConfig.model_validate(entry["interconnect"])
        except ValueError as error:
            raise ConfigError(f"{where}.interconnect", f"a link {{bandwidth, latency}} is required ({error})") from None
        rows.append(Row(id=str(entry["id"]), gpus=gpus, time_s=float(time_s), device=str(entry["device"]),
                        interconnect=link, size_bytes=int(size), algorithm=str(entry["algorithm"]),
                        source=str(entry["source"]), reading=str(entry["reading"])))
    return rows


def nccl_ring_allreduce_s(transport: Transport, protocol: NcclProtocol, ranks: int) -> float:
    """NCCL's modelled latency of a one-host Ring allreduce over ``ranks`` ranks (s), before its
    bytes: ``baseLat + 2 (ranks - 1) hwLat`` (NVIDIA/nccl ``src/graph/tuning.cc``,
    ``ncclTopoTuneModel``: ``nsteps = 2 (nRanks - 1)`` for an allreduce, no inter-node steps)."""
    return NCCL_RING_BASE_LATENCY_S[protocol] + 2 * (ranks - 1) * NCCL_RING_HOP_LATENCY_S[transport][protocol]


def price(row: Row) -> dict[str, object]:
    """``row`` priced by hetsim's defaults and NCCL's model: one line of :data:`CSV_COLUMNS`.

    Raises:
        ConfigError: an unknown device type, or a transport outside NCCL's (a CPU device).
    """
    topology = build_topology(ClusterConfig.model_validate({"hosts": [{
        "name": "host", "interconnect": row.interconnect.model_dump(by_alias=True),
        "devices": {"type": row.device, "count": row.gpus}}]}))
    group = tuple(range(row.gpus))
    transport = group_transport(topology, group)
    if transport not in NCCL_RING_HOP_LATENCY_S:
        raise ConfigError("device", f"an NCCL device is required (got {row.device!r}, transport {transport.value})")
    pricer = CollectivePricer(DefaultTransportNetwork(topology), topology)
    ring_s = pricer.price(OpKind.ALLREDUCE, "ring", group, row.size_bytes)[1].duration_s
    auto, auto_timing = pricer.price(OpKind.ALLREDUCE, AUTO, group, row.size_bytes)
    ll_s = nccl_ring_allreduce_s(transport, NcclProtocol.LL, row.gpus)
    simple_s = nccl_ring_allreduce_s(transport, NcclProtocol.SIMPLE, row.gpus)

    def error(value: float) -> float:
        return value / row.time_s - 1

    return {"id": row.id, "device": row.device, "gpus": row.gpus, "size_bytes": row.size_bytes,
            "nccl_algorithm": row.algorithm, "transport": transport.value, "published_s": row.time_s,
            "hetsim_ring_s": ring_s, "hetsim_ring_error": error(ring_s),
            "hetsim_auto_s": auto_timing.duration_s, "hetsim_auto_algorithm": auto,
            "hetsim_auto_error": error(auto_timing.duration_s),
            "nccl_model_ll_s": ll_s, "nccl_model_ll_error": error(ll_s),
            "nccl_model_simple_s": simple_s, "nccl_model_simple_error": error(simple_s),
            "source": row.source, "reading": row.reading}


def compare(rows: list[Row]) -> pd.DataFrame:
    """Every row priced (:func:`price`), in the order given."""
    return pd.DataFrame([price(row) for row in rows], columns=CSV_COLUMNS)


def ring_line(table: pd.DataFrame, transport: Transport) -> tuple[float, float, int] | None:
    """(a s per call, b s per ring step, rows) of the least-squares line through the published
    times of ``transport``'s rows that ran NCCL's Ring, over their ``2 (gpus - 1)`` steps; None
    with fewer than two distinct GPU counts."""
    ring = table[(table["nccl_algorithm"] == "ring") & (table["transport"] == transport.value)]
    if ring["gpus"].nunique() < 2:
        return None
    slope, intercept = np.polyfit(2.0 * (ring["gpus"] - 1), ring["published_s"], 1)
    return float(intercept), float(slope), len(ring)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def report_markdown(table: pd.DataFrame, command: str) -> str:
    """The comparison as a markdown page: the table, the published ring's line, the sources."""
    lines = ["# NCCL small-message allreduce: published nccl-tests against hetsim's defaults and NCCL's model", "",
             "Every hetsim figure is a **prediction** (uncalibrated defaults, `sim/transport.py`); nothing was "
             "tuned to these numbers. Error = model / published - 1. NCCL's model: `baseLat + 2 (p - 1) hwLat` "
             "of its Ring (NVIDIA/nccl `src/graph/tuning.cc`), LL (NCCL's choice at these sizes) and Simple "
             "(the protocol of hetsim's default).", "", f"Reproduce: `{command}`", "",
             "| row | GPUs | bytes | NCCL ran | transport | published | hetsim ring | hetsim auto | "
             "NCCL model LL | NCCL model Simple |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.id} | {r.gpus} | {r.size_bytes} | {r.nccl_algorithm} | {r.transport} | "
                     f"{_us(r.published_s)} | {_us(r.hetsim_ring_s)} ({r.hetsim_ring_error:+.0%}) | "
                     f"{_us(r.hetsim_auto_s)} {r.hetsim_auto_algorithm} ({r.hetsim_auto_error:+.0%}) | "
                     f"{_us(r.nccl_model_ll_s)} ({r.nccl_model_ll_error:+.0%}) | "
                     f"{_us(r.nccl_model_simple_s)} ({r.nccl_model_simple_error:+.0%}) |")
    lines.append("")
    for transport in NCCL_RING_HOP_LATENCY_S:
        line = ring_line(table, transport)
        if line is not None:
            a, b, n = line
            lines.append(f"- The published {transport.value} Ring times ({n} rows) lie on {_us(a)} per call + "
                         f"{_us(b)} per ring step (least squares; a description, used by no default): NCCL's "
                         f"model has {_us(NCCL_RING_BASE_LATENCY_S[NcclProtocol.LL])} + "
                         f"{_us(NCCL_RING_HOP_LATENCY_S[transport][NcclProtocol.LL])} (LL) and "
                         f"{_us(NCCL_RING_BASE_LATENCY_S[NcclProtocol.SIMPLE])} + "
                         f"{_us(NCCL_RING_HOP_LATENCY_S[transport][NcclProtocol.SIMPLE])} (Simple).")
    lines += ["", "## Sources", ""]
    lines += [f"- {r.id}: {r.source} ({r.reading})" for r in table.itertuples()]
    return "\n".join(lines) + "\n"
