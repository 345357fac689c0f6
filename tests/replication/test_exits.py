"""The agent's exit watcher: a process's exit is reported at once, even while a child of it
still holds the socket that would otherwise tell."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from peerckpt.replication.exits import ExitWatcher

# A process that forks a child holding the inherited socket end, prints the child's pid, and
# sleeps: as a rank with a DataLoader worker does.
_PARENT_WITH_CHILD = """
import os, sys, time
fd = int(sys.argv[1])
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
time.sleep(30)
"""


def _open_files() -> set[str]:
    """What this process's descriptors point at ("pipe:[inode]", "anon_inode:[pidfd]", …):
    other tests' threads may open and close descriptors meanwhile, so the test compares the
    watcher's own objects, not descriptor numbers."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
    return out


def _pidfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            continue
    return count


def test_an_exit_is_reported_while_a_child_still_holds_the_processes_socket() -> None:
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT_WITH_CHILD, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    exited = threading.Event()
    watcher = ExitWatcher()
    try:
        assert watcher.watch(proc.pid, exited.set)
        proc.kill()
        proc.wait(timeout=10)
        assert exited.wait(timeout=5.0), "the exit was not reported"
        mine.settimeout(0.2)  # the socket alone would not have told: the child holds it
        try:
            data = mine.recv(1)
        except TimeoutError:
            data = None
        assert data is None, "the socket closed: the test did not keep it open"
    finally:
        os.kill(grandchild, 9)
        watcher.stop()
        mine.close()
        proc.stdout.close()


def test_an_unwatched_process_is_never_reported_and_stop_closes_everything() -> None:
    pidfds = _pidfds()
    watcher = ExitWatcher()
    pipe = {os.readlink(f"/proc/self/fd/{fd}") for fd in (watcher._wake_r, watcher._wake_w)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    calls: list[int] = []
    try:
        assert watcher.watch(proc.pid, lambda: calls.append(1))
        watcher.unwatch(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait(timeout=10)
        reported = threading.Event()
        assert watcher.watch(done.pid, reported.set)  # gone already: reported at once
        assert reported.wait(timeout=5.0)
    finally:
        watcher.stop()
    assert calls == []
    assert not pipe & _open_files(), "the watcher left its wake-up pipe open"
    assert _pidfds() <= pidfds, "the watcher left pidfds open"
