"""The commit tracker and the recovery plan (pure)."""

from __future__ import annotations

import pytest

from peerckpt.errors import RecoveryFailed, StaleEpoch
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.planning.sources import plan_sources


def test_a_step_commits_when_every_rank_has_it_replicated() -> None:
    tracker = CommitTracker(epoch=2, ranks=frozenset({0, 1, 2}), gen=7)
    assert tracker.record(2, 0, 5, [0, 1], ["layout of 0"]) is None
    assert tracker.record(2, 1, 5, [0, 1], ["layout of 1"]) is None
    assert tracker.record(2, 0, 6, [0, 1]) is None  # a later step of one rank does not commit 5
    assert tracker.record(2, 2, 5, [1, 0], ["layout of 2"]) == 5
    assert tracker.committed_step == 5
    assert tracker.committed_holders == {0: {0, 1}, 1: {0, 1}, 2: {0, 1}}
    # Layouts come once and are kept; the committed step's layout generation is recorded.
    assert tracker.committed_layouts == {r: [f"layout of {r}"] for r in range(3)}
    assert tracker.committed_gen == 7
    assert tracker.record(2, 2, 4, [1, 0]) is None  # older than committed: ignored


def test_a_step_cannot_commit_without_every_rank_layout() -> None:
    """Rank 1's first report (with its layout) was lost; its next report is taken and
    completes step 1, which must not commit, nor be refused: rank 1's agent sends the layout
    it owes with its next report, and that step commits."""
    tracker = CommitTracker(epoch=0, ranks=frozenset({0, 1}))
    tracker.record(0, 0, 1, [0, 1], ["a"])
    assert tracker.record(0, 1, 1, [1, 0]) is None
    assert tracker.layouts_owed == [1] and tracker.committed_step is None
    assert tracker.record(0, 0, 2, [0, 1]) is None
    assert tracker.layouts_owed == []
    assert tracker.record(0, 1, 2, [1, 0], ["b"]) == 2
    assert tracker.committed_layouts == {0: ["a"], 1: ["b"]}


def test_reports_of_another_epoch_are_fenced_off() -> None:
    tracker = CommitTracker(epoch=3, ranks=frozenset({0}))
    with pytest.raises(StaleEpoch, match="epoch 2 arrived in epoch 3"):
        tracker.record(2, 0, 9, [0])
    assert tracker.committed_step is None


def test_losing_a_node_removes_it_from_every_holder_set() -> None:
    tracker = CommitTracker(epoch=0, ranks=frozenset({0, 1}))
    tracker.record(0, 0, 1, [0, 1], ["a"])
    tracker.record(0, 1, 1, [1, 0], ["b"])
    tracker.forget_node(1)
    assert tracker.committed_holders == {0: {0}, 1: {0}}


def test_plan_reads_locally_first_then_balances_peers() -> None:
    # Ranks 2 and 3 moved to node 2; both have copies on nodes 0 and 1.
    plan = plan_sources(
        new_nodes={0: 0, 2: 2, 3: 2},
        holders={0: {0, 1}, 2: {0, 1}, 3: {0, 1}},
        nbytes={0: 100, 2: 100, 3: 100},
        previous_nodes={0: 0, 2: 1, 3: 1},
    )
    assert plan[0][0] == 0  # own node: no network
    firsts = {plan[2][0], plan[3][0]}
    assert firsts == {0, 1}  # the two pulls go to different sources


def test_plan_prefers_a_buddy_over_the_node_the_rank_was_lost_on() -> None:
    plan = plan_sources({2: 2}, {2: {0, 1}}, {2: 10}, previous_nodes={2: 1})
    assert plan[2] == [0, 1]


def test_plan_names_the_ranks_whose_every_copy_is_gone() -> None:
    with pytest.raises(RecoveryFailed, match=r"rank\(s\) \[3\].*--replicas"):
        plan_sources({2: 0, 3: 0}, {2: {0}, 3: set()}, {}, {2: 1, 3: 1})


def test_layouts_come_once_and_the_blob_size_with_every_report() -> None:
    from peerckpt.manifest import ChunkRecord

    layout = [
        ChunkRecord("w", "float32", (4,), (0,), (4,), 0, 16).to_msg(),
        ChunkRecord("__meta__", "uint8", (100,), (0,), (100,), 64, 100, scope="rank").to_msg(),
    ]
    tracker = CommitTracker(epoch=0, ranks=frozenset({0}))
    tracker.record(0, 0, 1, [0], layout, meta_nbytes=100)
    tracker.record(0, 0, 2, [0], None, meta_nbytes=137)  # same tensors, a longer blob
    meta = ChunkRecord.from_msg(tracker.committed_layouts[0][1])
    assert (meta.nbytes, meta.lengths, meta.global_shape) == (137, (137,), (137,))
    assert ChunkRecord.from_msg(tracker.committed_layouts[0][0]).nbytes == 16


def test_the_committed_layouts_are_those_of_the_committed_step_even_if_one_changes_later() -> None:
    tracker = CommitTracker(epoch=0, ranks=frozenset({0, 1}))
    tracker.record(0, 0, 1, [0, 1], ["old 0"])
    tracker.record(0, 1, 1, [1, 0], ["old 1"])
    tracker.record(0, 0, 2, [0, 1], ["new 0"])  # step 2 is not committed: 1's layouts stand
    assert tracker.committed_layouts == {0: ["old 0"], 1: ["old 1"]}
    assert tracker.record(0, 1, 2, [1, 0]) == 2
    assert tracker.committed_layouts == {0: ["new 0"], 1: ["old 1"]}
