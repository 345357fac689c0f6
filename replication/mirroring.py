"""The agent's sending side of replication: every local snapshot to the rank's buddies.

On a ``SnapshotTaken`` notice of the current epoch, ``Mirroring.replicate`` checksums the
slot (``ReplicationJob.start``) and hands the job to one ``BuddySender`` per buddy node
(``replication/replicator.py``). When every buddy acknowledged, it reports ``Replicated`` to
the coordinator; the coordinator commits a step once every rank's snapshot of it is
replicated. A buddy that refused or could not be reached is reported (``ReplicationFailed``):
the coordinator decides. The chunk layout travels with a rank's first report of an epoch and
whenever it changed; the last full report is kept for a restarted coordinator.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from peerckpt.coding import Coding
from peerckpt.columns import ChunkColumns
from peerckpt.errors import PeerUnavailable, StaleEpoch
from peerckpt.faults import FaultHooks
from peerckpt.manifest import META_KEY, SnapshotManifest
from peerckpt.membership import Membership
from peerckpt.messages.control import Replicated, ReplicationFailed
from peerckpt.messages.local import SnapshotTaken
from peerckpt.replication import dedup
from peerckpt.replication.coordlink import CoordinatorLink
from peerckpt.replication.encoding import Encoding, pieces_of
from peerckpt.replication.replicator import BuddySender, ReplicationJob
from peerckpt.replication.stats import NodeCounters
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.replication.transfer import Cancelled
from peerckpt.states import SlotKind

log = logging.getLogger("peerckpt.mirroring")


class Mirroring:
    """Replicates this node's snapshots. ``retry_s``: how long a push to an unreachable buddy
    is retried (the agent sets twice the heartbeat timeout)."""

    def __init__(
        self,
        node: int,
        job: str,
        secret: bytes,
        store: SlotStore,
        coordinator: CoordinatorLink,
        current_epoch: Callable[[], int],
        committed_step: Callable[[], int | None],
        faults: FaultHooks,
    ) -> None:
        self.node, self.job, self._secret = node, job, secret
        self.store = store
        self.coordinator = coordinator
        self._epoch = current_epoch
        self._committed = committed_step
        self.faults = faults
        self.retry_s = 10.0
        self.record_digests = False  # reports carry every tensor's digest (the coordinator asks)
        self._lock = threading.Lock()
        self._senders: dict[int, BuddySender] = {}
        self._reported_layouts: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._whole: set[tuple[int, int]] = set()  # (epoch, rank): pushed whole, not deduplicated
        self.counters = NodeCounters()  # sent with every heartbeat (replication/stats.py)
        self.encoding = Encoding(job, secret, current_epoch, committed_step, self._sent, faults)

    def replicate(self, members: Membership, msg: SnapshotTaken) -> None:
        """Checksum and push ``msg``'s snapshot to the rank's buddies in ``members``."""
        slot = self.store.get(SlotKind.OWN, members.gen, msg.rank, msg.slot)
        if slot is None:
            return
        manifest = msg.manifest
        manifest.validate_bounds(slot.segment.size)
        self.counters.snapshot(msg.epoch, msg.rank, manifest.step, manifest.used_bytes)
        if members.erasure is not None:
            self._encode(members, msg.epoch, slot, manifest)
            return
        buddies = members.placement.get(msg.rank, [])
        with slot.lock:
            job = ReplicationJob.start(msg.epoch, slot, manifest, buddies)
        if (msg.epoch, msg.rank) not in self._whole:
            job.absent = dedup.absent_chunks(manifest, members, msg.rank)
        if msg.epoch != self._epoch():
            return  # the epoch ended meanwhile; its snapshot must not count
        self._submit(job, members)

    def _encode(
        self, members: Membership, epoch: int, slot: Slot, manifest: SnapshotManifest
    ) -> None:
        """``--erasure``: send the snapshot's pieces to its stripes' parity holders; the
        chunks its data-parallel twins hold are left out of them (``dedup.coded_absent``)."""
        assert members.erasure is not None
        coding = Coding.from_msg(members.erasure)
        absent: tuple[int, ...] = ()
        if (epoch, slot.rank) not in self._whole:
            absent = dedup.coded_absent(manifest, coding, slot.rank)
        pieces = pieces_of(coding, slot.rank, manifest, absent)
        with slot.lock:
            job = ReplicationJob.start(epoch, slot, manifest, sorted({p.node for p in pieces}))
        job.coded, job.absent = True, absent
        if epoch != self._epoch():
            return
        if not pieces:
            self._replicated(job)
            return
        self.encoding.retry_s = self.retry_s
        self.encoding.submit(job, pieces, members.node_addrs)

    def _submit(self, job: ReplicationJob, members: Membership) -> None:
        if not job.buddies:
            self._replicated(job)
            return
        for buddy in job.buddies:
            self._sender(buddy, members.node_addrs[buddy]).put(job)

    def replicate_whole(self, members: Membership, rank: int, step: int) -> None:
        """The coordinator found ``rank``'s data-parallel chunks unequal to its twins' (or too
        few twins): push its snapshot of ``step`` whole, and every later one of the epoch
        (with ``--erasure``: code every later one whole)."""
        self._whole.add((members.epoch, rank))
        slot = self.store.find(members.gen, rank, step)
        if slot is None or slot.kind is not SlotKind.OWN:
            log.warning("rank %d step %d is no longer in its slot; not pushed whole", rank, step)
            return
        with slot.lock:
            manifest = slot.manifest
            if manifest is None or manifest.step != step:
                return
            job = ReplicationJob(members.epoch, slot, manifest, members.placement.get(rank, []))
        if members.erasure is not None:
            self._recode_whole(members, job)
            return
        self._submit(job, members)

    def _recode_whole(self, members: Membership, job: ReplicationJob) -> None:
        """``--erasure``: code ``job``'s snapshot anew, whole, for the same step: each piece
        cut without the twins' chunks is taken out of its parity (the same bytes folded again:
        the slot still holds them, its step not being committed), then the whole piece folded
        in, one after the other on each holder's connection."""
        assert members.erasure is not None
        coding = Coding.from_msg(members.erasure)
        rank, manifest = job.slot.rank, job.manifest
        before = dedup.coded_absent(manifest, coding, rank)
        old = pieces_of(coding, rank, manifest, before)
        new = pieces_of(coding, rank, manifest)
        pieces = [p for o, n in zip(old, new, strict=True) for p in (replace(o, unfold=True), n)]
        job.buddies, job.coded = sorted({p.node for p in new}), True
        self.encoding.retry_s = self.retry_s
        self.encoding.submit(job, pieces, members.node_addrs)

    def cancel_inflight(self) -> None:
        """An epoch change: abandon the transfers in flight."""
        with self._lock:
            senders = list(self._senders.values())
        for sender in senders:
            sender.cancel_inflight()
        self.encoding.cancel_inflight()

    def forget_reported_layouts(self) -> None:
        """A restarted coordinator knows no layout: send each with the next report."""
        self._reported_layouts.clear()

    def stop(self) -> None:
        with self._lock:
            senders = list(self._senders.values())
            self._senders.clear()
        for sender in senders:
            sender.stop()
        self.encoding.stop()

    def _sender(self, node: int, addr: str) -> BuddySender:
        with self._lock:
            sender = self._senders.get(node)
            if sender is None or sender.address != addr:
                if sender is not None:
                    sender.stop()
                sender = BuddySender(
                    node,
                    addr,
                    self._secret,
                    self.job,
                    self._epoch,
                    self._committed,
                    self._sent,
                    retry_s=self.retry_s,
                    local_node=self.node,
                    faults=self.faults,
                )
                self._senders[node] = sender
            return sender

    def _sent(self, job: ReplicationJob, node: int, error: BaseException | None) -> None:
        with job.lock:
            if job.failed:
                return
            if error is not None:
                job.failed = True
        if error is not None:
            if not isinstance(error, (Cancelled, StaleEpoch)) and job.epoch == self._epoch():
                # The coordinator decides: a lost buddy opens a new epoch anyway; a live
                # buddy that refuses (memory, checksums) fails the job with its reason.
                self.coordinator.report(
                    ReplicationFailed(
                        self.node,
                        job.epoch,
                        job.slot.rank,
                        job.manifest.step,
                        node,
                        f"{type(error).__name__}: {error}",
                        fatal=not isinstance(error, (PeerUnavailable, OSError)),
                    )
                )
            return
        self.counters.replicated(dedup.sent_bytes(job.manifest.without(job.absent)))
        with job.lock:
            job.acked.append(node)
            if len(job.acked) < len(job.buddies):
                return
        self._replicated(job)

    def _replicated(self, job: ReplicationJob) -> None:
        # The tensor layout travels on an epoch's first report and when it changes (the
        # coordinator needs it to plan a resharding); the blob's size, which changes almost
        # every step, travels as a number.
        manifest = job.checksummed()
        tensors = [c for c in manifest.chunks if c.key != META_KEY]
        signature = tuple((c.key, c.global_shape, c.offsets, c.lengths) for c in tensors)
        key = (job.epoch, job.slot.rank)
        full = Replicated(
            self.node,
            job.epoch,
            job.slot.rank,
            manifest.step,
            [self.node] if job.coded else [self.node, *job.acked],
            manifest.used_bytes,
            manifest.meta().nbytes,
            manifest.state_digest(),
            columns=ChunkColumns.from_records(manifest.chunks),
            twins=dedup.twin_digest(manifest),
            partial=bool(job.absent),
            deduplicated=manifest.used_bytes - dedup.sent_bytes(manifest.without(job.absent)),
            absent=tuple(job.absent),
            tensors=manifest.tensor_digests() if self.record_digests else {},
        )
        # Sent again, layout and all, to a restarted coordinator (it may have missed it).
        self.coordinator.remember(("Replicated", job.slot.rank), full)
        same = self._reported_layouts.get(key) == signature
        self.coordinator.report_replicated(replace(full, columns=None) if same else full)
        self._reported_layouts[key] = signature
