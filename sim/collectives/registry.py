"""The algorithms a scenario can name, per collective kind, and the one entry point that builds them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from enum import StrEnum
from functools import lru_cache

from models.errors import ConfigError, shorten
from models.ops import OpKind
from sim.collectives.binomial import binomial_broadcast, binomial_reduce
from sim.collectives.doubling import rabenseifner, recursive_doubling
from sim.collectives.double_binary_tree import double_binary_tree
from sim.collectives.gloo import gloo_allreduce, gloo_broadcast, gloo_reduce
from sim.collectives.ring import ring_allreduce
from sim.collectives.schedule import CommSchedule
from sim.collectives.star import star_allreduce, star_broadcast, star_reduce
from sim.collectives.two_level import two_level_rs, two_level_tree

HostGroups = tuple[tuple[int, ...], ...]
Builder = Callable[[tuple[int, ...], int, int, HostGroups | None], CommSchedule]
"""``(group, size_bytes, root, host_groups) -> CommSchedule``; root is resolved (group[0] by default)."""


def _flat(build: Callable[[tuple[int, ...], int], CommSchedule]) -> Builder:
    return lambda group, size_bytes, root, host_groups: build(group, size_bytes)


def _rooted(build: Callable[[tuple[int, ...], int, int], CommSchedule]) -> Builder:
    return lambda group, size_bytes, root, host_groups: build(group, size_bytes, root)


def _hierarchical(name: str, build: Callable[[tuple[int, ...], int, HostGroups], CommSchedule]) -> Builder:
    def builder(group: tuple[int, ...], size_bytes: int, root: int, host_groups: HostGroups | None) -> CommSchedule:
        if host_groups is None:
            raise ConfigError("host_groups", f"allreduce algorithm '{name}' needs the group's ranks grouped by host (got None)")
        return build(group, size_bytes, host_groups)

    return builder


ALGORITHMS: dict[OpKind, dict[str, Builder]] = {
    OpKind.ALLREDUCE: {
        "ring": _flat(ring_allreduce),
        "recursive_doubling": _flat(recursive_doubling),
        "rabenseifner": _flat(rabenseifner),
        "star": _flat(star_allreduce),
        "double_binary_tree": _flat(double_binary_tree),
        "two_level_tree": _hierarchical("two_level_tree", two_level_tree),
        "two_level_rs": _hierarchical("two_level_rs", two_level_rs),
    },
    OpKind.REDUCE: {"binomial": _rooted(binomial_reduce), "star": _rooted(star_reduce)},
    OpKind.BROADCAST: {"binomial": _rooted(binomial_broadcast), "star": _rooted(star_broadcast)},
}
"""Builders by collective kind and the algorithm name a scenario writes."""

LIBRARY = "library"
"""The communication backend's own collective (gloo or NCCL), which the runtime calls directly."""

AUTO = "auto"
"""Not an algorithm: the simulator prices every algorithm of the kind and takes the fastest
(:class:`sim.network.CollectivePricer`)."""


class LibraryBroadcast(StrEnum):
    """The schedule ``library``'s broadcast is priced as."""

    BINOMIAL = "binomial"
    """MPICH's binomial tree (:func:`sim.collectives.binomial.binomial_broadcast`): the root sends
    one level after the other, farthest first, each send waited for."""
    GLOO_TREE = "gloo_tree"
    """gloo's own tree (:func:`sim.collectives.gloo.gloo_broadcast`, ``gloo/broadcast.cc``): every
    rank posts all its sends at once once it has received, the root freed once its payloads are
    written."""


LIBRARY_BROADCAST = LibraryBroadcast.GLOO_TREE
"""Which schedule ``library``'s broadcast is priced as (the offline benchmarks' ``--no-gloo-tree``
sets MPICH's order); read when a schedule is built, and part of :func:`_built`'s cache key. gloo's
own tree by default, as gloo runs it: it prices the prefill's broadcasts right with the links'
token buckets (:data:`sim.token_bucket.PRICED`: a root freed on writing two payloads of 96 KiB
over a 32 kB bucket), on by default with it (its comment has the figures)."""

_LIBRARY_MODEL: dict[OpKind, Builder] = {OpKind.ALLREDUCE: _flat(gloo_allreduce), OpKind.REDUCE: _rooted(gloo_reduce)}
_LIBRARY_BROADCASTS: dict[LibraryBroadcast, Builder] = {
    LibraryBroadcast.BINOMIAL: _rooted(binomial_broadcast),
    LibraryBroadcast.GLOO_TREE: _rooted(gloo_broadcast),
}


def library_model(kind: OpKind, broadcast: LibraryBroadcast | None = None) -> Builder:
    """What stands for ``library`` in the simulator until calibration refines it: gloo's
    algorithms as PyTorch calls them (:mod:`sim.collectives.gloo`; torch 2.13.0's
    ``ProcessGroupGloo.cpp``), the broadcast as ``broadcast`` says (default
    :data:`LIBRARY_BROADCAST`). ``kind`` must be a collective."""
    if kind == OpKind.BROADCAST:
        return _LIBRARY_BROADCASTS[LIBRARY_BROADCAST if broadcast is None else broadcast]
    return _LIBRARY_MODEL[kind]


def known_algorithms(kind: OpKind) -> tuple[str, ...]:
    """Every name a scenario may write for a collective of ``kind``: the registry's algorithms,
    ``library`` and ``auto``.

    Raises:
        ConfigError: ``kind`` is not a collective, listing the ones that are.
    """
    if kind not in ALGORITHMS:
        raise ConfigError("kind", f"not a collective; known: {', '.join(ALGORITHMS)} (got {str(kind)!r})")
    return (*ALGORITHMS[kind], LIBRARY, AUTO)


def build_schedule(
    kind: OpKind,
    algorithm: str,
    group: Sequence[int],
    size_bytes: int,
    *,
    root: int | None = None,
    host_groups: Sequence[Sequence[int]] | None = None,
) -> CommSchedule:
    """The point-to-point schedule of collective ``kind`` by ``algorithm``.

    Args:
        kind: allreduce, reduce or broadcast.
        algorithm: a key of ``ALGORITHMS[kind]``, or ``library`` (see :func:`library_model`).
        group: the participating global ranks, distinct, in the order the algorithm uses.
        size_bytes: n, bytes per rank (>= 0).
        root: root of a reduce or broadcast; defaults to ``group[0]``; ignored by allreduce.
        host_groups: ``group`` partitioned by host (e.g. ``Topology.host_groups(group)``);
            required by the two-level algorithms, ignored by the others.

    Returns:
        A :class:`CommSchedule`; for a group of one rank it has no steps (takes no time).

    Raises:
        ConfigError: unknown kind or algorithm (listing the known ones), empty group or repeated
            ranks, negative size, root outside the group, missing or bad host groups.
    """
    if kind not in ALGORITHMS:
        raise ConfigError("kind", f"not a collective; known: {', '.join(ALGORITHMS)} (got {str(kind)!r})")
    builders = ALGORITHMS[kind]
    if algorithm == LIBRARY:
        builders = {LIBRARY: library_model(kind)}
    if algorithm not in builders:
        raise ConfigError(str(kind), f"unknown {kind} algorithm; known: {', '.join((*builders, LIBRARY))} "
                                       f"(got {shorten(algorithm)})")
    members = tuple(group)
    if not members or len(set(members)) != len(members):
        raise ConfigError("group", f"must be non-empty with distinct ranks (got {members})")
    if size_bytes < 0:
        raise ConfigError("size_bytes", f"must not be negative (got {size_bytes})")
    if kind == OpKind.ALLREDUCE:
        resolved_root = members[0]
    else:
        resolved_root = members[0] if root is None else root
        if resolved_root not in members:
            raise ConfigError("root", f"must be a rank of the group {members} (got {root})")
    hosts = None if host_groups is None else tuple(tuple(host) for host in host_groups)
    broadcast = LIBRARY_BROADCAST if algorithm == LIBRARY and kind == OpKind.BROADCAST else None
    return _built(kind, algorithm, members, size_bytes, resolved_root, hosts, broadcast)


BUILT_SCHEDULES = 1024
"""How many schedules :func:`_built` keeps (a plan search asks for the same few hundred on each of
its clusters)."""


@lru_cache(maxsize=BUILT_SCHEDULES)
def _built(kind: OpKind, algorithm: str, members: tuple[int, ...], size_bytes: int, root: int,
           hosts: tuple[tuple[int, ...], ...] | None, broadcast: LibraryBroadcast | None) -> CommSchedule:
    """The schedule of validated arguments (see :func:`build_schedule`; ``broadcast``: the
    :data:`LIBRARY_BROADCAST` a library broadcast is built as, None for any other), shared by
    every caller: a schedule is immutable and depends on nothing else. A builder's ConfigError
    is not cached."""
    builders = {LIBRARY: library_model(kind, broadcast)} if algorithm == LIBRARY else ALGORITHMS[kind]
    schedule = builders[algorithm](members, size_bytes, root, hosts)
    # Named as asked, so calibrated timings of ``library`` are looked up under that name.
    return schedule if schedule.algorithm == algorithm else replace(schedule, algorithm=algorithm)
