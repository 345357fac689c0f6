"""The JSON the observers write keeps its strings: a kind or a state held as an enum is
written as the same string a report, ``peerckpt status --json`` and /status.json always
showed, key for key (each dict below is written by hand)."""

from __future__ import annotations

import json
from dataclasses import replace

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
