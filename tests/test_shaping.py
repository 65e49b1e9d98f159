"""runtime.testbed.shaping: the tbf settings the testbed's links get, and what ``tc -s`` reports
as dropped (the column that marks a measurement made with losses)."""

import json

from runtime.testbed import shaping
from runtime.testbed.errors import TestbedError

# ``tc -j -s qdisc show`` in a delayed host's namespace (iproute2 6.x): eth0's and the ifb's
# tbf, lo's, and the ingress qdisc that is not a tbf.
QDISCS = [
    {"kind": "tbf", "handle": "8001:", "dev": "eth0", "root": True, "refcnt": 2,
     "options": {"rate": 12500000, "burst": 32000, "lat": 50000},
     "bytes": 9_000_000, "packets": 1100, "drops": 3, "overlimits": 40, "requeues": 0, "backlog": 0, "qlen": 0},
    {"kind": "ingress", "handle": "ffff:", "dev": "eth0", "parent": "ffff:fff1",
     "bytes": 0, "packets": 0, "drops": 0, "overlimits": 0, "requeues": 0, "backlog": 0, "qlen": 0},
    {"kind": "tbf", "handle": "8002:", "dev": "eth0-down", "root": True, "refcnt": 2,
     "options": {"rate": 12500000, "burst": 32000, "lat": 50000},
     "bytes": 8_000_000, "packets": 1000, "drops": 4, "overlimits": 30, "requeues": 0, "backlog": 0, "qlen": 0},
    {"kind": "tbf", "handle": "8003:", "dev": "lo", "root": True, "refcnt": 2,
     "options": {"rate": 1e9, "burst": 131072, "lat": 50000},
     "bytes": 100, "packets": 1, "drops": 0, "overlimits": 0, "requeues": 0, "backlog": 0, "qlen": 0},
]


def test_every_root_tbf_is_read_and_nothing_else():
    shaped = shaping.parse_tbf(json.dumps(QDISCS))
    assert sorted(shaped) == ["eth0", "eth0-down", "lo"]
    assert shaped["eth0"]["dropped_packets"] == 3 and shaped["eth0"]["rate_bytes_per_s"] == 12.5e6


def test_dropped_packets_add_up_over_the_host_s_tbfs(monkeypatch):
    monkeypatch.setattr(shaping, "tc", lambda *args, namespace=None: json.dumps(QDISCS))
    assert shaping.dropped_packets() == 7


def test_no_tbf_or_no_tc_gives_no_drop_count(monkeypatch):
    monkeypatch.setattr(shaping, "tc", lambda *args, namespace=None: json.dumps(QDISCS[1:2]))
    assert shaping.dropped_packets() is None  # outside the testbed: nothing shaped, nothing to count

    def fails(*args, namespace=None):
        raise TestbedError("testbed", "command failed: tc")
    monkeypatch.setattr(shaping, "tc", fails)
    assert shaping.dropped_packets() is None
