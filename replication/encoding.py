"""The agent's sending side of erasure coding (``--erasure K+M``): pieces to parity holders.

Where ``--replicas k`` pushes a rank's whole snapshot to k buddies, here the agent cuts the
rank's coded bytes into its group's k pieces (``peerckpt/coding.py``) and sends piece p to
the m nodes holding the parity rows of the stripe it belongs to, each of which folds it in
(``replication/parity.py``). The coded bytes are the snapshot less the chunks its
data-parallel twins hold (``job.absent``, ``replication/dedup.py``); the manifest sent with
each piece names those chunks absent, so a rebuild knows which bytes were coded. One sender thread per destination node, one connection each;
the pieces of a snapshot to one node go one after another, the nodes in parallel. Once every
piece is acknowledged the snapshot counts as replicated to that node, and when every node
did, ``Mirroring`` reports it (``Replicated``, the rank's own node its only complete copy).
Nothing here runs in the training process: the ranks only copy into their slots.

A piece the holder refused (checksum) is retried once on a fresh connection; a holder that
cannot be reached is retried for ``retry_s``, then reported, as replicas are
(``replication/replicator.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from peerckpt.coding import Coding, parity_matrix, piece_ranges, stripe_of_piece
from peerckpt.faults import NO_FAULTS, FaultHooks
from peerckpt.manifest import SnapshotManifest
from peerckpt.messages.data import Ack, ParityPiece, Ready
from peerckpt.replication.parity import send_ranges
from peerckpt.replication.replicator import NodeSender, ReplicationJob
from peerckpt.replication.transfer import Cancelled

log = logging.getLogger("peerckpt.encoding")


@dataclass(frozen=True)
class Piece:
    """One piece of a snapshot, bound for the holder of one parity row of its stripe."""

    node: int
    group: tuple[int, ...]
    stripe: int
    row: int
    piece: int
    k: int
    coef: int
    ranges: tuple[tuple[int, int], ...]
    absent: tuple[int, ...] = ()  # the chunks this coding of the snapshot left out
    unfold: bool = False  # take this piece, folded in before, out of the parity again

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)


@dataclass
class CodedJob:
    """A snapshot's pieces; ``left[node]``: pieces to ``node`` not acknowledged yet."""

    job: ReplicationJob
    pieces: list[Piece]
    left: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def pieces_of(
    coding: Coding, rank: int, manifest: SnapshotManifest, absent: tuple[int, ...] = ()
) -> list[Piece]:
    """Every piece of ``rank``'s snapshot (``manifest``) and the node it goes to. The coded
    bytes are the slot's byte ranges of every chunk but ``absent`` (those its data-parallel
    twins hold: ``replication/dedup.py``); each piece's holder keeps the manifest naming
    them absent, which is how a rebuild knows what was coded."""
    coded = manifest.without(absent).byte_ranges()
    group = coding.group_of(rank)
    if group is None or group.k < 1:
        return []
    pos, g, k, m = group.position(rank), group.size, group.k, group.m
    matrix = parity_matrix(k, m)
    out = []
    for p in range(k):
        stripe = stripe_of_piece(g, k, m, pos, p)
        ranges = tuple(piece_ranges(coded, k, p))
        for t in range(m):
            node = group.nodes[(stripe.index + t) % g]
            coef = matrix[t][p]
            out.append(Piece(node, group.ranks, stripe.index, t, p, k, coef, ranges, absent))
    return out


class Encoding:
    """Sends pieces; ``sent(job, node, error)`` hears when a node has all of a snapshot's."""

    def __init__(
        self,
        job: str,
        secret: bytes,
        current_epoch: Callable[[], int],
        committed_step: Callable[[], int | None],
        sent: Callable[[ReplicationJob, int, BaseException | None], None],
        faults: FaultHooks = NO_FAULTS,
    ) -> None:
        self._job, self._secret = job, secret
        self._epoch, self._committed = current_epoch, committed_step
        self._sent = sent
        self._faults = faults
        self.retry_s = 10.0
        self._lock = threading.Lock()
        self._senders: dict[int, _PieceSender] = {}

    def submit(self, job: ReplicationJob, pieces: list[Piece], addrs: dict[int, str]) -> None:
        """Send ``pieces`` of ``job``'s snapshot (``job.buddies``: their distinct nodes)."""
        coded = CodedJob(job, pieces)
        for piece in pieces:
            coded.left[piece.node] = coded.left.get(piece.node, 0) + 1
        for piece in pieces:
            self._sender(piece.node, addrs[piece.node]).put((coded, piece))

    def _sender(self, node: int, addr: str) -> _PieceSender:
        with self._lock:
            sender = self._senders.get(node)
            if sender is None or sender.address != addr:
                if sender is not None:
                    sender.stop()
                sender = _PieceSender(self, node, addr)
                self._senders[node] = sender
            return sender

    def cancel_inflight(self) -> None:
        with self._lock:
            senders = list(self._senders.values())
        for sender in senders:
            sender.cancel_inflight()

    def stop(self) -> None:
        with self._lock:
            senders = list(self._senders.values())
            self._senders.clear()
        for sender in senders:
            sender.stop()

    def _done(self, coded: CodedJob, node: int, error: BaseException | None) -> None:
        with coded.lock:
            if error is None:
                coded.left[node] -= 1
                if coded.left[node] > 0:
                    return
            elif coded.left.get(node, 0) <= 0:
                return
            else:
                coded.left[node] = 0
        self._sent(coded.job, node, error)


class _PieceSender(NodeSender[tuple[CodedJob, Piece]]):
    """One destination node's queue of pieces, sent by one thread over one connection."""

    def __init__(self, owner: Encoding, node: int, address: str) -> None:
        self._owner = owner
        super().__init__(node, address, owner._secret, owner._job, owner._faults, "peerckpt-encode")

    def _what(self, item: tuple[CodedJob, Piece]) -> str:
        job, piece = item[0].job, item[1]
        return (
            f"piece {piece.piece} of rank {job.slot.rank} step {job.manifest.step} "
            f"to node {self.node}"
        )

    def _stale(self, item: tuple[CodedJob, Piece]) -> bool:
        return self._epoch_ended(item) or item[0].job.failed

    def _epoch_ended(self, item: tuple[CodedJob, Piece]) -> bool:
        return item[0].job.epoch != self._owner._epoch()

    def _retry_s(self) -> float:
        return self._owner.retry_s

    def _finish(self, item: tuple[CodedJob, Piece], error: BaseException | None) -> None:
        self._owner._done(item[0], self.node, error)

    def _send(self, item: tuple[CodedJob, Piece]) -> None:
        job, piece = item[0].job, item[1]
        conn = self._connection()
        with job.slot.lock:
            if not job.is_current():
                raise Cancelled("slot was rewritten before it could be sent")
            if self.cancel.is_set():
                raise Cancelled("transfer cancelled by an epoch change")
            conn.send_msg(
                ParityPiece(
                    job.epoch,
                    job.slot.gen,
                    job.slot.rank,
                    job.manifest.step,
                    self._owner._committed(),
                    list(piece.group),
                    piece.stripe,
                    piece.row,
                    piece.piece,
                    piece.k,
                    piece.coef,
                    piece.length,
                    job.manifest.without(piece.absent),  # the holder keeps what was coded
                    piece.unfold,
                )
            )
            conn.recv_msg(Ready)
            send_ranges(conn, job.slot.segment.view, list(piece.ranges), lambda c: [c, *job.crcs()])
            conn.recv_msg(Ack)
            if job.slot.manifest is None:
                job.slot.manifest = job.checksummed()  # the slot's bytes are whole and known
