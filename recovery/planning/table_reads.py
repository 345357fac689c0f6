"""The table path of the planner: every rank's reads of the table's tensors, with numpy.

Pure functions, no I/O; part of the planner (``recovery/planning/reshard.py``), which plans chunk by
chunk the columns this leaves out (group -1). Input: the wanted table (a row per new
rank, a column per tensor) and the held table (a row per old rank), ``recovery/planning/tables.py``.

1. Columns are grouped: tensors whose held columns are equal and whose wanted columns are
   equal (same shape and sharding; a few groups for a model's thousand tensors) are covered
   once, for every rank at once.
2. A group's distinct non-empty held boxes must form a *product grid*: along each dimension
   their intervals are disjoint, and every combination of them is a held box (Shard(d),
   block meshes, replicas: the layouts DTensor makes). A wanted box then meets, along each
   dimension, the intervals found by binary search, and its pieces are their product, in
   the order the chunk path's box tree gives them.
3. Each piece's source follows the planner's rules: the rank's own snapshot, else a copy on
   its node (the smallest such old rank), else a network read from the chunk's sources,
   whose peer ``recovery/planning/balance.py`` picks later for the whole plan.
4. A rank's reads, in wanted order, are those pieces column by column: nothing is stored
   per read (13.6 million of them in the worst case planned in ``bench/planner.py``).

A column with anything irregular (boxes outside the tensor, overlaps, a region no surviving
copy holds, a key not held in the held table or also held outside it, boxes that are no
product grid) is left out: the chunk path plans it (or rejects it, naming the cause).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from peerckpt.dtypes import itemsize
from peerckpt.recovery.planning.held import Sourcing
from peerckpt.recovery.planning.tables import ChunkTable

NETWORK = -2  # the source node of a piece read over the network, until a peer is picked


@dataclass(eq=False, slots=True)
class Pieces:
    """The pieces of one group of columns, for every wanted row (rows in ``ptr`` order).

    Piece ``p`` reads ``region`` (offsets, then lengths: ``2 * ndim`` columns) of held box
    ``src`` from ``node`` and old rank ``rank``; for a network read ``node`` is NETWORK and
    ``rank`` the sources' id.
    """

    ndim: int
    ptr: np.ndarray  # row i's pieces are ptr[i]:ptr[i + 1]
    src: np.ndarray
    region: np.ndarray
    elements: np.ndarray
    node: np.ndarray
    rank: np.ndarray


@dataclass(eq=False, slots=True)
class TableReads:
    """Every wanted row's reads of the table's tensors, in wanted order, as shared pieces.

    The reads of row ``i``: for each column ``j`` in turn, one per piece of group
    ``group_of_column[j]`` at row ``i`` (``groups[g].ptr[i]:groups[g].ptr[i + 1]``), of
    ``elements * sizes[j]`` bytes. No array has an entry per read: a thousand tensors
    sharded alike share one group's pieces.
    """

    groups: list[Pieces]
    group_of_column: np.ndarray  # -1: a column the chunk path plans
    sizes: np.ndarray  # bytes per element of each column
    rows: int

    def counts(self) -> np.ndarray:
        """Pieces per (row, group)."""
        if not self.groups:
            return np.zeros((self.rows, 0), np.int64)
        return np.stack([np.diff(g.ptr) for g in self.groups], axis=1)

    def per_group(self) -> np.ndarray:
        """Columns per group."""
        fast = self.group_of_column[self.group_of_column >= 0]
        return np.bincount(fast, minlength=len(self.groups))

    def reads_of_row(self, row: int) -> int:
        """How many reads row ``row`` has in the groups (the chunk path's are elsewhere)."""
        per_group = self.per_group().tolist()
        return sum(
            int(g.ptr[row + 1] - g.ptr[row]) * n
            for g, n in zip(self.groups, per_group, strict=True)
        )


def plan_table(
    wanted: ChunkTable,
    held: ChunkTable,
    outside: set[str],
    sourcing: Sourcing,
    nodes: np.ndarray,
    owns: np.ndarray,
) -> TableReads:
    """The reads of every row of ``wanted`` from ``held``; the columns this path cannot plan
    have group -1.

    ``outside``: keys held outside the table; ``nodes``/``owns``: per wanted row, its node
    and the old rank whose snapshot survives there as its own (-1 if none).
    """
    at: dict[str, int] = {}
    twice = set(outside)
    for j, key in enumerate(held.keys):
        if key in at:
            twice.add(key)  # listed twice: the chunk path merges its boxes
        at[key] = j
    columns: list[int] = []
    fast: list[int] = []
    for j, (key, dtype, shape) in enumerate(
        zip(wanted.keys, wanted.dtypes, wanted.shapes, strict=True)
    ):
        h = at.get(key, -1)
        columns.append(h)
        # Not held, or not as wanted, or also elsewhere: the chunk path plans (or names) it.
        if h >= 0 and key not in twice and held.dtypes[h] == dtype and held.shapes[h] == shape:
            fast.append(j)
    held_sids = np.fromiter(
        (sourcing[rank].id for rank in held.ranks), np.int64, count=len(held.ranks)
    )
    held_rows = np.asarray(held.ranks, np.int64)
    at_row = np.minimum(np.searchsorted(held_rows, owns), len(held_rows) - 1)
    own_rows = np.where((owns >= 0) & (held_rows[at_row] == owns), at_row, -1)
    groups: list[Pieces] = []
    group_of_column = np.full(wanted.width, -1, np.int64)
    for members in _groups(wanted, held, columns, fast):
        j = members[0]
        pieces = _cover(wanted, held, j, columns[j], held_sids, own_rows, nodes, sourcing)
        if pieces is not None:
            group_of_column[members] = len(groups)
            groups.append(pieces)
    sizes = np.asarray([itemsize(dtype) for dtype in wanted.dtypes], np.int64)
    return TableReads(groups, group_of_column, sizes, len(wanted.ranks))


def _groups(
    wanted: ChunkTable, held: ChunkTable, columns: list[int], fast: list[int]
) -> list[list[int]]:
    """The ``fast`` wanted columns, grouped by equal wanted and equal held columns (step 1)."""
    # A fingerprint of every column proposes groups; comparing the arrays confirms them.
    w_prints = _prints(wanted)
    h_prints = _prints(held)
    proposed: dict[tuple[object, ...], list[int]] = {}
    for j in fast:
        h = columns[j]
        proposed.setdefault((wanted.shapes[j], w_prints[j], h_prints[h]), []).append(j)
    groups: list[list[int]] = []
    for members in proposed.values():
        while members:
            first, rest = members[0], members[1:]
            same = [first]
            others = []
            for j in rest:
                if _same_column(wanted, first, j) and _same_column(
                    held, columns[first], columns[j]
                ):
                    same.append(j)
                else:
                    others.append(j)
            groups.append(same)
            members = others
    return groups


def _prints(table: ChunkTable) -> list[tuple[object, ...]]:
    weights = np.arange(1, len(table.ranks) + 1, dtype=np.int64)
    offsets = (table.offsets @ weights).tolist()
    lengths = (table.lengths @ weights).tolist()
    starts = table.starts
    return [(tuple(offsets[a:b]), tuple(lengths[a:b])) for a, b in pairwise(starts)]


def _same_column(table: ChunkTable, a: int, b: int) -> bool:
    sa = slice(table.starts[a], table.starts[a + 1])
    sb = slice(table.starts[b], table.starts[b + 1])
    return np.array_equal(table.offsets[sa], table.offsets[sb]) and np.array_equal(
        table.lengths[sa], table.lengths[sb]
    )


def _cover(
    wanted: ChunkTable,
    held: ChunkTable,
    j: int,
    h: int,
    held_sids: np.ndarray,
    own_rows: np.ndarray,
    nodes: np.ndarray,
    sourcing: Sourcing,
) -> Pieces | None:
    """The pieces of wanted column ``j`` from held column ``h`` (steps 2 and 3), or None."""
    shape = wanted.shapes[j]
    ndim = len(shape)
    # Per dimension, every row's offset and length (contiguous: the tables are column-major).
    w_off, w_len = wanted.offsets[wanted.starts[j] :], wanted.lengths[wanted.starts[j] :]
    h_off, h_len = held.offsets[held.starts[h] :], held.lengths[held.starts[h] :]
    n_rows, n_held = len(wanted.ranks), len(held.ranks)
    w_full = np.ones(n_rows, bool)
    h_full = np.ones(n_held, bool)
    for d in range(ndim):
        for off, length, full in ((w_off[d], w_len[d], w_full), (h_off[d], h_len[d], h_full)):
            if (off < 0).any() or (length < 0).any() or (off + length > shape[d]).any():
                return None  # the chunk path names the bad box
            full &= length > 0
    # Step 2: the held grid. Along each dimension, the distinct intervals of non-empty boxes.
    rows = np.flatnonzero(h_full)
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    position = np.zeros(len(rows), np.int64)
    counts = []
    for d in range(ndim):
        pairs = (
            np.unique((h_off[d][rows] << 32) | h_len[d][rows])
            if _small(h_off[d], h_len[d])
            else None
        )
        if pairs is not None:
            begin, end = pairs >> 32, (pairs >> 32) + (pairs & 0xFFFFFFFF)
        else:
            both = np.unique(np.stack([h_off[d][rows], h_len[d][rows]], axis=1), axis=0)
            begin, end = both[:, 0], both[:, 0] + both[:, 1]
        if (begin[1:] < end[:-1]).any():
            return None  # overlapping intervals: no grid (or overlapping boxes)
        starts.append(begin)
        ends.append(end)
        counts.append(len(begin))
        position = position * len(begin) + np.searchsorted(begin, h_off[d][rows])
    n_chunks = math.prod(counts) if len(rows) else 0
    chunk_of_row = np.full(n_held, -1, np.int64)
    chunk_of_row[rows] = position
    present = np.bincount(position, minlength=n_chunks)
    if not (present > 0).all():
        return None  # a combination of intervals that no rank holds: not a product grid
    # The sources of each logical chunk: the ranks holding it.
    if (present == 1).all():
        sid_of_chunk = np.empty(n_chunks, np.int64)
        sid_of_chunk[position] = held_sids[rows]
    else:
        order = np.argsort(position, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(present)]).tolist()
        ranks = np.asarray(held.ranks, np.int64)[rows[order]].tolist()
        sid_of_chunk = np.fromiter(
            (sourcing.group(tuple(ranks[bounds[c] : bounds[c + 1]])).id for c in range(n_chunks)),
            np.int64,
            count=n_chunks,
        )
    # The wanted boxes: along each dimension, the intervals they meet.
    per_row = w_full.astype(np.int64) if n_chunks else np.zeros(n_rows, np.int64)
    low, count = [], []
    for d in range(ndim):
        lo = np.searchsorted(ends[d], w_off[d], side="right")
        hi = np.searchsorted(starts[d], w_off[d] + w_len[d], side="left")
        n = np.maximum(hi - lo, 0)
        low.append(lo)
        count.append(n)
        per_row *= n
    ptr = np.concatenate([[0], np.cumsum(per_row)])
    total = int(ptr[-1])
    row = np.repeat(np.arange(n_rows), per_row)
    rest = np.arange(total) - ptr[:-1][row]
    chunk = np.zeros(total, np.int64)
    src = np.empty((total, 2 * ndim), np.int64)
    region = np.empty((total, 2 * ndim), np.int64)
    elements = np.ones(total, np.int64)
    wanted_elements = w_full.astype(np.int64)
    multiplier = 1
    for d in range(ndim - 1, -1, -1):  # the last dimension varies fastest, as in the tree
        n = count[d][row]
        interval = low[d][row] + rest % n
        rest //= n
        chunk += multiplier * interval
        multiplier *= counts[d]
        src[:, d], src[:, ndim + d] = starts[d][interval], ends[d][interval] - starts[d][interval]
        begin = np.maximum(starts[d][interval], w_off[d][row])
        end = np.minimum(ends[d][interval], w_off[d][row] + w_len[d][row])
        region[:, d], region[:, ndim + d] = begin, end - begin
        elements *= end - begin
        wanted_elements *= w_len[d]
    got = np.bincount(row, weights=elements, minlength=n_rows)
    if not np.array_equal(got, wanted_elements.astype(np.float64)):
        return None  # a hole: the chunk path names the region
    # Step 3: sources.
    sid = sid_of_chunk[chunk]
    src_nodes, src_ranks = sourcing.arrays()
    if (src_nodes[sid, 0] == -2).any():
        return None  # every copy of some piece is gone: the chunk path names it
    node = np.full(total, NETWORK, np.int64)
    rank = sid.copy()
    own_row = own_rows[row]
    own = (own_row >= 0) & (chunk_of_row[np.maximum(own_row, 0)] == chunk)
    node_of_row = nodes[row]
    on_node = src_nodes[sid] == node_of_row[:, None]
    local = on_node.any(axis=1) & ~own
    node[own] = node_of_row[own]
    rank[own] = np.asarray(held.ranks, np.int64)[own_row[own]]
    where = on_node[local].argmax(axis=1)
    node[local] = node_of_row[local]
    rank[local] = src_ranks[sid[local], where]
    return Pieces(ndim, ptr, src, region, elements, node, rank)


def _small(offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether (offset, length) pairs fit in one int64 each (so np.unique sorts them fast)."""
    return bool(len(offsets)) and int(offsets.max()) < 1 << 31 and int(lengths.max()) < 1 << 32
