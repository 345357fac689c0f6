"""The agent's side of an epoch change: give every local rank of the new epoch its state.

The agent fences the new epoch, tells its processes to abort and cancels replication in
flight (``Agent._on_membership``); then ``Preparer.prepare`` readies each local rank in a
thread of its own: in the same topology it obtains the rank's committed snapshot (own slot,
local replica, or a fetch from the plan's sources, checksums verified,
``replication/obtain.py``) and sends the rank ``EpochStart``; a rank whose state must come
from a peer gets ``EpochStart`` first and ``Arrived`` once its state is verified in its slot,
so that it forms its group and builds its model while the bytes travel; after a topology change it
sends ``EpochStart`` at once, and gathers the pieces each resharding round's plan names into
a staging segment (``replication/gather.py``, on ``Reads``), answered with ``Staging``.

What a rank's restore pulled from where is kept until the rank reports it resumed, then
travels to the coordinator with ``Resumed`` (``take_pulls``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from peerckpt.errors import RecoveryFailed
from peerckpt.faults import FaultHooks, NetHooks
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.membership import Membership
from peerckpt.messages.control import ProcLost, Pull, RankFailed, Reads, Request
from peerckpt.messages.local import Arrived, EpochStart, RestoreBody, RestorePlan, Staging
from peerckpt.reads import ERASURE, Read
from peerckpt.reads import decode as decode_reads
from peerckpt.replication.control import ControlServer, ProcLink
from peerckpt.replication.decoding import rebuild
from peerckpt.replication.devicepull import DevicePulls
from peerckpt.replication.gather import GatherJob, assemble
from peerckpt.replication.obtain import _pull_target, obtain_committed
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import IO_TIMEOUT_S
from peerckpt.states import EpochMode
from peerckpt.wire import Connection, connect_tcp

log = logging.getLogger("peerckpt.agent")


class Preparer:
    """Readies local ranks for new epochs. Its threads check ``current_epoch`` before they
    hand a rank anything: a newer epoch supersedes what an older one prepared."""

    def __init__(
        self,
        node: int,
        job: str,
        secret: bytes,
        store: SlotStore,
        control: ControlServer,
        report: Callable[[Request[Any]], None],
        current_epoch: Callable[[], int],
        faults: FaultHooks,
        net: NetHooks | None,
    ) -> None:
        self.node, self.job, self._secret = node, job, secret
        self.store, self.control = store, control
        self._report = report
        self._current_epoch = current_epoch
        self.faults, self.net = faults, net
        self._lock = threading.Lock()
        self._pulls: dict[tuple[int, int], list[Pull]] = {}  # (epoch, rank) → its restore's
        self._holds: set[tuple[int, int]] = set()  # restored in place: this node holds a copy
        self._wanted: dict[tuple[int, int, int], list[ChunkRecord]] = {}
        self._rebuilding = threading.Lock()
        # The store address local ranks use (the agent's relay when the store is tunnelled).
        self.store_addr: Callable[[str], str] = lambda addr: addr
        self.device: DevicePulls | None = None  # pulls over NCCL where it can (the agent's)

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

    def prepare(self, members: Membership) -> None:
        """Ready every local rank of ``members``, each in its own thread."""
        for rank in members.local_ranks(self.node):
            threading.Thread(
                target=self._prepare_rank,
                args=(members, rank),
                name=f"peerckpt-prepare-r{rank}",
                daemon=True,
            ).start()

    def take_pulls(self, epoch: int, rank: int) -> tuple[list[Pull], bool]:
        """What ``rank``'s restore in ``epoch`` pulled, and whether this node now holds its
        committed snapshot; forgotten once taken."""
        with self._lock:
            pulls = self._pulls.pop((epoch, rank), [])
            holds = (epoch, rank) in self._holds
            self._holds.discard((epoch, rank))
        return pulls, holds

    def want(self, epoch: int, rank: int, round_: int, chunks: list[ChunkRecord]) -> None:
        """A resharding rank's boxes for ``round_`` (kept until the round's plan arrives)."""
        with self._lock:
            self._wanted[(epoch, rank, round_)] = chunks

    def _prepare_rank(self, members: Membership, rank: int) -> None:
        pid = members.ranks[rank].pid
        link = self.control.wait_link(pid, timeout=10.0)
        if link is None:
            log.error("process %d for rank %d never connected to this agent", pid, rank)
            self._report(ProcLost(self.node, pid, "never connected to its agent"))
            return
        restore: RestorePlan | None = None
        manifest = None
        if self._current_epoch() != members.epoch:
            return  # superseded before it began: the newer epoch's thread readies this rank
        self.faults.strike("recovery", node=self.node, rank=rank, epoch=members.epoch)
        sources = members.sources.get(rank, [])
        if members.mode is EpochMode.SAME and sources and sources[0] != self.node:
            self._prepare_arriving(members, rank, link)
            return
        try:
            if members.mode is EpochMode.SAME:
                restore, manifest = self._obtain(members, rank)
            elif members.mode is EpochMode.RESHARD:
                assert members.restore_step is not None
                restore = RestorePlan(
                    EpochMode.RESHARD,
                    members.restore_step,
                    previous_rank=members.previous.get(rank),
                    old_world=members.old_world,
                )
        except Exception as exc:  # a rank left without its state would wait forever
            self._failed(members, rank, exc)
            return
        if self._current_epoch() != members.epoch:
            return  # a newer epoch superseded this one while we were pulling
        link.send(self._epoch_start(members, rank, restore, manifest))

    def _prepare_arriving(self, members: Membership, rank: int, link: ProcLink) -> None:
        """A rank whose state this node does not hold (a spare taking a lost rank's place):
        it starts the epoch at once, joins its group and builds its objects while its state
        is pulled, and waits for ``Arrived`` only where it restores (``ctx.track``)."""
        assert members.restore_step is not None
        plan = RestorePlan(EpochMode.SAME, members.restore_step, arriving=True)
        link.send(self._epoch_start(members, rank, plan, None))
        try:
            got, manifest = self._obtain(members, rank)
        except Exception as exc:  # the rank waits in its restore until the epoch ends
            self._failed(members, rank, exc)
            return
        if self._current_epoch() != members.epoch:
            return  # a newer epoch superseded this one while we were pulling
        assert got.slot is not None and got.path is not None
        link.send(Arrived(members.epoch, got.slot, got.path, manifest))

    def _failed(self, members: Membership, rank: int, exc: Exception) -> None:
        """Readying ``rank`` failed: the coordinator decides (another source, storage, or the
        job's end); a RecoveryFailed names every source already, anything else is logged."""
        if not isinstance(exc, RecoveryFailed):
            log.exception("preparing rank %d for epoch %d failed", rank, members.epoch)
        self._report(_rank_failed(self.node, members.epoch, rank, exc))

    def _epoch_start(
        self,
        members: Membership,
        rank: int,
        restore: RestorePlan | None,
        manifest: SnapshotManifest | None,
    ) -> EpochStart:
        return EpochStart(
            epoch=members.epoch,
            rank=rank,
            world_size=members.world_size,
            local_rank=members.local_ranks(self.node).index(rank),
            node=self.node,
            store_addr=self.store_addr(members.store_addr),
            hosts=sorted({a.rpartition(":")[0] for a in members.node_addrs.values()}),
            restore=restore,
            body=RestoreBody(manifest, members.old_layout),
        )

    def on_reads(self, members: Membership, event: Reads) -> None:
        """A resharding round was planned: gather each local rank's staging slot."""
        if event.epoch != members.epoch:
            return
        for rank, reads in event.reads.items():
            threading.Thread(
                target=self._gather,
                args=(members, rank, event.round, reads),
                name=f"peerckpt-gather-r{rank}",
                daemon=True,
            ).start()

    def _gather(self, members: Membership, rank: int, round_: int, msg: dict[str, Any]) -> None:
        link = self.control.link_of(members.ranks[rank].pid)
        with self._lock:
            wanted = self._wanted.pop((members.epoch, rank, round_), None)
        if link is None or wanted is None or members.restore_step is None:
            return
        job = GatherJob(
            node=self.node,
            epoch=members.epoch,
            gen=members.gen,
            rank=rank,
            round=round_,
            old_gen=members.restore_gen,
            step=members.restore_step,
            wanted=wanted,
            reads=decode_reads(msg, wanted),  # the plan's compact message (peerckpt/reads.py)
            storage_url=members.restore_url,
        )
        try:
            job = replace(job, reads=self._rebuild_for(members, job.reads))
            got = assemble(self.store, job, self._connect(members))
        except Exception as exc:
            log.error("gathering rank %d's state failed: %s", rank, exc)
            self._report(_rank_failed(self.node, members.epoch, rank, exc))
            return
        pulls = []
        if got.local_bytes:
            pulls.append(Pull(rank, self.node, self.node, got.local_bytes, got.seconds, round_))
        for source, nbytes in sorted(got.pulled.items()):
            pulls.append(Pull(rank, self.node, source, nbytes, got.seconds, round_))
        with self._lock:
            self._pulls.setdefault((members.epoch, rank), []).extend(pulls)
        link.send(Staging(members.epoch, round_, got.slot.segment.path, got.manifest))

    def _rebuild_for(self, members: Membership, reads: list[Read]) -> list[Read]:
        """``--erasure``: rebuild here, once, every old rank the plan reads from ``ERASURE``
        (``replication/decoding.py``); its reads then come from this node's copy."""
        lost = sorted({r.source_rank for r in reads if r.source_node == ERASURE})
        if not lost:
            return reads
        assert members.restore_step is not None
        gen, step = members.restore_gen, members.restore_step
        with self._rebuilding:  # local ranks gathering at once rebuild each rank once
            for rank in lost:
                if self.store.find(gen, rank, step) is None:
                    rebuild(
                        self.store,
                        members.epoch,
                        gen,
                        rank,
                        step,
                        members.erasure_restore,
                        set(members.node_addrs),
                        self._connect(members),
                        index=_pull_target(self.store, gen, rank, step),
                        node=self.node,
                    )
        return [r._replace(source_node=self.node) if r.source_node == ERASURE else r for r in reads]

    def _obtain(self, members: Membership, rank: int) -> tuple[RestorePlan, SnapshotManifest]:
        """Make the committed snapshot of ``rank`` available in one of its own local slots."""
        assert members.restore_step is not None
        got = obtain_committed(
            self.store,
            self.node,
            members.epoch,
            members.restore_gen,
            rank,
            members.restore_step,
            members.sources.get(rank, []),
            self._connect(members),
            twins=members.twins.get(rank),
            erasure=members.erasure_restore,
            alive=set(members.node_addrs),
            device=self.device,
        )
        with self._lock:
            key = (members.epoch, rank)
            self._pulls[key] = [Pull(rank, self.node, got.source, got.nbytes, got.seconds)]
            self._holds.add(key)
        plan = RestorePlan(
            EpochMode.SAME, members.restore_step, got.slot.index, got.slot.segment.path
        )
        return plan, got.manifest


def _rank_failed(node: int, epoch: int, rank: int, exc: Exception) -> RankFailed:
    unreachable = isinstance(exc, RecoveryFailed) and exc.unreachable
    return RankFailed(node, epoch, rank, type(exc).__name__, str(exc), unreachable)
