"""The records of the durable format, and their checked decoding from what storage holds.

A step's manifest and its writers' parts are msgpack (``durable.py`` draws the layout). What
storage hands back is input like any other: whoever can write to the root, or a damaged
disk, decides it. So every field is decoded through ``peerckpt.decode`` and checked against
what the format itself writes — a chunk's file is one of the names a writer gives
(``data-n<node>.bin``, never a path), its size is what its dtype and box make — and anything
else is a :class:`MalformedManifest` (a ``CorruptCheckpoint``) naming the file and field.

Pure data; no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from peerckpt.decode import need_int, need_list, need_map
from peerckpt.dtypes import itemsize
from peerckpt.errors import MalformedManifest, StateMismatch
from peerckpt.manifest import FORMAT_VERSION, ChunkRecord

# The only data file names a writer gives (``data_file``): no separator, no "..", no link.
DATA_FILE = re.compile(r"data-n(0|[1-9][0-9]{0,8})\.bin")
MAX_STEP = 10**12 - 1  # a step directory's name has 12 digits
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")  # a rank as the manifest's map writes it


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
