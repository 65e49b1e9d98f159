"""TCP's own count of the segments a rank's host retransmitted: evidence of losses under a measurement.

Linux keeps the MIB-II TCP group (RFC 4022) per network namespace and shows the reading process's
in ``/proc/self/net/snmp`` as two ``Tcp:`` lines, one of counter names and one of their values
(``snmp_seq_show_tcp_udp`` in ``net/ipv4/proc.c``). A rank of the emulated cluster runs in its
host's namespace (:mod:`runtime.testbed`), so the counters are its host's TCP traffic: the rank's
own where a host runs one rank, and, outside the testbed, the whole machine's. ``RetransSegs``
(``tcpRetransSegs``) counts the segments sent again after a loss or a timeout: a chain of bucket
allreduces that runs slower than the same collectives alone, message by message, with
retransmissions beside it points at TCP's congestion window, not at the code
(``validation/training-report/progress.md``, session 15).
"""

from __future__ import annotations

from pathlib import Path

SNMP_PATH = Path("/proc/self/net/snmp")


def retransmitted_segments(path: Path = SNMP_PATH) -> int | None:
    """``RetransSegs``: the TCP segments the reading process's network namespace has retransmitted
    since it was created (a count); None where ``path`` or its ``Tcp:`` counters cannot be read
    (not Linux, no procfs)."""
    try:
        lines = [line.split() for line in path.read_text().splitlines() if line.startswith("Tcp:")]
    except OSError:
        return None
    if len(lines) != 2 or "RetransSegs" not in lines[0] or len(lines[0]) != len(lines[1]):
        return None
    try:
        return int(lines[1][lines[0].index("RetransSegs")])
    except ValueError:
        return None
