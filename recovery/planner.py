"""Resharding recovery plans: which bytes every rank of the new epoch reads, and from where.

Pure functions, no I/O. The old epoch left committed snapshots, each a list of chunks (boxes of
global tensors) held by the old rank's node and its buddies. The new epoch may have another
world size or layout; every new rank says which boxes it wants. :func:`plan_reads` covers each
wanted box exactly with pieces of held chunks and picks one source per piece:

1. the rank's own previous snapshot on its own node (no network, no copy to wait for);
2. any other copy on its own node;
3. otherwise the peer node with the fewest bytes assigned so far in this plan (then node id);
4. durable storage (the holder ``STORAGE``) only for chunks no memory copy of survived.

Identical boxes held by several old ranks (data-parallel replicas) are one *logical chunk* with
several sources, so a destination reads each piece once. Distinct held boxes of a key must be
disjoint; overlapping ones mean the snapshots came from two layouts and are rejected.

A job of 10,000 ranks with 1,000 tensors each hands the planner ten million wanted chunks, so
the work per chunk must stay in C (docs/performance.md, "Planning at scale"):

* Ranks list their tensors in one order (the model's), so chunk lists are read as a table
  (:class:`_Table`): each list's keys, dtypes and shapes are checked against the first list's
  with one ``map`` and one ``==``, and its boxes taken with another ``map``. A *column* is one
  tensor's box on every rank. Equal columns are found by proposing groups from a few rows and
  confirming them on every row in C: tensors whose held columns are equal (same shape and
  sharding) share one index of held boxes, and equal wanted columns share one cover per rank.
  Chunks past the common prefix (each rank's private state) and lists in another order go one
  by one through the same rules: the reference path that the tests compare the table with.
* Held boxes are checked in bulk (``box_array``, ``is_grid`` in ``recovery/chunks.py``); a
  wanted box equal to a held one is found by hashing; other covers intersect what a
  ``BoxTree`` finds.
* A rank's reads are made on demand (:class:`_RankReads`) from those shared tables. The only
  work per piece while planning is picking the peer of a network read, which depends on every
  pick before it.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, count, islice
from operator import attrgetter, itemgetter, ne
from typing import Any, NamedTuple, overload

import numpy as np

from peerckpt.errors import RecoveryFailed, StateMismatch
from peerckpt.recovery.chunks import Box, BoxTree, Overlap, box_array, intersect, is_grid, subtract

# Bytes per element of torch's dtypes, by the name ``str(dtype)`` gives without "torch.".
_ITEMSIZES: dict[str, int] = {
    **dict.fromkeys(["bool", "uint8", "int8", "qint8", "quint8", "quint4x2", "quint2x4"], 1),
    **dict.fromkeys(["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"], 1),
    **dict.fromkeys(["float8_e8m0fnu", "float4_e2m1fn_x2", "bit", "bits8", "bits1x8"], 1),
    **dict.fromkeys(["bits2x4", "bits4x2"], 1),
    # Sub-byte integer dtypes take a byte per element in torch's storage.
    **dict.fromkeys([f"{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8)], 1),
    **dict.fromkeys(["float16", "half", "bfloat16", "int16", "short", "uint16", "bits16"], 2),
    **dict.fromkeys(["float32", "float", "int32", "int", "uint32", "qint32"], 4),
    **dict.fromkeys(["complex32", "chalf"], 4),
    **dict.fromkeys(["float64", "double", "int64", "long", "uint64", "complex64", "cfloat"], 8),
    **dict.fromkeys(["complex128", "cdouble"], 16),
}
_MAX_LISTED = 8  # missing regions named in one error; the rest are counted
STORAGE = -1  # the durable tier as a holder: read only where no memory copy survived


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name ("float32", "torch.bfloat16", …)."""
    size = _ITEMSIZES.get(dtype.removeprefix("torch."))
    if size is None:
        raise StateMismatch(f"unknown dtype {dtype!r}: no element size is known for it")
    return size


@dataclass(frozen=True, slots=True)
class HeldChunk:
    """A chunk in an old rank's committed snapshot: ``box`` of tensor ``key``."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class WantedChunk:
    """A box of tensor ``key`` that a new rank needs to restore."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


class Read(NamedTuple):
    """Copy ``region`` of ``key`` from chunk ``src_box`` of old rank ``source_rank``'s snapshot,
    as stored on ``source_node``, into the new rank's chunk ``dst_box``.

    ``region`` lies in both boxes (global coordinates); ``nbytes`` is its size. A read whose
    ``source_node`` is the new rank's own node needs no network.
    """

    source_node: int
    source_rank: int
    key: str
    src_box: Box
    dst_box: Box
    region: Box
    nbytes: int


# Read((...)) without the named tuple's Python-level __new__: plans make millions of them.
_new_read = partial(tuple.__new__, Read)


def plan_reads(
    held: dict[int, list[HeldChunk]],
    holders: dict[int, list[int] | set[int]],
    wanted: dict[int, list[WantedChunk]],
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
) -> dict[int, Sequence[Read]]:
    """For every new rank, the reads that fill its wanted chunks exactly, in wanted order.

    ``held``: old rank → chunks of its committed snapshot; ``holders``: old rank → nodes with a
    complete verified copy of it; ``wanted``: new rank → chunks it needs; ``new_nodes``: new
    rank → node; ``previous``: new rank → the old rank the same process was (None if new).
    A rank's reads are a read-only sequence made on demand; ``list()`` it to keep them.

    Raises StateMismatch when a wanted chunk's dtype or global shape differs from the held one,
    or held boxes of a key overlap without being equal; RecoveryFailed, naming every missing
    key and region, when some wanted element has no surviving copy.
    """
    return _plan(held, holders, wanted, new_nodes, previous, tables=True)


def _plan(
    held: dict[int, list[HeldChunk]],
    holders: dict[int, list[int] | set[int]],
    wanted: dict[int, list[WantedChunk]],
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
    tables: bool,
) -> dict[int, Sequence[Read]]:
    """:func:`plan_reads`; ``tables=False`` plans every chunk on its own (the reference path)."""
    # A big plan allocates millions of small objects and no garbage cycles; left on, the
    # cyclic collector rescans them over and over and triples the planning time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        order = sorted(wanted)
        for new in order:
            if new not in new_nodes:
                raise ValueError(f"new rank {new} wants chunks but has no node in new_nodes")
        old = _Held(held, holders, tables)
        return _Planner(old, wanted, order, new_nodes, previous, tables).plan()
    finally:
        if was_enabled:
            gc.enable()


_META = attrgetter("key", "dtype", "global_shape")
_BOX = attrgetter("box")
_FIRST = itemgetter(0)
_SAMPLES = 16  # lists looked at to choose the table's width and its candidate families
_FEW = 32  # boxes below which checking them one by one beats numpy's fixed costs

_Chunk = HeldChunk | WantedChunk


@dataclass(eq=False, slots=True)
class _Table:
    """Chunk lists read as a table: row ``i`` is list ``members[i]``, whose first ``width``
    chunks have the keys, dtypes and shapes of ``template`` (the first list's); ``boxes[i]``
    are their boxes. Lists that differ there, and chunks past the width, are not in it."""

    members: list[int]
    width: int
    template: list[Any]
    boxes: list[list[Box]]

    def column(self, j: int) -> tuple[Box, ...]:
        """The box of chunk ``j`` of every row."""
        return tuple(map(itemgetter(j), self.boxes))

    def families(self, positions: Iterable[int], signature: Any) -> list[list[int]]:
        """``positions`` grouped into columns that are equal and have equal ``signature(j)``.

        A few rows propose the groups; every row then confirms them in C, or splits them.
        """
        sample = self.boxes[:: max(1, len(self.boxes) // _SAMPLES)]
        proposed: dict[tuple[Any, ...], list[int]] = {}
        for j in positions:
            proposed.setdefault((signature(j), *(boxes[j] for boxes in sample)), []).append(j)
        groups = list(proposed.values())
        if not groups:
            return []
        # A row confirms every group at once when its boxes equal themselves looked up through
        # the first of each one's group.
        first = {j: group[0] for group in groups for j in group}
        if len(first) == self.width:  # every column: compare with the row as it is
            get = itemgetter(*(first[j] for j in range(self.width)), 0)
            confirmed = all(get(boxes) == (*boxes, boxes[0]) for boxes in self.boxes)
        else:
            get_members, get_firsts = itemgetter(*first, 0), itemgetter(*first.values(), 0)
            confirmed = all(get_members(boxes) == get_firsts(boxes) for boxes in self.boxes)
        if confirmed:
            return groups
        families: list[list[int]] = []
        for group in groups:  # rare: the sample rows looked alike, others do not
            alike: dict[tuple[Box, ...], list[int]] = {}
            for j in group:
                alike.setdefault(self.column(j), []).append(j)
            families.extend(alike.values())
        return families


def _scan(rows: list[Sequence[Any]]) -> _Table:
    """Read ``rows`` as a table: as wide as the prefix a sample of them share with the first
    (at least half of it), with the rows that have that prefix."""
    if not rows:
        return _Table([], 0, [], [])
    template = list(map(_META, rows[0]))
    width = len(template)
    for row in rows[:: max(1, len(rows) // _SAMPLES)]:
        meta = list(map(_META, row))
        # The first position where they differ, found in C.
        prefix = next(compress(count(), map(ne, meta, template)), min(len(meta), width))
        if prefix >= max(1, len(template) // 2):
            width = min(width, prefix)
    if not width:
        return _Table([], 0, [], [])
    del template[width:]
    members = []
    boxes = []
    for i, row in enumerate(rows):
        head = row[:width]
        if list(map(_META, head)) == template:
            members.append(i)
            boxes.append(list(map(_BOX, head)))
    return _Table(members, width, list(rows[0][:width]), boxes)


# -- what survived: old ranks' chunks by key, indexed on demand ------------------------------


@dataclass(eq=False, slots=True)
class _Sources:
    """Where a logical chunk can be read from; shared by every chunk held by the same ranks."""

    ranks: list[int]  # ascending
    rankset: frozenset[int]
    on_node: dict[int, tuple[int, int]]  # node → (node, smallest old rank with a copy there)
    # For picking a peer, nodes are named by their place in the load list (places sort as
    # node ids do). One or two nodes: ``pick`` is (first place, second place, first's (node,
    # rank), second's), the second being the first when alone. More: ``pick`` is None, and
    # ``heap`` holds (load when pushed, place); entries go stale as loads grow and are
    # refreshed on the way.
    pick: tuple[int, int, tuple[int, int], tuple[int, int]] | None
    heap: list[tuple[int, int]]
    by_place: dict[int, tuple[int, int]]  # place → (node, rank)


_Logical = tuple[Box, _Sources]  # one distinct held box of a key and where it can be read
_Piece = tuple[_Logical, Box, int]  # a held chunk, the region read from it, its element count
_Problem = tuple[Box, list[int] | None]  # a region held by no one (None) or by ranks all gone
_Cover = tuple[tuple[_Piece, ...], tuple[_Problem, ...]]
# Per reader: source box, region, element count, and (node, rank) or, for a network read,
# the sources to pick a peer from.
_Entry = tuple[Box, Box, int, tuple[int, int] | _Sources]
_Network = tuple[int, int, tuple[int, int], tuple[int, int], int, _Sources]
_NO_PICK = (-1, -1, (-1, -1), (-1, -1))


@dataclass(eq=False, slots=True)
class _Index:
    """The distinct held boxes of one or more keys that are sharded alike, and covers found."""

    shape: tuple[int, ...]
    chunks: list[_Logical]  # non-empty, in the order of their first holder
    by_box: dict[Box, _Logical] | None  # None on the reference path: every cover intersects
    tree: BoxTree[_Sources] | None = None
    covers: dict[Box, _Cover] = field(default_factory=dict)  # those not a held box


@dataclass(eq=False, slots=True)
class _Column:
    """The boxes of keys sharded alike, one per table row, and their index once built."""

    boxes: tuple[Box, ...]
    index: _Index | None = None


@dataclass(eq=False, slots=True)
class _Key:
    """One key of the old snapshots: its meta, where its boxes are, and its index once built."""

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    first_rank: int
    column: _Column | None = None  # its box on every table row, when that is all
    ranks: list[int] = field(default_factory=list)  # otherwise every (rank, box), rank order
    boxes: list[Box] = field(default_factory=list)
    index: _Index | None = None


class _Sourcing(dict[int, _Sources]):
    """The sources of chunks by the old ranks holding them; as a dict, rank → the sources of
    chunks only that rank holds (looked up in C, made on first use)."""

    def __init__(self, holders: dict[int, list[int] | set[int]]) -> None:
        super().__init__()
        self.holders = {rank: frozenset(nodes) for rank, nodes in holders.items()}
        nodes = sorted(set().union(*self.holders.values()))
        self.place = {node: place for place, node in enumerate(nodes)}
        self.load = [0] * len(nodes)  # bytes each node sends in this plan, by place
        self._groups: dict[tuple[int, ...], _Sources] = {}

    def __missing__(self, rank: int) -> _Sources:
        sources = self[rank] = self.group((rank,))
        return sources

    def group(self, ranks: tuple[int, ...]) -> _Sources:
        """The sources of chunks held by exactly ``ranks`` (ascending)."""
        src = self._groups.get(ranks)
        if src is None:
            on_node: dict[int, tuple[int, int]] = {}
            for rank in ranks:  # ascending, so each node maps to its smallest rank
                for node in sorted(self.holders.get(rank, ())):
                    on_node.setdefault(node, (node, rank))
            if len(on_node) > 1:
                on_node.pop(STORAGE, None)  # memory first; storage only when nothing else is left
            places = sorted(self.place[node] for node in on_node)
            by_place = {self.place[node]: pair for node, pair in on_node.items()}
            pick = None
            heap = []
            if len(places) > 2:
                heap = sorted((self.load[place], place) for place in places)  # a heap
            elif places:
                first, second = places[0], places[-1]
                pick = (first, second, by_place[first], by_place[second])
            src = _Sources(list(ranks), frozenset(ranks), on_node, pick, heap, by_place)
            self._groups[ranks] = src
        return src


class _Held:
    """The old ranks' chunks by key; each key's index is built (and checked) when first wanted."""

    def __init__(
        self,
        held: dict[int, list[HeldChunk]],
        holders: dict[int, list[int] | set[int]],
        tables: bool,
    ) -> None:
        self.sourcing = _Sourcing(holders)
        self.tables = tables
        self.keys: dict[str, _Key] = {}
        ranks = sorted(held)
        rows: list[Sequence[Any]] = [held[rank] for rank in ranks]
        table = _scan(rows) if tables else _Table([], 0, [], [])
        self.rows = [ranks[i] for i in table.members]  # the old rank of each table row
        at: dict[str, list[int]] = {}  # key → its columns
        for j, chunk in enumerate(table.template):
            self._meta(self.rows[0], chunk)  # a key listed twice must agree with itself
            at.setdefault(chunk.key, []).append(j)
        in_table = set(table.members)
        for i, (rank, row) in enumerate(zip(ranks, rows, strict=True)):
            for chunk in islice(row, table.width, None) if i in in_table else row:
                info = self._meta(rank, chunk)
                info.ranks.append(rank)
                info.boxes.append(chunk.box)
        alone = [js[0] for key, js in at.items() if len(js) == 1 and not self.keys[key].ranks]
        infos = [self.keys[chunk.key] for chunk in table.template]
        for family in table.families(alone, lambda j: infos[j].shape):
            column = _Column(table.column(family[0]))
            for j in family:
                infos[j].column = column
        for key, js in at.items():
            info = self.keys[key]
            if info.column is not None:
                continue
            # Listed twice, or also by other ranks: merge into (rank, box) pairs, rank order.
            pairs = [
                (rank, box)
                for j in js
                for rank, box in zip(self.rows, table.column(j), strict=True)
            ]
            pairs.extend(zip(info.ranks, info.boxes, strict=True))
            pairs.sort(key=lambda pair: pair[0])  # stable: a rank's chunks keep their order
            info.ranks = [rank for rank, _ in pairs]
            info.boxes = [box for _, box in pairs]

    def _meta(self, rank: int, chunk: _Chunk) -> _Key:
        """The key of ``chunk``, created at its first holder, checked against it after."""
        info = self.keys.get(chunk.key)
        if info is None:
            size = itemsize(chunk.dtype)  # an unknown dtype fails here, naming it
            info = self.keys[chunk.key] = _Key(chunk.dtype, size, tuple(chunk.global_shape), rank)
        elif chunk.dtype != info.dtype or tuple(chunk.global_shape) != info.shape:
            raise StateMismatch(
                f"{chunk.key!r} is {chunk.dtype} {tuple(chunk.global_shape)} in old rank "
                f"{rank}'s snapshot but {info.dtype} {info.shape} in old rank "
                f"{info.first_rank}'s: the snapshots do not come from one model"
            )
        return info

    def index(self, key: str, info: _Key) -> _Index:
        """The index of ``key``'s held boxes, shared with keys whose column is the same."""
        column = info.column
        if column is not None:
            if column.index is None:
                column.index = self._build(key, info.shape, self.rows, column.boxes)
            return column.index
        if info.index is None:
            info.index = self._build(key, info.shape, info.ranks, info.boxes)
        return info.index

    def _build(
        self, key: str, shape: tuple[int, ...], ranks: Sequence[int], boxes: Sequence[Box]
    ) -> _Index:
        """Index ``boxes`` (``boxes[i]`` held by ``ranks[i]``, ranks ascending), checking them."""
        distinct = dict.fromkeys(boxes)  # in the order of their first holder
        if len(distinct) == len(boxes):  # no replicas: one holder per box
            sources = list(map(self.sourcing.__getitem__, ranks))
            unique = list(boxes)
        else:
            groups: dict[Box, list[int]] = {}
            for box, rank in zip(boxes, ranks, strict=True):
                group = groups.get(box)
                if group is None:
                    groups[box] = [rank]
                elif group[-1] != rank:  # a rank listing a box twice still holds it once
                    group.append(rank)
            unique = list(groups)
            sources = [self.sourcing.group(tuple(group)) for group in groups.values()]
        if self.tables and len(unique) > _FEW:
            flat = _check_boxes(key, shape, unique, sources)
            nonempty = np.all(flat[:, 1] > 0, axis=1)
            chunks = list(compress(zip(unique, sources, strict=True), nonempty.tolist()))
            index = _Index(shape, chunks, dict(zip(map(_FIRST, chunks), chunks, strict=True)))
            if not is_grid(flat[nonempty]):
                _tree(key, index)  # overlapping boxes fail here, with the pair named
            return index
        for box, src in zip(unique, sources, strict=True):
            _check_box(key, shape, box, src)
        chunks = [
            (box, src) for box, src in zip(unique, sources, strict=True) if not box.is_empty()
        ]
        index = _Index(
            shape, chunks, {chunk[0]: chunk for chunk in chunks} if self.tables else None
        )
        if len(chunks) > 1:
            _tree(key, index)  # overlapping boxes fail here, with the pair named
        return index


def _check_box(key: str, shape: tuple[int, ...], box: Box, src: _Sources) -> None:
    try:
        box.check(shape)
    except ValueError as e:
        raise StateMismatch(f"old rank {src.ranks[0]} holds a bad chunk of {key!r}: {e}") from None


def _check_boxes(
    key: str, shape: tuple[int, ...], boxes: list[Box], sources: list[_Sources]
) -> np.ndarray:
    """``boxes`` as :func:`box_array` gives them, once all are inside ``shape``."""
    array = box_array(boxes, len(shape))
    if (
        array is not None
        and (array >= 0).all()
        and (array[:, 0] + array[:, 1] <= np.asarray(shape, np.int64)).all()
    ):
        return array
    for box, src in zip(boxes, sources, strict=True):  # name the first bad one
        _check_box(key, shape, box, src)
    raise AssertionError("unreachable: some box failed the bulk check")


def _tree(key: str, index: _Index) -> BoxTree[_Sources]:
    """The tree of ``index``, built (and its boxes checked pairwise) on first use."""
    if index.tree is None:
        try:
            index.tree = BoxTree(index.chunks)
        except Overlap as e:
            (a, a_src), (b, b_src) = e.a, e.b
            raise StateMismatch(
                f"held chunks of {key!r} overlap without being equal: {_show(a)} in "
                f"old rank(s) {a_src.ranks} and {_show(b)} in old rank(s) {b_src.ranks}; "
                "the snapshots do not come from one layout"
            ) from None
    return index.tree


def _cover(key: str, index: _Index, box: Box) -> _Cover:
    """The pieces of held chunks that make up ``box``, and what no surviving copy holds."""
    # A held box is looked up each time (cheaper than caching it); others are cached.
    hit = index.by_box.get(box) if index.by_box is not None else None
    if hit is not None:  # the wanted box is a held one: nothing to intersect
        if hit[1].on_node:
            return ((hit, box, math.prod(box.lengths)),), ()
        return (), ((box, hit[1].ranks),)
    cover = index.covers.get(box)
    if cover is None:
        cover = index.covers[box] = _intersect_cover(key, index, box)
    return cover


def _intersect_cover(key: str, index: _Index, box: Box) -> _Cover:
    """:func:`_cover` of a box that is not a held one, by intersecting what the tree finds."""
    try:
        box.check(index.shape)
    except ValueError as e:
        raise StateMismatch(f"a wanted chunk of {key!r}: {e}") from None
    if box.is_empty():  # trailing ranks of a Shard(0) want nothing: no tree to build for it
        return (), ()
    found = _tree(key, index).find(box)
    pieces: list[_Piece] = []
    gone: list[_Problem] = []
    total = 0
    for chunk in found:
        region = intersect(chunk[0], box)
        if region is None:
            continue
        # Share equal boxes rather than keep copies: a big plan holds millions of them.
        if region == box:
            region = box
        elif region == chunk[0]:
            region = chunk[0]
        elements = math.prod(region.lengths)
        total += elements
        if chunk[1].on_node:
            pieces.append((chunk, region, elements))
        else:
            gone.append((region, chunk[1].ranks))
    problems: list[_Problem] = []
    # Held boxes are disjoint (checked when indexed), so element counts decide exact cover.
    if total != math.prod(box.lengths):
        holes = [box]
        for chunk in found:
            holes = [h for hole in holes for h in subtract(hole, chunk[0])]
        problems.extend((hole, None) for hole in holes)
    problems.extend(gone)
    return tuple(pieces), tuple(problems)


def _show(box: Box) -> str:
    return f"offsets={box.offsets} lengths={box.lengths}"


def _missing_text(key: str, problem: _Problem) -> str:
    region, ranks = problem
    if ranks is None:
        return f"{key!r} {_show(region)} (held by no old rank)"
    return f"{key!r} {_show(region)} (every copy of old ranks {ranks} is gone)"


def _pick(src: _Sources, load: list[int], nbytes: int) -> tuple[int, int]:
    """The least-loaded node of ``src`` (then lowest id) with its rank; charge it ``nbytes``."""
    if src.pick is not None:
        first, second, first_pair, second_pair = src.pick
        if load[second] < load[first]:
            load[second] += nbytes
            return second_pair
        load[first] += nbytes
        return first_pair
    # Loads only grow, so a stale entry is too small: refresh it and look again. When the top
    # entry is current, every other entry's true load is at least as large.
    heap = src.heap
    while True:
        recorded, place = heap[0]
        current = load[place]
        if recorded == current:
            break
        heapq.heapreplace(heap, (current, place))
    load[place] = current + nbytes
    heapq.heapreplace(heap, (current + nbytes, place))
    return src.by_place[place]


# -- what is wanted: the plan ----------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Family:
    """Table columns that want the same boxes of keys sharing one index: one cover per row."""

    index: _Index
    column: tuple[Box, ...]
    positions: list[int] = field(default_factory=list)
    entries: list[tuple[_Entry, ...]] = field(default_factory=list)  # per table row
    # Per table row: its network reads in order, each as the sources' ``pick`` (or -1, -1 and
    # two dummies with a heap), then the element count and the sources.
    network: list[tuple[_Network, ...]] = field(default_factory=list)


class _Planner:
    """Plans the reads of every new rank, table first, then chunk by chunk, in rank order."""

    def __init__(
        self,
        old: _Held,
        wanted: dict[int, list[WantedChunk]],
        order: list[int],
        new_nodes: dict[int, int],
        previous: dict[int, int | None],
        tables: bool,
    ) -> None:
        self.old = old
        self.order = order
        self.rows: list[Sequence[Any]] = [wanted[new] for new in order]
        self.nodes = [new_nodes[new] for new in order]
        self.owns: list[int | None] = []
        for new, node in zip(order, self.nodes, strict=True):
            prev = previous.get(new)
            # The own slot counts only where it survived on this rank's node.
            alive = prev is not None and node in old.sourcing.holders.get(prev, ())
            self.owns.append(prev if alive else None)
        self.table = _scan(self.rows) if tables else _Table([], 0, [], [])
        self.members, self.width = self.table.members, self.table.width
        # (rank's place in order, chunk position) → what is missing there, sorted at the end
        self.missing: list[tuple[tuple[int, int], str]] = []

    def plan(self) -> dict[int, Sequence[Read]]:
        families, layout = self._families()
        for family in families:
            self._fill(family)
        plan: dict[int, Sequence[Read]] = {}
        row = 0  # the next table row; ranks go in order, table rows among them
        for place, new in enumerate(self.order):
            chunks = self.rows[place]
            if row < len(self.members) and self.members[row] == place:
                network = (
                    self._network(layout, row) if any(f.network[row] for f in families) else []
                )
                tail = self._reads(place, islice(chunks, self.width, None), self.width)
                plan[new] = _RankReads(layout, row, network, tail)
                row += 1
            else:
                plan[new] = _RankReads(None, 0, [], self._reads(place, chunks, 0))
        if self.missing:
            self.missing.sort(key=lambda item: item[0])  # stable: a cover keeps its order
            missing = list(dict.fromkeys(text for _, text in self.missing))
            listed = "; ".join(missing[:_MAX_LISTED])
            more = f"; and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
            raise RecoveryFailed(
                f"no surviving copy of: {listed}{more}. The old ranks that held this state and "
                "all of their buddies were lost together (or it was never saved). Use more "
                "--replicas, or a durable tier (persist=...) to fall back to storage."
            )
        return plan

    def _network(
        self, layout: list[tuple[_Family | None, str, int]], row: int
    ) -> list[tuple[int, int]]:
        """The peers of table row ``row``'s network reads, picked in order (and charged)."""
        load = self.old.sourcing.load
        picked: list[tuple[int, int]] = []
        pick = picked.append
        for family, _, size in layout:
            # The hot loop of a plan with many network reads: _pick, inlined.
            for first, second, first_pair, second_pair, elements, src in (
                family.network[row] if family else ()
            ):
                if first < 0:
                    pick(_pick(src, load, elements * size))
                    continue
                low, high = load[first], load[second]
                if high < low:
                    load[second] = high + elements * size
                    pick(second_pair)
                else:
                    load[first] = low + elements * size
                    pick(first_pair)
        return picked

    def _key(self, new: int, want: _Chunk) -> _Key | None:
        """The held key ``want`` reads, after checking they agree; None if no one held it."""
        info = self.old.keys.get(want.key)
        if info is not None and (
            want.dtype != info.dtype
            or (want.global_shape != info.shape and tuple(want.global_shape) != info.shape)
        ):
            raise StateMismatch(
                f"new rank {new} wants {want.key!r} as {want.dtype} {tuple(want.global_shape)}"
                f" but old rank {info.first_rank} saved it as {info.dtype} {info.shape}; "
                "restore into a model with the same parameters and dtypes"
            )
        return info

    def _families(self) -> tuple[list[_Family], list[tuple[_Family | None, str, int]]]:
        """Group the table's columns by (index, boxes); per column: family, key, item size."""
        table = self.table
        first = self.order[table.members[0]] if table.members else 0
        indexes: dict[int, _Index] = {}
        layout: list[tuple[_Family | None, str, int]] = []
        for j, want in enumerate(table.template):
            info = self._key(first, want)
            layout.append((None, want.key, 0 if info is None else info.itemsize))
            if info is not None:
                indexes[j] = self.old.index(want.key, info)
                continue
            for row, box in enumerate(table.column(j)):
                if not box.is_empty():
                    text = f"{want.key!r} (held by no old rank)"
                    self.missing.append(((table.members[row], j), text))
        families = []
        for positions in table.families(indexes, lambda j: id(indexes[j])):
            family = _Family(indexes[positions[0]], table.column(positions[0]), positions)
            families.append(family)
            for j in positions:
                layout[j] = (family, *layout[j][1:])
        return families, layout

    def _fill(self, family: _Family) -> None:
        """Cover every row's box of ``family`` and pick the sources that need no network."""
        index = family.index
        keys = [self.table.template[j].key for j in family.positions]
        for row, box in enumerate(family.column):
            place = self.members[row]
            pieces, problems = _cover(keys[0], index, box)
            for problem in problems:
                for j, key in zip(family.positions, keys, strict=True):
                    self.missing.append(((place, j), _missing_text(key, problem)))
            node, own = self.nodes[place], self.owns[place]
            entries = []
            network = []
            for (src_box, src), region, elements in pieces:
                source: tuple[int, int] | _Sources
                if own is not None and own in src.rankset:
                    source = (node, own)
                else:
                    source = src.on_node.get(node, src)
                    if source is src:
                        network.append((*(src.pick or _NO_PICK), elements, src))
                entries.append((src_box, region, elements, source))
            family.entries.append(tuple(entries))
            family.network.append(tuple(network))

    def _reads(self, place: int, chunks: Iterable[_Chunk], start: int) -> list[Read]:
        """The reads of ``chunks`` (from position ``start`` of a rank's list), one by one."""
        new, node, own = self.order[place], self.nodes[place], self.owns[place]
        load = self.old.sourcing.load
        reads: list[Read] = []
        for position, want in enumerate(chunks, start):
            info = self._key(new, want)
            if info is None:
                if not want.box.is_empty():
                    self.missing.append(((place, position), f"{want.key!r} (held by no old rank)"))
                continue
            index = self.old.index(want.key, info)
            pieces, problems = _cover(want.key, index, want.box)
            for problem in problems:
                self.missing.append(((place, position), _missing_text(want.key, problem)))
            for (src_box, src), region, elements in pieces:
                nbytes = elements * info.itemsize
                if own is not None and own in src.rankset:
                    source = (node, own)
                else:
                    source = src.on_node.get(node) or _pick(src, load, nbytes)
                reads.append(
                    _new_read((source[0], source[1], want.key, src_box, want.box, region, nbytes))
                )
        return reads


class _RankReads(Sequence[Read]):
    """One new rank's reads, in wanted order, made on demand from the plan's shared tables.

    ``layout`` (per table column: family, key, item size) and ``row`` say where the rank's
    table part is; ``network`` holds the peers picked for its network reads, in order;
    ``tail`` the reads planned chunk by chunk after the table (or all of them).
    """

    __slots__ = ("_layout", "_list", "_network", "_row", "_tail")

    def __init__(
        self,
        layout: list[tuple[_Family | None, str, int]] | None,
        row: int,
        network: list[tuple[int, int]],
        tail: list[Read],
    ) -> None:
        self._layout = layout
        self._row = row
        self._network = network
        self._tail = tail
        self._list: list[Read] | None = tail if layout is None else None

    def __iter__(self) -> Iterator[Read]:
        return iter(self._list) if self._list is not None else self._make()

    def _make(self) -> Iterator[Read]:
        assert self._layout is not None
        new_read, row, network = _new_read, self._row, iter(self._network)
        for family, key, size in self._layout:
            if family is None:
                continue
            dst = family.column[row]
            for src_box, region, elements, source in family.entries[row]:
                node, rank = next(network) if isinstance(source, _Sources) else source
                yield new_read((node, rank, key, src_box, dst, region, elements * size))
        yield from self._tail

    def _reads(self) -> list[Read]:
        if self._list is None:
            self._list = list(self._make())
        return self._list

    def __len__(self) -> int:
        if self._list is not None:
            return len(self._list)
        assert self._layout is not None
        row = self._row
        return sum(len(f.entries[row]) for f, _, _ in self._layout if f) + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> Read: ...

    @overload
    def __getitem__(self, index: slice) -> list[Read]: ...

    def __getitem__(self, index: int | slice) -> Read | list[Read]:
        return self._reads()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _RankReads):
            return self._reads() == other._reads()
        if isinstance(other, list):
            return self._reads() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RankReads({self._reads()!r})"
