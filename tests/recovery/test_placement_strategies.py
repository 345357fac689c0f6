"""Ring, group and mixed placement, rack awareness, and the exact survival counts."""

from __future__ import annotations

import logging
from collections import Counter
from fractions import Fraction
from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.recovery.placement import (
    STRATEGY_NAMES,
    GroupPlacement,
    MixedPlacement,
    RingPlacement,
    effective_replicas,
    placement_by_name,
)
from peerckpt.recovery.survival import (
    copy_sets,
    count_by_enumeration,
    memory_cost,
    plan,
    recoverable_sets,
    ring_safe_sets,
    survival_probability,
)

rank_layouts = st.dictionaries(st.integers(0, 63), st.integers(0, 11), min_size=1, max_size=64)


def _one_rank_per_node(nodes: int) -> dict[int, int]:
    return {node: node for node in range(nodes)}


def test_placement_by_name_returns_each_strategy() -> None:
    assert isinstance(placement_by_name("ring"), RingPlacement)
    assert isinstance(placement_by_name("group"), GroupPlacement)
    assert isinstance(placement_by_name("mixed", {0: "a"}), MixedPlacement)


def test_placement_by_name_rejects_an_unknown_name_and_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'star'.*ring, group, mixed"):
        placement_by_name("star")


def test_group_and_mixed_layouts_of_eight_nodes_with_two_replicas() -> None:
    """n = 8, k = 2: groups {0,1,2}, {3,4,5} and a tail {6, 7} (r = 2)."""
    nodes = _one_rank_per_node(8)
    assert GroupPlacement().buddies(nodes, 2) == {
        0: [1, 2], 1: [2, 0], 2: [0, 1], 3: [4, 5], 4: [5, 3], 5: [3, 4],
        6: [4, 5], 7: [3, 5],
    }  # fmt: skip
    # GEMINI's mixed: the last group and the tail, {3..7}, form a ring of their own.
    assert MixedPlacement().buddies(nodes, 2) == {
        0: [1, 2], 1: [2, 0], 2: [0, 1], 3: [4, 5], 4: [5, 6], 5: [6, 7],
        6: [7, 3], 7: [3, 4],
    }  # fmt: skip


@pytest.mark.parametrize("nodes", [3, 6, 9, 12])
def test_mixed_is_group_when_the_nodes_divide_into_groups(nodes: int) -> None:
    layout = _one_rank_per_node(nodes)
    assert MixedPlacement().buddies(layout, 2) == GroupPlacement().buddies(layout, 2)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@given(rank_nodes=rank_layouts, replicas=st.integers(0, 5))
def test_buddies_are_k_distinct_other_nodes_shared_by_a_node(
    name: str, rank_nodes: dict[int, int], replicas: int
) -> None:
    placement = placement_by_name(name).buddies(rank_nodes, replicas)
    k = effective_replicas(rank_nodes, replicas)
    nodes = set(rank_nodes.values())
    assert placement.keys() == rank_nodes.keys()
    by_node: dict[int, list[int]] = {}
    for rank, buddies in placement.items():
        assert len(buddies) == len(set(buddies)) == k
        assert rank_nodes[rank] not in buddies
        assert set(buddies) <= nodes
        assert by_node.setdefault(rank_nodes[rank], buddies) == buddies


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@settings(max_examples=200)
@given(
    nodes=st.integers(1, 24),
    racks=st.lists(st.sampled_from("abcdef"), min_size=24, max_size=24),
    replicas=st.integers(0, 4),
)
def test_copies_land_in_distinct_racks_when_there_are_enough(
    name: str, nodes: int, racks: list[str], replicas: int
) -> None:
    node_racks = dict(enumerate(racks[:nodes]))
    rank_nodes = _one_rank_per_node(nodes)
    placement = placement_by_name(name, node_racks).buddies(rank_nodes, replicas)
    k = effective_replicas(rank_nodes, replicas)
    enough = len(set(node_racks.values())) >= k + 1
    for node, buddies in placement.items():
        assert len(buddies) == len(set(buddies)) == k and node not in buddies
        copy_racks = {node_racks[n] for n in [node, *buddies]}
        if enough:
            assert len(copy_racks) == k + 1


def test_too_few_racks_falls_back_to_distinct_nodes_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node_racks = {n: "ab"[n % 2] for n in range(6)}
    with caplog.at_level(logging.WARNING, logger="peerckpt.placement"):
        placement = RingPlacement(node_racks).buddies(_one_rank_per_node(6), 2)
    assert "only 2 rack(s)" in caplog.text
    assert all(len(set(b)) == 2 and n not in b for n, b in placement.items())


def test_a_node_without_a_rack_counts_as_its_own_rack(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="peerckpt.placement"):
        placement = GroupPlacement({0: "a", 1: "a"}).buddies({0: 0, 1: 1, 2: 2}, 1)
    assert "node(s) [2]" in caplog.text
    assert placement[0] == [2] and placement[1] == [2]


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.parametrize(("nodes", "racks"), [(12, 3), (12, 4), (10, 5), (16, 4)])
def test_balanced_racks_keep_the_strategy_exact(name: str, nodes: int, racks: int) -> None:
    """Equal racks only relabel positions: copies span distinct racks, the odds are unchanged."""
    node_racks = {n: f"rack{n % racks}" for n in range(nodes)}
    rank_nodes = _one_rank_per_node(nodes)
    k = racks - 1
    placement = placement_by_name(name, node_racks).buddies(rank_nodes, k)
    sets = copy_sets(rank_nodes, placement)
    assert all(len({node_racks[n] for n in s}) == k + 1 for s in sets)
    for failures in range(nodes + 1):
        exact = recoverable_sets(name, nodes, k, failures)
        assert count_by_enumeration(sets, list(range(nodes)), failures) == exact


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.parametrize("nodes", range(1, 11))
def test_closed_form_matches_brute_force_over_every_failed_set(name: str, nodes: int) -> None:
    rank_nodes = _one_rank_per_node(nodes)
    for replicas in range(nodes):
        sets = copy_sets(rank_nodes, placement_by_name(name).buddies(rank_nodes, replicas))
        for failures in range(nodes + 1):
            brute = count_by_enumeration(sets, list(range(nodes)), failures)
            assert recoverable_sets(name, nodes, replicas, failures) == brute, (replicas, failures)


def test_several_ranks_per_node_share_copy_sets_and_odds() -> None:
    rank_nodes = {rank: rank // 3 for rank in range(21)}  # 7 nodes, 3 ranks each
    for name in STRATEGY_NAMES:
        sets = copy_sets(rank_nodes, placement_by_name(name).buddies(rank_nodes, 2))
        assert count_by_enumeration(sets, range(7), 3) == recoverable_sets(name, 7, 2, 3)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.parametrize(("nodes", "replicas"), [(1024, 1), (1024, 3), (1000, 2), (999, 7)])
def test_k_plus_one_failures_lose_exactly_the_copy_sets(
    name: str, nodes: int, replicas: int
) -> None:
    """With f = k + 1 a failed set is fatal iff it is a copy set: an independent count."""
    groups, tail = divmod(nodes, replicas + 1)
    copy_set_count = {
        "ring": nodes,
        "group": groups + tail,
        "mixed": groups - 1 + (replicas + 1 + tail) if tail else groups,
    }[name]
    lost = comb(nodes, replicas + 1) - recoverable_sets(name, nodes, replicas, replicas + 1)
    assert lost == copy_set_count


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_large_jobs_are_counted_exactly_and_quickly(name: str) -> None:
    p = survival_probability(name, 1024, 3, 8)
    assert isinstance(p, Fraction) and Fraction(99, 100) < p < 1
    assert survival_probability(name, 1024, 3, 3) == 1  # f <= k never loses a copy set
    assert survival_probability(name, 1024, 3, 1024) == 0


def test_groups_beat_the_ring_and_mixed_sits_between_with_a_tail() -> None:
    ring, group, mixed = (p.probability for p in plan(16, 2, 3))
    assert (ring, group, mixed) == (Fraction(34, 35), Fraction(277, 280), Fraction(69, 70))


def test_no_replicas_survive_no_failure() -> None:
    for name in STRATEGY_NAMES:
        assert survival_probability(name, 5, 0, 0) == 1
        assert survival_probability(name, 5, 0, 1) == 0


def test_ring_safe_sets_counts_cyclic_runs() -> None:
    # 6-cycle, 3 chosen, no 2 adjacent: {0,2,4} and {1,3,5}.
    assert ring_safe_sets(6, 3, 2) == 2
    assert ring_safe_sets(5, 5, 5) == 0


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.parametrize("nodes", [1, 2, 5, 7, 8, 16, 17, 30])
def test_memory_cost_matches_the_replicas_each_node_holds(name: str, nodes: int) -> None:
    rank_nodes = _one_rank_per_node(nodes)
    for replicas in range(min(nodes, 5)):
        placement = placement_by_name(name).buddies(rank_nodes, replicas)
        held = Counter(b for buddies in placement.values() for b in buddies)
        per_node = [1 + held[node] for node in range(nodes)]
        cost = memory_cost(name, nodes, replicas)
        assert (cost.most, cost.least) == (max(per_node), min(per_node))
        assert cost.mean == Fraction(sum(per_node), nodes) == 1 + replicas


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("star", 4, 1, 1), "valid names"),
        (("ring", 0, 0, 0), "at least one node"),
        (("ring", 4, 4, 1), r"replicas must be in \[0, 3\]"),
        (("group", 4, 1, 5), r"must be in \[0, 4\]"),
    ],
)
def test_bad_arguments_name_the_problem(args: tuple[str, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        recoverable_sets(*args)


def test_enumeration_refuses_jobs_too_large_to_enumerate() -> None:
    with pytest.raises(ValueError, match="too many to enumerate"):
        count_by_enumeration([frozenset({0, 1})], range(200), 8)
