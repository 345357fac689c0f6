"""Whether a process that is not our child has exited, waiting a bounded time for it.

A pidfd (``os.pidfd_open``, Linux ≥ 5.3) becomes readable when its process exits, zombie or
not, so it tells the exit of a process killed with SIGKILL whose parent has not reaped it yet
(``kill(pid, 0)`` would still succeed on that zombie). Where pidfds are missing, ``/proc``'s
state is read instead (a zombie counts as exited).

Pure queries: nothing here signals, reaps or keeps a process.
"""

from __future__ import annotations

import contextlib
import os
import select
import time


class ProcessWatch:
    """One process, watched by pid for as long as this object is open (``close`` it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._fd = os.pidfd_open(pid)

    def exited(self, wait_s: float = 0.0) -> bool:
        """True once the process has exited; waits up to ``wait_s`` seconds for it."""
        if self._fd is not None:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            return bool(poller.poll(max(0, int(wait_s * 1000))))
        deadline = time.monotonic() + wait_s
        while True:
            if not alive(self.pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ProcessWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stat_fields(pid: int, thread: int | None = None) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` (of its thread ``thread``: ``task/TID/stat``) after
    the command's name — state, ppid, …, utime (11), stime (12) — or None where unreadable."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as f:
            return f.read().rpartition(")")[2].split() or None
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from /proc)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")
