"""Erasure coding between in-process agents: pieces folded into parity, a rank rebuilt."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from peerckpt.coding import Coding, ErasureSpec, Group
from peerckpt.errors import ChecksumMismatch, RecoveryFailed
from peerckpt.manifest import SnapshotManifest
from peerckpt.replication.decoding import rebuild
from peerckpt.replication.encoding import Encoding, pieces_of
from peerckpt.replication.replicator import ReplicationJob
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp

from .conftest import write_snapshot

SIZES = {0: 3 << 20, 1: (2 << 20) + 5, 2: (1 << 20) + 3}  # unequal: pieces zero-padded
CODING = Coding(ErasureSpec(2, 1), (Group((0, 1, 2), (0, 1, 2), 2, 1),))


def _encode_all(peers, job) -> dict[int, bytes]:
    """Each node's rank writes a snapshot of step 7 and sends its pieces; wait for acks."""
    name, secret = job
    originals: dict[int, bytes] = {}
    done = threading.Semaphore(0)
    expected = 0
    encodings = []
    for rank, size in SIZES.items():
        slot = write_snapshot(peers[rank].store, rank=rank, step=7, size=size)
        view = np.frombuffer(slot.segment.view, dtype=np.uint8)
        view[:size] ^= np.uint8(rank * 37 + 1)  # every rank's bytes differ
        manifest = slot.manifest
        assert manifest is not None
        manifest = manifest.with_checksums(slot.segment.view)
        originals[rank] = bytes(slot.segment.view[:size])
        encoding = Encoding(
            name,
            secret,
            lambda: 0,
            lambda: None,
            lambda j, n, e: done.release() if e is None else None,
        )
        pieces = pieces_of(CODING, rank, manifest)
        nodes = sorted({p.node for p in pieces})
        expected += len(nodes)
        with slot.lock:
            rjob = ReplicationJob.start(0, slot, manifest, nodes)
        addrs = {p.node: p.server.address for p in peers}
        encoding.submit(rjob, pieces, addrs)
        encodings.append(encoding)
    try:
        for _ in range(expected):
            assert done.acquire(timeout=30), "a piece was never acknowledged"
    finally:
        for encoding in encodings:
            encoding.stop()
    return originals


def _restore(peers) -> dict[str, object]:
    return {"coding": CODING.to_msg(), "holders": {0: 0, 2: 2}}


def test_a_lost_rank_is_rebuilt_bit_for_bit_from_its_groups_pieces(peers, job) -> None:
    originals = _encode_all(peers, job)
    name, secret = job
    connect = lambda node: connect_tcp(peers[node].server.address, secret, name)  # noqa: E731
    got = rebuild(peers[0].store, 0, 0, 1, 7, _restore(peers), {0, 2}, connect, index=1)
    assert got.slot.kind is SlotKind.OWN and got.slot.rank == 1
    assert bytes(got.slot.segment.view[: SIZES[1]]) == originals[1]
    assert isinstance(got.slot.manifest, SnapshotManifest) and got.slot.manifest.step == 7
    assert sum(got.pulled.values()) > 0 and 1 not in got.pulled  # node 1 is gone


def test_a_corrupted_parity_is_detected_and_never_decoded_from(peers, job) -> None:
    _encode_all(peers, job)
    # Every parity buffer of step 7 on node 0 gets a flipped byte, as memory damage would.
    for key in peers[0].server.parity.held_keys():
        buf = peers[0].server.parity.find(key, 7)
        if buf is not None and buf.segment is not None:
            buf.segment.view[0] ^= 0xFF
    name, secret = job
    connect = lambda node: connect_tcp(peers[node].server.address, secret, name)  # noqa: E731
    # Rank 1's stripes: one has its parity on node 0, which is now damaged.
    with pytest.raises(ChecksumMismatch, match="held by node 0 fails its crc32c"):
        rebuild(peers[2].store, 0, 0, 1, 7, _restore(peers), {0, 2}, connect, index=1)
    assert peers[2].store.find(0, 1, 7) is None


def test_a_rank_whose_group_lost_more_than_m_names_the_loss(peers, job) -> None:
    _encode_all(peers, job)
    name, secret = job
    connect = lambda node: connect_tcp(peers[node].server.address, secret, name)  # noqa: E731
    restore = {"coding": CODING.to_msg(), "holders": {0: 0}}
    with pytest.raises(RecoveryFailed, match="more than 1 of its group's nodes were lost"):
        rebuild(peers[0].store, 0, 0, 1, 7, restore, {0}, connect, index=1)


def test_a_retried_piece_is_not_folded_twice(peers, job) -> None:
    """Folding the same piece again (a push retried after its ack was lost) changes nothing."""
    _encode_all(peers, job)
    store = peers[0].server.parity
    [key] = [k for k in store.held_keys() if store.find(k, 7) is not None][:1]
    buf = store.find(key, 7)
    assert buf is not None and buf.segment is not None
    before = bytes(buf.segment.view[: buf.filled])
    piece = next(iter(buf.got))
    rank = next(iter(buf.manifests))
    junk = np.full(buf.filled, 0x5A, dtype=np.uint8)
    store.fold(key, 7, None, buf.k, piece, 1, rank, junk, buf.manifests[rank])
    assert bytes(buf.segment.view[: buf.filled]) == before
