"""The snapshot engine: ping-pong slots, one snapshot in flight, commits gate the next."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from peerckpt.errors import CommitTimeout, MembershipChanged
from peerckpt.runtime.capture import capture
from peerckpt.runtime.snapshot import SnapshotEngine

from ..conftest import FakeAgent


def _state(value: float) -> Any:
    return capture({"w": torch.full((1000,), float(value))}, step=int(value), extra={})


def _blocked_on(engine: SnapshotEngine, step: int, timeout: float = 10.0) -> bool:
    """Wait (bounded) until the copy thread holds the next snapshot and waits for ``step``'s
    commit: the point where it must not write."""
    deadline = time.monotonic() + timeout
    while engine.blocked_on_commit != step and time.monotonic() < deadline:
        time.sleep(0.005)
    return engine.blocked_on_commit == step


def test_snapshots_alternate_slots_and_wait_for_the_previous_commit(agent_engine) -> None:
    agent, engine = agent_engine
    engine.take(0, _state(0))
    assert [(n.step, n.slot) for n in agent.wait_notices(1)] == [(0, 0)]
    engine.take(1, _state(1))  # returns at once; the copy waits for step 0's commit
    assert _blocked_on(engine, 0)
    assert len(agent.notices) == 1  # it is waiting, with step 1 in hand, and wrote nothing
    engine.on_commit(0, 0)
    assert [(n.step, n.slot) for n in agent.wait_notices(2)] == [(0, 0), (1, 1)]
    engine.on_commit(0, 1)
    engine.take(2, _state(2))
    assert agent.wait_notices(3)[-1].slot == 0  # never slot 1: it holds committed step 1
    engine.wait_copy()
    assert engine.slot_tensor(1)[:4].view(torch.float32).item() == 1.0


def test_a_commit_of_another_epoch_or_step_does_not_release_the_next_snapshot(agent_engine) -> None:
    agent, engine = agent_engine
    engine.take(0, _state(0))
    agent.wait_notices(1)
    engine.take(1, _state(1))
    assert _blocked_on(engine, 0)
    engine.on_commit(1, 0)  # wrong epoch
    engine.on_commit(0, 7)  # a step this rank is not waiting for
    # A commit that released the copy would have cleared this under the same lock.
    assert engine.blocked_on_commit == 0 and engine.committed_step is None
    engine.on_commit(0, 0)  # the right one does release it
    assert [n.step for n in agent.wait_notices(2)] == [0, 1]


def test_an_abort_wakes_the_training_loop_with_membership_changed(agent_engine) -> None:
    agent, engine = agent_engine
    engine.take(0, _state(0))
    agent.wait_notices(1)
    engine.take(1, _state(1))  # stuck waiting for a commit that will never come
    assert _blocked_on(engine, 0)
    engine.abort()
    with pytest.raises(MembershipChanged):
        engine.wait_copy()
    assert len(agent.notices) == 1  # the snapshot of the ended epoch was never announced


def test_a_snapshot_never_committed_ends_with_a_clear_error() -> None:
    agent = FakeAgent()
    engine = SnapshotEngine(agent, commit_timeout_s=0.3)  # type: ignore[arg-type]
    try:
        engine.begin_epoch(0, 0, None, None, None)
        engine.take(0, _state(0))
        engine.take(1, _state(1))
        with pytest.raises(CommitTimeout, match=r"step 0 was not committed within 0\.3 s"):
            engine.wait_copy()
    finally:
        engine.close()
        agent.arena.destroy()
