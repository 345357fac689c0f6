"""Which peer serves each network read of a recovery plan.

Pure functions, no I/O. A network read can come from any node in its *candidate set* (the
nodes holding a copy of its chunk, other than the reader's). A rank's network reads of the
same region of the same held box with the same sources (tensors sharded alike: a model's
thousand tensors make a few) are one *item*, served by one peer; items are ordered by their
first read in plan order. The rule for the items of a whole plan:

* Up to ``GREEDY_ITEMS`` items, each in order goes to the node of its set that has been
  given the fewest bytes so far, then the lowest node id: the rule the planner always had,
  applied per item instead of per read. One Python step per item: 80 thousand items for the
  13.6 million reads of the worst case planned in ``bench/planner.py`` (a step per read took
  1.75 s there).
* Beyond (tensors sharded in as many ways as there are reads), :func:`deal` does it with
  numpy: each set's bytes are shared among its nodes by water-filling, then its items are
  dealt to them in turns.

Deterministic: the same reads in the same order get the same nodes.
"""

from __future__ import annotations

import numpy as np

GREEDY_ITEMS = 1_000_000  # items up to which each is picked in turn (one Python step each)


def assign(
    members: np.ndarray,
    weights: np.ndarray,
    set_of_sid: np.ndarray,
    sets: list[tuple[int, ...]],
) -> np.ndarray:
    """The place in its candidate set (as :func:`deal`) of each network read, or of each
    group of reads known to be one item.

    ``members``: an int64 row each: place of the rank, position of the chunk in its list,
    index of the piece in the chunk's cover, sources id, then what tells items apart (the
    held box and the region, padded alike); ``weights``: their bytes.
    """
    if not len(members):
        return np.zeros(0, np.int64)
    ident = np.concatenate([members[:, :1], members[:, 3:]], axis=1)
    _, item = np.unique(ident, axis=0, return_inverse=True)
    item = item.reshape(-1)
    # Items in the order of their first read: (place, position, piece).
    order = np.lexsort((members[:, 2], members[:, 1], members[:, 0]))
    seen = np.full(int(item.max()) + 1, len(order), np.int64)
    np.minimum.at(seen, item[order], np.arange(len(order)))
    item_order = np.argsort(seen, kind="stable")
    rank_of_item = np.empty_like(item_order)
    rank_of_item[item_order] = np.arange(len(item_order))
    ranked = rank_of_item[item]
    sizes = np.bincount(ranked, weights=weights, minlength=len(item_order))
    sid = np.empty(len(item_order), np.int64)
    sid[ranked] = members[:, 3]
    if len(item_order) <= GREEDY_ITEMS:
        choice = greedy(sets, set_of_sid[sid], sizes)
    else:
        choice = deal(sets, set_of_sid[sid], sizes)
    return choice[ranked]


def greedy(sets: list[tuple[int, ...]], set_of_item: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Each item in order to the node of its set given the fewest bytes so far (then the
    lowest node id); returns the place of that node in the set."""
    load: dict[int, float] = {}
    out = np.empty(len(set_of_item), np.int64)
    for i, (s, n) in enumerate(zip(set_of_item.tolist(), nbytes.tolist(), strict=True)):
        nodes = sets[s]
        best, low = 0, load.get(nodes[0], 0)
        for place in range(1, len(nodes)):
            current = load.get(nodes[place], 0)
            if current < low:
                best, low = place, current
        load[nodes[best]] = low + n
        out[i] = best
    return out


def deal(sets: list[tuple[int, ...]], set_of_read: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The place in its candidate set (0 for the set's lowest node id, …) of every read.

    ``sets``: the candidate sets, each ascending; ``set_of_read``: each read's set, in plan
    order; ``nbytes``: each read's size.
    """
    choice = np.zeros(len(set_of_read), np.int64)
    if not len(set_of_read):
        return choice
    size = np.asarray(nbytes, np.float64)
    totals = np.bincount(set_of_read, weights=size, minlength=len(sets))
    reads = np.bincount(set_of_read, minlength=len(sets))
    shares = _water_fill(sets, totals)
    # Reads of each set together, in plan order (a radix sort when set numbers are small).
    keys = set_of_read.astype(np.uint16 if len(sets) <= 1 << 16 else np.int64)
    order = np.argsort(keys, kind="stable")
    sizes = size[order]
    ends = np.cumsum(sizes)
    before = np.concatenate([[0.0], ends])[np.cumsum(reads) - reads]  # bytes of earlier sets
    which = keys[order]
    middle = ends - sizes / 2 - before[which]  # each read's middle byte within its set
    width = np.asarray([len(nodes) for nodes in sets], np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        turn = width * totals / reads  # one round: about one read per node
        phase = np.mod(middle / turn[which], 1.0)
        # Where each node's turn ends, as a fraction of a round: cumulative shares.
        edges = np.full((len(sets), max(1, int(width.max())) - 1), np.inf)
        for s, share in enumerate(shares):
            if len(share) > 1 and totals[s] > 0:
                edges[s, : len(share) - 1] = np.cumsum(share[:-1]) / totals[s]
    picked = np.zeros(len(order), np.int64)
    for k in range(edges.shape[1]):
        picked += phase >= edges[which, k]
    choice[order] = picked
    return choice


def _water_fill(sets: list[tuple[int, ...]], totals: np.ndarray) -> list[np.ndarray]:
    """Per set, the bytes each of its nodes serves (see the module docstring, step 1)."""
    load: dict[int, float] = {}
    shares: list[np.ndarray] = [np.zeros(0)] * len(sets)
    for s in sorted(range(len(sets)), key=lambda s: (len(sets[s]), sets[s])):
        nodes, total = sets[s], float(totals[s])
        if not nodes or not total:
            continue
        current = np.array([load.get(node, 0.0) for node in nodes])
        # The level L with sum(max(0, L - current)) == total, over the lowest loads.
        ordered = np.sort(current)
        level = ordered[0] + total
        for k in range(1, len(ordered) + 1):
            level = (ordered[:k].sum() + total) / k
            if k == len(ordered) or level <= ordered[k]:
                break
        share = np.maximum(0.0, level - current)
        if share.sum() > 0:
            share *= total / share.sum()  # rounding
        shares[s] = share
        for node, value in zip(nodes, share.tolist(), strict=True):
            load[node] = load.get(node, 0.0) + value
    return shares
