"""What the parallel layout does with the cluster, in lines for the terminal and the report: each
rank's slice of an uneven tensor-parallel split, each replica's share and figures, and the devices
the layout leaves idle (never silently)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.simulate import SimulationResult
from sim.vocabulary import Metric


def idle_warning(result: SimulationResult) -> str | None:
    """``warning: 2 of 6 devices idle: h2/dev0, h2/dev1 (...)``, or None when every device works."""
    return idle_line(result.idle_devices, len(result.topology.devices), layout_label(result))


def idle_line(idle: Sequence[str], total: int, layout: str) -> str | None:
    """The warning naming the ``idle`` devices of ``total`` under ``layout`` (``TP=4``), or None."""
    if not idle:
        return None
    return (f"warning: {len(idle)} of {total} devices idle: {', '.join(idle)} (the layout uses "
            f"{total - len(idle)}: {layout}; set parallel.tensor or parallel.replicas to use them)")


def layout_label(result: SimulationResult) -> str:
    """``TP=4``, ``TP=2 x PP=3`` or ``TP=2 x 3 replicas``, with ``uneven`` for a split by
    ``parallel.shares``; the device count where the variants choose their own layouts."""
    parallel = result.parallel
    if parallel is None or parallel.variant_layouts:
        return f"{len(result.ranks)} devices"
    label = f"TP={parallel.tensor}" + (" uneven" if parallel.shards is not None else "")
    if parallel.pipeline > 1:
        label += f" x PP={parallel.pipeline}"
    return label + (f" x {parallel.replicas} replicas" if parallel.replicas > 1 else "")


def layout_lines(result: SimulationResult) -> list[str]:
    """Lines describing the shards of an uneven split and each variant's replicas (none for an
    even split on one group)."""
    lines = []
    parallel, names = result.parallel, [d.name for d in result.topology.devices]
    if parallel is not None and parallel.shards is not None:
        lines.append("uneven tensor-parallel split (parallel.shares), query heads, KV heads and MLP columns "
                     "per device:")
        for group, shards in zip(parallel.replica_ranks, parallel.replica_shards):
            lines += [f"  {names[rank]}: {shard.label()}" for rank, shard in zip(group, shards)]
    for vr in result.variants:
        if not vr.replicas:
            continue
        total = vr.timing[Metric.DECODE_TOKENS_PER_S]
        lines.append(f"{vr.variant.name}: {len(vr.replicas)} replicas, {total:.1f} decode tok/s in all; "
                     "TTFT and TPOT above are the slowest replica's")
        for i, replica in enumerate(vr.replicas):
            t = replica.timing
            lines.append(f"  replica {i} on {', '.join(names[r] for r in replica.ranks)}: batch {replica.batch_size}, "
                         f"TTFT {t[Metric.TTFT] * 1e3:.3f} ms, TPOT {t[Metric.TPOT] * 1e3:.3f} ms, "
                         f"{t[Metric.DECODE_TOKENS_PER_S]:.1f} tok/s")
    return lines
