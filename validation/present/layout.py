"""What the parallel layout does with the cluster, in lines for the terminal and the report: each
rank's slice of an uneven tensor-parallel split, each replica's share and figures, and the devices
the layout leaves idle (never silently)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.simulate import SimulationResult
from sim.units import duration_text
from sim.vocabulary import Metric


def idle_warnings(result: SimulationResult) -> list[str]:
    """``warning: 2 of 6 devices idle: h2/dev0, h2/dev1 (...)`` for the scenario's layout; where the
    variants choose their own layouts, one such line per variant that leaves devices idle, named
    after it. Empty when every device works."""
    total = len(result.topology.devices)
    if result.parallel is None or not result.parallel.variant_layouts:
        line = idle_line(result.idle_devices, total, layout_label(result))
        return [line] if line else []
    return [line for vr in result.variants
            if (line := idle_line(vr.layout.idle_devices, total, vr.layout.label, f"{vr.variant.name}: "))]


def idle_line(idle: Sequence[str], total: int, layout: str, variant: str = "") -> str | None:
    """The warning naming the ``idle`` devices of ``total`` under ``layout`` (``TP=4``), after
    ``variant`` (``tp2: ``) where the variant chose it; None when none is idle."""
    if not idle:
        return None
    return (f"warning: {variant}{len(idle)} of {total} devices idle: {', '.join(idle)} (the layout uses "
            f"{total - len(idle)}: {layout}; set parallel.tensor or parallel.replicas to use them)")


def layout_label(result: SimulationResult) -> str:
    """The scenario's layout (:attr:`sim.parallel.ParallelPlan.label`); the device count where
    the variants choose their own layouts."""
    parallel = result.parallel
    if parallel is None or parallel.variant_layouts:
        return f"{len(result.ranks)} devices"
    return parallel.label


def layout_lines(result: SimulationResult) -> list[str]:
    """Lines describing the shards of an uneven split and each variant's replicas (none for an
    even split on one group)."""
    lines = []
    parallel, names = result.parallel, [d.name for d in result.topology.devices]
    if parallel is not None and parallel.variant_layouts:
        layouts = [(f"{vr.variant.name}: ", vr.layout) for vr in result.variants]
    else:
        layouts = [("", parallel)] if parallel is not None else []
    for variant, layout in layouts:
        if layout.shards is None:
            continue
        lines.append(f"{variant}{layout.shares_note}: query heads, KV heads and MLP columns per device:")
        for group, shards in zip(layout.replica_ranks, layout.replica_shards):
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
                         f"TTFT {duration_text(t[Metric.TTFT])}, TPOT {duration_text(t[Metric.TPOT])}, "
                         f"{t[Metric.DECODE_TOKENS_PER_S]:.1f} tok/s")
    return lines
