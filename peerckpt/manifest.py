"""The manifest of one rank's snapshot: which bytes of the slot hold which chunk.

A snapshot slot is one contiguous byte range: tensor chunks at 64-byte aligned offsets, then
the msgpack blob of small state (step, RNG, data-loader positions) as the chunk ``__meta__``.
The rank fills in the layout; the agent adds a crc32c per chunk before replicating, and every
receiver verifies them before it acknowledges or restores. The same records describe durable
checkpoints (one manifest per step, written last).

Chunk metadata follows DESIGN.md: ``key`` (the FQN), dtype, global shape, and the box the
chunk covers (``offsets``/``lengths`` per dimension), plus its scope (a box of a shared
tensor, or one rank's private state). Pure data; no I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import crc32c

from peerckpt.decode import (
    MAX_DIMS,
    MAX_INT,
    need_dims,
    need_int,
    need_list,
    need_map,
    need_one_of,
    need_str,
)
from peerckpt.errors import MalformedManifest

FORMAT_VERSION = 1
META_KEY = "__meta__"
ALIGN = 64
SCOPES = ("global", "rank")  # ChunkRecord.scope


def chunk_name(key: str, scope: str, rank: int) -> str:
    """How a chunk is named across old ranks: a box of a shared tensor keeps its key (copies
    on several ranks are replicas); a rank's private state is ``<key>@<rank>``."""
    return key if scope == "global" else f"{key}@{rank}"


def align(n: int) -> int:
    """Round ``n`` up to the slot alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk's place in a slot and, once the agent has seen it, its checksum."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    byte_offset: int
    nbytes: int
    crc: int | None = None
    # "global": a box of a tensor every rank shares a view of (sharded or replicated);
    # "rank": private state of one rank (a data loader's), never mistaken for a replica.
    scope: str = "global"

    def to_msg(self) -> list[Any]:
        return [
            self.key,
            self.dtype,
            list(self.global_shape),
            list(self.offsets),
            list(self.lengths),
            self.byte_offset,
            self.nbytes,
            self.crc,
            self.scope,
        ]

    @classmethod
    def from_msg(cls, msg: Any, what: str = "chunk record") -> ChunkRecord:
        """Decode a record, every field checked (MalformedManifest names the bad one)."""
        # The common case is checked in one pass: an agent decodes every rank's manifest
        # every step (measured: 1.7 µs a record, 1.1 unchecked, 5.5 field by field).
        if _well_formed(msg):
            key, dtype, gshape, offsets, lengths, byte_offset, nbytes, crc, scope = msg
            return cls(
                key, dtype, tuple(gshape), tuple(offsets), tuple(lengths), byte_offset, nbytes,
                crc, scope,
            )  # fmt: skip
        return cls.checked(msg, what)

    @classmethod
    def checked(cls, msg: Any, what: str = "chunk record") -> ChunkRecord:
        """``from_msg`` field by field, naming the first bad one (its slow path)."""
        key, dtype, gshape, offsets, lengths, byte_offset, nbytes, crc, scope = need_list(
            msg, what, 9
        )
        shape = need_dims(gshape, f"{what} global_shape")
        box = need_dims(offsets, f"{what} offsets"), need_dims(lengths, f"{what} lengths")
        if not len(shape) == len(box[0]) == len(box[1]):
            raise MalformedManifest(
                f"{what}: global_shape, offsets and lengths have different dimensions "
                f"({len(shape)}, {len(box[0])}, {len(box[1])})"
            )
        for dim, (size, start, n) in enumerate(zip(shape, *box, strict=True)):
            if start + n > size:
                raise MalformedManifest(
                    f"{what}: its box ends at {start + n} in dimension {dim}, past the "
                    f"tensor's {size}"
                )
        return cls(
            need_str(key, f"{what} key"),
            need_str(dtype, f"{what} dtype"),
            shape,
            box[0],
            box[1],
            need_int(byte_offset, f"{what} byte_offset"),
            need_int(nbytes, f"{what} nbytes"),
            None if crc is None else need_int(crc, f"{what} crc", hi=0xFFFFFFFF),
            need_one_of(scope, f"{what} scope", SCOPES),
        )


def _well_formed(msg: Any) -> bool:
    """Whether ``msg`` is a record as ``ChunkRecord.to_msg`` writes it, every field of its
    type and in range: exactly what the field-by-field checks accept (never more)."""
    if type(msg) is not list or len(msg) != 9:
        return False
    key, dtype, gshape, offsets, lengths, byte_offset, nbytes, crc, scope = msg
    if not (
        type(key) is str
        and type(dtype) is str
        and type(byte_offset) is int
        and type(nbytes) is int
        and 0 <= byte_offset <= MAX_INT
        and 0 <= nbytes <= MAX_INT
        and (crc is None or (type(crc) is int and 0 <= crc <= 0xFFFFFFFF))
        and type(scope) is str
        and scope in SCOPES
        and type(gshape) is list
        and type(offsets) is list
        and type(lengths) is list
        and len(gshape) == len(offsets) == len(lengths) <= MAX_DIMS
    ):
        return False
    for size, start, n in zip(gshape, offsets, lengths):  # noqa: B905 (lengths checked)
        if not (
            type(size) is int and type(start) is int and type(n) is int
            and start >= 0 and n >= 0 and start + n <= size <= MAX_INT
        ):  # fmt: skip
            return False
    return True


@dataclass(frozen=True)
class SnapshotManifest:
    """Everything needed to verify and restore one rank's snapshot of one step."""

    rank: int
    step: int
    epoch: int
    chunks: tuple[ChunkRecord, ...]
    used_bytes: int
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_msg(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "rank": self.rank,
            "step": self.step,
            "epoch": self.epoch,
            "chunks": [c.to_msg() for c in self.chunks],
            "used_bytes": self.used_bytes,
            "extra": self.extra,
        }

    @classmethod
    def from_msg(cls, msg: Any) -> SnapshotManifest:
        """Decode a snapshot manifest, every field checked (MalformedManifest names the bad
        one, a version other than this peerckpt's included)."""
        msg = need_map(msg, "snapshot manifest")
        if msg.get("version") != FORMAT_VERSION:
            raise MalformedManifest(
                f"snapshot manifest format {msg.get('version')!r:.40} is not {FORMAT_VERSION}; "
                "all processes of a job must run the same peerckpt version"
            )
        chunks = []
        for i, chunk in enumerate(need_list(msg.get("chunks"), "snapshot manifest chunks")):
            try:
                chunks.append(ChunkRecord.from_msg(chunk))
            except MalformedManifest as exc:
                raise MalformedManifest(f"snapshot manifest chunk {i}: {exc}") from None
        extra = need_map(msg.get("extra", {}), "snapshot manifest extra")
        for name in ("absent", "twins"):  # chunk indices (replication/dedup.py)
            if name in extra:
                for i in need_list(extra[name], f"snapshot manifest {name}"):
                    need_int(i, f"snapshot manifest {name} index", hi=max(len(chunks) - 1, 0))
        return cls(
            rank=need_int(msg.get("rank"), "snapshot manifest rank"),
            step=need_int(msg.get("step"), "snapshot manifest step"),
            epoch=need_int(msg.get("epoch"), "snapshot manifest epoch", lo=-1),
            chunks=tuple(chunks),
            used_bytes=need_int(msg.get("used_bytes"), "snapshot manifest used_bytes"),
            extra=extra,
        )

    @property
    def absent(self) -> tuple[int, ...]:
        """Chunks (indices) whose bytes a copy lacks: a buddy's copy of a rank whose
        data-parallel chunks live on its twins' nodes (``replication/dedup.py``); empty for a
        complete copy."""
        return tuple(self.extra.get("absent", ()))

    def without(self, absent: tuple[int, ...]) -> SnapshotManifest:
        """This manifest for a copy lacking the chunks ``absent`` (every checksum kept)."""
        extra = {k: v for k, v in self.extra.items() if k != "absent"}
        if absent:
            extra["absent"] = sorted(absent)
        return replace(self, extra=extra)

    def byte_ranges(self) -> list[tuple[int, int]]:
        """The (start, end) byte ranges a copy holds, ascending: every chunk's that is not
        ``absent``, neighbours merged across their alignment padding."""
        gone = set(self.absent)
        if not gone:
            return [(0, self.used_bytes)] if self.used_bytes else []
        ranges: list[tuple[int, int]] = []
        for i, c in sorted(enumerate(self.chunks), key=lambda ic: ic[1].byte_offset):
            if i in gone or not c.nbytes:
                continue
            if ranges and c.byte_offset - ranges[-1][1] < ALIGN:
                ranges[-1] = (ranges[-1][0], c.byte_offset + c.nbytes)
            else:
                ranges.append((c.byte_offset, c.byte_offset + c.nbytes))
        return ranges

    def present(self) -> list[ChunkRecord]:
        """The chunks a copy holds (all but ``absent``)."""
        gone = set(self.absent)
        return [c for i, c in enumerate(self.chunks) if i not in gone]

    def meta(self) -> ChunkRecord:
        for chunk in self.chunks:
            if chunk.key == META_KEY:
                return chunk
        raise KeyError("snapshot manifest has no __meta__ chunk")

    def state_digest(self) -> str:
        """A digest of the tensors' bytes (their keys, places and checksums; the blob left
        out): two snapshots of a step have the same one when their tensors are bit-equal."""
        h = hashlib.blake2b(digest_size=8)
        for c in self.chunks:
            if c.key != META_KEY:
                h.update(repr((c.key, c.offsets, c.lengths, c.nbytes, c.crc)).encode())
        return h.hexdigest()

    def tensor_digests(self) -> dict[str, str]:
        """Every tensor key's digest (its chunks' places and checksums), in chunk order: the
        first key whose digest differs between two snapshots of a step is the first tensor
        that differs (``peerckpt chaos`` names it)."""
        hashes: dict[str, Any] = {}
        for c in self.chunks:
            if c.key != META_KEY:
                h = hashes.setdefault(c.key, hashlib.blake2b(digest_size=6))
                h.update(repr((c.offsets, c.lengths, c.nbytes, c.crc)).encode())
        return {key: h.hexdigest() for key, h in hashes.items()}

    def with_checksums(self, view: memoryview) -> SnapshotManifest:
        """Return a copy whose chunks carry the crc32c of their bytes in ``view``."""
        chunks = tuple(
            replace(c, crc=crc32c.crc32c(view[c.byte_offset : c.byte_offset + c.nbytes]))
            for c in self.chunks
        )
        return replace(self, chunks=chunks)

    def with_crcs(self, crcs: list[int]) -> SnapshotManifest:
        """Return a copy whose chunks carry ``crcs`` (one per chunk, in order)."""
        if len(crcs) != len(self.chunks):
            raise ValueError(f"{len(crcs)} checksums for {len(self.chunks)} chunks")
        return replace(
            self, chunks=tuple(replace(c, crc=k) for c, k in zip(self.chunks, crcs, strict=True))
        )

    def mismatched(self, crcs: list[int]) -> list[str]:
        """Keys of the chunks whose recorded crc32c is not the one in ``crcs``."""
        if len(crcs) != len(self.chunks):
            return [c.key for c in self.chunks]
        return [
            c.key for c, k in zip(self.chunks, crcs, strict=True) if c.crc is None or c.crc != k
        ]

    def bad_chunks(self, view: memoryview) -> list[str]:
        """Keys of the chunks whose bytes in ``view`` do not match their recorded crc32c."""
        if self.used_bytes > len(view):
            return [c.key for c in self.chunks]
        bad = []
        for c in self.present():  # a partial copy is checked in the chunks it holds
            if (
                c.crc is None
                or crc32c.crc32c(view[c.byte_offset : c.byte_offset + c.nbytes]) != c.crc
            ):
                bad.append(c.key)
        return bad

    def validate_bounds(self, capacity: int) -> None:
        """Check that every chunk lies inside a slot of ``capacity`` bytes."""
        if self.used_bytes > capacity:
            raise ValueError(f"snapshot uses {self.used_bytes} bytes, slot holds {capacity}")
        for c in self.chunks:
            if c.byte_offset < 0 or c.nbytes < 0 or c.byte_offset + c.nbytes > self.used_bytes:
                raise ValueError(
                    f"chunk {c.key!r} lies outside the snapshot's {self.used_bytes} bytes"
                )
