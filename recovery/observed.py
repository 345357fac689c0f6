"""What ``Status`` adds for observability: where copies are, what each node reported.

The launcher serves metrics and a status page from the coordinator's ``Status`` reply, and
``peerckpt status`` shows it in a terminal. This module gathers the parts of that reply that
only observers read — the nodes holding each rank's committed copy, each rank's buddies, the
ranks that resumed in this epoch, the spare nodes, every node's last heartbeat report
(``replication/stats.py``), the steps committed (the end-of-run summary) and the nodes
refused as they joined (``peerckpt join`` exits on them) — so that the coordinator's own
handlers stay about decisions.

It only reads the coordinator's state, under its lock; it never changes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peerckpt.recovery.coordinator import Coordinator


def observed(c: Coordinator) -> dict[str, Any]:
    """The observers' fields of ``JobStatus`` (the caller holds the coordinator's lock)."""
    m, tracker = c.epochs.membership, c.epochs.tracker
    agents = c.registry.agents
    return {
        "holders": _holders(tracker) if tracker else {},
        "placement": {r: list(b) for r, b in m.placement.items()} if m else {},
        "resumed": sorted(c.epochs.resumed),
        "spare_nodes": sorted(n for n, a in agents.items() if a.spare_node),
        "node_stats": {n: a.stats for n, a in agents.items() if a.stats is not None},
        "replicas": c.settings.replicas,
        "node_addrs": c.registry.node_addrs(),
        "commits": c.commits,
        "refused_joins": dict(c.epochs.refused_joins),
        "inexact": list(c.inexact_found),
    }


def _holders(tracker: Any) -> dict[int, list[int]]:
    """Each rank's nodes holding its committed step: whole, or as a buddy's partial copy
    whose data-parallel chunks its twins hold (redundancy-aware replication), which a
    recovery reads as a copy all the same."""
    out: dict[int, set[int]] = {r: set(h) for r, h in tracker.committed_holders.items()}
    for rank, nodes in tracker.committed_partial.items():
        out.setdefault(rank, set()).update(nodes)
    return {r: sorted(h) for r, h in out.items()}
