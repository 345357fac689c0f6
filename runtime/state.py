"""The rank's state machine and what one epoch assigns to a rank process.

``RankState`` names every state of a rank runtime; ``check_transition`` is the one place that
says which changes are allowed (see ``rank.py`` for the picture).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from peerckpt.manifest import ChunkRecord, SnapshotManifest


class RankState(enum.Enum):
    SPARE = "spare"
    WAITING = "waiting"
    JOINING = "joining"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTING = "aborting"
    FAILED = "failed"
    EXITED = "exited"


_ALLOWED = {
    # A spare or waiting rank whose assignment is superseded before it joins is between
    # epochs, like an aborted one.
    RankState.SPARE: {RankState.JOINING, RankState.ABORTING, RankState.EXITED},
    RankState.WAITING: {
        RankState.JOINING,
        RankState.ABORTING,
        RankState.EXITED,
        RankState.FAILED,
    },
    RankState.JOINING: {RankState.RUNNING, RankState.ABORTING, RankState.FAILED, RankState.EXITED},
    RankState.RUNNING: {RankState.FINISHED, RankState.ABORTING, RankState.FAILED, RankState.EXITED},
    RankState.FINISHED: {RankState.ABORTING, RankState.EXITED, RankState.FAILED},
    RankState.ABORTING: {RankState.JOINING, RankState.ABORTING, RankState.EXITED, RankState.FAILED},
    RankState.FAILED: {RankState.EXITED},
    RankState.EXITED: set(),
}


@dataclass(frozen=True)
class Assignment:
    """What this process is in one epoch, and what it restores."""

    epoch: int
    rank: int
    world_size: int
    local_rank: int
    node: int
    store_addr: str
    restore_step: int | None
    restore_slot: int | None
    restore_path: str | None
    chunks: list[ChunkRecord]
    pulled: dict[str, Any] | None
    hosts: frozenset[str] = frozenset()
    # "fresh" (start over), "same" (restore own snapshot) or "reshard" (a new layout)
    mode: str = "fresh"
    previous_rank: int | None = None
    old_world: int = 0
    old_layout: dict[str, Any] | None = None

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Assignment:
        """Build from the agent's ``epoch`` message (the manifest travels as its body)."""
        restore = event.get("restore") or {}
        body = event.get("body") or {}
        chunks = []
        if body.get("manifest") is not None:
            chunks = list(SnapshotManifest.from_msg(body["manifest"]).chunks)
        return cls(
            epoch=event["epoch"],
            rank=event["rank"],
            world_size=event["world_size"],
            local_rank=event["local_rank"],
            node=event["node"],
            store_addr=event["store_addr"],
            restore_step=restore.get("step"),
            restore_slot=restore.get("slot"),
            restore_path=restore.get("path"),
            chunks=chunks,
            pulled=restore or None,
            hosts=frozenset(event.get("hosts", ())),
            mode=restore.get("mode", "fresh") if restore else "fresh",
            previous_rank=restore.get("previous_rank"),
            old_world=restore.get("old_world", 0),
            old_layout=body.get("old_layout"),
        )


def check_transition(current: RankState, new: RankState) -> None:
    """Raise if the state machine does not allow ``current`` → ``new``."""
    if new not in _ALLOWED[current]:
        raise RuntimeError(f"rank runtime cannot go from {current.name} to {new.name}")
