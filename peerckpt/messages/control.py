"""Messages to and from the coordinator: agents' reports, launchers' calls, the event stream.

Every request is a ``Request[R]``: its class name is the RPC method (``/peerckpt.Coordinator/
RegisterAgent``) and ``R`` the class of its reply. ``Watch`` opens a node's event stream, whose
items are ``Event``s: a new epoch, a commit, a resharding round's reads, a flush to write,
the end of the job. ``JobStatus`` is the coordinator's whole view, for launchers and tools.

Sequences (one agent; every call carries the agent's ``node``)::

    agent ── RegisterAgent ─────────▶ coordinator      (again, with ``rejoin``, after it restarts)
    agent ◀─ Watch: EpochOpened, Commit, Reads, Flush, Shutdown
    agent ── Heartbeat (every ~heartbeat_timeout/5)
    agent ── ProcJoined / ProcLost ─▶                  (its local processes)
    agent ── Replicated ────────────▶                  (a snapshot has all its buddies' acks)
    agent ── ReplicatedMany ────────▶                  (several at once, ready together)
    agent ── Resumed / Done / RankFailed / Wants ▶     (relayed for its ranks)
    agent ── Unreshardable ─────────▶                  (rank 0's, relayed)
    agent ── Inexact ───────────────▶                  (a rank's audit findings, relayed)
    agent ── ReplicationFailed / Flushed ▶

Pure data: no I/O here.

Its length (~460 lines) is one short frozen dataclass per message of the coordinator's
protocol; they stay in one file so the protocol reads in one place.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from peerckpt.columns import ChunkColumns
from peerckpt.membership import Membership
from peerckpt.messages import Message, message
from peerckpt.states import EpochMode, FlushState, JobState, ProcRole, RecoveryKind

R = TypeVar("R")


class Request(Message, Generic[R]):
    """A call to the coordinator whose reply is an ``R``."""


class Event(Message):
    """An item of a node's ``Watch`` stream."""


def reply_class(cls: type[Any]) -> type[Any]:
    """The reply class a request class names as its ``R``."""
    for base in getattr(cls, "__orig_bases__", ()):
        if typing.get_origin(base) is Request:
            (arg,) = typing.get_args(base)
            if isinstance(arg, typing.ForwardRef):
                arg = arg.__forward_arg__
            if isinstance(arg, str):
                arg = getattr(sys.modules[cls.__module__], arg)
            return typing.cast(type[Any], arg)
    raise TypeError(f"{cls.__name__} is not a Request")


@message("ok")
@dataclass(frozen=True)
class Ok(Message):
    """The reply of a call that returns nothing."""


# -- registration and liveness ---------------------------------------------------------------
@message("held_copy")
@dataclass(frozen=True)
class HeldCopy(Message):
    """A snapshot copy an agent holds (for a restarted coordinator's rebuild): complete, or a
    buddy's partial copy lacking the ``absent`` chunks (redundancy-aware replication), and
    the digest of the rank's declared data-parallel chunks (``""``: none declared), by which
    the coordinator finds the twins that hold what a partial copy lacks."""

    rank: int
    step: int
    gen: int
    used_bytes: int
    absent: tuple[int, ...] = ()
    digest: str = ""


@message("proc_report")
@dataclass(frozen=True)
class ProcReport(Message):
    """A live local process, as its agent knows it."""

    pid: int
    role: ProcRole
    rank: int | None
    replicas: int | None = None
    persist: dict[str, Any] | None = None  # its @resilient(persist=…), PersistConfig form
    erasure: str | None = None  # its @resilient(erasure="K+M")


@message("rejoin_state")
@dataclass(frozen=True)
class RejoinState(Message):
    """What an agent tells a restarted coordinator: its epoch, processes and copies."""

    membership: Membership | None
    committed_step: int | None
    held: list[HeldCopy]
    layouts: dict[int, list[Any]]  # rank → its chunk layout of the committed step
    procs: list[ProcReport]


@message("agent_config")
@dataclass(frozen=True)
class AgentConfig(Message):
    """The coordinator's answer to a registration. ``lost``: declared lost while it was away."""

    replicas: int | None
    heartbeat_timeout: float
    lost: bool = False
    record_digests: bool = False  # report every snapshot's tensor digests (``peerckpt chaos``)
    stall_timeout: float | None = None  # fence a rank stuck this long (``replication/stall.py``)


@message("RegisterAgent")
@dataclass(frozen=True)
class RegisterAgent(Request[AgentConfig]):
    node: int
    data_addr: str
    spare_node: bool = False
    joining: int = 0  # ranks this node brings to a running job (``peerckpt join``)
    rejoin: RejoinState | None = None


@message("heartbeat_reply")
@dataclass(frozen=True)
class HeartbeatReply(Message):
    epoch: int


@message("node_stats")
@dataclass(frozen=True)
class NodeStats(Message):
    """What an agent reports of its node with each heartbeat, for observers only
    (``replication/stats.py``): counters since it started, the newest snapshot step of each
    local rank, the bytes its arena holds by kind (slots, replicas, staging), and the step
    each local rank's loop runs (the live step, which chaos actions fire on) with the loop's
    total (``ctx.steps(total)``, once known)."""

    snapshot_bytes: int
    snapshots: int
    replicated_bytes: int
    latest_step: dict[int, int]
    memory: dict[str, int]
    live_step: dict[int, int] = field(default_factory=dict)
    steps_total: int | None = None


@message("Heartbeat")
@dataclass(frozen=True)
class Heartbeat(Request[HeartbeatReply]):
    node: int
    epoch: int
    stats: NodeStats | None = None


@message("node_allocated")
@dataclass(frozen=True)
class NodeAllocated(Message):
    node: int


@message("AllocateNode")
@dataclass(frozen=True)
class AllocateNode(Request[NodeAllocated]):
    """A free node index for a node about to join (``peerckpt join``, chaos ``add node``).
    ``spares_only``: the node will hold spares only (``--keep-spares`` opening a fresh spare
    node); the world keeps its size, so a job that cannot reshard does not refuse it."""

    spares_only: bool = False


@message("SparesStarting")
@dataclass(frozen=True)
class SparesStarting(Request[Ok]):
    """``count`` more spares are starting (they join once warmed up)."""

    count: int
    node: int | None = None


@message("ProcJoined")
@dataclass(frozen=True)
class ProcJoined(Request[Ok]):
    node: int
    proc: ProcReport


@message("ProcLost")
@dataclass(frozen=True)
class ProcLost(Request[Ok]):
    """Process ``pid`` on ``node`` is gone. ``in_place``: it announced a restart in place (a
    survivor that could not leave an aborted epoch; a fresh process on its node follows)."""

    node: int
    pid: int
    reason: str
    in_place: bool = False


# -- progress of ranks -----------------------------------------------------------------------
@message("Replicated")
@dataclass(frozen=True)
class Replicated(Request["ReplicatedReply"]):
    """``rank``'s snapshot of ``step`` is complete on every node of ``holders``.

    ``layout`` (its chunk records, message form) travels on a rank's first report of an
    epoch and whenever it changed; ``meta_nbytes``, the size of its blob, every time.
    With ``partial``, ``holders`` but the rank's own node hold the snapshot without its
    data-parallel chunks, which the coordinator counts on the twins' nodes once it verified
    ``twins`` (``recovery/twins.py``).
    """

    node: int
    epoch: int
    rank: int
    step: int
    holders: list[int]
    nbytes: int
    meta_nbytes: int
    digest: str = ""
    layout: list[Any] | None = None
    # Redundancy-aware replication (``replication/dedup.py``): the digest of the chunks the
    # rank declared data-parallel, whether the buddies in ``holders`` got only the others
    # (``partial``), how many bytes that left out, and which chunks (indices in ``layout``):
    # a resharding plan reads those from the twins (``recovery/twins.py``).
    twins: str = ""
    partial: bool = False
    deduplicated: int = 0
    absent: tuple[int, ...] = ()
    # Asked for by ``AgentConfig.record_digests``: every tensor's digest, in chunk order
    # (``SnapshotManifest.tensor_digests``), so that a difference can be named.
    tensors: dict[str, str] = field(default_factory=dict)
    # ``layout`` as columns (``peerckpt/columns.py``), as agents send it: at 10,000 ranks a
    # record per chunk cost the coordinator more than the plan (either field, not both).
    columns: ChunkColumns | None = None


@message("ReplicatedMany")
@dataclass(frozen=True)
class ReplicatedMany(Request["ReplicatedReply"]):
    """Several of node ``node``'s ``Replicated`` reports in one call: those that became ready
    while its previous report was on its way (``CoordinatorLink.report_replicated``)."""

    node: int
    reports: list[Replicated]


@message("replicated_reply")
@dataclass(frozen=True)
class ReplicatedReply(Message):
    committed: int | None


@message("pull")
@dataclass(frozen=True)
class Pull(Message):
    """Where some of a rank's restored state came from: ``source`` is a node, the rank's
    own node (no network), or ``STORAGE``. ``round`` numbers resharding rounds."""

    rank: int
    node: int
    source: int
    bytes: int
    seconds: float
    round: int | None = None


@message("Resumed")
@dataclass(frozen=True)
class Resumed(Request[Ok]):
    """``rank`` is stepping again in ``epoch``. ``holds_committed``: its node now holds its
    committed snapshot (a restore in the same layout copies it into the rank's own slot)."""

    node: int
    epoch: int
    rank: int
    pulls: list[Pull] = field(default_factory=list)
    holds_committed: bool = False


@message("Done")
@dataclass(frozen=True)
class Done(Request[Ok]):
    node: int
    epoch: int
    rank: int


@message("Unreshardable")
@dataclass(frozen=True)
class Unreshardable(Request[Ok]):
    """Rank 0 tracks ``objects`` (one line each: its name and what it is), data loaders or
    samplers whose state cannot follow a change of world size (``runtime/reshardable.py``): the
    coordinator then refuses to start the job elastic and refuses nodes that join."""

    node: int
    epoch: int
    rank: int
    objects: list[str]


@message("Inexact")
@dataclass(frozen=True)
class Inexact(Request[Ok]):
    """A rank's audit findings (``InexactState``, relayed): the job's report says that its
    restores were not exact, and why."""

    node: int
    epoch: int
    rank: int
    findings: list[str]


@message("RankFailed")
@dataclass(frozen=True)
class RankFailed(Request[Ok]):
    """A rank (or its agent preparing it) raised. ``error`` is the exception class's name;
    ``unreachable``: a RecoveryFailed that could not reach some source (``errors.py``)."""

    node: int
    epoch: int
    rank: int
    error: str
    message: str
    unreachable: bool = False


@message("ReplicationFailed")
@dataclass(frozen=True)
class ReplicationFailed(Request[Ok]):
    """A snapshot could not be mirrored to ``buddy``; ``fatal``: the buddy refused it."""

    node: int
    epoch: int
    rank: int
    step: int
    buddy: int
    message: str
    fatal: bool


@message("Wants")
@dataclass(frozen=True)
class Wants(Request[Ok]):
    """The boxes a resharding rank needs for one round (chunk records, message form)."""

    node: int
    epoch: int
    round: int
    rank: int
    chunks: list[Any]
    columns: ChunkColumns | None = None  # ``chunks`` as columns, as agents send them


@message("Flushed")
@dataclass(frozen=True)
class Flushed(Request[Ok]):
    """A writer finished its share of a durable flush (or failed, with ``error``)."""

    node: int
    step: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


@message("Stop")
@dataclass(frozen=True)
class Stop(Request[Ok]):
    """End the job. ``flush``: once its last committed step is durable (a launcher told to
    stop by a signal; it waits a bounded time, then stops without it)."""

    reason: str = "stopped by the launcher"
    flush: bool = False


# -- the event stream ------------------------------------------------------------------------
@message("Watch")
@dataclass(frozen=True)
class Watch(Request[Event]):
    """Open node ``node``'s event stream (a server stream of ``Event``s)."""

    node: int


@message("epoch_opened")
@dataclass(frozen=True)
class EpochOpened(Event):
    membership: Membership


@message("commit")
@dataclass(frozen=True)
class Commit(Event):
    """Step ``step`` of ``epoch`` is committed (also relayed by agents to their ranks).

    ``largest_snapshot``: the bytes of the largest rank's snapshot, so that a spare node's
    agent keeps slots of that size ready (``replication/spares.py``); 0 when not known."""

    epoch: int
    step: int
    largest_snapshot: int = 0


@message("reads")
@dataclass(frozen=True)
class Reads(Event):
    """A resharding round was planned: each local rank's reads (``peerckpt/reads.py`` form)."""

    epoch: int
    round: int
    reads: dict[int, dict[str, Any]]


@message("replicate_whole")
@dataclass(frozen=True)
class ReplicateWhole(Event):
    """Push ``rank``'s snapshot of ``step`` to its buddies whole, and every later one of
    ``epoch``: its data-parallel chunks differ from its twins', or too few twins hold them
    (``recovery/twins.py``). The step commits once that push is acknowledged."""

    epoch: int
    rank: int
    step: int


@message("flush")
@dataclass(frozen=True)
class Flush(Event):
    """Write this node's share of committed ``step``: (rank, chunk record) pairs."""

    step: int
    epoch: int
    gen: int
    persist: dict[str, Any]  # PersistConfig form
    chunks: list[tuple[int, Any]]


@message("shutdown")
@dataclass(frozen=True)
class Shutdown(Event):
    """The job ended (also relayed by agents to their processes)."""

    state: JobState
    reason: str = ""


# -- status ----------------------------------------------------------------------------------
@message("recovery_event")
@dataclass(frozen=True)
class RecoveryEvent(Message):
    """One membership change and its recovery, as it progresses (replaced, never mutated).

    ``kind``: ``RANK`` or ``NODE`` (a loss), ``GROW`` (a node joined), ``COLD_START``,
    ``RENDEZVOUS`` (a restarted coordinator's ranks form their group again); it travels as
    its value, the string the report and ``peerckpt status --json`` show.
    """

    kind: RecoveryKind
    ranks: list[int]
    nodes: list[int]
    reason: str
    lost: dict[int, int]  # rank → node it was on
    detected_at: float
    from_epoch: int
    pulls: list[Pull] = field(default_factory=list)
    resumed_at: float | None = None
    epoch: int | None = None
    restore_step: int | None = None
    mode: EpochMode | None = None
    replacements: dict[int, list[int]] = field(default_factory=dict)  # rank → [node, pid]
    shrunk_to: int | None = None
    grown_to: int | None = None
    old_world: int | None = None
    url: str | None = None
    fallback: str = ""
    partial: bool = False
    waited_for_spares_s: float | None = None
    # rank → when (wall clock) its process, a survivor that could not leave the aborted
    # epoch, was restarted in place during this recovery: part of its cost, not a new failure
    restarted: dict[int, float] = field(default_factory=dict)
    # rank → which of its restarts in place (1 … --max-restarts) this was: a lost rank that
    # a fresh process on its own node took, restoring from that node's memory
    in_place: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The report's JSON form (``peerckpt run --report``): fields that are set."""
        from peerckpt.messages import encode

        out = encode(self)
        del out["type"]
        return {k: v for k, v in out.items() if v is not None or k == "resumed_at"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecoveryEvent:
        """An event read back from its JSON form (``to_json``): JSON wrote the integer keys
        of its maps as strings, and a report written by hand may leave out a pull's type."""
        from peerckpt.messages import decode

        keyed = {k: _int_keys(data[k]) for k in _INT_KEYED if k in data}
        pulls = [{**p, "type": Pull.TYPE} for p in data.get("pulls", [])]
        return decode({**data, **keyed, "pulls": pulls, "type": cls.TYPE}, cls, where="a report")


@message("flush_record")
@dataclass(frozen=True)
class FlushRecord(Message):
    step: int
    state: FlushState
    error: str
    started_at: float
    committed_at: float | None
    nbytes: int
    writers: dict[int, float | None]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FlushRecord:
        """A flush read back from its JSON form (``encode``): the writers' ranks as strings."""
        from peerckpt.messages import decode

        writers = _int_keys(data.get("writers", {}))
        return decode({**data, "writers": writers, "type": cls.TYPE}, cls, where="a report")


# The maps of a recovery event keyed by rank: JSON writes those keys as strings.
_INT_KEYED = ("lost", "replacements", "restarted", "in_place")


def _int_keys(d: dict[Any, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


@message("job_status")
@dataclass(frozen=True)
class JobStatus(Message):
    """The coordinator's view of the job."""

    job: str
    state: JobState
    reason: str
    epoch: int
    world_size: int
    min_nodes: int | None
    committed_step: int | None
    last_replicated: dict[int, int]
    ranks: dict[int, list[int]]  # rank → [node, pid]
    spares: list[list[int]]  # [node, pid]
    nodes: dict[int, bool]  # node → alive
    events: list[RecoveryEvent]
    flushes: list[FlushRecord]
    flush_skipped: list[int]
    # For observers (``recovery/observed.py``): nodes holding each rank's committed copy
    # (-1: durable storage), each rank's buddies, the ranks resumed in this epoch, the spare
    # nodes, every node's last heartbeat report, and the replicas per rank.
    holders: dict[int, list[int]] = field(default_factory=dict)
    placement: dict[int, list[int]] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    spare_nodes: list[int] = field(default_factory=list)
    node_stats: dict[int, NodeStats] = field(default_factory=dict)
    replicas: int | None = None
    # Restarts in place the coordinator waits for: rank → [node, pid of the process lost];
    # the launcher that started that process starts a fresh one on the node, once.
    in_place: dict[int, list[int]] = field(default_factory=dict)
    # Every live node's agent (data address): where the coordinator moves if its host dies
    # (``peerckpt/succession.py``); the hosts' launchers read it.
    node_addrs: dict[int, str] = field(default_factory=dict)
    commits: int = 0  # steps committed since this coordinator started (the end-of-run summary)
    refused_joins: dict[int, str] = field(default_factory=dict)  # node → why it may not join
    # What the ranks' audits found a restore cannot reproduce (``Inexact``), each line once
    inexact: list[str] = field(default_factory=list)


@message("Status")
@dataclass(frozen=True)
class Status(Request[JobStatus]):
    pass


UNARY: tuple[type[Any], ...] = (
    RegisterAgent,
    Heartbeat,
    AllocateNode,
    SparesStarting,
    ProcJoined,
    ProcLost,
    Replicated,
    ReplicatedMany,
    Resumed,
    Done,
    Unreshardable,
    Inexact,
    RankFailed,
    ReplicationFailed,
    Wants,
    Flushed,
    Stop,
    Status,
)
STREAMS: tuple[type[Any], ...] = (Watch,)
