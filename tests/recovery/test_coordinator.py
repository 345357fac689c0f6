"""The coordinator's decisions, driven directly (no processes), and its authenticated RPC."""

from __future__ import annotations

import pytest

from peerckpt.errors import AuthenticationError
from peerckpt.manifest import ChunkRecord
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.recovery.placement import placement_by_name
from peerckpt.rpc import RpcClient, RpcServer


def _job(spares: int = 1, started: int | None = None) -> Coordinator:
    """A 2 x 2 job whose launcher started ``started`` spares (default: all joined)."""
    c = Coordinator(
        "j",
        world_size=4,
        replicas=1,
        store_addr="127.0.0.1:1",
        spares=spares if started is None else started,
    )
    for node in (0, 1):
        c.register_agent({"node": node, "data_addr": f"127.0.0.1:{1000 + node}"})
    c.register_agent({"node": 2, "data_addr": "127.0.0.1:1002", "spare_node": True})
    for rank in range(4):
        c.proc_joined({"node": rank // 2, "pid": 100 + rank, "role": "rank", "rank": rank})
    for i in range(spares):
        c.proc_joined({"node": 2, "pid": 200 + i, "role": "spare"})
    return c


def _events(c: Coordinator, node: int) -> list[dict]:
    q = c.agents[node].events
    out = []
    while not q.empty():
        out.append(q.get())
    return out


LAYOUT = [ChunkRecord("w", "float32", (4,), (0,), (4,), 0, 16).to_msg()]


def _commit(c: Coordinator, epoch: int, step: int) -> None:
    for rank in range(4):
        c.replicated(
            {
                "epoch": epoch,
                "rank": rank,
                "step": step,
                "nbytes": 10,
                "holders": [rank // 2, 1 - rank // 2],
                "layout": LAYOUT,
            }
        )


def test_epoch_zero_opens_when_every_rank_joined_and_commits_follow() -> None:
    c = _job()
    first = _events(c, 0)
    assert [e["type"] for e in first] == ["membership"]
    assert first[0]["epoch"] == 0 and first[0]["restore_step"] is None
    assert first[0]["placement"] == {0: [1], 1: [1], 2: [0], 3: [0]}
    _commit(c, 0, 0)
    assert _events(c, 1)[-1] == {"type": "commit", "epoch": 0, "step": 0}


def test_a_lost_rank_is_replaced_by_a_spare_and_restores_the_committed_step() -> None:
    c = _job()
    _commit(c, 0, 4)
    c.replicated(
        {"epoch": 0, "rank": 0, "step": 5, "nbytes": 10, "holders": [0, 1], "layout": LAYOUT}
    )
    _events(c, 0)
    c.proc_lost({"node": 1, "pid": 102, "reason": "exited"})
    m = _events(c, 0)[-1]
    assert m["type"] == "membership" and m["epoch"] == 1
    assert m["restore_step"] == 4  # step 5 was not committed by every rank
    assert m["ranks"][2] == [2, 200]  # the spare on the spare node
    assert m["sources"][2] == [0, 1]  # its buddy first, the node it was lost on last
    assert m["sources"][0] == [0, 1]  # a survivor reads its own node's slot
    assert c.events[-1]["kind"] == "rank" and c.events[-1]["replacements"] == {2: [2, 200]}


def test_a_lost_node_takes_its_ranks_and_needs_as_many_spares() -> None:
    c = _job(spares=2)
    _commit(c, 0, 1)
    c._lose_node(1, "test")
    m = _events(c, 0)[-1]
    assert m["ranks"][2][0] == 2 and m["ranks"][3][0] == 2
    assert m["sources"][2] == [0] and m["sources"][3] == [0]  # node 1's copies are gone


def test_without_a_spare_the_job_fails_with_a_reason() -> None:
    c = _job(spares=0)
    _commit(c, 0, 1)
    c.proc_lost({"node": 0, "pid": 100, "reason": "exited"})
    assert c.state == "failed"
    assert "only 0 spare(s)" in c.reason and "--spares" in c.reason and "--min-nodes" in c.reason
    assert _events(c, 1)[-1]["type"] == "shutdown"


def test_a_loss_waits_for_spares_still_starting_then_recovers_them_together() -> None:
    # Two spares were started; one has joined. Rank 1 dies, then rank 3: the first recovery
    # takes the joined spare, the second waits for the one still warming up (seen on a fast
    # machine: the job had failed with "only 0 spare(s) are left").
    c = _job(spares=1, started=2)
    _commit(c, 0, 7)
    _events(c, 0)
    c.proc_lost({"node": 0, "pid": 101, "reason": "exited"})
    assert _events(c, 0)[-1]["epoch"] == 1
    c.proc_lost({"node": 1, "pid": 103, "reason": "exited"})
    assert c.state == "running" and _events(c, 0) == []  # waiting, not failed
    c.proc_joined({"node": 2, "pid": 201, "role": "spare"})
    m = _events(c, 0)[-1]
    assert m["epoch"] == 2 and m["ranks"][3] == [2, 201] and m["ranks"][1] == [2, 200]
    assert c.events[-1]["ranks"] == [3] and c.events[-1]["waited_for_spares_s"] >= 0


def test_a_spare_that_never_joins_ends_the_wait_with_a_clear_reason() -> None:
    c = _job(spares=0, started=1)
    _commit(c, 0, 2)
    c.proc_lost({"node": 0, "pid": 100, "reason": "exited"})
    c.proc_lost({"node": 1, "pid": 102, "reason": "exited"})  # joins the waiting recovery
    assert c.state == "running"
    assert c._deferred is not None and c._deferred.ranks == {0, 2}
    c._deferred.deadline -= 120.0  # the wait has run out
    c.check_heartbeats()
    assert c.state == "failed"
    assert "lost rank(s) [0, 2]" in c.reason and "1 more never joined" in c.reason


def test_the_job_succeeds_when_every_rank_of_the_epoch_is_done() -> None:
    c = _job()
    for rank in range(3):
        c.rank_done({"epoch": 0, "rank": rank})
    assert c.state == "running"
    c.rank_done({"epoch": 1, "rank": 3})  # a stale epoch's report does not count
    assert c.state == "running"
    c.rank_done({"epoch": 0, "rank": 3})
    assert c.state == "succeeded"


def test_rpc_with_the_wrong_secret_is_refused() -> None:
    c = _job()
    unary, streams = c.handlers()
    server = RpcServer(b"right" * 8, "j", unary, streams)
    server.start()
    try:
        good = RpcClient(server.address, b"right" * 8, "j")
        assert good.call("Status")["state"] == "running"
        bad = RpcClient(server.address, b"wrong" * 8, "j")
        with pytest.raises(AuthenticationError, match="wrong job secret"):
            bad.call("Status")
        good.close(), bad.close()
    finally:
        server.stop()


def test_a_node_whose_heartbeats_stop_is_declared_lost() -> None:
    c = _job(spares=2)
    _commit(c, 0, 3)
    c.heartbeat_timeout = 1.0
    for node in (0, 2):
        c.heartbeat({"node": node, "epoch": 0})
    c.agents[1].last_heartbeat -= 5.0  # node 1 has been silent for 5 s
    c.check_heartbeats()
    assert not c.agents[1].alive and c.agents[0].alive
    event = c.events[-1]
    assert event["kind"] == "node" and event["nodes"] == [1]
    assert "no heartbeat for" in event["reason"]
    assert _events(c, 0)[-1]["restore_step"] == 3


@pytest.mark.parametrize(
    ("name", "expected"),
    [("ring", {0: [1], 1: [2], 2: [3], 3: [0]}), ("group", {0: [1], 1: [0], 2: [3], 3: [2]})],
)
def test_the_coordinator_places_buddies_with_the_strategy_it_was_given(name, expected) -> None:
    c = Coordinator(
        "j", world_size=4, replicas=1, store_addr="127.0.0.1:1", placement=placement_by_name(name)
    )
    for node in range(4):
        c.register_agent({"node": node, "data_addr": f"127.0.0.1:{1000 + node}"})
        c.proc_joined({"node": node, "pid": 100 + node, "role": "rank", "rank": node})
    assert _events(c, 0)[-1]["placement"] == expected
