"""Ring placement of buddies."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from peerckpt.recovery.placement import RingPlacement, effective_replicas


def test_two_nodes_mirror_each_other() -> None:
    placement = RingPlacement().buddies({0: 0, 1: 0, 2: 1, 3: 1}, replicas=1)
    assert placement == {0: [1], 1: [1], 2: [0], 3: [0]}


def test_a_single_node_job_has_no_buddies() -> None:
    assert RingPlacement().buddies({0: 0, 1: 0}, replicas=2) == {0: [], 1: []}


@given(
    st.dictionaries(st.integers(0, 63), st.integers(0, 9), min_size=1, max_size=64),
    st.integers(0, 4),
)
def test_buddies_are_distinct_other_nodes_as_many_as_exist(rank_nodes, replicas) -> None:
    placement = RingPlacement().buddies(rank_nodes, replicas)
    k = effective_replicas(rank_nodes, replicas)
    nodes = set(rank_nodes.values())
    for rank, buddies in placement.items():
        assert len(buddies) == len(set(buddies)) == k
        assert rank_nodes[rank] not in buddies
        assert set(buddies) <= nodes
