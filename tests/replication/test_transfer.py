"""Pushing replicas and pulling snapshots: checksums decide what may be restored from."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from peerckpt.errors import ChecksumMismatch, ProtocolError, RecoveryFailed, StaleEpoch
from peerckpt.messages.data import Data, Push, Ready
from peerckpt.replication.obtain import obtain_committed
from peerckpt.replication.replicator import BuddySender, ReplicationJob
from peerckpt.replication.transfer import Cancelled, fetch, push, send_bytes
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp, raise_if_error

from .conftest import write_snapshot


def _connect(peers, job):
    name, secret = job
    return lambda node: connect_tcp(peers[node].server.address, secret, name)


def test_push_stores_a_verified_replica_byte_for_byte(peers, job) -> None:
    slot = write_snapshot(peers[0].store, rank=5, step=7)
    conn = _connect(peers, job)(1)
    push(conn, 0, 0, 5, None, slot.manifest, slot.segment.view)
    conn.close()
    replica = peers[1].store.find(0, 5, 7)
    assert replica is not None and replica.kind is SlotKind.REPLICA
    used = slot.manifest.used_bytes
    assert bytes(replica.segment.view[:used]) == bytes(slot.segment.view[:used])


def test_a_replica_that_arrives_corrupted_is_refused_and_never_readable(peers, job) -> None:
    slot = write_snapshot(peers[0].store, rank=5, step=7)
    manifest = slot.manifest
    slot.segment.view[10] ^= 0xFF  # the bytes no longer match the manifest's checksum
    conn = _connect(peers, job)(1)
    with pytest.raises(ChecksumMismatch, match="fails verification"):
        push(conn, 0, 0, 5, None, manifest, slot.segment.view)
    conn.close()
    assert peers[1].store.find(0, 5, 7) is None


def test_a_push_from_an_older_epoch_is_fenced_off(peers, job) -> None:
    slot = write_snapshot(peers[0].store, rank=1, step=2)
    peers[1].epoch = 3
    conn = _connect(peers, job)(1)
    with pytest.raises(StaleEpoch, match="epoch 0 after epoch 3"):
        push(conn, 0, 0, 1, None, slot.manifest, slot.segment.view)
    conn.close()
    assert peers[1].store.find(0, 1, 2) is None


def test_recovery_pulls_from_a_peer_and_verifies(peers, job) -> None:
    original = write_snapshot(peers[0].store, rank=2, step=9)
    got = obtain_committed(
        peers[2].store, 2, 1, 0, rank=2, step=9, sources=[0], connect=_connect(peers, job)
    )
    assert got.source == 0 and got.nbytes == original.manifest.used_bytes
    used = original.manifest.used_bytes
    assert bytes(got.slot.segment.view[:used]) == bytes(original.segment.view[:used])
    assert peers[2].store.find(0, 2, 9) is got.slot


def test_a_corrupted_replica_is_never_restored_from_another_copy_is_used(peers, job) -> None:
    source = write_snapshot(peers[0].store, rank=3, step=4)
    conn = _connect(peers, job)(1)
    push(conn, 0, 0, 3, None, source.manifest, source.segment.view)
    conn.close()
    peers[1].store.find(0, 3, 4).segment.view[12345] ^= 0x01  # bit rot in node 1's replica
    got = obtain_committed(
        peers[2].store, 2, 1, 0, rank=3, step=4, sources=[1, 0], connect=_connect(peers, job)
    )
    assert got.source == 0  # node 1 was tried first and refused
    used = source.manifest.used_bytes
    assert bytes(got.slot.segment.view[:used]) == bytes(source.segment.view[:used])


def test_a_corrupted_local_slot_falls_back_to_a_peer(peers, job) -> None:
    local = write_snapshot(peers[0].store, rank=0, step=6)
    conn = _connect(peers, job)(1)
    push(conn, 0, 0, 0, None, local.manifest, local.segment.view)
    conn.close()
    expected = bytes(local.segment.view[: local.manifest.used_bytes])
    local.segment.view[0] ^= 0x80
    got = obtain_committed(
        peers[0].store, 0, 1, 0, rank=0, step=6, sources=[0, 1], connect=_connect(peers, job)
    )
    assert got.source == 1
    assert bytes(got.slot.segment.view[: got.manifest.used_bytes]) == expected
    assert got.manifest.bad_chunks(got.slot.segment.view) == []  # repaired from the peer


def test_when_every_copy_is_bad_recovery_fails_naming_each_source(peers, job) -> None:
    local = write_snapshot(peers[0].store, rank=0, step=6)
    conn = _connect(peers, job)(1)
    push(conn, 0, 0, 0, None, local.manifest, local.segment.view)
    conn.close()
    local.segment.view[0] ^= 0x80
    peers[1].store.find(0, 0, 6).segment.view[0] ^= 0x80
    with pytest.raises(
        RecoveryFailed, match=r"node 0: .*fails verification.*node 1: .*fails verification"
    ) as failed:
        obtain_committed(
            peers[2].store, 2, 1, 0, rank=0, step=6, sources=[0, 1], connect=_connect(peers, job)
        )
    assert not failed.value.unreachable  # every source answered: nothing to wait for


def test_a_source_that_does_not_answer_marks_the_failure_unreachable(peers, job) -> None:
    """Its node may be dying: the coordinator waits for that loss before failing the job."""
    write_snapshot(peers[0].store, rank=0, step=6)
    closed = _connect(peers, job)
    peers[1].server.stop()
    with pytest.raises(RecoveryFailed, match=r"node 1: ") as failed:
        obtain_committed(peers[2].store, 2, 1, 0, rank=0, step=6, sources=[1], connect=closed)
    assert failed.value.unreachable


def _push_step(peers, job, rank: int, step: int, committed: int | None) -> None:
    slot = write_snapshot(peers[0].store, rank=rank, step=step, index=step % 2, size=1 << 20)
    conn = _connect(peers, job)(1)
    push(conn, 0, 0, rank, committed, slot.manifest, slot.segment.view)
    conn.close()


def test_a_push_never_overwrites_the_buddys_copy_of_the_committed_step(peers, job) -> None:
    _push_step(peers, job, rank=2, step=10, committed=9)
    _push_step(peers, job, rank=2, step=11, committed=10)
    # Step 11 committed; the buddy has not heard of it yet, but the sender says so.
    _push_step(peers, job, rank=2, step=12, committed=11)
    store = peers[1].store
    assert store.find(0, 2, 11) is not None and store.find(0, 2, 12) is not None
    assert store.find(0, 2, 10) is None  # the older copy made room


def test_after_a_restore_the_committed_replica_survives_the_first_push(peers, job) -> None:
    """A replacement restarts its slot numbering; the buddy must not trust the sender's slot.

    The buddy holds steps 10 and 11 of rank 3; 11 is committed. The replacement's first push
    (step 12) comes from its own slot 1, which names the buddy's copy of 11.
    """
    _push_step(peers, job, rank=3, step=10, committed=9)
    _push_step(peers, job, rank=3, step=11, committed=10)
    peers[1].committed = 11
    slot = write_snapshot(peers[0].store, rank=3, step=12, index=1, size=1 << 20)
    conn = _connect(peers, job)(1)
    push(conn, 0, 0, 3, None, slot.manifest, slot.segment.view)
    conn.close()
    assert peers[1].store.find(0, 3, 11) is not None


def test_a_fetch_from_an_older_epoch_is_fenced_off(peers, job) -> None:
    write_snapshot(peers[0].store, rank=1, step=2)
    peers[0].epoch = 4
    conn = _connect(peers, job)(0)
    with pytest.raises(StaleEpoch, match="fetch of epoch 3 after epoch 4"):
        fetch(conn, 3, 0, 1, 2, lambda m: memoryview(bytearray(m.used_bytes)))
    conn.close()


def test_pulling_the_same_step_twice_reuses_its_slot(peers, job) -> None:
    # A recovery superseded after its pull pulls again; the step must not end up in both
    # own slots, or the rank's next snapshot would be refused its only free slot.
    write_snapshot(peers[0].store, rank=1, step=7)
    first = obtain_committed(
        peers[2].store, 2, 1, 0, rank=1, step=7, sources=[0], connect=_connect(peers, job)
    )
    second = obtain_committed(
        peers[2].store, 2, 2, 0, rank=1, step=7, sources=[0], connect=_connect(peers, job)
    )
    assert second.slot.index == first.slot.index
    other = peers[2].store.get(SlotKind.OWN, 0, 1, 1 - first.slot.index)
    assert other is None or other.step != 7


def _start_push(peers, job, slot):
    conn = _connect(peers, job)(1)
    conn.send_msg(Push(0, 0, slot.rank, None, slot.manifest))
    conn.recv_msg(Ready)
    return conn


def test_data_frames_out_of_order_are_refused(peers, job) -> None:
    slot = write_snapshot(peers[0].store, rank=4, step=3)
    conn = _start_push(peers, job, slot)
    view = slot.segment.view
    conn.send_msg(Data(4096), view[4096:8192])  # a gap before it
    with pytest.raises(ProtocolError, match="expected 0"):
        raise_if_error(conn.recv_message()[0], conn.peer)
    conn.close()
    assert peers[1].store.find(0, 4, 3) is None


def test_a_push_ending_without_its_checksums_is_refused(peers, job) -> None:
    slot = write_snapshot(peers[0].store, rank=4, step=3)
    conn = _start_push(peers, job, slot)
    send_bytes(conn, slot.segment.view, slot.manifest.used_bytes)  # an end frame without crcs
    with pytest.raises(ProtocolError, match="without a checksum per chunk"):
        raise_if_error(conn.recv_message()[0], conn.peer)
    conn.close()
    assert peers[1].store.find(0, 4, 3) is None


def _replicate(peers, job, replication: ReplicationJob) -> BaseException | None:
    """Push ``replication`` to node 1 with the agent's BuddySender; the push's outcome."""
    done: list[BaseException | None] = []
    finished = threading.Event()
    name, secret = job
    sender = BuddySender(
        1,
        peers[1].server.address,
        secret,
        name,
        lambda: 0,
        lambda: None,
        lambda _job, _node, error: (done.append(error), finished.set()),
    )
    try:
        sender.put(replication)
        assert finished.wait(30)
    finally:
        sender.stop()
    return done[0]


def test_checksums_computed_during_the_push_make_the_slot_readable(peers, job) -> None:
    """The agent's path: checksums start with the push; both ends agree, the slot is whole."""
    slot = write_snapshot(peers[0].store, rank=6, step=8)
    manifest = replace(
        slot.manifest, chunks=tuple(replace(c, crc=None) for c in slot.manifest.chunks)
    )
    expected = slot.manifest
    with slot.lock:
        replication = ReplicationJob.start(0, slot, manifest, [1])
        assert slot.manifest is None  # not readable until its checksums are known
    assert _replicate(peers, job, replication) is None
    assert slot.manifest == expected and replication.checksummed() == expected
    replica = peers[1].store.find(0, 6, 8)
    assert replica is not None and replica.manifest == expected


def test_a_slot_rewritten_before_its_push_is_not_sent(peers, job) -> None:
    slot = write_snapshot(peers[0].store, rank=6, step=8)
    with slot.lock:
        replication = ReplicationJob.start(0, slot, slot.manifest, [1])
        slot.invalidate()  # the rank writes its slot again (checksums cancelled)
    assert isinstance(_replicate(peers, job, replication), Cancelled)
    assert peers[1].store.find(0, 6, 8) is None
