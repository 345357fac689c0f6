"""A job's status as the coordinator returns it, for the observability tests: 2 nodes × 2
ranks and a spare node, one rank lost and recovered by a chaos kill, one durable flush."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from peerckpt.chaos import ActionKind, FiredAction
from peerckpt.messages.control import FlushRecord, JobStatus, NodeStats, Pull, RecoveryEvent
from peerckpt.states import EpochMode, FlushState, JobState, RecoveryKind

T0 = 1_700_000_000.0


def event(kind: RecoveryKind = RecoveryKind.RANK, **over: Any) -> RecoveryEvent:
    """A failure event; what the test does not name is empty (no ranks lost, nothing
    pulled, detected at 0, from epoch 0, not resumed)."""
    base = RecoveryEvent(kind, [], [], "", {}, 0.0, 0)
    return replace(base, **over)


def flush(step: int, state: FlushState, **over: Any) -> FlushRecord:
    """A durable flush of ``step``; what the test does not name is empty."""
    return replace(FlushRecord(step, state, "", 0.0, None, 0, {}), **over)


EVENT = event(
    RecoveryKind.RANK,
    ranks=[2],
    reason="process 200 exited",
    lost={2: 1},
    detected_at=T0 + 10.02,
    from_epoch=0,
    pulls=[Pull(2, 2, 0, 5000, 0.03), Pull(0, 0, 0, 4000, 0.001)],
    resumed_at=T0 + 10.25,
    restore_step=30,
    mode=EpochMode.SAME,
    epoch=1,
)


def status(**over: Any) -> JobStatus:
    """A ``Status`` reply; ``over`` replaces fields."""
    out = JobStatus(
        job="demo",
        state=JobState.RUNNING,
        reason="",
        epoch=1,
        world_size=4,
        min_nodes=None,
        committed_step=41,
        last_replicated={0: 42, 1: 42, 2: 41, 3: 43},
        ranks={0: [0, 100], 1: [0, 101], 2: [2, 300], 3: [1, 201]},
        spares=[[2, 301]],
        nodes={0: True, 1: True, 2: True},
        events=[EVENT],
        flushes=[
            flush(20, FlushState.COMMITTED, started_at=T0 + 5, committed_at=T0 + 6),
            flush(40, FlushState.FAILED, started_at=T0 + 12),
        ],
        flush_skipped=[],
        holders={0: [0, 1], 1: [0, 1], 2: [1, 2], 3: [0, 1], 9: [-1]},
        placement={0: [1], 1: [1], 2: [1], 3: [0]},
        resumed=[0, 1, 2, 3],
        spare_nodes=[2],
        node_stats={
            0: NodeStats(
                snapshot_bytes=1000,
                snapshots=10,
                replicated_bytes=900,
                latest_step={0: 44, 1: 43},
                memory={"slots": 4096, "replicas": 2048, "staging": 0},
            ),
            1: NodeStats(
                snapshot_bytes=500,
                snapshots=5,
                replicated_bytes=400,
                latest_step={3: 43},
                memory={"slots": 2048, "replicas": 8192, "staging": 0},
            ),
        },
        replicas=1,
    )
    return replace(out, **over)


CHAOS = [
    FiredAction("kill rank=2 at=30", ActionKind.KILL_RANK, 2, 30, 29, 0, T0 + 10.0, 1, 102),
    FiredAction("slow node=0 at=35 rate=2 for=2", ActionKind.SLOW_NODE, 0, 35, 34, 1, T0 + 11.0),
    FiredAction(
        "kill rank=1 at=999",
        ActionKind.KILL_RANK,
        1,
        40,
        39,
        1,
        None,
        skipped="the job ended before its step",
    ),
]
