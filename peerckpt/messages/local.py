"""Messages between a rank process and its node agent (the Unix-socket control link).

The rank's side is ``runtime/channel.py``, the agent's ``replication/control.py``. A process
connects, proves the job's secret and introduces itself with a ``ProcHello`` (inside the
handshake). Then::

    rank ── AllocSlot ─────────▶ agent ── SlotGranted ─▶ rank      (requests: ``req`` ids)
    rank ── Restarting ────────▶ agent ── Granted ─────▶ rank
    rank ── SnapshotTaken / RankResumed / RankDone / RankError / WantChunks / ReleaseStaging
    rank ── UnreshardableState (rank 0, at ctx.track, when it tracks a loader that cannot reshard)
    rank ── InexactState (after its first snapshot, when its audit found what cannot be restored)
    rank ── ProcSettings (a spare, once it has the decorator's settings)
    rank ── Beat (every HEARTBEAT_S)
    agent ─ Abort / EpochStart / Arrived / Commit / Staging / Shutdown / Fenced ─▶ rank  (events)

A request's reply travels as ``Reply``: the answer as its payload, or an error (the class
name of the agent's exception and its message). ``AgentLost`` never crosses the wire: the
rank's reader makes it when the link closes.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from peerckpt.manifest import SnapshotManifest
from peerckpt.messages import Message, message
from peerckpt.states import EpochMode, ProcRole

# A rank writes every thread's Python stack to its stderr on this signal (faulthandler): its
# agent sends it when the rank's step stops moving (``replication/stall.py``).
STACK_SIGNAL = signal.SIGRTMIN + 6


class ToAgent(Message):
    """Sent by a rank process to its agent."""


class ToRank(Message):
    """Sent by an agent to one of its rank processes."""


@message("proc_hello")
@dataclass(frozen=True)
class ProcHello(Message):
    """Who a process is; the fields of its handshake's ``auth`` frame."""

    role: ProcRole
    pid: int
    rank: int | None = None
    replicas: int | None = None  # rank 0's @resilient(replicas=…)
    persist: dict[str, Any] | None = None  # rank 0's @resilient(persist=…), PersistConfig form
    erasure: str | None = None  # rank 0's @resilient(erasure="K+M")
    stacks: bool = False  # it writes its stacks on STACK_SIGNAL (its default would end it)


# -- requests (a reply each) -----------------------------------------------------------------
@message("alloc")
@dataclass(frozen=True)
class AllocSlot(ToAgent):
    """Make (or grow) own slot ``slot`` of ``rank`` to hold ``nbytes``."""

    epoch: int
    rank: int
    slot: int
    nbytes: int


@message("slot_granted")
@dataclass(frozen=True)
class SlotGranted(Message):
    path: str
    size: int


@message("restarting")
@dataclass(frozen=True)
class Restarting(ToAgent):
    """The process cannot leave an aborted epoch; a fresh one on this node takes its place."""

    reason: str


@message("granted")
@dataclass(frozen=True)
class Granted(Message):
    """The reply of a request that returns nothing."""


@message("reply")
@dataclass(frozen=True)
class Reply(ToRank):
    """The answer to request ``req``: ``answer`` (payload), or ``error`` and ``message``."""

    PAYLOAD = "answer"

    req: int
    answer: dict[str, Any] | None = None
    error: str = ""  # the class name of the agent's PeerckptError
    message: str = ""


# -- notices ---------------------------------------------------------------------------------
@message("hb")
@dataclass(frozen=True)
class Beat(ToAgent):
    """The process is alive (a few times a second); inside ``ctx.steps``, the rank it is,
    the step it runs and the loop's total (the live step: chaos actions fire on it), and
    whether it waits in a collective peerckpt watches (``replication/stall.py``)."""

    rank: int | None = None
    step: int | None = None
    total: int | None = None
    waiting: bool = False


@message("snapshot")
@dataclass(frozen=True)
class SnapshotTaken(ToAgent):
    """Own slot ``slot`` now holds the snapshot ``manifest`` describes (its payload)."""

    PAYLOAD = "manifest"

    epoch: int
    rank: int
    step: int
    slot: int
    manifest: SnapshotManifest


@message("resumed")
@dataclass(frozen=True)
class RankResumed(ToAgent):
    epoch: int
    rank: int
    step: int


@message("done")
@dataclass(frozen=True)
class RankDone(ToAgent):
    epoch: int
    rank: int


@message("unreshardable")
@dataclass(frozen=True)
class UnreshardableState(ToAgent):
    """Rank 0 tracks ``objects`` whose state cannot follow a change of world size (data
    loaders and samplers without ``load_resharded_state``), one line each; sent at
    ``ctx.track``, relayed to the coordinator as ``Unreshardable``."""

    epoch: int
    rank: int
    objects: list[str]


@message("inexact")
@dataclass(frozen=True)
class InexactState(ToAgent):
    """What a rank's audit found its loop uses that a restore cannot reproduce
    (``runtime/audit.py``: the ``not exact after a restore`` warnings, one line each); sent
    after its first snapshot, relayed to the coordinator as ``Inexact``."""

    epoch: int
    rank: int
    findings: list[str]


@message("proc_settings")
@dataclass(frozen=True)
class ProcSettings(ToAgent):
    """The decorator's settings of a process that said hello with the defaults: a spare, a
    restarted or a joining process waits for its rank at ``import peerckpt``, before the
    decorator runs (``runtime/standby.py``). The agent keeps them as its hello's, which it
    reports to a restarted coordinator: after every first-epoch process was replaced, a
    restarted coordinator learnt the job's ``replicas``, ``persist`` and ``erasure`` from the
    defaults the spares said hello with."""

    replicas: int | None = None
    persist: dict[str, Any] | None = None
    erasure: str | None = None


@message("rank_error")
@dataclass(frozen=True)
class RankError(ToAgent):
    """The user's function raised ``error`` (its class name) with ``message``."""

    epoch: int
    rank: int
    error: str
    message: str


@message("wants")
@dataclass(frozen=True)
class WantChunks(ToAgent):
    """The boxes a resharding rank needs in round ``round`` (chunk records, message form)."""

    PAYLOAD = "chunks"

    epoch: int
    rank: int
    round: int
    chunks: list[Any]


@message("release")
@dataclass(frozen=True)
class ReleaseStaging(ToAgent):
    """The rank restored from its staging slot of ``round``: free it."""

    epoch: int
    rank: int
    round: int


# -- events ----------------------------------------------------------------------------------
@message("abort")
@dataclass(frozen=True)
class Abort(ToRank):
    """Epoch ``epoch`` begins: leave the current one now."""

    epoch: int


@message("restore_plan")
@dataclass(frozen=True)
class RestorePlan(Message):
    """What a rank restores in its new epoch.

    ``SAME``: its committed snapshot ``step``, in own slot ``slot`` at ``path`` (described by
    the event's manifest); with ``arriving`` the agent is still pulling it from a peer and
    says where it is with ``Arrived`` (the rank joins its group and builds its objects
    meanwhile). ``RESHARD``: ``step`` of the old layout of ``old_world`` ranks, through
    resharding rounds; ``previous_rank`` is the rank this process was (None: new).
    """

    mode: EpochMode
    step: int
    slot: int | None = None
    path: str | None = None
    previous_rank: int | None = None
    old_world: int = 0
    arriving: bool = False


@message("restore_body")
@dataclass(frozen=True)
class RestoreBody(Message):
    """The large part of an ``EpochStart``: the restore slot's manifest, the old layout."""

    manifest: SnapshotManifest | None = None
    old_layout: dict[str, Any] | None = None


@message("epoch")
@dataclass(frozen=True)
class EpochStart(ToRank):
    """This process is ``rank`` of ``world_size`` in ``epoch``; ``restore`` says from what."""

    PAYLOAD = "body"

    epoch: int
    rank: int
    world_size: int
    local_rank: int
    node: int
    store_addr: str
    hosts: list[str]
    restore: RestorePlan | None
    body: RestoreBody


@message("arrived")
@dataclass(frozen=True)
class Arrived(ToRank):
    """The committed snapshot an ``arriving`` restore waits for is verified in own slot
    ``slot`` at ``path`` (``manifest``)."""

    PAYLOAD = "manifest"

    epoch: int
    slot: int
    path: str
    manifest: SnapshotManifest


@message("staging")
@dataclass(frozen=True)
class Staging(ToRank):
    """Round ``round``'s boxes are gathered in the segment at ``path`` (``manifest``)."""

    PAYLOAD = "manifest"

    epoch: int
    round: int
    path: str
    manifest: SnapshotManifest


@message("fenced")
@dataclass(frozen=True)
class Fenced(ToRank):
    """Declared lost while silent: this process must never act in the job again."""

    reason: str


@message("agent_lost")
@dataclass(frozen=True)
class AgentLost(ToRank):
    """Made by the rank's reader when the link closes (never sent)."""
