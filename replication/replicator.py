"""Replication sends: one sender thread per buddy node, one queue of snapshots each.

A snapshot of rank r is pushed to each of its k buddies in parallel (one sender per buddy);
each push ends in a call of ``done(job, node, error)``. A push the buddy refused (memory,
checksums) is retried once on a fresh connection. A push that could not reach the buddy is
retried, with backoff, for up to ``retry_s`` (the agent passes twice the heartbeat timeout):
a partition shorter than that heals and the push goes through; a buddy that is really gone is
declared lost by the coordinator meanwhile, and the epoch change ends the retries. Jobs of an
ended epoch are dropped, and an epoch change cancels the transfer in flight.
"""

from __future__ import annotations

import abc
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from peerckpt.errors import PeerckptError, PeerUnavailable, StaleEpoch
from peerckpt.faults import NO_FAULTS, FaultHooks
from peerckpt.manifest import SnapshotManifest
from peerckpt.replication.checksums import RunningChecksums
from peerckpt.replication.store import Slot
from peerckpt.replication.transfer import IO_TIMEOUT_S, Cancelled, push
from peerckpt.wire import Connection, connect_tcp

log = logging.getLogger("peerckpt.replicator")
T = TypeVar("T")


@dataclass
class ReplicationJob:
    """One snapshot to be mirrored to ``buddies``.

    ``checksums``, when set, is computing the chunks' crc32c while the first push runs
    (``start``); ``manifest`` carries them once ``checksummed`` returned.
    """

    epoch: int
    slot: Slot
    manifest: SnapshotManifest
    buddies: list[int]
    checksums: RunningChecksums | None = None
    # Chunks the buddies' copies go without: data-parallel ones the twins hold
    # (``replication/dedup.py``); empty for a full push.
    absent: tuple[int, ...] = ()
    # ``--erasure``: ``buddies`` are parity holders, which keep pieces, not copies
    # (``replication/encoding.py``); the rank's own node is its only complete copy.
    coded: bool = False
    acked: list[int] = field(default_factory=list)
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    _summed: bool = False

    @classmethod
    def start(
        cls, epoch: int, slot: Slot, manifest: SnapshotManifest, buddies: list[int]
    ) -> ReplicationJob:
        """Begin replicating the bytes the rank just wrote into ``slot``: their checksums start
        now, on a thread, and the pushes need not wait for them (the ``end`` frame carries
        them). The caller holds ``slot.lock``; the slot becomes readable (``slot.manifest``)
        once a push has sent the checksums, or at once here when there is no buddy."""
        slot.invalidate()  # whatever step it held before, it holds new bytes now
        if not buddies:
            slot.manifest = manifest.with_checksums(slot.segment.view)
            return cls(epoch, slot, slot.manifest, buddies)
        sums = RunningChecksums(
            manifest.chunks, slot.segment.view, ready=manifest.used_bytes, name=f"r{slot.rank}"
        )
        slot.pending = sums
        return cls(epoch, slot, manifest, buddies, checksums=sums)

    def checksummed(self) -> SnapshotManifest:
        """The manifest with every chunk's crc32c (waits for them if they are still running)."""
        with self.lock:
            if self.checksums is not None and not self._summed:
                self.manifest = self.manifest.with_crcs(self.checksums.wait())
                self._summed = True
            return self.manifest

    def is_current(self) -> bool:
        """Whether the slot still holds the bytes this job is about (not rewritten since)."""
        if self.checksums is not None:
            return self.slot.pending is self.checksums
        return self.slot.manifest is self.manifest

    def crcs(self) -> list[int]:
        return [c.crc for c in self.checksummed().chunks if c.crc is not None]


class NodeSender(abc.ABC, Generic[T]):
    """One destination node's queue, sent in order by one thread over one reused,
    authenticated connection, each item through ``send_with_retries``. ``put`` items;
    ``cancel_inflight`` abandons the transfer in flight (its epoch ended), later items still
    go; ``stop`` always (it joins the thread and closes the connection). A subclass says how
    an item is sent, named in the log, found stale, and what is done with its outcome."""

    def __init__(
        self, node: int, address: str, secret: bytes, job: str, faults: FaultHooks, name: str
    ) -> None:
        self.node, self.address = node, address
        self._secret, self._job, self._faults = secret, job, faults
        self._queue: queue.Queue[T | None] = queue.Queue()
        self._conn: Connection | None = None
        self.cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-n{node}", daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        self._queue.put(item)

    def cancel_inflight(self) -> None:
        """Abandon the transfer in flight (its epoch ended); later items still go."""
        self.cancel.set()

    def stop(self) -> None:
        self._queue.put(None)
        self.cancel.set()
        self._thread.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> Connection:
        """The connection to the node, opened again after a failure closed it."""
        if self._conn is None or self._conn.closed:
            self._conn = connect_tcp(
                self.address, self._secret, self._job, io_timeout=IO_TIMEOUT_S, net=self._faults.net
            )
        return self._conn

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            # Clear before the staleness check: a cancel that arrives after it is kept.
            self.cancel.clear()
            if self._stale(item):
                continue
            error = send_with_retries(
                functools.partial(self._send, item),
                self._what(item),
                functools.partial(self._epoch_ended, item),
                self._retry_s(),
                self.cancel,
                self._close,
            )
            self._finish(item, error)

    @abc.abstractmethod
    def _send(self, item: T) -> None:
        """Send ``item`` once (``self._connection()``); raise to fail the attempt."""

    @abc.abstractmethod
    def _what(self, item: T) -> str:
        """What sending ``item`` is called in the log."""

    @abc.abstractmethod
    def _stale(self, item: T) -> bool:
        """Whether ``item`` is dropped unsent (its epoch ended, its job failed)."""

    @abc.abstractmethod
    def _epoch_ended(self, item: T) -> bool:
        """Whether ``item``'s epoch ended (its retries stop)."""

    @abc.abstractmethod
    def _retry_s(self) -> float:
        """How long an unreachable node is retried."""

    @abc.abstractmethod
    def _finish(self, item: T, error: BaseException | None) -> None:
        """Take ``item``'s outcome: None, or the error that ended its sending."""


class BuddySender(NodeSender[ReplicationJob]):
    """Pushes snapshots to one buddy node over one reused connection."""

    def __init__(
        self,
        node: int,
        address: str,
        secret: bytes,
        job: str,
        current_epoch: Callable[[], int],
        committed_step: Callable[[], int | None],
        done: Callable[[ReplicationJob, int, BaseException | None], None],
        retry_s: float = 10.0,
        local_node: int = -1,
        faults: FaultHooks = NO_FAULTS,
    ) -> None:
        self._retry = retry_s
        self._local_node = local_node
        self._committed_step = committed_step
        self._current_epoch = current_epoch
        self._done = done
        super().__init__(node, address, secret, job, faults, "peerckpt-send")

    def _what(self, job: ReplicationJob) -> str:
        return f"replicating rank {job.slot.rank} step {job.manifest.step} to node {self.node}"

    def _stale(self, job: ReplicationJob) -> bool:
        return self._epoch_ended(job)

    def _epoch_ended(self, job: ReplicationJob) -> bool:
        return job.epoch != self._current_epoch()

    def _retry_s(self) -> float:
        return self._retry

    def _finish(self, job: ReplicationJob, error: BaseException | None) -> None:
        self._done(job, self.node, error)

    def _send(self, job: ReplicationJob) -> None:
        conn = self._connection()
        with job.slot.lock:
            if not job.is_current():
                raise Cancelled("slot was rewritten before it could be sent")
            push(
                conn,
                job.epoch,
                job.slot.gen,
                job.slot.rank,
                self._committed_step(),
                job.manifest.without(job.absent),
                job.slot.segment.view,
                self.cancel,
                self._midway(job) if self._faults.active else None,
                crcs=job.crcs,
            )
            if job.slot.manifest is None:
                job.slot.manifest = job.checksummed()  # the slot's bytes are whole and known

    def _midway(self, job: ReplicationJob) -> Callable[[], object]:
        where = {"rank": job.slot.rank, "node": self._local_node, "step": job.manifest.step}
        return functools.partial(self._faults.strike, "replication", **where)


def send_with_retries(
    send: Callable[[], None],
    what: str,
    epoch_ended: Callable[[], bool],
    retry_s: float,
    cancel: threading.Event,
    close: Callable[[], None],
) -> BaseException | None:
    """``send()`` until it succeeds (None) or the error that ends trying: the epoch ended
    (or the transfer was cancelled), a refusal twice, or an unreachable peer past ``retry_s``
    (retried with backoff, 50 ms doubling to 0.5 s). ``close`` drops the connection after
    each failure; every failed attempt is logged as ``what`` failed."""
    deadline = time.monotonic() + retry_s
    backoff = 0.05
    for attempt in itertools.count(1):
        try:
            send()
            return None
        except (Cancelled, StaleEpoch) as exc:
            close()
            return exc  # the epoch ended: nothing to retry
        except (PeerckptError, OSError) as exc:
            close()
            log.warning("%s failed (attempt %d): %s", what, attempt, exc)
            unreachable = isinstance(exc, (PeerUnavailable, OSError))
            if (
                epoch_ended()
                or (not unreachable and attempt >= 2)
                or time.monotonic() + backoff > deadline
            ):
                return exc
            if unreachable and cancel.wait(backoff):
                return Cancelled("transfer cancelled by an epoch change")
            backoff = min(2 * backoff, 0.5)
    raise AssertionError("unreachable")
