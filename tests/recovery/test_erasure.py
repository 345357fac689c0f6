"""The coordinator's side of --erasure: groups, rebuildable ranks, odds, the plan command."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.coding import ErasureSpec, rebuildable
from peerckpt.reads import ERASURE
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.erasure import (
    ErasurePlacement,
    coding_for,
    erasure_plan,
    mark_rebuildable,
    why_unrebuildable,
)
from peerckpt.recovery.placement import RingPlacement
from tests.conftest import REPO


@given(st.integers(1, 4), st.integers(1, 2), st.integers(1, 12), st.integers(1, 3))
def test_groups_span_distinct_nodes_and_cover_every_rank(
    k: int, m: int, nodes: int, per_node: int
) -> None:
    spec = ErasureSpec(k, m)
    rank_nodes = {n * per_node + i: n for n in range(nodes) for i in range(per_node)}
    coding = coding_for(spec, rank_nodes, list(range(nodes)))
    ranks = [r for g in coding.groups for r in g.ranks]
    assert sorted(ranks) == sorted(rank_nodes)
    for group in coding.groups:
        assert len(set(group.nodes)) == group.size  # one member per node
        assert all(rank_nodes[r] == n for r, n in zip(group.ranks, group.nodes, strict=True))
        if nodes >= spec.width:
            assert group.size >= spec.width and group.k == k


def test_groups_follow_the_rack_spread_node_order() -> None:
    racks = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c", 6: "d", 7: "d"}
    placement = ErasurePlacement(ErasureSpec(3, 1), RingPlacement(racks))
    coding = placement.coding({n: n for n in range(8)})
    for group in coding.groups:
        assert len({racks[n] for n in group.nodes}) == 4  # every piece of a stripe: own rack


def _tracker(spec: ErasureSpec, nodes: int) -> CommitTracker:
    rank_nodes = {n: n for n in range(nodes)}
    tracker = CommitTracker(0, frozenset(rank_nodes), committed_step=5)
    tracker.committed_holders = {r: {n} for r, n in rank_nodes.items()}
    tracker.committed_coding = coding_for(spec, rank_nodes, list(range(nodes)))
    return tracker


def test_a_lost_rank_is_held_by_erasure_until_its_group_loses_more_than_m() -> None:
    tracker = _tracker(ErasureSpec(3, 1), 8)
    tracker.forget_node(1)
    assert tracker.committed_holders[1] == {ERASURE} and tracker.unrebuildable == []
    tracker.forget_node(6)  # the other group: both still rebuildable
    assert tracker.committed_holders[6] == {ERASURE}
    tracker.forget_node(2)  # node 1's group loses a second node
    assert tracker.committed_holders[1] == set() and tracker.committed_holders[2] == set()
    assert tracker.unrebuildable == [1, 2]
    assert tracker.committed_holders[6] == {ERASURE}
    why = why_unrebuildable(tracker)
    assert "rank(s) [1, 2] cannot be rebuilt" in why and "lost nodes [1, 2] together" in why
    assert "--erasure 3+2" in why


def test_parity_lost_with_a_node_stays_lost_until_the_next_commit() -> None:
    """Rank 1 rebuilt on node 9 holds its data again, but the committed step's parity that
    node 1 kept is gone: node 2 lost next (before a new commit) leaves rank 2's stripe whose
    parity was on node 1 with 2 of its 3 pieces, and the coordinator says so."""
    tracker = _tracker(ErasureSpec(3, 1), 4)
    tracker.forget_node(1)
    tracker.add_holder(1, 9)
    tracker.forget_node(2)
    assert tracker.committed_holders[1] == {9}
    assert tracker.committed_holders[2] == set() and tracker.unrebuildable == [2]


def _brute_force(nodes: int, spec: ErasureSpec, failures: int) -> int:
    rank_nodes = {n: n for n in range(nodes)}
    coding = coding_for(spec, rank_nodes, list(range(nodes)))
    safe = 0
    for lost in itertools.combinations(range(nodes), failures):
        alive = set(range(nodes)) - set(lost)
        holders = {r: ({r} if r in alive else set()) for r in range(nodes)}
        gone = mark_rebuildable(coding, holders, set(lost))
        safe += not gone
        for group in coding.groups:  # the closed form's ground truth, rank by rank
            for r in group.ranks:
                if r in lost and group.k:
                    assert rebuildable(group, r, alive, alive) == (ERASURE in holders[r])
    return safe


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 11), st.data())
def test_the_plan_counts_equal_brute_force(k: int, m: int, nodes: int, data: st.DataObject) -> None:
    spec = ErasureSpec(k, m)
    failures = data.draw(st.integers(0, nodes))
    plan = erasure_plan(nodes, spec, failures)
    assert plan.recoverable_sets == _brute_force(nodes, spec, failures)
    if nodes >= spec.width and failures <= m:
        assert plan.probability == 1


def test_the_plan_memory_is_one_copy_plus_m_over_k() -> None:
    plan = erasure_plan(8, ErasureSpec(3, 1), 2)
    assert plan.memory_most == Fraction(4, 3) and plan.groups == (4, 4)
    assert plan.recoverable_sets == 28 - 2 * 6  # fatal: both failed nodes in one group


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peerckpt.launch", "plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_peerckpt_plan_answers_for_an_erasure_layout() -> None:
    out = _plan("--nodes", "8", "--erasure", "3+1", "--failures", "2", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["probability"] == "4/7" and got["groups"] == [4, 4]
    assert got["memory_per_node_most"] == "4/3"
    text = _plan("--nodes", "10", "--erasure", "3+2", "--failures", "2")
    assert "recoverable sets 45/45" in text.stdout and "5/3·S" in text.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "3", "--erasure", "3+1", "--failures", "1"], "give --nodes 4 or more"),
        (["--nodes", "5", "--failures", "1"], "give --replicas k (buddy copies) or --erasure"),
        (["--nodes", "5", "--erasure", "3", "--failures", "1"], "give K+M"),
        (["--nodes", "5", "--erasure", "3+1", "--replicas", "1", "--failures", "1"], "choose one"),
    ],
)
def test_peerckpt_plan_refuses_what_has_no_answer(args: list[str], message: str) -> None:
    out = _plan(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_the_scripts_erasure_applies_unless_the_launcher_chose() -> None:
    from peerckpt.recovery.erasure import script_erasure
    from peerckpt.recovery.job import Settings

    def settings(replicas: int | None) -> Settings:
        return Settings("j", 4, replicas, 5.0, "h:1", None, RingPlacement())

    chosen = settings(None)
    script_erasure(chosen, "3+1")
    assert isinstance(chosen.placement, ErasurePlacement) and chosen.placement.spec.m == 1
    given = settings(2)  # the launcher's --replicas 2 wins
    script_erasure(given, "3+1")
    assert isinstance(given.placement, RingPlacement)
    bad = settings(None)
    script_erasure(bad, "three")  # logged and ignored: replicas as before
    assert isinstance(bad.placement, RingPlacement)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"erasure": "3"}, "erasure='3': give K"),
        ({"erasure": "3+1", "replicas": 1}, "choose one"),
    ],
)
def test_resilient_refuses_a_bad_erasure(kwargs: dict[str, object], message: str) -> None:
    from peerckpt.errors import ConfigurationError
    from peerckpt.runtime.config import ResilientConfig

    with pytest.raises(ConfigurationError, match=message):
        ResilientConfig(**kwargs)  # type: ignore[arg-type]
    assert ResilientConfig(erasure="4+2").erasure == "4+2"
