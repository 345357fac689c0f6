"""Planned reads: what a recovery plan tells an agent to copy, and its compact message.

A :class:`Read` copies a region of a held chunk (of an old rank's committed snapshot, on a
node, or in durable storage: :data:`STORAGE`) into a chunk a new rank wants. The
coordinator's planner makes them (``recovery/planning/``); the agents carry them out
(``replication/gather.py``). Between the two they travel as one compact message per rank:
arrays as raw bytes, not an object per read. The coordinator encodes it
(``recovery/planning/message.py``); the rank's agent decodes it (:func:`decode`), knowing the
chunks the rank asked for. msgpack carries the bytes; nothing is pickled.

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

Pure data and functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from peerckpt.boxes import Box
from peerckpt.dtypes import itemsize
from peerckpt.errors import ProtocolError
from peerckpt.manifest import ChunkRecord

STORAGE = -1  # the durable tier as a holder: read only where no memory copy survived
ERASURE = -2  # a rank no node holds, rebuilt from its group's pieces and parity (--erasure)
I32, I64, U8 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1")


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
new_read = partial(tuple.__new__, Read)


def empty_message() -> dict[str, Any]:
    """A message with no reads."""
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


def decode(msg: dict[str, Any], wanted: Sequence[ChunkRecord]) -> list[Read]:
    """The reads of a plan message, in the rank's wanted order.

    ``wanted``: the chunk records the rank asked for, in the order it sent them.
    """
    ndims = np.frombuffer(msg["ndim"], U8).tolist()
    coords = np.frombuffer(msg["boxes"], I64).tolist()
    nodes = np.frombuffer(msg["node"], I32).tolist()
    ranks = np.frombuffer(msg["rank"], I32).tolist()
    pieces = []
    at = 0
    for ndim, node, rank in zip(ndims, nodes, ranks, strict=True):
        c = coords[at : at + 4 * ndim]
        at += 4 * ndim
        region = Box(tuple(c[2 * ndim : 3 * ndim]), tuple(c[3 * ndim :]))
        src = Box(tuple(c[:ndim]), tuple(c[ndim : 2 * ndim]))
        pieces.append((node, rank, src, region, region.numel()))
    group = np.frombuffer(msg["group"], I32).tolist()
    first = np.frombuffer(msg["first"], I32).tolist()
    count = np.frombuffer(msg["count"], I32).tolist()
    extras = list(
        zip(
            np.frombuffer(msg["extra_chunk"], I32).tolist(),
            np.frombuffer(msg["extra_piece"], I32).tolist(),
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
        dst = Box(tuple(want.offsets), tuple(want.lengths))
        reads.append(
            new_read((node, rank, want.key, src, dst, region, elements * itemsize(want.dtype)))
        )
    return reads
