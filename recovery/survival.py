"""Exact odds that f simultaneous node failures leave every snapshot in memory, per strategy.

The model: n nodes, each holding its own snapshot (size S) and replicas of others' as
``recovery/placement.py`` places them with k buddies, so every node's state lives in a
*copy set* of k + 1 nodes. f nodes fail at once, every set of f nodes equally likely. The job
recovers from memory iff no copy set lies entirely inside the failed set. Racks are not
modelled: ``node_racks`` only relabels positions when racks are balanced, which changes none
of these numbers.

Counting, all in exact integers (``fractions.Fraction`` for the ratio), polynomial in n and f:

- ``ring`` (copy sets: every k + 1 cyclically consecutive nodes). A failed set is safe iff it
  has no run of k + 1 failed neighbours around the cycle. Cut the cycle at each of the n - f
  survivors: the failed nodes fall into n - f gaps of at most k each. Pairs (safe set, chosen
  survivor) match pairs (gap sizes, position of that survivor) one to one, so
  ``safe = n / (n - f) * C(f; n - f, k)``, where ``C(s; p, c)``, the number of ways to write
  s as p ordered parts in [0, c], is ``sum_i (-1)^i binom(p, i) binom(s - i(c+1) + p - 1, p - 1)``.
- Closed groups (q groups of g = k + 1 nodes, inclusion-exclusion over fully failed groups):
  ``H(q, s) = sum_i (-1)^i binom(q, i) binom(q g - i g, s - i g)`` safe s-subsets.
- ``group`` and ``mixed`` are q - 1 closed groups next to one *last block* (last group and
  tail); the two blocks fail independently, so ``safe = sum_j B(j) H(q - 1, f - j)``, with B
  the last block's safe j-subsets: a ring of k + 1 + r nodes for ``mixed``; for ``group``,
  the last group may lose at most k - 1 members with any tail nodes, or exactly k members if
  no failed tail node relied on the one survivor (``_tail_block_safe``).

``count_by_enumeration`` checks all of this against brute force on small jobs. This module
must never do I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from math import comb

from peerckpt.recovery.placement import STRATEGY_NAMES

ENUMERATION_LIMIT = 2_000_000


@dataclass(frozen=True)
class MemoryCost:
    """Snapshot memory a node holds (its own plus replicas), as multiples of one snapshot S.

    Every node is assumed to have the same snapshot size S. ``most`` is what the fullest node
    must provision; ``mean`` is always 1 + k, since every snapshot is stored k + 1 times.
    """

    most: int
    least: int
    mean: Fraction


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy's exact survival odds and memory cost for a job of ``nodes`` nodes."""

    strategy: str
    nodes: int
    replicas: int
    failures: int
    recoverable_sets: int
    failure_sets: int
    memory: MemoryCost

    @property
    def probability(self) -> Fraction:
        """Chance that ``failures`` random simultaneous node failures are recoverable."""
        return Fraction(self.recoverable_sets, self.failure_sets)


def plan(
    nodes: int, replicas: int, failures: int, strategies: Iterable[str] = STRATEGY_NAMES
) -> list[StrategyPlan]:
    """The survival odds and memory cost of every strategy in ``strategies``."""
    return [
        StrategyPlan(
            strategy=name,
            nodes=nodes,
            replicas=replicas,
            failures=failures,
            recoverable_sets=recoverable_sets(name, nodes, replicas, failures),
            failure_sets=comb(nodes, failures),
            memory=memory_cost(name, nodes, replicas),
        )
        for name in strategies
    ]


def survival_probability(strategy: str, nodes: int, replicas: int, failures: int) -> Fraction:
    """Exact chance that ``failures`` random node failures leave a copy of every snapshot."""
    return Fraction(recoverable_sets(strategy, nodes, replicas, failures), comb(nodes, failures))


def recoverable_sets(strategy: str, nodes: int, replicas: int, failures: int) -> int:
    """How many of the C(nodes, failures) failed sets leave every copy set a survivor."""
    _check(strategy, nodes, replicas, failures)
    size = replicas + 1
    if strategy == "ring":
        return ring_safe_sets(nodes, failures, size)
    groups, tail = divmod(nodes, size)
    if strategy == "group":
        last = [_tail_block_safe(replicas, tail, j) for j in range(size + tail + 1)]
    else:
        last = [ring_safe_sets(size + tail, j, size) for j in range(size + tail + 1)]
    return sum(safe * _groups_safe(groups - 1, size, failures - j) for j, safe in enumerate(last))


def memory_cost(strategy: str, nodes: int, replicas: int) -> MemoryCost:
    """Per-node snapshot memory of ``strategy``, as multiples of S (see ``MemoryCost``).

    ``ring`` and ``mixed``: every node holds (1 + k) S. ``group`` with a tail of r > 0 nodes:
    the last group's members hold up to (1 + k + r) S, the tail nodes only their own S.
    """
    _check(strategy, nodes, replicas, 0)
    mean = Fraction(1 + replicas)
    tail = nodes % (replicas + 1)
    if strategy == "group" and tail:
        return MemoryCost(most=1 + replicas + tail, least=1, mean=mean)
    return MemoryCost(most=1 + replicas, least=1 + replicas, mean=mean)


def ring_safe_sets(size: int, chosen: int, window: int) -> int:
    """How many ``chosen``-subsets of a ``size``-node cycle contain no ``window`` neighbours."""
    if chosen == size:
        return 0 if window <= size else 1
    gaps = size - chosen
    pairs = size * _compositions(chosen, gaps, window - 1)
    assert pairs % gaps == 0, "each safe set is counted once per survivor"
    return pairs // gaps


def copy_sets(
    rank_nodes: Mapping[int, int], placement: Mapping[int, list[int]]
) -> set[frozenset[int]]:
    """The distinct copy sets of a placement: each rank's node together with its buddies."""
    return {frozenset([node, *placement[rank]]) for rank, node in rank_nodes.items()}


def count_by_enumeration(
    sets: Iterable[frozenset[int]], nodes: Sequence[int], failures: int
) -> int:
    """Brute force: failed sets of size ``failures`` that contain none of ``sets``. Small jobs."""
    if comb(len(nodes), failures) > ENUMERATION_LIMIT:
        raise ValueError(
            f"C({len(nodes)}, {failures}) failed sets are too many to enumerate "
            f"(limit {ENUMERATION_LIMIT:,}); use recoverable_sets for the closed form"
        )
    minimal = [s for s in set(sets) if len(s) <= failures]
    return sum(
        not any(s <= failed for s in minimal)
        for failed in map(frozenset, combinations(nodes, failures))
    )


def _check(strategy: str, nodes: int, replicas: int, failures: int) -> None:
    if strategy not in STRATEGY_NAMES:
        raise ValueError(
            f"unknown placement strategy {strategy!r}; valid names: {', '.join(STRATEGY_NAMES)}"
        )
    if nodes < 1:
        raise ValueError(f"a job needs at least one node, not {nodes}")
    if not 0 <= replicas < nodes:
        raise ValueError(
            f"{replicas} replicas on {nodes} nodes: replicas must be in [0, {nodes - 1}], "
            "each on a node other than the snapshot's own"
        )
    if not 0 <= failures <= nodes:
        raise ValueError(f"{failures} failures among {nodes} nodes: must be in [0, {nodes}]")


def _compositions(total: int, parts: int, cap: int) -> int:
    """Ways to write ``total`` as ``parts`` ordered integers in [0, cap] (inclusion-exclusion)."""
    return sum(
        (-1) ** i * comb(parts, i) * comb(total - i * (cap + 1) + parts - 1, parts - 1)
        for i in range(min(parts, total // (cap + 1)) + 1)
    )


def _groups_safe(groups: int, size: int, failed: int) -> int:
    """``failed``-subsets of ``groups`` closed groups of ``size`` nodes with no group all failed."""
    if failed < 0:
        return 0
    return sum(
        (-1) ** i * comb(groups, i) * comb((groups - i) * size, failed - i * size)
        for i in range(min(groups, failed // size) + 1)
    )


def _tail_block_safe(replicas: int, tail: int, failed: int) -> int:
    """Safe ``failed``-subsets of the last group (k + 1 nodes) and tail (r nodes) of ``group``.

    Tail node i's copy set is itself and the last group without member i. With a < k of the
    group failed, nothing is lost; with a = k, the lone survivor e must not be the member
    skipped by a failed tail node (one tail node skips each of the first r members).
    """
    k, r = replicas, tail
    safe = sum(comb(k + 1, a) * comb(r, failed - a) for a in range(min(k - 1, failed) + 1))
    if failed >= k:
        b = failed - k
        safe += (r * comb(r - 1, b) if r else 0) + (k + 1 - r) * comb(r, b)
    return safe
