"""Rank processes that crashed, named by the launcher that reaped them.

A rank that dies of a signal its own code raised (SIGSEGV in a C extension, SIGABRT from a
failed ``assert`` in C++, SIGBUS, SIGFPE, SIGILL) is lost like a killed one: a spare takes its
rank, or it is restarted in place from its node's memory. Only the launcher, the process's
parent, learns how it ended; the node agent sees its connection close, the coordinator a
loss. So the launcher says it, once per process, as torchrun does ("Signal 11 (SIGSEGV)
received by PID …"), and the rank's Python stack is above it (the rank runtime enables
``faulthandler``).

A crash that recurs after every restore is the job's own, not a lost machine's: a job that
then fails for want of spares or restarts gets that said with the reason, instead of only the
coordinator's advice to start it with more of them.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable, Mapping

from peerckpt.launch.processes import Proc

log = logging.getLogger("peerckpt.launcher")

CRASH_SIGNALS = {
    signal.SIGSEGV: "segmentation fault",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "arithmetic error",
    signal.SIGILL: "illegal instruction",
    signal.SIGABRT: "aborted: a C/C++ assertion or std::terminate",
}


def crash_of(returncode: int | None) -> str | None:
    """How a process that ended with ``returncode`` crashed, or None if it did not (still
    running, exited with a status, or killed from outside: SIGKILL, SIGTERM, SIGINT)."""
    if returncode is None or returncode >= 0:
        return None
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return None
    what = CRASH_SIGNALS.get(sig)
    return f"{sig.name} ({what})" if what is not None else None


class Crashes:
    """The crashes of a job's rank processes, as the launcher sees its children end."""

    def __init__(self) -> None:
        self._rank_of: dict[tuple[int, int], int] = {}  # (node, pid) → the rank it last held
        self._seen: set[int] = set()
        # rank → how each of its processes that ended crashed (None: it did not)
        self.by_rank: dict[int, list[str | None]] = {}

    def observe(
        self, ranks: Mapping[int, tuple[int, int]], procs: Iterable[tuple[int, Proc]]
    ) -> None:
        """``ranks``: the coordinator's rank → (node, pid); ``procs``: (node, process) of
        every training process. Logs each rank process that crashed since the last call."""
        for rank, (node, pid) in ranks.items():
            self._rank_of[(node, pid)] = rank
        for node, proc in procs:
            if proc.pid in self._seen:
                continue
            code = proc.poll()
            if code is None:
                continue
            self._seen.add(proc.pid)
            held = self._rank_of.get((node, proc.pid))
            crash = crash_of(code)
            if held is None:
                continue  # a spare that never held a rank, or one this job never placed
            self.by_rank.setdefault(held, []).append(crash)
            if crash is not None:
                log.warning(
                    "rank %d (pid %d) on node %d crashed: killed by %s; its Python stack, "
                    "if it had one, is above",
                    held,
                    proc.pid,
                    node,
                    crash,
                )

    def recurring(self) -> str:
        """A sentence for a failed job's reason where a rank crashed the same way every time
        (at least twice), or ""."""
        found = [
            (rank, ends)
            for rank, ends in sorted(self.by_rank.items())
            if len(ends) >= 2 and len(set(ends)) == 1 and ends[0] is not None
        ]
        if not found:
            return ""
        said = "; ".join(f"rank {r} crashed {len(e)} times, each by {e[0]}" for r, e in found)
        return (
            f"{said}: a crash that recurs after every restore comes from the job's code or a "
            "library it calls, not from a lost machine, and more spares or restarts end the "
            "same way; its stack is in the log above"
        )
