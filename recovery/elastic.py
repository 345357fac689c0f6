"""Elastic membership: who is which rank after a loss or a join, and resharding rounds.

Pure functions and one small state holder, no I/O; the coordinator calls them under its lock.

- ``replaced``: spares take the lost ranks' numbers (a spare on the lost rank's own node
  first), everyone else keeps theirs.
- ``shrunk``: no spare is left and the job may shrink: the survivors are renumbered 0…W'-1
  in the order of their old ranks.
- ``restarted``: every rank was restarted (torchrun) and fewer came back: they form the world.
- ``grown``: a node joins: its processes become ranks W…W+P-1.

In the last two the layout changes and every rank restores through a plan. A resharding
round starts when a rank calls ``ctx.track`` and sends the boxes it wants; when every rank of
the epoch has sent its wants for the round, ``ReshardRounds`` plans all their reads at once
(``recovery/planning/reshard.py``) and hands back, per node, the reads of the ranks on it, each rank's
as one compact message (``recovery/planning/message.py``). The planner gets both sides as tables
(``recovery/planning/tables.py``); the committed layouts' table is made once per committed layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peerckpt.columns import ChunkColumns
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.membership import Membership, RankAssignment
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.planning.message import encode
from peerckpt.recovery.planning.reshard import plan
from peerckpt.recovery.planning.tables import ChunkLists, from_columns
from peerckpt.recovery.planning.types import WantedChunk
from peerckpt.recovery.twins import lacking, read_holders


def replaced(
    old: dict[int, RankAssignment], lost: set[int], spares: list[tuple[int, int]]
) -> tuple[dict[int, RankAssignment], dict[int, int | None]]:
    """Spares (node, pid) take the lost ranks; the others keep their rank.

    A spare on the node a lost rank ran on takes it first: that node still holds the rank's
    snapshot, so the restore needs no network (a process restarted in place, every worker
    torchrun restarted). The other lost ranks take the remaining spares in rank order.
    """
    assignments = dict(old)
    previous: dict[int, int | None] = {r: r for r in old if r not in lost}
    pool = list(spares)
    chosen: dict[int, tuple[int, int]] = {}
    for rank in sorted(lost):
        here = next((s for s in pool if s[0] == old[rank].node), None)
        if here is not None:
            chosen[rank] = here
            pool.remove(here)
    for rank in sorted(lost):
        if rank not in chosen and pool:
            chosen[rank] = pool.pop(0)
    for rank, (node, pid) in chosen.items():
        assignments[rank] = RankAssignment(rank, node, pid)
        previous[rank] = None
    return assignments, previous


def restarted(
    spares: list[tuple[int, int]],
) -> tuple[dict[int, RankAssignment], dict[int, int | None]]:
    """Every rank was lost and restarted (torchrun restarts every worker after a failure),
    and too few came back for the old world: the restarted processes (node, pid) form the
    new, smaller world, ranks 0…W'-1 in the order given; all of them restore through a plan."""
    assignments = {r: RankAssignment(r, node, pid) for r, (node, pid) in enumerate(spares)}
    return assignments, dict.fromkeys(assignments)


def shrunk(
    old: dict[int, RankAssignment], lost: set[int]
) -> tuple[dict[int, RankAssignment], dict[int, int | None]]:
    """The survivors, renumbered densely in the order of their old ranks."""
    survivors = sorted(r for r in old if r not in lost)
    assignments = {
        new: RankAssignment(new, old[r].node, old[r].pid) for new, r in enumerate(survivors)
    }
    return assignments, {new: r for new, r in enumerate(survivors)}


def grown(
    old: dict[int, RankAssignment], joiners: list[tuple[int, int]]
) -> tuple[dict[int, RankAssignment], dict[int, int | None]]:
    """Everyone keeps their rank; the joiners (node, pid) become the next ranks."""
    assignments = dict(old)
    previous: dict[int, int | None] = {r: r for r in old}
    for i, (node, pid) in enumerate(joiners):
        rank = len(old) + i
        assignments[rank] = RankAssignment(rank, node, pid)
        previous[rank] = None
    return assignments, previous


def _records(layout: list[Any]) -> list[ChunkRecord]:
    return [c if isinstance(c, ChunkRecord) else ChunkRecord.from_msg(c) for c in layout]


def old_layout_summary(layouts: dict[int, list[Any]]) -> dict[str, Any]:
    """What a resharding rank needs to know of the committed step (see runtime.restore.OldLayout):
    shared tensors with dtype and global shape, every old rank's private chunks, blob sizes."""
    shared: dict[str, list[Any]] = {}
    private: dict[int, dict[str, list[Any]]] = {}
    meta_bytes: dict[int, int] = {}
    seen: dict[int, Any] = {}  # ranks' shared parts already read (equal ranks share one)
    for rank, layout in sorted(layouts.items()):
        private[rank] = {}
        if isinstance(layout, ChunkColumns):  # its tensors once per distinct blob
            meta = layout.shared()
            if id(meta) not in seen:
                seen[id(meta)] = meta  # kept: its id is not reused meanwhile
                for key, dtype, shape in zip(meta.keys, meta.dtypes, meta.shapes, strict=True):
                    shared.setdefault(key, [dtype, list(shape)])
            layout = list(layout.rest)
        for c in _records(layout):
            if c.key == META_KEY:
                meta_bytes[rank] = c.nbytes
            elif c.scope == "global":
                shared.setdefault(c.key, [c.dtype, list(c.global_shape)])
            else:
                private[rank][c.key] = [c.dtype, list(c.lengths)]
    return {"shared": shared, "private": private, "meta_bytes": meta_bytes}


@dataclass
class ReshardRounds:
    """Collects every rank's wants per (epoch, round); plans a round once all have come."""

    _wants: dict[tuple[int, int], dict[int, list[Any] | ChunkColumns]] = field(default_factory=dict)
    # The committed layouts (the object itself) and their table, made on first use.
    _held: tuple[dict[int, list[Any]], ChunkLists] | None = None

    def add(
        self,
        members: Membership,
        tracker: CommitTracker,
        round_: int,
        rank: int,
        wants: list[Any] | ChunkColumns,
    ) -> dict[int, dict[int, dict[str, Any]]] | None:
        """Record ``rank``'s wants (records, or columns as agents send them); when the round
        is complete, return node → rank → its reads as a message (``peerckpt/reads.py``, whose
        ``decode`` the node's agent uses).

        Raises RecoveryFailed (from the planner) if some wanted box survives nowhere.
        """
        pending = self._wants.setdefault((members.epoch, round_), {})
        pending[rank] = wants
        # Counted first: comparing the sets at every rank's wants was O(ranks²) (10^8 at 10,000)
        if len(pending) < len(members.ranks) or set(pending) != set(members.ranks):
            return None
        del self._wants[(members.epoch, round_)]
        for stale in [k for k in self._wants if k[0] < members.epoch]:
            del self._wants[stale]
        layouts = tracker.committed_layouts
        if self._held is None or self._held[0] is not layouts:
            self._held = (layouts, tracker.held_lists())
        # Partial copies (redundancy-aware replication) are read in the chunks they hold.
        lacks = lacking(tracker.committed_partial, tracker.committed_absent, layouts)
        reads = plan(
            self._held[1],
            read_holders(tracker.committed_holders, lacks),
            from_columns(pending, WantedChunk, rename=False),
            {r: a.node for r, a in members.ranks.items()},
            dict(members.previous),
            lacking=lacks,
        )
        by_node: dict[int, dict[int, dict[str, Any]]] = {}
        for r, msg in encode(reads).items():
            by_node.setdefault(members.ranks[r].node, {})[r] = msg
        return by_node
