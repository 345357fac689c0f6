"""The agent's parity pieces (``--erasure K+M``): folding data pieces in, serving them out.

Exchanges on an authenticated data connection (``replication/transfer.py`` serves them)::

    parity_piece  → {parity_piece, epoch, gen, rank, step, committed, group, stripe, row,
                     piece, k, coef, length, manifest, unfold}           ← {ready} | error
                  → {data, off} + bytes … → {end, crcs: [piece crc, chunk crcs …]}
                                                                         ← {ack} | error
    fetch_parity  → {fetch_parity, epoch, gen, group, stripe, row, step}
                  ← {parity_reply, length, crc, manifests} + data frames + {end}
    fetch_ranges  → {fetch_ranges, epoch, gen, rank, step, ranges}
                  ← data frames (offsets counted over the ranges) + {end, crcs: [crc]}

A holder keeps, per (layout, group, stripe, row), two parity buffers, as a buddy keeps two
replica slots per rank: never the one holding the committed step is reset. A piece is
received whole into process memory, its crc32c checked, and only then folded in
(parity ^= coef · piece, ``peerckpt/gf256.py``): a transfer that breaks midway leaves the
parity untouched, and a piece folded already (a push retried after its ack was lost) is
not folded twice. A piece is taken out again by folding the same bytes once more
(``unfold``, checked against the crc32c recorded when it was folded): so a rank coded
without its twins' chunks whose twins turn out to differ is coded anew, whole, for the same
step (``replication/mirroring.py``). The last of the stripe's k pieces computes the parity's crc32c before
its ack goes out, so by the time a step commits (every piece of every rank acknowledged)
every parity of that step is complete and checksummed. A fetch answers only a complete
parity, with that crc32c, which the reader checks: a parity corrupted in memory is found
there, never decoded from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c
import numpy as np

from peerckpt.errors import ProtocolError
from peerckpt.gf256 import mad_into, mul_into
from peerckpt.manifest import SnapshotManifest
from peerckpt.messages.data import (
    Ack,
    Data,
    End,
    FetchParity,
    FetchRanges,
    ParityPiece,
    ParityReply,
    Ready,
)
from peerckpt.replication.arena import Arena, Segment
from peerckpt.replication.store import SlotStore
from peerckpt.wire import Connection

FRAME_BYTES = 16 << 20
ParityKey = tuple[int, tuple[int, ...], int, int]  # (gen, group's ranks, stripe, row)
log = logging.getLogger("peerckpt.parity")


@dataclass
class ParityBuffer:
    """One parity piece of one step, being folded or complete (``crc`` set)."""

    segment: Segment | None = None
    step: int | None = None
    k: int = 0
    filled: int = 0  # bytes written: the longest piece folded so far
    got: dict[int, int] = field(default_factory=dict)  # piece → the crc32c of what was folded
    manifests: dict[int, SnapshotManifest] = field(default_factory=dict)
    crc: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def array(self) -> np.ndarray:
        assert self.segment is not None
        return np.frombuffer(self.segment.view, dtype=np.uint8)


class ParityStore:
    """Every parity buffer of one agent, in its arena."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._pairs: dict[ParityKey, list[ParityBuffer]] = {}
        self._lock = threading.Lock()

    def fold(
        self,
        key: ParityKey,
        step: int,
        keep: int | None,
        k: int,
        piece: int,
        coef: int,
        rank: int,
        data: np.ndarray,
        manifest: SnapshotManifest,
        crc: int | None = None,
        unfold: bool = False,
    ) -> None:
        """Fold ``data`` (piece ``piece`` of ``rank``'s snapshot of ``step``, its crc32c
        ``crc``) into the parity of ``key``; never into the buffer holding step ``keep`` (the
        committed one). ``unfold``: take that piece out again (``data``: the bytes folded in,
        their crc32c recorded then; anything else is not taken out), leaving the parity
        incomplete until the piece is folded in anew."""
        crc = crc32c.crc32c(data.data) if crc is None else crc
        with self._lock:
            pair = self._pairs.setdefault(key, [ParityBuffer(), ParityBuffer()])
            target = next((b for b in pair if b.step == step), None)
            if target is None:
                if unfold:
                    return  # nothing of that step is here to take out
                free = [b for b in pair if b.step is None or b.step != keep]
                target = min(free, key=lambda b: -1 if b.step is None else b.step)
                with target.lock:
                    target.step, target.k, target.filled = step, k, 0
                    target.got, target.manifests, target.crc = {}, {}, None
        with target.lock:
            if target.step != step:
                return  # reset by a newer step meanwhile
            if unfold:
                if target.got.get(piece) != crc or data.size > target.filled:
                    return  # not what was folded in (or taken out already: a retried unfold)
                mad_into(target.array()[: data.size], data, coef)  # x + x = 0 in GF(2^8)
                del target.got[piece]
                target.crc = None
                return
            if piece in target.got:
                return  # folded already (a retried push)
            self._fit(target, key, data.size)
            parity = target.array()
            n, f = data.size, target.filled
            mad_into(parity[: min(n, f)], data[: min(n, f)], coef)
            if n > f:
                mul_into(parity[f:n], data[f:n], coef)
                target.filled = n
            target.got[piece] = crc
            target.manifests[rank] = manifest
            if len(target.got) >= target.k:
                target.crc = crc32c.crc32c(parity[: target.filled].data)

    def _fit(self, buf: ParityBuffer, key: ParityKey, nbytes: int) -> None:
        """Grow ``buf``'s segment to ``nbytes`` (keeping what was folded); caller holds its lock."""
        if buf.segment is not None and buf.segment.size >= nbytes:
            return
        gen, _, stripe, row = key
        what = f"parity row {row} of stripe {stripe} (layout {gen})"
        segment = self.arena.create(f"p{stripe}-{row}-g{gen}", nbytes, what)
        if buf.segment is not None:
            segment.view[: buf.filled] = buf.segment.view[: buf.filled]
            self.arena.release(buf.segment)
        buf.segment = segment

    def find(self, key: ParityKey, step: int) -> ParityBuffer | None:
        """The complete parity of ``key`` for ``step``, if this agent holds it."""
        with self._lock:
            pair = self._pairs.get(key, [])
        return next((b for b in pair if b.step == step and b.crc is not None), None)

    def release_where(self, doomed: Callable[[ParityKey], bool]) -> int:
        """Free every buffer whose key is ``doomed``; return how many."""
        with self._lock:
            keys = [key for key in self._pairs if doomed(key)]
            pairs = [self._pairs.pop(key) for key in keys]
        freed = 0
        for pair in pairs:
            for buf in pair:
                with buf.lock:
                    if buf.segment is not None:
                        self.arena.release(buf.segment)
                        buf.segment, buf.step, buf.crc = None, None, None
                        freed += 1
        return freed

    def held_keys(self) -> list[ParityKey]:
        with self._lock:
            return list(self._pairs)


def send_ranges(
    conn: Connection,
    view: memoryview,
    ranges: list[tuple[int, int]],
    crcs: Callable[[int], list[int]] | None = None,
) -> int:
    """Send ``view``'s byte ``ranges`` as data frames numbered over the ranges, then ``end``
    carrying ``crcs(crc of the bytes sent)`` (default: just that crc). Returns the crc."""
    crc, off = 0, 0
    for start, stop in ranges:
        for a in range(start, stop, FRAME_BYTES):
            part = view[a : min(a + FRAME_BYTES, stop)]
            crc = crc32c.crc32c(part, crc)
            conn.send_msg(Data(off), part)
            off += len(part)
    conn.send_msg(End(crcs(crc) if crcs is not None else [crc]))
    return crc


def serve_piece(
    conn: Connection,
    msg: ParityPiece,
    parity: ParityStore,
    current_epoch: int,
    committed: int | None,
) -> None:
    """Receive one data piece, check it, fold it into its parity, acknowledge."""
    from peerckpt.replication.transfer import recv_bytes

    if msg.epoch < current_epoch:
        conn.send_error("stale_epoch", f"piece of epoch {msg.epoch} after {current_epoch} began")
        return
    if msg.length < 0 or msg.length > msg.manifest.used_bytes or not 0 <= msg.coef < 256:
        conn.send_error("protocol", "a parity piece longer than its snapshot, or a bad coefficient")
        raise ProtocolError(f"{conn.peer} sent a malformed parity piece")
    conn.send_msg(Ready())
    data = np.empty(msg.length, dtype=np.uint8)
    end = recv_bytes(conn, data.data, msg.length)
    sent = end.crcs
    if sent is None or len(sent) != 1 + len(msg.manifest.chunks):
        conn.send_error("protocol", "the piece ended without its crc32c and the chunks'")
        raise ProtocolError(f"{conn.peer} ended a parity piece without its checksums")
    if crc32c.crc32c(data.data) != sent[0]:
        log.error("piece %d of rank %d step %d from %s fails its crc32c", msg.piece, msg.rank,
                  msg.step, conn.peer)  # fmt: skip
        conn.send_error("checksum", f"piece {msg.piece} of rank {msg.rank} fails its crc32c")
        return
    keep = max((s for s in (committed, msg.committed) if s is not None), default=None)
    key: ParityKey = (msg.gen, tuple(msg.group), msg.stripe, msg.row)
    manifest = msg.manifest.with_crcs(sent[1:])
    parity.fold(
        key,
        msg.step,
        keep,
        msg.k,
        msg.piece,
        msg.coef,
        msg.rank,
        data,
        manifest,
        sent[0],
        msg.unfold,
    )
    conn.send_msg(Ack())


def serve_parity(conn: Connection, msg: FetchParity, parity: ParityStore) -> None:
    """Send a complete parity piece with its crc32c and its stripe's manifests."""
    buf = parity.find((msg.gen, tuple(msg.group), msg.stripe, msg.row), msg.step)
    if buf is None:
        conn.send_error(
            "missing", f"no complete parity of stripe {msg.stripe} row {msg.row} step {msg.step}"
        )
        return
    with buf.lock:
        if buf.step != msg.step or buf.crc is None or buf.segment is None:
            conn.send_error("missing", "the parity was replaced while the request waited")
            return
        conn.send_msg(ParityReply(buf.filled, buf.crc, list(buf.manifests.values())))
        send_ranges(conn, buf.segment.view, [(0, buf.filled)])


def serve_ranges(conn: Connection, msg: FetchRanges, store: SlotStore) -> None:
    """Send byte ranges of a held copy (a data piece a rebuild decodes with)."""
    slot = store.find(msg.gen, msg.rank, msg.step, partial=True)
    if slot is None:
        conn.send_error("missing", f"this agent holds no copy of rank {msg.rank} step {msg.step}")
        return
    with slot.lock:
        manifest = slot.manifest
        if manifest is None or manifest.step != msg.step:
            conn.send_error("missing", "the copy was replaced while the request waited")
            return
        ranges = [(int(a), int(b)) for a, b in msg.ranges]
        if any(a < 0 or b < a or b > manifest.used_bytes for a, b in ranges):
            conn.send_error("protocol", "ranges outside the snapshot")
            return
        send_ranges(conn, slot.segment.view, ranges)
