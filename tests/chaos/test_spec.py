"""Parsing chaos specs."""

from __future__ import annotations

import pytest

from peerckpt.chaos.spec import ChaosAction, parse_chaos
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
