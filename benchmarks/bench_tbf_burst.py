"""Benchmark: does a TCP message after an idle gap get its tbf bucket's burst (issue 18)?

The simulator can price a link's token bucket (:mod:`sim.token_bucket`): a message finding the
bucket full sends ``burst`` bytes at once and the rest at the rate. Whether a real message gets
that speed-up depends on the sender's TCP as well as on the tbf (Linux ``net/sched/sch_tbf.c``):
after an idle gap Linux restarts the congestion window of a loss-based control once the gap exceeds
the RTO (RFC 2861 / RFC 7661 cwnd validation; ``tcp_cwnd_restart``, ``net.ipv4.tcp_slow_start_after_idle``),
and BBR, the testbed's default, paces a flow restarting from idle at exactly its bandwidth
estimate (``bbr_cwnd_event`` in ``net/ipv4/tcp_bbr.c``; draft-cardwell-iccrg-bbr-congestion-control,
"Restarting From Idle"), so a burst could leave at the estimate, not at once; and on the
testbed's two shared cores the burst crosses the veths at what the CPU carries.

Two network namespaces joined by a veth, each end shaped as the testbed shapes a direct link
(:func:`runtime.testbed.shaping.tbf_args`: tbf at 100 Mbit/s, a 32 kB bucket, MTU 9000). A client
sends a message of n bytes; the server answers one byte once it has them all; the time is the
message's transfer plus a one-byte reply. Patterns before each timed message: an idle gap of
5 ms (the bucket refills in 2.6 ms), of 3.5 ms (about a GPT-2 prefill's compute between two
collectives on the testbed), a 4 MiB transfer (BBR's estimate then the shaped rate) and 5 ms, 20
messages of 3 KiB (a decode's collectives) and 5 ms, and 300 ms (more than the 200 ms minimum
RTO: the cwnd restart applies to cubic). Each under BBR and cubic (``TCP_CONGESTION``), with the
client and server alone on two cores and with ``--hogs`` busy processes beside them on those
cores (a run's compute). Prints per pattern the p10 / median / p90 time (ms) and the wire times
with and without the burst.

Needs root and iproute2; builds and removes its own namespaces (``bb-a``, ``bb-b``), not the
testbed's. About two minutes.

Run: ``.venv/bin/python benchmarks/bench_tbf_burst.py [--repeats 11] [--hogs 4] [--cores 0,1]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time

from runtime.testbed.netns import enter_namespace, ip, tc
from runtime.testbed.shaping import burst_applied_bytes, tbf_args

NAMESPACES = ("bb-a", "bb-b")
ADDRESSES = ("10.98.0.1", "10.98.0.2")
PORT = 5001
RATE_BYTES_PER_S = 100e6 / 8
BURST_BYTES = 32_000
MTU_BYTES = 9000
SIZES_BYTES = (65536, 98304, 393216)  # GPT-2 fp32 hidden states of 21, 32 and 128 tokens
HEADER_BYTES = 8
# name: (messages sent before the timed one (bytes), idle gap before it (s))
PATTERNS = {
    "idle 5 ms": ((), 5e-3),
    "idle 3.5 ms": ((), 3.5e-3),
    "4 MiB, idle 5 ms": ((4 << 20,), 5e-3),
    "20 x 3 KiB, idle 5 ms": ((3072,) * 20, 5e-3),
    "idle 300 ms": ((), 0.3),
}
CONTROLS = ("bbr", "cubic")


def up() -> None:
    """The two namespaces, a veth between them, each end tbf-shaped as a direct testbed link."""
    down()
    a, b = NAMESPACES
    for name in NAMESPACES:
        ip("netns", "add", name)
    ip("link", "add", "bb0", "netns", a, "type", "veth", "peer", "name", "bb1", "netns", b)
    for name, device, address in zip(NAMESPACES, ("bb0", "bb1"), ADDRESSES):
        ip("addr", "add", f"{address}/24", "dev", device, namespace=name)
        ip("link", "set", device, "mtu", str(MTU_BYTES), "up", namespace=name)
        tc("qdisc", "add", "dev", device, "root", *tbf_args(RATE_BYTES_PER_S, MTU_BYTES, BURST_BYTES), namespace=name)


def down() -> None:
    for name in NAMESPACES:
        ip("netns", "del", name, check=False)


def _pin(cores: set[int]) -> None:
    os.sched_setaffinity(0, cores)


def _server(ready, cores: set[int]) -> None:
    enter_namespace(NAMESPACES[1])
    _pin(cores)
    listener = socket.create_server((ADDRESSES[1], PORT))
    ready.set()
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while len(header := conn.recv(HEADER_BYTES, socket.MSG_WAITALL)) == HEADER_BYTES:
            left = int.from_bytes(header, "little")
            while left:
                left -= len(conn.recv(min(1 << 20, left)))
            conn.sendall(b"x")
        conn.close()


def _hog(stop, cores: set[int]) -> None:
    _pin(cores)
    while not stop.is_set():
        sum(range(100_000))


def _send(conn: socket.socket, payload: memoryview, size: int) -> float:
    """One message of ``size`` bytes and its one-byte answer (s); the size header goes first."""
    conn.sendall(size.to_bytes(HEADER_BYTES, "little"))
    start = time.perf_counter()
    conn.sendall(payload[:size])
    conn.recv(1)
    return time.perf_counter() - start


def timings(control: str, pattern: str, repeats: int) -> dict[int, list[float]]:
    """Per size, the sorted times (s) of ``repeats`` messages, each after ``pattern``, over one
    connection under congestion control ``control``."""
    before, idle_s = PATTERNS[pattern]
    conn = socket.create_connection((ADDRESSES[1], PORT))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, control.encode())
    payload = memoryview(bytes(8 << 20))
    for _ in range(3):  # past slow start
        _send(conn, payload, 1 << 20)
    times = {}
    for size in SIZES_BYTES:
        spans = []
        for _ in range(repeats):
            for message in before:
                _send(conn, payload, message)
                time.sleep(1e-3 if message < min(SIZES_BYTES) else 0.0)  # a decode's calls, 1 ms apart
            time.sleep(idle_s)
            spans.append(_send(conn, payload, size))
        times[size] = sorted(spans)
    conn.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--hogs", type=int, default=4, help="busy processes beside the pair in the loaded runs")
    parser.add_argument("--cores", default="0,1", help="the cores the pair and the hogs share")
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("bench_tbf_burst: needs root and iproute2's ip and tc on PATH")
    cores = {int(c) for c in args.cores.split(",")}
    burst = burst_applied_bytes(BURST_BYTES, MTU_BYTES)
    print("wire ms without the burst: " + ", ".join(f"{n}: {n / RATE_BYTES_PER_S * 1e3:.2f}" for n in SIZES_BYTES))
    print("wire ms with the burst:    " + ", ".join(f"{n}: {max(0, n - burst) / RATE_BYTES_PER_S * 1e3:.2f}"
                                                   for n in SIZES_BYTES))
    print("per size: p10 / median / p90 ms")
    up()
    try:
        ready = mp.Event()
        server = mp.Process(target=_server, args=(ready, cores), daemon=True)
        server.start()
        ready.wait(10)
        enter_namespace(NAMESPACES[0])  # this process is the client from here on
        _pin(cores)
        for hogs in (0, args.hogs):
            stop = mp.Event()
            busy = [mp.Process(target=_hog, args=(stop, cores), daemon=True) for _ in range(hogs)]
            for process in busy:
                process.start()
            for control in CONTROLS:
                for pattern, (_, idle_s) in PATTERNS.items():
                    times = timings(control, pattern, args.repeats if idle_s < 0.1 else 3)
                    cells = [f"{n}: {statistics.quantiles(t, n=10)[0] * 1e3:.2f} / {statistics.median(t) * 1e3:.2f}"
                             f" / {statistics.quantiles(t, n=10)[-1] * 1e3:.2f}" for n, t in times.items()]
                    print(f"{hogs} hogs, {control:5s} {pattern:22s} " + "; ".join(cells), flush=True)
            stop.set()
            for process in busy:
                process.join()
        server.kill()
    finally:
        down()


if __name__ == "__main__":
    main()
