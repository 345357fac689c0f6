"""The coordinator's epoch decision, as pure functions: no coordinator, no process, no clock."""

from __future__ import annotations

from dataclasses import replace

from peerckpt.manifest import ChunkRecord
from peerckpt.membership import Membership, RankAssignment
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.decide import (
    Fail,
    JobView,
    Join,
    Loss,
    NeedStorage,
    OpenEpoch,
    Topology,
    Wait,
    decide_join,
    decide_loss,
    restarts_in_place,
)
from peerckpt.recovery.placement import RingPlacement
from peerckpt.states import EpochMode, RecoveryKind

LAYOUT = [ChunkRecord("w", "float32", (4,), (0,), (4,), 0, 16).to_msg()]


def _view(
    spares: tuple[tuple[int, int], ...] = (),
    starting: int = 0,
    min_nodes: int | None = None,
    committed: int | None = 9,
    holders: dict[int, set[int]] | None = None,
) -> JobView:
    """A 2 × 2 job in epoch 3 (ranks 0, 1 on node 0; 2, 3 on node 1; spare node 2)."""
    ranks = {r: RankAssignment(r, r // 2, 100 + r) for r in range(4)}
    membership = Membership(
        epoch=3,
        world_size=4,
        ranks=ranks,
        placement={0: [1], 1: [1], 2: [0], 3: [0]},
        restore_step=None,
        sources={},
        node_addrs={0: "a0", 1: "a1", 2: "a2"},
        store_addr="store",
        mode=EpochMode.SAME if committed is not None else EpochMode.FRESH,
        gen=2,
    )
    tracker = CommitTracker(
        epoch=3,
        ranks=frozenset(ranks),
        gen=2,
        committed_step=committed,
        committed_gen=2,
        committed_holders=holders if holders is not None else {r: {0, 1} for r in range(4)},
        committed_layouts={r: LAYOUT for r in range(4)},
    )
    return JobView(
        membership,
        tracker,
        {r: 16 for r in range(4)},
        spares,
        starting,
        min_nodes,
        Topology(RingPlacement(), 1, {0: "a0", 1: "a1", 2: "a2"}, "store"),
    )


def _loss(*ranks: int, nodes: tuple[int, ...] = (), deadline: float | None = None) -> Loss:
    return Loss(
        RecoveryKind.NODE if nodes else RecoveryKind.RANK,
        frozenset(ranks),
        frozenset(nodes),
        "test",
        0.0,
        deadline,
    )


def test_spares_take_the_lost_ranks_in_the_same_layout() -> None:
    view = _view(spares=((2, 200), (2, 201)))
    d = decide_loss(view, _loss(2, 3, nodes=(1,)), now=10.0, spare_wait_s=60.0)
    assert isinstance(d, OpenEpoch)
    m = d.membership
    assert m.epoch == 4 and m.mode is EpochMode.SAME and m.gen == 2 and m.restore_step == 9
    assert {r: (a.node, a.pid) for r, a in m.ranks.items() if r >= 2} == {2: (2, 200), 3: (2, 201)}
    assert d.promoted == {(2, 200): 2, (2, 201): 3}
    assert d.replacements == {2: [2, 200], 3: [2, 201]}
    assert m.previous == {0: 0, 1: 1, 2: None, 3: None}
    assert d.tracker.epoch == 4 and d.tracker.committed_step == 9
    # The view's tracker was read, not changed.
    assert view.tracker.epoch == 3


def test_too_few_spares_with_more_starting_waits_until_the_deadline() -> None:
    view = _view(spares=((2, 200),), starting=1)
    d = decide_loss(view, _loss(2, 3, nodes=(1,)), now=10.0, spare_wait_s=60.0)
    assert isinstance(d, Wait) and d.loss.deadline == 70.0
    # Asked again before the deadline: still waiting, with the same deadline.
    again = decide_loss(view, d.loss, now=50.0, spare_wait_s=60.0)
    assert isinstance(again, Wait) and again.loss.deadline == 70.0
    # After it, with no way to shrink: a failure naming the ranks and the fix.
    late = decide_loss(view, d.loss, now=71.0, spare_wait_s=60.0)
    assert isinstance(late, Fail)
    assert "lost rank(s) [2, 3]" in late.reason and "--spares" in late.reason


def test_no_spare_shrinks_the_world_when_enough_nodes_remain() -> None:
    d = decide_loss(_view(min_nodes=1), _loss(2, 3, nodes=(1,)), now=0.0, spare_wait_s=60.0)
    assert isinstance(d, OpenEpoch) and d.shrunk_to == 2
    m = d.membership
    assert m.mode is EpochMode.RESHARD and m.gen == 3 and m.old_world == 4
    assert m.previous == {0: 0, 1: 1} and m.old_layout is not None


def test_no_spare_fails_when_shrinking_would_leave_too_few_nodes() -> None:
    d = decide_loss(_view(min_nodes=2), _loss(2, 3, nodes=(1,)), now=0.0, spare_wait_s=60.0)
    assert isinstance(d, Fail) and "fewer than --min-nodes 2" in d.reason


def test_a_rank_without_a_surviving_copy_needs_storage() -> None:
    holders = {0: {0}, 1: {0}, 2: set(), 3: {0}}  # rank 2's copies died with node 1
    view = _view(spares=((2, 200),), holders=holders)
    d = decide_loss(view, _loss(2), now=0.0, spare_wait_s=60.0)
    assert isinstance(d, NeedStorage)
    assert "rank(s) [2]" in d.why and d.assignments[2].pid == 200


def test_nothing_committed_yet_restarts_fresh() -> None:
    d = decide_loss(_view(spares=((2, 200),), committed=None), _loss(1), 0.0, 60.0)
    assert isinstance(d, OpenEpoch)
    assert d.membership.mode is EpochMode.FRESH and d.membership.restore_step is None


def test_a_join_grows_the_world_and_reshards() -> None:
    d = decide_join(_view(), Join(3, ((3, 300), (3, 301))))
    assert isinstance(d, OpenEpoch) and d.grown_to == 6
    m = d.membership
    assert m.mode is EpochMode.RESHARD and sorted(m.ranks) == list(range(6))
    assert d.promoted == {(3, 300): 4, (3, 301): 5}
    assert m.previous[4] is None and m.previous[0] == 0


def test_merged_losses_recover_together() -> None:
    first = _loss(1, deadline=70.0)
    both = first.merged(_loss(3, nodes=(1,)))
    assert both.ranks == {1, 3} and both.kind is RecoveryKind.NODE and both.deadline == 70.0
    assert both.reason == "test; test"


def test_a_spare_on_the_lost_ranks_own_node_takes_it_first() -> None:
    # Spares sorted spare node first; the one restarted on node 1 (where rank 2's snapshot
    # is) takes rank 2, the spare node's takes rank 0.
    view = _view(spares=((2, 200), (1, 300)))
    d = decide_loss(view, _loss(0, 2), now=0.0, spare_wait_s=60.0)
    assert isinstance(d, OpenEpoch)
    assert d.replacements == {0: [2, 200], 2: [1, 300]}
    assert d.promoted == {(2, 200): 0, (1, 300): 2}
    assert d.membership.sources[2][0] == 1  # its own node holds it: restored there


def test_restart_based_recovery_waits_until_every_worker_is_gone_and_back() -> None:
    """torchrun restarts every worker after one fails: no epoch opens while a worker of the
    old one lives or restarted ones are still coming, though enough spares joined."""
    spares = ((0, 400), (0, 401), (1, 402), (1, 403))
    alive = replace(_view(spares=spares), restart_based=True, members_alive=2)
    d = decide_loss(alive, _loss(2, 3), now=0.0, spare_wait_s=600.0)
    assert isinstance(d, Wait) and d.loss.deadline == 600.0
    coming = replace(_view(spares=spares[:3], starting=1), restart_based=True)
    assert isinstance(decide_loss(coming, _loss(0, 1, 2, 3), 1.0, 600.0), Wait)
    ready = replace(_view(spares=spares), restart_based=True)
    d = decide_loss(ready, _loss(0, 1, 2, 3), now=2.0, spare_wait_s=600.0)
    assert isinstance(d, OpenEpoch) and d.membership.mode is EpochMode.SAME
    # Every rank back on its own node (ranks 0, 1 on node 0; 2, 3 on node 1).
    assert {r: a.node for r, a in d.membership.ranks.items()} == {0: 0, 1: 0, 2: 1, 3: 1}


def test_restarted_workers_of_the_surviving_nodes_form_the_shrunk_world() -> None:
    view = replace(_view(spares=((0, 400), (0, 401)), min_nodes=1), restart_based=True)
    d = decide_loss(view, _loss(0, 1, 2, 3, nodes=(1,)), now=0.0, spare_wait_s=600.0)
    assert isinstance(d, OpenEpoch) and d.shrunk_to == 2
    m = d.membership
    assert m.mode is EpochMode.RESHARD and m.old_world == 4
    assert {r: (a.node, a.pid) for r, a in m.ranks.items()} == {0: (0, 400), 1: (0, 401)}
    assert d.promoted == {(0, 400): 0, (0, 401): 1} and m.previous == {0: None, 1: None}


def _restartable(max_restarts: int = 3, **view: object) -> JobView:
    """``_view`` where a launcher restarts lost ranks in place on nodes 0, 1 and 2."""
    return replace(
        _view(**view),  # type: ignore[arg-type]
        max_restarts=max_restarts,
        restartable_nodes=frozenset({0, 1, 2}),
    )


def test_a_rank_lost_on_a_live_node_with_no_spare_is_restarted_there() -> None:
    view = _restartable()
    assert restarts_in_place(view, _loss(1)) == {1: 0}  # rank 1 ran on node 0
    assert restarts_in_place(view, _loss(1, 2)) == {1: 0, 2: 1}
    # Ordered once: the shell counts it as a spare starting, and decide_loss waits for it.
    ordered = replace(_loss(1), ordered=frozenset({1}))
    assert restarts_in_place(replace(view, spares_starting=1), ordered) == {}
    d = decide_loss(replace(view, spares_starting=1), ordered, now=5.0, spare_wait_s=60.0)
    assert isinstance(d, Wait) and d.loss.deadline == 65.0 and d.loss.ordered == {1}
    # Its process joins as a spare on node 0 and takes rank 1, from node 0's own memory.
    d = decide_loss(replace(view, spares=((0, 500),)), d.loss, now=8.0, spare_wait_s=60.0)
    assert isinstance(d, OpenEpoch) and d.replacements == {1: [0, 500]}
    assert d.membership.mode is EpochMode.SAME and d.membership.sources[1][0] == 0


def test_free_spares_are_preferred_and_restarts_cover_only_what_they_cannot() -> None:
    assert restarts_in_place(_restartable(spares=((2, 200),)), _loss(1)) == {}
    assert restarts_in_place(_restartable(starting=1), _loss(1)) == {}  # one is coming
    # Two lost, one spare: one restart, the lowest rank that can be restarted.
    assert restarts_in_place(_restartable(spares=((2, 200),)), _loss(1, 3)) == {1: 0}


def test_no_restart_where_the_node_is_gone_the_count_is_spent_or_the_launcher_restarts() -> None:
    view = _restartable()
    assert restarts_in_place(view, _loss(2, 3, nodes=(1,))) == {}  # node 1's memory is gone
    # Rank 3's node died with it: restarting rank 1 alone would leave the world short.
    assert restarts_in_place(view, _loss(1, 3, nodes=(1,))) == {}
    gone = replace(view, restartable_nodes=frozenset({1, 2}))  # node 0: agent lost, or joined
    assert restarts_in_place(gone, _loss(1)) == {}
    assert restarts_in_place(replace(view, restarts={1: 3}), _loss(1)) == {}
    assert restarts_in_place(replace(view, restarts={1: 2}), _loss(1)) == {1: 0}
    assert restarts_in_place(_restartable(max_restarts=0), _loss(1)) == {}
    assert restarts_in_place(replace(view, restart_based=True), _loss(1)) == {}  # torchrun's
    stuck = replace(_loss(1), restarted=frozenset({1}))  # it restarts itself
    assert restarts_in_place(view, stuck) == {}


def test_with_no_restart_left_the_failure_names_max_restarts() -> None:
    off = decide_loss(_restartable(max_restarts=0), _loss(1), now=0.0, spare_wait_s=60.0)
    assert isinstance(off, Fail)
    assert "only 0 spare(s) are left; restarting in place is off (--max-restarts 0)" in off.reason
    assert "more --spares, a higher --max-restarts, or let it shrink" in off.reason
    spent = replace(_restartable(max_restarts=2), restarts={1: 2})
    d = decide_loss(spent, _loss(1), now=0.0, spare_wait_s=60.0)
    assert isinstance(d, Fail)
    assert "rank(s) [1] were restarted in place 2 time(s) already" in d.reason
    assert "--max-restarts 2 allows" in d.reason
    # A rank lost with its node could not be restarted anyway: no word of it.
    node = decide_loss(_restartable(), _loss(2, 3, nodes=(1,)), now=0.0, spare_wait_s=60.0)
    assert isinstance(node, Fail) and "--max-restarts" not in node.reason


def test_restarts_spent_fall_back_to_shrinking_with_min_nodes() -> None:
    view = replace(_restartable(max_restarts=1, min_nodes=1), restarts={1: 1})
    assert restarts_in_place(view, _loss(1)) == {}
    d = decide_loss(view, _loss(1), now=0.0, spare_wait_s=60.0)
    assert isinstance(d, OpenEpoch) and d.shrunk_to == 3


def test_merged_losses_keep_the_ranks_ordered_restarted() -> None:
    first = replace(_loss(1), ordered=frozenset({1}))
    assert first.merged(_loss(2)).ordered == {1}
