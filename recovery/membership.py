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
from peerckpt.persist.manifest import META_KEY


@dataclass(frozen=True)
class RankAssignment:
    """Which process plays a rank in an epoch."""

    rank: int
    node: int
    pid: int


@dataclass(frozen=True)
class Membership:
    """One epoch's membership, as broadcast to agents.

    ``mode`` says how the epoch restores: ``fresh`` (nothing committed yet: start over),
    ``same`` (the layout is unchanged: every rank restores its own snapshot, replacements
    pull theirs whole from ``sources``), or ``reshard`` (a new layout: every rank asks for the
    boxes it needs and gets them through a plan). ``gen`` numbers layouts; ``restore_gen`` is
    the layout of the committed step; ``previous`` maps new ranks to the old rank the same
    process was (None for a newcomer).
    """

    epoch: int
    world_size: int
    ranks: dict[int, RankAssignment]
    placement: dict[int, list[int]]
    restore_step: int | None
    sources: dict[int, list[int]]
    node_addrs: dict[int, str]
    store_addr: str
    mode: str = "fresh"
    gen: int = 0
    restore_gen: int = 0
    previous: dict[int, int | None] = field(default_factory=dict)
    old_world: int = 0
    old_layout: dict[str, Any] | None = None
    restore_url: str | None = None  # durable storage the restore may read (STORAGE reads)

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
            "mode": self.mode,
            "gen": self.gen,
            "restore_gen": self.restore_gen,
            "previous": self.previous,
            "old_world": self.old_world,
            "old_layout": self.old_layout,
            "restore_url": self.restore_url,
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
            mode=msg["mode"],
            gen=msg["gen"],
            restore_gen=msg["restore_gen"],
            previous={int(r): p for r, p in msg["previous"].items()},
            old_world=msg["old_world"],
            old_layout=msg["old_layout"],
            restore_url=msg.get("restore_url"),
        )


def _with_meta_size(layout: list[Any], nbytes: int | None) -> list[Any]:
    """A layout (chunk records as msgpack lists) with its blob chunk resized to ``nbytes``."""
    if nbytes is None:
        return layout
    out = []
    for c in layout:
        if c[0] == META_KEY:
            c = [c[0], c[1], [nbytes], c[3], [nbytes], c[5], nbytes, None, *c[8:]]
        out.append(c)
    return out


@dataclass
class CommitTracker:
    """Counts replicated snapshots per step and commits a step once every rank has it.

    It also keeps what a recovery needs about the committed step: which nodes hold each
    rank's copy, each rank's chunk layout, and the layout generation it belongs to.
    """

    epoch: int
    ranks: frozenset[int]
    gen: int = 0
    committed_step: int | None = None
    committed_gen: int = 0
    committed_holders: dict[int, set[int]] = field(default_factory=dict)
    committed_layouts: dict[int, list[Any]] = field(default_factory=dict)
    _pending: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    _layouts: dict[int, list[Any]] = field(default_factory=dict)
    _meta: dict[int, dict[int, int]] = field(default_factory=dict)  # step → rank → blob size
    last_replicated: dict[int, int] = field(default_factory=dict)

    def set_layout(self, rank: int, layout: list[Any]) -> None:
        """A rank's chunk layout, known from elsewhere (a restarted coordinator's rebuild)."""
        self._layouts.setdefault(rank, layout)

    def record(
        self,
        epoch: int,
        rank: int,
        step: int,
        holders: list[int],
        layout: list[Any] | None = None,
        meta_nbytes: int | None = None,
    ) -> int | None:
        """Record that ``rank``'s snapshot of ``step`` now lives on ``holders``.

        ``layout`` (its chunks) comes on a rank's first report of the epoch and when it
        changed; ``meta_nbytes``, the size of its blob, with every report.
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
        if layout is not None:
            self._layouts[rank] = layout
        by_rank = self._pending.setdefault(step, {})
        by_rank[rank] = set(holders)
        if meta_nbytes is not None:
            self._meta.setdefault(step, {})[rank] = meta_nbytes
        if set(by_rank) != self.ranks:
            return None
        missing = sorted(r for r in self.ranks if r not in self._layouts)
        if missing:
            raise StaleEpoch(f"no chunk layout was reported for rank(s) {missing}")
        self.committed_step = step
        self.committed_gen = self.gen
        self.committed_holders = by_rank
        sizes = self._meta.get(step, {})
        self.committed_layouts = {
            r: _with_meta_size(self._layouts[r], sizes.get(r)) for r in self.ranks
        }
        for older in [s for s in self._pending if s <= step]:
            del self._pending[older]
            self._meta.pop(older, None)
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
