"""The chaos monkey: fires the actions of a chaos spec at a running job, from outside it.

An action's step S comes when the job's ranks reach training step S: a rank announces it at
a step point (``chaos/points.py``: the first rank about to run S), or, where the ranks are on
another machine (the Ray driver's node faults), the coordinator's status says so (the live
step in the agents' heartbeats, or S-1 committed). The monkey then carries the action out
through the launcher, which owns the processes, and lets the ranks, which wait at the end of
step S, go on. Faults come from outside the training processes, as real ones do: a kill
lands wherever the rank is in step S, often in the middle of a collective. However rarely
snapshots are taken, the action fires in step S; one that cannot (its target gone, the
job ended first) is named by ``unfired``, and the run fails.

An action with ``during=PHASE`` is timed from inside: when it is due the monkey arms a phase
point (``chaos/points.py``), waits until a process is struck there (holding still inside the
phase), fires the kill, then releases the point.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from peerckpt.chaos.points import ENDED, HOLD_S, LOOP, read_json, released_path
from peerckpt.chaos.spec import ActionKind, ChaosAction, FiredAction
from peerckpt.errors import NotReshardable, PeerckptError
from peerckpt.messages.control import JobStatus, Status
from peerckpt.states import JobState

log = logging.getLogger("peerckpt.chaos")
SETTLE_S = 10.0  # the longest a corruption waits for the snapshot in flight to commit
# The longest an added node's step stays held for its ranks to join (as long as a rank holds).
JOIN_S = HOLD_S


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
    """Fires each action once, when the job reaches its step; actions fire in step order
    (those of one step in the order given)."""

    def __init__(
        self,
        actions: list[ChaosAction],
        status: StatusSource,
        target: FaultTarget,
        poll_s: float = 0.01,
    ) -> None:
        self.actions = sorted(actions, key=lambda a: a.at)  # stable: a step's keep their order
        self.fired: list[FiredAction] = []
        self.reached = -1  # the highest step the job was seen to reach
        self.total: int | None = None  # the script's ``ctx.steps(total)``, once a rank said
        self.refusal: str | None = None  # why an action can never fire, once known
        self._status = status
        self._target = target
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._armed: dict[int, float] = {}  # action index → when its phase point was armed
        self._released: set[int] = set()
        self._records: dict[int, FiredAction] = {}  # action index → what firing it did
        # "add node" actions whose node's ranks are not in the job yet: index → (node, since).
        # Their step stays held until they are (the job grows at the step asked for), at
        # most JOIN_S; one that never joined is named by ``unfired``.
        self._joining: dict[int, tuple[int, float]] = {}
        self._not_joined: dict[int, str] = {}
        self._ended: Any = None  # the ranks' ``ended.json``, read at ``stop``
        self._thread = threading.Thread(target=self._run, name="peerckpt-chaos", daemon=True)

    def start(self) -> None:
        if self.actions:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        # Where the loop ended, read while the job's folder is there (``unfired`` runs after
        # the launcher removed it: it read nothing there, and named no step the loop ended at).
        directory = self._target.chaos_dir
        if directory is not None:
            self._ended = read_json(directory, ENDED) or self._ended
        self._release(set(a.at for a in self.actions))  # no rank may wait for a stopped monkey

    def unfired(self) -> list[str]:
        """A line per action that did not fire, saying why."""
        lines = []
        for index, action in enumerate(self.actions):
            record = self._records.get(index)
            if index in self._not_joined or index in self._joining:
                why = self._not_joined.get(index) or "the job ended before they did"
                lines.append(
                    f"chaos action '{action.text}' never took effect: node "
                    f"{record.node if record else '?'} started, but its ranks never joined the "
                    f"job: {why}"
                )
                continue
            if record is not None and record.fired_at is not None:
                continue
            if self.refusal is not None and action.at >= (self.total or 0):
                why = f"its step is past the script's last, {(self.total or 0) - 1}"
            elif record is not None:
                why = f"skipped: {record.skipped or ''}"
            elif index in self._armed:
                why = (
                    f"its point was armed once step {action.at} came, but no process entered "
                    f"the {action.during} phase before the job ended"
                )
            elif self.reached < action.at:
                why = f"the job {self._end()}, never reaching step {action.at}"
                if self.total is not None:
                    why += f" (its loop is ctx.steps({self.total}))"
            else:
                why = f"step {action.at} came, but the job ended before it could fire"
                if action.after:
                    why += f" (after={action.after:g} s)"
            lines.append(f"chaos action '{action.text}' never fired: {why}")
        return lines

    def _end(self) -> str:
        """Where the job ended, as well as the monkey knows."""
        directory = self._target.chaos_dir
        ended = read_json(directory, ENDED) if directory is not None else None
        ended = ended or self._ended
        if isinstance(ended, dict) and isinstance(ended.get("step"), int):
            if ended.get("left"):
                return f"left its loop after step {ended['step']} (a break)"
            return f"ended at step {ended['step']}"
        if self.reached >= 0:
            return f"got to step {self.reached}"
        return "stopped" if self.total is not None else "never started a step"

    def _seen(self, status: JobStatus) -> int:
        """The highest step the job has reached: a rank announced it at a step point, a
        heartbeat carried it, or the step before it was committed (every rank finished it)."""
        steps = [self.reached]
        directory = self._target.chaos_dir
        if directory is not None:
            with contextlib.suppress(OSError):
                steps += [
                    int(n[len("reached-") :])
                    for n in os.listdir(directory)
                    if n.startswith("reached-") and n[len("reached-") :].isdigit()
                ]
        if directory is not None:
            loop = read_json(directory, LOOP)
            if isinstance(loop, dict) and isinstance(loop.get("total"), int):
                self.total = max(self.total or 0, loop["total"])
        for stats in status.node_stats.values():
            steps += stats.live_step.values()
            if stats.steps_total is not None:
                self.total = max(self.total or 0, stats.steps_total)
        if status.committed_step is not None:
            steps.append(status.committed_step + 1)
        return max(steps)

    def _run(self) -> None:
        pending = list(enumerate(self.actions))
        due_since: dict[int, float] = {}  # step → when actions at it became due (for after=)
        while (pending or self._joining) and not self._stop.wait(self._poll_s):
            status = self._running_status()
            if status is None:
                continue
            self.reached = self._seen(status)
            self._watch_joins(status)
            if pending and self.total is not None and pending[-1][1].at >= self.total:
                action = pending[-1][1]
                self.refusal = (
                    f"chaos action '{action.text}' can never fire: the script's loop is "
                    f"ctx.steps({self.total}), whose last step is {self.total - 1}; give a "
                    f"step below {self.total}"
                )
                log.error("%s", self.refusal)
                return
            # Every action that is due fires now, in order: actions at the same step strike
            # together (within a millisecond), not one status poll apart.
            while pending:
                index, action = pending[0]
                if action.at > self.reached:
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
                self._records[index] = record
                self.fired.append(record)
                pending.pop(0)
                if action.kind is ActionKind.ADD_NODE and record.fired_at is not None:
                    assert record.node is not None
                    self._joining[index] = (record.node, time.monotonic())
            # A step's ranks go on once none of its actions is left to fire (an armed phase
            # point waits for its phase, and an action ``after=T`` lands T seconds later
            # wherever the job is by then: both only if the ranks go on) and the nodes its
            # actions added are in the job.
            waiting = {a.at for i, a in pending if i not in self._armed and not a.after}
            waiting |= {self.actions[i].at for i in self._joining}
            self._release({a.at for a in self.actions if a.at <= self.reached} - waiting)

    def _watch_joins(self, status: JobStatus) -> None:
        """Added nodes whose ranks are in the job now, or that waited too long."""
        for index, (node, since) in list(self._joining.items()):
            ranks = sorted(r for r, (n, _pid) in status.ranks.items() if n == node)
            refused = status.refused_joins.get(node)
            if refused is not None:  # the job may not grow (a loader that cannot reshard)
                log.error("chaos: node %d may not join: %s", node, refused)
                self._not_joined[index] = f"the job refused it: {refused}"
                del self._joining[index]
            elif ranks:
                log.warning(
                    "chaos: node %d joined the job as rank(s) %s: the world is %d ranks",
                    node,
                    ", ".join(map(str, ranks)),
                    len(status.ranks),
                )
                del self._joining[index]
            elif time.monotonic() - since > JOIN_S:
                why = f"not within {JOIN_S:.0f} s"
                log.error("chaos: node %d started but its ranks did not join: %s", node, why)
                self._not_joined[index] = why
                del self._joining[index]

    def _release(self, steps: set[int]) -> None:
        """Let the ranks held after ``steps`` go on (``chaos/points.py``, step points)."""
        directory = self._target.chaos_dir
        if directory is None:
            return
        for step in sorted(steps - self._released):
            with contextlib.suppress(OSError), open(released_path(directory, step), "w"):
                pass
            self._released.add(step)

    def _strike(self, index: int, action: ChaosAction, status: JobStatus) -> FiredAction | None:
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
                    if action.kind is ActionKind.KILL_RANK or action.of_rank is not None:
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
        if record is None:
            return None
        return replace(record, during=action.during, struck=where)

    def _say(self, action: ChaosAction, status: JobStatus, where: str = "") -> None:
        log.warning("%s", _said(action, self.reached, status, where))

    def _fire(self, action: ChaosAction, status: JobStatus) -> FiredAction | None:
        """Carry ``action`` out; its record (``fired_at`` None and ``skipped`` when its target
        is gone)."""
        record = FiredAction(
            action=action.text,
            kind=action.kind,
            target=action.target,
            step=self.reached,
            committed_step=status.committed_step,
            epoch=status.epoch,
            fired_at=None,
        )
        if action.kind.on_a_rank and action.kind is not ActionKind.CORRUPT_RANK:
            assignment = status.ranks.get(action.target)
            if assignment is None:
                log.error("chaos: rank %d is not in the job; action skipped", action.target)
                return replace(record, skipped="no such rank")
            record = replace(record, node=assignment[0], pid=assignment[1])
            self._say(action, status)
        elif action.kind.on_a_node:
            node = action.target
            if action.of_rank is not None:
                node = status.ranks.get(action.of_rank, [-1])[0]
            record = replace(record, node=node)
            if not status.nodes.get(node, False):
                log.error("chaos: node %d is not alive; action skipped", node)
                return replace(record, skipped="no such live node")
            self._say(action, status, f"node {node}, ")
        else:
            self._say(action, status)
        return self._carry_out[action.kind](action, replace(record, fired_at=time.time()))

    # -- one per kind (``_carry_out``): the fault itself, and what it adds to the record ---
    def _kill_rank(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        assert record.pid is not None
        self._target.kill_pid(record.pid)
        return record

    def _hang_rank(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        assert record.pid is not None
        self._target.hang_pid(record.pid, action.duration)
        return record

    def _corrupt_rank(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        self._settle(self.reached)
        return replace(record, segments=tuple(self._target.corrupt_replicas(action.target)))

    def _settle(self, step: int) -> None:
        """Before a corruption: wait until ``step``'s snapshot is committed (the ranks hold
        after it until its actions fired), at most ``SETTLE_S`` (a job that snapshots less
        often). Flipped while it was still being replicated, its copy on a buddy was written
        whole afterwards and committed: a corruption that asked to leave no valid copy left
        one (seen in CI under load: the job recovered from it)."""
        deadline = time.monotonic() + SETTLE_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            status = self._running_status()
            if status is None:
                return
            if status.committed_step is not None and status.committed_step >= step:
                return
            time.sleep(0.02)

    def _running_status(self) -> JobStatus | None:
        """The coordinator's status while the job runs; None if it did not answer or the
        job is not running."""
        try:
            status = self._status.call(Status(), timeout=2.0)
        except PeerckptError:
            return None
        return status if status.state is JobState.RUNNING else None

    def _kill_node(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        assert record.node is not None
        self._target.kill_node(record.node)
        return record

    def _kill_agent(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        assert record.node is not None
        self._target.kill_agent(record.node)
        return record

    def _partition_node(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        assert record.node is not None
        self._target.net_fault(record.node, partition_s=action.duration)
        return record

    def _slow_node(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        assert record.node is not None
        self._target.net_fault(record.node, rate=action.rate * 1e6, slow_s=action.duration)
        return record

    def _kill_coordinator(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        self._target.kill_coordinator()
        return record

    def _add_node(self, action: ChaosAction, record: FiredAction) -> FiredAction:
        try:
            return replace(record, node=self._target.add_node())
        except NotReshardable as exc:  # the job refuses to grow: it goes on as it was
            log.error("chaos: %s refused: %s", action.text, exc)
            return replace(record, fired_at=None, skipped=f"the job refused it: {exc}")

    @property
    def _carry_out(
        self,
    ) -> dict[ActionKind, Callable[[ChaosAction, FiredAction], FiredAction]]:
        return {
            ActionKind.KILL_RANK: self._kill_rank,
            ActionKind.HANG_RANK: self._hang_rank,
            ActionKind.CORRUPT_RANK: self._corrupt_rank,
            ActionKind.KILL_NODE: self._kill_node,
            ActionKind.KILL_AGENT: self._kill_agent,
            ActionKind.PARTITION_NODE: self._partition_node,
            ActionKind.SLOW_NODE: self._slow_node,
            ActionKind.KILL_COORDINATOR: self._kill_coordinator,
            ActionKind.ADD_NODE: self._add_node,
        }


def _said(action: ChaosAction, reached: int, status: JobStatus, where: str = "") -> str:
    return (
        f"chaos: {action.text} ({where}the job at step {reached}, committed step "
        f"{status.committed_step})"
    )


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
