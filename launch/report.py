"""The report of a finished job: each failure, what caused it, how fast it was repaired.

Failure events come from the coordinator (``detected_at``, ``resumed_at``, the lost ranks and
where they were, the restore step and every rank's restore source); chaos records come from
the launcher's chaos monkey (``fired_at``). A failure is attributed to the chaos action whose
target it lost and that fired before it was detected, in the epoch it ended or an earlier
one: of several, the one that fired last. A fault that lost nothing (a partition shorter than
the heartbeat timeout, a hang that ended in time) stays unpaired and cannot take a later
failure of its target; failures nobody injected are reported with the coordinator's reason
and timed from their detection.

Every failure's cost runs to every rank stepping again, whatever that took: a survivor that
could not leave the aborted epoch and was restarted in place is part of the same recovery
(the coordinator records it there, ``restarted``), and a failure repaired together with a
newer one that struck before it ended costs until that joint repair ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peerckpt.chaos import ActionKind, FiredAction
from peerckpt.launch.base import JobOutcome, JobResult
from peerckpt.messages.control import FlushRecord, Pull, RecoveryEvent
from peerckpt.reads import ERASURE, STORAGE
from peerckpt.states import FlushState, RecoveryKind


@dataclass
class FailureRow:
    """One failure and its recovery, timed from the fault when it was injected."""

    cause: str
    lost: dict[int, int]  # rank → node it was on
    detected_s: float | None  # after the kill; None when nobody injected it
    recovered_s: float | None  # kill (or detection) → every rank stepping again
    restore_step: int | None
    pulls: list[Pull] = field(default_factory=list)
    superseded: bool = False  # another failure opened a newer epoch before this one resumed
    change: str = ""  # how the world changed, if it did
    fallback: str = ""  # why the state came from durable storage instead of memory
    restarted: dict[int, tuple[int | None, float]] = field(default_factory=dict)
    # rank → (its node, seconds after the kill or detection): survivors restarted in place
    in_place: dict[int, tuple[int | None, int]] = field(default_factory=dict)
    # rank → (its node, which restart of it): lost ranks restarted in place on their node


def settled_at(events: list[RecoveryEvent], index: int) -> float | None:
    """When every rank stepped again after failure ``index``: the end of its own recovery, or,
    when newer failures superseded it, of the recovery that repaired them all; None while
    that has not happened."""
    event, seen = events[index], {index}
    while event.resumed_at is None:
        epoch = event.epoch
        later = [
            i
            for i, e in enumerate(events)
            if epoch is not None and e.from_epoch == epoch and i not in seen
        ]
        if not later:
            return None
        seen.add(later[0])
        event = events[later[0]]
    return float(event.resumed_at)


def superseded(events: list[RecoveryEvent], event: RecoveryEvent) -> bool:
    """Whether a newer failure opened an epoch before ``event``'s recovery resumed."""
    return event.resumed_at is None and any(e.from_epoch == event.epoch for e in events)


def _matches(action: FiredAction, event: RecoveryEvent) -> bool:
    """Whether ``action`` fired before ``event`` was detected, in the epoch ``event`` ended
    or an earlier one, and lost what it lost."""
    if action.fired_at is None or action.fired_at > event.detected_at:
        return False
    if action.epoch > event.from_epoch:
        return False  # fired in a newer epoch than the one this failure ended
    if action.kind in (ActionKind.KILL_RANK, ActionKind.HANG_RANK):
        if action.node is not None and event.lost.get(action.target, action.node) != action.node:
            return False  # the rank it struck was on another node than the one lost
        return event.kind is RecoveryKind.RANK and action.target in event.ranks
    if action.kind is ActionKind.ADD_NODE:
        return event.kind is RecoveryKind.GROW and action.node in event.nodes
    if action.kind in (ActionKind.CORRUPT_RANK, ActionKind.SLOW_NODE):
        return False  # neither loses anything by itself
    node = action.target if action.node is None else action.node
    return event.kind is RecoveryKind.NODE and node in event.nodes


def causes(events: list[RecoveryEvent], chaos: list[FiredAction]) -> list[FiredAction | None]:
    """For every failure event, the chaos record of the action that caused it, or None: of
    the fired actions not yet paired that lost the event's target before its detection, the
    one that fired last. Not the first: an earlier fault on the same target that lost nothing
    (a partition of node 3 that healed in time) would take the failure of a later one (the
    kill of node 3's agent), and that one's row would say nothing was lost."""
    unmatched = [c for c in chaos if c.fired_at]
    found: list[FiredAction | None] = []
    for event in events:
        candidates = [c for c in unmatched if _matches(c, event)]
        cause = max(candidates, key=lambda c: c.fired_at or 0.0, default=None)
        if cause is not None:
            unmatched.remove(cause)
        found.append(cause)
    return found


def failure_rows(events: list[RecoveryEvent], chaos: list[FiredAction]) -> list[FailureRow]:
    """Pair every failure event with the chaos action that caused it, if any."""
    rows = []
    for index, (event, cause) in enumerate(zip(events, causes(events, chaos), strict=True)):
        t0 = cause.fired_at if cause is not None and cause.fired_at else event.detected_at
        resumed = settled_at(events, index)
        replaced = event.replacements
        if cause is not None:
            what = cause.action
        elif event.kind is RecoveryKind.COLD_START:
            what = f"cold start: {event.reason}, {event.old_world} ranks then"
        else:
            what = f"{event.kind.value} lost ({event.reason})"
        rows.append(
            FailureRow(
                cause=what,
                lost=dict(event.lost),
                detected_s=event.detected_at - t0 if cause else None,
                recovered_s=resumed - t0 if resumed else None,
                restore_step=event.restore_step,
                pulls=sorted(event.pulls, key=lambda p: p.rank),
                fallback=event.fallback,
                superseded=superseded(events, event),
                restarted={
                    r: (replaced[r][0] if r in replaced else None, at - t0)
                    for r, at in sorted(event.restarted.items())
                },
                in_place={
                    r: (replaced[r][0] if r in replaced else None, count)
                    for r, count in sorted(event.in_place.items())
                },
                change=(
                    f"the world grew to {event.grown_to} ranks"
                    if event.grown_to is not None
                    else f"the world shrank to {event.shrunk_to} ranks"
                    if event.shrunk_to is not None
                    else ""
                ),
            )
        )
    return rows


def format_failures(events: list[RecoveryEvent], chaos: list[FiredAction]) -> list[str]:
    """Human lines: per failure, detection, recovery and where every rank's state came from."""
    lines = []
    for row in failure_rows(events, chaos):
        where = ", ".join(f"rank {r} on node {n}" for r, n in sorted(row.lost.items()))
        head = f"- {row.cause}: lost {where}" if where else f"- {row.cause}"
        lines.append(head + (f"; {row.change}" if row.change else ""))
        if row.detected_s is not None:
            if row.cause.startswith("add node"):
                lines.append(
                    f"    joined {row.detected_s * 1000:.0f} ms after the node was started"
                )
            else:
                lines.append(f"    detected {row.detected_s * 1000:.0f} ms after the kill")
        if row.fallback:
            lines.append(f"    no memory copy survived: {row.fallback}")
        since = (
            "the node was started"
            if row.cause.startswith("add node")
            else "the job started"
            if row.cause.startswith("cold start")
            else "the kill"
            if row.detected_s is not None
            else "detection"
        )
        for rank, (node, after_s) in row.restarted.items():
            on = f" on node {node}" if node is not None else ""
            lines.append(
                f"    rank {rank} could not leave the aborted epoch: restarted in place{on} "
                f"{after_s:.1f} s after {since}"
            )
        for rank, (node, count) in row.in_place.items():
            lines.append(
                f"    rank {rank} restarted in place on node {node}, from its node's memory "
                f"(its restart {count} in this job)"
            )
        if row.superseded:
            lines.append(
                "    repaired together with the next failure, which struck before this recovery "
                "ended"
                + (
                    f": every rank stepping again {row.recovered_s * 1000:.0f} ms after {since}"
                    if row.recovered_s is not None
                    else ""
                )
            )
        elif row.recovered_s is None:
            lines.append("    NOT RECOVERED")
        else:
            lines.append(
                f"    every rank stepping again {row.recovered_s * 1000:.0f} ms after {since}, "
                f"from step {(row.restore_step if row.restore_step is not None else -1) + 1}"
            )
        for pull in row.pulls:
            ms = pull.seconds * 1000
            if pull.source == STORAGE:
                lines.append(
                    f"    rank {pull.rank} on node {pull.node}: read {pull.bytes:,} bytes "
                    f"from durable storage in {ms:.1f} ms"
                )
            elif pull.source == ERASURE:
                lines.append(
                    f"    rank {pull.rank} on node {pull.node}: rebuilt from its group's "
                    f"pieces and parity, {pull.bytes:,} bytes pulled in {ms:.1f} ms"
                )
            elif pull.source == pull.node:
                lines.append(
                    f"    rank {pull.rank} on node {pull.node}: its node's own memory, "
                    f"no network ({ms:.1f} ms)"
                )
            else:
                lines.append(
                    f"    rank {pull.rank} on node {pull.node}: pulled {pull.bytes:,} bytes "
                    f"from node {pull.source} over TCP in {ms:.1f} ms"
                )
    return lines


def summarize(
    commits: int,
    committed_step: int | None,
    rank_snapshots: int,
    events: list[RecoveryEvent],
    flushes: list[FlushRecord],
    inexact: list[str] | None = None,
) -> dict[str, Any]:
    """The end-of-run summary's figures (the JSON report's ``summary``): ``commits`` steps
    committed over the job, the last committed step, the snapshots the ranks took (one per
    rank and step, as the agents counted them), the last durable step, the faults the job
    survived (failures whose recovery ended: every rank stepping again), and what the ranks'
    audits found a restore cannot reproduce (``inexact``: the ``not exact after a restore``
    warnings)."""
    faults = [
        i
        for i, e in enumerate(events)
        if e.kind not in (RecoveryKind.GROW, RecoveryKind.COLD_START)
    ]
    durable = [f.step for f in flushes if f.state is FlushState.COMMITTED]
    return {
        "protected": commits > 0,
        "snapshots_committed": commits,
        "committed_step": committed_step,
        "rank_snapshots": rank_snapshots,
        "persisted": bool(flushes),
        "durable_step": max(durable) if durable else None,
        "faults": len(faults),
        "faults_survived": sum(settled_at(events, i) is not None for i in faults),
        "inexact": list(inexact or []),
    }


def format_summary(summary: dict[str, Any], state: JobOutcome = JobOutcome.SUCCEEDED) -> list[str]:
    """Human lines of ``summarize``'s figures: what the job was protected by, or that it was
    not (nothing claims a protection it did not give). A job that failed before anything was
    committed is not told how to loop: it may have failed before its loop began."""
    if not summary:
        return []
    if not summary["protected"] and state is JobOutcome.FAILED:
        return ["no snapshot was committed before the job failed"]
    if not summary["protected"]:
        taken = summary["rank_snapshots"]
        return [
            "NOT PROTECTED: no snapshot was taken (loop over ctx.steps)"
            if not taken
            else f"NOT PROTECTED: no snapshot was committed ({taken} taken by the ranks)",
            "    a failure would have started the job again from its first step: iterate "
            "`for step in ctx.steps(total)`, not range(), after ctx.track(model=…, optim=…)",
        ]
    n = summary["snapshots_committed"]
    parts = [
        f"{n} snapshot{'s' if n != 1 else ''} committed",
        f"last committed step {summary['committed_step']}",
    ]
    if summary["persisted"]:
        durable = summary["durable_step"]
        parts.append(f"last durable step {durable if durable is not None else 'none'}")
    faults, survived = summary["faults"], summary["faults_survived"]
    parts.append(
        f"{survived} of {faults} fault{'s' if faults != 1 else ''} survived"
        if survived != faults
        else f"{faults} fault{'s' if faults != 1 else ''} survived"
    )
    lines = ["protection: " + ", ".join(parts)]
    inexact = summary.get("inexact") or []
    if inexact:
        restored = "its restores were" if faults else "a restore would be"
        lines.append(
            f"NOT EXACT: {restored} not bit for bit: the loop uses {len(inexact)} thing(s) "
            "a restore cannot reproduce (the 'not exact after a restore' warnings above); "
            f"the first: {inexact[0]}"
        )
    return lines


def format_report(result: JobResult) -> str:
    """A short human report: how the job ended, per failure detection and recovery, and the
    summary of what protected it."""
    head = f"job {result.state.value} in {result.wall_s:.1f} s"
    if result.reason:
        head += f": {result.reason}"
    lines = [head, *format_failures(result.events, result.chaos)]
    committed = [f for f in result.flushes if f.state is FlushState.COMMITTED]
    failed = [f for f in result.flushes if f.state is FlushState.FAILED]
    if committed:
        steps = ", ".join(str(f.step) for f in committed)
        lines.append(f"durable checkpoints written: step(s) {steps}")
    for f in failed:
        lines.append(f"durable checkpoint of step {f.step} failed: {f.error}")
    lines += format_summary(result.summary, result.state)
    return "\n".join(lines)
