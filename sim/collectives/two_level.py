"""Hierarchical allreduces over N hosts of G ranks: few messages on the slow inter-host links.

* ``two_level_tree`` (MPICH's SMP-aware allreduce): binomial reduce to a leader per host (the
  host group's first rank), ring allreduce among the leaders, binomial broadcast in each host.
  ``2 ceil(lg G)(a_i + n b_i) + 2(N-1) a_e + 2((N-1)/N) n b_e`` (+ gamma terms).
* ``two_level_rs``: ring reduce-scatter in each host, then G ring allreduces of n/G bytes each, one
  among the ranks with the same local index on every host, then ring allgather in each host.
  ``2[(G-1) a_i + ((G-1)/G) n b_i] + 2(N-1) a_e + 2((N-1)/N)(n/G) b_e_eff``, where the G
  concurrent inter-host rings share one host NIC unless every device has its own.

Formulas: MPICH's SMP-aware allreduce (``src/mpi/coll/allreduce/allreduce_intra_smp.c``) priced
with the terms of Thakur, Rabenseifner, Gropp (IJHPCA 2005); their exact form for these schedules is
:func:`sim.collectives.closed_form.two_level_time_s`.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.errors import ConfigError
from models.ops import OpKind
from sim.collectives.binomial import binomial_broadcast_steps, binomial_reduce_steps
from sim.collectives.chunks import ByteRange, split
from sim.collectives.ring import ring_allgather, ring_allreduce_steps, ring_reduce_scatter
from sim.collectives.schedule import CommSchedule, in_parallel, make_schedule


def _check_partition(group: Sequence[int], host_groups: Sequence[Sequence[int]]) -> None:
    ranks = [rank for host in host_groups for rank in host]
    if any(not host for host in host_groups) or sorted(ranks) != sorted(group):
        raise ConfigError(
            "host_groups", f"must split the group {tuple(group)} into non-empty hosts, each rank once (got {host_groups})"
        )


def two_level_tree(group: Sequence[int], size_bytes: int, host_groups: Sequence[Sequence[int]]) -> CommSchedule:
    """Leader-based two-level allreduce; ``host_groups`` partitions ``group`` by host.

    Raises:
        ConfigError: ``host_groups`` is not a partition of ``group`` into non-empty groups.
    """
    _check_partition(group, host_groups)
    whole = ByteRange(0, size_bytes)
    leaders = [host[0] for host in host_groups]
    gather = in_parallel(*(binomial_reduce_steps(host, host[0], whole) for host in host_groups))
    spread = in_parallel(*(binomial_broadcast_steps(host, host[0], whole) for host in host_groups))
    steps = gather + ring_allreduce_steps(leaders, whole) + spread
    return make_schedule(OpKind.ALLREDUCE, "two_level_tree", group, None, size_bytes, steps)


def two_level_rs(group: Sequence[int], size_bytes: int, host_groups: Sequence[Sequence[int]]) -> CommSchedule:
    """Reduce-scatter / inter-host allreduce / allgather; ``host_groups`` partitions ``group`` by host.

    After the intra-host reduce-scatter the rank at local index i holds chunk (i + 1) mod G of its
    host's sum; the ranks at local index i of all hosts allreduce that chunk in a ring.

    Raises:
        ConfigError: ``host_groups`` is not a partition of ``group``, or hosts hold different
            numbers of ranks of the group.
    """
    _check_partition(group, host_groups)
    per_host = len(host_groups[0])
    if any(len(host) != per_host for host in host_groups):
        sizes = [len(host) for host in host_groups]
        raise ConfigError("host_groups", f"two_level_rs needs the same number of ranks on every host (got {sizes})")
    chunks = split(ByteRange(0, size_bytes), per_host)
    scatter = in_parallel(*(ring_reduce_scatter(host, chunks) for host in host_groups))
    peers = [[host[i] for host in host_groups] for i in range(per_host)]
    across = in_parallel(*(ring_allreduce_steps(peers[i], chunks[(i + 1) % per_host]) for i in range(per_host)))
    gather = in_parallel(*(ring_allgather(host, chunks) for host in host_groups))
    return make_schedule(OpKind.ALLREDUCE, "two_level_rs", group, None, size_bytes, scatter + across + gather)
