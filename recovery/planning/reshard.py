"""Resharding recovery plans: which bytes every rank of the new epoch reads, and from where.

Pure functions, no I/O. The old epoch left committed snapshots, each a list of chunks (boxes of
global tensors) held by the old rank's node and its buddies. The new epoch may have another
world size or layout; every new rank says which boxes it wants. :func:`plan` covers each
wanted box exactly with pieces of held chunks and picks one source per piece:

1. the rank's own previous snapshot on its own node (no network, no copy to wait for);
2. any other copy on its own node (that of the smallest such old rank);
3. otherwise a peer node holding a copy, dealt by ``recovery/planning/balance.py`` so that the peers'
   bytes are balanced (water-filling over candidate sets; ties to the lowest node id);
4. durable storage (the holder ``STORAGE``) only for chunks no memory copy of survived.

Identical boxes held by several old ranks (data-parallel replicas) are one *logical chunk* with
several sources, so a destination reads each piece once. Distinct held boxes of a key must be
disjoint; overlapping ones mean the snapshots came from two layouts and are rejected.

A job of 10,000 ranks with 1,000 tensors each has ten million chunks per side, so the planner
takes its input as tables (``recovery/planning/tables.py``: per tensor, every rank's box as arrays)
and plans them with numpy (``recovery/planning/table_reads.py``), docs/performance.md "Planning at scale".
Chunks outside the tables (each rank's private state, lists in another order such as FSDP1's
flat shards) and tables that path cannot take are planned chunk by chunk (``recovery/planning/held.py``):
the reference path, which the tests compare the tables with.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from peerckpt.errors import RecoveryFailed, StateMismatch
from peerckpt.reads import Read, new_read
from peerckpt.recovery.planning.balance import assign
from peerckpt.recovery.planning.held import Held, Key, Lacking, cover, missing_text
from peerckpt.recovery.planning.results import ReadPlan
from peerckpt.recovery.planning.table_reads import NETWORK, Pieces, TableReads, plan_table
from peerckpt.recovery.planning.tables import ChunkLists, ChunkTable, from_chunks
from peerckpt.recovery.planning.types import HeldChunk, WantedChunk

__all__ = ["plan", "plan_reads"]

_MAX_LISTED = 8  # missing regions named in one error; the rest are counted
_Chunk: TypeAlias = HeldChunk | WantedChunk
Side: TypeAlias = Mapping[int, Sequence[Any]] | ChunkLists


def plan_reads(
    held: Side,
    holders: dict[int, list[int] | set[int]],
    wanted: Side,
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
) -> dict[int, Sequence[Read]]:
    """For every new rank, the reads that fill its wanted chunks exactly, in wanted order.

    ``held``: old rank → chunks of its committed snapshot; ``holders``: old rank → nodes with a
    complete verified copy of it; ``wanted``: new rank → chunks it needs (either side as chunk
    objects or as :class:`ChunkLists`); ``new_nodes``: new rank → node; ``previous``: new rank
    → the old rank the same process was (None if new). A rank's reads are a read-only
    sequence made on demand; ``list()`` it to keep them.

    Raises StateMismatch when a wanted chunk's dtype or global shape differs from the held one,
    or held boxes of a key overlap without being equal; RecoveryFailed, naming every missing
    key and region, when some wanted element has no surviving copy.
    """
    return plan(held, holders, wanted, new_nodes, previous).by_rank()


def plan(
    held: Side,
    holders: dict[int, list[int] | set[int]],
    wanted: Side,
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
    lacking: Lacking | None = None,
) -> ReadPlan:
    """:func:`plan_reads` as a :class:`ReadPlan` (its reads also as compact arrays).

    ``lacking``: old rank → (nodes of ``holders`` whose copy of it lacks some chunks, those
    chunks' keys): partial copies (``recovery/twins.py``), read only in what they hold; a key
    they lack is read from another old rank's identical box (a data-parallel twin)."""
    return _plan(held, holders, wanted, new_nodes, previous, tables=True, lacking=lacking)


def _plan(
    held: Side,
    holders: dict[int, list[int] | set[int]],
    wanted: Side,
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
    tables: bool,
    lacking: Lacking | None = None,
) -> ReadPlan:
    """:func:`plan`; ``tables=False`` plans every chunk on its own (the reference path)."""
    # A big plan allocates many small objects and no garbage cycles; left on, the cyclic
    # collector rescans them over and over.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        old_side, new_side = _lists(held, HeldChunk, tables), _lists(wanted, WantedChunk, tables)
        order = new_side.ranks()
        for new in order:
            if new not in new_nodes:
                raise ValueError(f"new rank {new} wants chunks but has no node in new_nodes")
        old = Held(old_side, holders, fast=tables, lacking=lacking)
        return _Planner(old, new_side, order, new_nodes, previous).plan()
    finally:
        if was_enabled:
            gc.enable()


def _lists(side: Side, cls: type[Any], tables: bool) -> ChunkLists:
    if isinstance(side, ChunkLists):
        return side if tables or side.table is None else ChunkLists(None, side.to_chunks(cls))
    if tables:
        return from_chunks(side)
    return ChunkLists(None, {rank: list(chunks) for rank, chunks in side.items()})


class _Planner:
    """Plans the reads of every new rank: the table with numpy, the rest chunk by chunk."""

    def __init__(
        self,
        old: Held,
        wanted: ChunkLists,
        order: list[int],
        new_nodes: dict[int, int],
        previous: dict[int, int | None],
    ) -> None:
        self.old = old
        self.wanted = wanted
        self.order = order
        self.nodes = [new_nodes[new] for new in order]
        self.owns: list[int | None] = []
        for new, node in zip(order, self.nodes, strict=True):
            prev = previous.get(new)
            # The own slot counts only where it survived on this rank's node.
            alive = prev is not None and node in old.sourcing.holders.get(prev, ())
            self.owns.append(prev if alive else None)
        # (rank's place in order, chunk position) → what is missing there, sorted at the end
        self.missing: list[tuple[tuple[int, int], str]] = []
        # Network reads of the chunk path: (place, its read list, index there, sources, bytes)
        self.network: list[tuple[int, list[list[Any]], int, int, int]] = []

    def plan(self) -> ReadPlan:
        table, rows = self._table()
        place_of = {new: place for place, new in enumerate(self.order)}
        rest: list[list[list[Any]]] = []
        lists = self.wanted.rest
        if table is not None and rows is None:  # no held table: chunk by chunk
            lists = self.wanted.to_chunks(WantedChunk)
        row_of = {new: row for row, new in enumerate(table.ranks)} if rows and table else {}
        slow = np.flatnonzero(rows.group_of_column < 0).tolist() if rows is not None else []
        for place, new in enumerate(self.order):
            row = row_of.get(new)
            if row is None:
                rest.append(self._reads(place, lists.get(new, ()), 0))
                continue
            assert table is not None
            # The columns the table path left out, then the chunks after the table.
            reads: list[list[Any]] = []
            for j in slow:
                want = WantedChunk(
                    table.keys[j], table.dtypes[j], table.shapes[j], table.box(row, j)
                )
                self._reads(place, [want], j, reads)
            rest.append(self._reads(place, lists.get(new, ()), table.width, reads))
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
        places = (
            np.fromiter((place_of[r] for r in table.ranks), np.int64, count=len(table.ranks))
            if rows is not None and table is not None
            else np.zeros(0, np.int64)
        )
        self._pick(rows, places)
        reads = [[new_read(tuple(read[:7])) for read in pending] for pending in rest]
        positions = [[read[7] for read in pending] for pending in rest]
        return ReadPlan(
            self.order, table if rows is not None else None, rows, places, reads, positions
        )

    def _table(self) -> tuple[ChunkTable | None, TableReads | None]:
        """The table path's reads (None where it cannot plan the table)."""
        table, held = self.wanted.table, self.old.table
        if table is None or held is None or not self.old.fast:
            return table, None
        place_of = {new: place for place, new in enumerate(self.order)}
        places = [place_of[r] for r in table.ranks]
        nodes = np.asarray([self.nodes[p] for p in places], np.int64)
        owns = np.asarray([-1 if (o := self.owns[p]) is None else o for p in places], np.int64)
        # Keys some copies lack are sourced per key: the chunk path plans them.
        outside = {key for key, info in self.old.keys.items() if info.ranks}
        outside |= self.old.sourcing.lacking_keys
        return table, plan_table(table, held, outside, self.old.sourcing, nodes, owns)

    def _pick(self, rows: TableReads | None, places: np.ndarray) -> None:
        """Deal every network read's item to a peer (``recovery/planning/balance.py``)."""
        parts: list[tuple[Pieces | None, np.ndarray]] = []  # (group or None, its reads)
        members: list[np.ndarray] = []
        weights: list[np.ndarray] = []
        # Items are told apart by their boxes, padded to the most dimensions of any.
        widths = [g.ndim for g in rows.groups] if rows is not None else []
        widths += [len(pending[i][5].offsets) for _, pending, i, _, _ in self.network]
        ndim = max(widths, default=0)
        if rows is not None:
            fast = np.flatnonzero(rows.group_of_column >= 0)
            first = np.full(len(rows.groups), -1, np.int64)
            first[rows.group_of_column[fast[::-1]]] = fast[::-1]
            per_group = np.bincount(
                rows.group_of_column[fast], weights=rows.sizes[fast], minlength=len(rows.groups)
            ).astype(np.int64)  # bytes per element of a piece, over the group's columns
            for g, group in enumerate(rows.groups):
                q = np.flatnonzero(group.node == NETWORK)
                if not len(q):
                    continue
                row = np.repeat(np.arange(len(group.ptr) - 1), np.diff(group.ptr))[q]
                columns = [
                    places[row],
                    np.full(len(q), first[g]),
                    q - group.ptr[row],
                    group.rank[q],
                ]
                members.append(_members(columns, group.ndim, ndim, group.src[q], group.region[q]))
                weights.append(group.elements[q] * per_group[g])
                parts.append((group, q))
        if self.network:
            rest = [pending[i] for _, pending, i, _, _ in self.network]
            columns = [
                np.asarray([p for p, _, _, _, _ in self.network], np.int64),
                np.asarray([read[7] for read in rest], np.int64),
                np.asarray([read[8] for read in rest], np.int64),
                np.asarray([sid for _, _, _, sid, _ in self.network], np.int64),
            ]
            coords = [
                _members(
                    [],
                    len(read[5].offsets),
                    ndim,
                    np.asarray([[*read[3][0], *read[3][1]]]),
                    np.asarray([[*read[5][0], *read[5][1]]]),
                )
                for read in rest
            ]
            members.append(
                np.concatenate([np.stack(columns, axis=1), np.concatenate(coords)], axis=1)
            )
            weights.append(np.asarray([read[6] for read in rest], np.int64))
            parts.append((None, np.arange(len(rest))))
        if not members:
            return
        src_nodes, src_ranks = self.old.sourcing.arrays()
        sets: dict[tuple[int, ...], int] = {}
        set_of_sid = np.asarray(
            [sets.setdefault(src.nodes, len(sets)) for src in self.old.sourcing.all], np.int64
        )
        table = np.concatenate(members)
        choice = assign(table, np.concatenate(weights), set_of_sid, list(sets))
        sid = table[:, 3]
        node, rank = src_nodes[sid, choice], src_ranks[sid, choice]
        at = 0
        for group, q in parts:
            n, r = node[at : at + len(q)], rank[at : at + len(q)]
            at += len(q)
            if group is not None:
                group.node[q], group.rank[q] = n, r
                continue
            for (_, pending, i, _, _), n_i, r_i in zip(
                self.network, n.tolist(), r.tolist(), strict=True
            ):
                pending[i][0], pending[i][1] = n_i, r_i

    def _key(self, new: int, want: _Chunk) -> Key | None:
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

    def _reads(
        self, place: int, chunks: Iterable[_Chunk], start: int, reads: list[list[Any]] | None = None
    ) -> list[list[Any]]:
        """The reads of ``chunks`` (from position ``start`` of a rank's list), one by one,
        appended to ``reads``; a network read's node and rank are NETWORK and its sources' id
        until peers are picked."""
        new, node, own = self.order[place], self.nodes[place], self.owns[place]
        reads = [] if reads is None else reads
        for position, want in enumerate(chunks, start):
            info = self._key(new, want)
            if info is None:
                if not want.box.is_empty():
                    self.missing.append(((place, position), f"{want.key!r} (held by no old rank)"))
                continue
            index = self.old.index(want.key, info)
            pieces, problems = cover(want.key, index, want.box)
            for problem in problems:
                self.missing.append(((place, position), missing_text(want.key, problem)))
            for k, ((src_box, src), region, elements) in enumerate(pieces):
                nbytes = elements * info.itemsize
                source: tuple[int, int] | None
                if own is not None and own in src.rankset:
                    source = (node, own)
                else:
                    source = src.on_node.get(node)
                if source is None:
                    self.network.append((place, reads, len(reads), src.id, nbytes))
                    source = (NETWORK, src.id)
                reads.append([*source, want.key, src_box, want.box, region, nbytes, position, k])
        return reads


def _members(
    columns: list[np.ndarray], ndim: int, width: int, src: np.ndarray, region: np.ndarray
) -> np.ndarray:
    """Rows of ``columns`` then, padded to ``width`` dimensions, ndim, held box and region."""
    n = len(src)
    out = np.full((n, len(columns) + 1 + 4 * width), -1, np.int64)
    for c, column in enumerate(columns):
        out[:, c] = column
    at = len(columns)
    out[:, at] = ndim
    for part, coords in enumerate((src, region)):
        base = at + 1 + 2 * width * part
        out[:, base : base + ndim] = coords[:, :ndim]
        out[:, base + width : base + width + ndim] = coords[:, ndim:]
    return out
