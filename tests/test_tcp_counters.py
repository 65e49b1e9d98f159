"""runtime.tcp_counters: the TCP segments a namespace retransmitted, read from Linux's MIB-II
counters, and nothing (None) where they are not there to read."""

import sys
from pathlib import Path

import pytest

from runtime.tcp_counters import SNMP_PATH, retransmitted_segments

# /proc/net/snmp's TCP lines as Linux writes them (net/ipv4/proc.c), around the other groups'.
SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 9309841
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 5553 5283 204 153 0 4595287 4582705 5089 0 394 0
Udp: InDatagrams NoPorts
Udp: 7 0
"""


def test_the_retransmitted_segments_are_the_tcp_group_s_retranssegs(tmp_path):
    path = tmp_path / "snmp"
    path.write_text(SNMP)
    assert retransmitted_segments(path) == 5089


@pytest.mark.parametrize("text", ["", "Tcp: RtoAlgorithm InSegs\nTcp: 1 10\n", SNMP.replace(" 5089 ", " lost ")])
def test_counters_that_are_missing_or_unreadable_give_none(tmp_path, text):
    path = tmp_path / "snmp"
    path.write_text(text)
    assert retransmitted_segments(path) is None
    assert retransmitted_segments(tmp_path / "absent") is None


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path(SNMP_PATH).exists(), reason="Linux procfs")
def test_the_live_counter_is_a_count_that_never_goes_back():
    first = retransmitted_segments()
    assert first is not None and first >= 0
    assert retransmitted_segments() >= first
