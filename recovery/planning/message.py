"""Encoding a recovery plan's reads as the compact per-rank message of ``peerckpt/reads.py``.

The coordinator (``recovery/elastic.py``) sends each node, per rank on it, the message that
:func:`encode` makes; the node's agent turns it back into reads with ``reads.decode``. The
format is described there, with the reader.

Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from peerckpt.reads import I32, I64, U8, empty_message
from peerckpt.recovery.planning.results import ReadPlan


def encode(plan: ReadPlan) -> dict[int, dict[str, Any]]:
    """Every new rank's reads as a message (see the module docstring)."""
    table = _TableParts(plan) if plan.rows is not None else None
    out: dict[int, dict[str, Any]] = {}
    for place, new in enumerate(plan.order):
        row = plan.row_of.get(place)
        msg = table.message(row) if table is not None and row is not None else empty_message()
        rest = plan.rest[place]
        if rest:
            _add_rest(msg, rest, plan.rest_positions[place])
        out[new] = msg
    return out


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
        self.ndim = ndims[group].astype(U8)
        self.node = np.empty(total, I32)
        self.rank = np.empty(total, I32)
        self.boxes = np.empty(int(widths.sum()), I64)
        for g, pieces in enumerate(groups):
            mine = np.flatnonzero(group == g)
            q = index[mine]
            self.node[mine], self.rank[mine] = pieces.node[q], pieces.rank[q]
            if pieces.ndim:
                coords = np.concatenate([pieces.src[q], pieces.region[q]], axis=1)
                self.boxes[at[mine][:, None] + np.arange(4 * pieces.ndim)] = coords
        self.first = (np.cumsum(counts, axis=1) - counts).astype(I32)
        self.count = counts.astype(I32)
        self.piece_ptr = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])
        self.box_ptr = np.concatenate([[0], np.cumsum(widths)])[self.piece_ptr]
        self.group = rows.group_of_column.astype(I32).tobytes()  # one object for every rank
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
    msg["extra_chunk"] = np.asarray(positions, I32).tobytes()
    msg["extra_piece"] = np.arange(first, first + len(reads), dtype=I32).tobytes()
    msg["ndim"] += np.asarray([len(read.region.offsets) for read in reads], U8).tobytes()
    msg["boxes"] += np.asarray(coords, I64).tobytes()
    msg["node"] += np.asarray([read.source_node for read in reads], I32).tobytes()
    msg["rank"] += np.asarray([read.source_rank for read in reads], I32).tobytes()
