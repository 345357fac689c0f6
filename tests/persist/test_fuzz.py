"""Fuzzing the durable format's decoders and the read paths behind them.

Any manifest — random values, a valid one with fields changed, random or damaged bytes —
committed with a matching marker (so that only its content is wrong) must end in a checkpoint
read as written, or in ``CheckpointError``: never another exception, a hang, or an allocation
larger than the checkpoint's files. The readers run on it are those of every user of the
format: ``slot_image`` (restore), ``full_tensors`` (export) and ``PeerckptReader`` (dcp.load).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

import crc32c
import pytest
from hypothesis import strategies as st

from peerckpt.codec import pack, unpack
from peerckpt.errors import CheckpointError, CorruptCheckpoint
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.persist.durable import DurableStore, _unpack
from peerckpt.persist.format import DATA_FILE, DurableManifest, decode_part
from peerckpt.persist.interop import PeerckptReader, full_tensors

from ..fuzz import check_bounded, fuzz, mutations, values

STEP = 3


def _chunks(rank: int) -> list[tuple[ChunkRecord, bytes]]:
    w = bytes(range(96))  # a (4, 6) float32 box is 96 bytes
    blob = f"rank {rank}".encode()
    n = len(blob)
    return [
        (ChunkRecord("m/w", "float32", (8, 6), (4 * rank, 0), (4, 6), 0, 96, crc32c.crc32c(w)), w),
        (ChunkRecord(META_KEY, "uint8", (n,), (0,), (n,), 0, n, crc32c.crc32c(blob), "rank"), blob),
    ]


@functools.cache
def _store() -> DurableStore:
    """One local root with a committed step of two ranks, shared by every example (each
    example rewrites only its manifest and marker)."""
    root = tempfile.mkdtemp(prefix="peerckpt-fuzz-store-")
    store = DurableStore(root)
    layouts = {}
    for rank in (0, 1):
        pieces = [(rank, record, data) for record, data in _chunks(rank)]
        store.write_part(STEP, rank, pieces)
        layouts[rank] = [r for _, r, _ in pieces]
    store.commit(STEP, epoch=1, layouts=layouts)
    # Once through every reader: what they allocate the first time (imports, torch's caches)
    # is not what a manifest makes them allocate.
    ckpt = store.open()
    ckpt.slot_image(0)
    full_tensors(ckpt)
    PeerckptReader(store.url).read_metadata()
    return store


@pytest.fixture(scope="module", autouse=True)
def _remove_store() -> Any:
    yield
    if _store.cache_info().currsize:
        shutil.rmtree(_store().root, ignore_errors=True)
        _store.cache_clear()


def _template() -> dict[str, Any]:
    msg: dict[str, Any] = unpack(_store().fs.cat_file(_store().step_path(STEP, "manifest.msgpack")))
    return msg


def _data_bytes() -> int:
    store = _store()
    return sum(store.fs.size(p) for p in store.fs.glob(store.step_path(STEP, "data-n*.bin")))


def _check_decoded(manifest: DurableManifest) -> None:
    for chunks in manifest.ranks.values():
        for c in chunks:
            assert DATA_FILE.fullmatch(c.file) and c.record.crc is not None


# -- the decoders ----------------------------------------------------------------------------
def _check_manifest_msg(value: Any) -> None:
    def decode() -> None:
        try:
            _check_decoded(DurableManifest.from_msg(value, "manifest.msgpack"))
        except CorruptCheckpoint as exc:
            assert "manifest.msgpack" in str(exc)

    check_bounded(decode, 256 << 10)


def _check_manifest_bytes(raw: bytes) -> None:
    def decode() -> None:
        try:
            _check_decoded(DurableManifest.from_msg(_unpack(raw, "m"), "m"))
        except CorruptCheckpoint:
            pass

    check_bounded(decode, (256 << 10) + 64 * len(raw))


def _check_part(value: Any) -> None:
    def decode() -> None:
        try:
            decode_part(value, "part-n0.msgpack")
        except CorruptCheckpoint:
            pass

    check_bounded(decode, 256 << 10)


@st.composite
def _damaged_bytes(draw: st.DrawFn) -> bytes:
    raw = bytearray(pack(_template()))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw) - 1))
        raw[at] = draw(st.integers(0, 255))
    return bytes(raw[: draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw)


_manifest_msgs = st.deferred(lambda: values | mutations(_template()))
_manifest_bytes = st.deferred(lambda: st.binary(max_size=200) | _damaged_bytes())
_parts = st.deferred(
    lambda: (
        values
        | mutations({"format": 1, "node": 0, "chunks": [[0, c] for c in _template()["ranks"]["0"]]})
    )
)

test_fuzz_durable_manifest_values = fuzz(_manifest_msgs, _check_manifest_msg)
test_fuzz_durable_manifest_bytes = fuzz(_manifest_bytes, _check_manifest_bytes)
test_fuzz_parts = fuzz(_parts, _check_part)


# -- the read paths --------------------------------------------------------------------------
def _commit_manifest(msg: Any) -> None:
    store = _store()
    raw = pack(msg)
    store.fs.pipe_file(store.step_path(STEP, "manifest.msgpack"), raw)
    marker = pack({"step": STEP, "crc": crc32c.crc32c(raw)})
    store.fs.pipe_file(store.step_path(STEP, "COMMITTED"), marker)


def _check_readers(msg: Any) -> None:
    try:
        _commit_manifest(msg)
    except (TypeError, ValueError, OverflowError):
        return  # not msgpack-encodable (a float key, an int past 64 bits): storage cannot hold it
    store = _store()

    def read() -> None:
        try:
            ckpt = store.open()
            for rank in ckpt.manifest.ranks:
                image, _ = ckpt.slot_image(rank)
                assert len(image) <= 2 * _data_bytes() + 64 * len(list(ckpt.chunks(rank)))
            tensors = full_tensors(ckpt)
            assert sum(t.numel() * t.element_size() for t in tensors.values()) <= _data_bytes()
            PeerckptReader(store.url).read_metadata()
        except CheckpointError:
            pass

    check_bounded(read, (1 << 20) + 4 * _data_bytes(), seconds=10.0)


test_fuzz_readers_of_a_committed_manifest = fuzz(_manifest_msgs, _check_readers)

test_fuzz_durable_manifest_values_long = pytest.mark.slow(
    fuzz(_manifest_msgs, _check_manifest_msg, long=True)
)
test_fuzz_durable_manifest_bytes_long = pytest.mark.slow(
    fuzz(_manifest_bytes, _check_manifest_bytes, long=True)
)
test_fuzz_parts_long = pytest.mark.slow(fuzz(_parts, _check_part, long=True))
test_fuzz_readers_of_a_committed_manifest_long = pytest.mark.slow(
    fuzz(_manifest_msgs, _check_readers, long=True)
)
