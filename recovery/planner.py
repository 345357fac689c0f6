"""Resharding recovery plans: which bytes every rank of the new epoch reads, and from where.

Pure functions, no I/O. The old epoch left committed snapshots, each a list of chunks (boxes of
global tensors) held by the old rank's node and its buddies. The new epoch may have another
world size or layout; every new rank says which boxes it wants. :func:`plan_reads` covers each
wanted box exactly with pieces of held chunks and picks one source per piece:

1. the rank's own previous snapshot on its own node (no network, no copy to wait for);
2. any other copy on its own node;
3. otherwise the peer node with the fewest bytes assigned so far in this plan (then node id);
4. durable storage (the holder ``STORAGE``) only for chunks no memory copy of survived.

Identical boxes held by several old ranks (data-parallel replicas) are one *logical chunk* with
several sources, so a destination reads each piece once. Distinct held boxes of a key must be
disjoint; overlapping ones mean the snapshots came from two layouts and are rejected.

Held boxes of each key are indexed as a tree over dimensions: along dimension 0 the boxes form
disjoint, sorted groups (found by bisection), each group being boxes with the same interval
there, indexed the same way along dimension 1, and so on. Shard(d), block meshes and flat
shards all fit it, so a lookup costs O(ndim · log n + pieces). Groups whose intervals overlap
without being equal (no regular layout makes them) are kept as flat lists and scanned.
"""

from __future__ import annotations

import gc
import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field

from peerckpt.errors import RecoveryFailed, StateMismatch
from peerckpt.recovery.chunks import Box, intersect, subtract

# Bytes per element of torch's dtypes, by the name ``str(dtype)`` gives without "torch.".
_ITEMSIZES: dict[str, int] = {
    **dict.fromkeys(["bool", "uint8", "int8", "qint8", "quint8", "quint4x2", "quint2x4"], 1),
    **dict.fromkeys(["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"], 1),
    **dict.fromkeys(["float8_e8m0fnu", "float4_e2m1fn_x2", "bit", "bits8", "bits1x8"], 1),
    **dict.fromkeys(["bits2x4", "bits4x2"], 1),
    # Sub-byte integer dtypes take a byte per element in torch's storage.
    **dict.fromkeys([f"{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8)], 1),
    **dict.fromkeys(["float16", "half", "bfloat16", "int16", "short", "uint16", "bits16"], 2),
    **dict.fromkeys(["float32", "float", "int32", "int", "uint32", "qint32"], 4),
    **dict.fromkeys(["complex32", "chalf"], 4),
    **dict.fromkeys(["float64", "double", "int64", "long", "uint64", "complex64", "cfloat"], 8),
    **dict.fromkeys(["complex128", "cdouble"], 16),
}
_MAX_LISTED = 8  # missing regions named in one error; the rest are counted
STORAGE = -1  # the durable tier as a holder: read only where no memory copy survived


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name ("float32", "torch.bfloat16", …)."""
    size = _ITEMSIZES.get(dtype.removeprefix("torch."))
    if size is None:
        raise StateMismatch(f"unknown dtype {dtype!r}: no element size is known for it")
    return size


@dataclass(frozen=True, slots=True)
class HeldChunk:
    """A chunk in an old rank's committed snapshot: ``box`` of tensor ``key``."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class WantedChunk:
    """A box of tensor ``key`` that a new rank needs to restore."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class Read:
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


@dataclass(eq=False, slots=True)
class _Sources:
    """Where a logical chunk can be read from; shared by every chunk held by the same ranks."""

    ranks: frozenset[int]
    on_node: dict[int, int]  # node → smallest old rank with a copy there
    # (load when pushed, node); entries go stale as loads grow and are refreshed on the way.
    heap: list[tuple[int, int]]


@dataclass(eq=False, slots=True)
class _Logical:
    """One distinct held box of a key, and the old ranks that hold it (ascending)."""

    box: Box
    ranks: list[int]
    sources: _Sources


@dataclass(eq=False, slots=True)
class _Node:
    """Disjoint groups of held boxes along ``dim``, sorted; see the module docstring."""

    dim: int
    starts: list[int]
    ends: list[int]
    children: list[_Node | _Logical | list[_Logical]]


_Tree = _Node | _Logical | None


@dataclass(eq=False, slots=True)
class _Key:
    """Everything the planner knows about one key: layout, index, and covers already found."""

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    first_rank: int
    boxes: dict[Box, list[int]] = field(default_factory=dict)
    tree: _Tree = None
    built: bool = False
    covers: dict[Box, list[tuple[_Logical, Box, int]]] = field(default_factory=dict)


def plan_reads(
    held: dict[int, list[HeldChunk]],
    holders: dict[int, list[int] | set[int]],
    wanted: dict[int, list[WantedChunk]],
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
) -> dict[int, list[Read]]:
    """For every new rank, the reads that fill its wanted chunks exactly, in wanted order.

    ``held``: old rank → chunks of its committed snapshot; ``holders``: old rank → nodes with a
    complete verified copy of it; ``wanted``: new rank → chunks it needs; ``new_nodes``: new
    rank → node; ``previous``: new rank → the old rank the same process was (None if new).

    Raises StateMismatch when a wanted chunk's dtype or global shape differs from the held one,
    or held boxes of a key overlap without being equal; RecoveryFailed, naming every missing
    key and region, when some wanted element has no surviving copy.
    """
    # A big plan allocates millions of small objects and no garbage cycles; left on, the
    # cyclic collector rescans them over and over and triples the planning time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(held, holders, wanted, new_nodes, previous)
    finally:
        if was_enabled:
            gc.enable()


def _plan(
    held: dict[int, list[HeldChunk]],
    holders: dict[int, list[int] | set[int]],
    wanted: dict[int, list[WantedChunk]],
    new_nodes: dict[int, int],
    previous: dict[int, int | None],
) -> dict[int, list[Read]]:
    keys = _index_held(held)
    holder_sets = {rank: frozenset(nodes) for rank, nodes in holders.items()}
    sources: dict[tuple[int, ...], _Sources] = {}
    load: dict[int, int] = {}  # node → bytes it sends in this plan
    missing: dict[str, None] = {}  # what cannot be recovered, in order, once each
    plan: dict[int, list[Read]] = {}
    for new in sorted(wanted):
        if new not in new_nodes:
            raise ValueError(f"new rank {new} wants chunks but has no node in new_nodes")
        node = new_nodes[new]
        prev = previous.get(new)
        # The own slot counts only where it survived on this rank's node.
        own = prev if prev is not None and node in holder_sets.get(prev, ()) else None
        reads: list[Read] = []
        for want in wanted[new]:
            info = keys.get(want.key)
            if info is None:
                if not want.box.is_empty():
                    missing[f"{want.key!r} (held by no old rank)"] = None
                continue
            if want.dtype != info.dtype or (
                want.global_shape != info.shape and tuple(want.global_shape) != info.shape
            ):
                raise StateMismatch(
                    f"new rank {new} wants {want.key!r} as {want.dtype} {tuple(want.global_shape)}"
                    f" but old rank {info.first_rank} saved it as {info.dtype} {info.shape}; "
                    "restore into a model with the same parameters and dtypes"
                )
            pieces = info.covers.get(want.box)
            if pieces is None:
                pieces = _cover(want.key, info, want.box, holder_sets, sources, load, missing)
            for chunk, region, nbytes in pieces:
                src = chunk.sources
                if own is not None and own in src.ranks:
                    reads.append(Read(node, own, want.key, chunk.box, want.box, region, nbytes))
                    continue
                rank = src.on_node.get(node)
                if rank is None:
                    peer = _least_loaded(src.heap, load, nbytes)
                    reads.append(
                        Read(peer, src.on_node[peer], want.key, chunk.box, want.box, region, nbytes)
                    )
                else:
                    reads.append(Read(node, rank, want.key, chunk.box, want.box, region, nbytes))
        plan[new] = reads
    if missing:
        listed = "; ".join(list(missing)[:_MAX_LISTED])
        more = f"; and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise RecoveryFailed(
            f"no surviving copy of: {listed}{more}. The old ranks that held this state and all "
            "of their buddies were lost together (or it was never saved). Use more --replicas, "
            "or a durable tier (persist=...) to fall back to storage."
        )
    return plan


def _index_held(held: dict[int, list[HeldChunk]]) -> dict[str, _Key]:
    """Group held chunks by key and box, checking that old ranks agree on each key's meta."""
    keys: dict[str, _Key] = {}
    for rank in sorted(held):
        for chunk in held[rank]:
            info = keys.get(chunk.key)
            if info is None:
                size = itemsize(chunk.dtype)  # an unknown dtype fails here, naming it
                info = keys[chunk.key] = _Key(chunk.dtype, size, tuple(chunk.global_shape), rank)
            elif chunk.dtype != info.dtype or tuple(chunk.global_shape) != info.shape:
                raise StateMismatch(
                    f"{chunk.key!r} is {chunk.dtype} {tuple(chunk.global_shape)} in old rank "
                    f"{rank}'s snapshot but {info.dtype} {info.shape} in old rank "
                    f"{info.first_rank}'s: the snapshots do not come from one model"
                )
            ranks = info.boxes.get(chunk.box)
            if ranks is None:
                info.boxes[chunk.box] = [rank]
            elif ranks[-1] != rank:  # a rank listing a box twice still holds it once
                ranks.append(rank)
    return keys


def _cover(
    key: str,
    info: _Key,
    box: Box,
    holder_sets: dict[int, frozenset[int]],
    sources: dict[tuple[int, ...], _Sources],
    load: dict[int, int],
    missing: dict[str, None],
) -> list[tuple[_Logical, Box, int]]:
    """The pieces ``(logical chunk, region, nbytes)`` that make up ``box``; cached per key."""
    try:
        box.check(info.shape)
    except ValueError as e:
        raise StateMismatch(f"a wanted chunk of {key!r}: {e}") from None
    if not info.built:
        info.tree = _build(key, info, holder_sets, sources, load)
        info.built = True
    found: list[_Logical] = []
    if isinstance(info.tree, _Logical):
        found.append(info.tree)
    elif info.tree is not None and not box.is_empty():
        _find(info.tree, box, found)
    pieces: list[tuple[_Logical, Box, int]] = []
    gone: list[tuple[Box, list[int]]] = []
    total = 0
    for chunk in found:
        region = intersect(chunk.box, box)
        if region is None:
            continue
        # Share equal boxes rather than keep copies: a big plan holds millions of them.
        if region == box:
            region = box
        elif region == chunk.box:
            region = chunk.box
        count = math.prod(region.lengths)
        total += count
        if chunk.sources.on_node:
            pieces.append((chunk, region, count * info.itemsize))
        else:
            gone.append((region, chunk.ranks))
    # Held boxes are disjoint (checked when indexed), so element counts decide exact cover.
    if total != math.prod(box.lengths):
        holes = [box]
        for chunk in found:
            holes = [h for hole in holes for h in subtract(hole, chunk.box)]
        missing.update(dict.fromkeys(f"{key!r} {_show(h)} (held by no old rank)" for h in holes))
    for region, ranks in gone:
        missing[f"{key!r} {_show(region)} (every copy of old ranks {ranks} is gone)"] = None
    info.covers[box] = pieces
    return pieces


def _show(box: Box) -> str:
    return f"offsets={box.offsets} lengths={box.lengths}"


def _build(
    key: str,
    info: _Key,
    holder_sets: dict[int, frozenset[int]],
    sources: dict[tuple[int, ...], _Sources],
    load: dict[int, int],
) -> _Tree:
    """Index the non-empty held boxes of a key, attaching each one's sources."""
    chunks: list[_Logical] = []
    for box, ranks in info.boxes.items():
        try:
            box.check(info.shape)
        except ValueError as e:
            raise StateMismatch(f"old rank {ranks[0]} holds a bad chunk of {key!r}: {e}") from None
        if box.is_empty():
            continue
        group = tuple(ranks)
        src = sources.get(group)
        if src is None:
            src = sources[group] = _make_sources(group, holder_sets, load)
        chunks.append(_Logical(box, ranks, src))
    return _group(key, chunks, 0) if chunks else None


def _make_sources(
    ranks: tuple[int, ...], holder_sets: dict[int, frozenset[int]], load: dict[int, int]
) -> _Sources:
    on_node: dict[int, int] = {}
    for rank in ranks:  # ascending, so each node maps to its smallest rank
        for node in sorted(holder_sets.get(rank, ())):
            on_node.setdefault(node, rank)
    if len(on_node) > 1:
        on_node.pop(STORAGE, None)  # memory first; storage only when nothing else is left
    heap = sorted((load.get(node, 0), node) for node in on_node)
    return _Sources(frozenset(ranks), on_node, heap)


def _least_loaded(heap: list[tuple[int, int]], load: dict[int, int], nbytes: int) -> int:
    """Pop the least-loaded node (then lowest id) of ``heap``, charge it ``nbytes``."""
    # Loads only grow, so a stale entry is too small: refresh it and look again. When the top
    # entry is current, every other entry's true load is at least as large.
    while True:
        recorded, node = heap[0]
        current = load.get(node, 0)
        if recorded == current:
            break
        heapq.heapreplace(heap, (current, node))
    load[node] = current + nbytes
    heapq.heapreplace(heap, (current + nbytes, node))
    return node


def _group(key: str, chunks: list[_Logical], dim: int) -> _Node | _Logical:
    """Index ``chunks`` (distinct boxes, equal along dimensions before ``dim``)."""
    if len(chunks) == 1:
        # A lone box needs no index below here: callers intersect what they find anyway. Past
        # the last dimension there is always one box, since equal boxes were merged.
        return chunks[0]
    chunks.sort(key=lambda c: (c.box.offsets[dim], c.box.lengths[dim]))
    node = _Node(dim, [], [], [])
    i = 0
    while i < len(chunks):
        lo = chunks[i].box.offsets[dim]
        first_end = hi = lo + chunks[i].box.lengths[dim]
        same = True
        j = i + 1
        while j < len(chunks) and chunks[j].box.offsets[dim] < hi:
            start, end = (
                chunks[j].box.offsets[dim],
                chunks[j].box.offsets[dim] + chunks[j].box.lengths[dim],
            )
            same = same and start == lo and end == first_end
            hi = max(hi, end)
            j += 1
        members = chunks[i:j]
        node.starts.append(lo)
        node.ends.append(hi)
        if same:
            node.children.append(_group(key, members, dim + 1))
        else:
            _check_disjoint(key, members, dim)
            node.children.append(members)
        i = j
    return node


def _check_disjoint(key: str, chunks: list[_Logical], dim: int) -> None:
    """Raise StateMismatch when two of ``chunks`` (sorted along ``dim``) overlap."""
    for i, a in enumerate(chunks):
        a_end = a.box.offsets[dim] + a.box.lengths[dim]
        j = i + 1
        # Only chunks starting before ``a`` ends along ``dim`` can meet it.
        while j < len(chunks) and chunks[j].box.offsets[dim] < a_end:
            b = chunks[j]
            if intersect(a.box, b.box) is not None:
                raise StateMismatch(
                    f"held chunks of {key!r} overlap without being equal: {_show(a.box)} in "
                    f"old rank(s) {a.ranks} and {_show(b.box)} in old rank(s) {b.ranks}; "
                    "the snapshots do not come from one layout"
                )
            j += 1


def _find(node: _Node, box: Box, out: list[_Logical]) -> None:
    """Append to ``out`` the logical chunks under ``node`` that may meet ``box``, in order."""
    lo = box.offsets[node.dim]
    hi = lo + box.lengths[node.dim]
    starts, children = node.starts, node.children
    i = bisect_right(node.ends, lo)  # groups are disjoint, so ends ascend with starts
    while i < len(starts) and starts[i] < hi:
        child = children[i]
        if isinstance(child, _Logical):
            out.append(child)
        elif isinstance(child, _Node):
            _find(child, box, out)
        else:
            out.extend(c for c in child if intersect(c.box, box) is not None)
        i += 1
