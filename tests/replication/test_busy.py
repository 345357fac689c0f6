"""A silent rank process that computes is busy, not hung (``replication/busy.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from peerckpt.replication.busy import BusyWatch


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _start(procs: list[subprocess.Popen[bytes]], code: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", code])
    procs.append(proc)
    time.sleep(0.3)  # past the interpreter's start
    return proc.pid


def test_a_computing_process_is_busy_and_a_stopped_or_sleeping_one_is_not(spawn) -> None:
    # json.loads of a large file holds the GIL as this loop holds the CPU: no heartbeat
    # thread runs, yet the process computes.
    computing = _start(spawn, "while True: pass")
    stopped = _start(spawn, "while True: pass")
    sleeping = _start(spawn, "import time; time.sleep(60)")
    spawn[1].send_signal(signal.SIGSTOP)  # `hang rank=R`, a debugger, a frozen machine
    watch = BusyWatch()
    watch.note([computing, stopped, sleeping])
    time.sleep(0.6)
    share = watch.busy(computing, window=0.5)
    assert share is not None and share >= 0.1
    assert watch.busy(stopped, window=0.5) is None
    assert watch.busy(sleeping, window=0.5) is None
    assert watch.first(computing, 5.2) and not watch.first(computing, 6.0)  # named once,
    assert watch.first(computing, 65.3)  # and again a minute later: it is not kept quiet
    assert watch.busy(computing, window=5.0) == share  # too soon to judge again: it stands
    spawn[0].send_signal(signal.SIGSTOP)  # it stops computing: the next window finds it
    time.sleep(0.6)
    assert watch.busy(computing, window=0.5) is None


def test_a_process_that_spoke_again_is_forgotten(spawn) -> None:
    computing = _start(spawn, "while True: pass")
    watch = BusyWatch()
    watch.note([computing])
    watch.note([])  # a heartbeat came: silent no more
    time.sleep(0.3)
    assert watch.busy(computing, window=0.1) is None  # no mark: judged afresh next time
