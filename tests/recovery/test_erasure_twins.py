"""--erasure with data-parallel twins, the coordinator's side: a step whose ranks were coded
without their twin chunks commits only when every loss the parity survives leaves a twin;
a lost rank is rebuildable only while a twin is held; the rebuild learns its twins."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerckpt.coding import Coding, ErasureSpec, survives
from peerckpt.reads import ERASURE
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.erasure import (
    coding_for,
    mark_rebuildable,
    restore_coding,
    why_unrebuildable,
)
from peerckpt.recovery.twins import Report, verify


def _coding(spec: ErasureSpec, nodes: int) -> Coding:
    return coding_for(spec, {n: n for n in range(nodes)}, list(range(nodes)))


def test_the_parity_survives_m_losses_of_a_group_and_no_more() -> None:
    coding = _coding(ErasureSpec(3, 1), 8)  # groups: nodes 0-3, 4-7
    assert survives(coding, {1}) and survives(coding, {0, 4})  # one per group
    assert not survives(coding, {0, 1}) and not survives(coding, set(range(8)))


@given(st.integers(1, 3), st.integers(1, 2), st.integers(0, 4), st.data())
def test_twins_outlive_every_survivable_loss_exactly_when_the_rule_says(
    k: int, m: int, extra: int, data: st.DataObject
) -> None:
    """Brute force: a set of twin nodes passes ``not survives`` exactly when no set of lost
    nodes that the parity survives contains all of them."""
    nodes = k + m + extra
    coding = _coding(ErasureSpec(k, m), nodes)
    twins = data.draw(st.sets(st.integers(0, nodes - 1), min_size=1))
    survivable = [
        set(lost)
        for j in range(nodes + 1)
        for lost in itertools.combinations(range(nodes), j)
        if survives(coding, set(lost))
    ]
    killed = any(twins <= lost for lost in survivable)
    assert (not survives(coding, twins)) == (not killed)


def _reports(digests: dict[int, str], partial: bool = True) -> dict[int, Report]:
    return {r: Report(r, frozenset({r}), d, partial) for r, d in digests.items()}


def test_ddp_twins_on_every_node_stand_in_for_parity() -> None:
    coding = _coding(ErasureSpec(3, 1), 8)
    verdict = verify(_reports(dict.fromkeys(range(8), "a")), {}, coding)
    assert verdict.short == () and verdict.twins[0] == (1, 2, 3, 4, 5, 6, 7)


def test_twins_one_per_group_are_refused_though_they_span_m_plus_1_nodes() -> None:
    """Ranks 0 and 4 are twins on two nodes (M + 1 = 2) but in two groups: losing both is
    one loss per group, which the parity survives, and would take every copy of their chunks.
    So they are short; ranks 1 and 2, twins in one group of 3+1, are covered."""
    coding = _coding(ErasureSpec(3, 1), 8)
    digests = {0: "a", 4: "a", 1: "b", 2: "b", 3: "c", 5: "d", 6: "e", 7: "f"}
    verdict = verify(_reports(digests), {}, coding)
    assert verdict.short == (0, 3, 4, 5, 6, 7)
    assert verdict.twins == {1: (2,), 2: (1,)}


def _tracker(nodes: int) -> CommitTracker:
    """3+1 over ``nodes`` nodes, one rank each, every layout known."""
    tracker = CommitTracker(0, frozenset(range(nodes)))
    tracker.domains = {r: (r, 0) for r in range(nodes)}
    tracker.coding = _coding(ErasureSpec(3, 1), nodes)
    for r in range(nodes):
        tracker.set_layout(r, [])
    return tracker


def _report(tracker: CommitTracker, rank: int, step: int, digest: str, partial: bool) -> int | None:
    return tracker.record(0, rank, step, [rank], twins=digest, partial=partial, absent=(0,))


def test_a_step_commits_when_twins_cover_and_is_refused_when_they_do_not() -> None:
    tracker = _tracker(4)
    assert [_report(tracker, r, 1, "a", True) for r in range(4)] == [None, None, None, 1]
    assert tracker.committed_twins[2] == (0, 1, 3)
    assert tracker.committed_holders == {r: {r} for r in range(4)}  # its own node: whole
    # Step 2: rank 3's chunks differ from its twins' (its digest alone): nothing else holds
    # them, so the step is refused and rank 3 named, to be coded whole.
    got = [_report(tracker, r, 2, "b" if r == 3 else "a", True) for r in range(4)]
    assert got == [None] * 4 and tracker.committed_step == 1 and tracker.short == [(3, 2)]
    # Step 3: rank 3 coded whole (not partial), the others still covered by their twins.
    got = [_report(tracker, r, 3, "b" if r == 3 else "a", r != 3) for r in range(4)]
    assert got == [None, None, None, 3] and tracker.short == []
    assert 3 not in tracker.committed_twins


def test_a_lost_rank_is_rebuildable_while_a_twin_is_held() -> None:
    tracker = _tracker(8)
    for r in range(8):
        _report(tracker, r, 1, "a", True)
    assert tracker.committed_step == 1
    tracker.forget_node(1)
    assert tracker.committed_holders[1] == {ERASURE}
    restore = restore_coding(
        tracker.committed_coding, tracker.committed_holders, tracker.committed_twins
    )
    assert restore["twins"][1] == [0, 2, 3, 4, 5, 6, 7] and 1 not in restore["holders"]


def test_a_rank_whose_twins_are_gone_is_lost_and_the_message_says_why() -> None:
    """Ranks 0, 1 and 4 are twins (covered: nodes 0 and 1 lost together are more than group
    0's parity survives). Nodes 0, 1 and 4 lost: group 1 lost one node, which its parity
    survives, but rank 4's data-parallel chunks are gone with every twin."""
    tracker = _tracker(8)
    for r in range(8):
        _report(tracker, r, 1, "a" if r in (0, 1, 4) else f"own{r}", r in (0, 1, 4))
    assert tracker.committed_step == 1 and tracker.committed_twins[4] == (0, 1)
    tracker.forget_node(4)
    assert tracker.committed_holders[4] == {ERASURE}  # its twins are held
    tracker.forget_node(0)
    assert tracker.committed_holders[0] == {ERASURE} and tracker.unrebuildable == []
    tracker.forget_node(1)
    assert tracker.unrebuildable == [0, 1, 4]
    why = why_unrebuildable(tracker)
    assert "rank(s) [0, 1, 4] cannot be rebuilt from memory" in why
    assert "every node holding a twin of them (ranks [0, 1, 4]) was lost" in why
    assert "--persist" in why


@pytest.mark.parametrize("whole", [True, False])
def test_a_rank_coded_whole_needs_no_twin(whole: bool) -> None:
    coding = _coding(ErasureSpec(3, 1), 4)
    holders = {r: {r} for r in range(4)}
    holders[1] = set()
    twins = {} if whole else {1: ()}
    gone = mark_rebuildable(coding, holders, {1}, twins)
    assert (holders[1] == {ERASURE}) == whole and gone == ([] if whole else [1])
