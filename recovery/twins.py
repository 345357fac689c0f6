"""Redundancy-aware replication, the coordinator's side: verifying twins, counting holders.

A rank of a data-parallel job declares the chunks every data-parallel rank holds equal
(``runtime/twins.py``); its agent pushes only the rest to its buddies (``replication/dedup.py``)
and reports ``partial`` with a digest of the declared chunks' checksums (``twins``). Those
chunks then live only in the ranks' own slots: rank r's are held by every node hosting a
*twin* of r, a rank whose digest for the same step is r's.

When every rank of a step has reported, :func:`verify` groups the ranks by digest and checks,
for every partially replicated rank, that its twins' nodes (its own included) number at
least 1 + k (k: its buddies): the invariant that every chunk of a committed step lives in
1 + k failure domains, counting twins. A rank that falls short (its digest differs from the
others', or too few twins) is named: the coordinator logs it once and asks its agent to push
it whole (``ReplicateWhole``); the step commits once that push is in.

With ``--erasure K+M`` the agent codes a rank without those chunks (``replication/dedup.py``
``coded_absent``), and the rule is erasure's: the twins' nodes, lost together, must be more
than the parity survives (``peerckpt/coding.py`` ``survives``; in a group of K + M, at least
M + 1 of its nodes), so that whatever loss the parity survives leaves a twin. A rank that
falls short keeps its step from committing (its parity already holds it without them) and
is coded whole from its next snapshot on.

For a recovery, :func:`recovery_sources` turns the committed step's holders into what the
same-topology plan needs: a rank whose complete copies are all gone is read from a node
holding its partial copy, and its data-parallel chunks from a twin's complete copy on any
surviving node (``Membership.twins``). A resharding plan reads partial copies too, but only
in the chunks they hold (:func:`lacking`): a chunk they lack is one logical chunk with its
twins' identical boxes, read from a twin's complete copy.

Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from peerckpt.coding import Coding, survives
from peerckpt.manifest import ChunkRecord
from peerckpt.membership import Membership
from peerckpt.recovery.planning.sources import plan_sources


def domains_of(membership: Membership) -> dict[int, tuple[int, int]]:
    """rank → (its node, its buddy count k) in ``membership``: what :func:`verify` needs."""
    return {r: (a.node, len(membership.placement.get(r, []))) for r, a in membership.ranks.items()}


@dataclass(frozen=True)
class Report:
    """What a rank's ``Replicated`` says that the verification reads."""

    node: int  # the rank's own node (its slot holds the whole snapshot)
    holders: frozenset[int]
    digest: str  # of its declared data-parallel chunks; "" when none is declared
    partial: bool  # the buddies in ``holders`` hold it without those chunks
    absent: tuple[int, ...] = ()  # the chunks (layout indices) those buddies' copies lack


@dataclass(frozen=True)
class Verdict:
    """The verification of one step: each partial rank's verified twins, and the ranks whose
    data-parallel chunks are held in too few failure domains (to be pushed whole)."""

    twins: dict[int, tuple[int, ...]] = field(default_factory=dict)
    short: tuple[int, ...] = ()


def verify(
    reports: Mapping[int, Report], buddies: Mapping[int, int], coding: Coding | None = None
) -> Verdict:
    """Check the twins of every partially replicated (or coded) rank of one step.

    ``reports``: rank → its report of the step; ``buddies``: rank → how many buddies it has
    (k). A partial rank r is covered when the nodes of the ranks with r's digest number at
    least 1 + k. With ``--erasure`` (``coding``: the step's groups) it is covered when those
    nodes lost together are more than the parity survives (``coding.survives``): then every
    loss the parity survives leaves one of them, so r's chunks outlive exactly what its
    coded bytes do (with a group of K + M: at least M + 1 twin nodes in one group).
    """
    classes: dict[str, list[int]] = {}
    for rank, report in reports.items():
        if report.digest:
            classes.setdefault(report.digest, []).append(rank)
    twins: dict[int, tuple[int, ...]] = {}
    short: list[int] = []
    outlive: dict[frozenset[int], bool] = {}  # twin nodes → they outlive what parity does
    # Only partial ranks are checked: a step of 8,000 whole ranks costs one pass, no sort.
    for rank in sorted(r for r, report in reports.items() if report.partial):
        report = reports[rank]
        group = classes.get(report.digest, [rank]) if report.digest else [rank]
        domains = frozenset(reports[r].node for r in group)
        if coding is None:
            covered = len(domains) >= 1 + buddies.get(rank, 0)
        else:
            if domains not in outlive:
                outlive[domains] = not survives(coding, set(domains))
            covered = outlive[domains]
        if covered:
            twins[rank] = tuple(sorted(r for r in group if r != rank))
        else:
            short.append(rank)
    return Verdict(twins, tuple(short))


def twins_by_digest(
    digests: Mapping[int, str], partial: Mapping[int, set[int]]
) -> dict[int, tuple[int, ...]]:
    """For a restarted coordinator (``recovery/rebuild.py``): each rank with partial copies →
    the other ranks whose copies of the committed step carry its twin digest (the commit
    verified them before the coordinator died)."""
    groups: dict[str, list[int]] = {}
    for rank, digest in digests.items():
        groups.setdefault(digest, []).append(rank)
    return {
        r: tuple(sorted(t for t in groups.get(digests.get(r, ""), []) if t != r))
        for r in partial
        if digests.get(r)
    }


def partial_nodes(report: Report) -> set[int]:
    """The nodes holding a report's rank without its data-parallel chunks."""
    return set(report.holders) - {report.node} if report.partial else set()


def complete_nodes(report: Report) -> set[int]:
    """The nodes holding a report's rank whole."""
    return {report.node} if report.partial else set(report.holders)


def twin_sources(
    rank: int,
    node: int,
    twins: Mapping[int, tuple[int, ...]],
    holders: Mapping[int, set[int]],
) -> list[list[int]]:
    """Where ``rank`` (restoring on ``node``) reads its data-parallel chunks: [node, twin]
    pairs, the twins' complete copies on surviving nodes, its own node first, then by node."""
    pairs = {(n, t) for t in twins.get(rank, ()) for n in holders.get(t, ())}
    best: dict[int, int] = {}
    for n, t in sorted(pairs):
        best.setdefault(n, t)  # one twin per node: the smallest
    return [[n, best[n]] for n in sorted(best, key=lambda n: (n != node, n))]


def recovery_sources(
    new_nodes: dict[int, int],
    holders: Mapping[int, set[int]],
    partial: Mapping[int, set[int]],
    twins: Mapping[int, tuple[int, ...]],
    nbytes: dict[int, int],
    previous_nodes: dict[int, int],
) -> tuple[dict[int, list[int]], dict[int, list[list[int]]]]:
    """The same-topology plan with twins: every rank's source nodes, best first, and for
    every rank that may be read from a partial copy, where its data-parallel chunks are.

    A partial copy counts as a source only while some twin's complete copy survives.
    Raises RecoveryFailed (``plan_sources``) naming ranks with nothing left.
    """
    usable: dict[int, set[int]] = {}
    fill: dict[int, list[list[int]]] = {}
    for rank in holders.keys() | partial.keys():  # a rebuilt coordinator may know only partials
        usable[rank] = set(holders.get(rank, ()))
        if partial.get(rank):
            pairs = twin_sources(rank, new_nodes.get(rank, -1), twins, holders)
            if pairs:
                usable[rank] |= partial[rank]
                fill[rank] = pairs
    for rank in partial:
        usable.setdefault(rank, set())
    sources = plan_sources(new_nodes, usable, nbytes, previous_nodes)
    return sources, {r: p for r, p in fill.items() if r in new_nodes}


def lacking(
    partial: Mapping[int, set[int]],
    absent: Mapping[int, tuple[int, ...]],
    layouts: Mapping[int, list[Any]],
) -> dict[int, tuple[frozenset[int], frozenset[str]]]:
    """What a resharding plan must know of the committed step's partial copies: rank → (the
    nodes holding it without some chunks, the keys of those chunks). A rank whose absent
    chunks are unknown (not reported, or no layout) counts none of its partial copies."""
    out: dict[int, tuple[frozenset[int], frozenset[str]]] = {}
    for rank, nodes in partial.items():
        if not nodes:
            continue
        layout = layouts.get(rank)
        indices = absent.get(rank, ())
        if not indices or layout is None or any(not 0 <= i < len(layout) for i in indices):
            continue  # what the copy lacks is unknown: it is no source
        keys = frozenset(ChunkRecord.from_msg(layout[i]).key for i in indices)
        out[rank] = (frozenset(nodes), keys)
    return out


def read_holders(
    holders: Mapping[int, set[int]],
    lacks: Mapping[int, tuple[frozenset[int], frozenset[str]]],
) -> dict[int, set[int]]:
    """Every node a resharding plan may read a rank from: its complete copies' and, with
    :func:`lacking` telling the planner which keys they lack, its partial copies'."""
    out = {rank: set(nodes) for rank, nodes in holders.items()}
    for rank, (nodes, _) in lacks.items():
        out.setdefault(rank, set()).update(nodes)
    return out
