"""A rank's planned reads as one compact message: arrays as raw bytes, not a dict per read.

The coordinator (``recovery/elastic.py``) sends each node, per rank on it, the message that
:func:`encode` makes; the node's agent turns it back into reads with :func:`decode`, knowing
the chunks the rank asked for. msgpack carries the bytes; nothing is pickled.

A message (all integers little-endian) lists *pieces* (a region of a held box, read from a
node and old rank: ``ndim`` uint8, ``boxes`` int64 as the held box's offsets and lengths then
the region's, ``node`` and ``rank`` int32, per piece), then the reads, in the rank's wanted
order, as references to them:

- ``table`` chunks first: chunk ``j`` (its place in the list the rank sent) is filled by the
  pieces ``first[g]…first[g] + count[g] - 1`` of its group ``g = group[j]`` (``group``,
  ``first``, ``count``: int32). Tensors sharded alike are one group, so a rank's thousand
  tensors need a few groups' pieces, and ``group`` is the same bytes for every rank;
- one read per ``extra_chunk``/``extra_piece`` pair (int32 each, ascending chunks): the
  chunks planned one by one (those of group -1 in their place, then a rank's private state,
  lists in another order).

The key, the destination box and the dtype of a read come from the chunk the rank asked for.
``n`` is the number of reads.

Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from peerckpt.errors import ProtocolError
from peerckpt.recovery.planner import ReadPlan, itemsize

_I32, _I64, _U8 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1")


def encode(plan: ReadPlan) -> dict[int, dict[str, Any]]:
    """Every new rank's reads as a message (see the module docstring)."""
    table = _TableParts(plan) if plan.rows is not None else None
    out: dict[int, dict[str, Any]] = {}
    for place, new in enumerate(plan.order):
        row = plan.row_of.get(place)
        msg = table.message(row) if table is not None and row is not None else _empty()
        rest = plan.rest[place]
        if rest:
            _add_rest(msg, rest, plan.rest_positions[place])
        out[new] = msg
    return out


def _empty() -> dict[str, Any]:
    return {
        "n": 0,
        "table": 0,
        "group": b"",
        "first": b"",
        "count": b"",
        "extra_chunk": b"",
        "extra_piece": b"",
        "ndim": b"",
        "boxes": b"",
        "node": b"",
        "rank": b"",
    }


class _TableParts:
    """The table's pieces of every row in message order (row, group, piece), made at once."""

    def __init__(self, plan: ReadPlan) -> None:
        rows = plan.rows
        assert rows is not None
        groups = rows.groups
        counts = rows.counts()  # (rows, groups)
        n_rows, n_groups = counts.shape
        flat = counts.ravel()
        total = int(flat.sum())
        starts = (
            np.stack([g.ptr[:-1] for g in groups], axis=1).ravel()
            if groups
            else np.zeros(0, np.int64)
        )
        group = np.repeat(np.tile(np.arange(n_groups), n_rows), flat)
        index = np.repeat(starts - (np.cumsum(flat) - flat), flat) + np.arange(total)
        ndims = np.asarray([g.ndim for g in groups], np.int64)
        widths = 4 * ndims[group]
        at = np.cumsum(widths) - widths
        self.ndim = ndims[group].astype(_U8)
        self.node = np.empty(total, _I32)
        self.rank = np.empty(total, _I32)
        self.boxes = np.empty(int(widths.sum()), _I64)
        for g, pieces in enumerate(groups):
            mine = np.flatnonzero(group == g)
            q = index[mine]
            self.node[mine], self.rank[mine] = pieces.node[q], pieces.rank[q]
            if pieces.ndim:
                coords = np.concatenate([pieces.src[q], pieces.region[q]], axis=1)
                self.boxes[at[mine][:, None] + np.arange(4 * pieces.ndim)] = coords
        self.first = (np.cumsum(counts, axis=1) - counts).astype(_I32)
        self.count = counts.astype(_I32)
        self.piece_ptr = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])
        self.box_ptr = np.concatenate([[0], np.cumsum(widths)])[self.piece_ptr]
        self.group = rows.group_of_column.astype(_I32).tobytes()  # one object for every rank
        self.width = len(rows.group_of_column)
        self.reads = counts @ rows.per_group()

    def message(self, row: int) -> dict[str, Any]:
        lo, hi = self.piece_ptr[row], self.piece_ptr[row + 1]
        return {
            "n": int(self.reads[row]),
            "table": self.width,
            "group": self.group,
            "first": self.first[row].tobytes(),
            "count": self.count[row].tobytes(),
            "extra_chunk": b"",
            "extra_piece": b"",
            "ndim": self.ndim[lo:hi].tobytes(),
            "boxes": self.boxes[self.box_ptr[row] : self.box_ptr[row + 1]].tobytes(),
            "node": self.node[lo:hi].tobytes(),
            "rank": self.rank[lo:hi].tobytes(),
        }


def _add_rest(msg: dict[str, Any], reads: list[Any], positions: list[int]) -> None:
    """Append reads planned chunk by chunk to ``msg``: each its own piece."""
    first = len(msg["ndim"])
    coords = [
        v
        for read in reads
        for v in (
            *read.src_box.offsets,
            *read.src_box.lengths,
            *read.region.offsets,
            *read.region.lengths,
        )
    ]
    msg["n"] += len(reads)
    msg["extra_chunk"] = np.asarray(positions, _I32).tobytes()
    msg["extra_piece"] = np.arange(first, first + len(reads), dtype=_I32).tobytes()
    msg["ndim"] += np.asarray([len(read.region.offsets) for read in reads], _U8).tobytes()
    msg["boxes"] += np.asarray(coords, _I64).tobytes()
    msg["node"] += np.asarray([read.source_node for read in reads], _I32).tobytes()
    msg["rank"] += np.asarray([read.source_rank for read in reads], _I32).tobytes()


def decode(msg: dict[str, Any], wanted: list[Any]) -> list[dict[str, Any]]:
    """The reads of an :func:`encode` message as dicts (``source_node``, ``source_rank``,
    ``key``, ``src_box``, ``dst_box``, ``region`` as [offsets, lengths], ``nbytes``).

    ``wanted``: the chunk records the rank asked for, in the order it sent them.
    """
    ndims = np.frombuffer(msg["ndim"], _U8).tolist()
    coords = np.frombuffer(msg["boxes"], _I64).tolist()
    nodes = np.frombuffer(msg["node"], _I32).tolist()
    ranks = np.frombuffer(msg["rank"], _I32).tolist()
    pieces = []
    at = 0
    for ndim, node, rank in zip(ndims, nodes, ranks, strict=True):
        c = coords[at : at + 4 * ndim]
        at += 4 * ndim
        region = [c[2 * ndim : 3 * ndim], c[3 * ndim :]]
        elements = 1
        for length in region[1]:
            elements *= length
        pieces.append((node, rank, [c[:ndim], c[ndim : 2 * ndim]], region, elements))
    group = np.frombuffer(msg["group"], _I32).tolist()
    first = np.frombuffer(msg["first"], _I32).tolist()
    count = np.frombuffer(msg["count"], _I32).tolist()
    extras = list(
        zip(
            np.frombuffer(msg["extra_chunk"], _I32).tolist(),
            np.frombuffer(msg["extra_piece"], _I32).tolist(),
            strict=True,
        )
    )
    refs: list[tuple[int, int]] = []
    i = 0  # the next extra read: those of a chunk of group -1 come in its place
    for j in range(msg["table"]):
        g = group[j]
        if g < 0:
            while i < len(extras) and extras[i][0] == j:
                refs.append(extras[i])
                i += 1
        else:
            refs.extend((j, p) for p in range(first[g], first[g] + count[g]))
    refs += extras[i:]
    if len(refs) != msg["n"]:
        raise ProtocolError(f"a plan message lists {len(refs)} reads but says {msg['n']}")
    reads = []
    for j, p in refs:
        want = wanted[j]
        node, rank, src, region, elements = pieces[p]
        reads.append(
            {
                "source_node": node,
                "source_rank": rank,
                "key": want.key,
                "src_box": src,
                "dst_box": [list(want.offsets), list(want.lengths)],
                "region": region,
                "nbytes": elements * itemsize(want.dtype),
            }
        )
    return reads
