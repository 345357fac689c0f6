"""The durable format: written by several writers, committed atomically, read back verified."""

from __future__ import annotations

import contextlib
import mmap
import random
import secrets
from collections.abc import Iterator

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.persist.durable import (
    DurableStore,
    HeldBytesChanged,
    assign_writers,
    step_dir_name,
    unique_key,
)


def _record(key: str, data: bytes, offsets=(0,), scope="global", shape=None) -> ChunkRecord:
    n = len(data)
    return ChunkRecord(key, "uint8", shape or (n,), offsets, (n,), 0, n, crc32c.crc32c(data), scope)


def _world(step: int) -> tuple[dict[int, list[ChunkRecord]], dict[tuple, bytes]]:
    """Three data-parallel ranks: a replicated weight, a weight sharded in two, private blobs."""
    weight = bytes((i * 3 + step) % 256 for i in range(5000))
    shards = [bytes((i + 7 * r + step) % 256 for i in range(3000)) for r in range(2)]
    layouts: dict[int, list[ChunkRecord]] = {}
    data: dict[tuple, bytes] = {}
    for rank in range(3):
        blob = f"rank {rank} step {step}".encode()
        shard = shards[rank % 2]
        records = [
            _record("model/w", weight),
            _record("model/s", shard, offsets=(3000 * (rank % 2),), shape=(6000,)),
            _record(META_KEY, blob, scope="rank"),
        ]
        layouts[rank] = records
        for record, raw in zip(records, [weight, shard, blob], strict=True):
            data[unique_key(rank, record)] = raw
    return layouts, data


def _write(store: DurableStore, step: int, keep: int | None = None, skip_node: int | None = None):
    layouts, data = _world(step)
    holders = {0: {0}, 1: {1}, 2: {0, 1}}
    plan = assign_writers(layouts, holders)
    for node, items in sorted(plan.items()):
        if node == skip_node:
            continue
        store.write_part(
            step, node, [(rank, rec, data[unique_key(rank, rec)]) for rank, rec in items]
        )
    return store.commit(step, epoch=1, layouts=layouts, keep=keep), layouts, data


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path) -> Iterator[DurableStore]:
    if request.param == "memory":
        url = f"memory://peerckpt-test-{secrets.token_hex(4)}/ckpt"
    else:
        url = f"file://{tmp_path}/ckpt"
    s = DurableStore(url)
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


def test_a_step_round_trips_each_unique_chunk_written_once(store) -> None:
    _, layouts, data = _write(store, step=10)
    assert store.latest_step() == 10
    ckpt = store.open()
    assert ckpt.step == 10 and ckpt.manifest.world_size == 3
    for rank, records in layouts.items():
        got = {(c.record.key, c.record.offsets): ckpt.read(c) for c in ckpt.chunks(rank)}
        for record in records:
            assert got[(record.key, record.offsets)] == data[unique_key(rank, record)]
    # 1 replicated weight + 2 shards + 3 private blobs, each stored once
    assert len(ckpt.manifest.unique_chunks()) == 6
    assert ckpt.manifest.nbytes() == 5000 + 6000 + sum(len(f"rank {r} step 10") for r in range(3))
    assert ckpt.verify() == []
    assert ckpt.meta(2) == b"rank 2 step 10"


def test_a_step_missing_a_writer_is_never_committed(store) -> None:
    _write(store, step=1)
    with pytest.raises(CheckpointError, match=r"step 2 cannot be committed: .* not written"):
        _write(store, step=2, skip_node=1)
    assert store.latest_step() == 1 and store.committed_steps() == [1]
    with pytest.raises(NoCheckpoint, match=r"step 2 .* is not committed"):
        store.open(2)


def test_a_write_killed_before_the_marker_leaves_the_previous_step_visible(store) -> None:
    _write(store, step=1)
    _write(store, step=2)
    store.fs.rm(store.step_path(2, "COMMITTED"))  # killed after the manifest, before the marker
    store.fs.pipe_file(store.root + "/latest", b"2")  # even a stale pointer does not help it
    assert store.latest_step() == 1
    assert store.open().step == 1
    # A marker that names another manifest does not commit this one either.
    store.fs.pipe_file(
        store.step_path(2, "COMMITTED"), store.fs.cat_file(store.step_path(1, "COMMITTED"))
    )
    assert store.committed_steps() == [1]


def test_a_corrupted_data_file_is_named_and_refused(store) -> None:
    _write(store, step=3)
    ckpt = store.open()
    victim = next(c for c in ckpt.chunks(0) if c.record.key == "model/w")
    path = store.step_path(3, victim.file)
    raw = bytearray(store.fs.cat_file(path))
    raw[victim.record.byte_offset + 17] ^= 0x40
    store.fs.pipe_file(path, bytes(raw))
    with pytest.raises(
        CorruptCheckpoint, match=r"'model/w' of step 3 fails verification in .*data-n"
    ):
        ckpt.read(victim)
    problems = ckpt.verify()
    assert len(problems) == 1 and "model/w" in problems[0]


def test_a_corrupt_copy_in_memory_is_never_written(store) -> None:
    layouts, data = _world(5)
    record = layouts[0][0]
    bad = bytearray(data[unique_key(0, record)])
    bad[0] ^= 1
    with pytest.raises(CorruptCheckpoint, match="fails its checksum in memory"):
        store.write_part(5, 0, [(0, record, bytes(bad))])
    assert store.committed_steps() == []


def test_retention_keeps_the_newest_committed_steps_only_after_a_newer_commit(store) -> None:
    for step in (1, 2, 3):
        _write(store, step=step, keep=2)
    assert store.committed_steps() == [2, 3]
    with pytest.raises(CheckpointError):
        _write(store, step=4, skip_node=0, keep=2)  # a failed flush deletes nothing
    assert store.committed_steps() == [2, 3] and 4 in store.all_steps()
    _write(store, step=5, keep=2)
    assert store.committed_steps() == [3, 5]
    assert store.all_steps() == [3, 5]  # the never-committed step 4 went with the commit of 5


def test_writers_are_balanced_and_each_chunk_comes_from_a_holder() -> None:
    layouts = {r: [_record(f"k{i}", bytes(100 * (i + 1))) for i in range(6)] for r in range(4)}
    plan = assign_writers(layouts, {r: {0, 1, 2} for r in range(4)})
    written = [rec.key for items in plan.values() for _, rec in items]
    assert sorted(written) == sorted(f"k{i}" for i in range(6))  # replicas written once
    loads = sorted(sum(rec.nbytes for _, rec in items) for items in plan.values())
    assert loads == [700, 700, 700]


@given(
    st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=5), min_size=1, max_size=5),
    st.data(),
)
@settings(max_examples=100, deadline=None)
def test_every_unique_chunk_is_assigned_once_to_a_holder(sizes, data) -> None:
    layouts = {
        rank: [
            _record(f"p{i}", bytes(n), scope="rank" if i == 0 else "global")
            for i, n in enumerate(ns)
        ]
        for rank, ns in enumerate(sizes)
    }
    holders = {
        rank: set(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
        for rank in layouts
    }
    plan = assign_writers(layouts, holders)
    seen = [
        (node, unique_key(rank, rec), rank) for node, items in plan.items() for rank, rec in items
    ]
    keys = [k for _, k, _ in seen]
    assert len(keys) == len(set(keys))
    expected = {unique_key(rank, rec) for rank, recs in layouts.items() for rec in recs}
    assert set(keys) == expected
    for node, key, rank in seen:
        # The writer reads the copy of a rank it holds (a DDP parameter is in every rank's
        # snapshot, but a node holds only some ranks' snapshots).
        assert node in holders[rank], f"node {node} writes {key} from rank {rank}, not held"
        assert key in {unique_key(rank, x) for x in layouts[rank]}


def test_a_chunk_nobody_holds_is_named() -> None:
    with pytest.raises(CheckpointError, match="no holder"):
        assign_writers({0: [_record("w", b"abc")]}, {0: set()})


def test_inspect_lists_steps_and_tensors_and_verify_finds_damage(tmp_path, capsys) -> None:
    from peerckpt.launch.cli import main

    store = DurableStore(str(tmp_path / "ckpt"))
    _write(store, step=7)
    _write(store, step=8)
    assert main(["inspect", str(tmp_path / "ckpt"), "--verify", "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "committed steps [7, 8]" in out and "step 8 (epoch 1, 3 ranks)" in out
    assert "model/s" in out and "uint8 [6000]" in out and "all checksums match" in out
    victim = next(c for c in store.open(8).chunks(1) if c.record.key == "model/s")
    path = store.step_path(8, victim.file)
    raw = bytearray(store.fs.cat_file(path))
    raw[victim.record.byte_offset] ^= 0xFF
    store.fs.pipe_file(path, bytes(raw))
    assert main(["inspect", str(tmp_path / "ckpt"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "verification FAILED for 1 of 6 chunk(s)" in out and "'model/s' of step 8" in out
    assert main(["inspect", str(tmp_path / "ckpt"), "--step", "7", "--verify"]) == 0


def test_inspect_summarizes_by_default_and_lists_tensors_when_asked(tmp_path, capsys) -> None:
    from peerckpt.launch.cli import main

    store = DurableStore(str(tmp_path / "ckpt"))
    _write(store, step=8)
    tensors = {c.record.key for r in store.open(8).manifest.ranks.values() for c in r}
    tensors.discard(META_KEY)
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    summary = capsys.readouterr().out
    assert f"tensors: {len(tensors)} in " in summary and "verified: no" in summary
    assert not any(key in summary for key in tensors), "the summary lists no tensor"
    assert main(["inspect", str(tmp_path / "ckpt"), "--tensors"]) == 0
    listing = capsys.readouterr().out
    assert all(key in listing for key in tensors)
    assert len(listing.splitlines()) == len(summary.splitlines()) - 1 + len(tensors)


def test_the_persist_config_survives_its_message_form() -> None:
    from peerckpt.persist.config import PersistConfig

    config = PersistConfig("s3://b/x", 10, 30.0, 3, 1e8, allow_older=True)
    assert PersistConfig.from_msg(config.to_msg()) == config
    with pytest.raises(ValueError, match="persist_every"):
        PersistConfig("file:///x")


def test_direct_writes_of_odd_sizes_read_back_exactly(tmp_path) -> None:
    # Local data files are written with O_DIRECT in whole aligned blocks; pieces of any size,
    # and a tail that is not a whole block, must come back byte for byte.
    from peerckpt.persist.durable import _DirectFile, _sync

    rng = random.Random(3)
    pieces = [rng.randbytes(n) for n in (1, 4095, 4097, (8 << 20) + 3, 3 << 20, 12345)]
    path = str(tmp_path / "data.bin")
    direct = _DirectFile.open(path)
    if direct is None:
        pytest.skip("this file system refuses O_DIRECT (the buffered path is used there)")
    with direct as f:
        for piece in pieces:
            f.write(piece)
        _sync(f)
    assert (tmp_path / "data.bin").read_bytes() == b"".join(pieces)


class _Slot:
    """A page-aligned buffer of chunks, as an agent's slot is; ``rewrite_on`` rewrites it
    (as a rank reusing its slot does, without asking) when it is held that many times."""

    def __init__(self, sizes: list[int], rewrite_on: int | None = None) -> None:
        rng = random.Random(len(sizes))
        self.records, offset = [], 0
        for i, n in enumerate(sizes):
            offset = (offset + 63) // 64 * 64
            self.records.append((i, offset, n))
            offset += n
        self.buf = mmap.mmap(-1, offset + 64)
        self.view = memoryview(self.buf)
        self.view[:offset] = rng.randbytes(offset)
        self.records = [
            ChunkRecord(
                f"t{i}", "uint8", (n,), (0,), (n,), at, n, crc32c.crc32c(self.view[at : at + n])
            )
            for i, at, n in self.records
        ]
        self.original = bytes(self.view)
        self.holds, self.rewrite_on = 0, rewrite_on

    @contextlib.contextmanager
    def hold(self) -> Iterator[memoryview]:
        self.holds += 1
        if self.holds == self.rewrite_on:
            self.view[:] = bytes(len(self.view))
        yield self.view

    def close(self) -> None:
        self.view.release()
        self.buf.close()


SIZES = [100, (3 << 20) + 5, 4096, (1 << 20) - 1, (5 << 20) + 4097, 7]


def test_held_chunks_are_written_from_their_buffer_and_read_back_exactly(store) -> None:
    slot = _Slot(SIZES)
    try:
        layouts = {0: slot.records}
        store.write_part(3, 0, [(0, r, slot) for r in slot.records])
        store.commit(3, epoch=1, layouts=layouts)
        ckpt = store.open(3)
        assert ckpt.verify() == []
        for stored, record in zip(ckpt.chunks(0), slot.records, strict=True):
            start = record.byte_offset
            assert ckpt.read(stored) == slot.original[start : start + record.nbytes]
    finally:
        slot.close()


def test_a_held_chunk_rewritten_while_it_is_written_is_never_committed(tmp_path) -> None:
    store = DurableStore(f"file://{tmp_path}/ckpt")
    slot = _Slot(SIZES, rewrite_on=4)  # during the second chunk's write
    try:
        with pytest.raises(HeldBytesChanged, match="'t1' of rank 0 no longer matches"):
            store.write_part(3, 0, [(0, r, slot) for r in slot.records])
        assert not (tmp_path / "ckpt" / step_dir_name(3) / "part-n0.msgpack").exists()
        with pytest.raises(CheckpointError):
            store.commit(3, epoch=1, layouts={0: slot.records})
        assert store.committed_steps() == []
    finally:
        slot.close()
