"""Attributing failures to the chaos actions that caused them."""

from __future__ import annotations

from dataclasses import replace

from peerckpt.chaos import ActionKind, FiredAction
from peerckpt.launch.report import causes, failure_rows, format_failures
from peerckpt.messages.control import Pull, RecoveryEvent
from peerckpt.states import RecoveryKind
from tests.launch.campaign_run import complete, recorded
from tests.launch.observed import event

EVENTS = [
    event(
        RecoveryKind.NODE,
        ranks=[2, 3],
        nodes=[1],
        reason="agent gone",
        lost={2: 1, 3: 1},
        detected_at=10.02,
        resumed_at=10.10,
        restore_step=7,
        pulls=[Pull(2, 2, 0, 1000, 0.01)],
    ),
    event(
        RecoveryKind.RANK,
        ranks=[0],
        reason="process 9 exited",
        lost={0: 0},
        detected_at=20.0,
        resumed_at=20.5,
        restore_step=15,
    ),
]
CHAOS = [
    FiredAction("kill rank=1 at=3", ActionKind.KILL_RANK, 1, 3, 2, 0, 5.0, node=0, pid=101),
    FiredAction("kill node=1 at=8", ActionKind.KILL_NODE, 1, 8, 7, 0, 10.0, node=1),
]


def test_failures_are_paired_with_the_action_that_lost_their_target() -> None:
    node, rank = failure_rows(EVENTS, CHAOS)
    assert node.cause == "kill node=1 at=8"
    assert round(node.detected_s, 3) == 0.02 and round(node.recovered_s, 3) == 0.1
    assert node.lost == {2: 1, 3: 1}
    # Rank 0 died without being killed by chaos (kill rank=1 never lost anything).
    assert rank.cause == "rank lost (process 9 exited)" and rank.detected_s is None
    assert round(rank.recovered_s, 3) == 0.5


def test_the_report_says_where_each_rank_got_its_state() -> None:
    text = "\n".join(format_failures(EVENTS, CHAOS))
    assert "rank 2 on node 2: pulled 1,000 bytes from node 1" not in text
    assert "rank 2 on node 2: pulled 1,000 bytes from node 0 over TCP" in text
    assert "every rank stepping again 100 ms after the kill, from step 8" in text
    assert "every rank stepping again 500 ms after detection, from step 16" in text


def test_a_survivor_restarted_in_place_is_costed_in_the_recovery_of_its_fault() -> None:
    """The coordinator records a restart in place of a survivor in the recovery it could not
    leave; the report times that recovery to every rank stepping after the restart."""
    node = replace(
        EVENTS[0],
        epoch=2,
        from_epoch=0,
        resumed_at=50.3,
        restarted={1: 50.0},
        replacements={1: [0, 300], 2: [2, 200], 3: [2, 201]},
    )
    [row] = failure_rows([node], CHAOS)
    assert row.restarted == {1: (0, 40.0)} and round(row.recovered_s, 3) == 40.3
    text = "\n".join(format_failures([node], CHAOS))
    assert "rank 1 could not leave the aborted epoch: restarted in place on node 0 40.0 s" in text
    assert "every rank stepping again 40300 ms after the kill, from step 8" in text
    assert "repaired together" not in text


def test_a_lost_rank_restarted_in_place_says_so_with_its_node() -> None:
    as_json = {**EVENTS[1].to_json(), "in_place": {"0": 2}, "replacements": {"0": [0, 400]}}
    rank = RecoveryEvent.from_json(as_json)  # JSON's string keys read back as ranks
    [row] = failure_rows([rank], [])
    assert row.in_place == {0: (0, 2)}
    text = "\n".join(format_failures([rank], []))
    assert "rank 0 restarted in place on node 0, from its node's memory (its restart 2" in text
    assert "restarted in place" not in "\n".join(format_failures(EVENTS, CHAOS))


def test_a_failure_repaired_with_the_next_one_costs_until_that_repair_ended() -> None:
    first = replace(EVENTS[0], epoch=1, from_epoch=0, resumed_at=None)
    second = replace(EVENTS[1], epoch=2, from_epoch=1, detected_at=10.5, resumed_at=11.0)
    row, _ = failure_rows([first, second], CHAOS)
    assert row.superseded and round(row.recovered_s, 3) == 1.0
    text = "\n".join(format_failures([first, second], CHAOS))
    assert "repaired together with the next failure, which struck before this recovery " in text
    assert "ended: every rank stepping again 1000 ms after the kill" in text


def test_a_fault_that_lost_nothing_does_not_take_a_later_failure_of_its_node() -> None:
    """The real campaign's report: ``partition node=@1 at=35 for=5.0`` cut node 3 for 5 s and
    lost nothing; 5.5 s later ``kill agent node=@0 at=55`` lost node 3. The failure is the
    agent kill's, detected 6 ms after it, not the partition's 5.5 s after that."""
    events, chaos = recorded()
    first, node = failure_rows(events, chaos)
    assert first.cause == "kill rank=0 at=5"
    assert node.cause == "kill agent node=@0 at=55"
    assert node.detected_s is not None and node.detected_s < 0.01
    assert node.recovered_s is not None and round(node.recovered_s, 3) == 0.08
    assert [c.action for c in causes(events, chaos) if c] == [
        "kill rank=0 at=5",
        "kill agent node=@0 at=55",
    ]


def test_every_failure_of_the_run_is_paired_with_its_own_fault() -> None:
    _, chaos = recorded()
    rows = failure_rows(complete(), chaos)
    assert [r.cause for r in rows] == [
        "kill rank=0 at=5",
        "kill rank=1 at=15",
        "kill agent node=@0 at=55",
    ]
    assert all(r.detected_s is not None and 0 <= r.detected_s < 0.1 for r in rows)


def test_a_kill_of_a_rank_is_not_paired_with_a_later_loss_of_that_rank_elsewhere() -> None:
    """A rank's kill on node 1 did not cause a loss of that rank on node 3 (its spare's), nor
    a failure that ended an epoch older than the one it struck in."""
    kill = FiredAction("kill rank=1 at=3", ActionKind.KILL_RANK, 1, 3, 2, 1, 5.0, node=1, pid=9)
    elsewhere = event(ranks=[1], lost={1: 3}, detected_at=6.0, from_epoch=1)
    older = event(ranks=[1], lost={1: 1}, detected_at=6.0, from_epoch=0)
    assert causes([elsewhere], [kill]) == [None]
    assert causes([older], [kill]) == [None]
    assert causes([replace(elsewhere, lost={1: 1})], [kill]) == [kill]
