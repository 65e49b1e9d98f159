"""Closed-form alpha-beta-gamma costs of the collective algorithms.

Notation: p ranks, n bytes per rank, alpha = per-message latency (s), beta = 1/bandwidth (s/byte),
gamma = local reduction cost (s/byte), lg = log2. The formulas are the cost comments of MPICH's
``src/mpi/coll`` (Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005, section 4), written for the exact
schedules of this package, so that :class:`sim.network.AlphaBetaNetwork` reproduces them on a
uniform network (every path the same alpha and beta, each rank its own link):

* ring: ``2(p-1) a + 2((p-1)/p) n b + ((p-1)/p) n g``
* recursive doubling, p = 2^k: ``lg p (a + n b + n g)``
* Rabenseifner, p = 2^k: ``2 lg p a + 2((p-1)/p) n b + ((p-1)/p) n g``
* either of the two, p not a power of two: the p' = 2^floor(lg p) formula plus the fold and
  unfold, ``2 a + 2 n b + n g``. For Rabenseifner this is MPICH's
  ``(2 floor(lg p) + 2) a + (2(p'-1)/p' + 2) n b + (1 + (p'-1)/p') n g``; MPICH's comment writes
  (p-1)/p where the halving runs over p' ranks, which only the p' form matches exactly.
* star allreduce: ``2 a + 2(p-1) n b + (p-1) n g`` (the hub's link carries p-1 messages each way)
* star reduce / broadcast: ``a + (p-1) n b`` (+ ``(p-1) n g`` for reduce)
* binomial reduce / broadcast: ``ceil(lg p)(a + n b)`` (+ ``ceil(lg p) n g`` for reduce)
* double binary tree (NCCL ``src/graph/trees.cc``), k segments of m = n/(2k) bytes per tree, H
  the taller root's height, c the most tree neighbours of one rank and r the most children of
  one rank over both trees (c = 4, r = 2 from p = 4 on):
  ``(k + 2H - 1)(a + c m b) + (k + H - 1) r m g``. This charges every step the steady state of
  the pipeline, so it is an upper bound, within about 5% at k = 64 but up to 2x loose for one or
  two segments, where pipeline fill and drain dominate.
"""

from __future__ import annotations

import math

from models.errors import ConfigError
from models.ops import OpKind
from sim.collectives.double_binary_tree import nccl_double_tree, num_segments


def _lg_pow2_part(p: int) -> tuple[int, int]:
    """(floor(lg p), p' = 2^floor(lg p))."""
    k = p.bit_length() - 1
    return k, 1 << k


def _fold_s(p: int, n: float, a: float, b: float, g: float) -> float:
    """The non-power-of-two fold (n bytes in, reduced) and unfold (n bytes out)."""
    return 0.0 if p == _lg_pow2_part(p)[1] else 2 * a + 2 * n * b + n * g


def _ring(p: int, n: float, a: float, b: float, g: float) -> float:
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


def _recursive_doubling(p: int, n: float, a: float, b: float, g: float) -> float:
    lg, _ = _lg_pow2_part(p)
    return lg * (a + n * b + n * g) + _fold_s(p, n, a, b, g)


def _rabenseifner(p: int, n: float, a: float, b: float, g: float) -> float:
    lg, p2 = _lg_pow2_part(p)
    return 2 * lg * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * g + _fold_s(p, n, a, b, g)


def _star_allreduce(p: int, n: float, a: float, b: float, g: float) -> float:
    return 2 * a + 2 * (p - 1) * n * b + (p - 1) * n * g


def _double_binary_tree(p: int, n: float, a: float, b: float, g: float) -> float:
    trees = nccl_double_tree(p)
    k = num_segments(int(n))
    m = n / 2 / k
    height = max(tree.height(tree.root) for tree in trees)
    neighbours = max(sum(len(t.children[v]) + (v != t.root) for t in trees) for v in range(p))
    children = max(sum(len(t.children[v]) for t in trees) for v in range(p))
    return (k + 2 * height - 1) * (a + neighbours * m * b) + (k + height - 1) * children * m * g


def _star_reduce(p: int, n: float, a: float, b: float, g: float) -> float:
    return a + (p - 1) * n * b + (p - 1) * n * g


def _star_broadcast(p: int, n: float, a: float, b: float, g: float) -> float:
    return a + (p - 1) * n * b


def _binomial_reduce(p: int, n: float, a: float, b: float, g: float) -> float:
    return math.ceil(math.log2(p)) * (a + n * b + n * g)


def _binomial_broadcast(p: int, n: float, a: float, b: float, g: float) -> float:
    return math.ceil(math.log2(p)) * (a + n * b)


_FORMULAS = {
    OpKind.ALLREDUCE: {
        "ring": _ring,
        "recursive_doubling": _recursive_doubling,
        "rabenseifner": _rabenseifner,
        "star": _star_allreduce,
        "double_binary_tree": _double_binary_tree,
    },
    OpKind.REDUCE: {"binomial": _binomial_reduce, "star": _star_reduce},
    OpKind.BROADCAST: {"binomial": _binomial_broadcast, "star": _star_broadcast},
}


def closed_form_time_s(
    kind: OpKind, algorithm: str, p: int, size_bytes: int, alpha_s: float, beta_s_per_byte: float, gamma_s_per_byte: float
) -> float:
    """Time (s) of a flat collective on a uniform network; see the module docstring for the formulas.

    Args:
        kind: allreduce, reduce or broadcast.
        algorithm: ring, recursive_doubling, rabenseifner, star, double_binary_tree (allreduce);
            binomial, star (reduce, broadcast). Two-level ones: :func:`two_level_time_s`.
        p: number of ranks (>= 1; one rank takes no time).
        size_bytes: n, bytes per rank.
        alpha_s, beta_s_per_byte, gamma_s_per_byte: latency per message, inverse bandwidth, and
            reduction cost per byte.

    Raises:
        ConfigError: no closed form for ``kind`` and ``algorithm``, or ``p < 1``.
    """
    formulas = _FORMULAS.get(kind, {})
    if algorithm not in formulas:
        raise ConfigError(str(kind), f"no closed form for {kind} algorithm {algorithm!r}; known: {', '.join(formulas)}")
    if p < 1:
        raise ConfigError("p", f"must be at least 1 (got {p})")
    if p == 1:
        return 0.0
    return formulas[algorithm](p, float(size_bytes), alpha_s, beta_s_per_byte, gamma_s_per_byte)


def two_level_time_s(
    algorithm: str,
    num_hosts: int,
    ranks_per_host: int,
    size_bytes: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    gamma_s_per_byte: float,
    shared_nic: bool,
) -> float:
    """Time (s) of a two-level allreduce over N hosts of G ranks (MPICH's SMP-aware allreduce,
    ``src/mpi/coll/allreduce/allreduce_intra_smp.c``, priced with the Thakur et al. 2005 terms).

    With (a_i, b_i) = ``intra``, (a_e, b_e) = ``inter``, g = gamma, n = size:

    * ``two_level_tree``: ``2 ceil(lg G)(a_i + n b_i) + ceil(lg G) n g`` in the hosts, plus a ring
      allreduce of n among the N leaders ``2(N-1) a_e + 2((N-1)/N) n b_e + ((N-1)/N) n g``.
      Only one rank per host crosses the NIC, so ``shared_nic`` does not matter.
    * ``two_level_rs``: ring reduce-scatter and allgather in the hosts
      ``2[(G-1) a_i + ((G-1)/G) n b_i] + ((G-1)/G) n g``, plus G concurrent ring allreduces of
      n/G ``2(N-1) a_e + 2((N-1)/N)(n/G) b_e_eff + ((N-1)/N)(n/G) g``, where
      ``b_e_eff = G b_e`` when the G rings share the host's NIC (``shared_nic``; the NIC must then
      be the bottleneck of the inter-host path), else ``b_e``.

    Args:
        intra: (alpha_s, beta_s_per_byte) of a path between two ranks of one host.
        inter: (alpha_s, beta_s_per_byte) of a path between ranks of different hosts.

    Raises:
        ConfigError: unknown algorithm, or fewer than one host or rank per host.
    """
    if num_hosts < 1 or ranks_per_host < 1:
        raise ConfigError("two_level", f"needs at least one host and one rank per host (got {num_hosts} x {ranks_per_host})")
    (a_i, b_i), (a_e, b_e) = intra, inter
    n, hosts, local, g = float(size_bytes), num_hosts, ranks_per_host, gamma_s_per_byte
    if algorithm == "two_level_tree":
        depth = math.ceil(math.log2(local))
        return 2 * depth * (a_i + n * b_i) + depth * n * g + _ring(hosts, n, a_e, b_e, g)
    if algorithm == "two_level_rs":
        b_eff = local * b_e if shared_nic else b_e
        inside = 2 * (local - 1) * a_i + 2 * (local - 1) / local * n * b_i + (local - 1) / local * n * g
        return inside + _ring(hosts, n / local, a_e, b_eff, g)
    raise ConfigError("algorithm", f"no two-level closed form for {algorithm!r}; known: two_level_tree, two_level_rs")
