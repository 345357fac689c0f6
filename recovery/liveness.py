"""The coordinator's clocks: lost heartbeats, replication that cannot finish, a last flush
that does not end, spares that do not come, agents that do not come back.

``Clocks`` only keeps deadlines and says which have passed (``expired``); the coordinator,
which calls it a few times a second under its lock, acts on the answer. A node whose agent
stops heart-beating (a hang or a partition) is declared lost; a snapshot that could not be
mirrored to a buddy that still looks alive after one heartbeat timeout fails the job rather
than wait forever; a rank whose recovery could not reach a source fails the job only if no
newer epoch began within ``HOLD_FACTOR`` heartbeat timeouts (the source may have been dying,
its loss not yet declared; the epoch that loss starts plans from what is really left); a
finished job waits at most ``FINISH_FLUSH_S`` for its last durable flush; a restarted
coordinator waits ``REBUILD_WAIT_FACTOR`` heartbeat timeouts for agents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peerckpt.membership import Membership
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.registry import Registry
from peerckpt.states import JobState

FINISH_FLUSH_S = 300.0  # how long a finished job waits for its last flush
REBUILD_WAIT_FACTOR = 2.0  # a restarted coordinator waits this many heartbeat timeouts for agents
HOLD_FACTOR = 1.5  # a failed recovery waits this many heartbeat timeouts for a newer epoch


@dataclass(frozen=True)
class StuckReplication:
    """A snapshot that could not be mirrored to a buddy that still looked alive."""

    deadline: float
    epoch: int
    step: int
    buddy: int
    message: str


@dataclass(frozen=True)
class HeldFailure:
    """A rank's recovery that could not reach a source, in an epoch a loss may supersede."""

    deadline: float
    epoch: int
    message: str


@dataclass
class Expired:
    """What ``Clocks.expired`` found overdue."""

    finish: bool = False  # the last flush took too long: end the job anyway
    rebuild: bool = False  # agents had their time to come back to a restarted coordinator
    spare_wait: bool = False  # a recovery waited long enough for spares
    failures: list[str] = field(default_factory=list)  # stuck replications, held failures
    silent: dict[int, float] = field(default_factory=dict)  # node → seconds without heartbeat


class Clocks:
    """Deadlines. Call under the coordinator's lock."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.stuck: list[StuckReplication] = []
        self.held: list[HeldFailure] = []
        self.finishing_since: float | None = None
        self.rebuild_deadline: float | None = None  # until then, agents may still come back

    def replication_stuck(
        self, now: float, epoch: int, step: int, buddy: int, message: str
    ) -> None:
        self.stuck.append(StuckReplication(self._after(now, 1.0), epoch, step, buddy, message))

    def hold_failure(self, now: float, epoch: int, message: str) -> None:
        """A rank of ``epoch`` could not recover (``message``). Two nodes killed together
        are declared lost one after the other: a spare replacing the first one's rank may
        read from the second and fail on its closed connection before that loss is known.
        The job fails with ``message`` only if no loss started a newer epoch meanwhile."""
        self.held.append(HeldFailure(self._after(now, HOLD_FACTOR), epoch, message))

    def _after(self, now: float, timeouts: float) -> float:
        """``timeouts`` heartbeat timeouts from now, or from the end of a rebuild. A restarted
        coordinator learns which nodes are gone only once its agents had their time to come
        back (a moved one: the dead host's never do): until then a node that does not answer
        may be one of those."""
        return max(now, self.rebuild_deadline or now) + timeouts * self.heartbeat_timeout

    def start_rebuild(self, now: float) -> None:
        if self.rebuild_deadline is None:
            self.rebuild_deadline = now + REBUILD_WAIT_FACTOR * self.heartbeat_timeout

    def expired(
        self,
        now: float,
        state: JobState,
        registry: Registry,
        membership: Membership | None,
        tracker: CommitTracker | None,
        spare_deadline: float | None,
    ) -> Expired:
        out = Expired()
        if state is JobState.FINISHING and self.finishing_since is not None:
            out.finish = now - self.finishing_since > FINISH_FLUSH_S
        if self.rebuild_deadline is not None and now > self.rebuild_deadline:
            self.rebuild_deadline = None
            out.rebuild = True
        out.spare_wait = spare_deadline is not None and now > spare_deadline
        committed = tracker.committed_step if tracker is not None else None
        for entry in list(self.stuck):
            buddy = registry.agents.get(entry.buddy)
            if (
                (buddy is not None and not buddy.alive)  # its recovery (perhaps waiting) handles it
                or membership is None
                or entry.epoch != membership.epoch
                or (committed if committed is not None else -1) >= entry.step
            ):
                self.stuck.remove(entry)
            elif now > entry.deadline:
                out.failures.append(
                    f"{entry.message}; the buddy still looks alive, so the step can never commit"
                )
        for held in list(self.held):
            if state.ended or membership is None or held.epoch != membership.epoch:
                self.held.remove(held)  # superseded: a newer epoch planned from what is left
            elif now > held.deadline:
                self.held.remove(held)
                out.failures.append(held.message)
        if state not in (JobState.STARTING, JobState.RUNNING, JobState.FINISHING):
            return out  # the job ended: agents stop heart-beating as they exit
        if self.rebuild_deadline is not None:
            return out  # restarted: agents are still coming back
        for node, agent in registry.agents.items():
            if agent.alive and now - agent.last_heartbeat > self.heartbeat_timeout:
                out.silent[node] = now - agent.last_heartbeat
        return out
