"""The coordinator's clocks: lost heartbeats, replication that cannot finish, a last flush
that does not end.

``Liveness`` is mixed into ``Coordinator`` (``recovery/coordinator.py``), whose server loop
calls ``check_heartbeats`` a few times a second; its methods run under the coordinator's
lock. A node whose agent stops heart-beating (a hang or a partition) is declared lost; a
snapshot that could not be mirrored to a buddy that still looks alive after one heartbeat
timeout fails the job rather than wait forever; a finished job waits at most
``FINISH_FLUSH_S`` for its last durable flush.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peerckpt.membership import Membership
    from peerckpt.recovery.commits import CommitTracker
    from peerckpt.recovery.coordinator import AgentInfo
    from peerckpt.recovery.epochs import DeferredRecovery

log = logging.getLogger("peerckpt.coordinator")
FINISH_FLUSH_S = 300.0  # how long a finished job waits for its last flush


class Liveness:
    """Timeouts. Expects the coordinator's state (declared for type checking)."""

    agents: dict[int, AgentInfo]
    membership: Membership | None
    tracker: CommitTracker | None
    state: str
    heartbeat_timeout: float
    _lock: threading.RLock
    _stuck: list[tuple[float, int, int, int, str]]
    _finishing_since: float
    _deferred: DeferredRecovery | None
    _rebuild_deadline: float | None

    if TYPE_CHECKING:  # provided by Coordinator

        def _fail(self, reason: str) -> None: ...
        def _finish(self) -> None: ...
        def _lose_node(self, node: int, reason: str) -> None: ...
        def _retry_deferred(self, force: bool = False) -> None: ...
        def _end_rebuild(self) -> None: ...

    def replication_failed(self, req: dict[str, Any]) -> dict[str, Any]:
        """A snapshot could not be mirrored to a buddy; the step cannot commit without it.

        If the buddy refused it (out of memory, checksums), the job fails now with that
        reason. If the buddy could not be reached, its node is probably gone and will be
        declared lost; should it still look alive after one heartbeat timeout while the step
        is still uncommitted, the job fails rather than wait forever.
        """
        with self._lock:
            if self.membership is None or req["epoch"] != self.membership.epoch:
                return {}
            message = (
                f"replicating rank {req['rank']}'s snapshot of step {req['step']} to node "
                f"{req['buddy']} failed: {req['message']}"
            )
            log.warning("%s", message)
            buddy = self.agents.get(req["buddy"])
            if buddy is not None and not buddy.alive:
                return {}  # already declared lost: its recovery (perhaps waiting) handles it
            if req.get("fatal"):
                self._fail(message)
            else:
                deadline = time.monotonic() + self.heartbeat_timeout
                self._stuck.append((deadline, req["epoch"], req["step"], req["buddy"], message))
            return {}

    def check_heartbeats(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self.state == "finishing" and now - self._finishing_since > FINISH_FLUSH_S:
                log.warning(
                    "the last flush did not finish in %.0f s; ending anyway", FINISH_FLUSH_S
                )
                self._finish()
            if self._rebuild_deadline is not None and now > self._rebuild_deadline:
                self._end_rebuild()
            if self._deferred is not None and now > self._deferred.deadline:
                self._retry_deferred(force=True)
            for entry in list(self._stuck):
                deadline, epoch, step, buddy, message = entry
                lost = buddy in self.agents and not self.agents[buddy].alive
                if (
                    lost  # declared lost meanwhile: its recovery (perhaps waiting) handles it
                    or self.membership is None
                    or epoch != self.membership.epoch
                    or (self.tracker is not None and (self.tracker.committed_step or -1) >= step)
                ):
                    self._stuck.remove(entry)
                elif now > deadline:
                    self._fail(
                        f"{message}; the buddy still looks alive, so the step can never commit"
                    )
            if self.state not in ("starting", "running", "finishing"):
                return  # the job ended: agents stop heart-beating as they exit
            if self._rebuild_deadline is not None:
                return  # restarted: agents are still coming back
            for node, agent in list(self.agents.items()):
                if agent.alive and now - agent.last_heartbeat > self.heartbeat_timeout:
                    self._lose_node(
                        node,
                        f"no heartbeat for {now - agent.last_heartbeat:.1f} s "
                        f"(timeout {self.heartbeat_timeout} s)",
                    )
