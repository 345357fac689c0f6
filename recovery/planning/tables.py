"""Columnar chunk lists: the planner's input as arrays, one row per rank, not one object per chunk.

A job of 10,000 ranks with 1,000 tensors each has ten million chunks per side; as Python
objects, merely reading their keys, dtypes, shapes and boxes takes seconds. Ranks list their
tensors in one order (the model's), so a side of the plan is a :class:`ChunkTable` (each
tensor's key, dtype and global shape stored once; the offsets and lengths of every rank's box
as int64 arrays, a row per rank) plus, per rank, the chunks that do not fit it (``rest``: a
rank's private state after its row, or a whole list in another order, such as FSDP1's flat
shards), planned chunk by chunk.

This module builds those tables from chunk objects, from decoded chunk records and from
chunk columns (``peerckpt/columns.py``: what ranks send, boxes as raw int64 and the keys,
dtypes and shapes as one blob that equal ranks share), and back. Pure functions, no I/O; it
never plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, count, repeat
from operator import attrgetter, itemgetter, ne
from typing import Any

import numpy as np

from peerckpt.boxes import Box
from peerckpt.columns import ChunkColumns, ChunkMeta, meta_of
from peerckpt.manifest import chunk_name

_META = attrgetter("key", "dtype", "global_shape")
_BOX = attrgetter("box")
_SAMPLES = 16  # lists looked at to choose the table's width


@dataclass(eq=False, slots=True)
class ChunkTable:
    """Chunk lists of several ranks that share one list of tensors, as arrays.

    Row ``i`` is rank ``ranks[i]`` (ascending); its chunk ``j`` is a box of tensor
    ``keys[j]`` (``dtypes[j]``, ``shapes[j]``) whose offsets and lengths along dimension
    ``d`` are ``offsets[starts[j] + d, i]`` and ``lengths[starts[j] + d, i]``: column-major,
    so that one tensor's boxes on every rank are contiguous.
    """

    ranks: list[int]
    keys: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: np.ndarray  # int64, (starts[-1], len(ranks))
    lengths: np.ndarray
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = [0, *np.cumsum([len(s) for s in self.shapes]).tolist()]

    @property
    def width(self) -> int:
        """Chunks per row."""
        return len(self.keys)

    def box(self, row: int, j: int) -> Box:
        """The box of chunk ``j`` of row ``row``, as an object."""
        a, b = self.starts[j], self.starts[j + 1]
        return Box(tuple(self.offsets[a:b, row].tolist()), tuple(self.lengths[a:b, row].tolist()))

    def row_chunks(self, row: int, cls: type[Any]) -> list[Any]:
        """Row ``row`` as chunk objects of ``cls`` (HeldChunk or WantedChunk)."""
        offsets, lengths = self.offsets[:, row].tolist(), self.lengths[:, row].tolist()
        starts = self.starts
        return [
            cls(
                key,
                dtype,
                shape,
                Box(
                    tuple(offsets[starts[j] : starts[j + 1]]),
                    tuple(lengths[starts[j] : starts[j + 1]]),
                ),
            )
            for j, (key, dtype, shape) in enumerate(
                zip(self.keys, self.dtypes, self.shapes, strict=True)
            )
        ]


@dataclass(eq=False, slots=True)
class ChunkLists:
    """One side of a plan: every rank's chunks, a table of the common ones and the rest.

    A rank of ``table`` lists its row's chunks first, then ``rest[rank]``; any other rank
    lists ``rest[rank]`` only. ``rest`` holds chunk objects (HeldChunk or WantedChunk).
    """

    table: ChunkTable | None
    rest: dict[int, list[Any]]

    def ranks(self) -> list[int]:
        """Every rank with a list (possibly empty), ascending."""
        return sorted({*(self.table.ranks if self.table else ()), *self.rest})

    def to_chunks(self, cls: type[Any]) -> dict[int, list[Any]]:
        """Every rank's list as chunk objects (``cls`` for the table's rows)."""
        out: dict[int, list[Any]] = {}
        if self.table is not None:
            for row, rank in enumerate(self.table.ranks):
                out[rank] = self.table.row_chunks(row, cls)
        for rank, chunks in self.rest.items():
            out.setdefault(rank, []).extend(chunks)
        return out


def _width(metas: list[list[Any]]) -> int:
    """The prefix of the first list that a sample of the others share (at least half of it)."""
    template = metas[0]
    width = len(template)
    for meta in metas[:: max(1, len(metas) // _SAMPLES)]:
        # The first position where they differ, found in C.
        prefix = next(compress(count(), map(ne, meta, template)), min(len(meta), width))
        if prefix >= max(1, len(template) // 2):
            width = min(width, prefix)
    return width


def _table(
    ranks: list[int],
    metas: list[list[tuple[str, str, Any]]],
    boxes: list[Sequence[Any]],
    boxes_of: Any,
) -> tuple[ChunkTable | None, set[int]]:
    """The table of the ranks whose lists start with the first one's ``width`` chunks, and
    the ranks in it. ``boxes_of(row, width)`` gives a row's first ``width`` boxes as
    (offsets, lengths) pairs of integer sequences."""
    if not metas or not metas[0]:
        return None, set()
    width = _width(metas)
    if not width:
        return None, set()
    template = metas[0][:width]
    keys = [m[0] for m in template]
    dtypes = [m[1] for m in template]
    shapes = [tuple(m[2]) for m in template]
    ndims = [len(s) for s in shapes]
    dims = sum(ndims)
    # Per box: its offsets' and its lengths' lengths, as every row must have them.
    expected = np.repeat(np.asarray(ndims, np.int64), 2)
    members: list[int] = []
    flats: list[np.ndarray] = []
    for i, meta in enumerate(metas):
        if meta[:width] != template:
            continue
        pairs = boxes_of(i, width)
        sizes = np.fromiter(map(len, chain.from_iterable(pairs)), np.int64, count=2 * width)
        if not np.array_equal(sizes, expected):
            continue  # a box of another dimensionality: planned (and rejected) chunk by chunk
        ints = chain.from_iterable(chain.from_iterable(pairs))
        flats.append(np.fromiter(ints, np.int64, count=2 * dims))
        members.append(i)
    if not members:
        return None, set()
    flat = np.stack(flats)
    # Columns of the flat rows: box j's offsets, then its lengths.
    starts = [0, *np.cumsum(ndims).tolist()]
    off_idx = np.empty(dims, np.int64)
    len_idx = np.empty(dims, np.int64)
    for j, n in enumerate(ndims):
        base = 2 * starts[j]
        off_idx[starts[j] : starts[j + 1]] = np.arange(base, base + n)
        len_idx[starts[j] : starts[j + 1]] = np.arange(base + n, base + 2 * n)
    table = ChunkTable(
        [ranks[i] for i in members],
        keys,
        dtypes,
        shapes,
        np.ascontiguousarray(flat[:, off_idx].T),
        np.ascontiguousarray(flat[:, len_idx].T),
        starts,
    )
    return table, set(members)


def from_chunks(chunks: Mapping[int, Sequence[Any]]) -> ChunkLists:
    """Chunk objects (rank → list of HeldChunk or WantedChunk) as a table and the rest."""
    ranks = sorted(chunks)
    rows = [chunks[rank] for rank in ranks]
    metas = [list(map(_META, row)) for row in rows]

    def boxes_of(i: int, width: int) -> list[Box]:
        return list(map(_BOX, rows[i][:width]))

    table, members = _table(ranks, metas, rows, boxes_of)
    width = table.width if table else 0
    rest = {
        rank: list(row[width:]) if i in members else list(row)
        for i, (rank, row) in enumerate(zip(ranks, rows, strict=True))
    }
    return ChunkLists(table, rest)


_RECORD_META = itemgetter(0, 1, 2)  # key, dtype, global shape of a chunk record message
_RECORD_BOX = itemgetter(3, 4)  # offsets, lengths
_SCOPE = itemgetter(-1)
_GLOBAL = "global"


def from_records(
    records: Mapping[int, Sequence[list[Any]]], cls: type[Any], rename: bool
) -> ChunkLists:
    """Decoded chunk records (``ChunkRecord.to_msg()`` lists: key, dtype, global shape,
    offsets, lengths, …, scope) of every rank as a table and the rest.

    A rank's private chunks (scope other than "global") go to ``rest`` as ``cls`` objects,
    renamed ``<key>@<rank>`` when ``rename`` (the held side: never taken for replicas of each
    other). Only the shared chunks before a rank's first private one can be in the table.
    """
    ranks = sorted(records)
    shared: list[Sequence[list[Any]]] = []
    private: list[list[list[Any]]] = []
    for rank in ranks:
        row = records[rank]
        # The first chunk that is not shared, found in C.
        first = next(compress(count(), map(ne, map(_SCOPE, row), repeat(_GLOBAL))), len(row))
        shared.append(row[:first])
        private.append(list(row[first:]))
    metas = [list(map(_RECORD_META, row)) for row in shared]

    def boxes_of(i: int, width: int) -> list[tuple[list[int], list[int]]]:
        return list(map(_RECORD_BOX, shared[i][:width]))

    table, members = _table(ranks, metas, shared, boxes_of)
    width = table.width if table else 0
    rest: dict[int, list[Any]] = {}
    for i, rank in enumerate(ranks):
        msgs = [*shared[i][width:], *private[i]] if i in members else [*shared[i], *private[i]]
        rest[rank] = [_chunk(cls, msg, rank, rename) for msg in msgs]
    return ChunkLists(table, rest)


def _chunk(cls: type[Any], msg: list[Any], rank: int, rename: bool) -> Any:
    key, dtype, shape, offsets, lengths = msg[:5]
    if rename:
        key = chunk_name(key, msg[-1], rank)
    return cls(key, dtype, tuple(shape), Box(tuple(offsets), tuple(lengths)))


_BLOCK = 256  # ranks transposed at a time: their rows stay in cache while they are spread


def from_columns(
    columns: Mapping[int, ChunkColumns | Sequence[list[Any]]],
    cls: type[Any],
    rename: bool,
    table: ChunkTable | None = None,
) -> ChunkLists:
    """Every rank's list as a table and the rest, from ``ChunkColumns`` (``peerckpt/columns.py``)
    as ranks send them; a rank whose list is records (a restarted coordinator's rebuild, a
    durable checkpoint) is read as ``from_records`` reads it.

    The table's ranks are those whose ``meta`` is the most common one's among a sample (equal
    bytes: compared, never decoded again); their boxes become its arrays with one blocked
    transpose, their ``rest`` the chunks after their row. Every other rank's chunks are in
    ``rest``. ``rename``: the held side, whose private chunks are named ``<key>@<rank>``.
    ``table``: the table of these lists, already made (``LayoutTable``: as layouts arrived).
    Nothing here is per chunk but the ``rest``.
    """
    ranks = sorted(columns)
    # Ranks whose list is records go to ``rest``, chunk by chunk.
    cols = {r: c for r in ranks if isinstance(c := columns[r], ChunkColumns)}
    if not cols:  # records only (a rebuild, a durable checkpoint)
        return from_records(columns, cls, rename)
    if table is None:
        step = max(1, len(cols) // _SAMPLES)
        template = _common_meta([cols[r].meta for r in list(cols)[::step]])
        members = [r for r in ranks if r in cols and cols[r].meta == template]
        table = _stacked(meta_of(template), [cols[r] for r in members], members)
    inside = set(table.ranks) if table is not None else set()
    rest: dict[int, list[Any]] = {}
    for rank in ranks:
        c = columns[rank]
        if rank in inside:
            msgs: Sequence[list[Any]] = [r.to_msg() for r in cols[rank].rest]
        else:
            msgs = list(c)
        rest[rank] = [_chunk(cls, msg, rank, rename) for msg in msgs]
    return ChunkLists(table, rest)


def _stacked(meta: ChunkMeta, rows: list[ChunkColumns], ranks: list[int]) -> ChunkTable | None:
    """The table of ``rows`` (all of ``meta``), by blocks of ranks."""
    if not rows or not len(meta):
        return None
    dims = meta.dims
    offsets = np.empty((dims, len(rows)), np.int64)
    lengths = np.empty((dims, len(rows)), np.int64)
    block = np.empty((min(_BLOCK, len(rows)), 2 * dims), np.int64)  # reused: stays in memory
    for at in range(0, len(rows), _BLOCK):
        n = min(_BLOCK, len(rows) - at)
        for i, c in enumerate(rows[at : at + n]):
            block[i] = np.frombuffer(c.boxes, np.int64)
        offsets[:, at : at + n] = block[:n, :dims].T
        lengths[:, at : at + n] = block[:n, dims:].T
    return _table_of(meta, ranks, offsets, lengths)


def _table_of(
    meta: ChunkMeta, ranks: list[int], offsets: np.ndarray, lengths: np.ndarray
) -> ChunkTable:
    return ChunkTable(
        ranks, list(meta.keys), list(meta.dtypes), list(meta.shapes), offsets, lengths,
        list(meta.starts),
    )  # fmt: skip


def _common_meta(sample: list[bytes]) -> bytes:
    """The most common blob of ``sample`` (equal bytes; the first among equals)."""
    counts: list[list[Any]] = []
    for blob in sample:
        for entry in counts:
            if entry[0] == blob:
                entry[1] += 1
                break
        else:
            counts.append([blob, 1])
    return max(counts, key=lambda entry: entry[1])[0] if counts else b""


class LayoutTable:
    """The held side's table, filled as the ranks' layouts arrive, never at recovery.

    A row per rank of the epoch (ascending), allocated at the first layout in columns: its
    ``meta`` is the table's, and a rank with another (or with records) is left out (the
    planner takes its chunks one by one). Each layout is one column write (tens of µs at
    1,000 tensors), so the table of 10,000 ranks is there when a recovery needs it; a
    blocked transpose of every rank's boxes there cost 0.2–2.5 s on this machine.

    ``table()`` hands out the arrays themselves; a layout that arrives after that (a rank's
    layout changed) first copies them, so a table handed out never changes.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = sorted(ranks)
        self._row = {rank: i for i, rank in enumerate(self.ranks)}
        self.meta: bytes | None = None
        self._offsets: np.ndarray | None = None
        self._lengths: np.ndarray | None = None
        self._filled = np.zeros(len(self.ranks), bool)
        self._lent = False  # the arrays are in a table handed out: copy before writing

    def add(self, rank: int, layout: ChunkColumns | Sequence[list[Any]]) -> None:
        """``rank``'s layout arrived (it replaces the one before)."""
        row = self._row.get(rank)
        if row is None:
            return
        if not isinstance(layout, ChunkColumns) or not len(meta_of(layout.meta)):
            self._filled[row] = False
            return
        if self.meta is None:
            self.meta = layout.meta
            dims = meta_of(layout.meta).dims
            self._offsets = np.empty((dims, len(self.ranks)), np.int64)
            self._lengths = np.empty((dims, len(self.ranks)), np.int64)
        if layout.meta != self.meta:
            self._filled[row] = False
            return
        assert self._offsets is not None and self._lengths is not None
        if self._lent:
            self._offsets, self._lengths = self._offsets.copy(), self._lengths.copy()
            self._lent = False
        offsets, lengths = layout.box_arrays()
        self._offsets[:, row] = offsets
        self._lengths[:, row] = lengths
        self._filled[row] = True

    def table(self) -> ChunkTable | None:
        """The table of the ranks whose layout is in it (None before any)."""
        if self.meta is None or not self._filled.any():
            return None
        assert self._offsets is not None and self._lengths is not None
        meta = meta_of(self.meta)
        if self._filled.all():
            self._lent = True
            return _table_of(meta, list(self.ranks), self._offsets, self._lengths)
        rows = np.flatnonzero(self._filled)
        ranks = [self.ranks[i] for i in rows.tolist()]
        return _table_of(meta, ranks, self._offsets[:, rows], self._lengths[:, rows])
