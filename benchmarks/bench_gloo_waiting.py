"""What a pipeline's idle stage does to a busy stage's tensor-parallel collectives (issue 20:
tp2_pp2's TPOT predicted 26-35% fast): 4 gloo processes on loopback, ranks 0-1 run ``--calls``
3 KB reduce + broadcast pairs (the baseline strategy's decode collectives, ``library``) in their
own 2-rank group while ranks 2-3, per mode:

* ``sleep``: sleep (as if they had exited);
* ``recv``: wait as a pipeline's next stage waits: rank 2 in ``dist.recv`` from rank 0, rank 3 in
  its stage's broadcast from rank 2;
* ``spin``: burn a core each (a spinning waiter, for scale);
* ``busy``: run the same collectives in their own group.

Modes are interleaved round-robin over ``--repeats`` rounds. Prints, per mode, the median over
rounds of rank 0's median reduce + broadcast time, and the CPU time ranks 2-3 took per second
of their wait (``time.process_time``, every thread of the process), and the machine's CPU time
other processes took (``/proc/stat`` less ours) during the rounds.

Measured 2026-11-23, 300 pairs x 8 rounds, the 2 cores fully taken (other helpers' load; an upper
bound of any difference): ranks waiting in recv or a collective took 0.5-0.6% of a core, sleeping
ones 0.5%; rank 0's pair median, sleep / recv / spin / busy: loopback 0.70 / 0.80 / 0.89 / 0.81 ms
and 1.14 / 0.94 / 1.35 / 1.52 ms (two runs), inside a testbed host's namespace (``lo`` shaped by
tbf at 1 Gbit/s) 0.99 / 0.90 / 1.02 / 0.97 ms. Waiting ranks do not spin: gloo's
``UnboundBuffer::waitRecv`` (gloo/transport/tcp/unbound_buffer.cc) waits on a condition variable,
and torch's ``ProcessGroupGloo::RecvWork::wait`` calls it; gloo's busy polling is for pairs set
synchronous (``Pair::setSync``), which the process group does not use.

Run: ``PYTHONPATH=. python benchmarks/bench_gloo_waiting.py [--calls 200] [--repeats 7]`` (in a
testbed host: ``ip netns exec <prefix>-n0`` in front, under ``flock /work/testbed.lock``)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("sleep", "recv", "spin", "busy")
PAYLOAD_FLOATS = 768  # 3 KB of fp32: GPT-2's hidden size, one token


def _machine_busy_s() -> float:
    with open("/proc/stat") as stat:
        fields = [float(x) for x in stat.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _pair_calls(tensor: torch.Tensor, group, root: int, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.reduce(tensor, dst=root, group=group)
        dist.broadcast(tensor, src=root, group=group)
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, port: int, calls: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    front, back = dist.new_group([0, 1]), dist.new_group([2, 3])
    tensor = torch.ones(PAYLOAD_FLOATS)
    for _ in range(3):  # warm the pairs' connections
        _pair_calls(tensor, front if rank < 2 else back, 0 if rank < 2 else 2, 5)
    if rank == 0:  # warm the pipeline hop and the back stage's broadcast too
        dist.send(tensor, dst=2)
    elif rank == 2:
        dist.recv(tensor, src=0)
    if rank >= 2:
        dist.broadcast(tensor, src=2, group=back)
    for round_ in range(repeats):
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            dist.barrier()
            busy0, wall0, cpu0 = _machine_busy_s(), time.perf_counter(), time.process_time()
            if rank < 2:
                times = _pair_calls(tensor, front, 0, calls)
                if rank == 0:
                    dist.send(tensor, dst=2)  # releases the waiting stage in every mode
            elif mode == "sleep":
                time.sleep(calls * 2e-3)
            elif mode == "spin":
                end = time.perf_counter() + calls * 2e-3
                while time.perf_counter() < end:
                    pass
            elif mode == "busy":
                _pair_calls(tensor, back, 2, calls)
            if mode == "recv" and rank >= 2:  # as a pipeline's next stage: its master in recv, the rest
                if rank == 2:                     # in the stage's first collective
                    dist.recv(tensor, src=0)
                dist.broadcast(tensor, src=2, group=back)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            if rank == 2 and mode != "recv":
                dist.recv(tensor, src=0)
            dist.barrier()
            queue.put((rank, mode, round_, statistics.median(times) if rank < 2 else None, cpu / wall, wall,
                       _machine_busy_s() - busy0))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--port", type=int, default=29731)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(r, args.port, args.calls, args.repeats, queue))
                 for r in range(4)]
    for p in processes:
        p.start()
    rows = [queue.get() for _ in range(4 * len(MODES) * args.repeats)]
    for p in processes:
        p.join()
    print(f"{os.cpu_count()} cores; {args.calls} reduce+broadcast pairs of {PAYLOAD_FLOATS * 4} B per round, "
          f"{args.repeats} rounds")
    print("| mode | rank 0 pair median ms | ranks 2-3 CPU per wall s | ranks 0-1 CPU per wall s | machine busy cores |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        mine = [r for r in rows if r[1] == mode]
        pair = statistics.median(r[3] for r in mine if r[0] == 0) * 1e3
        idle = statistics.median(r[4] for r in mine if r[0] >= 2)
        front = statistics.median(r[4] for r in mine if r[0] < 2)
        busy = statistics.median(r[6] / r[5] for r in mine if r[0] == 0)
        print(f"| {mode} | {pair:.3f} | {idle:.3f} | {front:.3f} | {busy:.2f} |")


if __name__ == "__main__":
    main()
