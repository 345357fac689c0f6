"""The rank's torch.distributed process group, one per epoch, and how it is aborted.

``join`` creates the default process group of an epoch on the coordinator's TCPStore under a
prefix of its own. ``abort`` must release a rank that is blocked inside a collective as soon
as the failure is known, from another thread. Measured on torch 2.13 with gloo:
``ProcessGroup.abort()`` returns but does not wake a rank blocked in ``recv`` (it waited out
the whole process-group timeout), whereas shutting down the group's TCP connections makes
the blocked collective raise within a millisecond on every survivor. So ``abort`` shuts
down the connected TCP sockets that this rank opened while joining the epoch (the store
client and gloo's pairs, never listeners), recognised by their inode and restricted to the
job's own hosts. ``leave`` then destroys the group; the next epoch builds a fresh one.

An aborted group is not freed at once. Its gloo worker threads finish the failed collectives
and, destroying each one, take the GIL. ``~ProcessGroupGloo`` joins those threads while the
thread that dropped the last reference holds the GIL (the last reference is often the user's
DDP module, freed with the exception's traceback): a deadlock, seen once in the demo. So
``leave`` keeps the epoch's groups alive, and ``release_retired`` frees them later, once the
next epoch has committed a step and their workers are long idle.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("peerckpt.pg")


def _socket_inodes() -> dict[str, int]:
    """Socket inode → fd for every socket this process has open."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[target] = int(fd)
    return found


def _shutdown_socket(fd: int, inode: str, hosts: set[str]) -> bool:
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != inode:
            return False  # the fd was closed and reused meanwhile
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False  # gloo aborts the process if its listener is shut down
        peer = sock.getpeername()[0]
        if hosts and peer not in hosts:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()


class ProcessGroupLifecycle:
    """Creates, aborts and destroys the default process group of each epoch."""

    def __init__(self, job: str, timeout_s: float = 1800.0) -> None:
        self.job = job
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.epoch: int | None = None
        self._baseline: set[str] = set()
        self._hosts: set[str] = set()
        self._lock = threading.Lock()
        self._aborted = False
        self._retired: list[object] = []

    def backend(self) -> str:
        return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"

    def join(
        self, epoch: int, store_addr: str, rank: int, world_size: int, hosts: set[str]
    ) -> None:
        """Create the default process group of ``epoch`` (blocks until every rank joins)."""
        host, _, port = store_addr.rpartition(":")
        with self._lock:
            self._baseline = set(_socket_inodes())
            self._hosts = hosts | {host}
            self._aborted = False
            self.epoch = epoch
        store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        prefixed = dist.PrefixStore(f"peerckpt/{self.job}/epoch-{epoch}", store)
        with self._lock:
            if self._aborted:
                raise RuntimeError(f"epoch {epoch} was aborted while joining")
        dist.init_process_group(
            self.backend(), store=prefixed, rank=rank, world_size=world_size, timeout=self.timeout
        )

    def abort(self) -> int:
        """Release any collective of this epoch blocked in this process; return sockets cut.

        Safe to call from any thread, any number of times.
        """
        with self._lock:
            self._aborted = True
            baseline, hosts = self._baseline, self._hosts
        cut = 0
        for inode, fd in _socket_inodes().items():
            if inode not in baseline and _shutdown_socket(fd, inode, hosts):
                cut += 1
        log.info("aborted the process group of epoch %s (%d connections cut)", self.epoch, cut)
        return cut

    def leave(self) -> None:
        """Destroy the epoch's process groups (after ``abort`` or at the end of the job).

        The group objects themselves stay referenced until ``release_retired``.
        """
        if dist.is_initialized():
            self._retired.extend(dist.distributed_c10d._world.pg_map.keys())
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.epoch = None

    def release_retired(self) -> None:
        """Free the groups of ended epochs. Call only when their workers are idle."""
        if self._retired:
            log.debug("releasing %d process group(s) of ended epochs", len(self._retired))
            self._retired.clear()
