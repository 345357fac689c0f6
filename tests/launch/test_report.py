"""Attributing failures to the chaos actions that caused them."""

from __future__ import annotations

from dataclasses import replace

from peerckpt.chaos import ActionKind, FiredAction
from peerckpt.launch.report import failure_rows, format_failures
from peerckpt.messages.control import Pull, RecoveryEvent
from peerckpt.states import RecoveryKind
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
