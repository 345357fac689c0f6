"""A restarted coordinator rebuilt from its agents, when an agent was lost just before it.

Node 0's agent dies, the coordinator opens epoch 1 (the spares on node 2 take ranks 0 and
1), and dies itself while the ranks form epoch 1's process group on the rendezvous store
that dies with it. The restarted coordinator learns everything from the agents' reports
(``recovery/rebuild.py``), driven directly here, without processes.
"""

from __future__ import annotations

import time

from peerckpt.coding import ErasureSpec
from peerckpt.membership import Membership
from peerckpt.messages.control import (
    Commit,
    EpochOpened,
    HeldCopy,
    ProcJoined,
    ProcReport,
    RegisterAgent,
    RejoinState,
    Replicated,
    Resumed,
)
from peerckpt.reads import ERASURE
from peerckpt.recovery import rebuild
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.recovery.erasure import ErasurePlacement
from peerckpt.recovery.placement import RingPlacement
from peerckpt.states import EpochMode, JobState, ProcRole, RecoveryKind

from .test_coordinator import LAYOUT

RANK_NODES = {0: 2, 1: 2, 2: 1, 3: 1}  # epoch 1: node 0 lost, its ranks on the spares' node
PIDS = {0: 200, 1: 201, 2: 102, 3: 103}


def _epoch_one() -> Membership:
    """The membership of epoch 1, as the first coordinator opened it (restore step 3)."""
    first = Coordinator("j", world_size=4, replicas=1, store_addr="127.0.0.1:1", spares=2)
    for node in (0, 1):
        first.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}"))
    first.register_agent(RegisterAgent(2, "127.0.0.1:1002", spare_node=True))
    for rank in range(4):
        first.proc_joined(ProcJoined(rank // 2, ProcReport(100 + rank, ProcRole.RANK, rank)))
    for i in range(2):
        first.proc_joined(ProcJoined(2, ProcReport(200 + i, ProcRole.SPARE, None)))
    for rank in range(4):
        holders = [rank // 2, 1 - rank // 2]
        first.replicated(Replicated(rank // 2, 0, rank, 3, holders, 10, 4, layout=LAYOUT))
    first.lose_node(0, "its agent's connection to the coordinator closed")
    m = first.epochs.membership
    assert m is not None and m.epoch == 1 and m.restore_step == 3
    assert {r: a.node for r, a in m.ranks.items()} == RANK_NODES
    return m


def _restarted(m: Membership, replicas: int | None = 1, erasure: str | None = None) -> Coordinator:
    """The restarted coordinator (given ``replicas``), once nodes 1 and 2 registered again,
    their ranks reporting rank 0's ``erasure``."""
    c = Coordinator("j", world_size=4, replicas=replicas, store_addr="127.0.0.1:1")
    for node in (1, 2):
        ranks = [r for r, n in RANK_NODES.items() if n == node]
        procs = [ProcReport(PIDS[r], ProcRole.RANK, r, erasure=erasure) for r in ranks]
        held = [HeldCopy(r, 3, 0, 10) for r in ranks]
        rejoin = RejoinState(m, 3, held, {r: LAYOUT for r in ranks}, procs)
        c.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}", node == 2, 0, rejoin))
    assert c.epochs.membership == m and c.life.state is JobState.RUNNING
    return c


def _rebuild_ends(c: Coordinator) -> None:
    """The agents had their time to come back (``REBUILD_WAIT_FACTOR`` heartbeat timeouts)."""
    assert c.clocks.rebuild_deadline is not None
    c.clocks.rebuild_deadline = time.monotonic() - 0.1
    now = time.monotonic()
    for agent in c.registry.agents.values():
        agent.last_heartbeat = now  # every node that came back is heart-beating


def test_ranks_that_never_stepped_in_the_rebuilt_epoch_form_its_group_again() -> None:
    """Ranks 2 and 3 formed epoch 1's group and stepped (their agent replays ``Resumed``);
    ranks 0 and 1 were still joining it on the dead coordinator's store and never will. The
    same four ranks form it again in epoch 2, each from its own node's copy of step 3."""
    m = _epoch_one()
    c = _restarted(m)
    for rank in (2, 3):
        c.resumed_rank(Resumed(1, 1, rank))
    c.check_heartbeats()
    assert c.epochs.membership == m, "the agents may still come back: no decision yet"
    _rebuild_ends(c)
    c.check_heartbeats()
    new = c.epochs.membership
    assert new is not None and new.epoch == 2 and new.mode is EpochMode.SAME
    assert new.restore_step == 3 and new.ranks == m.ranks
    (event,) = c.epochs.events
    assert event.kind is RecoveryKind.RENDEZVOUS and event.ranks == [] and event.from_epoch == 1
    assert "rank(s) [0, 1] never reported stepping in epoch 1" in event.reason
    assert c.life.state is JobState.RUNNING


def test_a_rebuilt_epoch_whose_every_rank_stepped_is_left_alone() -> None:
    m = _epoch_one()
    c = _restarted(m)
    for rank in range(4):
        c.resumed_rank(Resumed(RANK_NODES[rank], 1, rank))
    _rebuild_ends(c)
    c.check_heartbeats()
    assert c.epochs.membership == m and c.epochs.events == []


def test_an_agent_back_after_a_commit_it_missed_hears_that_commit_first() -> None:
    """Epoch 1 commits step 4 after the restart. An agent whose stream opens now (one that
    registered late, after that commit was broadcast) must hear it: its ranks wait for it
    before they overwrite their older snapshot slot, and the job stalled until the commit
    timeout (300 s) without it."""
    m = _epoch_one()
    c = _restarted(m)
    assert rebuild.catch_up(c) == [EpochOpened(m)]  # nothing committed in epoch 1 yet
    for rank, node in RANK_NODES.items():
        holders = [node, 1 if node == 2 else 2]
        c.replicated(Replicated(node, 1, rank, 4, holders, 10, 4, layout=LAYOUT))
    assert c.epochs.tracker is not None and c.epochs.tracker.committed_step == 4
    assert rebuild.catch_up(c) == [EpochOpened(m), Commit(1, 4, largest_snapshot=10)]


def test_a_coordinator_restarted_without_replicas_given_keeps_the_default_buddy() -> None:
    """Neither the launcher nor the script gave replicas (the default, 1). The restarted
    coordinator never opens a first epoch, where that default was applied: the epoch it opened
    next had no buddies at all, so every step committed with the rank's own copy only, and a
    node lost then took its ranks' committed state with it (chaos seed 7)."""
    c = _restarted(_epoch_one(), replicas=None)
    _rebuild_ends(c)
    c.check_heartbeats()  # ranks 0..3 never stepped in epoch 1: they form it again in epoch 2
    new = c.epochs.membership
    assert new is not None and new.epoch == 2
    assert new.placement == {0: [1], 1: [1], 2: [2], 3: [2]}


def test_a_coordinator_restarted_applies_the_scripts_erasure_again() -> None:
    """Rank 0's @resilient(erasure="K+M") reached the first coordinator when rank 0 joined;
    a restarted one hears of rank 0 from its agent only, and kept buddy replicas instead."""
    c = _restarted(_epoch_one(), replicas=None, erasure="1+1")
    assert isinstance(c.settings.placement, ErasurePlacement)


def test_a_restarted_coordinator_takes_the_scripts_replicas_from_any_rank() -> None:
    """@resilient(replicas=2), given by every rank's decorator; rank 0's node (2) does not
    come back after the coordinator's restart. Only rank 0's settings were read: the job
    went on with one buddy per rank."""
    c = Coordinator("j", world_size=4, replicas=None, store_addr="127.0.0.1:1")
    procs = [ProcReport(PIDS[r], ProcRole.RANK, r, replicas=2) for r in (2, 3)]
    held = [HeldCopy(r, 3, 0, 10) for r in (2, 3)]
    rejoin = RejoinState(_epoch_one(), 3, held, {r: LAYOUT for r in (2, 3)}, procs)
    c.register_agent(RegisterAgent(1, "127.0.0.1:1001", False, 0, rejoin))
    assert c.settings.replicas == 2


def test_a_restarted_coordinator_takes_the_scripts_settings_from_spares_that_took_ranks() -> None:
    """Every first-epoch process of node 1 was replaced by spares, which said hello with the
    defaults before their decorator ran; their agent reports the settings it gave since."""
    c = Coordinator("j", world_size=4, replicas=None, store_addr="127.0.0.1:1")
    procs = [ProcReport(PIDS[r], ProcRole.SPARE, None, replicas=2, erasure=None) for r in (2, 3)]
    procs.append(ProcReport(9999, ProcRole.SPARE, None))  # a spare that took no rank
    held = [HeldCopy(r, 3, 0, 10) for r in (2, 3)]
    rejoin = RejoinState(_epoch_one(), 3, held, {r: LAYOUT for r in (2, 3)}, procs)
    c.register_agent(RegisterAgent(1, "127.0.0.1:1001", False, 0, rejoin))
    assert c.settings.replicas == 2


def _erasure_coordinator() -> Coordinator:
    placement = ErasurePlacement(ErasureSpec(3, 1), RingPlacement())
    return Coordinator(
        "j", world_size=4, replicas=None, store_addr="127.0.0.1:1", placement=placement
    )


def test_a_restarted_coordinator_keeps_the_erasure_groups_of_what_commits_after() -> None:
    """--erasure 3+1 on nodes 0..3, a spare node 4. The coordinator dies at step 1 and the
    restarted one, rebuilt from the agents, commits step 2; then node 1 is lost. Its rank is
    rebuilt from its group's parity, as without the restart: the rebuilt commit tracker had
    no groups, so step 2 committed without them, and the job failed with 'no surviving copy
    of the committed snapshot of rank(s) [1]'."""
    first = _erasure_coordinator()
    for node in range(4):
        first.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}"))
    first.register_agent(RegisterAgent(4, "127.0.0.1:1004", spare_node=True))
    for rank in range(4):
        first.proc_joined(ProcJoined(rank, ProcReport(100 + rank, ProcRole.RANK, rank)))
    first.proc_joined(ProcJoined(4, ProcReport(200, ProcRole.SPARE, None)))
    for rank in range(4):
        first.replicated(Replicated(rank, 0, rank, 1, [rank], 10, 4, layout=LAYOUT))
    m = first.epochs.membership
    assert m is not None and m.erasure is not None
    assert first.epochs.tracker is not None and first.epochs.tracker.committed_step == 1

    c = _erasure_coordinator()
    for node in range(5):
        ranks = [node] if node < 4 else []
        procs = [ProcReport(100 + r, ProcRole.RANK, r) for r in ranks]
        if node == 4:
            procs = [ProcReport(200, ProcRole.SPARE, None)]
        held = [HeldCopy(r, 1, 0, 10) for r in ranks]
        rejoin = RejoinState(m, 1, held, {r: LAYOUT for r in ranks}, procs)
        c.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}", node == 4, 0, rejoin))
        for r in ranks:
            c.resumed_rank(Resumed(node, 0, r))
    _rebuild_ends(c)
    c.check_heartbeats()
    assert c.epochs.membership == m
    for rank in range(4):
        c.replicated(Replicated(rank, 0, rank, 2, [rank], 10, 4, layout=LAYOUT))
    tracker = c.epochs.tracker
    assert tracker is not None and tracker.committed_step == 2
    c.lose_node(1, "its agent's connection to the coordinator closed")
    assert c.life.state is JobState.RUNNING, c.life.reason
    assert tracker.committed_holders[1] == {ERASURE}
    new = c.epochs.membership
    assert new is not None and new.epoch == 1 and new.restore_step == 2
    assert new.ranks[1].node == 4
