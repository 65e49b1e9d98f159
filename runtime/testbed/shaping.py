"""Rate shaping with tbf: commands from rates, and what ``tc -s qdisc`` says is in force.

Settings measured on this machine (see :mod:`runtime.testbed`): MTU 9000 on the inter-host devices and
a tbf burst of 32 kB give 0.98-0.99 of 100-200 Mbit/s; with MTU 1500 and small bursts rates
undershoot. tbf drops outright a packet larger than its burst, so the burst is at least two
MTUs: 128 KiB on ``lo`` (MTU 65536; with 32 kB, transfers over ``lo`` stall, measured here).
The queue holds at most 50 ms of traffic at the rate before tbf drops; TCP still kept 100-200
Mbit/s links 0.99 busy at a 100 ms RTT (measured here, no drops).

Inter-host downlinks: with the delay forwarder, on the receiving side: the forwarder writes
packets into the destination's TUN, whose ingress cannot hold a tbf, so the ingress redirects
everything to an ifb device (``<device>-down``) whose egress tbf is the downlink. Without it,
the downlink is the egress tbf of the bridge port that leads to the host.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.testbed.errors import TestbedError
from runtime.testbed.netns import ip, tc

BURST_BYTES = 32_000
QUEUE_LATENCY_S = 0.050


def tbf_args(rate_bytes_per_s: float, mtu_bytes: int) -> list[str]:
    """``tc`` arguments of a tbf at ``rate_bytes_per_s`` for packets up to ``mtu_bytes``."""
    burst = max(BURST_BYTES, 2 * mtu_bytes)
    return ["tbf", "rate", f"{round(rate_bytes_per_s * 8)}bit", "burst", str(burst),
            "latency", f"{round(QUEUE_LATENCY_S * 1e6)}us"]


def shape_egress(namespace: str, device: str, rate_bytes_per_s: float, mtu_bytes: int) -> None:
    """Limit what ``device`` of ``namespace`` sends to ``rate_bytes_per_s``. Raises TestbedError."""
    tc("qdisc", "add", "dev", device, "root", *tbf_args(rate_bytes_per_s, mtu_bytes), namespace=namespace)


def shape_ingress(namespace: str, device: str, rate_bytes_per_s: float, mtu_bytes: int) -> str:
    """Limit what ``device`` of ``namespace`` receives to ``rate_bytes_per_s``, through an ifb.

    Returns the ifb's name, ``<device>-down``. Raises TestbedError.
    """
    ifb = f"{device}-down"
    ip("link", "add", ifb, "type", "ifb", namespace=namespace)
    ip("link", "set", ifb, "mtu", str(mtu_bytes), "up", namespace=namespace)
    tc("qdisc", "add", "dev", device, "handle", "ffff:", "ingress", namespace=namespace)
    # u32 matching everything: this kernel has no matchall classifier.
    tc("filter", "add", "dev", device, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
       "action", "mirred", "egress", "redirect", "dev", ifb, namespace=namespace)
    shape_egress(namespace, ifb, rate_bytes_per_s, mtu_bytes)
    return ifb


def tbf_in_force(namespace: str | None = None) -> dict[str, dict[str, Any]]:
    """The root tbf of each device of ``namespace`` (None: the calling thread's own), from
    ``tc -s qdisc``, by device name (:func:`parse_tbf`).

    Raises TestbedError if ``tc`` fails (e.g. no such namespace).
    """
    return parse_tbf(tc("-j", "-s", "qdisc", "show", namespace=namespace))


def parse_tbf(qdiscs_json: str) -> dict[str, dict[str, Any]]:
    """The root tbf of each device in ``tc -j -s qdisc show``'s output, by device name.

    Each entry: ``rate_bytes_per_s``, ``burst_bytes``, ``sent_bytes``, ``sent_packets``,
    ``dropped_packets`` (what the tbf dropped because its queue was full: ``qdisc_drop`` in
    ``tbf_enqueue``, ``net/sched/sch_tbf.c``), ``backlog_bytes``. Devices without a root tbf are
    left out.
    """
    qdiscs = json.loads(qdiscs_json or "[]")
    return {
        qdisc["dev"]: {
            "rate_bytes_per_s": float(qdisc["options"]["rate"]),
            "burst_bytes": qdisc["options"]["burst"],
            "sent_bytes": qdisc["bytes"],
            "sent_packets": qdisc["packets"],
            "dropped_packets": qdisc["drops"],
            "backlog_bytes": qdisc["backlog"],
        }
        for qdisc in qdiscs
        if qdisc["kind"] == "tbf" and qdisc.get("root")
    }


def dropped_packets() -> int | None:
    """The packets every root tbf of the calling thread's network namespace has dropped since it
    was added (a count): a rank's host's links in the testbed (uplink, downlink ifb, ``lo``).
    None where there is no tbf (outside the testbed) or ``tc`` cannot be run."""
    try:
        shaped = tbf_in_force()
    except (TestbedError, OSError):
        return None
    return sum(entry["dropped_packets"] for entry in shaped.values()) if shaped else None
