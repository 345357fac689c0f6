"""Membership of an epoch, as the coordinator broadcasts it. Pure data, no I/O.

An *epoch* is one membership: which process is which rank on which node, where each rank's
replicas go, and the step everyone restores at the start of it. Every failure or replacement
opens a new epoch; messages of older epochs are fenced off. The coordinator decides it
(``recovery/``); every agent carries it out (``replication/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peerckpt.messages import decode, message
from peerckpt.states import EpochMode


@dataclass(frozen=True)
class RankAssignment:
    """Which process plays a rank in an epoch."""

    rank: int
    node: int
    pid: int


@dataclass(frozen=True)
class Membership:
    """One epoch's membership, as broadcast to agents.

    ``mode`` says how the epoch restores: ``FRESH`` (nothing committed yet: start over),
    ``SAME`` (the layout is unchanged: every rank restores its own snapshot, replacements
    pull theirs whole from ``sources``), or ``RESHARD`` (a new layout: every rank asks for the
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
    mode: EpochMode = EpochMode.FRESH
    gen: int = 0
    restore_gen: int = 0
    previous: dict[int, int | None] = field(default_factory=dict)
    old_world: int = 0
    old_layout: dict[str, Any] | None = None
    restore_url: str | None = None  # durable storage the restore may read (STORAGE reads)
    # rank → [node, twin rank] pairs, best first: where a rank restored from a copy without
    # its data-parallel chunks reads them (a twin's complete copy; recovery/twins.py).
    twins: dict[int, list[list[int]]] = field(default_factory=dict)
    # ``--erasure K+M`` (``peerckpt/coding.py``): this epoch's coding groups (``Coding``'s
    # message; None: buddy replicas), and what rebuilding a rank of the committed step needs:
    # its step's groups and, per rank still held, a node holding it (``recovery/erasure.py``).
    erasure: dict[str, Any] | None = None
    erasure_restore: dict[str, Any] = field(default_factory=dict)

    def rank_nodes(self) -> dict[int, int]:
        return {r: a.node for r, a in self.ranks.items()}

    def local_ranks(self, node: int) -> list[int]:
        return sorted(r for r, a in self.ranks.items() if a.node == node)

    def to_msg(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "world_size": self.world_size,
            "ranks": {r: [a.node, a.pid] for r, a in self.ranks.items()},
            "placement": self.placement,
            "restore_step": self.restore_step,
            "sources": self.sources,
            "node_addrs": self.node_addrs,
            "store_addr": self.store_addr,
            "mode": self.mode.value,
            "gen": self.gen,
            "restore_gen": self.restore_gen,
            "previous": self.previous,
            "old_world": self.old_world,
            "old_layout": self.old_layout,
            "restore_url": self.restore_url,
            "twins": self.twins,
            "erasure": self.erasure,
            "erasure_restore": self.erasure_restore,
        }

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> Membership:
        """Decode (every field's type checked: ``ProtocolError`` names a bad one)."""
        w = decode({**msg, "type": _Wire.TYPE}, _Wire, where="a membership")
        return cls(
            epoch=w.epoch,
            world_size=w.world_size,
            ranks={r: RankAssignment(r, node, pid) for r, (node, pid) in w.ranks.items()},
            placement=w.placement,
            restore_step=w.restore_step,
            sources=w.sources,
            node_addrs=w.node_addrs,
            store_addr=w.store_addr,
            mode=w.mode,
            gen=w.gen,
            restore_gen=w.restore_gen,
            previous=w.previous,
            old_world=w.old_world,
            old_layout=w.old_layout,
            restore_url=w.restore_url,
            twins=w.twins,
            erasure=w.erasure,
            erasure_restore=w.erasure_restore,
        )


@message("membership_wire")
@dataclass(frozen=True)
class _Wire:
    """A membership as it travels: ranks as [node, pid] pairs."""

    TYPE = "membership_wire"

    epoch: int
    world_size: int
    ranks: dict[int, tuple[int, int]]
    placement: dict[int, list[int]]
    restore_step: int | None
    sources: dict[int, list[int]]
    node_addrs: dict[int, str]
    store_addr: str
    mode: EpochMode
    gen: int
    restore_gen: int
    previous: dict[int, int | None]
    old_world: int
    old_layout: dict[str, Any] | None
    restore_url: str | None = None
    twins: dict[int, list[list[int]]] = field(default_factory=dict)
    erasure: dict[str, Any] | None = None
    erasure_restore: dict[str, Any] = field(default_factory=dict)
