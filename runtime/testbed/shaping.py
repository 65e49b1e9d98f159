"""Rate shaping with tbf: commands from rates, and what ``tc -s qdisc`` says is in force.

Settings measured on this machine (see :mod:`runtime.testbed`): MTU 9000 on the inter-host devices and
a tbf burst of 32 kB give 0.98-0.99 of 100-200 Mbit/s; with MTU 1500 and small bursts rates
undershoot. The burst is the scenario's (a link's ``burst``, :class:`sim.cluster_config.LinkConfig`;
the shipped testbed scenarios declare 32 kB between hosts and 128 KiB on ``lo``), so that the
simulator prices the bucket the testbed applies (:mod:`sim.token_bucket`). tbf drops outright a
packet larger than its burst, so the burst is at least two MTUs (:data:`MIN_BURST_MTUS`), also
where the link declares none or less: 18 kB between hosts, 128 KiB on ``lo`` (MTU 65536; with
32 kB, transfers over ``lo`` stall, measured here). Before links declared a burst, every tbf
here had max(32 kB, two MTUs): the profiles calibrated then ran with those (:mod:`sim.context`).
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

MIN_BURST_MTUS = 2
QUEUE_LATENCY_S = 0.050


def burst_applied_bytes(burst_bytes: int | None, mtu_bytes: int) -> int:
    """The tbf bucket (bytes) for a link declaring ``burst_bytes`` (None: none) over devices of
    ``mtu_bytes``: the declared one, at least :data:`MIN_BURST_MTUS` MTUs (module docstring)."""
    return max(burst_bytes or 0, MIN_BURST_MTUS * mtu_bytes)


def tbf_args(rate_bytes_per_s: float, mtu_bytes: int, burst_bytes: int | None) -> list[str]:
    """``tc`` arguments of a tbf at ``rate_bytes_per_s`` for packets up to ``mtu_bytes``, its
    bucket ``burst_bytes`` deep as :func:`burst_applied_bytes` applies it."""
    burst = burst_applied_bytes(burst_bytes, mtu_bytes)
    return ["tbf", "rate", f"{round(rate_bytes_per_s * 8)}bit", "burst", str(burst),
            "latency", f"{round(QUEUE_LATENCY_S * 1e6)}us"]


def shape_egress(namespace: str, device: str, rate_bytes_per_s: float, mtu_bytes: int,
                 burst_bytes: int | None) -> None:
    """Limit what ``device`` of ``namespace`` sends to ``rate_bytes_per_s``, with a bucket of
    ``burst_bytes`` (:func:`tbf_args`). Raises TestbedError."""
    tc("qdisc", "add", "dev", device, "root", *tbf_args(rate_bytes_per_s, mtu_bytes, burst_bytes),
       namespace=namespace)


def shape_ingress(namespace: str, device: str, rate_bytes_per_s: float, mtu_bytes: int,
                  burst_bytes: int | None) -> str:
    """Limit what ``device`` of ``namespace`` receives to ``rate_bytes_per_s``, through an ifb,
    with a bucket of ``burst_bytes`` (:func:`tbf_args`).

    Returns the ifb's name, ``<device>-down``. Raises TestbedError.
    """
    ifb = f"{device}-down"
    ip("link", "add", ifb, "type", "ifb", namespace=namespace)
    ip("link", "set", ifb, "mtu", str(mtu_bytes), "up", namespace=namespace)
    tc("qdisc", "add", "dev", device, "handle", "ffff:", "ingress", namespace=namespace)
    # u32 matching everything: this kernel has no matchall classifier.
    tc("filter", "add", "dev", device, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
       "action", "mirred", "egress", "redirect", "dev", ifb, namespace=namespace)
    shape_egress(namespace, ifb, rate_bytes_per_s, mtu_bytes, burst_bytes)
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
