"""The pure decisions of ``peerckpt run --ray``: the order of hosts, where each fault goes."""

from __future__ import annotations

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.launch.rayplan import host_order, split_chaos


def test_node_faults_go_to_the_driver_and_rank_faults_to_their_host() -> None:
    driver, hosts = split_chaos(
        "kill rank=3 at=5; kill node=1 at=9; add node at=12; kill agent node=2 at=14; "
        "kill coordinator at=16; hang rank=4 at=18 for=1",
        nproc_per_node=2,
    )
    assert driver == "kill node=1 at=9; add node at=12"
    assert hosts == {
        1: "kill rank=3 at=5",
        2: "kill agent node=2 at=14; hang rank=4 at=18 for=1",
        0: "kill coordinator at=16",
    }


def test_a_rank_struck_twice_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="each rank can be struck once"):
        split_chaos("kill rank=2 at=5; kill rank=2 at=9", nproc_per_node=2)


def test_a_whole_node_cannot_be_struck_during_a_phase() -> None:
    with pytest.raises(ConfigurationError, match="during=PHASE"):
        split_chaos("kill node=1 at=5 during=snapshot", nproc_per_node=2)


def test_a_bad_spec_fails_before_anything_starts() -> None:
    with pytest.raises(ConfigurationError):
        split_chaos("explode rank=1 at=3", nproc_per_node=2)


def test_hosts_are_given_out_head_first_then_by_address_and_only_to_alive_nodes() -> None:
    def node(addr: str, head: bool = False, alive: bool = True) -> dict[str, object]:
        resources = {"CPU": 1.0, **({"node:__internal_head__": 1.0} if head else {})}
        return {
            "NodeID": f"id-{addr}",
            "NodeManagerAddress": addr,
            "Alive": alive,
            "Resources": resources,
        }

    nodes = [
        node("10.0.0.9"),
        node("10.0.0.7", alive=False),
        node("10.0.0.5", head=True),
        node("10.0.0.3"),
    ]
    assert [n["NodeManagerAddress"] for n in host_order(nodes)] == [
        "10.0.0.5",
        "10.0.0.3",
        "10.0.0.9",
    ]
