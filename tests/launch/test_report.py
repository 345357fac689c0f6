"""Attributing failures to the chaos actions that caused them."""

from __future__ import annotations

from peerckpt.launch.report import failure_rows, format_failures

EVENTS = [
    {
        "kind": "node",
        "ranks": [2, 3],
        "nodes": [1],
        "reason": "agent gone",
        "lost": {2: 1, 3: 1},
        "detected_at": 10.02,
        "resumed_at": 10.10,
        "restore_step": 7,
        "pulls": [{"rank": 2, "node": 2, "source": 0, "bytes": 1000, "seconds": 0.01}],
    },
    {
        "kind": "rank",
        "ranks": [0],
        "nodes": [],
        "reason": "process 9 exited",
        "lost": {0: 0},
        "detected_at": 20.0,
        "resumed_at": 20.5,
        "restore_step": 15,
        "pulls": [],
    },
]
CHAOS = [
    {"action": "kill rank=1 at=3", "kind": "kill_rank", "target": 1, "fired_at": 5.0},
    {"action": "kill node=1 at=8", "kind": "kill_node", "target": 1, "fired_at": 10.0},
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
