"""A job whose rank 0 tracks a data loader that cannot reshard keeps its world's size
(``recovery/unreshardable.py``), driven on the coordinator directly: an elastic job fails at
the report, naming the loader and the fix; a node that asks to join is refused, before or
after it started, and the job goes on in its epoch."""

from __future__ import annotations

import pytest

from peerckpt.errors import NotReshardable
from peerckpt.manifest import ChunkRecord
from peerckpt.messages.control import (
    AllocateNode,
    ProcJoined,
    ProcLost,
    ProcReport,
    RegisterAgent,
    Replicated,
    SparesStarting,
    Status,
    Unreshardable,
)
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.states import JobState, ProcRole, RecoveryKind

LAYOUT = [ChunkRecord("w", "float32", (4,), (0,), (4,), 0, 16).to_msg()]
LOADER = "data (a StatefulDataLoader with a DistributedSampler)"


def _job(min_nodes: int | None = None) -> Coordinator:
    """A running 2 x 2 job, no spares."""
    c = Coordinator("j", world_size=4, replicas=1, store_addr="127.0.0.1:1", min_nodes=min_nodes)
    for node in (0, 1):
        c.register_agent(RegisterAgent(node, f"127.0.0.1:{1000 + node}"))
    for rank in range(4):
        c.proc_joined(ProcJoined(rank // 2, ProcReport(100 + rank, ProcRole.RANK, rank)))
    assert c.life.state is JobState.RUNNING
    return c


def _commit(c: Coordinator, step: int) -> None:
    for rank in range(4):
        node = rank // 2
        c.replicated(Replicated(node, 0, rank, step, [node, 1 - node], 10, 4, layout=LAYOUT))


def test_an_elastic_job_fails_when_rank_0_names_a_loader_that_cannot_reshard() -> None:
    c = _job(min_nodes=1)
    c.cannot_reshard(Unreshardable(0, 0, 0, [LOADER]))
    assert c.life.state is JobState.FAILED
    reason = c.life.reason
    assert "--min-nodes 1" in reason and LOADER in reason
    assert "peerckpt.ResumableSampler" in reason and "without --min-nodes" in reason


def test_a_job_that_cannot_reshard_refuses_a_node_asking_to_join_and_goes_on() -> None:
    c = _job()
    c.cannot_reshard(Unreshardable(0, 0, 0, [LOADER]))
    assert c.life.state is JobState.RUNNING
    with pytest.raises(NotReshardable, match=r"peerckpt\.ResumableSampler") as refused:
        c.allocate_node(AllocateNode())
    assert "job j cannot grow" in str(refused.value) and LOADER in str(refused.value)
    assert c.epochs.membership is not None and c.epochs.membership.epoch == 0


def test_a_node_given_its_index_before_the_report_is_refused_when_its_processes_connect() -> None:
    c = _job()
    node = c.allocate_node(AllocateNode()).node  # before rank 0 tracked its loader
    c.cannot_reshard(Unreshardable(0, 0, 0, [LOADER]))
    c.register_agent(RegisterAgent(node, "127.0.0.1:1002", joining=2))
    for pid in (300, 301):
        c.proc_joined(ProcJoined(node, ProcReport(pid, ProcRole.JOINER, None)))
    status = c.status(Status())
    assert status.epoch == 0 and status.world_size == 4 and status.events == []
    assert "cannot grow" in status.refused_joins[node]
    c.lose_node(node, "peerckpt join exited")  # it stops what it started: not a failure
    assert c.epochs.events == [] and c.epochs.membership.epoch == 0
    assert c.life.state is JobState.RUNNING


def test_a_job_that_can_reshard_lets_a_node_join_and_counts_its_commits() -> None:
    c = _job(min_nodes=1)
    _commit(c, 0)
    _commit(c, 1)
    node = c.allocate_node(AllocateNode()).node
    c.register_agent(RegisterAgent(node, "127.0.0.1:1002", joining=1))
    c.proc_joined(ProcJoined(node, ProcReport(300, ProcRole.JOINER, None)))
    status = c.status(Status())
    assert status.commits == 2 and status.refused_joins == {}
    assert status.epoch == 1 and [e.kind for e in status.events] == [RecoveryKind.GROW]


def test_a_node_of_spares_only_is_never_refused_and_its_spares_replace_lost_ranks() -> None:
    """``--keep-spares`` opens a fresh spare node (``AllocateNode(spares_only=True)``) in a
    job that cannot reshard: the world keeps its size, so it is not a grow. A spare there takes
    a lost rank; a plain ``AllocateNode`` (a grow) is still refused."""
    c = _job()
    c.cannot_reshard(Unreshardable(0, 0, 0, [LOADER]))
    c.spares_starting(SparesStarting(1))
    node = c.allocate_node(AllocateNode(spares_only=True)).node
    assert node == 2
    c.register_agent(RegisterAgent(node, "127.0.0.1:1002", spare_node=True))
    c.proc_joined(ProcJoined(node, ProcReport(300, ProcRole.SPARE, None)))
    _commit(c, 0)
    c.proc_lost(ProcLost(1, 103, "killed"))  # rank 3
    status = c.status(Status())
    assert c.life.state is JobState.RUNNING and status.refused_joins == {}
    assert status.world_size == 4 and status.epoch == 1 and tuple(status.ranks[3]) == (node, 300)
    with pytest.raises(NotReshardable, match="cannot grow"):
        c.allocate_node(AllocateNode())


def test_a_node_of_spares_only_that_brings_ranks_after_all_is_not_added() -> None:
    """The refusal of a grow holds at the join too: an index asked as spares only does not let
    a node with ranks in."""
    c = _job()
    c.cannot_reshard(Unreshardable(0, 0, 0, [LOADER]))
    node = c.allocate_node(AllocateNode(spares_only=True)).node
    c.register_agent(RegisterAgent(node, "127.0.0.1:1002", joining=1))
    c.proc_joined(ProcJoined(node, ProcReport(300, ProcRole.JOINER, None)))
    status = c.status(Status())
    assert status.epoch == 0 and status.world_size == 4
    assert "cannot grow" in status.refused_joins[node]
