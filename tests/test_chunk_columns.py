"""Chunk columns (``peerckpt/columns.py``): a rank's chunk list in four fields, read back
record for record, shared metadata decoded once, and every malformed field refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerckpt.codec import pack, unpack
from peerckpt.columns import ChunkColumns, meta_of
from peerckpt.errors import MalformedManifest, ProtocolError
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.messages import decode, encode
from peerckpt.messages.control import Wants


@st.composite
def records(draw: st.DrawFn) -> list[ChunkRecord]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        shape = tuple(draw(st.lists(st.integers(0, 1 << 40), max_size=3)))
        offsets = tuple(draw(st.integers(0, s)) for s in shape)
        lengths = tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, offsets, strict=True))
        scope = draw(st.sampled_from(["global", "global", "rank"]))
        at, n = draw(st.integers(0, 1 << 40)), draw(st.integers(0, 1 << 40))
        out.append(ChunkRecord(f"t{i}", "bfloat16", shape, offsets, lengths, at, n, None, scope))
    return out


@given(records())
def test_columns_read_back_as_the_records_they_were_made_of(chunks: list[ChunkRecord]) -> None:
    columns = ChunkColumns.from_records(chunks)
    assert columns.records() == chunks
    assert len(columns) == len(chunks)
    assert list(columns) == [c.to_msg() for c in chunks]
    assert [columns[i] for i in range(len(chunks))] == [c.to_msg() for c in chunks]
    wire = unpack(pack(columns.to_msg()))
    assert ChunkColumns.from_msg(wire) == columns


def test_the_shared_part_ends_at_the_first_private_chunk() -> None:
    chunks = [
        ChunkRecord("a", "float32", (4,), (0,), (2,), 0, 8),
        ChunkRecord(META_KEY, "uint8", (5,), (0,), (5,), 64, 5, None, "rank"),
        ChunkRecord("b", "float32", (4,), (2,), (2,), 128, 8),
    ]
    columns = ChunkColumns.from_records(chunks)
    assert columns.shared().keys == ("a",)
    assert columns.rest == tuple(chunks[1:])
    resized = columns.with_meta_size(9)
    assert resized.records()[1] == ChunkRecord(
        META_KEY, "uint8", (9,), (0,), (9,), 64, 9, None, "rank"
    )
    assert resized.records()[2] == chunks[2]


def test_equal_ranks_share_their_metadata_bytes_and_decode_it_once() -> None:
    def rank(r: int) -> ChunkColumns:
        return ChunkColumns.from_records(
            [
                ChunkRecord(f"w{i}", "bfloat16", (64, 8), (8 * r, 0), (8, 8), 0, 128)
                for i in range(3)
            ]
        )

    a, b = (
        ChunkColumns.from_msg(unpack(pack(rank(0).to_msg()))),
        ChunkColumns.from_msg(unpack(pack(rank(1).to_msg()))),
    )
    # Decoded once; every list keeps the first copy of the blob, the others' are freed.
    assert a.meta is b.meta
    assert meta_of(a.meta) is meta_of(b.meta)
    assert a.boxes != b.boxes
    assert a.box_arrays()[0].tolist() == [0, 0, 0, 0, 0, 0]
    assert b.box_arrays()[0].tolist() == [8, 0, 8, 0, 8, 0]


def _bad(mutate: Any) -> list[Any]:
    msg = ChunkColumns.from_records(
        [ChunkRecord("w", "float32", (10, 4), (2, 0), (3, 4), 0, 48)]
    ).to_msg()
    mutate(msg)
    return msg


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda m: m.__setitem__(0, "text"), "meta must be bytes"),
        (lambda m: m.__setitem__(0, b"\xc1"), "not msgpack"),
        (lambda m: m.__setitem__(0, pack([["w"], ["float32"]])), "must have 3 items"),
        (lambda m: m.__setitem__(0, pack([["w"], ["float32"], [[10, -4]]])), "non-negative"),
        (lambda m: m.__setitem__(1, m[1][:8]), "boxes has 8 bytes"),
        (
            lambda m: m.__setitem__(1, np.asarray([2, 0, 3, 5], "<i8").tobytes()),
            "past the tensor's 4",
        ),
        (lambda m: m.__setitem__(1, np.asarray([-1, 0, 3, 4], "<i8").tobytes()), "negative"),
        (lambda m: m.__setitem__(2, b"\0" * 8), "places has 8 bytes"),
        (lambda m: m.__setitem__(3, [["x"]]), "chunk 1"),
    ],
)
def test_malformed_columns_are_refused_by_name(mutate: Any, says: str) -> None:
    with pytest.raises(MalformedManifest, match=says):
        ChunkColumns.from_msg(_bad(mutate))


def test_a_message_with_columns_is_decoded_and_checked_at_the_edge() -> None:
    columns = ChunkColumns.from_records(
        [ChunkRecord("w", "float32", (10, 4), (2, 0), (3, 4), 0, 0)], places=False
    )
    msg = Wants(3, 1, 0, 7, [], columns=columns)
    assert decode(unpack(pack(encode(msg)))) == msg
    raw = encode(msg)
    raw["columns"][1] = np.asarray([2, 0, 9, 4], "<i8").tobytes()
    with pytest.raises(ProtocolError, match="past the tensor's 10"):
        decode(unpack(pack(raw)))
