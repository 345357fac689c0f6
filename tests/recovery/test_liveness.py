"""The coordinator's clocks, driven with explicit times (no processes, no sleeping)."""

from __future__ import annotations

from dataclasses import replace

from peerckpt.membership import Membership
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.liveness import HOLD_FACTOR, REBUILD_WAIT_FACTOR, Clocks
from peerckpt.recovery.registry import AgentInfo, Registry
from peerckpt.states import JobState

TIMEOUT = 5.0


def _state(now: float) -> tuple[Registry, Membership, CommitTracker]:
    registry = Registry()
    for node in (0, 1):
        registry.add_agent(AgentInfo(node, f"127.0.0.{node + 2}:1", spare_node=False))
        registry.agents[node].last_heartbeat = now
    membership = Membership(0, 2, {}, {}, None, {}, {}, "127.0.0.2:2")
    return registry, membership, CommitTracker(0, frozenset({0, 1}))


def test_a_stuck_replication_fails_the_job_after_a_heartbeat_timeout() -> None:
    registry, membership, tracker = _state(0.0)
    clocks = Clocks(TIMEOUT)
    clocks.replication_stuck(0.0, 0, 3, 0, "replicating rank 1 step 3 failed")
    args = (JobState.RUNNING, registry, membership, tracker, None)
    assert clocks.expired(TIMEOUT - 0.1, *args).failures == []
    assert clocks.expired(TIMEOUT + 0.1, *args).failures


def test_a_rebuilding_coordinator_waits_for_the_missing_nodes_before_failing_a_replication() -> (
    None
):
    """A coordinator that moved to another host counts the dead host's node alive until its
    agents had their time to come back; a buddy on that node does not answer meanwhile. The
    node must be declared lost (its heart-beats), not the job failed (the replication)."""
    registry, membership, tracker = _state(0.0)
    clocks = Clocks(TIMEOUT)
    clocks.start_rebuild(0.0)
    clocks.replication_stuck(1.0, 0, 3, 0, "replicating rank 1 step 3 to node 0 failed")
    registry.agents[1].last_heartbeat = 100.0  # node 1 is back and heart-beating
    args = (JobState.RUNNING, registry, membership, tracker, None)
    end = REBUILD_WAIT_FACTOR * TIMEOUT
    during = clocks.expired(end - 0.1, *args)
    assert during.failures == [] and during.silent == {} and not during.rebuild
    registry.agents[1].last_heartbeat = end
    after = clocks.expired(end + 0.1, *args)
    assert after.rebuild and after.failures == [] and set(after.silent) == {0}
    registry.agents[0].alive = False  # the coordinator declares it lost
    assert clocks.expired(end + TIMEOUT + 1.0, *args).failures == []
    assert clocks.stuck == []


def test_a_failed_recovery_fails_the_job_only_if_no_newer_epoch_supersedes_it() -> None:
    registry, membership, tracker = _state(0.0)
    clocks = Clocks(TIMEOUT)
    args = (JobState.RUNNING, registry, membership, tracker, None)
    clocks.hold_failure(0.0, 0, "rank 1 raised: RecoveryFailed: node 1: connection closed")
    end = HOLD_FACTOR * TIMEOUT
    registry.agents[0].last_heartbeat = registry.agents[1].last_heartbeat = end
    assert clocks.expired(end - 0.1, *args).failures == []
    assert clocks.expired(end + 0.1, *args).failures == [
        "rank 1 raised: RecoveryFailed: node 1: connection closed"
    ]
    assert clocks.held == []  # said once
    clocks.hold_failure(10.0, 0, "rank 0 raised: RecoveryFailed: twin on node 1")
    newer = replace(membership, epoch=1)  # node 1's loss was declared meanwhile
    assert clocks.expired(10.0 + end + 1.0, *args[:2], newer, tracker, None).failures == []
    assert clocks.held == []
