"""``assemble``: a rank's state in a new layout, gathered from pieces of old snapshots held on
its own node and on peers (``fetch_boxes``), checked piece by piece."""

from __future__ import annotations

import numpy as np
import pytest

from peerckpt.boxes import Box
from peerckpt.errors import RecoveryFailed
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.reads import Read
from peerckpt.replication.gather import GatherJob, assemble
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp

# A float32 tensor "t" of 8 × 4, cut by rows between two old ranks (Shard(0)).
FULL = np.arange(32, dtype=np.float32).reshape(8, 4)
STEP, OLD_GEN = 5, 0


def _hold(peer, rank: int) -> None:
    """Old rank ``rank``'s snapshot of STEP (rows 4·rank … 4·rank+3) in ``peer``'s memory."""
    rows = FULL[4 * rank : 4 * rank + 4]
    chunk = ChunkRecord("t", "float32", (8, 4), (4 * rank, 0), (4, 4), 0, rows.nbytes)
    slot = peer.store.ensure(SlotKind.OWN, OLD_GEN, rank, 0, rows.nbytes)
    slot.segment.view[: rows.nbytes] = rows.tobytes()
    manifest = SnapshotManifest(rank, STEP, 0, (chunk,), rows.nbytes)
    slot.manifest = manifest.with_checksums(slot.segment.view)


def _job(node: int, reads: list[Read]) -> GatherJob:
    # New rank 0 wants columns 0-1 of every row (Shard(1) over two ranks).
    wanted = [ChunkRecord("t", "float32", (8, 4), (0, 0), (8, 2), 0, 0)]
    return GatherJob(node, 1, 1, 0, 0, OLD_GEN, STEP, wanted, reads)


def _read(node: int, rank: int) -> Read:
    src = Box((4 * rank, 0), (4, 4))
    region = Box((4 * rank, 0), (4, 2))
    return Read(node, rank, "t", src, Box((0, 0), (8, 2)), region, 4 * 2 * 4)


def _connect(peers, job):
    name, secret = job
    return lambda node: connect_tcp(peers[node].server.address, secret, name)


def test_pieces_from_the_own_node_and_a_peer_land_in_place(peers, job) -> None:
    _hold(peers[0], 0)  # a peer holds old rank 0
    _hold(peers[1], 1)  # this node (1) holds old rank 1
    got = assemble(peers[1].store, _job(1, [_read(0, 0), _read(1, 1)]), _connect(peers, job))
    assert got.pulled == {0: 32} and got.local_bytes == 32
    [chunk] = got.manifest.chunks
    staged = np.frombuffer(
        got.slot.segment.view[chunk.byte_offset : chunk.byte_offset + chunk.nbytes],
        dtype=np.float32,
    ).reshape(8, 2)
    assert np.array_equal(staged, FULL[:, :2])
    assert got.slot.kind is SlotKind.STAGING and got.manifest.rank == 0


def test_a_damaged_source_fails_the_gather_naming_it_and_keeps_nothing(peers, job) -> None:
    _hold(peers[0], 0)
    _hold(peers[1], 1)
    held = peers[0].store.find(OLD_GEN, 0, STEP)
    held.segment.view[3] ^= 0xFF  # flip a byte of old rank 0's copy on node 0
    with pytest.raises(RecoveryFailed, match=r"node 0: .*fails its checksum"):
        assemble(peers[1].store, _job(1, [_read(0, 0), _read(1, 1)]), _connect(peers, job))
    assert not [s for s in peers[1].store.all() if s.kind is SlotKind.STAGING]


def test_a_read_the_rank_did_not_ask_for_is_refused(peers, job) -> None:
    _hold(peers[1], 1)
    stray = Read(1, 1, "other", Box((4, 0), (4, 4)), Box((0, 0), (8, 2)), Box((4, 0), (4, 2)), 32)
    with pytest.raises(RecoveryFailed, match="did not ask for"):
        assemble(peers[1].store, _job(1, [stray]), _connect(peers, job))
