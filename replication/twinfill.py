"""Completing a partial copy of a rank's snapshot from its data-parallel twins.

With redundancy-aware replication (``replication/dedup.py``) a buddy holds a rank's snapshot
without the chunks its twins hold equal (``manifest.absent``). A recovery that reads such a
copy then fills those chunks from a twin's complete copy: on this node with one copy each,
else with ``fetch_boxes`` from the first of the plan's ``[node, twin]`` pairs
(``Membership.twins``) that answers. Every chunk is verified against the crc32c the *lost*
rank's own manifest records for it, so a twin whose bytes differ is never restored from.

The caller holds no lock; this module takes the slots' locks while it reads or writes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import crc32c

from peerckpt.errors import ChecksumMismatch, PeerckptError, PeerUnavailable, ProtocolError
from peerckpt.manifest import ChunkRecord
from peerckpt.messages import decode
from peerckpt.messages.data import Box as BoxFrame
from peerckpt.messages.data import End, FetchBoxes
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.wire import Connection, raise_if_error

log = logging.getLogger("peerckpt.restore")


def _box(c: ChunkRecord) -> list[list[int]]:
    return [list(c.offsets), list(c.lengths)]


def _check(c: ChunkRecord, data: memoryview, rank: int, where: str) -> None:
    if crc32c.crc32c(data) != c.crc:
        raise ChecksumMismatch(
            f"chunk {c.key!r} of {where} differs from rank {rank}'s (crc32c); not restored from"
        )


def _from_local(store: SlotStore, slot: Slot, need: list[ChunkRecord], twin: int) -> int:
    assert slot.manifest is not None
    step, rank = slot.manifest.step, slot.rank
    src = store.find(slot.gen, twin, step)
    if src is None:
        raise PeerUnavailable(f"this node holds no complete copy of twin rank {twin} step {step}")
    copied = 0
    with src.lock:
        manifest = src.manifest
        if manifest is None or manifest.step != step:
            raise PeerUnavailable(f"the copy of twin rank {twin} was replaced meanwhile")
        records = {(c.key, c.offsets, c.lengths): c for c in manifest.chunks}
        for c in need:
            s = records.get((c.key, c.offsets, c.lengths))
            if s is None or s.nbytes != c.nbytes:
                raise ProtocolError(f"twin rank {twin} has no chunk {c.key!r} like rank {rank}'s")
            data = src.segment.view[s.byte_offset : s.byte_offset + s.nbytes]
            _check(c, data, rank, f"twin rank {twin}")
            slot.segment.view[c.byte_offset : c.byte_offset + c.nbytes] = data
            copied += c.nbytes
    return copied


def _from_peer(conn: Connection, slot: Slot, need: list[ChunkRecord], twin: int, epoch: int) -> int:
    assert slot.manifest is not None
    step, rank = slot.manifest.step, slot.rank
    items = [(twin, c.key, _box(c), _box(c)) for c in need]
    conn.send_msg(FetchBoxes(epoch, slot.gen, step, items))
    done = [False] * len(need)
    received = 0
    while True:
        header = conn.recv_header()
        raise_if_error(header, conn.peer)
        frame = decode(header, where=conn.peer)
        if isinstance(frame, End):
            break
        if not isinstance(frame, BoxFrame) or not 0 <= frame.i < len(need) or done[frame.i]:
            raise ProtocolError(f"{conn.peer} sent {header['type']!r} in answer to fetch_boxes")
        c = need[frame.i]
        dst = slot.segment.view[c.byte_offset : c.byte_offset + c.nbytes]
        conn.recv_payload_into(header, dst)
        if header["len"] != c.nbytes:
            raise ProtocolError(f"{conn.peer} sent {header['len']} bytes of {c.key!r}")
        _check(c, dst, rank, f"twin rank {twin} on {conn.peer}")
        done[frame.i] = True
        received += c.nbytes
    if not all(done):
        raise ProtocolError(f"{conn.peer} left out chunks of twin rank {twin}")
    return received


def complete(
    store: SlotStore,
    slot: Slot,
    node: int,
    epoch: int,
    sources: list[list[int]],
    connect: Callable[[int], Connection],
) -> dict[int, int]:
    """Fill the chunks ``slot``'s copy lacks from a twin (``sources``: [node, twin rank],
    best first); the slot's manifest then names none absent. Returns bytes per source node.
    Raises PeerUnavailable naming each source and why when none could give them."""
    assert slot.manifest is not None
    manifest = slot.manifest
    need = [manifest.chunks[i] for i in manifest.absent]
    failures = []
    for source, twin in sources:
        try:
            with slot.lock:
                if slot.manifest is not manifest:
                    raise PeerUnavailable("the copy being completed was replaced meanwhile")
                if slot.segment.sparse:  # the absent chunks' pages are holes: reserve them
                    slot.segment.reserve(
                        [(c.byte_offset, c.byte_offset + c.nbytes) for c in need],
                        f"completing rank {slot.rank}'s copy",
                    )
                if source == node:
                    got = _from_local(store, slot, need, twin)
                else:
                    conn = connect(source)
                    try:
                        got = _from_peer(conn, slot, need, twin, epoch)
                    finally:
                        conn.close()
                slot.manifest = manifest.without(())
            return {source: got}
        except (PeerckptError, OSError) as exc:
            log.warning(
                "cannot complete rank %d from twin rank %d on node %d: %s",
                slot.rank,
                twin,
                source,
                exc,
            )
            failures.append(f"twin rank {twin} on node {source}: {exc}")
    raise PeerUnavailable(
        f"rank {slot.rank}'s data-parallel chunks could be read from no twin: "
        + ("; ".join(failures) or "no twin's copy survived")
    )
