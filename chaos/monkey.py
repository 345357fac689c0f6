"""The chaos monkey: fires the actions of a chaos spec at a running job, from outside it.

It watches the coordinator's status (committed step, who is which rank) and, when an action's
step comes, carries it out through the launcher, which owns the processes. Faults come from
outside the training processes, as real ones do: a kill lands wherever the rank happens to be,
often in the middle of a collective.

An action with ``during=PHASE`` is timed from inside: when it is due the monkey arms a phase
point (``chaos/points.py``), waits until a process is struck there (holding still inside the
phase), fires the kill, then releases the point.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Protocol

from peerckpt.chaos.spec import ChaosAction
from peerckpt.errors import PeerckptError
from peerckpt.messages.control import JobStatus, Status
from peerckpt.states import JobState

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

    def hang_pid(self, pid: int, seconds: float) -> None:
        """SIGSTOP one process; SIGCONT it ``seconds`` later."""
        ...

    def kill_agent(self, node: int) -> None:
        """SIGKILL a node's agent only."""
        ...

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (the launcher restarts it)."""
        ...

    def net_fault(
        self, node: int, partition_s: float = 0.0, rate: float = 0.0, slow_s: float = 0.0
    ) -> None:
        """Cut a node's agent off for ``partition_s``, or pace its links at ``rate`` B/s."""
        ...

    @property
    def chaos_dir(self) -> str | None:
        """Where phase points are armed (None: the job was started without them)."""
        ...


class StatusSource(Protocol):
    def call(self, msg: Status, timeout: float = 10.0) -> JobStatus: ...


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
        self._armed: dict[int, float] = {}  # action index → when its phase point was armed
        self._thread = threading.Thread(target=self._run, name="peerckpt-chaos", daemon=True)

    def start(self) -> None:
        if self.actions:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        pending = list(enumerate(self.actions))
        due_since: dict[int, float] = {}  # step → when actions at it became due (for after=)
        while pending and not self._stop.wait(self._poll_s):
            try:
                status = self._status.call(Status(), timeout=2.0)
            except PeerckptError:
                continue
            if status.state is not JobState.RUNNING:
                continue
            # Every action that is due fires now, in order: actions at the same step strike
            # together (within a millisecond), not one status poll apart.
            committed = status.committed_step
            while pending:
                index, action = pending[0]
                due = action.at == 0 or (committed is not None and committed >= action.at - 1)
                if not due:
                    break
                since = due_since.setdefault(action.at, time.monotonic())
                if time.monotonic() - since < action.after:
                    break
                if action.during is not None:
                    record = self._strike(index, action, status)
                else:
                    record = self._fire(action, status)
                if record is None:
                    break
                self.fired.append(record)
                pending.pop(0)

    def _strike(self, index: int, action: ChaosAction, status: JobStatus) -> dict[str, Any] | None:
        """Arm the action's phase point; once a process is struck there, fire and release it."""
        directory = self._target.chaos_dir
        assert directory is not None and action.during is not None
        armed = os.path.join(directory, f"armed-{index}.json")
        hit = os.path.join(directory, f"hit-{index}.json")
        if not os.path.exists(hit):
            if index not in self._armed:
                # Snapshot and replication: the rank's (or node's) own phase; recovery: anyone's.
                match: dict[str, int] = {}
                if action.during != "recovery":
                    if action.kind == "kill_rank" or action.of_rank is not None:
                        match["rank"] = action.target if action.of_rank is None else action.of_rank
                    else:
                        match["node"] = action.target
                with open(armed + ".tmp", "w") as f:
                    json.dump({"phase": action.during, "match": match}, f)
                os.rename(armed + ".tmp", armed)
                self._armed[index] = time.monotonic()
                log.warning("chaos: %s armed", action.text)
            return None
        where = _read_where(hit + ".where")
        try:
            record = self._fire(action, status)
        finally:
            with open(os.path.join(directory, f"done-{index}"), "w"):
                pass
        if record is not None:
            record.update(during=action.during, struck=where)
        return record

    def _fire(self, action: ChaosAction, status: JobStatus) -> dict[str, Any] | None:
        record = {
            "action": action.text,
            "kind": action.kind,
            "target": action.target,
            "committed_step": status.committed_step,
            "epoch": status.epoch,
        }
        if action.kind == "add_node":
            log.warning("chaos: %s (committed step %s)", action.text, status.committed_step)
            record["fired_at"] = time.time()
            record["node"] = self._target.add_node()
            return record
        if action.kind == "kill_coordinator":
            log.warning("chaos: %s (committed step %s)", action.text, status.committed_step)
            record["fired_at"] = time.time()
            self._target.kill_coordinator()
            return record
        if action.kind == "corrupt_rank":
            log.warning("chaos: %s (committed step %s)", action.text, status.committed_step)
            record["fired_at"] = time.time()
            record["segments"] = self._target.corrupt_replicas(action.target)
            return record
        if action.kind in ("kill_rank", "hang_rank"):
            assignment = status.ranks.get(action.target)
            if assignment is None:
                log.error("chaos: rank %d is not in the job; action skipped", action.target)
                return {**record, "fired_at": None, "skipped": "no such rank"}
            record["pid"] = assignment[1]
            record["node"] = assignment[0]
            log.warning("chaos: %s (committed step %s)", action.text, status.committed_step)
            record["fired_at"] = time.time()
            if action.kind == "kill_rank":
                self._target.kill_pid(assignment[1])
            else:
                self._target.hang_pid(assignment[1], action.duration)
            return record
        # The rest act on a node.
        node = action.target
        if action.of_rank is not None:
            node = status.ranks.get(action.of_rank, [-1])[0]
        record["node"] = node
        if not status.nodes.get(node, False):
            log.error("chaos: node %d is not alive; action skipped", node)
            return {**record, "fired_at": None, "skipped": "no such live node"}
        log.warning(
            "chaos: %s (node %d, committed step %s)", action.text, node, status.committed_step
        )
        record["fired_at"] = time.time()
        if action.kind == "kill_node":
            self._target.kill_node(node)
        elif action.kind == "kill_agent":
            self._target.kill_agent(node)
        elif action.kind == "partition_node":
            self._target.net_fault(node, partition_s=action.duration)
        elif action.kind == "slow_node":
            self._target.net_fault(node, rate=action.rate * 1e6, slow_s=action.duration)
        else:
            raise AssertionError(f"unknown chaos action {action.kind}")
        return record


def _read_where(path: str, wait_s: float = 2.0) -> dict[str, Any]:
    """Where the struck process was: it writes this file just after winning the point, so
    the monkey may look a moment too early; it waits for it a little, bounded."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path) as f:
                where: dict[str, Any] = json.load(f)
            return where
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return {}
            time.sleep(0.005)
