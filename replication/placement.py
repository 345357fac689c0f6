"""Buddy placement: which nodes mirror each rank's snapshot. Pure functions, no I/O.

A placement maps every rank to the ``k`` nodes (other than its own) that keep a replica of
its snapshot. Nodes are failure domains, so a rank's buddies are never on its own node; when
the job has fewer than ``k + 1`` nodes, a rank gets as many buddies as there are other nodes.
"""

from __future__ import annotations

from typing import Protocol


class Placement(Protocol):
    """Chooses buddies. Called by the coordinator once per epoch, with that epoch's ranks."""

    def buddies(self, rank_nodes: dict[int, int], replicas: int) -> dict[int, list[int]]:
        """Return, for every rank, the nodes that hold its replicas (never its own node)."""
        ...


class RingPlacement:
    """Ring over the nodes that host ranks: a rank on the i-th node mirrors to the next k."""

    def buddies(self, rank_nodes: dict[int, int], replicas: int) -> dict[int, list[int]]:
        nodes = sorted(set(rank_nodes.values()))
        k = min(replicas, len(nodes) - 1)
        placement: dict[int, list[int]] = {}
        for rank, node in rank_nodes.items():
            i = nodes.index(node)
            placement[rank] = [nodes[(i + j) % len(nodes)] for j in range(1, k + 1)]
        return placement


def effective_replicas(rank_nodes: dict[int, int], replicas: int) -> int:
    """How many replicas each snapshot gets: ``replicas``, capped by the other nodes there are."""
    return max(0, min(replicas, len(set(rank_nodes.values())) - 1))
