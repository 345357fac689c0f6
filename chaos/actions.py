"""What the chaos monkey does to a job's processes: the faults themselves.

Faults come from outside the training processes, as real ones do. A machine-level fault (a
node, its agent, the coordinator lost; a node added) is the launcher's to cause, since only
the launcher knows what a node is in its backend, so :class:`FaultActions` asks it through
:class:`Machines`, the few calls of a launcher (``launch/base.py``, ``Launcher``) that chaos
needs, so that this package never imports a launcher. Process-level faults act on this machine
directly: a signal to one process, a flipped byte in a replica's shared memory, a network
fault written to the node's fault file, which the node agent's hooks read
(``chaos/points.py``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import threading
import time
from typing import Protocol

from peerckpt.shm import SHM_DIR, segment_prefix

# corrupt: how far into a replica's data, and how densely, bytes are flipped
FLIP_SPAN = 8192
FLIP_STRIDE = 64


class Machines(Protocol):
    """What runs the job, as the machine-level faults see it: a launcher meets it. Each call
    loses (or adds) what it names while the job runs; ``job`` and ``run_id`` name the job's
    shared-memory segments."""

    job: str
    run_id: str

    def kill_node(self, node: int) -> None: ...
    def kill_agent(self, node: int) -> None: ...
    def kill_coordinator(self) -> None: ...
    def add_node(self) -> int: ...


class FaultActions:
    """The monkey's target (``chaos.monkey.FaultTarget``) for one running job."""

    def __init__(self, launcher: Machines, fault_dir: str | None) -> None:
        self._launcher = launcher
        self._fault_dir = fault_dir
        self._hung: dict[int, threading.Timer] = {}  # pid → the timer that will SIGCONT it
        self._net: dict[int, dict[str, float]] = {}  # node → its network fault file's content

    @property
    def chaos_dir(self) -> str | None:
        return self._fault_dir

    # -- machine-level: the launcher causes them -------------------------------------------
    def kill_node(self, node: int) -> None:
        self._launcher.kill_node(node)

    def kill_agent(self, node: int) -> None:
        self._launcher.kill_agent(node)

    def kill_coordinator(self) -> None:
        self._launcher.kill_coordinator()

    def add_node(self) -> int:
        return self._launcher.add_node()

    # -- process-level --------------------------------------------------------------------
    def kill_pid(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def hang_pid(self, pid: int, seconds: float) -> None:
        """SIGSTOP ``pid`` (the process freezes, sockets open); SIGCONT it after ``seconds``."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, self._wake, args=(pid,))
        timer.daemon = True
        self._hung[pid] = timer
        timer.start()

    def _wake(self, pid: int) -> None:
        self._hung.pop(pid, None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def wake_all(self) -> None:
        """Thaw every frozen process now: a frozen process cannot exit when the job stops."""
        for pid, timer in list(self._hung.items()):
            timer.cancel()
            self._wake(pid)

    def corrupt_replicas(self, rank: int) -> list[str]:
        """Flip bytes at the start of the data of every replica segment of ``rank`` (on its
        buddies' nodes), as a bad DIMM or a stray write would; the first chunk's checksum no
        longer matches. A buddy's partial copy (redundancy-aware replication) is a sparse file
        whose absent chunks are holes, and its first page of data (``SEEK_DATA``) may begin
        with an absent chunk's bytes: every ``FLIP_STRIDE``-th byte of that first page and the
        next is flipped, so any present chunk of at least that size starting there is hit."""
        prefix = segment_prefix(self._launcher.job, self._launcher.run_id)
        pattern = os.path.join(SHM_DIR, f"{prefix}n*-r{rank}-g*")
        flipped = []
        for path in sorted(glob.glob(pattern)):
            try:
                with open(path, "r+b") as f:
                    at = os.lseek(f.fileno(), 0, os.SEEK_DATA)
                    end = os.lseek(f.fileno(), at, os.SEEK_HOLE)
                    f.seek(at)
                    data = bytearray(f.read(min(end - at, FLIP_SPAN)))
                    if not data:
                        continue
                    data[::FLIP_STRIDE] = bytes(b ^ 0xFF for b in data[::FLIP_STRIDE])
                    f.seek(at)
                    f.write(data)
            except OSError:
                continue  # released meanwhile, or nothing but holes
            flipped.append(os.path.basename(path))
        return flipped

    def net_fault(
        self, node: int, partition_s: float = 0.0, rate: float = 0.0, slow_s: float = 0.0
    ) -> None:
        """Tell node ``node``'s agent to cut its connections for ``partition_s``, or to pace
        its data links at ``rate`` bytes/s (for ``slow_s``; 0: until the job ends)."""
        assert self._fault_dir is not None
        fault = self._net.setdefault(node, {})
        now = time.time()
        if partition_s:
            fault["partition_until"] = now + partition_s
        if rate:
            fault.update(rate=rate, slow_until=now + slow_s if slow_s else 0.0)
        path = os.path.join(self._fault_dir, f"net-{node}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(fault, f)
        os.rename(path + ".tmp", path)
