"""The failure events and chaos records of a real campaign, ``peerckpt chaos --seed 1
--faults 6`` of a nanoGPT script on 3 nodes with a spare, run under CPU load (two busy loops
on 2 cores). Its report (``campaign-report.json``) had lost the recovery from ``kill rank=1
at=15``: the coordinator that saw it was killed at step 25 before the launcher's watch loop,
busy starting a new spare node's agent, polled it. ``MISSING`` is that event as the log
showed it (``epoch 2 opened (same, layout 0): restore step 11``, 45 ms to recover)."""

from __future__ import annotations

from typing import Any

from peerckpt.chaos import FiredAction
from peerckpt.messages.control import RecoveryEvent


def _pull(rank: int, node: int, source: int, nbytes: int, seconds: float) -> dict[str, Any]:
    return {"rank": rank, "node": node, "source": source, "bytes": nbytes, "seconds": seconds}


# The report's "events", as written.
EVENTS_JSON: list[dict[str, Any]] = [
    {
        "kind": "rank",
        "ranks": [0],
        "nodes": [],
        "reason": "process 14675 exited",
        "lost": {"0": 0},
        "detected_at": 1795801375.3720343,
        "from_epoch": 0,
        "pulls": [
            _pull(2, 2, 2, 0, 9.611399946152233e-05),
            _pull(0, 3, 1, 370981, 0.011388896997232223),
            _pull(1, 1, 1, 0, 0.00010062000001198612),
        ],
        "resumed_at": 1795801375.4184556,
        "epoch": 1,
        "restore_step": 1,
        "mode": "same",
        "replacements": {"0": [3, 14686]},
    },
    {
        "kind": "node",
        "ranks": [0, 1],
        "nodes": [3],
        "reason": "its agent's connection to the coordinator closed",
        "lost": {"0": 3, "1": 3},
        "detected_at": 1795801383.7575593,
        "from_epoch": 2,
        "pulls": [
            _pull(2, 2, 2, 0, 0.00012443599916878156),
            _pull(1, 4, 2, 370988, 0.022840276000351878),
            _pull(0, 4, 2, 370988, 0.026375654997536913),
        ],
        "resumed_at": 1795801383.8314507,
        "epoch": 3,
        "restore_step": 48,
        "mode": "same",
        "replacements": {"0": [4, 14940], "1": [4, 14962]},
    },
]
# The recovery the report lost, from the log: 17:42:55,892 epoch 2 opened, restore step 11,
# ranks {0: 3, 2: 2, 1: 3}; every rank stepping again 0.045 s after detection.
MISSING_JSON: dict[str, Any] = {
    "kind": "rank",
    "ranks": [1],
    "nodes": [],
    "reason": "process 14676 exited",
    "lost": {"1": 1},
    "detected_at": 1795801375.892,
    "from_epoch": 1,
    "pulls": [_pull(1, 3, 2, 370981, 0.012)],
    "resumed_at": 1795801375.937,
    "epoch": 2,
    "restore_step": 11,
    "mode": "same",
    "replacements": {"1": [3, 14700]},
}
# The report's "chaos", as written.
CHAOS_JSON: list[dict[str, Any]] = [
    {"action": "kill rank=0 at=5", "kind": "kill_rank", "target": 0, "step": 5,
     "committed_step": 1, "epoch": 0, "node": 0, "pid": 14675,
     "fired_at": 1795801375.3109696},
    {"action": "kill rank=1 at=15", "kind": "kill_rank", "target": 1, "step": 15,
     "committed_step": 11, "epoch": 1, "node": 1, "pid": 14676,
     "fired_at": 1795801375.8195956},
    {"action": "kill coordinator at=25", "kind": "kill_coordinator", "target": -1, "step": 25,
     "committed_step": 21, "epoch": 2, "fired_at": 1795801376.352438},
    {"action": "partition node=@1 at=35 for=5.0", "kind": "partition_node", "target": 1,
     "step": 35, "committed_step": 30, "epoch": 2, "node": 3,
     "fired_at": 1795801378.2565565},
    {"action": "corrupt rank=0 at=45", "kind": "corrupt_rank", "target": 0, "step": 45,
     "committed_step": 30, "epoch": 2, "fired_at": 1795801378.4601848,
     "segments": ["peerckpt-be1fa8a9-bdce947941d26c59-n2-r0-g0-0-5",
                  "peerckpt-be1fa8a9-bdce947941d26c59-n2-r0-g0-1-6"]},
    {"action": "kill agent node=@0 at=55", "kind": "kill_agent", "target": 0, "step": 55,
     "committed_step": 48, "epoch": 2, "node": 3, "fired_at": 1795801383.7518322},
]  # fmt: skip


def recorded() -> tuple[list[RecoveryEvent], list[FiredAction]]:
    """The report's events (2: one lost) and chaos records (6), read back as the report is."""
    return (
        [RecoveryEvent.from_json(e) for e in EVENTS_JSON],
        [FiredAction.from_json(c) for c in CHAOS_JSON],
    )


def complete() -> list[RecoveryEvent]:
    """The 3 failures the run had, the lost one back in its place."""
    first, last = EVENTS_JSON
    return [RecoveryEvent.from_json(e) for e in (first, MISSING_JSON, last)]
