"""The coordinator's decisions, driven directly (no processes), and its authenticated RPC."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from peerckpt.errors import AuthenticationError, StaleEpoch
from peerckpt.manifest import ChunkRecord
from peerckpt.messages.control import (
    Commit,
    Done,
    EpochOpened,
    Heartbeat,
    HeldCopy,
    ProcJoined,
    ProcLost,
    ProcReport,
    RankFailed,
    RegisterAgent,
    RejoinState,
    Replicated,
    ReplicatedMany,
    Resumed,
    Shutdown,
    SparesStarting,
    Status,
)
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.recovery.placement import placement_by_name
from peerckpt.rpc import RpcClient, RpcServer
from peerckpt.states import EpochMode, JobState, ProcRole, RecoveryKind


def _rank(node: int, pid: int, rank: int) -> ProcJoined:
    return ProcJoined(node, ProcReport(pid, ProcRole.RANK, rank))


def _spare(node: int, pid: int) -> ProcJoined:
    return ProcJoined(node, ProcReport(pid, ProcRole.SPARE, None))


def _job(spares: int = 1, started: int | None = None, max_restarts: int = 0) -> Coordinator:
    """A 2 x 2 job whose launcher started ``started`` spares (default: all joined)."""
    c = Coordinator(
        "j",
        world_size=4,
        replicas=1,
        store_addr="127.0.0.1:1",
        spares=spares if started is None else started,
        max_restarts=max_restarts,
    )
    for node in (0, 1):
        c.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}"))
    c.register_agent(RegisterAgent(2, "127.0.0.1:1002", spare_node=True))
    for rank in range(4):
        c.proc_joined(_rank(rank // 2, 100 + rank, rank))
    for i in range(spares):
        c.proc_joined(_spare(2, 200 + i))
    return c


def _events(c: Coordinator, node: int) -> list:
    q = c.registry.agents[node].events
    out = []
    while not q.empty():
        out.append(q.get())
    return out


LAYOUT = [ChunkRecord("w", "float32", (4,), (0,), (4,), 0, 16).to_msg()]


def _commit(c: Coordinator, epoch: int, step: int) -> None:
    for rank in range(4):
        c.replicated(_replicated(epoch, rank, step, [rank // 2, 1 - rank // 2]))


def _replicated(epoch: int, rank: int, step: int, holders: list[int]) -> Replicated:
    return Replicated(rank // 2, epoch, rank, step, holders, 10, 4, layout=LAYOUT)


def test_epoch_zero_opens_when_every_rank_joined_and_commits_follow() -> None:
    c = _job()
    [first] = _events(c, 0)
    assert isinstance(first, EpochOpened)
    m = first.membership
    assert m.epoch == 0 and m.restore_step is None and m.mode is EpochMode.FRESH
    assert m.placement == {0: [1], 1: [1], 2: [0], 3: [0]}
    _commit(c, 0, 0)
    assert _events(c, 1)[-1] == Commit(0, 0, largest_snapshot=10)  # the ranks reported 10 bytes


def test_a_lost_rank_is_replaced_by_a_spare_and_restores_the_committed_step() -> None:
    c = _job()
    _commit(c, 0, 4)
    c.replicated(_replicated(0, 0, 5, [0, 1]))
    _events(c, 0)
    c.proc_lost(ProcLost(1, 102, "exited"))
    m = _events(c, 0)[-1].membership
    assert m.epoch == 1 and m.mode is EpochMode.SAME
    assert m.restore_step == 4  # step 5 was not committed by every rank
    assert (m.ranks[2].node, m.ranks[2].pid) == (2, 200)  # the spare on the spare node
    assert m.sources[2] == [0, 1]  # its buddy first, the node it was lost on last
    assert m.sources[0] == [0, 1]  # a survivor reads its own node's slot
    event = c.epochs.events[-1]
    assert (
        event.kind is RecoveryKind.RANK and event.replacements == {2: [2, 200]} and event.epoch == 1
    )
    assert c.registry.procs[(2, 200)].role is ProcRole.RANK


def test_a_lost_node_takes_its_ranks_and_needs_as_many_spares() -> None:
    c = _job(spares=2)
    _commit(c, 0, 1)
    c.lose_node(1, "test")
    m = _events(c, 0)[-1].membership
    assert m.ranks[2].node == 2 and m.ranks[3].node == 2
    assert m.sources[2] == [0] and m.sources[3] == [0]  # node 1's copies are gone


def test_a_recovery_failing_on_a_node_not_yet_declared_lost_waits_for_that_loss() -> None:
    """Nodes 0 and 1 die together; node 0's loss is declared first, and its ranks' spares
    read from node 1, whose closed connections fail them. The job must fail because every
    copy is gone (what node 1's loss then shows), not with a connection error."""
    c = _job(spares=4)
    _commit(c, 0, 3)
    c.lose_node(0, "test")
    assert c.epochs.membership.epoch == 1 and c.life.state is JobState.RUNNING
    c.rank_failed(
        RankFailed(2, 1, 0, "RecoveryFailed", "node 1: connection closed by peer", unreachable=True)
    )
    c.check_heartbeats()
    assert c.life.state is JobState.RUNNING and len(c.clocks.held) == 1
    c.lose_node(1, "test")
    assert c.life.state is JobState.FAILED
    assert "no surviving copy of the committed snapshot of rank(s) [0, 1" in c.life.reason
    c.check_heartbeats()
    assert c.clocks.held == []


def test_a_recovery_failing_while_every_source_looks_alive_fails_the_job_after_the_hold() -> None:
    c = _job(spares=2)
    _commit(c, 0, 3)
    c.lose_node(1, "test")
    c.rank_failed(RankFailed(2, 1, 2, "RecoveryFailed", "node 0: no answer", unreachable=True))
    assert c.life.state is JobState.RUNNING
    for node in (0, 2):
        c.heartbeat(Heartbeat(node, 1))
    [held] = c.clocks.held
    c.clocks.held = [replace(held, deadline=time.monotonic() - 0.1)]  # the hold is over
    c.check_heartbeats()
    assert c.life.state is JobState.FAILED
    assert c.life.reason == "rank 2 raised: RecoveryFailed: node 0: no answer"


def test_a_recovery_whose_every_source_answered_with_a_bad_copy_fails_the_job_at_once() -> None:
    c = _job(spares=2)
    _commit(c, 0, 3)
    c.lose_node(1, "test")
    c.rank_failed(RankFailed(2, 1, 2, "RecoveryFailed", "node 0: checksum mismatch"))
    assert c.life.state is JobState.FAILED and c.clocks.held == []


def test_without_a_spare_the_job_fails_with_a_reason() -> None:
    c = _job(spares=0)
    _commit(c, 0, 1)
    c.proc_lost(ProcLost(0, 100, "exited"))
    assert c.life.state is JobState.FAILED
    reason = c.life.reason
    assert "only 0 spare(s)" in reason and "--spares" in reason and "--min-nodes" in reason
    assert _events(c, 1)[-1] == Shutdown(JobState.FAILED, reason)


def test_a_loss_waits_for_spares_still_starting_then_recovers_them_together() -> None:
    # Two spares were started; one has joined. Rank 1 dies, then rank 3: the first recovery
    # takes the joined spare, the second waits for the one still warming up (seen on a fast
    # machine: the job had failed with "only 0 spare(s) are left").
    c = _job(spares=1, started=2)
    _commit(c, 0, 7)
    _events(c, 0)
    c.proc_lost(ProcLost(0, 101, "exited"))
    assert _events(c, 0)[-1].membership.epoch == 1
    c.proc_lost(ProcLost(1, 103, "exited"))
    assert c.life.state is JobState.RUNNING and _events(c, 0) == []  # waiting, not failed
    c.proc_joined(_spare(2, 201))
    m = _events(c, 0)[-1].membership
    assert m.epoch == 2 and m.ranks[3].pid == 201 and m.ranks[1].pid == 200
    event = c.epochs.events[-1]
    assert event.ranks == [3] and event.waited_for_spares_s is not None


def test_a_rank_lost_on_a_live_node_waits_for_its_restart_in_place_and_takes_it() -> None:
    c = _job(spares=0, max_restarts=3)
    _commit(c, 0, 5)
    _events(c, 0)
    c.proc_lost(ProcLost(0, 101, "exited"))
    # Ordered before any launcher could act: counted as a spare starting, so the job waits.
    assert c.life.state is JobState.RUNNING and _events(c, 0) == []
    assert c.status(Status()).in_place == {1: [0, 101]} and c.spares.starting == 1
    c.proc_joined(_spare(0, 500))  # the launcher's fresh process on node 0
    m = _events(c, 0)[-1].membership
    assert m.epoch == 1 and m.mode is EpochMode.SAME and m.restore_step == 5
    assert (m.ranks[1].node, m.ranks[1].pid) == (0, 500) and m.sources[1][0] == 0
    event = c.epochs.events[-1]
    assert event.ranks == [1] and event.in_place == {1: 1} and event.replacements == {1: [0, 500]}
    assert c.status(Status()).in_place == {} and c.spares.starting == 0


def test_restarts_in_place_are_counted_per_rank_over_the_job_then_the_job_fails() -> None:
    c = _job(spares=0, max_restarts=2)
    _commit(c, 0, 3)
    pid = 101
    for epoch, new in ((1, 500), (2, 501)):
        c.proc_lost(ProcLost(0, pid, "exited"))
        c.proc_joined(_spare(0, new))
        assert c.epochs.membership.epoch == epoch and c.epochs.events[-1].in_place == {1: epoch}
        _commit(c, epoch, 3 + epoch)
        pid = new
    c.proc_lost(ProcLost(1, 103, "exited"))  # another rank: a count of its own
    c.proc_joined(_spare(1, 502))
    assert c.epochs.membership.epoch == 3 and c.epochs.events[-1].in_place == {3: 1}
    c.proc_lost(ProcLost(0, pid, "exited"))  # rank 1's third loss: none left
    assert c.life.state is JobState.FAILED
    assert "rank(s) [1] were restarted in place 2 time(s) already" in c.life.reason
    assert "--max-restarts 2" in c.life.reason


def test_a_restart_ordered_on_a_node_then_lost_is_not_waited_for() -> None:
    c = _job(spares=0, max_restarts=3)
    _commit(c, 0, 2)
    c.proc_lost(ProcLost(0, 101, "exited"))
    assert c.spares.starting == 1
    c.lose_node(0, "test")  # its memory is gone: no restart there, no spare: fail now
    assert c.life.state is JobState.FAILED and "only 0 spare(s) are left" in c.life.reason
    assert c.spares.starting == 0 and c.status(Status()).in_place == {}


def test_a_rank_on_a_node_that_joined_the_running_job_is_not_restarted_in_place() -> None:
    c = _job(spares=0, max_restarts=3)
    c.register_agent(RegisterAgent(3, "127.0.0.1:1003", joining=1))
    assert c.registry.restartable_nodes() == {0, 1, 2}


def test_a_spare_that_never_joins_ends_the_wait_with_a_clear_reason() -> None:
    c = _job(spares=0, started=1)
    _commit(c, 0, 2)
    c.proc_lost(ProcLost(0, 100, "exited"))
    c.proc_lost(ProcLost(1, 102, "exited"))  # joins the waiting recovery
    assert c.life.state is JobState.RUNNING
    waiting = c.epochs.deferred
    assert waiting is not None and waiting.ranks == {0, 2} and waiting.deadline is not None
    c.epochs.deferred = replace(waiting, deadline=waiting.deadline - 120.0)  # the wait ran out
    c.check_heartbeats()
    assert c.life.state is JobState.FAILED
    assert "lost rank(s) [0, 2]" in c.life.reason and "1 more never joined" in c.life.reason


def test_the_job_succeeds_when_every_rank_of_the_epoch_is_done() -> None:
    c = _job()
    for rank in range(3):
        c.rank_done(Done(rank // 2, 0, rank))
    assert c.life.state is JobState.RUNNING
    c.rank_done(Done(1, 1, 3))  # a stale epoch's report does not count
    assert c.life.state is JobState.RUNNING
    c.rank_done(Done(1, 0, 3))
    assert c.life.state is JobState.SUCCEEDED


def test_rpc_with_the_wrong_secret_is_refused() -> None:
    c = _job()
    unary, streams = c.handlers()
    server = RpcServer(b"right" * 8, "j", unary, streams)
    server.start()
    try:
        good = RpcClient(server.address, b"right" * 8, "j")
        assert good.call(Status()).state is JobState.RUNNING
        bad = RpcClient(server.address, b"wrong" * 8, "j")
        with pytest.raises(AuthenticationError, match="wrong job secret"):
            bad.call(Status())
        good.close(), bad.close()
    finally:
        server.stop()


def test_a_node_whose_heartbeats_stop_is_declared_lost() -> None:
    c = _job(spares=2)
    _commit(c, 0, 3)
    c.settings.heartbeat_timeout = c.clocks.heartbeat_timeout = 1.0
    for node in (0, 2):
        c.heartbeat(Heartbeat(node, 0))
    c.registry.agents[1].last_heartbeat -= 5.0  # node 1 has been silent for 5 s
    c.check_heartbeats()
    assert not c.registry.agents[1].alive and c.registry.agents[0].alive
    event = c.epochs.events[-1]
    assert event.kind is RecoveryKind.NODE and event.nodes == [1]
    assert "no heartbeat for" in event.reason
    assert _events(c, 0)[-1].membership.restore_step == 3


def test_heartbeats_that_arrive_while_the_coordinator_is_busy_still_count() -> None:
    """A cold start reading a slow object store holds the coordinator's lock for seconds: the
    heartbeats that arrive meanwhile must keep their nodes alive (before, they waited for the
    lock, and the liveness check that ran first declared every node lost)."""
    c = _job(spares=1)
    _commit(c, 0, 3)
    c.settings.heartbeat_timeout = c.clocks.heartbeat_timeout = 1.0
    with c._lock:  # the long step
        for agent in c.registry.agents.values():
            agent.last_heartbeat -= 5.0  # every node's last heartbeat is old
        beats = [  # one RPC thread per agent's heartbeat, as the server runs them
            threading.Thread(target=c.heartbeat, args=(Heartbeat(n, 0),)) for n in (0, 1, 2)
        ]
        for beat in beats:
            beat.start()
        time.sleep(0.3)  # the heartbeats arrive while the lock is held
        c.check_heartbeats()  # the next holder of the lock is the liveness check
    for beat in beats:
        beat.join(timeout=10)
    assert all(a.alive for a in c.registry.agents.values())


@pytest.mark.parametrize(
    ("name", "expected"),
    [("ring", {0: [1], 1: [2], 2: [3], 3: [0]}), ("group", {0: [1], 1: [0], 2: [3], 3: [2]})],
)
def test_the_coordinator_places_buddies_with_the_strategy_it_was_given(name, expected) -> None:
    c = Coordinator(
        "j", world_size=4, replicas=1, store_addr="127.0.0.1:1", placement=placement_by_name(name)
    )
    for node in range(4):
        c.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}"))
        c.proc_joined(_rank(node, 100 + node, node))
    assert _events(c, 0)[-1].membership.placement == expected


def test_reports_sent_together_commit_and_a_stale_one_is_refused_after_the_others_count() -> None:
    c = _job()
    _events(c, 0)
    reports = [_replicated(0, rank, 3, [rank // 2, 1 - rank // 2]) for rank in range(4)]
    stale = _replicated(7, 0, 3, [0, 1])
    with pytest.raises(StaleEpoch, match="epoch 7"):
        c.replicated_many(ReplicatedMany(0, [stale, *reports]))
    assert c.epochs.tracker is not None and c.epochs.tracker.committed_step == 3
    assert _events(c, 0) == [Commit(0, 3, largest_snapshot=10)]


def test_a_report_stands_for_a_heartbeat_and_a_silent_node_is_still_lost() -> None:
    c = _job(spares=2)
    c.settings.heartbeat_timeout = c.clocks.heartbeat_timeout = 1.0
    for node in (0, 1, 2):
        c.registry.agents[node].last_heartbeat -= 5.0  # no heart-beat for 5 s
    c.replicated(_replicated(0, 0, 3, [0, 1]))  # node 0 reports: the agent skipped its beats
    c.check_heartbeats()
    assert c.registry.agents[0].alive
    assert not c.registry.agents[1].alive and not c.registry.agents[2].alive


def test_a_coordinator_moved_off_a_dead_host_loses_its_nodes_once_the_others_are_back() -> None:
    """Host 127.0.0.2 (node 0, ranks 0 and 1) died with the coordinator; the one started on
    another host with moved_from rebuilds from nodes 1 and 2 and, as soon as both are back,
    declares node 0 lost — not after the usual rebuild wait — and recovers its ranks on the
    spares from node 1's copies."""
    first = Coordinator("j", world_size=4, replicas=1, store_addr="127.0.0.2:1", spares=2)
    for node in (0, 1):
        first.register_agent(RegisterAgent(node, f"127.0.0.{node + 2}:1000"))
    first.register_agent(RegisterAgent(2, "127.0.0.4:1000", spare_node=True))
    for rank in range(4):
        first.proc_joined(_rank(rank // 2, 100 + rank, rank))
    for i in range(2):
        first.proc_joined(_spare(2, 200 + i))
    _commit(first, 0, 3)
    members = first.epochs.membership
    assert members is not None
    moved = Coordinator(
        "j", world_size=4, replicas=1, store_addr="127.0.0.3:1", moved_from="127.0.0.2"
    )
    held = [HeldCopy(rank, 3, 0, 10) for rank in range(4)]  # its own ranks and their buddies'
    ranks = [ProcReport(100 + r, ProcRole.RANK, r) for r in (2, 3)]
    moved.register_agent(
        RegisterAgent(1, "127.0.0.3:1000", rejoin=RejoinState(members, 3, held, {}, ranks))
    )
    moved.check_heartbeats()
    assert moved.registry.agents[0].alive, "node 2 is not back yet: keep waiting"
    spares = [ProcReport(200 + i, ProcRole.SPARE, None) for i in range(2)]
    moved.register_agent(
        RegisterAgent(2, "127.0.0.4:1000", True, rejoin=RejoinState(members, 3, [], {}, spares))
    )
    moved.check_heartbeats()
    assert not moved.registry.agents[0].alive
    (event,) = moved.epochs.events
    assert (
        event.kind is RecoveryKind.NODE
        and "127.0.0.2 died with the job's coordinator" in event.reason
    )
    m = moved.epochs.membership
    assert m is not None and m.epoch == 1 and m.restore_step == 3
    assert {m.ranks[r].node for r in (0, 1)} == {2} and m.sources[0][0] == 1


def _resume_all(c: Coordinator, epoch: int) -> None:
    for rank, a in c.epochs.membership.ranks.items():
        c.resumed_rank(Resumed(a.node, epoch, rank))


def test_a_survivor_restarted_in_place_is_part_of_the_recovery_it_could_not_leave() -> None:
    """Node 1 dies; rank 1 survives it but cannot leave the aborted epoch and is restarted in
    place. That is the node loss's recovery going on, not a failure of its own: one event,
    timed from the node's loss to every rank stepping after the restart."""
    c = _job(spares=2)
    _commit(c, 0, 3)
    c.lose_node(1, "test")
    [event] = c.epochs.events
    assert event.epoch == 1 and event.resumed_at is None
    c.spares_starting(SparesStarting(1, 0))  # rank 1 announced its restart to its agent
    c.proc_lost(ProcLost(0, 101, "process 101 restarted in place", in_place=True))
    c.proc_joined(_spare(0, 300))  # the fresh process on rank 1's node
    assert c.epochs.membership.epoch == 2 and c.epochs.membership.ranks[1].pid == 300
    _resume_all(c, 2)
    [event] = c.epochs.events
    assert event.kind is RecoveryKind.NODE and event.ranks == [2, 3] and event.epoch == 2
    assert list(event.restarted) == [1] and event.restarted[1] >= event.detected_at
    assert event.replacements == {1: [0, 300], 2: [2, 200], 3: [2, 201]}
    assert event.resumed_at is not None and event.waited_for_spares_s is not None


def test_a_restart_in_place_after_every_rank_stepped_again_is_a_failure_of_its_own() -> None:
    c = _job(spares=2)
    _commit(c, 0, 3)
    c.lose_node(1, "test")
    _resume_all(c, 1)
    c.spares_starting(SparesStarting(1, 0))
    c.proc_lost(ProcLost(0, 101, "process 101 restarted in place", in_place=True))
    c.proc_joined(_spare(0, 300))
    first, second = c.epochs.events
    assert first.resumed_at is not None and first.restarted == {}
    assert (
        second.kind is RecoveryKind.RANK and second.ranks == [1] and list(second.restarted) == [1]
    )
    assert second.from_epoch == 1 and second.epoch == 2
