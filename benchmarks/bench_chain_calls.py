"""What a collective costs alone against queued behind others (issue 19: the training calibration's
``chain``, :data:`runtime.training.calibrate.BUCKET_CHAIN_CALLS`).

DDP's buckets after the first queue on the communication stream and run back to back; the
inference calibration times each call alone, every rank starting at one deadline. Inside a
scenario's testbed (``hetsim testbed up`` first), every rank builds two
:class:`runtime.comm_timing.CollectiveSweep` of the allreduce ``--algorithm`` over every rank at
``--sizes``, one timing each call alone (``chain`` 1), one ``--chain`` calls back to back, and
runs their rounds in turn (``--rounds``), so that both sample the same stretch of the machine's
time. Prints per size each sweep's row (median, p10, p90, mean over rounds, ms) and chain over
alone (medians).

Measured 2026-11-29 (quiet machine; with the scratch script this one replaces, 3 rounds of 10
calls each): v2x2_bandwidth (2 hosts x 2 ranks, 100 Mbit/s between them), ring, alone / in a
chain of 10, medians: 256 KiB 34.0 / 33.8 ms; 1 MiB 149 / 161 ms (alone p10 126, p90 180:
bimodal; chain p10 149, p90 171); 4 MiB 547 / 545 ms. v4x1_bandwidth (4 hosts x 1 rank): 1 MiB
126.4 / 127.7 ms (the wire's 126), 4 MiB 512 / 513 ms. This script, 6 rounds, chains of 4, two
runs on v2x2_bandwidth: 1 MiB alone 166.3 and 154.4 ms (p10 142 and 147, p90 188 and 172), chained
163.0 and 165.1 (p10-p90 160-173); v2x2_latency and v4x1_latency chain / alone 0.99-1.01 at every size.

Run: ``flock /work/testbed.lock sh -c 'hetsim testbed up S && PYTHONPATH=. .venv/bin/python
benchmarks/bench_chain_calls.py S [--sizes 262144,1048576,4194304 --chain 4 --rounds 5]; hetsim testbed down S'``
"""

from __future__ import annotations

import argparse

import torch

from models.ops import OpKind
from runtime.comm import Communicator
from runtime.comm_timing import CollectiveSweep
from runtime.launch import launch
from runtime.measure import placements_for
from sim.scenario import load_scenario
from sim.topology import build_topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--sizes", default="262144,1048576,4194304")
    parser.add_argument("--chain", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    topology = build_topology(scenario.config.cluster)
    ranks = tuple(range(topology.num_ranks))
    placements, enter = placements_for(scenario, topology, ranks, True)
    sizes = tuple(int(float(size)) for size in args.sizes.split(","))

    def body(rank: int, heartbeat):
        torch.set_num_threads(1)
        comm = Communicator(rank, topology.host_groups)
        sweeps = {chain: CollectiveSweep(ranks, topology, rank, comm, float("inf"), heartbeat, sizes=sizes,
                                         algorithms={OpKind.ALLREDUCE: (args.algorithm,), OpKind.REDUCE: (),
                                                     OpKind.BROADCAST: ()}, chain=chain)
                  for chain in (1, args.chain)}
        for index in range(args.rounds):
            for sweep in sweeps.values():
                sweep.round(f"round {index + 1} of {args.rounds}")
        return {chain: sweep.rows() for chain, sweep in sweeps.items()}

    rows = launch(body, len(ranks), placements=placements, enter_namespace=enter)[0]
    print(f"{scenario.name}: {args.algorithm} allreduce over {len(ranks)} ranks, {args.rounds} rounds; "
          f"alone and {args.chain} calls back to back (ms per call)")
    print("| size (bytes) | alone median | p10 | p90 | mean | chain median | p10 | p90 | mean | chain / alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for alone, chained in zip(rows[1], rows[args.chain], strict=True):
        cells = [f"{row[key] * 1e3:.1f}" for row in (alone, chained) for key in ("median", "p10", "p90", "mean")]
        print(f"| {alone['size_bytes']} | {' | '.join(cells)} | {chained['median'] / alone['median']:.3f} |")


if __name__ == "__main__":
    main()
