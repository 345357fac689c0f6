"""Chunk arithmetic: boxes, flat ranges, byte runs, strided copies and the box index, checked
against numpy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.boxes import (
    Box,
    BoxTree,
    Overlap,
    box_array,
    box_byte_runs,
    contiguous_range,
    copy_box,
    extract_box,
    flat_range_to_boxes,
    flat_shards_to_boxes,
    full_box,
    intersect,
    is_grid,
    place_box,
    relative,
    subtract,
)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


def slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Numpy index of ``box`` (relative to ``origin`` when given)."""
    rel = box if origin is None else relative(box, origin)
    return tuple(slice(o, o + n) for o, n in zip(rel.offsets, rel.lengths, strict=True))


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    """A box (possibly empty) inside a tensor of ``shape``."""
    offsets, lengths = [], []
    for size in shape:
        start = draw(st.integers(0, size))
        offsets.append(start)
        lengths.append(draw(st.integers(0, size - start)))
    return Box(tuple(offsets), tuple(lengths))


@st.composite
def chunk_and_sub(draw: st.DrawFn) -> tuple[Box, Box]:
    """A chunk of a random tensor and a box inside it, both in global coordinates."""
    shape = draw(st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple))
    chunk = draw(boxes_in(shape))
    inner = draw(boxes_in(chunk.lengths))
    sub = Box(
        tuple(a + b for a, b in zip(chunk.offsets, inner.offsets, strict=True)), inner.lengths
    )
    return chunk, sub


def test_box_basics() -> None:
    box = Box((1, 2), (3, 4))
    assert box.numel() == 12 and box.end == (4, 6) and box.ndim == 2 and not box.is_empty()
    assert Box((0, 0), (3, 0)).is_empty() and Box((0, 0), (3, 0)).numel() == 0
    scalar = full_box(())
    assert scalar == Box((), ()) and scalar.numel() == 1 and not scalar.is_empty()
    box.check((4, 6))
    with pytest.raises(ValueError, match="past"):
        box.check((4, 5))
    with pytest.raises(ValueError, match="dimensions"):
        Box((0,), (1, 2)).check()
    with pytest.raises(ValueError, match="non-negative"):
        Box((-1,), (1,)).check()


def test_intersect_and_relative() -> None:
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (4, 4))
    assert intersect(a, b) == Box((2, 3), (2, 1))
    assert intersect(a, Box((4, 0), (1, 4))) is None  # touching is not sharing
    assert intersect(a, Box((1, 1), (0, 2))) is None  # an empty box shares nothing
    assert intersect(Box((), ()), Box((), ())) == Box((), ())
    assert relative(Box((2, 3), (2, 1)), b) == Box((0, 0), (2, 1))
    with pytest.raises(ValueError, match="not inside"):
        relative(a, b)


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_intersect_and_subtract_match_numpy_masks(data: st.DataObject) -> None:
    shape = data.draw(shapes)
    a, b = data.draw(boxes_in(shape)), data.draw(boxes_in(shape))
    mask_a, mask_b = np.zeros(shape, bool), np.zeros(shape, bool)
    mask_a[slices(a)] = True
    mask_b[slices(b)] = True
    both = intersect(a, b)
    expected = mask_a & mask_b
    if both is None:
        assert not expected.any()
    else:
        got = np.zeros(shape, bool)
        got[slices(both)] = True
        assert (got == expected).all()
    count = np.zeros(shape, int)
    pieces = subtract(a, b)
    assert len(pieces) <= 2 * len(shape) + 1
    for piece in pieces:
        assert not piece.is_empty()
        count[slices(piece)] += 1
    assert (count == (mask_a & ~mask_b)).all()  # disjoint, and exactly a minus b


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_flat_range_to_boxes_covers_the_range_in_order(data: st.DataObject) -> None:
    shape = data.draw(shapes)
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_range_to_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    flat = np.arange(total).reshape(shape)
    values = [flat[slices(b)].reshape(-1) for b in boxes]
    for box in boxes:
        box.check(shape)
        assert not box.is_empty()
    # Each box is a contiguous run and they come in order: together they are the range.
    got = np.concatenate(values) if values else np.zeros(0, int)
    assert got.tolist() == list(range(start, stop))


def test_flat_range_to_boxes_shapes() -> None:
    assert flat_range_to_boxes((), 0, 1) == [Box((), ())]
    assert flat_range_to_boxes((), 0, 0) == []
    assert flat_range_to_boxes((10,), 3, 7) == [Box((3,), (4,))]
    assert flat_range_to_boxes((4, 5), 5, 15) == [Box((1, 0), (2, 5))]
    assert flat_range_to_boxes((4, 5), 3, 17) == [
        Box((0, 3), (1, 2)),
        Box((1, 0), (2, 5)),
        Box((3, 0), (1, 2)),
    ]
    assert len(flat_range_to_boxes((3, 4, 5), 7, 53)) == 5
    with pytest.raises(ValueError, match="not inside"):
        flat_range_to_boxes((2, 2), 1, 5)


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_flat_shards_rebuild_every_parameter(data: st.DataObject) -> None:
    params = data.draw(st.lists(shapes, min_size=1, max_size=4))
    sizes = [math.prod(s) for s in params]
    total = sum(sizes)
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=0, max_size=5)))
    bounds = [0, *cuts, total]
    flat = np.arange(total)
    starts = np.cumsum([0, *sizes])
    tensors = [flat[starts[i] : starts[i + 1]].reshape(s) for i, s in enumerate(params)]
    seen = []
    for lo, hi in itertools.pairwise(bounds):
        for index, box in flat_shards_to_boxes(params, lo, hi):
            box.check(params[index])
            seen.append(tensors[index][slices(box)].reshape(-1))
    # Ranks in order, pieces in order: the flat parameter, every element once.
    assert (np.concatenate(seen) if seen else np.zeros(0, int)).tolist() == list(range(total))


def test_flat_shards_to_boxes_example() -> None:
    # Params of 6, 0 and 4 elements; a rank holding flat [4, 8) holds the end of the first
    # and the start of the third.
    assert flat_shards_to_boxes([(2, 3), (0,), (4,)], 4, 8) == [
        (0, Box((1, 1), (1, 2))),
        (2, Box((0,), (2,))),
    ]
    with pytest.raises(ValueError, match="not inside"):
        flat_shards_to_boxes([(2,)], 0, 3)


@given(chunk_and_sub(), st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=300, deadline=None)
def test_byte_runs_agree_with_extract_and_numpy(pair: tuple[Box, Box], size: int) -> None:
    chunk, sub = pair
    raw = np.arange(chunk.numel() * size, dtype=np.uint32).astype(np.uint8).tobytes()
    runs = box_byte_runs(chunk, sub, size)
    packed = extract_box(raw, chunk, sub, size)
    assert b"".join(raw[o : o + n] for o, n in runs) == packed
    assert sum(n for _, n in runs) == len(packed) == sub.numel() * size
    for (o1, n1), (o2, _) in itertools.pairwise(runs):
        assert o1 + n1 < o2  # ascending and merged
    items = np.frombuffer(raw, dtype=np.uint8).reshape(*chunk.lengths, size)
    assert items[slices(sub, chunk)].tobytes() == packed


@given(chunk_and_sub(), st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=300, deadline=None)
def test_contiguous_range_is_the_single_byte_run(pair: tuple[Box, Box], size: int) -> None:
    # What the data path sends or receives in place must be exactly the box's one run.
    chunk, sub = pair
    runs = box_byte_runs(chunk, sub, size)
    expected = runs[0] if len(runs) == 1 and not sub.is_empty() else None
    assert contiguous_range(chunk, sub, size) == expected


def test_byte_runs_merge_whole_trailing_dimensions() -> None:
    chunk = Box((10, 0, 0), (4, 3, 5))
    assert box_byte_runs(chunk, Box((11, 0, 0), (2, 3, 5)), 4) == [(60, 120)]
    assert box_byte_runs(chunk, Box((11, 1, 0), (2, 2, 5)), 1) == [(20, 10), (35, 10)]
    assert box_byte_runs(chunk, chunk, 2) == [(0, 120)]
    assert box_byte_runs(chunk, Box((11, 1, 0), (0, 2, 5)), 1) == []
    assert box_byte_runs(Box((), ()), Box((), ()), 8) == [(0, 8)]


@given(chunk_and_sub(), st.sampled_from([1, 2, 8]))
@settings(max_examples=200, deadline=None)
def test_place_box_inverts_extract_box(pair: tuple[Box, Box], size: int) -> None:
    chunk, sub = pair
    rng = np.random.default_rng(chunk.numel())
    src = rng.integers(0, 256, chunk.numel() * size, dtype=np.uint8).tobytes()
    packed = extract_box(memoryview(src), chunk, sub, size)
    dst = bytearray(chunk.numel() * size)
    place_box(dst, chunk, sub, size, packed)
    expected = np.zeros((*chunk.lengths, size), np.uint8)
    view = np.frombuffer(src, np.uint8).reshape(*chunk.lengths, size)
    expected[slices(sub, chunk)] = view[slices(sub, chunk)]
    assert bytes(dst) == expected.tobytes()
    direct = np.zeros(chunk.numel() * size, np.uint8)
    copy_box(src, chunk, direct, chunk, sub, size)
    assert direct.tobytes() == expected.tobytes()


def test_copy_box_between_different_chunks() -> None:
    whole = np.arange(24, dtype=np.int32).reshape(4, 6)
    src_chunk, dst_chunk = Box((0, 2), (4, 4)), Box((1, 0), (2, 6))
    region = intersect(src_chunk, dst_chunk)
    assert region is not None
    dst = np.zeros((2, 6), np.int32)
    copy_box(whole[:, 2:].copy(), src_chunk, dst, dst_chunk, region, 4)
    assert (dst[:, 2:] == whole[1:3, 2:]).all() and (dst[:, :2] == 0).all()


def test_buffer_errors_are_clear() -> None:
    chunk = Box((0,), (4,))
    with pytest.raises(ValueError, match="cannot hold"):
        extract_box(b"\0" * 7, chunk, chunk, 2)
    with pytest.raises(ValueError, match="read-only"):
        place_box(b"\0" * 8, chunk, chunk, 2, b"\1" * 8)
    strided = np.zeros(16, np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        place_box(strided, chunk, chunk, 2, b"\1" * 8)


def test_boxes_hash_and_compare_by_value() -> None:
    a, b = Box((1, 2), (3, 4)), Box((1, 2), (3, 4))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Box((1, 2), (3, 5)) and [a, a] == [b, b]
    assert Box(offsets=(0,), lengths=(2,)).lengths == (2,)


def test_box_array_reads_offsets_and_lengths() -> None:
    boxes = [Box((0, 1), (2, 3)), Box((4, 5), (6, 7))]
    array = box_array(boxes, 2)
    assert array is not None and array.shape == (2, 2, 2)
    assert array.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert box_array(boxes, 3) is None
    assert box_array([Box((0,), (1, 2))], 1) is None
    scalars = box_array([Box((), ())], 0)
    assert scalars is not None and scalars.shape == (1, 2, 0)


PINWHEEL = [  # five disjoint boxes tiling 4×4, no dimension splitting them into groups
    Box((0, 0), (1, 3)),
    Box((0, 3), (3, 1)),
    Box((3, 1), (1, 3)),
    Box((1, 0), (3, 1)),
    Box((1, 1), (2, 2)),
]


def grid_of(boxes: list[Box]) -> bool:
    array = box_array(boxes, boxes[0].ndim)
    assert array is not None
    return is_grid(array)


def test_grid_examples() -> None:
    rows = [Box((r, 0), (1, 4)) for r in range(4)]
    blocks = [Box((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    uneven = [Box((0, 0), (2, 4)), Box((2, 0), (2, 1)), Box((2, 1), (2, 3))]
    assert grid_of(rows) and grid_of(blocks) and grid_of(uneven)
    assert not grid_of(PINWHEEL)  # disjoint, but not a grid
    assert not grid_of([Box((0, 0), (3, 4)), Box((2, 0), (2, 4))])  # overlap along dim 0
    assert not grid_of([Box((0, 0), (2, 3)), Box((0, 2), (2, 2))])  # same rows, cols overlap
    assert grid_of([Box((0,), (5,))])


@st.composite
def box_sets(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], bool]:
    """Distinct non-empty boxes in a small tensor: a random grid (recursive splits), maybe with
    one box moved or added, so that some sets overlap or are no grid."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))

    def split(box: Box, dim: int) -> list[Box]:
        if dim == len(shape) or draw(st.integers(0, 3)) == 0:
            return [box]
        cuts = sorted(set(draw(st.lists(st.integers(1, box.lengths[dim]), max_size=3))))
        bounds = [0, *(c for c in cuts if c < box.lengths[dim]), box.lengths[dim]]
        out = []
        for lo, hi in itertools.pairwise(bounds):
            offsets, lengths = list(box.offsets), list(box.lengths)
            offsets[dim] += lo
            lengths[dim] = hi - lo
            out += split(Box(tuple(offsets), tuple(lengths)), dim + 1)
        return out

    boxes = split(full_box(shape), 0)
    extra = draw(st.booleans())
    if extra:
        boxes.append(draw(boxes_in(shape)))
    return shape, list(dict.fromkeys(b for b in boxes if not b.is_empty())), not extra


@given(box_sets())
@settings(max_examples=300, deadline=None)
def test_grid_check_and_box_tree_agree_with_masks(
    case: tuple[tuple[int, ...], list[Box], bool],
) -> None:
    shape, boxes, split_only = case
    count = np.zeros(shape, int)
    for box in boxes:
        count[slices(box)] += 1
    disjoint = bool((count <= 1).all())
    array = box_array(boxes, len(shape))
    assert array is not None
    assert is_grid(array) or not split_only  # recursive splits always make a grid
    if is_grid(array):
        assert disjoint  # and a grid is never wrong about disjointness
    items = [(box, i) for i, box in enumerate(boxes)]
    if not disjoint:
        with pytest.raises(Overlap) as info:
            BoxTree(items)
        assert intersect(info.value.a[0], info.value.b[0]) is not None
        return
    tree = BoxTree(items)
    for probe in [full_box(shape), *boxes, Box((0,) * len(shape), (1,) * len(shape))]:
        found = {i for _, i in tree.find(probe)}
        meeting = {i for box, i in items if intersect(box, probe) is not None}
        assert meeting <= found


def test_box_tree_finds_in_order_and_handles_edges() -> None:
    assert BoxTree([]).find(Box((0,), (3,))) == []
    lone = BoxTree([(Box((2,), (2,)), "a")])
    assert lone.find(Box((0,), (1,))) == [(Box((2,), (2,)), "a")]  # callers intersect
    rows = BoxTree([(Box((r, 0), (1, 4)), r) for r in (3, 0, 2, 1)])
    assert [r for _, r in rows.find(Box((1, 1), (2, 2)))] == [1, 2]
    assert rows.find(Box((1, 1), (0, 2))) == []  # an empty box meets nothing
    pinwheel = BoxTree([(box, i) for i, box in enumerate(PINWHEEL)])
    assert sorted(i for _, i in pinwheel.find(Box((0, 0), (2, 2)))) == [0, 3, 4]
