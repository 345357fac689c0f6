"""The end-of-run summary (``launch/report.py``): the figures of what protected a job, and
NOT PROTECTED when no snapshot was committed."""

from __future__ import annotations

from dataclasses import replace

from peerckpt.launch.base import JobOutcome, JobResult
from peerckpt.launch.report import format_report, format_summary, summarize
from peerckpt.states import FlushState, RecoveryKind
from tests.launch.observed import event, flush

LOST = event(RecoveryKind.RANK, ranks=[1], reason="exited", lost={1: 0}, detected_at=5.0)
FLUSHES = [
    flush(20, FlushState.COMMITTED),
    flush(29, FlushState.COMMITTED),
    flush(10, FlushState.FAILED, error="disk full"),
]


def test_the_figures_of_a_job_with_faults_and_a_durable_tier() -> None:
    events = [
        replace(LOST, resumed_at=5.5),
        replace(LOST, detected_at=9.0, resumed_at=None),  # never repaired
        event(RecoveryKind.GROW, detected_at=12.0, resumed_at=13.0),  # not a fault
    ]
    summary = summarize(30, 29, 120, events, FLUSHES)
    assert summary == {
        "protected": True,
        "snapshots_committed": 30,
        "committed_step": 29,
        "rank_snapshots": 120,
        "persisted": True,
        "durable_step": 29,
        "faults": 2,
        "faults_survived": 1,
        "inexact": [],
    }
    assert format_summary(summary) == [
        "protection: 30 snapshots committed, last committed step 29, last durable step 29, "
        "1 of 2 faults survived"
    ]


def test_without_a_durable_tier_the_summary_says_nothing_of_one() -> None:
    [line] = format_summary(summarize(1, 0, 2, [replace(LOST, resumed_at=6.0)], []))
    assert line == "protection: 1 snapshot committed, last committed step 0, 1 fault survived"


def test_a_job_that_committed_nothing_is_not_protected() -> None:
    first, hint = format_summary(summarize(0, None, 0, [], []))
    assert first == "NOT PROTECTED: no snapshot was taken (loop over ctx.steps)"
    assert "ctx.steps(total)" in hint and "range()" in hint
    first, _ = format_summary(summarize(0, None, 8, [], []))
    assert first == "NOT PROTECTED: no snapshot was committed (8 taken by the ranks)"
    failed = format_summary(
        summarize(0, None, 0, [], []), JobOutcome.FAILED
    )  # maybe before its loop
    assert failed == ["no snapshot was committed before the job failed"]


def test_the_report_ends_with_the_summary() -> None:
    result = JobResult(
        "j", 0, JobOutcome.SUCCEEDED, "", [], [], 3.0, summary=summarize(0, None, 0, [], [])
    )
    lines = format_report(result).splitlines()
    assert lines[0] == "job succeeded in 3.0 s"
    assert lines[1] == "NOT PROTECTED: no snapshot was taken (loop over ctx.steps)"


def test_what_a_restore_cannot_reproduce_is_said_after_the_protection() -> None:
    found = ["LR scheduler LambdaLR of optimizer AdamW is not tracked: ..."]
    lost = [replace(LOST, resumed_at=6.0)]
    protection, inexact = format_summary(summarize(1, 0, 2, lost, [], found))
    assert protection.startswith("protection: ") and "1 fault survived" in protection
    assert inexact.startswith("NOT EXACT: its restores were not bit for bit: the loop uses 1")
    assert inexact.endswith(found[0])
    [_] = format_summary(summarize(1, 0, 2, lost, []))  # nothing found: nothing said
