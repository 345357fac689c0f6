"""Membership of an epoch and the commit tracker. Pure state, no I/O, no threads.

An *epoch* is one membership: which process is which rank on which node, where each rank's
replicas go, and the step everyone restores at the start of it. Every failure or replacement
opens a new epoch; messages of older epochs are fenced off.

Step ``s`` is *committed* when every rank of the epoch has reported its snapshot of ``s``
replicated to all of its buddies. The tracker also remembers, for each rank, which nodes hold
a complete copy of the last committed step (the holders a recovery plan reads from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peerckpt.errors import StaleEpoch


@dataclass(frozen=True)
class RankAssignment:
    """Which process plays a rank in an epoch."""

    rank: int
    node: int
    pid: int


@dataclass(frozen=True)
class Membership:
    """One epoch's membership, as broadcast to agents."""

    epoch: int
    world_size: int
    ranks: dict[int, RankAssignment]
    placement: dict[int, list[int]]
    restore_step: int | None
    sources: dict[int, list[int]]
    node_addrs: dict[int, str]
    store_addr: str

    def rank_nodes(self) -> dict[int, int]:
        return {r: a.node for r, a in self.ranks.items()}

    def local_ranks(self, node: int) -> list[int]:
        return sorted(r for r, a in self.ranks.items() if a.node == node)

    def to_msg(self) -> dict[str, Any]:
        return {
            "type": "membership",
            "epoch": self.epoch,
            "world_size": self.world_size,
            "ranks": {r: [a.node, a.pid] for r, a in self.ranks.items()},
            "placement": self.placement,
            "restore_step": self.restore_step,
            "sources": self.sources,
            "node_addrs": self.node_addrs,
            "store_addr": self.store_addr,
        }

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> Membership:
        return cls(
            epoch=msg["epoch"],
            world_size=msg["world_size"],
            ranks={int(r): RankAssignment(int(r), v[0], v[1]) for r, v in msg["ranks"].items()},
            placement={int(r): list(v) for r, v in msg["placement"].items()},
            restore_step=msg["restore_step"],
            sources={int(r): list(v) for r, v in msg["sources"].items()},
            node_addrs={int(n): a for n, a in msg["node_addrs"].items()},
            store_addr=msg["store_addr"],
        )


@dataclass
class CommitTracker:
    """Counts replicated snapshots per step and commits a step once every rank has it."""

    epoch: int
    ranks: frozenset[int]
    committed_step: int | None = None
    committed_holders: dict[int, set[int]] = field(default_factory=dict)
    _pending: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    last_replicated: dict[int, int] = field(default_factory=dict)

    def record(self, epoch: int, rank: int, step: int, holders: list[int]) -> int | None:
        """Record that ``rank``'s snapshot of ``step`` now lives on ``holders``.

        Returns the step that this report committed, if any.
        """
        if epoch != self.epoch:
            raise StaleEpoch(
                f"replication report for epoch {epoch} arrived in epoch {self.epoch}; ignored"
            )
        if rank not in self.ranks:
            raise StaleEpoch(f"rank {rank} is not a member of epoch {self.epoch}")
        if self.committed_step is not None and step <= self.committed_step:
            return None
        self.last_replicated[rank] = max(step, self.last_replicated.get(rank, -1))
        by_rank = self._pending.setdefault(step, {})
        by_rank[rank] = set(holders)
        if set(by_rank) != self.ranks:
            return None
        self.committed_step = step
        self.committed_holders = by_rank
        for older in [s for s in self._pending if s <= step]:
            del self._pending[older]
        return step

    def forget_node(self, node: int) -> None:
        """A node was lost: it no longer holds anything."""
        for holders in self.committed_holders.values():
            holders.discard(node)
        for by_rank in self._pending.values():
            for holders in by_rank.values():
                holders.discard(node)

    def add_holder(self, rank: int, node: int) -> None:
        """A recovery copied ``rank``'s committed snapshot to ``node``."""
        self.committed_holders.setdefault(rank, set()).add(node)
