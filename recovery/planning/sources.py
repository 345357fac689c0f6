"""Recovery planning for the same topology: where each rank reads its committed snapshot.

Pure functions. For every rank of the new epoch the plan is an ordered list of source nodes;
the rank's agent tries them in order and skips one whose copy fails its checksum. Order:

1. the rank's own node, when it holds a copy (its slot survived: no network at all);
2. other holders, least-loaded first (bytes already assigned to that source in this plan),
   preferring buddies over the node the rank was lost on, then by node id.

Resharding plans (a different world size or layout) are ``reshard.py``'s: they read boxes of
chunks rather than whole snapshots, preferring sources in the same order.
"""

from __future__ import annotations

from peerckpt.errors import RecoveryFailed


def plan_sources(
    new_nodes: dict[int, int],
    holders: dict[int, set[int]],
    nbytes: dict[int, int],
    previous_nodes: dict[int, int],
) -> dict[int, list[int]]:
    """Return, for every rank, the nodes to read its committed snapshot from, best first.

    ``new_nodes``: rank → node in the new epoch; ``holders``: rank → nodes with a complete copy;
    ``nbytes``: rank → snapshot size (for balancing); ``previous_nodes``: rank → node before.
    Raises RecoveryFailed naming every rank whose copies are all gone.
    """
    lost = sorted(r for r in new_nodes if not holders.get(r))
    if lost:
        raise RecoveryFailed(
            f"no surviving copy of the committed snapshot of rank(s) {lost}: the rank and all "
            "of its buddies were lost together. Use more --replicas, or a durable tier "
            "(persist=...) to fall back to storage."
        )
    load: dict[int, int] = {}
    plan: dict[int, list[int]] = {}
    # Big snapshots first, so balancing places them while every source is still idle.
    for rank in sorted(new_nodes, key=lambda r: (-nbytes.get(r, 0), r)):
        node = new_nodes[rank]
        peers = sorted(
            (h for h in holders[rank] if h != node),
            key=lambda h: (load.get(h, 0), h == previous_nodes.get(rank), h),
        )
        order = ([node] if node in holders[rank] else []) + peers
        if order[0] != node:
            load[order[0]] = load.get(order[0], 0) + nbytes.get(rank, 0)
        plan[rank] = order
    return plan
