"""The chaos monkey: fires the actions of a chaos spec at a running job, from outside it.

It watches the coordinator's status (committed step, who is which rank) and, when an action's
step comes, carries it out through the launcher, which owns the processes. Faults come from
outside the training processes, as real ones do: a kill lands wherever the rank happens to be,
often in the middle of a collective.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from peerckpt.chaos.spec import ChaosAction
from peerckpt.errors import PeerckptError

log = logging.getLogger("peerckpt.chaos")


class FaultTarget(Protocol):
    """What the launcher offers the monkey."""

    def kill_pid(self, pid: int) -> None:
        """SIGKILL one process of the job."""
        ...

    def kill_node(self, node: int) -> None:
        """SIGKILL a node's agent and every process on it; its shared memory is lost."""
        ...

    def add_node(self) -> int:
        """Start a new node that joins the job; return its index."""
        ...

    def corrupt_replicas(self, rank: int) -> list[str]:
        """Flip a byte in every replica of ``rank``'s snapshot; return the segments' names."""
        ...


class StatusSource(Protocol):
    def call(self, method: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]: ...


class ChaosMonkey:
    """Fires each action once, in order, when the job reaches its step."""

    def __init__(
        self,
        actions: list[ChaosAction],
        status: StatusSource,
        target: FaultTarget,
        poll_s: float = 0.01,
    ) -> None:
        self.actions = list(actions)
        self.fired: list[dict[str, Any]] = []
        self._status = status
        self._target = target
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peerckpt-chaos", daemon=True)

    def start(self) -> None:
        if self.actions:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        pending = list(self.actions)
        due_since: dict[int, float] = {}  # step → when actions at it became due (for after=)
        while pending and not self._stop.wait(self._poll_s):
            try:
                status = self._status.call("Status", timeout=2.0)
            except PeerckptError:
                continue
            if status["state"] != "running":
                continue
            # Every action that is due fires now, in order: actions at the same step strike
            # together (within a millisecond), not one status poll apart.
            committed = status["committed_step"]
            while pending:
                action = pending[0]
                due = action.at == 0 or (committed is not None and committed >= action.at - 1)
                if not due:
                    break
                since = due_since.setdefault(action.at, time.monotonic())
                if time.monotonic() - since < action.after:
                    break
                record = self._fire(action, status)
                if record is None:
                    break
                self.fired.append(record)
                pending.pop(0)

    def _fire(self, action: ChaosAction, status: dict[str, Any]) -> dict[str, Any] | None:
        record = {
            "action": action.text,
            "kind": action.kind,
            "target": action.target,
            "committed_step": status["committed_step"],
            "epoch": status["epoch"],
        }
        if action.kind == "add_node":
            log.warning("chaos: %s (committed step %s)", action.text, status["committed_step"])
            record["fired_at"] = time.time()
            record["node"] = self._target.add_node()
            return record
        if action.kind == "corrupt_rank":
            log.warning("chaos: %s (committed step %s)", action.text, status["committed_step"])
            record["fired_at"] = time.time()
            record["segments"] = self._target.corrupt_replicas(action.target)
            return record
        if action.kind == "kill_rank":
            assignment = status["ranks"].get(action.target)
            if assignment is None:
                log.error("chaos: rank %d is not in the job; action skipped", action.target)
                return {**record, "fired_at": None, "skipped": "no such rank"}
            record["pid"] = assignment[1]
            record["node"] = assignment[0]
            log.warning("chaos: %s (committed step %s)", action.text, status["committed_step"])
            record["fired_at"] = time.time()
            self._target.kill_pid(assignment[1])
        else:
            if not status["nodes"].get(action.target, False):
                log.error("chaos: node %d is not alive; action skipped", action.target)
                return {**record, "fired_at": None, "skipped": "no such live node"}
            log.warning("chaos: %s (committed step %s)", action.text, status["committed_step"])
            record["fired_at"] = time.time()
            self._target.kill_node(action.target)
        return record
