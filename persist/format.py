"""The records of the durable format, and their checked decoding from what storage holds.

A step's manifest and its writers' parts are msgpack (``durable.py`` draws the layout). What
storage hands back is input like any other: whoever can write to the root, or a damaged
disk, decides it. So every field is decoded through ``peerckpt.decode`` and checked against
what the format itself writes — a chunk's file is one of the names a writer gives
(``data-n<node>.bin``, never a path), its size is what its dtype and box make — and anything
else is a :class:`MalformedManifest` (a ``CorruptCheckpoint``) naming the file and field.

What a reader allocates must be bounded by what the root stores, so a manifest is also
refused when its records make a reader count stored bytes twice (:func:`check_stored_once`:
a chunk listed twice for one rank, two records claiming the same bytes, records whose bytes
overlap in their file), and its msgpack is decoded with bounds (:func:`decode_document`).

Pure data; no I/O.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from peerckpt.decode import need_int, need_list, need_map
from peerckpt.dtypes import itemsize
from peerckpt.errors import MalformedManifest, StateMismatch
from peerckpt.manifest import FORMAT_VERSION, ChunkRecord, chunk_name

# The only data file names a writer gives (``data_file``): no separator, no "..", no link.
DATA_FILE = re.compile(r"data-n(0|[1-9][0-9]{0,8})\.bin")
MAX_STEP = 10**12 - 1  # a step directory's name has 12 digits
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")  # a rank as the manifest's map writes it

# Bounds on what a document read from the root may be and decode to. A manifest or a part is
# a few dozen bytes per chunk (1 GiB: tens of millions of chunks); the marker and ``latest``
# are a few bytes. A decoded document holds at most 8 maps (the format writes two) and one
# list per 5 bytes (each list of a stored chunk takes more), so that no content decodes to
# more than a manifest of the same size does; strings are names (a key, a dtype).
MANIFEST_MAX = 1 << 30
SMALL_MAX = 4096
_MAPS_MAX = 8
_BYTES_PER_LIST = 5
_STR_MAX = 1 << 16


def data_file(node: int) -> str:
    """The name of node ``node``'s data file in a step directory."""
    return f"data-n{node}.bin"


def part_file(node: int) -> str:
    """The name of node ``node``'s part (its index of the chunks it wrote)."""
    return f"part-n{node}.msgpack"


@dataclass(frozen=True)
class StoredChunk:
    """A chunk in a durable checkpoint: the snapshot's record, and where its bytes are
    (``record.byte_offset``/``nbytes`` are within ``file``, relative to the step)."""

    file: str
    record: ChunkRecord

    def to_msg(self) -> list[Any]:
        return [self.file, self.record.to_msg()]

    @classmethod
    def from_msg(cls, msg: Any, what: str = "stored chunk") -> StoredChunk:
        """Decode a stored chunk; MalformedManifest unless it is one the format writes."""
        file, record_msg = need_list(msg, what, 2)
        if not isinstance(file, str) or not DATA_FILE.fullmatch(file):
            raise MalformedManifest(
                f"{what} names the file name {file!r:.80}, which is not a data file of the "
                "format (data-n<node>.bin in the step's directory)"
            )
        record = ChunkRecord.from_msg(record_msg, what)
        if record.crc is None:
            raise MalformedManifest(f"{what} ({record.key!r:.80}) has no checksum")
        try:
            size = itemsize(record.dtype)
        except StateMismatch as exc:
            raise MalformedManifest(f"{what}: {exc}") from None
        expected = math.prod(record.lengths) * size
        if record.nbytes != expected:
            raise MalformedManifest(
                f"{what} ({record.key!r:.80}) says nbytes {record.nbytes}, but its box of "
                f"{record.dtype} holds {expected}"
            )
        return cls(file, record)


@dataclass(frozen=True)
class DurableManifest:
    """One committed step: for every rank of the world that took it, its chunks."""

    step: int
    epoch: int
    world_size: int
    ranks: dict[int, list[StoredChunk]]

    def to_msg(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "ranks": {str(r): [c.to_msg() for c in cs] for r, cs in sorted(self.ranks.items())},
        }

    @classmethod
    def from_msg(cls, msg: Any, where: str = "manifest") -> DurableManifest:
        """Decode the manifest read from ``where``; every field is checked, and a bad one is
        a MalformedManifest naming ``where`` and the field."""
        msg = need_map(msg, where)
        if msg.get("format") != FORMAT_VERSION:
            raise MalformedManifest(
                f"{where}: checkpoint format {msg.get('format')!r:.40} is not {FORMAT_VERSION}, "
                "the one this peerckpt reads"
            )
        try:
            ranks: dict[int, list[StoredChunk]] = {}
            for key, chunks in need_map(msg.get("ranks"), "ranks").items():
                if not isinstance(key, str) or not _RANK.fullmatch(key):
                    raise MalformedManifest(f"rank {key!r:.40} is not a rank number")
                rank = int(key)
                ranks[rank] = [
                    StoredChunk.from_msg(c, f"rank {rank} chunk {i}")
                    for i, c in enumerate(need_list(chunks, f"rank {rank}'s chunks"))
                ]
            check_stored_once(ranks)
            return cls(
                need_int(msg.get("step"), "step", hi=MAX_STEP),
                need_int(msg.get("epoch"), "epoch", lo=-1),
                need_int(msg.get("world_size"), "world_size"),
                ranks,
            )
        except MalformedManifest as exc:
            raise MalformedManifest(f"{where}: {exc}") from None

    def unique_chunks(self) -> dict[tuple[str, int], StoredChunk]:
        """Every stored chunk once, by (file, offset)."""
        found: dict[tuple[str, int], StoredChunk] = {}
        for chunks in self.ranks.values():
            for c in chunks:
                found.setdefault((c.file, c.record.byte_offset), c)
        return found

    def nbytes(self) -> int:
        return sum(c.record.nbytes for c in self.unique_chunks().values())


def decode_document(raw: bytes, where: str) -> Any:
    """The msgpack map stored as ``raw`` (a manifest, a part, a marker), decoded with bounds:
    MalformedManifest naming ``where`` for anything else.

    Without them a document of N bytes decoded to up to 73·N bytes of Python objects (a list
    of empty maps, one byte each); with them, to about what a manifest of N bytes costs
    (measured: 14·N for one of real chunks, 27·N at most, for a map of many ranks with no
    chunks; docs/security.md). msgpack itself refuses a declared length past the bytes that
    follow (``max_*_len``), and bytes and extension types, which the format never writes;
    the hooks count maps and lists as they are built and stop the decoding as soon as a
    document holds more of them than its size allows in the format.
    """
    if not raw or not (0x80 <= raw[0] <= 0x8F or raw[0] in (0xDE, 0xDF)):
        raise MalformedManifest(f"{where} is not a msgpack map (first byte {raw[:1]!r})")
    lists_left = [len(raw) // _BYTES_PER_LIST + 16]
    maps_left = [_MAPS_MAX]

    def count(left: list[int], what: str) -> None:
        left[0] -= 1
        if left[0] < 0:
            raise MalformedManifest(
                f"{where} holds more {what} than a document of {len(raw)} bytes in the format "
                "can; it is not one peerckpt wrote"
            )

    def on_list(value: list[Any]) -> list[Any]:
        count(lists_left, "lists")
        return value

    def on_map(value: dict[Any, Any]) -> dict[Any, Any]:
        count(maps_left, "maps")
        return value

    try:
        return msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=False,
            list_hook=on_list,
            object_hook=on_map,
            max_str_len=_STR_MAX,
            max_bin_len=0,
            max_ext_len=0,
        )
    except MalformedManifest:
        raise
    except Exception as exc:  # msgpack raises several types for bad input
        raise MalformedManifest(
            f"{where} is not a valid msgpack document: {type(exc).__name__} {exc}"
        ) from None


def check_stored_once(ranks: dict[int, list[StoredChunk]]) -> None:
    """MalformedManifest unless every stored byte is counted once: no rank lists a chunk
    twice, records at one place in a file are one chunk (a box of a shared tensor, which
    any number of ranks may list; a rank's private state, one rank only), and no two chunks'
    bytes overlap in their file. O(n log n) in the records.

    The format writes each unique chunk once, at its own place in its writer's data file. A
    manifest that points many records at the same bytes (aliases) or lists one many times
    (duplicates) would pass every size check — each record's bytes are in the file — while
    a reader allocated the file's size once per record: 20,000 aliases of a 1 MB file make an
    export of 20 GB. With this check what a reader allocates for one rank, or for every shared
    tensor whole, is bounded by the bytes the data files hold.
    """
    places: dict[tuple[str, int], tuple[ChunkRecord, int]] = {}
    for rank, chunks in ranks.items():
        seen: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
        for c in chunks:
            r = c.record
            if r.nbytes == 0:
                continue  # holds no byte, costs no memory: several may stand at one offset
            identity = (chunk_name(r.key, r.scope, rank), r.offsets, r.lengths)
            if identity in seen:
                raise MalformedManifest(
                    f"rank {rank} lists chunk {r.key!r:.80} {list(r.offsets)} twice"
                )
            seen.add(identity)
            place = (c.file, r.byte_offset)
            first = places.setdefault(place, (r, rank))
            if first[0] != r or (r.scope == "rank" and first[1] != rank):
                raise MalformedManifest(
                    f"{_named(first[0], first[1])} and {_named(r, rank)} both claim bytes "
                    f"{r.byte_offset}–{r.byte_offset + r.nbytes} of {c.file}: aliased records"
                )
    _check_apart((file, offset, r) for (file, offset), (r, _) in places.items())


def _check_apart(places: Iterable[tuple[str, int, ChunkRecord]]) -> None:
    """MalformedManifest if two of the chunks' byte ranges overlap in one file."""
    ordered = sorted(places, key=lambda p: (p[0], p[1]))
    for (file, offset, r), (next_file, next_offset, s) in itertools.pairwise(ordered):
        if file == next_file and offset + r.nbytes > next_offset:
            raise MalformedManifest(
                f"{r.key!r:.80} (bytes {offset}–{offset + r.nbytes}) and {s.key!r:.80} (from "
                f"{next_offset}) overlap in {file}: the format stores each chunk apart"
            )


def _named(record: ChunkRecord, rank: int) -> str:
    return f"{record.key!r:.80} {list(record.offsets)} of rank {rank}"


def decode_part(msg: Any, where: str) -> list[tuple[int, StoredChunk]]:
    """The (rank, chunk) entries of a writer's part read from ``where``, checked."""
    try:
        part = need_map(msg, "part")
        entries = need_list(part.get("chunks"), "chunks")
        out = []
        for i, entry in enumerate(entries):
            rank, chunk = need_list(entry, f"entry {i}", 2)
            out.append(
                (need_int(rank, f"entry {i} rank"), StoredChunk.from_msg(chunk, f"entry {i}"))
            )
        return out
    except MalformedManifest as exc:
        raise MalformedManifest(f"{where}: {exc}") from None
