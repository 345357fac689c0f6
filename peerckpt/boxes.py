"""Chunk arithmetic: boxes of a global tensor, their overlaps, and the bytes that hold them.

A *chunk* is an n-dimensional box of one global tensor (``offsets`` and ``lengths`` per
dimension, in global coordinates) whose elements are stored contiguously, row-major, in a byte
buffer. Resharding a checkpoint is this arithmetic: intersect what a new rank wants with what
old ranks hold, then copy each intersection out of one chunk's bytes into another's.

This module owns that arithmetic and nothing else: pure functions (and :class:`BoxTree`, an
index of disjoint boxes), no I/O, no torch. Copies go through numpy strided views, so moving a
large box costs one memory-speed copy, never a Python loop per element or per row.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

# What a chunk's bytes may live in: anything exposing a C-contiguous buffer.
Buffer = bytes | bytearray | memoryview | np.ndarray


class Box(NamedTuple):
    """An n-dimensional box of a global tensor: ``offsets`` and ``lengths`` per dimension.

    Construction does not validate, because planners build millions of boxes; call
    :meth:`check` where a box comes from outside. A named tuple, so that hashing and comparing
    boxes (and lists of them) run in C: a planner compares millions.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def ndim(self) -> int:
        """Number of dimensions (0 for a scalar, whose box holds one element)."""
        return len(self.offsets)

    @property
    def end(self) -> tuple[int, ...]:
        """Exclusive end per dimension: ``offsets + lengths``."""
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def numel(self) -> int:
        """Number of elements in the box (1 for a 0-d box)."""
        return math.prod(self.lengths)

    def is_empty(self) -> bool:
        """True when some dimension has length 0, so the box holds no element."""
        return 0 in self.lengths

    def check(self, shape: Sequence[int] | None = None) -> None:
        """Raise ValueError unless the box is well formed (and inside ``shape`` when given)."""
        offsets, lengths = self.offsets, self.lengths
        if len(offsets) != len(lengths):
            raise ValueError(f"{self}: offsets and lengths have different numbers of dimensions")
        if shape is not None and len(shape) != len(offsets):
            raise ValueError(f"{self} has {self.ndim} dimensions, the tensor {tuple(shape)}")
        # A plain loop: planners check millions of boxes, and generators cost twice as much.
        for dim in range(len(offsets)):
            if offsets[dim] < 0 or lengths[dim] < 0:
                raise ValueError(f"{self}: offsets and lengths must be non-negative")
            if shape is not None and offsets[dim] + lengths[dim] > shape[dim]:
                raise ValueError(f"{self} reaches past the tensor's shape {tuple(shape)}")


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return Box((0,) * len(shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None when they share no element."""
    if len(a.offsets) != len(b.offsets):
        raise ValueError(f"{a} and {b} have different numbers of dimensions")
    offsets = []
    lengths = []
    # Written for speed (planners call it millions of times): no generator, no min().
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):  # noqa: B905
        lo = ao if ao > bo else bo
        hi = ao + an
        if bo + bn < hi:
            hi = bo + bn
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def subtract(a: Box, b: Box) -> list[Box]:
    """Disjoint boxes covering the elements of ``a`` that are not in ``b`` (at most 2·ndim)."""
    common = intersect(a, b)
    if common is None:
        return [] if a.is_empty() else [a]
    pieces: list[Box] = []
    offsets, lengths = list(a.offsets), list(a.lengths)
    # Peel off the slabs before and after ``common`` one dimension at a time; what is left
    # after the last dimension is ``common`` itself.
    for dim in range(a.ndim):
        lo, hi = common.offsets[dim], common.offsets[dim] + common.lengths[dim]
        end = offsets[dim] + lengths[dim]
        if lo > offsets[dim]:
            pieces.append(
                Box(tuple(offsets), (*lengths[:dim], lo - offsets[dim], *lengths[dim + 1 :]))
            )
        if end > hi:
            after = (*offsets[:dim], hi, *offsets[dim + 1 :])
            pieces.append(Box(after, (*lengths[:dim], end - hi, *lengths[dim + 1 :])))
        offsets[dim], lengths[dim] = lo, hi - lo
    return pieces


def box_array(boxes: Sequence[Box], ndim: int) -> np.ndarray | None:
    """``boxes`` as an int64 array indexed (box, 0 for offsets or 1 for lengths, dimension),
    or None when some box does not have ``ndim`` dimensions. Read in C, with no loop per box."""
    if not set(map(len, itertools.chain.from_iterable(boxes))) <= {ndim}:
        return None
    ints = itertools.chain.from_iterable(itertools.chain.from_iterable(boxes))
    return np.fromiter(ints, np.int64, count=2 * ndim * len(boxes)).reshape(len(boxes), 2, ndim)


def is_grid(array: np.ndarray) -> bool:
    """True when the distinct non-empty boxes ``array`` (as :func:`box_array` gives) form a grid.

    Sorted by (offset, length) along dimension 0, then 1, …, every two neighbours must be
    disjoint along the first dimension where they differ. Then boxes sharing their first k
    intervals have disjoint (k+1)-th ones, so any two boxes are apart along some dimension: a
    grid's boxes are disjoint. Shard(d), block meshes and regular flat shards are grids; sets
    of disjoint boxes that are not (a pinwheel) get False, as do overlapping ones.
    """
    if len(array) < 2:
        return True
    keys = array.transpose(0, 2, 1).reshape(len(array), -1)  # o0, n0, o1, n1, …
    ordered = keys[np.lexsort(keys.T[::-1])]
    first = (ordered[1:] != ordered[:-1]).argmax(axis=1)
    offset = first - first % 2  # the offset column of the dimension where they differ
    rows = np.arange(len(ordered) - 1)
    end = ordered[rows, offset] + ordered[rows, offset + 1]
    return bool((end <= ordered[rows + 1, offset]).all())


T = TypeVar("T")


class Overlap(ValueError):
    """Two items of a :class:`BoxTree` whose boxes overlap without being equal."""

    def __init__(self, a: tuple[Box, Any], b: tuple[Box, Any]) -> None:
        super().__init__(f"{a[0]} and {b[0]} overlap")
        self.a, self.b = a, b


@dataclass(eq=False, slots=True)
class _TreeNode:
    """Disjoint groups of boxes along ``dim``, sorted; see :class:`BoxTree`."""

    dim: int
    starts: list[int]
    ends: list[int]
    children: list[Any]  # _TreeNode, an item, or a list of items to scan


class BoxTree(Generic[T]):
    """An index of distinct non-empty boxes, each with a payload: the items that meet a box.

    A tree over dimensions: along dimension 0 the boxes form disjoint, sorted groups (found by
    bisection), each group being boxes with the same interval there, indexed the same way
    along dimension 1, and so on. Shard(d), block meshes and flat shards all fit it, so a
    lookup costs O(ndim · log n + found). Groups whose intervals overlap without being equal
    (no regular layout makes them) are kept as lists and scanned; building checks their boxes
    pairwise and raises :class:`Overlap` for the first two that meet.
    """

    __slots__ = ("_root",)

    def __init__(self, items: Sequence[tuple[Box, T]]) -> None:
        self._root: Any = _tree(list(items), 0) if items else None

    def find(self, box: Box) -> list[tuple[Box, T]]:
        """The items whose boxes may meet ``box`` (intersect them to be sure), in order."""
        root = self._root
        if root is None:
            return []
        if not isinstance(root, _TreeNode):
            return [root]
        out: list[tuple[Box, T]] = []
        if not box.is_empty():
            _find(root, box, out)
        return out


def _tree(items: list[tuple[Box, Any]], dim: int) -> Any:
    """Index ``items`` (distinct boxes, equal along dimensions before ``dim``)."""
    if len(items) == 1:
        # A lone box needs no index below here: callers intersect what they find anyway. Past
        # the last dimension there is always one box, since the boxes are distinct.
        return items[0]
    items.sort(key=lambda item: (item[0].offsets[dim], item[0].lengths[dim]))
    node = _TreeNode(dim, [], [], [])
    i = 0
    while i < len(items):
        lo = items[i][0].offsets[dim]
        first_end = hi = lo + items[i][0].lengths[dim]
        same = True
        j = i + 1
        while j < len(items) and items[j][0].offsets[dim] < hi:
            start = items[j][0].offsets[dim]
            end = start + items[j][0].lengths[dim]
            same = same and start == lo and end == first_end
            hi = max(hi, end)
            j += 1
        members = items[i:j]
        node.starts.append(lo)
        node.ends.append(hi)
        if same:
            node.children.append(_tree(members, dim + 1))
        else:
            _check_disjoint(members, dim)
            node.children.append(members)
        i = j
    return node


def _check_disjoint(items: list[tuple[Box, Any]], dim: int) -> None:
    """Raise Overlap when two of ``items`` (sorted along ``dim``) overlap."""
    for i, a in enumerate(items):
        a_end = a[0].offsets[dim] + a[0].lengths[dim]
        j = i + 1
        # Only boxes starting before ``a`` ends along ``dim`` can meet it.
        while j < len(items) and items[j][0].offsets[dim] < a_end:
            if intersect(a[0], items[j][0]) is not None:
                raise Overlap(a, items[j])
            j += 1


def _find(node: _TreeNode, box: Box, out: list[Any]) -> None:
    """Append to ``out`` the items under ``node`` that may meet ``box``, in order."""
    lo = box.offsets[node.dim]
    hi = lo + box.lengths[node.dim]
    starts, children = node.starts, node.children
    i = bisect.bisect_right(node.ends, lo)  # groups are disjoint, so ends ascend with starts
    while i < len(starts) and starts[i] < hi:
        child = children[i]
        if isinstance(child, _TreeNode):
            _find(child, box, out)
        elif isinstance(child, list):
            out.extend(item for item in child if intersect(item[0], box) is not None)
        else:
            out.append(child)
        i += 1


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` in coordinates whose origin is ``outer``'s first element.

    Raises ValueError when ``inner`` is not inside ``outer``.
    """
    if inner.ndim != outer.ndim or any(
        i < o or i + n > o + m
        for i, n, o, m in zip(
            inner.offsets, inner.lengths, outer.offsets, outer.lengths, strict=True
        )
    ):
        raise ValueError(f"{inner} is not inside {outer}")
    return Box(
        tuple(i - o for i, o in zip(inner.offsets, outer.offsets, strict=True)), inner.lengths
    )


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Split the row-major element range ``[start, stop)`` of a tensor into regular boxes.

    Returns at most ``max(1, 2 * ndim - 1)`` disjoint boxes in row-major order: a partial run
    up to the next row boundary, whole rows in the middle, a partial run after them, each part
    split again along the inner dimensions. An empty range gives no box.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of {total} elements")
    if start == stop:
        return []
    return _range_boxes(shape, start, stop)


def _range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    # Precondition: 0 <= start < stop <= prod(shape), so no dimension is 0.
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row and (start % inner or stop % inner):
        return _in_row(shape, first_row, start % inner, stop - first_row * inner)
    boxes: list[Box] = []
    full_from = first_row
    if start % inner:
        boxes += _in_row(shape, first_row, start % inner, inner)
        full_from += 1
    full_to = stop // inner
    if full_to > full_from:
        boxes.append(Box((full_from,) + (0,) * (len(shape) - 1), (full_to - full_from, *shape[1:])))
    if stop % inner:
        boxes += _in_row(shape, full_to, 0, stop % inner)
    return boxes


def _in_row(shape: tuple[int, ...], row: int, start: int, stop: int) -> list[Box]:
    """Boxes of the range ``[start, stop)`` of row ``row`` (a tensor of ``shape[1:]``)."""
    return [Box((row, *b.offsets), (1, *b.lengths)) for b in _range_boxes(shape[1:], start, stop)]


def flat_shards_to_boxes(
    param_shapes: Sequence[Sequence[int]], start: int, stop: int
) -> list[tuple[int, Box]]:
    """The pieces of each parameter in elements ``[start, stop)`` of a flat parameter.

    A flat parameter (ZeRO, FSDP1) is its parameters flattened row-major and concatenated in
    order; a rank that holds ``[start, stop)`` of it holds, for each parameter it touches, the
    boxes returned here as ``(parameter index, box)``, in flat order.
    """
    bounds = [0, *itertools.accumulate(math.prod(s) for s in param_shapes)]
    if not 0 <= start <= stop <= bounds[-1]:
        raise ValueError(f"range [{start}, {stop}) is not inside a flat parameter of {bounds[-1]}")
    pieces: list[tuple[int, Box]] = []
    # The first parameter whose end lies past ``start``; later ones are taken in order.
    index = bisect.bisect_right(bounds, start) - 1
    while start < stop:
        begin, end = bounds[index], bounds[index + 1]
        upto = min(stop, end)
        if upto > start:  # parameters with no element are skipped
            shape = tuple(param_shapes[index])
            pieces += [(index, b) for b in _range_boxes(shape, start - begin, upto - begin)]
            start = upto
        index += 1
    return pieces


def contiguous_range(chunk: Box, sub: Box, itemsize: int) -> tuple[int, int] | None:
    """``(byte offset, byte length)`` of ``sub`` in ``chunk``'s row-major bytes if it is one
    contiguous run there (so it can be sent or received in place), else None."""
    if sub.is_empty():
        return None
    rel = relative(sub, chunk)
    split = len(chunk.lengths) - 1
    while split >= 0 and rel.lengths[split] == chunk.lengths[split]:
        split -= 1
    if split < 0:
        return 0, chunk.numel() * itemsize
    if any(n != 1 for n in rel.lengths[:split]):
        return None
    strides = _strides(chunk.lengths)
    start = sum(o * st for o, st in zip(rel.offsets, strides, strict=True))
    return start * itemsize, rel.lengths[split] * strides[split] * itemsize


def box_byte_runs(chunk: Box, sub: Box, itemsize: int) -> list[tuple[int, int]]:
    """The ``(byte offset, byte length)`` runs of ``chunk``'s row-major bytes that hold ``sub``.

    ``sub`` must lie inside ``chunk`` (both in global coordinates). Runs come in row-major
    order of ``sub``; adjacent runs are merged, so a ``sub`` that spans whole trailing
    dimensions of ``chunk`` gives few long runs.
    """
    rel = relative(sub, chunk)
    if sub.is_empty():
        return []
    strides = _strides(chunk.lengths)
    # Dimensions after ``split`` are covered whole; each run spans ``sub.lengths[split]``
    # rows of them. Dimensions before it give one run per index combination.
    split = len(chunk.lengths) - 1
    while split >= 0 and rel.lengths[split] == chunk.lengths[split]:
        split -= 1
    if split < 0:
        return [(0, chunk.numel() * itemsize)]
    run = rel.lengths[split] * strides[split] * itemsize
    base = rel.offsets[split] * strides[split]
    starts = np.full((), base, dtype=np.int64)
    for dim in range(split):
        steps = (rel.offsets[dim] + np.arange(rel.lengths[dim], dtype=np.int64)) * strides[dim]
        starts = np.add.outer(starts, steps)
    return [(int(s) * itemsize, run) for s in starts.reshape(-1).tolist()]


def _strides(lengths: Sequence[int]) -> list[int]:
    """Row-major element strides of a box of ``lengths``."""
    strides = [1] * len(lengths)
    for dim in range(len(lengths) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * lengths[dim + 1]
    return strides


def _view(buf: Buffer, chunk: Box, itemsize: int, writable: bool) -> np.ndarray:
    """``buf`` as a uint8 array of shape ``(*chunk.lengths, itemsize)``."""
    nbytes = chunk.numel() * itemsize
    if isinstance(buf, np.ndarray):
        # reshape(-1) of a strided array would copy, and writes would go to the copy.
        if not buf.flags.c_contiguous:
            raise ValueError("a chunk buffer must be C-contiguous")
        flat = buf.reshape(-1).view(np.uint8)
    else:
        flat = np.frombuffer(buf, dtype=np.uint8)
    if flat.size < nbytes:
        raise ValueError(
            f"a buffer of {flat.size} bytes cannot hold {chunk} of {itemsize}-byte items"
        )
    if writable and not flat.flags.writeable:
        raise ValueError("the destination buffer is read-only")
    return flat[:nbytes].reshape(*chunk.lengths, itemsize)


def _slices(chunk: Box, sub: Box) -> tuple[slice, ...]:
    rel = relative(sub, chunk)
    return tuple(slice(o, o + n) for o, n in zip(rel.offsets, rel.lengths, strict=True))


def extract_box(src: Buffer, chunk: Box, sub: Box, itemsize: int) -> bytes:
    """The bytes of ``sub``, packed row-major, out of ``chunk``'s row-major buffer ``src``."""
    return _view(src, chunk, itemsize, writable=False)[_slices(chunk, sub)].tobytes()


def place_box(dst: Buffer, chunk: Box, sub: Box, itemsize: int, data: Buffer) -> None:
    """Write ``data`` (``sub`` packed row-major) into its place in ``chunk``'s buffer ``dst``.

    The inverse of :func:`extract_box`; ``dst`` must be writable (bytearray, writable
    memoryview or numpy array).
    """
    packed = _view(data, sub, itemsize, writable=False)
    _view(dst, chunk, itemsize, writable=True)[_slices(chunk, sub)] = packed


def copy_box(
    src: Buffer, src_chunk: Box, dst: Buffer, dst_chunk: Box, region: Box, itemsize: int
) -> None:
    """Copy ``region`` from ``src_chunk``'s buffer straight into ``dst_chunk``'s buffer.

    One strided copy with no packed intermediate, for pieces read from a local snapshot.
    """
    piece = _view(src, src_chunk, itemsize, writable=False)[_slices(src_chunk, region)]
    _view(dst, dst_chunk, itemsize, writable=True)[_slices(dst_chunk, region)] = piece
