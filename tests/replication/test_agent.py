"""The agent's own guards, driven directly (no coordinator is contacted)."""

from __future__ import annotations

import pytest

from peerckpt.errors import PeerckptError
from peerckpt.messages.local import AllocSlot, SlotGranted, SnapshotTaken
from peerckpt.replication.agent import Agent

from .conftest import write_snapshot


@pytest.fixture
def agent(tmp_path, job):
    name, secret = job
    a = Agent(
        name, node=0, secret=secret, coordinator="127.0.0.1:1", socket_path=str(tmp_path / "a.sock")
    )
    yield a
    a.close()


def test_a_rank_cannot_reallocate_the_slot_holding_the_committed_step(agent) -> None:
    write_snapshot(agent.store, rank=1, step=5, index=0)
    agent.committed_step = 5
    with pytest.raises(PeerckptError, match="holds committed step 5"):
        agent._requests.handle(AllocSlot(0, 1, 0, 1 << 20), None)
    reply = agent._requests.handle(AllocSlot(0, 1, 1, 1 << 20), None)
    assert isinstance(reply, SlotGranted) and reply.size >= 1 << 20
    assert agent.store.find(0, 1, 5) is not None  # the committed copy is untouched


def test_a_snapshot_notice_of_an_ended_epoch_is_never_replicated(agent) -> None:
    slot = write_snapshot(agent.store, rank=1, step=6, index=1)
    manifest, slot.manifest = slot.manifest, None
    agent.epoch = 3  # no membership for epoch 2 any more
    agent._requests.handle(SnapshotTaken(2, 1, 6, 1, manifest), None)
    assert slot.manifest is None and not agent.mirroring._senders
