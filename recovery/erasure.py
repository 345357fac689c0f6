"""Erasure-coded redundancy, the coordinator's side: groups, and what a loss leaves.

``--erasure K+M`` replaces buddy replicas (``recovery/placement.py``) with parity spread
over groups of nodes (``peerckpt/coding.py`` has the code, the stripes and the invariant).
The coordinator

- forms the groups at every epoch (``coding_for``): the nodes that host ranks, in the
  placement's node order (racks spread evenly, as for replicas), cut into groups of K + M,
  the last n mod (K + M) nodes joining the last group; group l of a node group is the l-th
  local rank of each of its nodes. The membership carries them (``Membership.erasure``);
  the agents encode with them;
- remembers the groups of the committed step (``CommitTracker.committed_coding``) and the
  nodes lost since it committed, and, whenever a node is lost (``mark_rebuildable``), marks
  every rank that no node holds any more but whose stripes each keep K readable pieces (and,
  for a rank coded without its data-parallel chunks, one of whose twins is still held) as
  held by ``ERASURE``: the planner then reads it as from any holder, and the agent that
  reads it rebuilds it first (``replication/decoding.py``). A rank with too few pieces
  left keeps no holder, and the recovery falls back to durable storage, or fails, naming
  the ranks and the loss (``decide``'s ``NeedStorage``);
- puts what a rebuild needs into the membership (``restore_coding``): the committed step's
  groups, for every rank still held one node that holds it, and the twins of every rank
  coded without its data-parallel chunks (docs/erasure.md, "Dedup").

``ErasurePlacement`` carries the spec in the job's settings: a placement with no buddies.
Pure functions, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from itertools import combinations
from math import comb
from typing import TYPE_CHECKING, Any

from peerckpt.coding import Coding, ErasureSpec, Group, group_k, parse_spec, rebuildable
from peerckpt.membership import Membership
from peerckpt.reads import ERASURE, STORAGE
from peerckpt.recovery.placement import Placement

if TYPE_CHECKING:
    from peerckpt.recovery.commits import CommitTracker
    from peerckpt.recovery.job import Settings

log = logging.getLogger("peerckpt.coordinator")


class ErasurePlacement:
    """No buddy replicas: the job's redundancy is parity (``spec``); ``order`` gives the node
    order (a strategy's, with racks spread)."""

    def __init__(self, spec: ErasureSpec, order: Placement) -> None:
        self.spec = spec
        self.order = order

    def buddies(self, rank_nodes: dict[int, int], replicas: int) -> dict[int, list[int]]:
        return {rank: [] for rank in rank_nodes}

    def coding(self, rank_nodes: Mapping[int, int]) -> Coding:
        node_order = getattr(self.order, "node_order", sorted)
        return coding_for(self.spec, rank_nodes, list(node_order(set(rank_nodes.values()))))


def coding_for(spec: ErasureSpec, rank_nodes: Mapping[int, int], order: list[int]) -> Coding:
    """The groups of an epoch whose ranks live on ``rank_nodes``, nodes in ``order``."""
    node_groups = _node_groups(order, spec.width)  # the tail joins the last group
    local: dict[int, list[int]] = {}
    for rank in sorted(rank_nodes):
        local.setdefault(rank_nodes[rank], []).append(rank)
    groups = []
    for nodes in node_groups:
        depth = max(len(local.get(n, [])) for n in nodes)
        for level in range(depth):
            members = [(local[n][level], n) for n in nodes if len(local.get(n, [])) > level]
            k = group_k(spec, len(members))
            if k < 1:
                log.warning(
                    "erasure %s: ranks %s form a group of %d, too few to survive %d loss(es); "
                    "they are protected by their own node only",
                    spec,
                    [r for r, _ in members],
                    len(members),
                    spec.m,
                )
            ranks, where = zip(*members, strict=True)
            groups.append(Group(tuple(ranks), tuple(where), k, spec.m))
    return Coding(spec, tuple(groups))


def real(holders: set[int]) -> set[int]:
    """Nodes that hold a copy (not storage, not a rebuild)."""
    return holders - {STORAGE, ERASURE}


def mark_rebuildable(
    coding: Coding | None,
    holders: dict[int, set[int]],
    lost: set[int],
    twins: Mapping[int, tuple[int, ...]] | None = None,
) -> list[int]:
    """Mark as held by ``ERASURE`` every rank that no node holds but that its group can
    rebuild (``lost``: the nodes lost since ``coding``'s step committed); unmark the rest.
    A rank in ``twins`` was coded without its data-parallel chunks: it is rebuildable only
    while one of those twins is still held by a node (its chunks are read from there).
    Returns the ranks lost for good (no holder, not rebuildable)."""
    if coding is None:
        return []
    twins = twins or {}
    alive_ranks = {r for r, h in holders.items() if real(h)}
    gone = []
    for group in coding.groups:
        nodes_alive = {n for n in group.nodes if n not in lost}
        for rank in group.ranks:
            held = holders.setdefault(rank, set())
            held.discard(ERASURE)
            if real(held):
                continue
            twin_held = rank not in twins or any(t in alive_ranks for t in twins[rank])
            if twin_held and rebuildable(group, rank, alive_ranks, nodes_alive):
                held.add(ERASURE)
            else:
                gone.append(rank)
    return gone


def restore_coding(
    coding: Coding | None,
    holders: Mapping[int, set[int]],
    twins: Mapping[int, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """What an agent needs to rebuild a rank of the committed step (``Membership``): the
    groups, a node holding each rank still held, and the twins of each rank coded without
    its data-parallel chunks (the rebuild reads those chunks from a twin)."""
    if coding is None:
        return {}
    held = {r: min(real(h)) for r, h in holders.items() if real(h)}
    out: dict[str, Any] = {"coding": coding.to_msg(), "holders": held}
    if twins:
        out["twins"] = {r: list(t) for r, t in twins.items()}
    return out


def open_epoch(
    placement: Placement, old: CommitTracker | None, membership: Membership, tracker: CommitTracker
) -> Membership:
    """``membership`` as it opens, with its groups and what a rebuild needs (unchanged
    without ``--erasure``); ``tracker`` learns its groups and keeps the committed step's."""
    if not isinstance(placement, ErasurePlacement):
        return membership
    tracker.coding = placement.coding(membership.rank_nodes())
    if (
        old is not None
        and old is not tracker
        and tracker.committed_coding is None
        and old.committed_step == tracker.committed_step
    ):
        tracker.committed_coding = old.committed_coding
        tracker.lost_nodes = set(old.lost_nodes)
        tracker.unrebuildable = list(old.unrebuildable)
    return replace(
        membership,
        erasure=tracker.coding.to_msg(),
        erasure_restore=restore_coding(
            tracker.committed_coding, tracker.committed_holders, tracker.committed_twins
        ),
    )


def why_unrebuildable(tracker: CommitTracker | None) -> str:
    """Why the ranks the last loss left without a holder cannot be rebuilt ("" if none)."""
    if tracker is None or not tracker.unrebuildable or tracker.committed_coding is None:
        return ""
    coding = tracker.committed_coding
    gone = sorted(tracker.unrebuildable)
    alive = {r for r, h in tracker.committed_holders.items() if real(h)}
    twins = tracker.committed_twins
    twinless = [r for r in gone if r in twins and not set(twins[r]) & alive]
    parts = []
    rest = [r for r in gone if r not in twinless]
    if rest:
        groups = [g for g in coding.groups if set(g.ranks) & set(rest)]
        lost = sorted({n for g in groups for n in g.nodes if n in tracker.lost_nodes})
        parts.append(
            f"rank(s) {rest} cannot be rebuilt from memory: their group (nodes "
            f"{sorted({n for g in groups for n in g.nodes})}) lost nodes {lost} together, "
            f"more than the {coding.spec.m} its parity survives"
        )
    if twinless:
        parts.append(
            f"rank(s) {twinless} cannot be rebuilt from memory: they were coded without their "
            f"data-parallel chunks, and every node holding a twin of them (ranks "
            f"{sorted({t for r in twinless for t in twins[r]})}) was lost since the commit"
        )
    return (
        f"erasure {coding.spec}: {'; '.join(parts)}; a larger M (--erasure "
        f"{coding.spec.k}+{coding.spec.m + 1}) or a durable tier (--persist) survives that"
    )


@dataclass(frozen=True)
class ErasurePlan:
    """What ``--erasure K+M`` survives on ``nodes`` nodes when ``failures`` fail at once
    (every set equally likely), and the snapshot memory a node holds (units of S, one
    node's snapshot: its own copy plus its parity pieces)."""

    spec: ErasureSpec
    nodes: int
    failures: int
    groups: tuple[int, ...]  # group sizes
    recoverable_sets: int
    failure_sets: int
    memory_most: Fraction
    memory_least: Fraction

    @property
    def probability(self) -> Fraction:
        return Fraction(self.recoverable_sets, self.failure_sets)


def erasure_plan(nodes: int, spec: ErasureSpec, failures: int) -> ErasurePlan:
    """Count exactly the failed sets after which every rank can be read or rebuilt.

    Groups are as ``coding_for`` forms them. A group of exactly K + M nodes survives any
    set of at most M of its nodes and nothing more (every stripe spans the whole group); a
    larger group (the tail joined it) is counted by enumerating its failed subsets against
    the stripe layout. The groups' counts are multiplied as polynomials in the number of
    failed nodes."""
    sizes = [len(g) for g in _node_groups(list(range(nodes)), spec.width)]
    total = [1]
    most, least = Fraction(0), Fraction(10**9)
    for size in sizes:
        k = group_k(spec, size)
        safe = _group_safe_counts(size, k, spec.m)
        total = _multiply(total, safe)
        memory = Fraction(1) + (Fraction(spec.m, k) if k else 0)
        most, least = max(most, memory), min(least, memory)
    recoverable = total[failures] if failures < len(total) else 0
    return ErasurePlan(
        spec, nodes, failures, tuple(sizes), recoverable, comb(nodes, failures), most, least
    )


def _node_groups(order: list[int], width: int) -> list[list[int]]:
    groups = [order[i : i + width] for i in range(0, len(order), width)]
    if len(groups) > 1 and len(groups[-1]) < width:
        groups[-2].extend(groups.pop())
    return groups


def _group_safe_counts(size: int, k: int, m: int) -> list[int]:
    """B(j): the j-subsets of a group's nodes whose loss every rank of it survives."""
    if k < 1:
        return [1] + [0] * size  # unprotected: only the loss of none is survived
    if size == k + m:
        return [comb(size, j) if j <= m else 0 for j in range(size + 1)]
    if size > 24:
        raise ValueError(f"a group of {size} nodes is too large to count exactly")
    group = Group(tuple(range(size)), tuple(range(size)), k, m)
    counts = [0] * (size + 1)
    for j in range(size + 1):
        for lost in combinations(range(size), j):
            alive = set(range(size)) - set(lost)
            if all(rebuildable(group, r, alive, alive) for r in lost):
                counts[j] += 1
    return counts


def _multiply(a: list[int], b: list[int]) -> list[int]:
    out = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] += x * y
    return out


def script_erasure(settings: Settings, erasure: str | None) -> None:
    """Rank 0's ``@resilient(erasure="K+M")``, unless the launcher gave the job's redundancy
    (``--replicas`` or ``--erasure``): parity groups in the placement's node order."""
    if not erasure or settings.replicas is not None:
        return
    if isinstance(settings.placement, ErasurePlacement):
        return
    try:
        spec = parse_spec(erasure)
    except ValueError as exc:
        log.error("rank 0's erasure=%r is ignored: %s", erasure, exc)
        return
    settings.placement = ErasurePlacement(spec, settings.placement)
    log.info("erasure %s from the script: parity over groups instead of replicas", spec)
