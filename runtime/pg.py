"""The rank's torch.distributed process group, one per epoch, and how it is aborted.

``join`` creates the default process group of an epoch on the coordinator's TCPStore under a
prefix of its own. ``abort`` must release a rank that is blocked inside a collective as soon
as the failure is known, from another thread. Measured on torch 2.13 with gloo:
``ProcessGroup.abort()`` returns but does not wake a rank blocked in ``recv`` (it waited out
the whole process-group timeout), whereas shutting down the group's TCP connections makes
the blocked collective raise within a millisecond on every survivor. So ``abort`` shuts
down the connected TCP sockets that belong to the epoch's group, recognised by their inode,
never listeners: while the group forms, every socket opened since ``begin`` (the store client
first, so an abort at any point of the rendezvous makes it fail); once it has formed, exactly
the sockets it opened while forming, so the user's own connections are left alone.
``leave`` then destroys the group; the next epoch builds a fresh one.

Cutting does not end every wait: gloo never ends a send it had started writing when its
connection closes (``runtime/inflight.py`` has the measurements). ``abort`` therefore also
fails every collective watched in ``InFlight`` (DDP's gradient all-reduce), so that the
training thread unwinds whatever gloo's worker thread is still waiting for.

An aborted group is not freed at once. Its gloo worker threads finish the failed collectives
and, destroying each one, take the GIL. ``~ProcessGroupGloo`` joins those threads while the
thread that dropped the last reference holds the GIL (the last reference is often the user's
DDP module, freed with the exception's traceback): a deadlock, seen once in the demo. So
``leave`` keeps the epoch's groups alive, and ``release_retired`` frees them later, once the
next epoch has committed a step and their workers are long idle. A group one of whose
collectives the abort left inside gloo is kept longer: freeing it would join a worker that
waits out the group's timeout (``release_retired`` frees it once that collective has ended),
and it is pinned, so that neither the runtime's end nor the interpreter's exit frees it
before then.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from peerckpt.runtime.inflight import IN_FLIGHT, InFlight
from peerckpt.runtime.userpg import ORIGINAL_DESTROY, ORIGINAL_INIT

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


def normalize_host(host: str) -> str:
    """One spelling per address: IPv4-mapped IPv6 (``::ffff:127.0.0.1``, what torch's
    TCPStore client reports as its peer) becomes plain IPv4; names resolve to addresses."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        try:
            return socket.gethostbyname(host)
        except OSError:
            return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        peer = normalize_host(sock.getpeername()[0])
        if hosts and peer not in hosts:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def _nccl_backend(group: Any) -> Any:
    """The NCCL backend of ``group`` for CUDA tensors, or None (gloo, or no CUDA)."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError):
        return None
    return backend if isinstance(backend, dist.ProcessGroupNCCL) else None


def nccl_environment(environ: dict[str, str]) -> None:
    """What a rank process needs set before its first NCCL group: peerckpt handles failures
    itself (``abort``), so NCCL's watchdog must neither end the process on a communicator
    error (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, torch's default tears it down) nor kill it
    when a collective hangs (``TORCH_NCCL_ENABLE_MONITORING``). A value the user set wins."""
    environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")


@dataclass
class _Kept:
    """Groups of an ended epoch that must outlive the collectives an abort left inside them."""

    groups: list[dist.ProcessGroup]
    unfinished: list[torch.futures.Future[Any]]

    def finished(self) -> bool:
        return all(work.done() for work in self.unfinished)


class ProcessGroupLifecycle:
    """Creates, aborts and destroys the default process group of each epoch."""

    def __init__(
        self,
        job: str,
        timeout_s: float = 1800.0,
        backend: str | None = None,
        in_flight: InFlight = IN_FLIGHT,
    ) -> None:
        self.job = job
        self._backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.epoch: int | None = None
        self._baseline: set[str] = set()
        self._owned: set[str] | None = None  # None while the group forms
        self._hosts: set[str] = set()
        self._lock = threading.Lock()
        self._aborted = False
        self._retired: list[object] = []
        self._in_flight = in_flight
        self._unfinished: list[torch.futures.Future[Any]] = []  # left inside gloo by an abort
        self._kept: list[_Kept] = []

    def backend(self) -> str:
        if self._backend is not None:
            return self._backend
        return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"

    def begin(self, epoch: int, store_addr: str, hosts: set[str]) -> None:
        """Start forming ``epoch``'s group: from now on ``abort`` cuts what it opens."""
        with self._lock:
            self._baseline = set(_socket_inodes())
            self._owned = None
            self._hosts = {normalize_host(h) for h in hosts | {store_addr.rpartition(":")[0]}}
            if any(_is_loopback(h) for h in self._hosts):
                # Hosts simulated on one machine (127.0.0.2, …): gloo's pairs connect through
                # the address the machine's name resolves to, 127.0.0.1, not the node's.
                self._hosts |= {"127.0.0.1", "::1"}
            self._aborted = False
            self.epoch = epoch
        self._in_flight.reopen()

    def join(self, store_addr: str, rank: int, world_size: int) -> None:
        """Form the default process group begun with ``begin`` (blocks until all ranks join).

        Raises if the epoch is aborted before or while the group forms.
        """
        host, _, port = store_addr.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        prefixed = dist.PrefixStore(f"peerckpt/{self.job}/epoch-{self.epoch}", store)
        with self._lock:
            if self._aborted:  # an abort from here on cuts the store client: init fails
                raise RuntimeError(f"epoch {self.epoch} was aborted while its group formed")
        if not dist.is_initialized():
            # torch names groups after a process-wide counter, which an init that failed half
            # way (an aborted epoch) leaves raised; a fresh spare's is 0. Ranks that disagree
            # wait forever for each other's rendezvous keys, so every epoch starts at 0.
            dist.distributed_c10d._world.group_count = 0
        ORIGINAL_INIT(  # torch's own: the script's name for it does nothing (runtime/userpg.py)
            self.backend(), store=prefixed, rank=rank, world_size=world_size, timeout=self.timeout
        )
        with self._lock:
            self._owned = set(_socket_inodes()) - self._baseline

    def abort(self, everything: bool = False) -> int:
        """Release any collective of this epoch blocked in this process; return sockets cut.

        ``everything``: cut every connection to the job's hosts opened since the epoch began,
        not only those its group opened while forming (a last resort). Safe to call from any
        thread, any number of times.
        """
        with self._lock:
            self._aborted = True
            baseline, owned, hosts = self._baseline, self._owned, self._hosts
        if everything:
            owned = None
        cut = 0
        for inode, fd in _socket_inodes().items():
            mine = inode in owned if owned is not None else inode not in baseline
            if mine and _shutdown_socket(fd, inode, hosts):
                cut += 1
        nccl = self._abort_nccl()
        if everything:
            # Last resort before the process gives up: also abort the groups themselves
            # (a no-op for gloo in torch 2.13).
            for group in list(dist.distributed_c10d._world.pg_map.keys()):
                with contextlib.suppress(Exception):
                    group.abort()
        # What the cut did not end (a send gloo had started writing) no longer holds anyone.
        left: list[torch.futures.Future[Any]] = []

        def unfinished(works: list[torch.futures.Future[Any]]) -> None:
            left.extend(works)
            with self._lock:  # before the training thread wakes and leaves the epoch
                self._unfinished.extend(works)

        released = self._in_flight.release(f"epoch {self.epoch} was aborted", unfinished)
        log.info(
            "aborted the process group of epoch %s (%d connections cut, %d NCCL "
            "communicator group(s) aborted, %d collective(s) released, %d of them still "
            "inside gloo)",
            self.epoch,
            cut,
            nccl,
            released,
            len(left),
        )
        return cut

    def _abort_nccl(self) -> int:
        """Abort the NCCL communicators of this epoch's groups (``ncclCommAbort``, from this
        thread while the training thread may wait in a collective or in a CUDA
        synchronisation behind one); return how many groups had one.

        NCCL's kernels do not end when a peer dies or a socket is cut: a survivor blocked in
        an all-reduce would wait out NCCL's watchdog (minutes), which then, with torch's
        default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ends the process. An abort ends the
        kernels at once and the survivor's collective raises, or its stream runs on with
        what the aborted kernel left (the step is discarded: the next step boundary sees the
        abort and the epoch restores its committed state). The groups are kept referenced
        until ``release_retired`` (freeing them is then safe), not removed from torch's
        table here: the training thread may still be using it. Several groups are aborted
        inside one NCCL group call, as torch's ``_abort_process_group`` does (pytorch#119797:
        one communicator's abort waiting for another's). Unverified on a GPU in this
        session's CI (no device): ``make test-gpu`` runs it on one."""
        groups = list(dist.distributed_c10d._world.pg_map.keys())
        backends = [b for b in (_nccl_backend(g) for g in groups) if b is not None]
        if not backends:
            return 0
        with self._lock:
            self._retired.extend(groups)  # referenced until the next epoch committed
        first = backends[0]
        with contextlib.suppress(Exception):
            first._group_start()
        try:
            for backend in backends:
                with contextlib.suppress(Exception):
                    backend.abort()
        finally:
            with contextlib.suppress(Exception):
                first._group_end()
        return len(backends)

    def leave(self) -> None:
        """Destroy the epoch's process groups (after ``abort`` or at the end of the job).

        The group objects themselves stay referenced until ``release_retired``.
        """
        with self._lock:
            unfinished = [work for work in self._unfinished if not work.done()]
            self._unfinished = []
        if dist.is_initialized():
            groups = list(dist.distributed_c10d._world.pg_map.keys())
            if unfinished:
                self._keep(_Kept(groups, unfinished))
            else:
                self._retired.extend(groups)
            with contextlib.suppress(Exception):
                ORIGINAL_DESTROY()
        self.epoch = None

    def _keep(self, kept: _Kept) -> None:
        log.warning(
            "%d collective(s) of epoch %s are still inside gloo after the abort (a send gloo "
            "does not end when its connection closes; it ends at the group's timeout, %.0f s): "
            "the epoch's process group is kept until then",
            len(kept.unfinished),
            self.epoch,
            self.timeout.total_seconds(),
        )
        for group in kept.groups:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never freed at exit
        self._kept.append(kept)

    def release_retired(self) -> None:
        """Free the groups of ended epochs. Call only when their workers are idle."""
        if self._retired:
            log.debug("releasing %d process group(s) of ended epochs", len(self._retired))
            self._retired.clear()
        for kept in [k for k in self._kept if k.finished()]:
            self._kept.remove(kept)
            for group in kept.groups:
                ctypes.pythonapi.Py_DecRef(ctypes.py_object(group))
            log.debug("released the process group(s) kept for their collectives in gloo")

    def kept(self) -> int:
        """Process groups of ended epochs kept for a collective still inside gloo."""
        return sum(len(k.groups) for k in self._kept)
