"""A rank process silent for a heartbeat timeout that runs on a CPU is busy, not hung.

A rank's heartbeats come from a Python thread of its own (``runtime/channel.py``), which runs
only when it gets the GIL. A C call that holds the GIL for seconds silences it: ``json.loads``
of a detection dataset's annotation file (COCO's is 450 MB; 208 MB took ~7 s here), a large
``pickle.load``, a C extension that never releases it. A machine loaded past its cores delays
it too. The agent declared such a rank hung and fenced it: in a test job whose ranks each
parsed a 208 MB JSON file at the start, every rank was fenced and the job failed, having
done nothing wrong.

What the heartbeat's silence is there to find is a process that does not run: stopped
(SIGSTOP, a debugger, a frozen VM), or deadlocked in C holding the GIL, waiting on a lock. So
a silent process whose main thread's CPU time grows by at least ``BUSY_SHARE`` of a core over
the window since it was first seen a third of a timeout silent (then over each half-timeout
window), and that is not stopped, is computing: it is named once, and not declared lost while
it computes. The main thread's alone: the runtime's and gloo's threads may run while the
script's is blocked. A stopped or blocked one uses no CPU and is
fenced as before, as late as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import psutil

from peerckpt.pidwatch import stat_fields

BUSY_SHARE = 0.1  # of one core, over the window: what a computing process uses at the least
AGAIN_S = 60.0  # a silent process that computes is named again after this much more silence


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds(pid: int) -> float | None:
    """The CPU time of the process's main thread (the one that runs the script: its other
    threads, gloo's or the runtime's, may use CPU while it is blocked), or None if it is
    stopped or gone."""
    fields = stat_fields(pid, thread=pid)
    if fields is None:
        return _process_cpu_seconds(pid)  # no /proc: the whole process's
    if fields[0] in ("T", "t"):  # stopped (SIGSTOP, a debugger)
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _process_cpu_seconds(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return None
        times = proc.cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(times.user + times.system)


class BusyWatch:
    """The CPU time of silent processes, to tell busy from hung."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[float, float]] = {}  # pid → (CPU seconds, when)
        self._named: dict[int, float] = {}  # pid → its silence when last named
        self._verdicts: dict[int, float | None] = {}  # pid → its last window's share, if busy

    def note(self, pids: Iterable[int]) -> None:
        """``pids`` are silent (a third of a timeout, as the agent calls it): mark the CPU time
        of each newly silent one; forget those that spoke again."""
        silent = set(pids)
        for pid in list(self._marks):
            if pid not in silent:
                del self._marks[pid]
                self._named.pop(pid, None)
                self._verdicts.pop(pid, None)
        for pid in silent - set(self._marks):
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self._marks[pid] = (cpu, time.monotonic())

    def busy(self, pid: int, window: float) -> float | None:
        """The share of a core ``pid`` used since its mark if it computes (at least
        ``BUSY_SHARE``, not stopped), else None. Judged over at least ``window`` seconds (a
        process's CPU time may be counted in coarse steps): sooner, the last verdict stands.
        The mark then moves to now, so a process that stops computing is found a window
        later."""
        mark = self._marks.get(pid)
        if mark is None:
            return None
        now = time.monotonic()
        if now - mark[1] < window and pid in self._verdicts:
            return self._verdicts[pid]  # the first verdict is over whatever time has passed
        cpu = cpu_seconds(pid)
        share = None if cpu is None else (cpu - mark[0]) / (now - mark[1])
        verdict = share if share is not None and share >= BUSY_SHARE else None
        if cpu is not None:
            self._marks[pid] = (cpu, now)
        self._verdicts[pid] = verdict
        return verdict

    def first(self, pid: int, silent_s: float = 0.0) -> bool:
        """True the first time ``pid`` is found busy in this silence, and again each
        ``AGAIN_S`` it stays silent (a process that computes for minutes, or never stops:
        an endless C loop holding the GIL is not declared hung, but it is not kept quiet)."""
        said = self._named.get(pid)
        if said is not None and silent_s - said < AGAIN_S:
            return False
        self._named[pid] = silent_s
        return True
