"""Chunk lists as columns: a rank's layout or wants in four fields, not a record per chunk.

A job of 10,000 ranks with 1,000 tensors each has ten million chunks per side of a resharding
plan. As one msgpack record per chunk (``ChunkRecord.to_msg``), merely decoding them and
reading them into the planner's tables took 24–51 s on this project's 2-core machine
(docs/performance.md, "Planning at scale"). So a rank's list travels as :class:`ChunkColumns`:

- ``meta``: the msgpack bytes of ``[keys, dtypes, shapes]`` of its leading chunks of scope
  ``global`` (its tensors, in the model's order). Ranks with the same tensors send the same
  bytes, which a receiver decodes and checks once per distinct value (:func:`meta_of`);
- ``boxes``: those chunks' boxes as raw int64 (little-endian): every chunk's offsets, then
  every chunk's lengths, in chunk order;
- ``places``: their byte offsets in the slot, then their sizes, as raw int64 (a layout);
  empty for wants, whose chunks have none;
- ``rest``: the chunks from the first private one on (a rank's blob, a data loader's state),
  as records: few, and different on every rank.

A ``ChunkColumns`` is also a sequence of chunk records in message form (``to_msg`` lists,
their checksum ``None``), made on demand, so code that reads a layout record by record
(a flush, the twins' check) takes it unchanged; the planner reads the columns themselves.

Pure data, no I/O. ``from_msg`` checks every field as ``ChunkRecord.from_msg`` would (types,
dimensions, boxes inside their tensors) and raises MalformedManifest naming the first problem.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

import numpy as np

from peerckpt.codec import pack, unpack
from peerckpt.decode import MAX_DIMS, need_list, need_str
from peerckpt.errors import MalformedManifest
from peerckpt.manifest import META_KEY, ChunkRecord

I64 = np.dtype("<i8")
_GLOBAL = "global"
_CACHED = 64  # distinct meta blobs remembered (a job has a few: one per kind of rank)


@dataclass(frozen=True, slots=True, eq=False)
class ChunkMeta:
    """A decoded, checked ``meta`` blob: the shared part's keys, dtypes and shapes.

    Chunk ``j``'s dimensions are ``starts[j]:starts[j + 1]`` of a boxes array's offsets (and
    of its lengths); ``sizes`` is every dimension's extent, in that order.
    """

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    sizes: np.ndarray = field(repr=False)
    blob: bytes = field(default=b"", repr=False)  # the bytes it was decoded from, kept once

    @property
    def dims(self) -> int:
        """Dimensions of every chunk together (the length of a boxes array's offsets)."""
        return self.starts[-1]

    def __len__(self) -> int:
        return len(self.keys)


_metas: dict[bytes, ChunkMeta] = {}
_recent: list[ChunkMeta] = []  # the last few found, compared before hashing


def meta_of(blob: bytes) -> ChunkMeta:
    """The decoded ``meta`` blob, checked once per distinct value and then remembered.

    Equal ranks' blobs are equal bytes but other objects: they are compared (memcmp) with the
    last few found before the blob is hashed (tens of kB per rank at 1,000 tensors)."""
    for meta in _recent:
        if meta.blob is blob or meta.blob == blob:
            return meta
    found = _metas.get(blob)
    if found is None:
        found = _decode_meta(blob)
        if len(_metas) >= _CACHED:
            _metas.clear()
        _metas[blob] = found
    meta = found
    _recent.insert(0, meta)
    del _recent[4:]
    return meta


def _decode_meta(blob: bytes) -> ChunkMeta:
    try:
        value = unpack(blob)
    except Exception as exc:  # msgpack raises several types for bad bytes
        raise MalformedManifest(f"chunk columns' meta is not msgpack: {exc}") from None
    keys, dtypes, shapes = need_list(value, "chunk columns' meta", 3)
    keys, dtypes, shapes = (
        need_list(keys, "chunk columns' keys"),
        need_list(dtypes, "chunk columns' dtypes"),
        need_list(shapes, "chunk columns' shapes"),
    )
    if not len(keys) == len(dtypes) == len(shapes):
        raise MalformedManifest(
            f"chunk columns' meta lists {len(keys)} keys, {len(dtypes)} dtypes and "
            f"{len(shapes)} shapes"
        )
    for i, (key, dtype) in enumerate(zip(keys, dtypes, strict=True)):
        need_str(key, f"chunk columns' key {i}")
        need_str(dtype, f"chunk columns' dtype {i}")
    dims = []
    for i, shape in enumerate(shapes):
        shape = need_list(shape, f"chunk columns' shape {i}")
        if len(shape) > MAX_DIMS:
            raise MalformedManifest(f"chunk columns' shape {i} has more than {MAX_DIMS} dims")
        dims.append(len(shape))
    starts = (0, *np.cumsum(dims, dtype=np.int64).tolist())
    flat = [d for shape in shapes for d in shape]
    if any(type(d) is not int or d < 0 for d in flat):
        raise MalformedManifest("chunk columns' shapes must hold non-negative integers")
    try:
        sizes = np.asarray(flat, I64)
    except OverflowError:
        raise MalformedManifest("chunk columns' shapes hold integers past int64") from None
    return ChunkMeta(tuple(keys), tuple(dtypes), tuple(map(tuple, shapes)), starts, sizes, blob)


@dataclass(frozen=True, slots=True)
class ChunkColumns(Sequence[list[Any]]):
    """A rank's chunk list (a snapshot's layout, or the boxes it wants) as columns; see the
    module docstring for the fields."""

    meta: bytes
    boxes: bytes
    places: bytes = b""
    rest: tuple[ChunkRecord, ...] = ()

    @classmethod
    def from_records(cls, records: Sequence[ChunkRecord], places: bool = True) -> ChunkColumns:
        """``records`` as columns; ``places``: keep their byte offsets and sizes (a layout)."""
        n = next((i for i, c in enumerate(records) if c.scope != _GLOBAL), len(records))
        shared = records[:n]
        meta = pack(
            [
                [c.key for c in shared],
                [c.dtype for c in shared],
                [list(c.global_shape) for c in shared],
            ]
        )
        offsets = [x for c in shared for x in c.offsets]
        lengths = [x for c in shared for x in c.lengths]
        boxes = np.asarray(offsets + lengths, I64).tobytes()
        where = (
            np.asarray([c.byte_offset for c in shared] + [c.nbytes for c in shared], I64).tobytes()
            if places
            else b""
        )
        return cls(meta, boxes, where, tuple(records[n:]))

    # -- reading ---------------------------------------------------------------------------
    def shared(self) -> ChunkMeta:
        """The shared part's keys, dtypes and shapes (decoded once per distinct blob)."""
        return meta_of(self.meta)

    def box_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The shared part's offsets and lengths, each int64 of ``shared().dims`` (views)."""
        flat = np.frombuffer(self.boxes, I64)
        half = len(flat) // 2
        return flat[:half], flat[half:]

    def place_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The shared part's byte offsets and sizes (zeros when the list has none)."""
        n = len(self.shared())
        if not self.places:
            zeros = np.zeros(n, I64)
            return zeros, zeros
        flat = np.frombuffer(self.places, I64)
        return flat[:n], flat[n:]

    def __len__(self) -> int:
        return len(self.shared()) + len(self.rest)

    @overload
    def __getitem__(self, i: int) -> list[Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[list[Any]]: ...

    def __getitem__(self, i: int | slice) -> list[Any] | list[list[Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.shared())
        if i < 0:
            i += len(self)
        if not 0 <= i < n + len(self.rest):
            raise IndexError(f"chunk {i} of a list of {n + len(self.rest)}")
        if i >= n:
            return self.rest[i - n].to_msg()
        return self._record(i).to_msg()

    def __iter__(self) -> Iterator[list[Any]]:
        for record in self.records():
            yield record.to_msg()

    def records(self) -> list[ChunkRecord]:
        """Every chunk as a record (the shared part's checksums ``None``)."""
        meta = self.shared()
        offsets, lengths = (a.tolist() for a in self.box_arrays())
        at, size = (a.tolist() for a in self.place_arrays())
        out = []
        for j, (key, dtype, shape) in enumerate(
            zip(meta.keys, meta.dtypes, meta.shapes, strict=True)
        ):
            a, b = meta.starts[j], meta.starts[j + 1]
            box = tuple(offsets[a:b]), tuple(lengths[a:b])
            out.append(ChunkRecord(key, dtype, shape, *box, at[j], size[j]))
        return out + list(self.rest)

    def _record(self, j: int) -> ChunkRecord:
        meta = self.shared()
        offsets, lengths = self.box_arrays()
        at, size = self.place_arrays()
        a, b = meta.starts[j], meta.starts[j + 1]
        return ChunkRecord(
            meta.keys[j],
            meta.dtypes[j],
            meta.shapes[j],
            tuple(offsets[a:b].tolist()),
            tuple(lengths[a:b].tolist()),
            int(at[j]),
            int(size[j]),
        )

    def with_meta_size(self, nbytes: int) -> ChunkColumns:
        """This layout with its blob chunk (``__meta__``, in ``rest``) resized to ``nbytes``:
        the blob's size changes every step, the rest of a layout once per epoch."""
        rest = tuple(
            replace(c, global_shape=(nbytes,), lengths=(nbytes,), nbytes=nbytes, crc=None)
            if c.key == META_KEY
            else c
            for c in self.rest
        )
        return replace(self, rest=rest)

    # -- the wire --------------------------------------------------------------------------
    def to_msg(self) -> list[Any]:
        return [self.meta, self.boxes, self.places, [c.to_msg() for c in self.rest]]

    @classmethod
    def from_msg(cls, msg: Any, what: str = "chunk columns") -> ChunkColumns:
        """Decode and check (MalformedManifest names the first bad field)."""
        meta, boxes, places, rest = need_list(msg, what, 4)
        for name, value in (("meta", meta), ("boxes", boxes), ("places", places)):
            if not isinstance(value, bytes):
                raise MalformedManifest(f"{what} {name} must be bytes, not {type(value).__name__}")
        shared = meta_of(meta)
        if len(boxes) != 16 * shared.dims:
            raise MalformedManifest(
                f"{what} boxes has {len(boxes)} bytes; {len(shared)} chunks of {shared.dims} "
                f"dimensions in all need {16 * shared.dims}"
            )
        if places and len(places) != 16 * len(shared):
            raise MalformedManifest(
                f"{what} places has {len(places)} bytes, not {16 * len(shared)}"
            )
        records = tuple(
            ChunkRecord.from_msg(c, f"{what} chunk {len(shared) + i}")
            for i, c in enumerate(need_list(rest, f"{what} rest"))
        )
        # The blob kept is the one already known: equal ranks' lists share one object, and the
        # copy each message brought is freed with it (at 10,000 ranks, 400 MB of fresh memory).
        out = cls(shared.blob or meta, boxes, places, records)
        offsets, lengths = out.box_arrays()
        # Two passes over the boxes (every message of 10,000 ranks is checked at the edge).
        if len(offsets) and int(np.frombuffer(boxes, I64).min()) < 0:
            raise MalformedManifest(f"{what} has a negative offset or length")
        past = shared.sizes - lengths < offsets  # no overflow: both sides are non-negative
        if len(offsets) and past.any():
            d = int(np.flatnonzero(past)[0])
            j = int(np.searchsorted(shared.starts, d, side="right")) - 1
            raise MalformedManifest(
                f"{what} chunk {j} ({shared.keys[j]!r}): its box ends at "
                f"{int(offsets[d]) + int(lengths[d])} in dimension {d - shared.starts[j]}, "
                f"past the tensor's {int(shared.sizes[d])}"
            )
        if places and int(np.frombuffer(places, I64).min()) < 0:
            raise MalformedManifest(f"{what} has a negative byte offset or size")
        return out
