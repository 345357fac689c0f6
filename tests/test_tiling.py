"""Whether boxes cover a tensor exactly once (``peerckpt/tiling.py``), checked against numpy:
every element counted."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.boxes import Box, flat_range_to_boxes
from peerckpt.tiling import MAX_CORNERS, TooFragmented, tiles


def _counted(boxes: list[Box], shape: tuple[int, ...]) -> bool:
    """The slow truth: every element of ``shape`` covered exactly once."""
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if any(o + n > s for o, n, s in zip(b.offsets, b.lengths, shape, strict=True)):
            return False
        count[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))] += 1
    return bool((count == 1).all())


@st.composite
def _boxes_in(draw: st.DrawFn) -> tuple[list[Box], tuple[int, ...]]:
    """A shape and boxes in it: the cells of a random grid (an exact cover), perhaps changed
    (a box moved, grown, dropped or doubled), or boxes drawn at random."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    if draw(st.booleans()):
        cuts = [
            sorted({0, s, *draw(st.lists(st.integers(1, max(1, s - 1)), max_size=3))})
            for s in shape
        ]
        boxes = [
            Box(tuple(c[0] for c in cell), tuple(c[1] - c[0] for c in cell))
            for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
        ]
        if boxes and draw(st.booleans()):
            i = draw(st.integers(0, len(boxes) - 1))
            how = draw(st.sampled_from(["move", "grow", "drop", "double"]))
            b = boxes[i]
            if how == "drop":
                del boxes[i]
            elif how == "double":
                boxes.append(b)
            elif b.offsets:
                d = draw(st.integers(0, len(shape) - 1))
                offsets, lengths = list(b.offsets), list(b.lengths)
                if how == "move":
                    offsets[d] = draw(st.integers(0, shape[d]))
                else:
                    lengths[d] += 1
                boxes[i] = Box(tuple(offsets), tuple(lengths))
        return boxes, shape
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        offsets = tuple(draw(st.integers(0, s)) for s in shape)
        lengths = tuple(
            draw(st.integers(0, s - o + 1)) for s, o in zip(shape, offsets, strict=True)
        )
        boxes.append(Box(offsets, lengths))
    return boxes, shape


@settings(max_examples=400, deadline=None)
@given(_boxes_in())
def test_tiles_agrees_with_counting_every_element(case: tuple[list[Box], tuple[int, ...]]) -> None:
    boxes, shape = case
    nonempty = [b for b in boxes if not b.is_empty()]
    assert tiles(boxes, shape) == _counted(nonempty, shape)


def test_sizes_that_add_up_do_not_hide_an_overlap() -> None:
    # 3 + 3 + 2 = 8 elements of (8,), but [2, 5) and [3, 6) share two and [6, 8) is covered once
    boxes = [Box((0,), (3,)), Box((3,), (3,)), Box((2,), (2,))]
    assert not tiles(boxes, (8,))
    pinwheel = [  # four 2x1 bricks round a centre cell: an exact cover that is no grid
        Box((0, 0), (2, 1)), Box((0, 1), (1, 2)), Box((1, 2), (2, 1)), Box((2, 0), (1, 2)),
        Box((1, 1), (1, 1)),
    ]  # fmt: skip
    assert tiles(pinwheel, (3, 3))
    assert not tiles([*pinwheel[:-1], Box((1, 0), (1, 1))], (3, 3))


def test_flat_shards_of_many_ranks_tile_their_tensor_in_linear_time() -> None:
    # 10,000 ranks' flat shards (ZeRO, FSDP) of a 3-d tensor: 16,000 boxes
    shape = (100, 70, 30)
    numel = math.prod(shape)
    bounds = [int(x) for x in np.linspace(0, numel, 10_001)]
    boxes = [b for lo, hi in itertools.pairwise(bounds) for b in flat_range_to_boxes(shape, lo, hi)]
    assert len(boxes) >= 15_000
    started = time.monotonic()
    assert tiles(boxes, shape)
    assert not tiles([*boxes, boxes[0]], shape)
    # every pair compared: 10^9 comparisons; corner parity: under a second here, unloaded
    assert time.monotonic() - started < 30


def test_boxes_cut_in_too_many_dimensions_are_refused() -> None:
    # every element of a (2,) * 12 tensor its own box: 4,096 boxes of 4,096 corners each
    shape = (2,) * 12
    cells = [Box(c, (1,) * 12) for c in itertools.product((0, 1), repeat=12)]
    with pytest.raises(TooFragmented, match=f"more than {MAX_CORNERS}"):
        tiles(cells, shape)
