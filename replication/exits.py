"""Process exits seen the instant they happen, whatever descriptors the process left behind.

The agent learns that a local rank process is gone from its control socket closing. But a
socket closes only when the *last* process holding it lets go, and a rank's children inherit
it: DataLoader worker processes, forked by the rank, kept it open until torch's worker loop
noticed the parent was gone — measured 5.0 s after a ``kill rank`` (4 ms without workers).

So the agent does not wait for the socket. For every process that connects it opens a
*pidfd* (``os.pidfd_open``, Linux ≥ 5.3), a descriptor that becomes readable when that one
process exits, children or not; one thread polls all of them and calls the process's exit
callback, which cuts the control link so that the usual path (link closed → ``ProcLost``)
runs at once.

Protocol::

    watch(pid, on_exit) ──▶ pending ──wake──▶ thread registers the pidfd with poll()
    process exits ──▶ pidfd readable ──▶ thread: on_exit(); pidfd closed
    unwatch(pid) (the link closed first) ──▶ pidfd closed, on_exit never called
    stop() ──▶ thread joined, every pidfd closed

Owns one thread, one wake-up pipe and a pidfd per watched process. Never signals or reaps a
process (the agent is not their parent); where pidfds are not available ``watch`` returns
False and the socket alone tells.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

log = logging.getLogger("peerckpt.control")


class ExitWatcher:
    """Calls a callback once for each watched process, as soon as it exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[int, Callable[[], None]]] = {}  # pidfd → (pid, callback)
        self._by_pid: dict[int, int] = {}
        self._changes: list[tuple[str, int]] = []  # ("add" | "remove", pidfd) for the thread
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peerckpt-exits", daemon=True)
        self._thread.start()

    def watch(self, pid: int, on_exit: Callable[[], None]) -> bool:
        """Call ``on_exit`` (from the watcher's thread) when ``pid`` exits; False if pidfds
        are not available here. A process already gone is reported at once."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            on_exit()
            return True
        except (AttributeError, OSError) as exc:
            log.debug("no pidfd for pid %d (%s): its socket alone tells its exit", pid, exc)
            return False
        with self._lock:
            if self._stop.is_set():
                os.close(fd)
                return False
            self._watched[fd] = (pid, on_exit)
            self._by_pid[pid] = fd
            self._changes.append(("add", fd))
            self._wake()
        return True

    def unwatch(self, pid: int) -> None:
        """Forget ``pid`` (its link closed on its own); its callback will not be called."""
        with self._lock:
            fd = self._by_pid.pop(pid, None)
            if fd is None or self._watched.pop(fd, None) is None:
                return
            self._changes.append(("remove", fd))
            self._wake()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            self._wake()
        self._thread.join(timeout=2.0)
        with self._lock:  # watch and unwatch see the stop under this lock: no fd is reused
            fds = list(self._watched)
            self._watched.clear()
            self._by_pid.clear()
            changes, self._changes = self._changes, []
        for fd in {*fds, *(fd for kind, fd in changes if kind == "remove")}:
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        """Interrupt the thread's poll (called with the lock held)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    entry = self._watched.pop(fd, None)
                    if entry is not None:
                        self._by_pid.pop(entry[0], None)
                if entry is None:
                    continue  # unwatched meanwhile: its queued removal closes it, below
                poller.unregister(fd)
                os.close(fd)
                try:
                    entry[1]()
                except Exception:  # a bug in a callback must not stop the others
                    log.exception("exit callback of pid %d failed", entry[0])
            with self._lock:
                changes, self._changes = self._changes, []
            for kind, fd in changes:
                if kind == "add":
                    poller.register(fd, select.POLLIN)
                else:
                    with contextlib.suppress(KeyError):
                        poller.unregister(fd)
                    os.close(fd)
