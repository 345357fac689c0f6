"""The recovery plan of a simulated job, end to end: from the ranks' messages to each node's reads.

Part of ``bench/scale.py``. The coordinator's own code runs, in this process, on the messages
as its RPC server receives them (msgpack bytes; the gRPC transport and the call's MAC are the
coordinator benchmark's, ``bench/coordinator.py``):

1. *Layouts*: every old rank's first ``Replicated`` report of the epoch carries its layout as
   ``ChunkColumns`` (``peerckpt/columns.py``); each is decoded and checked as the server does
   and recorded by the ``CommitTracker``, which fills the held table as they arrive, and the
   step commits. Timed per layout (``layout_us``): it happens during training, once per epoch.
2. A node is lost and the world shrinks by its 8 ranks (every shard boundary moves): the
   resharding epoch's ``old_layout_summary`` (what the ranks are told of the old layout) is
   timed on its own (``summary_s``): it is sent before any rank asks for anything.
3. *End to end* (``end_to_end_s``): every new rank's ``Wants`` body is decoded and checked,
   given to ``ReshardRounds.add`` (``recovery/elastic.py``) as the coordinator's ``wants``
   handler does; the last one plans the round (``recovery/planning/``) and encodes each
   rank's reads, grouped by node. Wall clock and the process's CPU time.

The job is ``bench/planner.py``'s worst case: ``tensors`` bfloat16 tensors of k · ranks rows
(k = 1…4) by 1,024, ``Shard(0)`` as torch.chunk cuts them, 8 ranks per node, every snapshot
also on the next node, and one private blob per rank; the new ranks want their shards of
every tensor and their old rank's blob. The inputs are built with numpy, not timed.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np

from peerckpt.codec import pack, unpack
from peerckpt.columns import ChunkColumns
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.membership import Membership, RankAssignment
from peerckpt.messages import decode, encode
from peerckpt.messages.control import Replicated, Wants
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.elastic import ReshardRounds, old_layout_summary
from peerckpt.states import EpochMode

PER_NODE = 8
COLUMNS = 1024
BLOB = 4096  # bytes of each rank's private blob
STEP = 5


def _body(msg: Any) -> bytes:
    """A request's body as the RPC client sends it (``peerckpt/rpc.py``)."""
    fields = encode(msg)
    del fields["type"]
    return pack(fields)


def _received(cls: type[Any], body: bytes) -> Any:
    """The typed message the RPC server hands its handler (``RpcServer._wrap_unary``)."""
    return decode({**unpack(body), "type": cls.TYPE}, cls, where="bench")


def _shards(tensors: int, old: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's (start row, rows) of every tensor, ``Shard(0)`` over ``world`` ranks."""
    rows = old * (1 + np.arange(tensors, dtype=np.int64) % 4)
    step = -(-rows // world)
    start = np.minimum(np.arange(world, dtype=np.int64)[:, None] * step, rows)
    return start, np.minimum(start + step, rows) - start


def _meta(tensors: int, old: int) -> bytes:
    keys = [f"layers.{i}.weight" for i in range(tensors)]
    shapes = [[old * (1 + i % 4), COLUMNS] for i in range(tensors)]
    return pack([keys, ["bfloat16"] * tensors, shapes])


def _boxes(start: np.ndarray, rows: np.ndarray) -> list[bytes]:
    """Each rank's boxes as ``ChunkColumns.boxes``: every offset, then every length."""
    n, tensors = start.shape
    flat = np.zeros((n, 4 * tensors), np.int64)
    flat[:, 0 : 2 * tensors : 2] = start
    flat[:, 2 * tensors :: 2] = rows
    flat[:, 2 * tensors + 1 :: 2] = COLUMNS
    return [row.tobytes() for row in flat]


def _places(rows: np.ndarray) -> list[bytes]:
    nbytes = rows * COLUMNS * 2
    at = np.cumsum(-(-nbytes // 64) * 64, axis=1) - (-(-nbytes // 64) * 64)
    return [np.concatenate([a, b]).tobytes() for a, b in zip(at, nbytes, strict=True)]


def _blob(rank: int, scope_key: str = META_KEY, at: int = 0) -> ChunkRecord:
    return ChunkRecord(scope_key, "uint8", (BLOB,), (0,), (BLOB,), at, BLOB, None, "rank")


def measure(ranks: int, tensors: int) -> dict[str, Any]:
    """Plan the shrink of ``ranks`` old ranks by one node, end to end; see the module."""
    gc.collect()
    nodes = ranks // PER_NODE
    meta = _meta(tensors, ranks)
    start, rows = _shards(tensors, ranks, ranks)

    def report(r: int, boxes: bytes, places: bytes) -> bytes:
        node = r // PER_NODE
        columns = ChunkColumns(meta, boxes, places, (_blob(r),))
        return _body(Replicated(node, 0, r, STEP, [node, (node + 1) % nodes], 1 << 30, BLOB,
                                columns=columns))  # fmt: skip

    layouts = [
        report(r, boxes, places)
        for r, (boxes, places) in enumerate(zip(_boxes(start, rows), _places(rows), strict=True))
    ]
    tracker = CommitTracker(0, frozenset(range(ranks)))
    began, cpu = time.perf_counter(), time.process_time()
    for body in layouts:
        msg = _received(Replicated, body)
        committed = tracker.record(
            msg.epoch, msg.rank, msg.step, msg.holders, msg.columns, msg.meta_nbytes
        )
    layout_s = time.perf_counter() - began
    layout_cpu = time.process_time() - cpu
    assert committed == STEP, committed
    del layouts
    lost = nodes // 2
    tracker.forget_node(lost)
    survivors = [r for r in range(ranks) if r // PER_NODE != lost]
    began = time.perf_counter()
    summary = old_layout_summary(tracker.committed_layouts)
    summary_s = time.perf_counter() - began
    assert len(summary["shared"]) == tensors
    world = len(survivors)
    members = Membership(
        1, world, {n: RankAssignment(n, old // PER_NODE, 1000 + n) for n, old in enumerate(survivors)},
        {}, STEP, {}, {}, "", EpochMode.RESHARD, gen=1, previous=dict(enumerate(survivors)),
        old_world=ranks,
    )  # fmt: skip
    fresh = CommitTracker(
        1, frozenset(range(world)), gen=1, committed_step=STEP,
        committed_holders={r: set(h) for r, h in tracker.committed_holders.items()},
        committed_layouts=dict(tracker.committed_layouts),
        committed_table=tracker.committed_table,
    )  # fmt: skip
    start, rows = _shards(tensors, ranks, world)

    def want(n: int, boxes: bytes) -> bytes:
        columns = ChunkColumns(meta, boxes, b"", (_blob(n, f"{META_KEY}@{survivors[n]}"),))
        return _body(Wants(members.ranks[n].node, 1, 0, n, [], columns))

    wants = [want(n, boxes) for n, boxes in enumerate(_boxes(start, rows))]
    del start, rows
    gc.collect()
    rounds = ReshardRounds()
    was_enabled = gc.isenabled()
    gc.disable()  # as in the planner: a big plan makes no garbage cycles
    try:
        began, cpu = time.perf_counter(), time.process_time()
        decode_s = 0.0
        by_node = None
        for body in wants:
            t = time.perf_counter()
            msg = _received(Wants, body)
            decode_s += time.perf_counter() - t
            by_node = rounds.add(members, fresh, msg.round, msg.rank, msg.columns)
        end_to_end = time.perf_counter() - began
        end_cpu = time.process_time() - cpu
    finally:
        if was_enabled:
            gc.enable()
    assert by_node is not None and sum(map(len, by_node.values())) == world
    message_bytes = sum(
        len(v) for m in by_node.values() for reads in m.values() for v in reads.values()
        if isinstance(v, bytes)
    )  # fmt: skip
    del by_node, wants, rounds, fresh, tracker
    gc.collect()
    return {
        "ranks": ranks,
        "new_ranks": world,
        "tensors_per_rank": tensors,
        "chunks_per_side": ranks * (tensors + 1),
        "layout_us": round(layout_s / ranks * 1e6, 1),
        "layouts_s": round(layout_s, 3),
        "layouts_cpu_s": round(layout_cpu, 3),
        "summary_s": round(summary_s, 3),
        "end_to_end_s": round(end_to_end, 3),
        "end_to_end_cpu_s": round(end_cpu, 3),
        "wants_decode_s": round(decode_s, 3),
        "reads_message_bytes": message_bytes,
    }
