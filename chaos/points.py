"""The inside half of the chaos harness: the fault hooks it installs in job processes.

The launcher's chaos monkey acts from outside (signals, killing processes). Two kinds of fault
need a hook inside a process; :class:`ChaosHooks` implements the ground layer's interface
(``peerckpt/faults.py``), and :func:`hooks` is the factory registered for it (entry point
``peerckpt.faults``). Both are driven by files in the job's fault directory
(``PEERCKPT_FAULTS_DIR``, set by the launcher only when the spec needs it; without it a
process gets no hooks at all):

- **Phase points** (``during=snapshot|replication|recovery``). The monkey *arms* a point by
  writing ``armed-<i>.json`` (phase and what must match: a rank or a node). The first process
  that reaches a matching :meth:`ChaosHooks.strike` renames it to ``hit-<i>.json`` (a rename
  happens once, so one process wins) and holds still until the monkey, which saw the hit, has
  fired the kill and written ``done-<i>``. The kill thus lands while that process is inside
  the phase: half of a snapshot copied, a push half sent, a restore half fetched.
- **Step points** (every action's ``at=S``). Before the job starts the monkey writes the
  steps its actions wait for to ``gates.json``. A rank about to run such a step S creates
  ``reached-<S>`` (the first one wins; the others see it there), runs step S, and at its next
  step boundary (or the end of its loop) waits until the monkey, which saw ``reached-<S>``,
  has fired every action of step S and written ``released-<S>``. The fault thus lands while
  the job runs step S, wherever the ranks are in it, however short the steps and however
  rarely snapshots are taken; a rank holds at most ``HOLD_S``, then goes on (the action
  then fails the run as never fired, if it did not fire at all).
- **Network faults** (``partition``, ``slow``) of one node's agent, from ``net-<node>.json``:
  ``{"partition_until": t, "rate": bytes_per_s, "slow_until": t}`` (wall-clock times). The
  agent polls it; :class:`NetFaults` then cuts its TCP connections and refuses new ones while
  partitioned, and paces what it sends while slowed. The agent also holds back its heartbeats,
  reports and the coordinator's events while partitioned (``replication/agent.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from peerckpt.errors import PeerUnavailable
from peerckpt.faults import Cuttable, FaultHooks

log = logging.getLogger("peerckpt.chaos")
HOLD_S = 30.0  # the longest a process holds still at a struck point, waiting for the kill


GATES = "gates.json"  # the steps the monkey's actions wait for (a JSON list)
LOOP = "loop.json"  # {"total": ctx.steps' total}, written by the first rank in its loop
ENDED = "ended.json"  # {"step": the last step}, written by a rank whose loop ended


def _write_json(path: str, value: Any) -> None:
    """Whole or not at all (a reader may look at any moment); best effort."""
    with contextlib.suppress(OSError):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)


def read_json(directory: str, name: str) -> Any:
    """What ``_write_json`` wrote, or None."""
    try:
        with open(os.path.join(directory, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def reached_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"reached-{step}")


def released_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"released-{step}")


class ChaosHooks(FaultHooks):
    """Phase and step points read from ``directory``; network faults for an agent (``net``)."""

    active = True

    def __init__(self, directory: str, node: int, network: bool) -> None:
        self.directory = directory
        self.net = NetFaults(os.path.join(directory, f"net-{node}.json")) if network else None
        self.gates = StepGates(directory)

    def strike(self, phase: str, **where: Any) -> bool:
        return strike_point(self.directory, phase, **where)

    def reach(self, step: int, check: Callable[[], None] | None = None, **where: Any) -> None:
        self.gates.reach(step, check, **where)

    def left(self, step: int, total: int) -> None:
        _write_json(os.path.join(self.directory, ENDED), {"step": step, "total": total, "left": 1})


class StepGates:
    """One rank process's step points (the module docstring says how they work)."""

    def __init__(self, directory: str, hold_s: float = HOLD_S) -> None:
        self.directory = directory
        self.hold_s = hold_s
        self._steps: frozenset[int] | None = None
        self._owed: int | None = None  # a step this process ran whose release it awaits
        self._told = False  # wrote the loop's total

    def steps(self) -> frozenset[int]:
        """The steps actions wait for (read once: the monkey writes them before any rank
        starts)."""
        if self._steps is None:
            try:
                with open(os.path.join(self.directory, GATES)) as f:
                    self._steps = frozenset(int(s) for s in json.load(f))
            except (OSError, ValueError, TypeError):
                self._steps = frozenset()
        return self._steps

    def reach(self, step: int, check: Callable[[], None] | None = None, **where: Any) -> None:
        """About to run ``step``: first wait for the release of a gated step run before (a
        re-entry after a restore waits too: the fault that caused it may have been only the
        first of its step's), then announce ``step`` if an action waits for it. The loop's
        total is written once (``loop.json``: the monkey refuses a step past it) and its end
        (``ended.json``: the monkey names it for an action that never fired)."""
        total = where.get("total")
        if not self._told and total is not None:
            self._told = True
            _write_json(os.path.join(self.directory, LOOP), {"total": total})
        if self._owed is not None and self._owed != step:
            self._await_release(self._owed, check)
            self._owed = None
        if total is not None and step >= total:
            _write_json(os.path.join(self.directory, ENDED), {"step": step - 1})
            return
        if step not in self.steps() or os.path.exists(released_path(self.directory, step)):
            return
        with contextlib.suppress(FileExistsError, OSError):
            fd = os.open(reached_path(self.directory, step), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(fd, "w") as f:
                json.dump({**where, "step": step, "pid": os.getpid()}, f)
            log.info("chaos: step %d reached; the faults of that step fire now", step)
        self._owed = step

    def _await_release(self, step: int, check: Callable[[], None] | None = None) -> None:
        """Hold until the monkey released ``step``, at most ``hold_s``; ``check`` raises
        (MembershipChanged) when the epoch ends meanwhile, and the step is still owed."""
        path = released_path(self.directory, step)
        deadline = time.monotonic() + self.hold_s
        if os.path.exists(path):
            return
        log.info("chaos: holding at the end of step %d until its faults have fired", step)
        while not os.path.exists(path):
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                log.warning(
                    "chaos: the faults of step %d did not fire within %.0f s; going on",
                    step,
                    self.hold_s,
                )
                return
            time.sleep(0.005)


def hooks(directory: str, node: int, network: bool) -> ChaosHooks:
    """The factory of the ``peerckpt.faults`` entry point."""
    return ChaosHooks(directory, node, network)


def strike_point(directory: str, phase: str, **where: Any) -> bool:
    """Hold still here if an armed ``phase`` point matches ``where``; True if one was struck."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("armed-"))
    except OSError:
        return False
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                armed = json.load(f)
        except (OSError, ValueError):
            continue  # struck by another process meanwhile
        if armed.get("phase") != phase:
            continue
        if any(where.get(key) != value for key, value in armed.get("match", {}).items()):
            continue
        hit = os.path.join(directory, "hit-" + name[len("armed-") :])
        try:
            os.rename(path, hit)
        except OSError:
            continue  # another process won it
        with contextlib.suppress(OSError):  # whole or not at all: the monkey reads it now
            with open(hit + ".where.tmp", "w") as f:
                json.dump({**where, "pid": os.getpid()}, f)
            os.rename(hit + ".where.tmp", hit + ".where")
        log.warning("chaos: %s point struck (%s); holding still", phase, where)
        done = os.path.join(directory, "done-" + name[len("armed-") : -len(".json")])
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.005)
        return True
    return False


class NetFaults:
    """One agent's network faults, read from its ``net-<node>.json``."""

    def __init__(self, path: str, poll_s: float = 0.02) -> None:
        self.path = path
        self._poll_s = poll_s
        self.partition_until = 0.0
        self.slow_until = 0.0
        self.rate = 0.0
        self._mtime = 0.0
        self._conns: weakref.WeakSet[Cuttable] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._healed = threading.Condition(self._lock)
        self._sent_at = 0.0  # the pacing clock of a slowed link
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peerckpt-netfaults", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._healed.notify_all()
        self._thread.join(timeout=2.0)

    # -- state ----------------------------------------------------------------------------
    def partitioned(self) -> bool:
        return time.time() < self.partition_until

    def wait_healed(self, stop: threading.Event | None = None) -> None:
        """Block while partitioned (what TCP does to a message sent into a partition)."""
        while self.partitioned() and not self._stop.is_set():
            if stop is not None and stop.is_set():
                return
            with self._lock:
                self._healed.wait(min(0.05, max(0.0, self.partition_until - time.time())))

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                mtime = os.stat(self.path).st_mtime
            except OSError:
                continue
            if mtime == self._mtime:
                continue
            try:
                with open(self.path) as f:
                    fault = json.load(f)
            except (OSError, ValueError):
                continue
            self._mtime = mtime
            was = self.partitioned()
            self.partition_until = float(fault.get("partition_until", 0.0))
            self.slow_until = float(fault.get("slow_until", 0.0))
            self.rate = float(fault.get("rate", 0.0))
            if self.partitioned() and not was:
                log.warning(
                    "chaos: partitioned for %.1f s; cutting every connection",
                    self.partition_until - time.time(),
                )
                self._cut_all()
            if self.rate:
                log.warning("chaos: data links slowed to %.1f MB/s", self.rate / 1e6)
            with self._lock:
                self._healed.notify_all()

    # -- the transport's hooks ------------------------------------------------------------
    def track(self, conn: Cuttable) -> None:
        """A new TCP connection: it is cut when a partition starts."""
        with self._lock:
            self._conns.add(conn)

    def _cut_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()

    def check(self, peer: str) -> None:
        """Raise as a cut connection would, if partitioned."""
        if self.partitioned():
            raise PeerUnavailable(f"connection to {peer} cut (chaos: partition)")

    def slowed(self) -> bool:
        return bool(self.rate) and time.time() < (self.slow_until or float("inf"))

    def pace(self, nbytes: int) -> None:
        """Sleep so that what is sent stays under the slow link's rate."""
        if not self.slowed():
            return
        with self._lock:
            now = time.monotonic()
            self._sent_at = max(self._sent_at, now) + nbytes / self.rate
            wait = self._sent_at - now
        if wait > 0:
            time.sleep(wait)
