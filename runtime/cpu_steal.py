"""CPU time others took while this machine's ranks ran: the hypervisor's other guests (steal) and
the other processes on the machine (load).

A measurement on a virtual machine runs on borrowed cores: when the host runs other guests on
them, the guest's tasks wait, and the kernel counts that time as *steal* (the 8th field of the
``cpu`` line of ``/proc/stat``, see proc(5)). Inside the machine, other processes (another
engineer's run, the testbed's delay forwarder, kernel threads) take cores from the ranks too,
which steal does not show: their share is the machine's busy time (``/proc/stat``: user, nice,
system, irq, softirq) less the ranks' own (``utime`` + ``stime`` of ``/proc/<pid>/stat``, every
thread of each rank's process). A validation run records both shares over the time each case was
measured, so a case that measured slow because the machine was taken away shows it in the report.
Times are in the kernel's clock ticks (``USER_HZ`` in both files); only their ratios are used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

PROC = Path("/proc")
PROC_STAT = PROC / "stat"

T = TypeVar("T")


def _cpu_fields(path: Path) -> list[int]:
    """user nice system idle iowait irq softirq steal of the ``cpu`` line (guest time is already
    in user); empty where ``path`` cannot be read."""
    try:
        fields = path.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return []
    return [int(v) for v in fields[1:9]]


def process_ticks(pids: Iterable[int], proc: Path = PROC) -> int:
    """Clock ticks the processes ``pids`` have run, user and system, all their threads
    (fields 14 and 15 of ``/proc/<pid>/stat``, proc(5)); a process that cannot be read adds 0."""
    ticks = 0
    for pid in pids:
        try:
            text = (proc / str(pid) / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may hold spaces: count after its end.
        fields = text[text.rindex(")") + 2:].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks


@dataclass(frozen=True)
class CpuSample:
    """One reading of the machine's and the ranks' CPU time (clock ticks since boot).

    Attributes:
        steal: ticks stolen by the hypervisor; busy: ticks any process or the kernel ran
            (user, nice, system, irq, softirq); total: all ticks of all CPUs; ours: ticks the
            ranks' processes ran.
    """

    steal: int
    busy: int
    total: int
    ours: int

    def __sub__(self, other: CpuSample) -> CpuSample:
        return CpuSample(self.steal - other.steal, self.busy - other.busy, self.total - other.total,
                         self.ours - other.ours)

    def __add__(self, other: CpuSample) -> CpuSample:
        return CpuSample(self.steal + other.steal, self.busy + other.busy, self.total + other.total,
                         self.ours + other.ours)

    @property
    def steal_fraction(self) -> float:
        """Stolen over all ticks of a span (a difference of two samples); NaN with no ticks."""
        return self.steal / self.total if self.total > 0 else float("nan")

    @property
    def other_load(self) -> float:
        """Other processes' share of the machine's CPU time over a span (a difference of two
        samples): busy ticks not the ranks', over all ticks, at least 0 (the two files are read
        a moment apart); NaN with no ticks."""
        return max(0, self.busy - self.ours) / self.total if self.total > 0 else float("nan")


ZERO = CpuSample(0, 0, 0, 0)


def cpu_sample(pids: Iterable[int], stat: Path = PROC_STAT, proc: Path = PROC) -> CpuSample:
    """The machine's CPU ticks now and those of the ranks' processes ``pids``; zeros where
    ``/proc/stat`` cannot be read."""
    ticks = _cpu_fields(stat)
    if not ticks:
        return ZERO
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]
    return CpuSample(ticks[7], busy, sum(ticks), process_ticks(pids, proc))


def own_ticks() -> int:
    """Clock ticks this process and its reaped children (the ranks of a launch, once it has
    returned) ran, user and system (``os.times``, times(2))."""
    times = os.times()
    return round((times.user + times.system + times.children_user + times.children_system)
                 * os.sysconf("SC_CLK_TCK"))


def load_during(run: Callable[[], T]) -> tuple[T, CpuSample]:
    """``run()`` (a launch of forked ranks that are reaped before it returns) and the machine's CPU
    ticks over it, ``ours`` this process's and its children's: the span's ``steal_fraction`` is
    the hypervisor's share and its ``other_load`` the other processes' share of the machine."""
    before, ours = cpu_sample(()), own_ticks()
    result = run()
    span = cpu_sample(()) - before
    return result, CpuSample(span.steal, span.busy, span.total, own_ticks() - ours)
