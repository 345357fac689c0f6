"""Parsing chaos specs."""

from __future__ import annotations

import re

import pytest

from peerckpt.chaos.spec import ChaosAction, check_targets, parse_chaos
from peerckpt.errors import ConfigurationError


def test_rank_and_node_kills_parse_in_order() -> None:
    actions = parse_chaos("kill rank=2 at=30; kill node=1 at=60;")
    assert actions == [
        ChaosAction("kill_rank", 2, 30, "kill rank=2 at=30"),
        ChaosAction("kill_node", 1, 60, "kill node=1 at=60"),
    ]


def test_corrupt_names_a_rank() -> None:
    [action] = parse_chaos("corrupt rank=3 at=7")
    assert (action.kind, action.target, action.at) == ("corrupt_rank", 3, 7)
    with pytest.raises(ConfigurationError, match="corrupt rank=R at=S"):
        parse_chaos("corrupt node=1 at=7")


def test_a_kill_can_wait_seconds_after_its_step() -> None:
    [action] = parse_chaos("kill node=0 at=12 after=2.5")
    assert (action.kind, action.target, action.at, action.after) == ("kill_node", 0, 12, 2.5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode rank=1 at=2", "unknown action"),
        ("kill rank=1", "exactly one of rank= or node=, and at="),
        ("kill rank=1 node=2 at=3", "exactly one of"),
        ("kill rank=x at=3", "rank must be an integer"),
        ("kill rank=1 at=3 at=4", "bad field 'at=4'"),
        ("kill rank=-1 at=3", "must be ≥ 0"),
        ("kill rank=1 at=3 after=soon", "after must be a number of seconds"),
    ],
)
def test_bad_clauses_are_named_with_the_grammar(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_chaos(spec)


def test_every_fault_of_the_campaign_parses() -> None:
    actions = parse_chaos(
        "hang rank=1 at=3 for=4.5; kill agent node=2 at=4; kill coordinator at=5 after=1; "
        "partition node=@0 at=6 for=2; slow node=1 at=7 rate=2.5; "
        "kill rank=0 at=8 during=snapshot; kill node=@2 at=9 during=replication"
    )
    got = [(a.kind, a.target, a.at, a.duration, a.rate, a.during, a.of_rank) for a in actions]
    assert got == [
        ("hang_rank", 1, 3, 4.5, 0.0, None, None),
        ("kill_agent", 2, 4, 0.0, 0.0, None, None),
        ("kill_coordinator", -1, 5, 0.0, 0.0, None, None),
        ("partition_node", 0, 6, 2.0, 0.0, None, 0),
        ("slow_node", 1, 7, 0.0, 2.5, None, None),
        ("kill_rank", 0, 8, 0.0, 0.0, "snapshot", None),
        ("kill_node", 2, 9, 0.0, 0.0, "replication", 2),
    ]
    assert actions[2].after == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hang rank=1 at=3", "for= missing; use 'hang rank=R at=S for=T"),
        ("partition node=1 at=3", "for= missing"),
        ("slow node=1 at=3", "rate= missing"),
        ("slow node=1 at=3 rate=0", "rate must be > 0"),
        ("kill rank=1 at=3 during=lunch", "during must be one of snapshot, replication, recovery"),
        ("hang rank=1 at=3 for=2 during=snapshot", "during= does not apply here"),
        ("partition rank=1 at=3 for=2", "rank= does not apply here"),
        ("kill coordinator node=1 at=3", "node= does not apply here"),
        ("kill node=@x at=3", "node=@R needs a rank number"),
    ],
)
def test_bad_fault_clauses_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        parse_chaos(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "kill rank=9 at=5",
            "rank 9 does not exist; the job has ranks 0…3 (2 node(s) × 2 rank(s))",
        ),
        ("hang rank=4 at=5 for=1", "rank 4 does not exist"),
        ("corrupt rank=4 at=5", "rank 4 does not exist"),
        ("kill node=@4 at=5", "rank 4 does not exist"),
        ("kill node=3 at=5", "node 3 does not exist; the job has nodes 0…2"),
        ("partition node=7 at=5 for=1", "node 7 does not exist"),
        # an added node's ranks exist only once it was added
        ("kill rank=4 at=5; add node at=9", "rank 4 does not exist"),
    ],
)
def test_a_target_the_job_does_not_have_is_refused(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        check_targets(parse_chaos(spec), nodes=2, nproc_per_node=2, spare_nodes=1)


def test_targets_that_exist_are_accepted_added_nodes_included() -> None:
    check_targets(
        parse_chaos(
            "kill rank=3 at=2; kill node=2 at=3; add node at=4; kill rank=5 at=6; "
            "kill node=3 at=7; kill agent node=@5 at=8"
        ),
        nodes=2,
        nproc_per_node=2,
        spare_nodes=1,
    )
