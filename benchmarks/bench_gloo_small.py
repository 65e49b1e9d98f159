"""What a small gloo collective costs in a group of 2 against one of 4 (issue 20: tp2_pp2's TPOT
predicted 26-35% fast, its stages' TP 2 groups priced from a TP 4 calibration).

4 gloo processes on loopback (or a testbed host's ``lo``, see Run). In rounds over ``--repeats``,
interleaved, rank 0 times ``--calls`` back-to-back calls of each op on ``--bytes`` (default 3 KB
of fp32, GPT-2's hidden size: a decode step's collective) per group:

* ``2``: ranks 0-1 in a group of their own, ranks 2-3 asleep in a barrier meanwhile (a pipeline's
  other stage waiting for its input);
* ``4``: all four ranks in one group;

and per state of the cores the ranks leave idle while they wait:

* ``halting``: as they are (this VM's guest halts an idle vCPU at once: ``cpuidle_haltpoll`` with
  ``haltpoll.guest_halt_poll_ns=0`` on its kernel command line, so a message to a rank whose core
  went idle waits for the hypervisor to run that vCPU again);
* ``kept busy``: a ``SCHED_IDLE`` spinner per core, which takes a core only while no rank wants it
  and keeps it from halting (its CPU time counts as other processes' below).

Ops: gloo's own ``reduce``, ``broadcast`` and ``allreduce`` (``library``), and a point-to-point
round trip between ranks 0 and 1 (``pingpong``: half of it reported, a message's cost). A call's
time is rank 0's, from entering to leaving it; back to back, each call starts as the one before
ended, so the mean per call is what a chain of dependent calls pays. Prints per group and op the
median over rounds of rank 0's median and mean per call (ms), and the CPU time other processes
took on the machine during the rounds (``/proc/stat`` less the 4 ranks' ``/proc/<pid>/stat``), in
cores: measured under load it is an upper bound of any difference.

Measured 2026-11-24 on the project's 2-core VM, 0.34-1.33 cores of other load: group of 2,
reduce 0.41-0.56 ms median (0.74-1.05 mean), broadcast 0.23-0.33 (0.43-0.63), allreduce
0.57-0.80; group of 4, reduce 3.0-4.3, broadcast 0.64-0.97, allreduce 5.0-7.5. Keeping the idle
cores busy took the 2-rank round trip from 0.43-0.53 to 0.13-0.16 ms per message under load, and
left it as it was (0.16 ms) with 0.34 cores of other load. With ``--matmuls 4`` (0.6 cores of
other load) the 2-rank reduce took 0.87 ms median, 1.31 mean (0.50 and 1.03 back to back).

Run: ``PYTHONPATH=. python benchmarks/bench_gloo_small.py [--calls 200] [--repeats 7] [--bytes 3072] [--matmuls 0]``
(in a testbed host: ``ip netns exec <prefix>-n0`` in front, under ``flock /work/testbed.lock``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUPS = (2, 4)
CORES = ("halting", "kept busy")  # idle cores as they are, or taken by a SCHED_IDLE spinner each
_SPINNER = "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True:\n    pass\n"
OPS = ("reduce", "broadcast", "allreduce", "pingpong")
WORLD = 4


def _cpu_s(pids: list[int] | None = None) -> float:
    """The machine's busy CPU time (s), or that of ``pids`` (every thread)."""
    tick = os.sysconf("SC_CLK_TCK")
    if pids is None:
        with open("/proc/stat") as stat:
            fields = [float(x) for x in stat.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / tick  # less idle, iowait
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (float(fields[11]) + float(fields[12])) / tick  # utime, stime
    return total


def _call(op: str, tensor: torch.Tensor, group, rank: int) -> None:
    if op == "reduce":
        dist.reduce(tensor, dst=0, group=group)
    elif op == "broadcast":
        dist.broadcast(tensor, src=0, group=group)
    elif op == "allreduce":
        dist.all_reduce(tensor, group=group)
    elif rank == 0:  # pingpong: 0 -> 1 -> 0
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    else:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)


def _worker(rank: int, args, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    groups = {2: dist.new_group([0, 1]), 4: dist.new_group(list(range(WORLD)))}
    tensor = torch.zeros(args.bytes // 4)
    weight, row = torch.randn(768, 1152), torch.randn(1, 768)  # GPT-2's qkv_proj shard of 2, one token
    results: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for round_index, cores in ((r, c) for r in range(args.repeats + 1) for c in CORES):  # round 0 warms up
        spinners = []
        if rank == 0 and cores != CORES[0]:
            spinners = [subprocess.Popen([sys.executable, "-c", _SPINNER]) for _ in range(os.cpu_count() or 1)]
            time.sleep(0.2)  # started and spinning
        dist.barrier()
        for size in GROUPS:
            for op in OPS if size == 2 else OPS[:-1]:  # a round trip is between ranks 0 and 1 alone
                if rank < size and not (op == "pingpong" and rank > 1):
                    times = []
                    for _ in range(args.calls):
                        for _ in range(args.matmuls):  # a decode step's compute between its collectives
                            row @ weight
                        start = time.perf_counter()
                        _call(op, tensor, groups[size], rank)
                        times.append(time.perf_counter() - start)
                    if round_index and rank == 0:
                        scale = 0.5 if op == "pingpong" else 1.0
                        results.setdefault((cores, size, op), []).append(
                            (statistics.median(times) * scale, statistics.mean(times) * scale))
                dist.barrier()  # the others sleep here meanwhile
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per op, group and round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--bytes", type=int, default=3072, help="message size per rank (bytes, a multiple of 4)")
    parser.add_argument("--matmuls", type=int, default=0,
                        help="1 x 768 x 1152 matmuls every rank runs before each call (0: calls back to back)")
    args = parser.parse_args(argv)
    if args.matmuls < 0:
        print(f"--matmuls: must be 0 or more (got {args.matmuls})", file=sys.stderr)
        return 2
    for name in ("calls", "repeats", "bytes"):
        if getattr(args, name) < 1 or (name == "bytes" and args.bytes % 4):
            print(f"--{name}: must be a positive{' multiple of 4' if name == 'bytes' else ''} (got {getattr(args, name)})",
                  file=sys.stderr)
            return 2
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(rank, args, port, queue)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    busy0, wall0 = _cpu_s(), time.monotonic()
    while queue.empty():  # a rank that failed leaves no result: stop instead of waiting for ever
        if any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in procs:
                proc.kill()
            print("a rank failed (its error is above)", file=sys.stderr)
            return 1
        time.sleep(0.5)
    results = queue.get()
    ours = _cpu_s([p.pid for p in procs])
    busy, wall = _cpu_s() - busy0, time.monotonic() - wall0
    for proc in procs:
        proc.join()
    print(f"{os.cpu_count()} cores; {args.calls} calls of {args.bytes} B per op, group and round, {args.repeats} rounds, "
          f"{args.matmuls} matmuls before each; "
          f"other processes took {max(0.0, busy - ours) / wall:.2f} cores, the ranks {ours / wall:.2f} "
          f"(start-up included)")
    print("| idle cores | group | op | median per call ms | mean per call ms |")
    print("|---|---|---|---|---|")
    for (cores, size, op), values in sorted(results.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
        print(f"| {cores} | {size} | {op} | {statistics.median(v[0] for v in values) * 1e3:.3f} | "
              f"{statistics.median(v[1] for v in values) * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
