"""When a gloo ``isend`` over TCP completes against its ``irecv``: the socket's send buffer
(:data:`sim.transport.GLOO_SEND_BUFFER_S`, :data:`sim.transport.GLOO_SEND_BUFFER_MAX_BYTES`).

A TCP send completes once the kernel has taken its bytes; Linux grows a socket's send buffer to
twice its congestion window (``tcp_sndbuf_expand``, ``net/ipv4/tcp_input.c``), at most
``net.ipv4.tcp_wmem``'s maximum of socket memory. Inside a scenario's testbed (``hetsim testbed
up`` first), rank ``--src`` sends one buffer of each size to rank ``--dst`` (``--repeats``
times, sizes in turn, a barrier before each), and each side times its own completion. Prints per
size the medians, the receive less the send, and the bytes that gap holds at the path's rate
(``--rate``, bytes/s: what the receive takes beyond the send is the buffered tail draining).

Measured 2026-11-29 (quiet machine), medians of 5: v2x2_bandwidth, ranks 1 -> 2 (100 Mbit/s
between hosts): sends of 1 and 1.4 MB complete at once (0.5 ms; receives 82 and 109 ms), 2 MB
0.121 s before its receive, 4 MB 0.107 s, 8 MB 0.097 s (1.2-1.5 MB buffered); v2x2_latency, ranks
1 -> 2 (100 Mbit/s, 5 ms of path latency): 2 MB at once after the rendezvous (11 ms), 4 MB 0.134 s
before, 8 MB 0.143 s; v2x2_bandwidth, ranks 0 -> 1 (1 Gbit/s inside a host): 4 MiB at once,
16 MiB 22 ms before (2.8 MB buffered: ``tcp_wmem``'s 4 MiB of socket memory).

Run: ``flock /work/testbed.lock sh -c 'hetsim testbed up S && PYTHONPATH=. .venv/bin/python
benchmarks/bench_send_buffer.py S [--src 1 --dst 2 --sizes 1e6,2e6,4e6,8e6 --rate 12.5e6]; hetsim testbed down S'``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from runtime.launch import launch
from runtime.measure import placements_for
from sim.scenario import load_scenario
from sim.topology import build_topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("--src", type=int, default=1)
    parser.add_argument("--dst", type=int, default=2)
    parser.add_argument("--sizes", default="1048576,1378304,2097152,4194304,8388608")
    parser.add_argument("--rate", type=float, default=12.5e6, help="the path's bottleneck rate (bytes/s)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    topology = build_topology(scenario.config.cluster)
    ranks = tuple(range(topology.num_ranks))
    placements, enter = placements_for(scenario, topology, ranks, True)
    sizes = [int(float(size)) for size in args.sizes.split(",")]

    def body(rank: int, heartbeat):
        torch.set_num_threads(1)
        times = []
        for repeat in range(args.repeats):
            for size in sizes:
                buffer = torch.zeros(size // 4)
                dist.barrier()
                start = time.perf_counter()
                if rank == args.src:
                    dist.isend(buffer, dst=args.dst).wait()
                    times.append(("send", size, time.perf_counter() - start))
                elif rank == args.dst:
                    dist.irecv(buffer, src=args.src).wait()
                    times.append(("recv", size, time.perf_counter() - start))
                dist.barrier()
            heartbeat(f"repeat {repeat}")
        gathered = [None] * len(ranks) if rank == 0 else None
        dist.gather_object(times, gathered, dst=0)
        return gathered

    gathered = launch(body, len(ranks), placements=placements, enter_namespace=enter)[0]
    medians = {}
    for part in gathered:
        for side, size, seconds in part:
            medians.setdefault((side, size), []).append(seconds)
    with open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
        print(f"{scenario.name}: rank {args.src} -> {args.dst}; net.ipv4.tcp_wmem {wmem.read().split()}")
    print("| size (bytes) | send (s) | receive (s) | receive - send (s) | buffered at the rate (bytes) |")
    print("|---|---|---|---|---|")
    for size in sizes:
        send = statistics.median(medians[("send", size)])
        receive = statistics.median(medians[("recv", size)])
        print(f"| {size} | {send:.4f} | {receive:.4f} | {receive - send:.4f} | {(receive - send) * args.rate:.3g} |")


if __name__ == "__main__":
    main()
