"""Redundancy-aware replication, the coordinator's accounting (recovery/twins.py, commits)."""

from __future__ import annotations

import pytest

from peerckpt.boxes import Box
from peerckpt.errors import RecoveryFailed
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.planning import reshard as planner
from peerckpt.recovery.planning.types import HeldChunk, WantedChunk
from peerckpt.recovery.twins import (
    Report,
    lacking,
    read_holders,
    recovery_sources,
    twin_sources,
    twins_by_digest,
    verify,
)

NODES = {0: 0, 1: 0, 2: 1, 3: 1}  # 2 nodes x 2 ranks


def _reports(digests: dict[int, str], partial: bool = True) -> dict[int, Report]:
    return {
        r: Report(NODES[r], frozenset({NODES[r], 1 - NODES[r]}), d, partial)
        for r, d in digests.items()
    }


def test_equal_twins_on_two_nodes_cover_one_buddy() -> None:
    verdict = verify(_reports(dict.fromkeys(range(4), "a")), dict.fromkeys(range(4), 1))
    assert verdict.short == ()
    assert verdict.twins[2] == (0, 1, 3)


def test_a_rank_whose_checksums_differ_is_short() -> None:
    verdict = verify(_reports({0: "a", 1: "a", 2: "b", 3: "a"}), dict.fromkeys(range(4), 1))
    assert verdict.short == (2,)
    assert 2 not in verdict.twins and verdict.twins[3] == (0, 1)


def test_twins_on_one_node_are_too_few_domains() -> None:
    # ranks 0 and 1 share node 0: with k=1 their twin chunks need a second node
    reports = {r: Report(0, frozenset({0, 1}), "a", True) for r in (0, 1)}
    assert verify(reports, {0: 1, 1: 1}).short == (0, 1)


def test_an_undeclared_or_whole_rank_is_never_short() -> None:
    reports = _reports({0: "", 1: "a", 2: "a", 3: "a"}, partial=False)
    assert verify(reports, dict.fromkeys(range(4), 1)) == verify({}, {})


def test_commit_waits_for_a_whole_push_of_a_mismatched_rank() -> None:
    tracker = CommitTracker(0, frozenset(range(4)))
    tracker.domains = {r: (NODES[r], 1) for r in range(4)}
    layout = [["w", "float32", [4], [0], [4], 0, 16, None, "global"]]
    for r, d in ((0, "a"), (1, "a"), (2, "b")):
        assert (
            tracker.record(0, r, 5, [NODES[r], 1 - NODES[r]], layout, twins=d, partial=True) is None
        )
    assert tracker.record(0, 3, 5, [1, 0], layout, twins="a", partial=True) is None
    assert tracker.short == [(2, 5)]
    # the whole push of rank 2 arrives: now the step commits
    assert tracker.record(0, 2, 5, [1, 0], twins="b", partial=False) == 5
    assert tracker.committed_holders[2] == {0, 1}  # complete on both
    assert tracker.committed_holders[3] == {1}  # its buddy holds it partially only
    assert tracker.committed_partial[3] == {0} and tracker.committed_twins[3] == (0, 1)
    assert 2 not in tracker.committed_partial


def test_without_known_domains_partial_reports_fall_back_to_whole() -> None:
    tracker = CommitTracker(0, frozenset({0, 1}))
    for r in (0, 1):
        tracker.record(0, r, 1, [r, 1 - r], [], twins="a", partial=True)
    assert tracker.short == [(0, 1), (1, 1)] and tracker.committed_step is None


def test_a_lost_node_reads_partial_copies_and_twins_on_the_survivor() -> None:
    holders = {0: {0}, 1: {0}, 2: set(), 3: set()}  # node 1 is gone
    partial = {0: {1} - {1}, 1: set(), 2: {0}, 3: {0}}
    twins = {r: tuple(t for t in range(4) if t != r) for r in range(4)}
    new = {0: 0, 1: 0, 2: 2, 3: 2}
    sources, fill = recovery_sources(new, holders, partial, twins, {}, NODES)
    assert sources[2] == [0] and sources[3] == [0]
    assert fill[2] == [[0, 0]] and fill[3] == [[0, 0]]


def test_a_rebuilt_coordinator_reads_ranks_it_knows_only_partial_copies_of() -> None:
    """A coordinator that moved after its host died (node 0's ranks with it) learns from the
    surviving agent only node 1's partial copies of ranks 0 and 1, and their twins by
    digest: the ranks are recovered from those copies and node 1's complete twins."""
    digests = {0: "d", 1: "d", 2: "d", 3: "d"}
    partial = {0: {1}, 1: {1}}
    twins = twins_by_digest(digests, partial)
    assert twins == {0: (1, 2, 3), 1: (0, 2, 3)}
    holders = {2: {1}, 3: {1}}  # no entry at all for ranks 0 and 1
    new = {0: 2, 1: 2, 2: 1, 3: 1}
    sources, fill = recovery_sources(new, holders, partial, twins, {}, NODES)
    assert sources[0] == [1] and sources[1] == [1]
    assert fill[0] == [[1, 2]] and fill[1] == [[1, 2]]


def test_twins_by_digest_skips_ranks_without_a_digest_or_another_twin() -> None:
    twins = twins_by_digest({0: "a", 1: "b", 2: "a"}, {0: {1}, 1: {0}, 3: {0}})
    assert twins == {0: (2,), 1: ()}


def test_a_partial_copy_without_a_surviving_twin_is_no_source() -> None:
    holders = {0: set(), 1: set()}
    partial = {0: {1}, 1: {1}}
    try:
        recovery_sources({0: 2, 1: 2}, holders, partial, {0: (1,), 1: (0,)}, {}, {0: 0, 1: 0})
    except Exception as exc:
        assert "no surviving copy" in str(exc)
    else:
        raise AssertionError("a rank whose twins are all gone must not be recovered")


def test_twin_sources_prefer_the_restoring_node() -> None:
    holders = {0: {0, 5}, 1: {3}}
    assert twin_sources(2, 3, {2: (0, 1)}, holders) == [[3, 1], [0, 0], [5, 0]]


# -- resharding from partial copies (recovery/planning with ``lacking``) -------------------------
W = Box((0,), (8,))


def _ddp_held(ranks: range) -> dict[int, list[HeldChunk]]:
    """Every old rank: the data-parallel tensor "w" whole, and its own blob."""
    return {
        r: [
            HeldChunk("w", "float32", (8,), W),
            HeldChunk(f"meta@{r}", "uint8", (4,), Box((0,), (4,))),
        ]
        for r in ranks
    }


def test_a_shrink_reads_private_chunks_from_partial_copies_and_twins_elsewhere() -> None:
    # 2 nodes x 2 ranks, node 1 lost: ranks 2 and 3 survive only as partial copies on node 0
    holders = read_holders(
        {0: {0}, 1: {0}, 2: set(), 3: set()},
        lacks := {
            2: (frozenset({0}), frozenset({"w"})),
            3: (frozenset({0}), frozenset({"w"})),
        },
    )
    wanted = {
        new: [WantedChunk("w", "float32", (8,), W)]
        + [WantedChunk(f"meta@{r}", "uint8", (4,), Box((0,), (4,))) for r in range(4)]
        for new in (0, 1)
    }
    reads = planner.plan(_ddp_held(range(4)), holders, wanted, {0: 0, 1: 0}, {0: 0, 1: 1}, lacks)
    for new, rank_reads in reads.by_rank().items():
        by_key = {r.key: r for r in rank_reads}
        assert by_key["w"].source_rank == new  # its own slot, never a partial copy
        for old in range(4):
            assert (by_key[f"meta@{old}"].source_node, by_key[f"meta@{old}"].source_rank) == (
                0,
                old,
            )


def test_a_chunk_only_partial_copies_lack_is_not_read_from_them() -> None:
    # rank 0's complete copy (node 0) is gone; rank 1's partial copy on node 0 lacks "w"
    lacks = {1: (frozenset({0}), frozenset({"w"}))}
    holders = read_holders({0: set(), 1: set()}, lacks)
    wanted = {0: [WantedChunk("w", "float32", (8,), W)]}
    with pytest.raises(RecoveryFailed, match="'w'"):
        planner.plan(_ddp_held(range(2)), holders, wanted, {0: 0}, {0: 1}, lacks)
    # without ``lacking`` the same holders would read "w" from a copy that lacks it
    assert planner.plan(_ddp_held(range(2)), holders, wanted, {0: 0}, {0: 1}).by_rank()[0]


def test_lacking_names_the_keys_of_the_absent_chunks() -> None:
    layout = [
        ["m/w", "float32", [4], [0], [4], 0, 16, None, "global"],
        ["pos", "int64", [1], [0], [1], 64, 8, None, "rank"],
    ]
    lacks = lacking({0: {1}, 1: {0}, 2: set()}, {0: (0,), 1: ()}, {0: layout, 1: layout})
    assert lacks == {0: (frozenset({1}), frozenset({"m/w"}))}  # rank 1: absent chunks unknown
    assert read_holders({0: {0}, 1: {1}}, lacks) == {0: {0, 1}, 1: {1}}


def test_the_commit_keeps_what_each_partial_copy_lacks_for_the_next_epoch() -> None:
    tracker = CommitTracker(0, frozenset(range(4)))
    tracker.domains = {r: (NODES[r], 1) for r in range(4)}
    layout = [["w", "float32", [4], [0], [4], 0, 16, None, "global"]]
    for r in range(4):
        tracker.record(
            0, r, 3, [NODES[r], 1 - NODES[r]], layout, twins="a", partial=True, absent=(0,)
        )
    assert tracker.committed_step == 3
    assert tracker.committed_absent == dict.fromkeys(range(4), (0,))
    assert lacking(tracker.committed_partial, tracker.committed_absent, tracker.committed_layouts)[
        2
    ] == (frozenset({0}), frozenset({"w"}))
