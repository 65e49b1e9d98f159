"""CPU time the hypervisor gave to other guests while this virtual machine's ranks ran.

A measurement on a virtual machine runs on borrowed cores: when the host runs other guests on
them, the guest's tasks wait, and the kernel counts that time as *steal* (the 8th field of the
``cpu`` line of ``/proc/stat``, see proc(5)). A validation run records the fraction stolen while
each case was measured, so a case that measured slow because the machine was taken away shows
it in the report. Times are in the kernel's clock ticks; only their ratio is used.
"""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_ticks(path: Path = PROC_STAT) -> tuple[int, int]:
    """(steal, total) clock ticks of all CPUs since boot; (0, 0) where ``path`` cannot be read."""
    try:
        fields = path.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return 0, 0
    # user nice system idle iowait irq softirq steal guest guest_nice: guest time is already in user.
    ticks = [int(v) for v in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Stolen ticks over all ticks between two :func:`cpu_ticks` readings; NaN with no ticks."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")
