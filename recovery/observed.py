"""What ``Status`` adds for observability: where copies are, what each node reported.

The launcher serves metrics and a status page from the coordinator's ``Status`` reply, and
``peerckpt status`` shows it in a terminal. This module gathers the parts of that reply that
only observers read — the nodes holding each rank's committed copy, each rank's buddies, the
ranks that resumed in this epoch, the spare nodes, and every node's last heartbeat report
(``replication/stats.py``) — so that the coordinator's own handlers stay about decisions.

It only reads the coordinator's state, under its lock; it never changes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peerckpt.recovery.coordinator import Coordinator


def observed(c: Coordinator) -> dict[str, Any]:
    """The observers' part of ``Status`` (the caller holds ``c._lock``)."""
    m, tracker = c.membership, c.tracker
    return {
        # Nodes holding a complete copy of each rank's committed step (-1: durable storage).
        "holders": {r: sorted(h) for r, h in tracker.committed_holders.items()} if tracker else {},
        "placement": {r: list(b) for r, b in m.placement.items()} if m else {},
        "resumed": sorted(c.resumed),
        "spare_nodes": sorted(n for n, a in c.agents.items() if a.spare_node),
        "node_stats": {n: a.stats for n, a in c.agents.items() if a.stats},
        "replicas": c.replicas,
    }
