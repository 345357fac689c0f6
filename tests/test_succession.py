"""The order in which a job's coordinator moves between hosts (peerckpt/succession.py)."""

from __future__ import annotations

from peerckpt.succession import succession, takeover_after


def test_the_succession_is_the_current_endpoint_then_each_other_host_by_node_index() -> None:
    nodes = {2: "127.0.0.4:900", 0: "127.0.0.2:700", 1: "127.0.0.3:800", 3: "127.0.0.3:801"}
    assert succession("127.0.0.2:5000", nodes) == [
        "127.0.0.2:5000",
        "127.0.0.3:5000",  # node 1's host (and node 3's: once)
        "127.0.0.4:5000",
    ]


def test_after_a_move_the_new_host_leads_and_the_old_one_is_a_successor_again() -> None:
    nodes = {1: "127.0.0.3:800", 2: "127.0.0.4:900"}
    assert succession("127.0.0.3:5000", nodes) == ["127.0.0.3:5000", "127.0.0.4:5000"]


def test_one_machine_jobs_have_no_successor_and_ipv6_hosts_keep_their_brackets() -> None:
    assert succession("127.0.0.1:5000", {0: "127.0.0.1:1", 1: "127.0.0.1:2"}) == ["127.0.0.1:5000"]
    assert succession("[fd00::1]:5000", {0: "[fd00::1]:1", 1: "[fd00::2]:2"}) == [
        "[fd00::1]:5000",
        "[fd00::2]:5000",
    ]


def test_later_successors_wait_longer() -> None:
    assert 0 < takeover_after(1) < takeover_after(2) < takeover_after(3)
