"""Buddy placement: which nodes mirror each rank's snapshot. Pure functions, no I/O.

A placement maps every rank to the ``k`` nodes (other than its own) that keep a replica of
its snapshot. Nodes are failure domains, so a rank's buddies are never on its own node and
never repeat; when the job has fewer than ``k + 1`` nodes, a rank gets as many buddies as
there are other nodes. Every rank of a node gets the same buddies: the node's snapshot and
its ``k`` replicas form the node's *copy set*, ``k + 1`` nodes that must all fail together
for that state to be lost from memory.

Three strategies, all over the nodes that host ranks, laid out in one *node order* (below):

- ``ring``: the node at position i mirrors to the next k positions (wrapping around).
- ``group``: consecutive runs of k + 1 nodes form groups; every node mirrors to the other
  k members of its group, so a group is one copy set. The r = n mod (k + 1) nodes left over
  (the *tail*) cannot form a group: tail node i mirrors to the last group's members except
  its i-th. The last group stays closed, but its members hold up to r extra replicas.
- ``mixed`` (GEMINI, Wang et al., SOSP 2023): groups as above, except that the last group and
  the tail, k + 1 + r nodes, form a ring of their own. Memory stays balanced, at the price of
  a few more copy sets than ``group`` when r > 0. With r = 0, ``mixed`` is ``group``.

``recovery/survival.py`` computes, exactly, how likely f simultaneous node failures are to
leave every copy set with a survivor under each strategy, and what each costs in memory.

Failure domains above nodes: given ``node_racks`` (node -> rack), the node order spreads
every rack evenly around the order (round-robin when racks are the same size), so the
strategy's copy sets already span k + 1 racks whenever racks are balanced and there are at
least k + 1 of them. Where a copy set would still repeat a rack (unequal racks), its buddies
are re-chosen: the strategy's own buddies first, then the nodes that follow in the order,
skipping any rack already used. With fewer than k + 1 racks, copies go to distinct nodes as
the strategy says, and a warning is logged. A node missing from ``node_racks`` counts as a
rack of its own.

This module must never talk to the network, the clock or the file system.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Protocol

log = logging.getLogger("peerckpt.placement")

STRATEGY_NAMES = ("ring", "group", "mixed")


class Placement(Protocol):
    """Chooses buddies. Called by the coordinator once per epoch, with that epoch's ranks."""

    def buddies(self, rank_nodes: dict[int, int], replicas: int) -> dict[int, list[int]]:
        """Return, for every rank, the nodes that hold its replicas (never its own node)."""
        ...


class _OrderedPlacement:
    """Shared by the strategies: node order, rack checks, and rank-level fan-out.

    ``buddies`` calls, in this order: ``node_order`` (racks spread out), the subclass's
    ``_layout`` (copy sets by position in that order), then the rack repair.
    """

    name = ""

    def __init__(self, node_racks: Mapping[int, str] | None = None) -> None:
        self.node_racks = dict(node_racks) if node_racks else None

    def buddies(self, rank_nodes: dict[int, int], replicas: int) -> dict[int, list[int]]:
        """Return, for every rank, the ``k`` nodes that hold its replicas (never its own)."""
        order = self.node_order(rank_nodes.values())
        k = max(0, min(replicas, len(order) - 1))
        by_node = self._layout(order, k) if k else {node: [] for node in order}
        if self.node_racks is not None and k:
            by_node = self._spread_racks(order, by_node, k)
        return {rank: list(by_node[node]) for rank, node in rank_nodes.items()}

    def node_order(self, nodes: Iterable[int]) -> list[int]:
        """The distinct ``nodes``, ordered so that each rack is spread evenly over the order.

        Without racks: ascending node id. With racks, the j-th of a rack's c nodes sits at
        fraction (j + 1/2) / c of the order; ties go to the larger rack, then the rack name.
        Racks of equal size therefore alternate strictly (a, b, c, a, b, c, ...).
        """
        distinct = sorted(set(nodes))
        if self.node_racks is None:
            return distinct
        racks: dict[str, list[int]] = {}
        for node in distinct:
            racks.setdefault(self._rack(node), []).append(node)
        rack_index = {r: i for i, r in enumerate(sorted(racks, key=lambda r: (-len(racks[r]), r)))}
        keyed = [
            (Fraction(2 * j + 1, 2 * len(members)), rack_index[rack], node)
            for rack, members in racks.items()
            for j, node in enumerate(members)
        ]
        return [node for _, _, node in sorted(keyed)]

    def _layout(self, order: list[int], k: int) -> dict[int, list[int]]:
        raise NotImplementedError

    def _rack(self, node: int) -> str:
        assert self.node_racks is not None
        # Angle brackets keep a node without a rack from sharing a name with a real rack.
        return self.node_racks.get(node, f"<node {node}>")

    def _spread_racks(
        self, order: list[int], by_node: dict[int, list[int]], k: int
    ) -> dict[int, list[int]]:
        unknown = [n for n in order if self.node_racks is not None and n not in self.node_racks]
        if unknown:
            log.warning("no rack known for node(s) %s: each counts as a rack of its own", unknown)
        racks = {self._rack(n) for n in order}
        if len(racks) < k + 1:
            log.warning(
                "%s placement: %d copies per snapshot but only %d rack(s) among %d nodes; "
                "copies go to distinct nodes, some in the same rack. Add racks or lower "
                "--replicas to %d for rack-level failure domains",
                self.name,
                k + 1,
                len(racks),
                len(order),
                len(racks) - 1,
            )
            return by_node
        spread: dict[int, list[int]] = {}
        moved = 0
        for i, node in enumerate(order):
            chosen = by_node[node]
            if len({self._rack(n) for n in [node, *chosen]}) < k + 1:
                following = order[i + 1 :] + order[:i]
                chosen = _distinct_racks(node, [*chosen, *following], k, self._rack)
                moved += 1
            spread[node] = chosen
        if moved:
            log.info(
                "%s placement: unequal racks; %d node(s) got buddies off the strategy's "
                "pattern to keep their copies in distinct racks",
                self.name,
                moved,
            )
        return spread


class RingPlacement(_OrderedPlacement):
    """Ring over the nodes that host ranks: a node at position i mirrors to the next k."""

    name = "ring"

    def _layout(self, order: list[int], k: int) -> dict[int, list[int]]:
        return _ring(order, k)


class GroupPlacement(_OrderedPlacement):
    """Groups of k + 1 consecutive nodes mirror to each other; a short tail leans on the last.

    With n = q(k + 1) + r nodes, the first q(k + 1) positions form q groups, each one copy
    set. Tail node i (0 <= i < r <= k) mirrors to the last group's members except member i,
    so each member takes at most r extra replicas and the groups keep their copy sets closed.
    """

    name = "group"

    def _layout(self, order: list[int], k: int) -> dict[int, list[int]]:
        size = k + 1
        full = len(order) - len(order) % size
        placement: dict[int, list[int]] = {}
        for start in range(0, full, size):
            placement.update(_ring(order[start : start + size], k))
        last = order[full - size : full]
        for i, node in enumerate(order[full:]):
            placement[node] = last[:i] + last[i + 1 :]
        return placement


class MixedPlacement(_OrderedPlacement):
    """GEMINI's mixed placement: groups of k + 1, and the last group plus the tail as a ring.

    With n = q(k + 1) + r nodes, the first q - 1 groups are as in ``GroupPlacement``; the last
    k + 1 + r nodes form a ring where each mirrors to its next k. Every node holds exactly k
    replicas. With r = 0 this is ``GroupPlacement``.
    """

    name = "mixed"

    def _layout(self, order: list[int], k: int) -> dict[int, list[int]]:
        size = k + 1
        ring_start = len(order) - size - len(order) % size
        placement: dict[int, list[int]] = {}
        for start in range(0, ring_start, size):
            placement.update(_ring(order[start : start + size], k))
        placement.update(_ring(order[ring_start:], k))
        return placement


def placement_by_name(name: str, node_racks: Mapping[int, str] | None = None) -> Placement:
    """The strategy called ``name`` ("ring", "group" or "mixed"), aware of ``node_racks``."""
    strategies: dict[str, type[_OrderedPlacement]] = {
        "ring": RingPlacement,
        "group": GroupPlacement,
        "mixed": MixedPlacement,
    }
    if name not in strategies:
        raise ValueError(
            f"unknown placement strategy {name!r}; valid names: {', '.join(STRATEGY_NAMES)}"
        )
    return strategies[name](node_racks)


def effective_replicas(rank_nodes: dict[int, int], replicas: int) -> int:
    """How many replicas each snapshot gets: ``replicas``, capped by the other nodes there are."""
    return max(0, min(replicas, len(set(rank_nodes.values())) - 1))


def _ring(members: list[int], k: int) -> dict[int, list[int]]:
    """Each member mirrors to the next k members, wrapping around (all others when k + 1 = n)."""
    n = len(members)
    return {node: [members[(i + j) % n] for j in range(1, k + 1)] for i, node in enumerate(members)}


def _distinct_racks(
    node: int, candidates: list[int], k: int, rack_of: Callable[[int], str]
) -> list[int]:
    """The first k ``candidates`` (in order) whose racks differ from each other and ``node``'s."""
    used = {rack_of(node)}
    chosen: list[int] = []
    for candidate in candidates:
        rack = rack_of(candidate)
        if candidate != node and candidate not in chosen and rack not in used:
            chosen.append(candidate)
            used.add(rack)
            if len(chosen) == k:
                break
    return chosen
