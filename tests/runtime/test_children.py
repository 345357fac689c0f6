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


# A rank after a membership change: the last epoch's process group is garbage, held in a
# cycle (as the frames of the function that a MembershipChanged ended hold its DDP), not yet
# collected. A worker forked now runs a collection, as any allocation in it may start one. The
# rank forks one worker before it installs the fork handler, then one after.
_GARBAGE = """
import gc, multiprocessing, socket
import torch, torch.distributed as dist
from peerckpt.runtime import children

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.new_group([0])
dist.all_reduce(torch.ones(3), group=group)  # gloo's threads now wait on its condition
class Frame: pass
frame = Frame(); frame.cycle = frame; frame.group = group
gc.collect()  # old, as after some training: only a full collection, rarely run, frees it
dist.destroy_process_group(group)
del frame, group

def worker(out):
    class Mine:
        def __del__(self): out.put("own garbage collected")
    mine = Mine(); mine.cycle = mine; del mine
    gc.collect()  # without the freeze: ProcessGroupGloo's destructor, in a child
    out.put(f"gc enabled {gc.isenabled()}")

def fork(wait):
    out = multiprocessing.get_context("fork").SimpleQueue()
    child = multiprocessing.get_context("fork").Process(target=worker, args=(out,))
    child.start()
    child.join(timeout=wait)
    said = ["hung" if child.is_alive() else f"exited {child.exitcode}"]
    if child.is_alive():
        child.kill()
        child.join()
    while not out.empty():
        said.append(out.get())
    return said

print("without:", fork(3.0), flush=True)
control, _peer = socket.socketpair()
children.install(control)
print("with:", fork(30.0), "parent gc enabled", gc.isenabled(), flush=True)
"""


def test_a_worker_forked_after_a_membership_change_never_collects_the_ranks_process_group() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _GARBAGE], capture_output=True, text=True, timeout=120
    ).stdout
    without = next(line for line in out.splitlines() if line.startswith("without:"))
    with_ = next(line for line in out.splitlines() if line.startswith("with:"))
    # Without the fork handler the worker hangs in the destructor (or crashes in it).
    assert "exited 0" not in without, out
    assert "exited 0" in with_, out
    assert "own garbage collected" in with_  # what the child makes is collected as usual
    assert "gc enabled True" in with_ and "parent gc enabled True" in with_  # on, both sides
