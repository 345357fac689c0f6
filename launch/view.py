"""One view of a running job, built from the coordinator's ``Status`` reply: what every
observer shows — the metrics (``metrics.py``), the status page (``statuspage.py``) and
``peerckpt status`` (``console.py``).

Pure functions and frozen records; no I/O. The status is the typed reply, read by its
attributes; only ``JobView.to_json`` writes JSON.

Recovery phases, per failure: *detection* is from the fault to the coordinator's decision
(known only when the launcher injected the fault, so that it knows when it struck);
*transfer* is the time agents spent obtaining the lost state (their own memory, a peer's
over TCP, or storage; the slowest rank of each resharding round, summed over the rounds);
*restore* is the rest, until every rank steps again: opening the epoch, aborting and
re-forming the process group, copying the state into the model.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from peerckpt.chaos import FiredAction
from peerckpt.launch.report import causes, settled_at, superseded
from peerckpt.messages.control import FlushRecord, JobStatus, NodeStats, Pull, RecoveryEvent
from peerckpt.reads import STORAGE
from peerckpt.states import EpochMode, FlushState, JobState, RecoveryKind


class RepairKind(enum.Enum):
    """How a failure was repaired, as the metrics count recoveries (their ``kind`` label)."""

    RANK = "rank"  # a process replaced
    NODE = "node"  # a node's ranks replaced
    RESHARD = "reshard"  # the world changed size
    STORAGE = "storage"  # state read from durable storage


PHASES = ("detection", "transfer", "restore")
RECENT = 10  # recoveries a view keeps (the metrics count all of them)


@dataclass(frozen=True)
class NodeView:
    """One node: health, the ranks it runs, what its agent reported last."""

    node: int
    alive: bool
    spare: bool  # started as a spare node (it may run ranks since)
    ranks: tuple[int, ...]
    memory: dict[str, int]  # slots, replicas, staging → bytes of its arena (none once lost)
    snapshot_bytes: int
    snapshots: int
    replicated_bytes: int


@dataclass(frozen=True)
class RankView:
    """One rank: where it runs and where its committed state is."""

    rank: int
    node: int
    pid: int
    copies: tuple[int, ...]  # nodes holding its committed step, whole or partial (-1: storage)
    buddies: tuple[int, ...]  # nodes it replicates to in this epoch
    replicated_step: int | None  # its newest step on all its buddies
    snapshot_step: int | None  # its newest snapshot known (heartbeat or replication report)
    lag: int | None  # snapshot_step - committed step: steps a failure now would train again


@dataclass(frozen=True)
class RecoveryView:
    """One failure and what its repair cost."""

    kind: RepairKind
    cause: str
    epoch: int | None  # the epoch it opened
    fault_at: float | None  # when the launcher injected it (wall clock), if it did
    detected_at: float
    resumed_at: float | None  # every rank stepping again; None while repairing (or superseded)
    detection_s: float | None
    transfer_s: float | None
    restore_s: float | None
    # fault (else detection) → every rank stepping again: after this recovery, or, when a newer
    # failure superseded it, after the recovery that repaired both
    total_s: float | None
    restore_step: int | None
    lost: dict[int, int]  # rank → the node it was on
    network_bytes: int  # pulled from peers over TCP
    storage_bytes: int  # read from durable storage
    local_bytes: int  # taken from the rank's own node's memory
    superseded: bool  # a newer failure opened an epoch before this one resumed


@dataclass(frozen=True)
class JobView:
    """Everything an observer shows about the job at one instant."""

    job: str
    state: JobState
    reason: str
    epoch: int
    world_size: int
    replicas: int | None
    committed_step: int | None
    durable_step: int | None
    lag: int | None  # the largest rank lag
    spares: int
    nodes: tuple[NodeView, ...]
    ranks: tuple[RankView, ...]
    recoveries: tuple[RecoveryView, ...]  # the last RECENT, oldest first
    recoveries_total: dict[RepairKind, int]  # finished recoveries, over the whole job
    phase_seconds: dict[str, tuple[float, ...]]  # phase → every finished recovery's, in order
    recovering: bool  # a recovery is under way
    flushes: dict[FlushState, int] = field(default_factory=dict)  # durable flushes by state

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``peerckpt status --json``, ``/status.json``)."""
        out = asdict(self)
        out["state"] = self.state.value
        out["flushes"] = {s.value: n for s, n in self.flushes.items()}
        out["recoveries_total"] = {k.value: n for k, n in self.recoveries_total.items()}
        for r in out["recoveries"]:
            r["kind"] = r["kind"].value
            r["lost"] = {str(k): v for k, v in r["lost"].items()}
        return out


def recovery_kind(event: RecoveryEvent) -> RepairKind:
    """The metrics' kind of a failure event: storage, reshard, rank or node."""
    if (
        event.kind is RecoveryKind.COLD_START
        or event.fallback
        or any(p.source == STORAGE for p in event.pulls)
    ):
        return RepairKind.STORAGE
    if event.mode is EpochMode.RESHARD or event.kind is RecoveryKind.GROW:
        return RepairKind.RESHARD
    return RepairKind.NODE if event.kind is RecoveryKind.NODE else RepairKind.RANK


def transfer_seconds(pulls: list[Pull]) -> float | None:
    """The slowest rank's transfer per resharding round, summed over the rounds."""
    by_round: dict[int, float] = {}
    for p in pulls:
        r = p.round or 0
        by_round[r] = max(by_round.get(r, 0.0), p.seconds)
    return sum(by_round.values()) if by_round else None


def recovery_views(events: list[RecoveryEvent], chaos: list[FiredAction]) -> list[RecoveryView]:
    """Every failure event with its cause (a chaos record, if the launcher injected it) and
    the cost of its repair, by phase."""
    out = []
    for index, (event, cause) in enumerate(zip(events, causes(events, chaos), strict=True)):
        detected, resumed = event.detected_at, event.resumed_at
        settled = settled_at(events, index)
        fault_at = cause.fired_at if cause is not None else None
        transfer = transfer_seconds(event.pulls)
        restore = None
        if resumed is not None:
            restore = max(0.0, resumed - detected - (transfer or 0.0))
        net = storage = local = 0
        for p in event.pulls:
            if p.source == STORAGE:
                storage += p.bytes
            elif p.source == p.node:
                local += p.bytes
            else:
                net += p.bytes
        out.append(
            RecoveryView(
                kind=recovery_kind(event),
                cause=cause.action if cause is not None else f"{event.kind.value}: {event.reason}",
                epoch=event.epoch,
                fault_at=fault_at,
                detected_at=detected,
                resumed_at=resumed,
                detection_s=detected - fault_at if fault_at is not None else None,
                transfer_s=transfer,
                restore_s=restore,
                total_s=settled - (fault_at if fault_at is not None else detected)
                if settled is not None
                else None,
                restore_step=event.restore_step,
                lost=dict(event.lost),
                network_bytes=net,
                storage_bytes=storage,
                local_bytes=local,
                superseded=superseded(events, event),
            )
        )
    return out


def durable_step(flushes: list[FlushRecord]) -> int | None:
    """The newest step written to durable storage and committed there."""
    steps = [f.step for f in flushes if f.state is FlushState.COMMITTED]
    return max(steps) if steps else None


def build_view(
    status: JobStatus,
    events: list[RecoveryEvent] | None = None,
    chaos: list[FiredAction] | None = None,
    node_stats: dict[int, NodeStats] | None = None,
) -> JobView:
    """The view of ``status`` (a ``Status`` reply). ``events`` replaces its failure events
    (a launcher knows those of coordinators before a restart), ``chaos`` says which the
    launcher injected, ``node_stats`` replaces its nodes' reports (a launcher keeps those of
    nodes a restarted coordinator never heard of)."""
    events = status.events if events is None else events
    stats = status.node_stats if node_stats is None else node_stats
    committed = status.committed_step
    replicated = status.last_replicated
    latest: dict[int, int] = {}
    for s in stats.values():
        latest.update(s.latest_step)
    ranks = []
    for rank, (node, pid) in sorted(status.ranks.items()):
        # The heartbeat's step may be older than the coordinator's replicated one.
        known = [s for s in (latest.get(rank), replicated.get(rank)) if s is not None]
        snap = max(known) if known else None
        ranks.append(
            RankView(
                rank=rank,
                node=node,
                pid=pid,
                copies=tuple(sorted(status.holders.get(rank, []))),
                buddies=tuple(status.placement.get(rank, [])),
                replicated_step=replicated.get(rank),
                snapshot_step=snap,
                lag=max(0, snap - committed)
                if snap is not None and committed is not None
                else None,
            )
        )
    spare_nodes = set(status.spare_nodes)
    nodes = []
    for node, alive in sorted(status.nodes.items()):
        last = stats.get(node)
        nodes.append(
            NodeView(
                node=node,
                alive=alive,
                spare=node in spare_nodes,
                ranks=tuple(r.rank for r in ranks if r.node == node),
                # A lost node's memory is gone with it, whatever it reported last.
                memory=dict(last.memory) if alive and last is not None else {},
                snapshot_bytes=last.snapshot_bytes if last is not None else 0,
                snapshots=last.snapshots if last is not None else 0,
                replicated_bytes=last.replicated_bytes if last is not None else 0,
            )
        )
    recoveries = recovery_views(events, chaos or [])
    finished = [r for r in recoveries if r.resumed_at is not None]
    totals = dict.fromkeys(RepairKind, 0)
    for r in finished:
        totals[r.kind] += 1
    phases = {
        "detection": tuple(r.detection_s for r in finished if r.detection_s is not None),
        "transfer": tuple(r.transfer_s for r in finished if r.transfer_s is not None),
        "restore": tuple(r.restore_s for r in finished if r.restore_s is not None),
        "total": tuple(r.total_s for r in finished if r.total_s is not None),
    }
    flushes: dict[FlushState, int] = {}
    for f in status.flushes:
        flushes[f.state] = flushes.get(f.state, 0) + 1
    lags = [r.lag for r in ranks if r.lag is not None]
    return JobView(
        job=status.job,
        state=status.state,
        reason=status.reason,
        epoch=status.epoch,
        world_size=status.world_size,
        replicas=status.replicas,
        committed_step=committed,
        durable_step=durable_step(status.flushes),
        lag=max(lags) if lags else None,
        spares=len(status.spares),
        nodes=tuple(nodes),
        ranks=tuple(ranks),
        recoveries=tuple(recoveries[-RECENT:]),
        recoveries_total=totals,
        phase_seconds=phases,
        recovering=status.state is JobState.RUNNING
        and any(r.resumed_at is None and not r.superseded for r in recoveries),
        flushes=flushes,
    )
