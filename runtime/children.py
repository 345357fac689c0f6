"""Processes a rank forks die with it and hold nothing of the job.

A forked child — above all a DataLoader worker — inherits every descriptor of the rank: the
control socket to its agent, its process group's connections, its mapped snapshot slots.
torch's worker loop notices a dead parent only by polling (every 5 s), so after a crash the
workers outlived the rank by seconds, holding all of that. ``install`` registers a fork
handler, once per process, that in every child forked from the rank's main thread:

- asks the kernel to SIGKILL the child when the rank dies (``PR_SET_PDEATHSIG``), and exits at
  once if the rank died between the fork and that call;
- closes the child's copy of the control socket (the child never speaks to the agent);
- freezes the garbage collector's view of what it inherited (``gc.freeze``), so that the
  child never collects the rank's garbage. After a membership change the previous epoch's
  objects (the function's frames, held in a cycle by the exception that ended them, its DDP,
  its process group) are garbage until the rank's collector runs; a DataLoader worker forked
  before then collected them itself, and ``ProcessGroupGloo``'s destructor, waiting for gloo
  threads that do not exist in a child, hung the worker (or crashed it: "Unexpected
  segmentation fault encountered in worker") and with it the rank. The collector is off
  across the fork, so no collection can run in the child before the freeze; what the child
  itself makes is collected as usual.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, so a child forked from any
other thread is left alone here: the launcher ends the rank's whole process group when the
rank exits (``launch/processes.py``), which takes those too. Children started with
``spawn`` run a fresh interpreter without these descriptors; the process group covers them.

This module never touches the parent's state from a child beyond the child's own copies of
descriptors, and does nothing on systems without ``prctl``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import sys
import threading
from typing import Any

_PR_SET_PDEATHSIG = 1
_installed = False
_sockets: list[socket.socket] = []
_forking = threading.local()  # the forking thread's: its parent pid, whether it is the main one
_gc_lock = threading.Lock()
_gc_depth = 0  # forks under way (threads may fork at once)
_gc_was_enabled = False  # the collector's state before the first of them
_prctl: Any = None  # libc's prctl, looked up before any fork


def install(control: socket.socket) -> None:
    """Make the children this process forks die with it and drop ``control``."""
    global _installed, _prctl
    _sockets.append(control)
    if _installed or not sys.platform.startswith("linux") or not hasattr(os, "register_at_fork"):
        return
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None
    os.register_at_fork(before=_before_fork, after_in_parent=_in_parent, after_in_child=_in_child)
    _installed = True


def _before_fork() -> None:
    global _gc_depth, _gc_was_enabled
    # A child forked while another thread made a Python thread state hung in os.fork()
    # itself (CPython 3.11): the collectives' callbacks no longer make one at each call
    # (``runtime/inflight.py``, ``_keep_thread_state``), so nothing is waited for here.
    with _gc_lock:  # threads may fork at once: the collector's state is saved by the first
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
        _gc_depth += 1
        gc.disable()  # the fork handlers registered before ours run in the child before ours
    _forking.parent = os.getpid()
    _forking.from_main = threading.current_thread() is threading.main_thread()


def _in_parent() -> None:
    global _gc_depth
    with _gc_lock:
        _gc_depth -= 1
        if _gc_depth == 0 and _gc_was_enabled:
            gc.enable()


def _in_child() -> None:
    global _gc_depth, _gc_lock
    gc.freeze()  # the rank's garbage is the rank's to collect: never in this child
    _gc_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _gc_depth = 0
    if _gc_was_enabled:
        gc.enable()
    for sock in _sockets:
        with contextlib.suppress(OSError):
            sock.close()  # this process's copy only: the rank's own stays open
    _sockets.clear()
    if _prctl is None or not getattr(_forking, "from_main", False):
        return
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != _forking.parent:  # the rank died before the call above took effect
        os._exit(1)
