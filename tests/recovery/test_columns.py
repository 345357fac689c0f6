"""Columnar plan inputs, the table path against the chunk path, plan messages, peer dealing.

The table path (``recovery/planning/table_reads.py``) must plan exactly what planning chunk by chunk
plans (or fail the same way) on layouts it takes, and must take the layouts DTensor makes;
the compact messages must decode to the plan's reads; the dealing must balance.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.boxes import Box
from peerckpt.errors import RecoveryFailed, StateMismatch
from peerckpt.manifest import ChunkRecord, chunk_name
from peerckpt.reads import STORAGE, decode
from peerckpt.recovery.planning import reshard as planner
from peerckpt.recovery.planning import table_reads as columnar
from peerckpt.recovery.planning.balance import assign, deal
from peerckpt.recovery.planning.message import encode
from peerckpt.recovery.planning.tables import ChunkLists, from_chunks, from_records
from peerckpt.recovery.planning.types import HeldChunk, WantedChunk

from .test_planner import even_splits


@contextmanager
def table_path_count() -> Iterator[Counter[str]]:
    """Counts, per key, the table columns the table path left to the chunk path."""
    left: Counter[str] = Counter()
    original = planner.plan_table

    def spy(wanted: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(wanted, *args, **kwargs)
        for j in np.flatnonzero(result.group_of_column < 0).tolist():
            left[wanted.keys[j]] += 1
        return result

    planner.plan_table = spy
    try:
        yield left
    finally:
        planner.plan_table = original


def mesh_layout(
    shapes: list[tuple[int, ...]], rows: int, cols: int, dims: list[tuple[int, int]]
) -> dict[int, list[tuple[int, Box]]]:
    """Every tensor Shard(d0) over mesh rows × Shard(d1) over mesh columns (d0 == d1 shards
    one dimension over the columns only: the rows are replicas), as torch.chunk cuts."""
    layout: dict[int, list[tuple[int, Box]]] = {r: [] for r in range(rows * cols)}
    for i, (shape, (d0, d1)) in enumerate(zip(shapes, dims, strict=True)):
        outer = even_splits(shape[d0], rows)
        inner = even_splits(shape[d1], cols)
        for r in range(rows * cols):
            offsets, lengths = [0] * len(shape), list(shape)
            if d0 != d1:
                offsets[d0], lengths[d0] = outer[r // cols]
            offsets[d1], lengths[d1] = inner[r % cols]
            layout[r].append((i, Box(tuple(offsets), tuple(lengths))))
    return layout


@st.composite
def jobs(draw: st.DrawFn) -> tuple[Any, ...]:
    """A job's old and new DTensor-like layouts, holders (some copies lost), nodes, previous."""
    ndim = draw(st.integers(1, 2))
    n = draw(st.integers(1, 4))
    shapes = [
        tuple(draw(st.integers(1, 12)) for _ in range(ndim)) for _ in range(draw(st.integers(1, 3)))
    ] * n  # tensors sharded alike share a group

    def layout() -> dict[int, list[tuple[int, Box]]]:
        rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 6))
        dims = [(draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1))) for _ in shapes]
        return mesh_layout(shapes, rows, cols, dims)

    old, new = layout(), layout()
    keys = [f"layers.{i}.w" for i in range(len(shapes))]
    held = {r: [HeldChunk(keys[i], "bfloat16", shapes[i], b) for i, b in c] for r, c in old.items()}
    wanted = {
        r: [WantedChunk(keys[i], "bfloat16", shapes[i], b) for i, b in c] for r, c in new.items()
    }
    per_node = draw(st.integers(1, 3))
    nodes = len(old) // per_node + 1
    holders = {
        r: draw(
            st.sampled_from(
                [{r // per_node, r // per_node + 1}, {r // per_node}, {STORAGE, r // per_node + 1}]
            )
        )
        for r in old
    }
    new_nodes = {r: draw(st.integers(0, nodes + 1)) for r in new}
    previous = {r: draw(st.none() | st.sampled_from(sorted(old))) for r in new}
    if draw(st.booleans()):  # private state after the shared tensors
        for r in old:
            held[r].append(HeldChunk(f"meta@{r}", "uint8", (3,), Box((0,), (3,))))
        for r, prev in previous.items():
            if prev is not None:
                wanted[r].append(WantedChunk(f"meta@{prev}", "uint8", (3,), Box((0,), (3,))))
    return held, holders, wanted, new_nodes, previous


def outcome(*args: Any, tables: bool) -> Any:
    try:
        plan = planner._plan(*args, tables=tables)
    except (RecoveryFailed, StateMismatch) as e:
        return type(e), str(e)
    return {rank: list(reads) for rank, reads in plan.by_rank().items()}


@given(jobs())
@settings(max_examples=200, deadline=None)
def test_the_table_path_takes_dtensor_layouts_and_plans_what_the_chunk_path_plans(
    job: tuple[Any, ...],
) -> None:
    _, holders, wanted, _, _ = job
    expected = outcome(*job, tables=False)
    with table_path_count() as left:
        got = outcome(*job, tables=True)
    assert got == expected
    if isinstance(expected, dict):
        # Every wanted byte is covered exactly once, from a holder that has it.
        for rank, reads in expected.items():
            assert sum(r.nbytes for r in reads) == sum(
                c.box.numel() * (1 if c.dtype == "uint8" else 2) for c in wanted[rank]
            )
            for read in reads:
                assert read.source_node in holders[read.source_rank]
        # Every shared tensor went through the table path.
        assert not [key for key in left if key.startswith("layers.")]


def test_a_thousand_tensors_alike_make_one_group() -> None:
    shapes = [(64, 8)] * 1000
    old, new = (
        mesh_layout(shapes, 1, 16, [(0, 0)] * 1000),
        mesh_layout(shapes, 1, 12, [(0, 0)] * 1000),
    )
    held = {r: [HeldChunk(f"t{i}", "float32", (64, 8), b) for i, b in c] for r, c in old.items()}
    wanted = {
        r: [WantedChunk(f"t{i}", "float32", (64, 8), b) for i, b in c] for r, c in new.items()
    }
    holders = {r: {r // 4, r // 4 + 1} for r in old}
    args = (held, holders, wanted, {r: 9 for r in new}, {r: None for r in new})
    plan = planner.plan(*args)
    assert plan.rows is not None and len(plan.rows.groups) == 1
    assert outcome(*args, tables=True) == outcome(*args, tables=False)


@st.composite
def chunk_lists(draw: st.DrawFn) -> dict[int, list[HeldChunk]]:
    shapes = draw(
        st.lists(st.lists(st.integers(0, 9), max_size=3).map(tuple), min_size=1, max_size=4)
    )
    ranks = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True))
    out = {}
    for r in ranks:
        row = [
            HeldChunk(f"k{i}", "float32", s, Box(tuple(draw(st.integers(0, 9)) for _ in s), s))
            for i, s in enumerate(shapes)
        ]
        if draw(st.booleans()):
            row = draw(st.permutations(row))
        if draw(st.booleans()):
            row.append(HeldChunk(f"own@{r}", "uint8", (4,), Box((0,), (4,))))
        out[r] = row
    return out


@given(chunk_lists())
def test_tables_hold_the_chunks_they_were_made_of(chunks: dict[int, list[HeldChunk]]) -> None:
    lists = from_chunks(chunks)
    assert lists.to_chunks(HeldChunk) == chunks
    if lists.table is not None:
        assert lists.table.offsets.shape == (lists.table.starts[-1], len(lists.table.ranks))


@given(chunk_lists(), st.booleans())
def test_tables_from_records_are_what_the_records_say(
    chunks: dict[int, list[HeldChunk]], rename: bool
) -> None:
    records = {
        r: [
            ChunkRecord(
                c.key.split("@")[0],
                c.dtype,
                c.global_shape,
                c.box.offsets,
                c.box.lengths,
                0,
                0,
                scope="rank" if "@" in c.key else "global",
            ).to_msg()
            for c in row
        ]
        for r, row in chunks.items()
    }
    lists = from_records(records, HeldChunk, rename=rename)
    expected = {
        r: [
            HeldChunk(
                chunk_name(m[0], m[8], r) if rename else m[0],
                m[1],
                tuple(m[2]),
                Box(tuple(m[3]), tuple(m[4])),
            )
            for m in msgs
        ]
        for r, msgs in records.items()
    }
    made = lists.to_chunks(HeldChunk)
    # The table's chunks come first; order within the rest is the list's.
    assert {r: sorted(map(repr, c)) for r, c in made.items()} == {
        r: sorted(map(repr, c)) for r, c in expected.items()
    }
    if lists.table is not None:
        assert not any("@" in key for key in lists.table.keys)


@given(jobs(), st.booleans())
@settings(max_examples=100, deadline=None)
def test_plan_messages_decode_to_the_plan_reads(job: tuple[Any, ...], permute: bool) -> None:
    held, holders, wanted, new_nodes, previous = job
    if permute and len(wanted) > 1:  # a list in another order: planned chunk by chunk
        first = min(wanted)
        wanted[first] = list(reversed(wanted[first]))
    try:
        plan = planner.plan(held, holders, wanted, new_nodes, previous)
    except RecoveryFailed:
        return
    messages = encode(plan)
    assert set(messages) == set(wanted)
    for rank, msg in messages.items():
        records = [
            ChunkRecord(c.key, c.dtype, c.global_shape, c.box.offsets, c.box.lengths, 0, 0)
            for c in wanted[rank]
        ]
        assert all(isinstance(v, (int, bytes)) for v in msg.values())  # msgpack-ready
        assert decode(msg, records) == list(plan.reads(rank))


def test_equal_items_of_a_set_alternate_from_the_lowest_node() -> None:
    sets = [(3, 7), (1, 2, 5)]
    which = np.asarray([0, 0, 1, 0, 1, 1, 0, 1, 1, 1])
    choice = deal(sets, which, np.full(len(which), 100))
    assert choice[which == 0].tolist() == [0, 1, 0, 1]
    assert choice[which == 1].tolist() == [0, 1, 2, 0, 1, 2]


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 1000)), min_size=1, max_size=400),
)
def test_dealing_balances_the_peers(items: list[tuple[int, int]]) -> None:
    # Sets chain nodes 0-1, 1-2, 2-3 and node 3 alone (a node whose buddy was lost).
    sets = [(0, 1), (1, 2), (2, 3), (3,)]
    which = np.asarray([s for s, _ in items])
    sizes = np.asarray([n for _, n in items])
    choice = deal(sets, which, sizes)
    load = Counter[int]()
    for s, n, c in zip(which.tolist(), sizes.tolist(), choice.tolist(), strict=True):
        assert 0 <= c < len(sets[s])
        load[sets[s][c]] += n
    assert sum(load.values()) == sizes.sum()
    # No node serves much more than it would under the best split of each set's bytes,
    # give or take the items that straddle turns.
    totals = np.bincount(which, weights=sizes, minlength=4)
    best = max(totals[3], totals.sum() / 4)
    assert max(load.values()) <= best + 4 * sizes.max() * math.sqrt(len(items) + 1)


def test_items_are_reads_of_one_rank_from_one_box_region_and_sources() -> None:
    # Rank 0 reads two tensors' same region from the same box (one item), rank 1 another.
    members = np.asarray(
        [
            [0, 0, 0, 0, 1, 0, 4, 0, 4],
            [0, 1, 0, 0, 1, 0, 4, 0, 4],
            [1, 0, 0, 0, 1, 0, 4, 0, 4],
        ]
    )
    choice = assign(members, np.asarray([10, 10, 20]), np.asarray([0]), [(5, 6)])
    assert choice.tolist() == [0, 0, 1]


def test_chunk_lists_without_a_table_plan_chunk_by_chunk() -> None:
    held = ChunkLists(None, {0: [HeldChunk("w", "float32", (4,), Box((0,), (4,)))]})
    wanted = ChunkLists(None, {0: [WantedChunk("w", "float32", (4,), Box((1,), (2,)))]})
    plan = planner.plan(held, {0: [0]}, wanted, {0: 0}, {0: 0})
    assert [(r.source_node, r.source_rank, r.region) for r in plan.reads(0)] == [
        (0, 0, Box((1,), (2,)))
    ]
    with pytest.raises(ValueError, match="no node"):
        planner.plan(held, {0: [0]}, wanted, {}, {})
    assert columnar.NETWORK not in [r.source_node for r in plan.reads(0)]


def _as_columns(chunks: dict[int, list[Any]], rename_private: bool) -> dict[int, Any]:
    """Each rank's chunks as ChunkColumns (private ``k@r`` chunks as scope "rank", key ``k``)."""
    from peerckpt.columns import ChunkColumns

    return {
        r: ChunkColumns.from_records(
            [
                ChunkRecord(
                    c.key.split("@")[0] if rename_private else c.key,
                    c.dtype,
                    c.global_shape,
                    c.box.offsets,
                    c.box.lengths,
                    0,
                    0,
                    scope="rank" if "@" in c.key else "global",
                )
                for c in row
            ],
            places=False,
        )
        for r, row in chunks.items()
    }


@given(chunk_lists(), st.booleans(), st.data())
def test_tables_from_columns_are_what_the_records_say(
    chunks: dict[int, list[HeldChunk]], rename: bool, data: st.DataObject
) -> None:
    from peerckpt.recovery.planning.tables import from_columns

    columns = _as_columns(chunks, rename_private=True)
    # Some ranks' lists arrive as records (a rebuilt coordinator's): they join the rest.
    mixed = {r: (list(c) if data.draw(st.booleans()) else c) for r, c in columns.items()}
    records = {r: list(c) for r, c in columns.items()}
    made = from_columns(mixed, HeldChunk, rename).to_chunks(HeldChunk)
    expected = from_records(records, HeldChunk, rename).to_chunks(HeldChunk)
    assert {r: sorted(map(repr, c)) for r, c in made.items()} == {
        r: sorted(map(repr, c)) for r, c in expected.items()
    }


@given(jobs())
@settings(max_examples=100, deadline=None)
def test_a_plan_from_columns_is_the_plan_from_chunks(job: tuple[Any, ...]) -> None:
    from peerckpt.recovery.planning.tables import from_columns

    held, holders, wanted, new_nodes, previous = job
    expected = outcome(*job, tables=True)
    lists = (
        from_columns(_as_columns(held, rename_private=True), HeldChunk, rename=True),
        from_columns(_as_columns(wanted, rename_private=False), WantedChunk, rename=False),
    )
    got = outcome(lists[0], holders, lists[1], new_nodes, previous, tables=True)
    assert got == expected
