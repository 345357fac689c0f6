"""The pure decisions of a job on Ray: which Ray node is which host, which fault goes where.

No I/O and no Ray: these take Ray's node records and the chaos spec as data, so that the
rules are tested without a cluster (``tests/launch/test_rayplan.py``).
"""

from __future__ import annotations

from typing import Any

from peerckpt.errors import ConfigurationError

HEAD = "node:__internal_head__"  # the resource only Ray's head node has


def host_order(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alive nodes of ``ray.nodes()`` in the order hosts are given out: the head first
    (host 0, the coordinator's: the node a Ray cluster can least do without anyway), then by
    address, then by node id."""
    alive = [n for n in nodes if n.get("Alive")]
    return sorted(
        alive,
        key=lambda n: (HEAD not in n.get("Resources", {}), n["NodeManagerAddress"], n["NodeID"]),
    )


def split_chaos(spec: str, nproc_per_node: int) -> tuple[str, dict[int, str]]:
    """Split a chaos spec into the driver's part (``kill node``, ``add node``: the Ray node
    itself) and each host's (faults of a rank go to the host that starts it, of a node to
    that node's host, ``kill coordinator`` to host 0), checked whole first."""
    if not spec:
        return "", {}
    from peerckpt.chaos import Chaos

    Chaos(spec)  # a bad spec fails here, before anything starts
    driver: list[str] = []
    hosts: dict[int, list[str]] = {}
    struck: set[int] = set()
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        words = part.split()
        named = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        if words[:2] == ["add", "node"] or (words[0] == "kill" and words[1].startswith("node=")):
            if "during" in named:
                raise ConfigurationError(
                    f"{part!r}: under --ray a node is removed when its step comes; "
                    "during=PHASE is not available for a whole node"
                )
            driver.append(part)
        elif "rank" in named:
            rank = int(named["rank"])
            if rank in struck:
                # Its host fires it by the pid the coordinator reports for the rank, on its
                # own machine: after a first fault the rank may live on another host.
                raise ConfigurationError(
                    f"{part!r}: under --ray each rank can be struck once (rank {rank} is "
                    "named twice); strike another rank, or its node with `kill node`"
                )
            struck.add(rank)
            hosts.setdefault(rank // nproc_per_node, []).append(part)
        elif "node" in named:
            hosts.setdefault(int(named["node"]), []).append(part)
        else:  # kill coordinator
            hosts.setdefault(0, []).append(part)
    return "; ".join(driver), {h: "; ".join(p) for h, p in hosts.items()}
