"""Named states of peerckpt's processes and jobs, each with the one table of its changes.

Every enum whose value changes over time has a transition table here and goes through
``Transitions.check``, which raises on a change the table does not allow, in the style of the
rank's own state machine (``runtime/state.py``). Processes store these enums, never strings;
messages carry their values.

- ``JobState``: the coordinator's view of the whole job.
- ``ProcRole``: what a process of the job is; a spare or a joiner becomes a rank once.
- ``FlushState``: one durable flush, from writing to committed or failed.
- ``EpochMode``: how an epoch restores; the table says which mode may follow which.
- ``SlotKind``: what a shared-memory slot holds. A slot is made as one kind and never
  changes it, so it has no table.
- ``RecoveryKind``: what changed the membership, for one recovery (a record, no table).
- ``ExitCode``: how a process ends, read by launchers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

MAX_RESTARTS = 3  # in-place restarts in a row for one rank's line of processes

S = TypeVar("S", bound=enum.Enum)


class Transitions(Generic[S]):
    """The allowed changes of one enum; ``check`` is the only place that decides."""

    def __init__(self, name: str, allowed: Mapping[S, frozenset[S]]) -> None:
        self.name = name
        self.allowed = allowed

    def check(self, current: S, new: S) -> S:
        """``new``, if ``current`` → ``new`` is allowed; else a RuntimeError (a bug)."""
        if new not in self.allowed[current]:
            raise RuntimeError(f"{self.name} cannot go from {current.name} to {new.name}")
        return new


class JobState(enum.Enum):
    STARTING = "starting"  # ranks are joining; no epoch yet
    RUNNING = "running"
    FINISHING = "finishing"  # ending (every rank done, or stopped): its last step is flushed
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped by the launcher (Ctrl-C, an error of its own)
    RESTARTING = "restarting"  # seen by a launcher only: its coordinator is being restarted

    @property
    def ended(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


_ENDED = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})
JOB = Transitions(
    "job",
    {
        JobState.STARTING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.STOPPED}),
        JobState.RUNNING: frozenset({JobState.FINISHING, *_ENDED}),
        JobState.FINISHING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}),
        JobState.SUCCEEDED: frozenset(),
        JobState.FAILED: frozenset(),
        JobState.STOPPED: frozenset(),
        JobState.RESTARTING: frozenset(),
    },
)


class ProcRole(enum.Enum):
    RANK = "rank"
    SPARE = "spare"  # a hot spare: takes a lost rank's place
    JOINER = "joiner"  # brought by a joining node: becomes a rank when the world grows


ROLE = Transitions(
    "process role",
    {
        ProcRole.RANK: frozenset({ProcRole.RANK}),
        ProcRole.SPARE: frozenset({ProcRole.RANK}),
        ProcRole.JOINER: frozenset({ProcRole.RANK}),
    },
)


class FlushState(enum.Enum):
    WRITING = "writing"  # the agents write their shares
    COMMITTING = "committing"  # every share is written; manifest, marker, ``latest``
    COMMITTED = "committed"
    FAILED = "failed"

    @property
    def busy(self) -> bool:
        return self in (FlushState.WRITING, FlushState.COMMITTING)


FLUSH = Transitions(
    "flush",
    {
        FlushState.WRITING: frozenset({FlushState.COMMITTING, FlushState.FAILED}),
        FlushState.COMMITTING: frozenset({FlushState.COMMITTED, FlushState.FAILED}),
        FlushState.COMMITTED: frozenset(),
        FlushState.FAILED: frozenset(),
    },
)


class EpochMode(enum.Enum):
    FRESH = "fresh"  # nothing committed yet: start over
    SAME = "same"  # same layout: every rank restores its own snapshot, replacements pull it
    RESHARD = "reshard"  # a new layout: every rank gets its boxes through a plan


# Once a step is committed an epoch always restores one: no FRESH after it.
EPOCH_MODE = Transitions(
    "epoch mode",
    {
        EpochMode.FRESH: frozenset(EpochMode),
        EpochMode.SAME: frozenset({EpochMode.SAME, EpochMode.RESHARD}),
        EpochMode.RESHARD: frozenset({EpochMode.SAME, EpochMode.RESHARD}),
    },
)


class SlotKind(enum.Enum):
    OWN = "own"  # a local rank's snapshot (its ping-pong pair)
    REPLICA = "replica"  # a copy of another node's rank
    STAGING = "staging"  # a resharding rank's gathered boxes, freed once it restored


class RecoveryKind(enum.Enum):
    """What one membership change of the coordinator's record (``RecoveryEvent``) was."""

    RANK = "rank"  # ranks lost, their nodes alive
    NODE = "node"  # a node lost, and its ranks with it
    GROW = "grow"  # a node joined the job
    COLD_START = "cold_start"  # the first epoch restored from durable storage
    RENDEZVOUS = "rendezvous"  # a restarted coordinator opened a new epoch of its agents


class ExitCode(enum.IntEnum):
    """How a peerckpt process ends. A launcher reads them; a test may, too."""

    OK = 0
    FAILED = 1  # the job failed (the launcher), or the user's function raised (a rank)
    NODE_LOST = 70  # a rank whose node agent is gone: its node is lost with it
    LAUNCHER_GONE = 71  # a process whose launcher is gone
    GAVE_UP = 74  # a rank that could not leave an aborted epoch; the job goes on without it
    RESTART = 75  # the same, but a fresh process on its node takes its place
    INTERRUPTED = 130  # stopped by a signal (Ctrl-C)
