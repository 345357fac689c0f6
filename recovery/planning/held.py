"""What survived a loss: the old ranks' chunks by key, where each can be read, and covers.

Pure functions, no I/O; part of the planner (``recovery/planning/reshard.py``). :class:`Sourcing`
names every group of old ranks holding the same box (a *logical chunk*'s sources) once, with
the nodes that hold a copy; both the table path (``recovery/planning/table_reads.py``) and the chunk
path share it, so that their network reads are dealt to peers by one rule
(``recovery/planning/balance.py``). :class:`Held` indexes each key's held boxes on first use (checked
when indexed: inside the tensor, disjoint unless equal) and :func:`cover` cuts a wanted box
into pieces of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter

import numpy as np

from peerckpt.boxes import Box, BoxTree, Overlap, box_array, intersect, is_grid, subtract
from peerckpt.dtypes import itemsize
from peerckpt.errors import StateMismatch
from peerckpt.reads import STORAGE
from peerckpt.recovery.planning.tables import ChunkLists

_FIRST = itemgetter(0)
_FEW = 32  # boxes below which checking them one by one beats numpy's fixed costs


@dataclass(eq=False, slots=True)
class Sources:
    """Where a logical chunk can be read from; shared by every chunk held by the same ranks.

    ``nodes`` ascending (storage only when no memory copy is left), ``node_ranks[i]`` the
    smallest old rank with a copy on ``nodes[i]``; ``id`` numbers them in one plan.
    """

    id: int
    ranks: list[int]  # ascending
    rankset: frozenset[int]
    on_node: dict[int, tuple[int, int]]  # node → (node, smallest old rank with a copy there)
    nodes: tuple[int, ...]
    node_ranks: tuple[int, ...]


# Old rank → (nodes whose copy of it lacks some chunks, the keys of those chunks): partial
# copies left by redundancy-aware replication (``recovery/twins.py``).
Lacking = dict[int, tuple[frozenset[int], frozenset[str]]]


class Sourcing(dict[int, Sources]):
    """The sources of chunks by the old ranks holding them; as a dict, rank → the sources of
    chunks only that rank holds (looked up in C, made on first use). Those of a key some
    copies lack (``lacking``) come from :meth:`group` with the key."""

    def __init__(
        self, holders: dict[int, list[int] | set[int]], lacking: Lacking | None = None
    ) -> None:
        super().__init__()
        self.holders = {rank: frozenset(nodes) for rank, nodes in holders.items()}
        self.lacking = dict(lacking or {})
        self.lacking_keys = frozenset(k for _, keys in self.lacking.values() for k in keys)
        self.all: list[Sources] = []
        self._groups: dict[tuple[tuple[int, ...], tuple[int, ...]], Sources] = {}
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def __missing__(self, rank: int) -> Sources:
        sources = self[rank] = self.group((rank,))
        return sources

    def group(self, ranks: tuple[int, ...], key: str | None = None) -> Sources:
        """The sources of chunks (of ``key``) held by exactly ``ranks`` (ascending). The
        nodes whose copy of a rank lacks ``key`` (``lacking``) are no source of it."""
        short = (
            tuple(r for r in ranks if r in self.lacking and key in self.lacking[r][1])
            if key is not None and key in self.lacking_keys
            else ()
        )
        src = self._groups.get((ranks, short))
        if src is None:
            on_node: dict[int, tuple[int, int]] = {}
            for rank in ranks:  # ascending, so each node maps to its smallest rank
                held = self.holders.get(rank, frozenset())
                if rank in short:
                    held = held - self.lacking[rank][0]
                for node in sorted(held):
                    on_node.setdefault(node, (node, rank))
            if len(on_node) > 1:
                on_node.pop(STORAGE, None)  # memory first; storage only when nothing else is left
            nodes = tuple(sorted(on_node))
            src = Sources(
                len(self.all),
                list(ranks),
                frozenset(ranks),
                on_node,
                nodes,
                tuple(on_node[node][1] for node in nodes),
            )
            self.all.append(src)
            self._groups[(ranks, short)] = src
        return src

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sources' nodes and their ranks, as arrays padded with -2 (by id, then place);
        made again only when sources were added since."""
        if self._arrays is not None and len(self._arrays[0]) == len(self.all):
            return self._arrays
        width = max((len(src.nodes) for src in self.all), default=0) or 1
        nodes = np.full((len(self.all), width), -2, np.int64)
        ranks = np.full((len(self.all), width), -2, np.int64)
        for src in self.all:
            nodes[src.id, : len(src.nodes)] = src.nodes
            ranks[src.id, : len(src.nodes)] = src.node_ranks
        self._arrays = nodes, ranks
        return nodes, ranks


Logical = tuple[Box, Sources]  # one distinct held box of a key and where it can be read
Piece = tuple[Logical, Box, int]  # a held chunk, the region read from it, its element count
Problem = tuple[Box, list[int] | None]  # a region held by no one (None) or by ranks all gone
Cover = tuple[tuple[Piece, ...], tuple[Problem, ...]]


@dataclass(eq=False, slots=True)
class Index:
    """The distinct held boxes of one key, and the covers found."""

    shape: tuple[int, ...]
    chunks: list[Logical]  # non-empty, in the order of their first holder
    by_box: dict[Box, Logical] | None  # None on the reference path: every cover intersects
    tree: BoxTree[Sources] | None = None
    covers: dict[Box, Cover] = field(default_factory=dict)  # those not a held box


@dataclass(eq=False, slots=True)
class Key:
    """One key of the old snapshots: its meta, where its boxes are, and its index once built."""

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    first_rank: int
    columns: list[int] = field(default_factory=list)  # its columns in the held table
    ranks: list[int] = field(default_factory=list)  # and every other (rank, box), rank order
    boxes: list[Box] = field(default_factory=list)
    index: Index | None = None


class Held:
    """The old ranks' chunks by key; each key's index is built (and checked) when first wanted.

    ``fast`` (the table path) finds a wanted box equal to a held one by hashing and checks
    many boxes at once; the reference path intersects every box and checks them one by one.
    """

    def __init__(
        self,
        held: ChunkLists,
        holders: dict[int, list[int] | set[int]],
        fast: bool,
        lacking: Lacking | None = None,
    ) -> None:
        self.sourcing = Sourcing(holders, lacking)
        self.fast = fast
        self.table = held.table
        self.keys: dict[str, Key] = {}
        table = held.table
        if table is not None:
            for j, (key, dtype, shape) in enumerate(
                zip(table.keys, table.dtypes, table.shapes, strict=True)
            ):
                info = self._meta(table.ranks[0], key, dtype, shape)
                info.columns.append(j)
        for rank in sorted(held.rest):
            for chunk in held.rest[rank]:
                info = self._meta(rank, chunk.key, chunk.dtype, chunk.global_shape)
                info.ranks.append(rank)
                info.boxes.append(chunk.box)

    def _meta(self, rank: int, key: str, dtype: str, shape: tuple[int, ...]) -> Key:
        """The key of a chunk, created at its first holder, checked against it after."""
        info = self.keys.get(key)
        if info is None:
            size = itemsize(dtype)  # an unknown dtype fails here, naming it
            info = self.keys[key] = Key(dtype, size, tuple(shape), rank)
        elif dtype != info.dtype or tuple(shape) != info.shape:
            raise StateMismatch(
                f"{key!r} is {dtype} {tuple(shape)} in old rank {rank}'s snapshot but "
                f"{info.dtype} {info.shape} in old rank {info.first_rank}'s: the snapshots do "
                "not come from one model"
            )
        return info

    def index(self, key: str, info: Key) -> Index:
        """The index of ``key``'s held boxes (built and checked on first use)."""
        if info.index is None:
            ranks, boxes = info.ranks, info.boxes
            if info.columns:
                table = self.table
                assert table is not None
                # Merged with the other lists' boxes in rank order; stable, so a rank's chunks
                # keep their order.
                pairs = [
                    (rank, table.box(row, j))
                    for j in info.columns
                    for row, rank in enumerate(table.ranks)
                ]
                pairs.extend(zip(ranks, boxes, strict=True))
                pairs.sort(key=_FIRST)
                ranks, boxes = [rank for rank, _ in pairs], [box for _, box in pairs]
            info.index = self._build(key, info.shape, ranks, boxes)
        return info.index

    def _build(self, key: str, shape: tuple[int, ...], ranks: list[int], boxes: list[Box]) -> Index:
        """Index ``boxes`` (``boxes[i]`` held by ``ranks[i]``, ranks ascending), checking them."""
        distinct = dict.fromkeys(boxes)  # in the order of their first holder
        # One holder per box and no copy lacking the key: each box's sources are its rank's.
        if len(distinct) == len(boxes) and key not in self.sourcing.lacking_keys:
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
            sources = [self.sourcing.group(tuple(group), key) for group in groups.values()]
        if self.fast and len(unique) > _FEW:
            flat = _check_boxes(key, shape, unique, sources)
            nonempty = np.all(flat[:, 1] > 0, axis=1)
            chunks = list(compress(zip(unique, sources, strict=True), nonempty.tolist()))
            index = Index(shape, chunks, dict(zip(map(_FIRST, chunks), chunks, strict=True)))
            if not is_grid(flat[nonempty]):
                _tree(key, index)  # overlapping boxes fail here, with the pair named
            return index
        for box, src in zip(unique, sources, strict=True):
            _check_box(key, shape, box, src)
        chunks = [
            (box, src) for box, src in zip(unique, sources, strict=True) if not box.is_empty()
        ]
        index = Index(shape, chunks, {chunk[0]: chunk for chunk in chunks} if self.fast else None)
        if len(chunks) > 1:
            _tree(key, index)  # overlapping boxes fail here, with the pair named
        return index


def _check_box(key: str, shape: tuple[int, ...], box: Box, src: Sources) -> None:
    try:
        box.check(shape)
    except ValueError as e:
        raise StateMismatch(f"old rank {src.ranks[0]} holds a bad chunk of {key!r}: {e}") from None


def _check_boxes(
    key: str, shape: tuple[int, ...], boxes: list[Box], sources: list[Sources]
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


def _tree(key: str, index: Index) -> BoxTree[Sources]:
    """The tree of ``index``, built (and its boxes checked pairwise) on first use."""
    if index.tree is None:
        try:
            index.tree = BoxTree(index.chunks)
        except Overlap as e:
            (a, a_src), (b, b_src) = e.a, e.b
            raise StateMismatch(
                f"held chunks of {key!r} overlap without being equal: {show(a)} in "
                f"old rank(s) {a_src.ranks} and {show(b)} in old rank(s) {b_src.ranks}; "
                "the snapshots do not come from one layout"
            ) from None
    return index.tree


def cover(key: str, index: Index, box: Box) -> Cover:
    """The pieces of held chunks that make up ``box``, and what no surviving copy holds."""
    # A held box is looked up each time (cheaper than caching it); others are cached.
    hit = index.by_box.get(box) if index.by_box is not None else None
    if hit is not None:  # the wanted box is a held one: nothing to intersect
        if hit[1].on_node:
            return ((hit, box, math.prod(box.lengths)),), ()
        return (), ((box, hit[1].ranks),)
    found = index.covers.get(box)
    if found is None:
        found = index.covers[box] = _intersect_cover(key, index, box)
    return found


def _intersect_cover(key: str, index: Index, box: Box) -> Cover:
    """:func:`cover` of a box that is not a held one, by intersecting what the tree finds."""
    try:
        box.check(index.shape)
    except ValueError as e:
        raise StateMismatch(f"a wanted chunk of {key!r}: {e}") from None
    if box.is_empty():  # trailing ranks of a Shard(0) want nothing: no tree to build for it
        return (), ()
    found = _tree(key, index).find(box)
    pieces: list[Piece] = []
    gone: list[Problem] = []
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
    problems: list[Problem] = []
    # Held boxes are disjoint (checked when indexed), so element counts decide exact cover.
    if total != math.prod(box.lengths):
        holes = [box]
        for chunk in found:
            holes = [h for hole in holes for h in subtract(hole, chunk[0])]
        problems.extend((hole, None) for hole in holes)
    problems.extend(gone)
    return tuple(pieces), tuple(problems)


def show(box: Box) -> str:
    """A box as error messages name it."""
    return f"offsets={box.offsets} lengths={box.lengths}"


def missing_text(key: str, problem: Problem) -> str:
    """What an error says of a region no surviving copy holds."""
    region, ranks = problem
    if ranks is None:
        return f"{key!r} {show(region)} (held by no old rank)"
    return f"{key!r} {show(region)} (every copy of old ranks {ranks} is gone)"
