"""When to write a committed step to durable storage, who writes what, and the commit.

The coordinator owns one ``FlushScheduler``. After each commit it asks ``due``: a flush is due
every ``every`` steps and/or every ``interval`` seconds, but never while the previous one is
still running — that step is skipped and counted as lag, not queued. A due flush is planned
with ``persist.durable.assign_writers`` (each unique chunk by one agent that holds it, bytes
balanced) and sent to the agents; each writes its part and reports. When every writer has
reported success, the scheduler merges the parts into the manifest and commits the step in a
background thread (``DurableStore.commit``: manifest, marker, ``latest``, retention). A
failed writer (full disk, a vanished slot) fails that flush only: it is logged, training goes
on, and the next due step tries again — once the failed flush's other writers have reported
(or been lost): an agent still writing the failed step would refuse the next one.

As the job ends (every rank done, or its launcher stopping it on a signal) the coordinator
waits for the flush in progress, then flushes the last committed step unless a flush of it
was started (``owed``): the newest state is never left in memory only. A job whose every
flush failed is told why (``failure``) and does not end as a success.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from peerckpt.errors import CheckpointError
from peerckpt.manifest import ChunkRecord
from peerckpt.messages.control import Flush, Flushed, FlushRecord
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.durable import DurableStore, assign_writers
from peerckpt.states import FLUSH, FlushState

log = logging.getLogger("peerckpt.coordinator")

# How long a failed flush's other writers may hold off the next flush: a report lost on the
# way (a coordinator that moved) must not stop the durable tier for good.
DRAIN_LIMIT_S = 120.0


@dataclass
class FlushInProgress:
    """One flush: a committed step being written."""

    step: int
    epoch: int
    writers: dict[int, list[tuple[int, ChunkRecord]]]
    layouts: dict[int, list[ChunkRecord]]
    started_at: float = field(default_factory=time.time)
    done: dict[int, Flushed] = field(default_factory=dict)
    state: FlushState = FlushState.WRITING
    error: str = ""
    committed_at: float | None = None
    unreported: set[int] = field(init=False)  # writers yet to report, or be lost
    failed_at: float | None = None  # time.monotonic() of the failure

    def __post_init__(self) -> None:
        self.unreported = set(self.writers)

    def become(self, state: FlushState, error: str = "") -> None:
        self.state = FLUSH.check(self.state, state)
        self.error = error or self.error

    def record(self) -> FlushRecord:
        return FlushRecord(
            step=self.step,
            state=self.state,
            error=self.error,
            started_at=self.started_at,
            committed_at=self.committed_at,
            nbytes=sum(r.nbytes for items in self.writers.values() for _, r in items),
            writers={n: d.seconds for n, d in self.done.items()},
        )


class FlushScheduler:
    """Decides flushes and commits them. Call its methods under the coordinator's lock."""

    def __init__(self, config: PersistConfig) -> None:
        self.config = config
        self.current: FlushInProgress | None = None
        self.history: list[FlushInProgress] = []
        self.skipped: list[int] = []  # due steps not flushed because one was still running
        self._last_started = time.monotonic()
        self._last_step: int | None = None
        self._last_seen: int | None = None  # the last committed step asked about
        self._threads: list[threading.Thread] = []
        # Called (without the coordinator's lock) when a flush commits or fails.
        self.on_settled: Callable[[], None] | None = None

    def busy(self) -> bool:
        return self.current is not None and self.current.state.busy

    def draining(self) -> set[int]:
        """The nodes still writing a flush that already failed (another writer's error)."""
        flush = self.current
        if flush is None or flush.state is not FlushState.FAILED or flush.failed_at is None:
            return set()
        if time.monotonic() - flush.failed_at > DRAIN_LIMIT_S:
            return set()
        return set(flush.unreported)

    def _settled(self) -> None:
        if self.on_settled is not None:
            self.on_settled()

    def due(self, step: int) -> bool:
        """Whether committed ``step`` should be flushed now."""
        c = self.config
        # A multiple of ``every``, or the first commit past one: with snapshots every n steps
        # (runtime/policy.py) the committed steps need not fall on the multiples.
        seen, self._last_seen = self._last_seen, step
        by_step = c.every is not None and (
            step % c.every == 0 or (seen is not None and step // c.every > seen // c.every)
        )
        by_time = c.interval is not None and time.monotonic() - self._last_started >= c.interval
        if not (by_step or by_time) or step == self._last_step:
            return False
        if self.busy():
            assert self.current is not None
            self.skipped.append(step)
            log.warning(
                "flush of step %d is still running; step %d is not flushed (lag)",
                self.current.step,
                step,
            )
            return False
        draining = self.draining()
        if draining:
            assert self.current is not None
            self.skipped.append(step)
            log.warning(
                "flush of step %d failed and node(s) %s still write it; step %d is not "
                "flushed (lag)",
                self.current.step,
                sorted(draining),
                step,
            )
            return False
        return True

    def owed(self, step: int) -> bool:
        """Whether committed ``step``, the job's last, is still to be flushed as the job ends:
        no flush of it was started (one that ran, committed or failed, is not repeated)."""
        return step != self._last_step

    def failure(self) -> str:
        """Why no step of the job became durable, if flushes were tried and none committed
        (the one in progress counts as not committed: the job is ending without it)."""
        tried = list(self.history)
        if self.current is not None and self.current not in tried:
            tried.append(self.current)
        if not tried or any(f.state is FlushState.COMMITTED for f in tried):
            return ""
        last = tried[-1]
        why = last.error or f"still {last.state.value} when the job ended"
        return (
            f"no step was made durable in {self.config.url}: {len(tried)} flush(es) tried, "
            f"none committed (the last, of step {last.step}: {why}); check that the storage is "
            "reachable, writable and has space, then run again"
        )

    def start(
        self,
        step: int,
        epoch: int,
        gen: int,
        layouts: dict[int, list[Any]],
        holders: dict[int, set[int]],
    ) -> dict[int, Flush]:
        """Plan a flush of ``step``; return the event for each writer node."""
        # Layouts are reported once per epoch: structure only, their checksums are stale.
        records = {
            r: [replace(ChunkRecord.from_msg(c), crc=None) for c in cs] for r, cs in layouts.items()
        }
        writers = assign_writers(records, holders)
        self.current = FlushInProgress(step, epoch, writers, records)
        self._last_started = time.monotonic()
        self._last_step = step
        log.info(
            "flushing step %d to %s: %s",
            step,
            self.config.url,
            {n: len(items) for n, items in sorted(writers.items())},
        )
        return {
            node: Flush(
                step,
                epoch,
                gen,
                self.config.to_msg(),
                [(rank, rec.to_msg()) for rank, rec in items],
            )
            for node, items in writers.items()
        }

    def written(self, msg: Flushed) -> None:
        """A writer reported; commit once all have succeeded."""
        flush = self.current
        if flush is None or msg.step != flush.step:
            return
        flush.unreported.discard(msg.node)
        if flush.state is not FlushState.WRITING:
            if flush.state is FlushState.FAILED and not flush.unreported:
                self._settled()  # its last writer is done: the next flush may start
            return
        if not msg.ok:
            self._failed(flush, f"node {msg.node}: {msg.error or 'failed'}")
            return
        flush.done[msg.node] = msg
        if set(flush.done) == set(flush.writers):
            flush.become(FlushState.COMMITTING)
            thread = threading.Thread(
                target=self._commit, args=(flush,), name="peerckpt-flush-commit", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def node_lost(self, node: int) -> None:
        flush = self.current
        if flush is None:
            return
        drained = flush.state is FlushState.FAILED and node in flush.unreported
        flush.unreported.discard(node)
        if flush.state is FlushState.WRITING and node in flush.writers:
            self._failed(flush, f"node {node}, one of its writers, was lost")
        elif drained and not flush.unreported:
            self._settled()

    def _failed(self, flush: FlushInProgress, why: str) -> None:
        flush.become(FlushState.FAILED, why)
        flush.failed_at = time.monotonic()
        self.history.append(flush)
        log.warning(
            "flush of step %d failed (%s); training goes on, the next flush tries again; the "
            "previous checkpoints are untouched",
            flush.step,
            why,
        )
        self._settled()

    def _commit(self, flush: FlushInProgress) -> None:
        try:
            DurableStore(self.config.url, mode=self.config.mode).commit(
                flush.step, flush.epoch, flush.layouts, keep=self.config.keep
            )
        except (CheckpointError, OSError) as exc:
            self._failed(flush, f"commit: {type(exc).__name__}: {exc}")
            return
        flush.committed_at = time.time()
        flush.become(FlushState.COMMITTED)
        self.history.append(flush)
        log.info(
            "step %d is durable in %s (%.2f s after its flush began)",
            flush.step,
            self.config.url,
            flush.committed_at - flush.started_at,
        )
        self._settled()

    def records(self) -> list[FlushRecord]:
        flushes = list(self.history)
        if self.current is not None and self.current not in flushes:
            flushes.append(self.current)
        return [f.record() for f in flushes]

    def join(self, timeout: float = 30.0) -> None:
        """Wait for commits in progress (the job is ending)."""
        for thread in self._threads:
            thread.join(timeout)
