"""Erasure coding with data-parallel twins between in-process agents: each rank's pieces leave
out the chunks its twins hold, and a rebuild decodes the rest and reads those from a twin."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from peerckpt.coding import Coding, ErasureSpec, Group
from peerckpt.errors import PeerUnavailable
from peerckpt.manifest import ChunkRecord, SnapshotManifest, align
from peerckpt.replication.decoding import rebuild, twin_sources
from peerckpt.replication.dedup import coded_absent
from peerckpt.replication.encoding import Encoding, pieces_of
from peerckpt.replication.replicator import ReplicationJob
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp

CODING = Coding(ErasureSpec(2, 1), (Group((0, 1, 2), (0, 1, 2), 2, 1),))
TWIN, OWN, META = 1 << 20, (64 << 10) + 3, 200  # bytes: the shared chunk, private, blob
OPT_AT = TWIN + 64
META_AT = align(OPT_AT + OWN)  # under ALIGN after the private chunk: one coded range
SIZE = META_AT + META


def _manifest(rank: int) -> SnapshotManifest:
    """A declared data-parallel chunk equal on every rank (``w``), a private one and a blob."""
    chunks = (
        ChunkRecord("w", "float32", (TWIN // 4,), (0,), (TWIN // 4,), 0, TWIN),
        ChunkRecord("opt", "uint8", (OWN,), (0,), (OWN,), OPT_AT, OWN, scope="rank"),
        ChunkRecord("__meta__", "uint8", (META,), (0,), (META,), META_AT, META),
    )
    return SnapshotManifest(rank, 7, 0, chunks, SIZE, extra={"twins": [0]})


def _snapshot(peer, rank: int) -> SnapshotManifest:
    """Rank ``rank``'s slot of step 7: ``w`` alike on every rank, the rest different."""
    slot = peer.store.ensure(SlotKind.OWN, 0, rank, 0, SIZE)
    view = np.frombuffer(slot.segment.view, dtype=np.uint8)
    view[:TWIN] = np.arange(TWIN, dtype=np.uint64).astype(np.uint8)
    view[TWIN:SIZE] = np.random.default_rng(rank).integers(0, 256, SIZE - TWIN, dtype=np.uint8)
    manifest = _manifest(rank)
    slot.manifest = manifest.with_checksums(slot.segment.view)
    return manifest


def _encode_all(peers, job, dedup: bool) -> dict[int, bytes]:
    name, secret = job
    originals, done, expected, encodings = {}, threading.Semaphore(0), 0, []
    for rank, peer in enumerate(peers):
        manifest = _snapshot(peer, rank)
        slot = peer.store.get(SlotKind.OWN, 0, rank, 0)
        assert slot is not None
        originals[rank] = bytes(slot.segment.view[:SIZE])
        absent = coded_absent(manifest, CODING, rank) if dedup else ()
        pieces = pieces_of(CODING, rank, manifest, absent)
        nodes = sorted({p.node for p in pieces})
        expected += len(nodes)
        encoding = Encoding(
            name, secret, lambda: 0, lambda: None, lambda j, n, e: done.release() if not e else None
        )
        with slot.lock:
            rjob = ReplicationJob.start(0, slot, manifest, nodes)
        rjob.coded, rjob.absent = True, absent
        encoding.submit(rjob, pieces, {p.node: p.server.address for p in peers})
        encodings.append(encoding)
    try:
        for _ in range(expected):
            assert done.acquire(timeout=30), "a piece was never acknowledged"
    finally:
        for encoding in encodings:
            encoding.stop()
    return originals


def _chunks(data: bytes | memoryview) -> list[bytes]:
    """The bytes of every chunk (the padding between them is no one's)."""
    return [bytes(data[c.byte_offset : c.byte_offset + c.nbytes]) for c in _manifest(0).chunks]


def _parity_bytes(peers) -> int:
    total = 0
    for peer in peers:
        for key in peer.server.parity.held_keys():
            buf = peer.server.parity.find(key, 7)
            total += buf.filled if buf is not None else 0
    return total


def _connect(peers, job):
    name, secret = job
    return lambda node: connect_tcp(peers[node].server.address, secret, name)


RESTORE = {"coding": CODING.to_msg(), "holders": {0: 0, 2: 2}, "twins": {1: [0, 2]}}


def test_pieces_leave_out_what_twins_hold_and_parity_shrinks(peers, job) -> None:
    _encode_all(peers, job, dedup=False)
    whole = _parity_bytes(peers)
    for peer in peers:
        peer.server.parity.release_where(lambda key: True)
    _encode_all(peers, job, dedup=True)
    coded = _parity_bytes(peers)
    # Three stripes of 2+1, each parity as long as its longest piece: half a rank's coded bytes.
    assert _manifest(0).without((0,)).byte_ranges() == [(OPT_AT, SIZE)]
    rest = SIZE - OPT_AT  # the private chunk and the blob, with the padding between
    assert whole == 3 * ((SIZE + 1) // 2)
    assert coded == 3 * ((rest + 1) // 2) and coded < 0.1 * whole


def test_a_lost_rank_is_decoded_and_its_twin_chunks_read_from_a_twin(peers, job) -> None:
    originals = _encode_all(peers, job, dedup=True)
    assert twin_sources(RESTORE, 1, {0, 2}, node=2) == [[2, 2], [0, 0]]  # its own node first
    # Rebuilt on node 2: the twin chunk is read from rank 2's slot there.
    got = rebuild(
        peers[2].store, 0, 0, 1, 7, RESTORE, {0, 2}, _connect(peers, job), index=1, node=2
    )
    assert _chunks(got.slot.segment.view) == _chunks(originals[1])
    assert got.slot.manifest is not None and got.slot.manifest.absent == ()
    # Per piece a parity and a data piece of half the coded bytes, plus the twin's chunk.
    assert sum(got.pulled.values()) <= TWIN + 2 * (SIZE - OPT_AT) + 4
    # Rebuilt on a node without a twin: the chunk comes from the first twin's node.
    got = rebuild(
        peers[1].store, 0, 0, 1, 7, RESTORE, {0, 2}, _connect(peers, job), index=1, node=1
    )
    assert _chunks(got.slot.segment.view) == _chunks(originals[1])


def test_a_rank_whose_twins_are_all_lost_is_not_restored(peers, job) -> None:
    _encode_all(peers, job, dedup=True)
    restore = {**RESTORE, "twins": {1: []}}
    with pytest.raises(PeerUnavailable, match="could be read from no twin"):
        rebuild(peers[0].store, 0, 0, 1, 7, restore, {0, 2}, _connect(peers, job), 1, node=0)
    assert peers[0].store.find(0, 1, 7) is None  # nothing incomplete is taken for the rank


def test_a_rank_recoded_whole_for_the_same_step_is_rebuilt_without_twins(peers, job) -> None:
    """Rank 1 was coded without its twin chunks; its pieces are taken out of the parity
    (the same bytes folded again) and it is coded anew, whole, as ``Mirroring`` does when the
    coordinator finds its twins differ: then it rebuilds with no twin at all, and rank 0,
    still coded without them, rebuilds beside it from the same stripes."""
    originals = _encode_all(peers, job, dedup=True)
    name, secret = job
    slot = peers[1].store.get(SlotKind.OWN, 0, 1, 0)
    assert slot is not None and slot.manifest is not None
    before = coded_absent(slot.manifest, CODING, 1)
    old = pieces_of(CODING, 1, slot.manifest, before)
    new = pieces_of(CODING, 1, slot.manifest)
    pieces = [p for o, n in zip(old, new, strict=True) for p in (replace(o, unfold=True), n)]
    done = threading.Semaphore(0)
    encoding = Encoding(name, secret, lambda: 0, lambda: None, lambda j, n, e: done.release())
    rjob = ReplicationJob(0, slot, slot.manifest, sorted({p.node for p in new}), coded=True)
    try:
        encoding.submit(rjob, pieces, {p.node: p.server.address for p in peers})
        for _ in rjob.buddies:
            assert done.acquire(timeout=30), "a piece was never acknowledged"
    finally:
        encoding.stop()
    assert rjob.failed is False
    connect = _connect(peers, job)
    restore = {"coding": CODING.to_msg(), "holders": {0: 0, 2: 2}}  # no twin to read from
    got = rebuild(peers[0].store, 0, 0, 1, 7, restore, {0, 2}, connect, index=1, node=0)
    assert _chunks(got.slot.segment.view) == _chunks(originals[1])
    restore = {"coding": CODING.to_msg(), "holders": {1: 1, 2: 2}, "twins": {0: [1, 2]}}
    got = rebuild(peers[2].store, 0, 0, 0, 7, restore, {1, 2}, connect, index=1, node=2)
    assert _chunks(got.slot.segment.view) == _chunks(originals[0])
