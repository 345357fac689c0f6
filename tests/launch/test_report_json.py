"""The JSON the observers write keeps its strings: a kind or a state held as an enum is
written as the same string a report, ``peerckpt status --json`` and /status.json always
showed, key for key (each dict below is written by hand)."""

from __future__ import annotations

import json
from dataclasses import replace

from peerckpt.chaos import ActionKind, FiredAction
from peerckpt.launch.base import JobOutcome, JobResult
from peerckpt.messages import decode, encode
from peerckpt.messages.control import FlushRecord, Pull, RecoveryEvent
from peerckpt.states import EpochMode, FlushState, RecoveryKind

EVENT = RecoveryEvent(
    RecoveryKind.RANK,
    [1],
    [],
    "process 7 exited",
    {1: 0},
    10.0,
    0,
    pulls=[Pull(1, 2, 1, 64, 0.5)],
    resumed_at=11.0,
    epoch=1,
    restore_step=9,
    mode=EpochMode.SAME,
    replacements={1: [2, 8]},
)
EVENT_JSON = {
    "kind": "rank",
    "ranks": [1],
    "nodes": [],
    "reason": "process 7 exited",
    "lost": {"1": 0},
    "detected_at": 10.0,
    "from_epoch": 0,
    "pulls": [
        {
            "type": "pull",
            "rank": 1,
            "node": 2,
            "source": 1,
            "bytes": 64,
            "seconds": 0.5,
            "round": None,
        }
    ],
    "resumed_at": 11.0,
    "epoch": 1,
    "restore_step": 9,
    "mode": "same",
    "replacements": {"1": [2, 8]},
    "fallback": "",
    "partial": False,
    "restarted": {},
    "in_place": {},
}
FLUSH = FlushRecord(5, FlushState.COMMITTED, "", 1.0, 2.0, 100, {0: 0.25})
FLUSH_JSON = {
    "type": "flush_record",
    "step": 5,
    "state": "committed",
    "error": "",
    "started_at": 1.0,
    "committed_at": 2.0,
    "nbytes": 100,
    "writers": {"0": 0.25},
}

# What the chaos monkey recorded, one of each shape a report holds: a rank killed, a node
# slowed, a rank's replicas corrupted, a kill struck inside a phase, an action skipped.
FIRED = [
    FiredAction("kill rank=1 at=8", ActionKind.KILL_RANK, 1, 8, 5, 0, 12.5, node=0, pid=4242),
    FiredAction("slow node=0 at=4 rate=50 for=1", ActionKind.SLOW_NODE, 0, 4, 2, 0, 11.0, node=0),
    FiredAction(
        "corrupt rank=0 at=6", ActionKind.CORRUPT_RANK, 0, 6, 3, 0, 11.5, segments=("seg-r0",)
    ),
    FiredAction(
        "kill node=1 at=10 during=replication",
        ActionKind.KILL_NODE,
        1,
        10,
        9,
        1,
        13.0,
        node=1,
        during="replication",
        struck={"phase": "replication", "node": 1, "pid": 77},
    ),
    FiredAction("add node at=12", ActionKind.ADD_NODE, -1, 12, 11, 1, None, skipped="refused"),
]
FIRED_JSON = [
    {
        "action": "kill rank=1 at=8",
        "kind": "kill_rank",
        "target": 1,
        "step": 8,
        "committed_step": 5,
        "epoch": 0,
        "node": 0,
        "pid": 4242,
        "fired_at": 12.5,
    },
    {
        "action": "slow node=0 at=4 rate=50 for=1",
        "kind": "slow_node",
        "target": 0,
        "step": 4,
        "committed_step": 2,
        "epoch": 0,
        "node": 0,
        "fired_at": 11.0,
    },
    {
        "action": "corrupt rank=0 at=6",
        "kind": "corrupt_rank",
        "target": 0,
        "step": 6,
        "committed_step": 3,
        "epoch": 0,
        "fired_at": 11.5,
        "segments": ["seg-r0"],
    },
    {
        "action": "kill node=1 at=10 during=replication",
        "kind": "kill_node",
        "target": 1,
        "step": 10,
        "committed_step": 9,
        "epoch": 1,
        "node": 1,
        "fired_at": 13.0,
        "during": "replication",
        "struck": {"phase": "replication", "node": 1, "pid": 77},
    },
    {
        "action": "add node at=12",
        "kind": "add_node",
        "target": -1,
        "step": 12,
        "committed_step": 11,
        "epoch": 1,
        "fired_at": None,
        "skipped": "refused",
    },
]


def _through_json(value: object) -> object:
    return json.loads(json.dumps(value))


def test_a_recovery_event_and_a_flush_are_written_with_their_strings() -> None:
    assert _through_json(EVENT.to_json()) == EVENT_JSON
    assert _through_json(encode(FLUSH)) == FLUSH_JSON
    # and every kind and flush state travels as its old string, and back
    for kind in RecoveryKind:
        raw = encode(replace(EVENT, kind=kind))
        assert raw["kind"] == kind.value and decode(raw).kind is kind


def test_a_job_result_is_written_with_its_state_as_a_string_and_read_back() -> None:
    result = JobResult("j", 0, JobOutcome.SUCCEEDED, "", [EVENT], [], 3.0, [FLUSH])
    written = _through_json(result.to_json())
    assert written["state"] == "succeeded" and written["events"] == [EVENT_JSON]
    assert written["flushes"] == [FLUSH_JSON]
    assert list(written) == [
        "job",
        "exit_code",
        "state",
        "reason",
        "events",
        "chaos",
        "wall_s",
        "flushes",
        "digests",
        "timeline",
        "unfired",
        "tensor_digests",
        "summary",
    ]
    assert JobResult.from_json(written) == result
    assert [o.exit_code for o in JobOutcome] == [0, 1, 1, 130]


def test_a_job_result_writes_its_chaos_records_as_the_maps_a_report_always_had() -> None:
    result = JobResult("j", 1, JobOutcome.FAILED, "", [EVENT], FIRED, 3.0, [FLUSH])
    written = _through_json(result.to_json())
    assert written["chaos"] == FIRED_JSON
    assert [list(c) for c in written["chaos"]] == [list(c) for c in FIRED_JSON]
    assert JobResult.from_json(written) == result
    assert [FiredAction.from_json(c) for c in FIRED_JSON] == FIRED
