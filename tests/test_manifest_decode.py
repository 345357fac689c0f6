"""Snapshot manifests and chunk records decoded from what a peer or storage sent.

Whatever the input, ``SnapshotManifest.from_msg`` and ``ChunkRecord.from_msg`` either return
records whose every field has its type and range, or raise ``MalformedManifest`` — a
``CorruptCheckpoint`` (storage) and a ``ProtocolError`` (a peer) — naming the field.
"""

from __future__ import annotations

from typing import Any

import pytest

from peerckpt.errors import CorruptCheckpoint, ProtocolError
from peerckpt.manifest import META_KEY, ChunkRecord, SnapshotManifest

from .fuzz import check_bounded, fuzz, mutations, values

RECORD = ChunkRecord("model/w", "float32", (8, 4), (4, 0), (4, 4), 128, 64, 0xDEADBEEF).to_msg()
MANIFEST = SnapshotManifest(
    rank=3,
    step=40,
    epoch=2,
    chunks=(
        ChunkRecord.from_msg(RECORD),
        ChunkRecord(META_KEY, "uint8", (20,), (0,), (20,), 192, 20, 7, "rank"),
    ),
    used_bytes=212,
    extra={"note": 1},
).to_msg()


def _with(template: Any, index: Any, value: Any) -> Any:
    out = dict(template) if isinstance(template, dict) else list(template)
    out[index] = value
    return out


BAD_RECORDS = {
    "not a list": "model/w",
    "too short": RECORD[:8],
    "key": _with(RECORD, 0, b"model/w"),
    "dtype": _with(RECORD, 1, None),
    "global_shape": _with(RECORD, 2, {"a": 1}),
    "negative offset": _with(RECORD, 3, [-4, 0]),
    "a bool for a length": _with(RECORD, 4, [True, 4]),
    "dimensions differ": _with(RECORD, 4, [4]),
    "box past the tensor": _with(RECORD, 3, [6, 0]),
    "byte_offset": _with(RECORD, 5, 1.5),
    "nbytes": _with(RECORD, 6, 1 << 64),
    "crc": _with(RECORD, 7, 1 << 32),
    "scope": _with(RECORD, 8, "all"),
}


@pytest.mark.parametrize("what", sorted(BAD_RECORDS))
def test_a_malformed_chunk_record_is_a_corrupt_checkpoint_naming_the_field(what: str) -> None:
    with pytest.raises(CorruptCheckpoint) as info:
        ChunkRecord.from_msg(BAD_RECORDS[what])
    assert isinstance(info.value, ProtocolError)  # a peer's bad input, on the data plane
    field = what.split()[-1] if what in ("byte_offset", "nbytes", "crc", "scope") else ""
    assert field in str(info.value)


BAD_MANIFESTS = {
    "not a map": [MANIFEST],
    "version": _with(MANIFEST, "version", 2),
    "no rank": {k: v for k, v in MANIFEST.items() if k != "rank"},
    "step": _with(MANIFEST, "step", "40"),
    "epoch": _with(MANIFEST, "epoch", -7),
    "chunks": _with(MANIFEST, "chunks", {"0": RECORD}),
    "a bad chunk": _with(MANIFEST, "chunks", [RECORD, [1, 2]]),
    "used_bytes": _with(MANIFEST, "used_bytes", None),
    "extra": _with(MANIFEST, "extra", [1]),
}


@pytest.mark.parametrize("what", sorted(BAD_MANIFESTS))
def test_a_malformed_snapshot_manifest_is_a_corrupt_checkpoint(what: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=r"snapshot manifest|chunk 1"):
        SnapshotManifest.from_msg(BAD_MANIFESTS[what])


def test_a_valid_manifest_round_trips() -> None:
    decoded = SnapshotManifest.from_msg(MANIFEST)
    assert decoded.to_msg() == MANIFEST
    assert decoded.chunks[0].offsets == (4, 0) and decoded.chunks[1].scope == "rank"


# -- fuzz ------------------------------------------------------------------------------------
def _decodes_or_refuses(decode: Any, value: Any) -> Any:
    decoded: list[Any] = []

    def call() -> None:
        decoded.clear()
        try:
            decoded.append(decode(value))
        except CorruptCheckpoint:
            decoded.append(None)

    # Decoding makes a few small objects per input item, never a buffer of a claimed size.
    check_bounded(call, 256 << 10)
    return decoded[0]


def _check_record(value: Any) -> None:
    record = _decodes_or_refuses(ChunkRecord.from_msg, value)
    # The one-pass check of the common case accepts exactly what the field-by-field one does.
    assert record == _decodes_or_refuses(ChunkRecord.checked, value)
    if record is not None:
        assert isinstance(record.key, str) and isinstance(record.nbytes, int)
        box = zip(record.offsets, record.lengths, record.global_shape, strict=True)
        assert all(o + n <= s for o, n, s in box)
        assert ChunkRecord.from_msg(record.to_msg()) == record


def _check_manifest(value: Any) -> None:
    manifest = _decodes_or_refuses(SnapshotManifest.from_msg, value)
    if manifest is not None:
        assert SnapshotManifest.from_msg(manifest.to_msg()) == manifest


test_fuzz_chunk_records = fuzz(values | mutations(RECORD), _check_record)
test_fuzz_snapshot_manifests = fuzz(values | mutations(MANIFEST), _check_manifest)
test_fuzz_chunk_records_long = pytest.mark.slow(
    fuzz(values | mutations(RECORD), _check_record, long=True)
)
test_fuzz_snapshot_manifests_long = pytest.mark.slow(
    fuzz(values | mutations(MANIFEST), _check_manifest, long=True)
)
