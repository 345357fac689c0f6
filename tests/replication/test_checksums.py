"""Checksums computed beside the transfer: same values, bytes arriving late, cancelled."""

from __future__ import annotations

import os
import threading

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.errors import PeerckptError
from peerckpt.manifest import ChunkRecord
from peerckpt.replication.checksums import RunningChecksums


def _chunks(sizes: list[int]) -> list[ChunkRecord]:
    chunks, off = [], 0
    for i, n in enumerate(sizes):
        chunks.append(ChunkRecord(f"t{i}", "uint8", (n,), (0,), (n,), off, n))
        off += n + (-n % 64)  # the slot's 64-byte alignment leaves gaps
    return chunks


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    pieces=st.lists(st.integers(1, 7000), min_size=1, max_size=20),
)
def test_checksums_of_bytes_arriving_in_pieces_equal_those_computed_at_once(
    sizes: list[int], pieces: list[int]
) -> None:
    chunks = _chunks(sizes)
    used = chunks[-1].byte_offset + chunks[-1].nbytes
    view = memoryview(bytearray(os.urandom(used + 64)))
    sums = RunningChecksums(chunks, view)
    ready = 0
    for n in pieces:
        ready = min(used, ready + n)
        sums.advance(ready)
    sums.advance(used)
    assert sums.wait(timeout=10) == [
        crc32c.crc32c(bytes(view[c.byte_offset : c.byte_offset + c.nbytes])) for c in chunks
    ]


def test_a_chunk_is_not_checksummed_before_its_last_byte_is_there() -> None:
    chunks = _chunks([1000, 1000])
    view = memoryview(bytearray(2048))
    sums = RunningChecksums(chunks, view, ready=500)
    view[:1000] = b"\x01" * 1000  # written after the checksummer started: must be seen
    view[1024:2024] = b"\x02" * 1000
    sums.advance(2024)
    assert sums.wait(timeout=10) == [crc32c.crc32c(b"\x01" * 1000), crc32c.crc32c(b"\x02" * 1000)]


def test_cancel_stops_the_thread_and_wait_raises() -> None:
    sums = RunningChecksums(_chunks([1000]), memoryview(bytearray(1024)))
    before = threading.active_count()
    sums.cancel()
    assert threading.active_count() == before - 1
    with pytest.raises(PeerckptError, match="cancelled"):
        sums.wait(timeout=1)
