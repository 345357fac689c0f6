"""Whether a set of boxes covers a tensor exactly once: the check before a tensor is assembled.

A reader that assembles a whole tensor from stored boxes (``persist/interop.py``: export,
``full_tensors``) allocates the tensor only once its boxes are known to cover every element
exactly once: a gap would hand out memory nobody wrote, and an overlap lets the sum of the
boxes' sizes match the tensor's while some elements are never written. Checking every pair of
boxes costs O(n²): 30,000 boxes of one tensor (10,000 ranks, three boxes each) took minutes.

:func:`tiles` decides it in O(n · 2^d) for boxes cut in d dimensions (d is 1 to 4 for real
layouts; dimensions every box spans whole are left out), with the corner-parity argument:

    Write a half-open box B = [o, o + l) as a signed sum of the orthants {x ≥ c} of its 2^d
    corners c. Then f = Σ 1_B − 1_T (boxes B, tensor T) is Σ_c w(c) · 1{x ≥ c}, where w(c)
    has the parity of the number of times c is a corner of a box or of T. If every point is
    a corner an even number of times in all (each corner of T an odd number among the boxes,
    every other point an even number), every w(c) is even, so f(x) is even everywhere. The
    boxes lie inside T, so f ≥ −1 there, hence f ≥ 0: every element is covered. And the sum
    of f over T is Σ |B| − |T|; when that is 0 (the sizes add up), f = 0: covered once.
    Conversely, an exact cover has f = 0, so every w(c) = 0 and the parities hold.

Pure functions; no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from peerckpt.boxes import Box

# More corners than this (boxes × 2^dimensions cut) is not a layout any writer makes.
MAX_CORNERS = 1 << 22


class TooFragmented(ValueError):
    """The boxes are cut in so many dimensions that checking them would cost too much."""


def tiles(boxes: Sequence[Box], shape: Sequence[int]) -> bool:
    """Whether ``boxes`` cover every element of a tensor of ``shape`` exactly once.

    Empty boxes are ignored; a box reaching outside ``shape`` makes it False. Raises
    :class:`TooFragmented` when the check would look at more than :data:`MAX_CORNERS` corners.
    """
    shape = tuple(shape)
    boxes = [b for b in boxes if not b.is_empty()]
    for box in boxes:
        try:
            box.check(shape)
        except ValueError:
            return False
    if sum(b.numel() for b in boxes) != math.prod(shape):
        return False
    if not boxes:
        return True  # a tensor with no element: nothing to cover
    cut = [
        d for d in range(len(shape)) if any(b.offsets[d] or b.lengths[d] != shape[d] for b in boxes)
    ]
    if len(boxes) << len(cut) > MAX_CORNERS:
        raise TooFragmented(
            f"{len(boxes)} boxes cut in {len(cut)} dimensions: {len(boxes) << len(cut)} corners "
            f"to check, more than {MAX_CORNERS}"
        )
    odd: set[tuple[int, ...]] = set()
    for box in boxes:
        ends = [(box.offsets[d], box.offsets[d] + box.lengths[d]) for d in cut]
        odd.symmetric_difference_update(itertools.product(*ends))
    return odd == set(itertools.product(*[(0, shape[d]) for d in cut]))
