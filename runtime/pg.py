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

gloo connects its pairs lazily, at their first use, when ``TORCH_GLOO_LAZY_INIT`` is set
when the group is constructed (torch 2.13 reads it then). Forming the group then costs the
store one set per rank instead of eager gloo's world² gets (``bench/scale.py``: 6 s at 320
simulated ranks eager, 2.6 s at 10,000 with NCCL and lazy gloo), so ``join`` sets it for
GPU jobs (whose gloo group carries only CPU tensors) and for CPU jobs of more than
``LAZY_GLOO_WORLD`` ranks; ``PEERCKPT_GLOO_LAZY=1``/``0`` forces it either way, and a value
the user set wins. Lazily connected pairs are opened after the group formed, so they are not
among the sockets it opened while forming: ``abort`` also cuts every socket opened since
``begin`` that carries gloo's own mark, the group's timeout as its ``SO_RCVTIMEO`` (gloo sets
it on every pair; measured on torch 2.13: a pair connected by the first all-reduce carried
exactly the timeout given to ``init_process_group``, the store client and listeners none).
A pair still waiting for a peer that died before connecting has no socket to cut: its
collective is released by ``InFlight`` or, failing that, by the abort watchdog's restart.

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
import struct
import sys
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from peerckpt.runtime.inflight import IN_FLIGHT, InFlight
from peerckpt.runtime.userpg import ORIGINAL_DESTROY, ORIGINAL_INIT

log = logging.getLogger("peerckpt.pg")

# A CPU job of more ranks than this connects gloo's pairs lazily. Eager gloo's world² store
# gets took 0.64 s at 104 ranks and 6 s at 320 (bench/results/scale.json); at 64 ranks they
# are a few tenths of a second, and an eager group fails fast on a peer lost before its
# first collective.
LAZY_GLOO_WORLD = 64
_TIMEVAL = struct.Struct("@ll")


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


def _gloo_timeout_s(sock: socket.socket) -> float:
    """The socket's ``SO_RCVTIMEO`` in seconds (0: none), which gloo sets on its pairs."""
    seconds, micros = _TIMEVAL.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.size)
    )
    return float(seconds + micros / 1e6)


def _shutdown_socket(
    fd: int, inode: str, hosts: set[str], gloo_timeout_s: float | None = None
) -> bool:
    """Shut down the connection ``fd`` if it still is ``inode``, reaches one of ``hosts`` (any
    host if empty) and is no listener; with ``gloo_timeout_s``, only if it is a gloo pair of
    a group with that timeout."""
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
        if gloo_timeout_s is not None and abs(_gloo_timeout_s(sock) - gloo_timeout_s) > 0.002:
            return False  # not opened by a gloo group of this epoch
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


def gloo_lazy(backend: str, world_size: int, environ: Mapping[str, str]) -> bool:
    """Should this epoch's gloo group connect its pairs at their first use (see the module
    docstring)? ``PEERCKPT_GLOO_LAZY`` (``1`` or ``0``) decides if set."""
    forced = environ.get("PEERCKPT_GLOO_LAZY", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return "nccl" in backend or world_size > LAZY_GLOO_WORLD


def gloo_environment(environ: MutableMapping[str, str], user_value: str | None, lazy: bool) -> bool:
    """Set ``TORCH_GLOO_LAZY_INIT`` for the next group unless the user set it
    (``user_value``); return whether its gloo pairs connect lazily."""
    if user_value is not None:
        return user_value.strip().lower() in ("1", "true", "yes", "on")
    environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"
    return lazy


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
        self._user_gloo_lazy = os.environ.get("TORCH_GLOO_LAZY_INIT")  # theirs wins
        self.gloo_lazy = False  # whether the current epoch's gloo pairs connect lazily

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
        backend = self.backend()
        self.gloo_lazy = gloo_environment(
            os.environ, self._user_gloo_lazy, gloo_lazy(backend, world_size, os.environ)
        )
        log.info(
            "epoch %s: gloo connects its pairs %s",
            self.epoch,
            "lazily, at their first use" if self.gloo_lazy else "while the group forms",
        )
        _one_traceback_prefix()
        ORIGINAL_INIT(  # torch's own: the script's name for it does nothing (runtime/userpg.py)
            backend, store=prefixed, rank=rank, world_size=world_size, timeout=self.timeout
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
            if inode in baseline:
                continue
            if owned is None or inode in owned:
                cut += _shutdown_socket(fd, inode, hosts)
            else:  # opened since the group formed: only a pair gloo connected lazily
                cut += _shutdown_socket(fd, inode, hosts, self.timeout.total_seconds())
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
            _destroy_groups(self.epoch)
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


def _destroy_groups(epoch: int | None) -> None:
    """torch's ``destroy_process_group()``; where it raises, torch's tables of groups are
    cleared here, so that the next epoch's ``init_process_group`` starts clean.

    Shutting down an NCCL group whose communicators an abort ended can raise (seen on an H200,
    torch 2.11: a survivor's next epoch then failed "trying to initialize the default process
    group twice!"). The group objects stay referenced by ``_retired``/``_kept`` as before."""
    try:
        ORIGINAL_DESTROY()
        return
    except Exception as exc:  # the tables are cleared below, and the cause logged
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        log.warning(
            "destroying the process groups of epoch %s raised %s: %s; forgetting them instead",
            epoch,
            type(exc).__name__,
            first,
        )
    c10d = dist.distributed_c10d
    world = c10d._world
    c10d._update_default_pg(None)
    for name in (
        "pg_map",
        "pg_names",
        "pg_group_ranks",
        "pg_backend_config",
        "pg_to_tag",
        "tags_to_pg",
        "pg_coalesce_state",
        "comms",
    ):
        table = getattr(world, name, None)
        if table is not None:
            table.clear()
    with contextlib.suppress(Exception):
        c10d._unregister_all_process_groups()
    world.group_count = 0


_plain_excepthook: Any = None  # sys.excepthook before torch's first group in this process


def _one_traceback_prefix() -> None:
    """Before a group forms: torch's ``init_process_group`` wraps ``sys.excepthook`` in one
    that prefixes an uncaught exception's lines with ``[rank<r>]:``, around whatever hook was
    there — its own of the last epoch too, so a rank in its third epoch printed
    ``[rank0]: [rank0]: [rank0]: Traceback``. Torch's hook of an earlier epoch is taken off
    first: one prefix, of the rank this epoch gives."""
    global _plain_excepthook
    if _plain_excepthook is None:
        _plain_excepthook = sys.excepthook
    elif getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
        sys.excepthook = _plain_excepthook
