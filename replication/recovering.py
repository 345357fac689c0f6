"""The agent's side of an epoch change: fence, abort, and give every local rank its state.

``RankRecovery`` is mixed into ``Agent`` (``replication/agent.py``). On a ``membership``
event it fences the new epoch, tells the local processes to abort, cancels replication in
flight, and prepares each local rank of the new epoch in its own thread: in the same
topology it obtains the rank's committed snapshot (own slot, local replica, or a fetch from
the plan's sources, checksums verified, ``replication/obtain.py``); after a topology
change it gathers the pieces the coordinator's plan names into a staging segment
(``replication/gather.py``). Then it sends the rank ``epoch`` (or ``staging``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from peerckpt.errors import RecoveryFailed
from peerckpt.faults import FaultHooks, NetHooks
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.membership import Membership
from peerckpt.reads import decode as decode_reads
from peerckpt.replication.gather import assemble
from peerckpt.replication.obtain import obtain_committed
from peerckpt.replication.transfer import IO_TIMEOUT_S
from peerckpt.wire import Connection, connect_tcp

if TYPE_CHECKING:
    from peerckpt.replication.control import ControlServer
    from peerckpt.replication.replicator import BuddySender
    from peerckpt.replication.store import SlotStore

log = logging.getLogger("peerckpt.agent")


class RankRecovery:
    """Epoch changes on one node. Expects the agent's state (declared for type checking)."""

    job: str
    node: int
    faults: FaultHooks
    net: NetHooks | None
    _secret: bytes
    epoch: int
    gen: int
    membership: Membership | None
    committed_step: int | None
    store: SlotStore
    control: ControlServer
    _lock: threading.RLock
    _senders: dict[int, BuddySender]
    _restore_info: dict[tuple[int, int], Any]
    _wanted: dict[tuple[int, int, int], list[ChunkRecord]]

    if TYPE_CHECKING:  # provided by Agent

        def _report(self, method: str, **args: Any) -> None: ...

    def _connect(self, members: Membership) -> Callable[[int], Connection]:
        """Data connections to the epoch's agents, by node."""

        def connect(source: int) -> Connection:
            return connect_tcp(
                members.node_addrs[source],
                self._secret,
                self.job,
                io_timeout=IO_TIMEOUT_S,
                net=self.net,
            )

        return connect

    def _on_membership(self, members: Membership) -> None:
        with self._lock:
            if members.epoch <= self.epoch:
                return
            self.epoch, self.membership = members.epoch, members
            self.gen = members.gen
            self.committed_step = members.restore_step
        self.control.broadcast({"type": "abort", "epoch": members.epoch})
        for sender in list(self._senders.values()):
            sender.cancel_inflight()
        for rank in members.local_ranks(self.node):
            threading.Thread(
                target=self._prepare_rank,
                args=(members, rank),
                name=f"peerckpt-prepare-r{rank}",
                daemon=True,
            ).start()

    def _prepare_rank(self, members: Membership, rank: int) -> None:
        pid = members.ranks[rank].pid
        link = self.control.wait_link(pid, timeout=10.0)
        if link is None:
            log.error("process %d for rank %d never connected to this agent", pid, rank)
            self._report("ProcLost", pid=pid, reason="never connected to its agent")
            return
        restore: dict[str, Any] | None = None
        manifest = None
        self.faults.strike("recovery", node=self.node, rank=rank, epoch=members.epoch)
        try:
            if members.mode == "same":
                restore, manifest = self._obtain(members, rank)
            elif members.mode == "reshard":
                restore = {
                    "mode": "reshard",
                    "step": members.restore_step,
                    "previous_rank": members.previous.get(rank),
                    "old_world": members.old_world,
                }
        except Exception as exc:  # a rank left without its state would wait forever
            if not isinstance(exc, RecoveryFailed):
                log.exception("preparing rank %d for epoch %d failed", rank, members.epoch)
            self._report(
                "Error", epoch=members.epoch, rank=rank, message=f"{type(exc).__name__}: {exc}"
            )
            return
        if self.epoch != members.epoch:
            return  # a newer epoch superseded this one while we were pulling
        local = members.local_ranks(self.node)
        link.send(
            {
                "type": "epoch",
                "epoch": members.epoch,
                "rank": rank,
                "world_size": members.world_size,
                "local_rank": local.index(rank),
                "node": self.node,
                "store_addr": members.store_addr,
                "hosts": sorted({a.rpartition(":")[0] for a in members.node_addrs.values()}),
                "restore": restore,
            },
            body={
                "manifest": manifest.to_msg() if manifest is not None else None,
                "old_layout": members.old_layout,
            },
        )

    def _on_reads(self, event: dict[str, Any]) -> None:
        """A resharding round was planned: gather each local rank's staging slot."""
        members = self.membership
        if members is None or event["epoch"] != self.epoch:
            return
        for rank, reads in event["reads"].items():
            threading.Thread(
                target=self._gather,
                args=(members, int(rank), event["round"], reads),
                name=f"peerckpt-gather-r{rank}",
                daemon=True,
            ).start()

    def _gather(self, members: Membership, rank: int, round_: int, msg: dict[str, Any]) -> None:
        link = self.control.link_of(members.ranks[rank].pid)
        wanted = self._wanted.pop((members.epoch, rank, round_), None)
        if link is None or wanted is None or members.restore_step is None:
            return

        connect = self._connect(members)

        try:
            got = assemble(
                self.store,
                self.node,
                members.epoch,
                members.gen,
                rank,
                round_,
                members.restore_gen,
                members.restore_step,
                wanted,
                decode_reads(msg, wanted),  # the plan's compact message (peerckpt/reads.py)
                connect,
                storage_url=members.restore_url,
            )
        except Exception as exc:
            log.error("gathering rank %d's state failed: %s", rank, exc)
            self._report(
                "Error", epoch=members.epoch, rank=rank, message=f"{type(exc).__name__}: {exc}"
            )
            return
        pulls = self._restore_info.setdefault((members.epoch, rank), [])
        if got.local_bytes:
            pulls.append(
                {
                    "node": self.node,
                    "source": self.node,
                    "bytes": got.local_bytes,
                    "seconds": got.seconds,
                    "round": round_,
                }
            )
        for source, nbytes in sorted(got.pulled.items()):
            pulls.append(
                {
                    "node": self.node,
                    "source": source,
                    "bytes": nbytes,
                    "seconds": got.seconds,
                    "round": round_,
                }
            )
        link.send(
            {
                "type": "staging",
                "epoch": members.epoch,
                "round": round_,
                "path": got.slot.segment.path,
            },
            body=got.manifest.to_msg(),
        )

    def _obtain(self, members: Membership, rank: int) -> tuple[dict[str, Any], SnapshotManifest]:
        """Make the committed snapshot of ``rank`` available in one of its own local slots."""
        assert members.restore_step is not None

        connect = self._connect(members)

        got = obtain_committed(
            self.store,
            self.node,
            members.epoch,
            members.restore_gen,
            rank,
            members.restore_step,
            members.sources.get(rank, []),
            connect,
        )
        info = {
            "mode": "same",
            "step": members.restore_step,
            "slot": got.slot.index,
            "path": got.slot.segment.path,
            "source": got.source,
            "node": self.node,
            "bytes": got.nbytes,
            "seconds": got.seconds,
        }
        self._restore_info[(members.epoch, rank)] = info
        return info, got.manifest
