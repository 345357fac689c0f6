"""The rank's state machine and what one epoch assigns to a rank process.

``RankState`` names every state of a rank runtime; ``check_transition`` is the one place that
says which changes are allowed (see ``rank.py`` for the picture).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from peerckpt.manifest import ChunkRecord
from peerckpt.messages.local import EpochStart
from peerckpt.states import EpochMode


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
    hosts: frozenset[str] = frozenset()
    mode: EpochMode = EpochMode.FRESH
    previous_rank: int | None = None
    old_world: int = 0
    old_layout: dict[str, Any] | None = None
    arriving: bool = False  # SAME: the state is still on its way (``Arrived`` says where)

    @classmethod
    def from_event(cls, event: EpochStart) -> Assignment:
        """Build from the agent's ``EpochStart`` (the manifest travels as its body)."""
        restore, body = event.restore, event.body
        return cls(
            epoch=event.epoch,
            rank=event.rank,
            world_size=event.world_size,
            local_rank=event.local_rank,
            node=event.node,
            store_addr=event.store_addr,
            restore_step=restore.step if restore else None,
            restore_slot=restore.slot if restore else None,
            restore_path=restore.path if restore else None,
            chunks=list(body.manifest.chunks) if body.manifest is not None else [],
            hosts=frozenset(event.hosts),
            mode=restore.mode if restore else EpochMode.FRESH,
            previous_rank=restore.previous_rank if restore else None,
            old_world=restore.old_world if restore else 0,
            old_layout=body.old_layout,
            arriving=restore.arriving if restore else False,
        )

    def arrived(self, slot: int, path: str, chunks: list[ChunkRecord]) -> Assignment:
        """This assignment once its arriving state is in own slot ``slot`` at ``path``."""
        return replace(self, restore_slot=slot, restore_path=path, chunks=chunks, arriving=False)


def check_transition(current: RankState, new: RankState) -> None:
    """Raise if the state machine does not allow ``current`` → ``new``."""
    if new not in _ALLOWED[current]:
        raise RuntimeError(f"rank runtime cannot go from {current.name} to {new.name}")
