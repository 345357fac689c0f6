"""Elastic membership: who is which rank after a loss or a join, and resharding rounds.

Pure functions and one small state holder, no I/O; the coordinator calls them under its lock.

- ``replaced``: spares take the lost ranks' numbers, everyone else keeps theirs.
- ``shrunk``: no spare is left and the job may shrink: the survivors are renumbered 0…W'-1
  in the order of their old ranks.
- ``grown``: a node joins: its processes become ranks W…W+P-1.

In the last two the layout changes and every rank restores through a plan. A resharding
round starts when a rank calls ``ctx.track`` and sends the boxes it wants; when every rank of
the epoch has sent its wants for the round, ``ReshardRounds`` plans all their reads at once
(``recovery/planner.py``) and hands back, per node, the reads of the ranks on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peerckpt.persist.manifest import META_KEY, ChunkRecord, chunk_name
from peerckpt.recovery.chunks import Box
from peerckpt.recovery.membership import CommitTracker, Membership, RankAssignment
from peerckpt.recovery.planner import HeldChunk, Read, WantedChunk, plan_reads


def replaced(
    old: dict[int, RankAssignment], lost: set[int], spares: list[tuple[int, int]]
) -> tuple[dict[int, RankAssignment], dict[int, int | None]]:
    """Spares (node, pid) take the lost ranks, in rank order; the others keep their rank."""
    assignments = dict(old)
    previous: dict[int, int | None] = {r: r for r in old if r not in lost}
    for rank, (node, pid) in zip(sorted(lost), spares, strict=False):
        assignments[rank] = RankAssignment(rank, node, pid)
        previous[rank] = None
    return assignments, previous


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
    return [ChunkRecord.from_msg(c) for c in layout]


def old_layout_summary(layouts: dict[int, list[Any]]) -> dict[str, Any]:
    """What a resharding rank needs to know of the committed step (see runtime.restore.OldLayout):
    shared tensors with dtype and global shape, every old rank's private chunks, blob sizes."""
    shared: dict[str, list[Any]] = {}
    private: dict[int, dict[str, list[Any]]] = {}
    meta_bytes: dict[int, int] = {}
    for rank, layout in sorted(layouts.items()):
        private[rank] = {}
        for c in _records(layout):
            if c.key == META_KEY:
                meta_bytes[rank] = c.nbytes
            elif c.scope == "global":
                shared.setdefault(c.key, [c.dtype, list(c.global_shape)])
            else:
                private[rank][c.key] = [c.dtype, list(c.lengths)]
    return {"shared": shared, "private": private, "meta_bytes": meta_bytes}


def held_chunks(layouts: dict[int, list[Any]]) -> dict[int, list[HeldChunk]]:
    """The planner's view of the committed step: every old rank's chunks, private ones renamed
    ``<key>@<old rank>`` so that they are never taken for replicas of each other."""
    return {
        rank: [
            HeldChunk(
                chunk_name(c.key, c.scope, rank),
                c.dtype,
                tuple(c.global_shape),
                Box(tuple(c.offsets), tuple(c.lengths)),
            )
            for c in _records(layout)
        ]
        for rank, layout in layouts.items()
    }


def read_msg(read: Read) -> dict[str, Any]:
    def box(b: Box) -> list[list[int]]:
        return [list(b.offsets), list(b.lengths)]

    return {
        "source_node": read.source_node,
        "source_rank": read.source_rank,
        "key": read.key,
        "src_box": box(read.src_box),
        "dst_box": box(read.dst_box),
        "region": box(read.region),
        "nbytes": read.nbytes,
    }


@dataclass
class ReshardRounds:
    """Collects every rank's wants per (epoch, round); plans a round once all have come."""

    _wants: dict[tuple[int, int], dict[int, list[Any]]] = field(default_factory=dict)

    def add(
        self, members: Membership, tracker: CommitTracker, round_: int, rank: int, wants: list[Any]
    ) -> dict[int, dict[int, list[dict[str, Any]]]] | None:
        """Record ``rank``'s wants; when the round is complete, return node → rank → reads.

        Raises RecoveryFailed (from the planner) if some wanted box survives nowhere.
        """
        pending = self._wants.setdefault((members.epoch, round_), {})
        pending[rank] = wants
        if set(pending) != set(members.ranks):
            return None
        del self._wants[(members.epoch, round_)]
        for stale in [k for k in self._wants if k[0] < members.epoch]:
            del self._wants[stale]
        wanted = {
            r: [
                WantedChunk(
                    c.key, c.dtype, tuple(c.global_shape), Box(tuple(c.offsets), tuple(c.lengths))
                )
                for c in map(ChunkRecord.from_msg, chunks)
            ]
            for r, chunks in pending.items()
        }
        plan = plan_reads(
            held_chunks(tracker.committed_layouts),
            {r: set(h) for r, h in tracker.committed_holders.items()},
            wanted,
            {r: a.node for r, a in members.ranks.items()},
            dict(members.previous),
        )
        by_node: dict[int, dict[int, list[dict[str, Any]]]] = {}
        for r, reads in plan.items():
            by_node.setdefault(members.ranks[r].node, {})[r] = [read_msg(x) for x in reads]
        return by_node
