"""Children a rank forks (DataLoader workers) die with it and drop its control socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

# A "rank": installs the fork handler with its control socket, forks a worker the way
# multiprocessing does (from the main thread), and sleeps. The worker reports its pid and
# whether it still has the socket, then sleeps far longer than the test waits.
_RANK = """
import multiprocessing, os, socket, sys, time
from peerckpt.runtime import children

control, _peer = socket.socketpair()
children.install(control)

def worker(fd, inode):
    # The number may be in use again (multiprocessing reopens stdin): compare the inode.
    try:
        held = "held" if os.fstat(fd).st_ino == inode else "closed"
    except OSError:
        held = "closed"
    print(os.getpid(), held, flush=True)
    time.sleep(60)

multiprocessing.get_context("fork").Process(target=worker, args=(control.fileno(), os.fstat(control.fileno()).st_ino)).start()
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_forked_worker_drops_the_socket_and_dies_with_its_rank() -> None:
    rank = subprocess.Popen([sys.executable, "-c", _RANK], stdout=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    worker = 0
    try:
        pid, held = rank.stdout.readline().split()
        worker = int(pid)
        assert held == "closed"
        rank.kill()  # as a crash: nobody tells the worker
        rank.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "the worker outlived its rank"
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(timeout=10)
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        rank.stdout.close()
