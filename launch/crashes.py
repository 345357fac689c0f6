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

SIGKILL is what peerckpt's own kills send (chaos, fencing, the end of a job), and also what
the kernel's out-of-memory killer sends. A rank process found killed by SIGKILL while the
kernel's count of OOM kills grew (``OomKills``: its cgroup's ``memory.events`` or
``memory.oom_control``, and ``/proc/vmstat``) is named as killed for memory: host memory is
what peerckpt's slots and replicas add to a job's, and a rank killed for it after every
restore needs a smaller footprint, not more spares.
"""

from __future__ import annotations

import logging
import os
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


OOM = "SIGKILL (out of memory)"


def _cgroup_oom_files(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> list[str]:
    """This process's cgroup files that count OOM kills: v2 ``memory.events``, v1
    ``memory.oom_control`` (at its path and at the namespace's root)."""
    found = []
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if controllers == "":
            found.append(os.path.join(root, path, "memory.events"))
        elif "memory" in controllers.split(","):
            found.append(os.path.join(root, "memory", path, "memory.oom_control"))
            found.append(os.path.join(root, "memory", "memory.oom_control"))
    return [p for p in dict.fromkeys(found) if os.path.exists(p)]


class OomKills:
    """The kernel's counts of OOM kills where this process can read them (``oom_kill`` lines);
    ``grew`` says which grew since it last looked."""

    def __init__(self, paths: list[str] | None = None) -> None:
        # The job's own cgroup where it has one; the machine's count (every OOM kill on the
        # host) only without.
        self.paths = paths if paths is not None else (_cgroup_oom_files() or ["/proc/vmstat"])
        self._last = self._read()

    def _read(self) -> dict[str, int]:
        counts = {}
        for path in self.paths:
            try:
                with open(path) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and value.strip().isdigit():
                            counts[path] = int(value)
            except OSError:
                continue
        return counts

    def grew(self) -> str:
        """``"PATH N → M"`` for each count that grew since the last call, or ""."""
        now = self._read()
        grown = [
            f"oom_kill in {p} {self._last[p]} → {n}"
            for p, n in now.items()
            if p in self._last and n > self._last[p]
        ]
        self._last.update(now)
        return ", ".join(grown)


class Crashes:
    """The crashes of a job's rank processes, as the launcher sees its children end."""

    def __init__(self, oom: OomKills | None = None) -> None:
        self._oom = oom if oom is not None else OomKills()
        self._oom_polls = ["", ""]  # what grew at the last two calls of ``observe``
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
        # Read at every call (every status poll), so that only an OOM kill since the last
        # poll or the one before (a death may be reaped a poll after the count grew) names a
        # SIGKILL: not one of hours ago, nor of a DataLoader worker.
        self._oom_polls = [self._oom_polls[-1], self._oom.grew()]
        oom = self._oom_polls[-1] or self._oom_polls[0]
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
            said = "; its Python stack, if it had one, is above"
            if code == -signal.SIGKILL and oom:
                crash, said = OOM, f": the kernel's OOM killer ({oom})"
            self.by_rank.setdefault(held, []).append(crash)
            if crash is not None:
                log.warning(
                    "rank %d (pid %d) on node %d crashed: killed by %s%s",
                    held,
                    proc.pid,
                    node,
                    crash,
                    said,
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
        if all(e[0] == OOM for _r, e in found):
            return (
                f"{said}: the machine runs out of memory after every restore, and more spares "
                "or restarts end the same way; give each node more memory or need less of it "
                "(a smaller batch or model per rank, fewer DataLoader workers, --replicas 1)"
            )
        return (
            f"{said}: a crash that recurs after every restore comes from the job's code or a "
            "library it calls, not from a lost machine, and more spares or restarts end the "
            "same way; its stack is in the log above"
        )
