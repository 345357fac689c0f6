"""The agent's durable writer: one node's share of a committed step, to storage.

The coordinator sends ``flush`` with the chunks this node writes (each unique chunk of the
step is written by exactly one node). The writer runs in its own thread at low CPU and I/O
priority. Local files are written straight from the slots holding the step (O_DIRECT, no
copy), each piece under its slot's lock after checking the slot still holds that step; other
storage is slower than a slot's reuse (two commits later), so the share is copied out of the
slots first and written at leisure, and so is every later flush once a slot was reused
while a local flush read it. Each chunk is verified against its checksum: a copy before it
is written, a chunk written straight from its slot right after (the rank may have rewritten
it meanwhile); then the part index, then ``Flushed``. It never changes the slots. ``rate`` (bytes
per second) throttles the writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import psutil

from peerckpt.errors import CheckpointError
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.messages.control import Flush, Flushed
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.durable import (
    DurableStore,
    HeldBytesChanged,
    Piece,
    copied,
    is_local_url,
)
from peerckpt.replication.store import Slot, SlotStore

log = logging.getLogger("peerckpt.agent")


def _lower_priority(nice: int) -> None:
    """This thread yields to training: CPU priority ``nice``, idle I/O class where possible."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (psutil.Error, AttributeError, OSError):
        pass


class Flusher:
    """Writes this node's share of durable checkpoints, one flush at a time."""

    def __init__(self, store: SlotStore, node: int, report: Callable[[Flushed], None]) -> None:
        """``report`` sends to the coordinator."""
        self.store = store
        self.node = node
        self._report = report
        self._thread: threading.Thread | None = None
        # Chunks are written straight from the slots; once a slot was reused mid-flush (a
        # disk slower than the snapshots), each flush copies its share out first instead.
        self._copy_first = False

    def start(self, event: Flush) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._report(
                Flushed(
                    self.node,
                    event.step,
                    ok=False,
                    error=f"node {self.node} is still writing an earlier flush",
                )
            )
            return
        self._thread = threading.Thread(
            target=self._run, args=(event,), name="peerckpt-flush", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, event: Flush) -> None:
        # Writing straight from the slots takes little CPU (a crc32c per chunk, 18 ms per
        # 256 MiB, and the write calls), but at the lowest priority each of those waits for
        # a core the ranks keep busy, and the flush fell behind the slots' reuse (measured:
        # 0.7 s per 256 MiB while training, 0.24 s idle). Copying a share out first is
        # memory-bound work that training would notice: that runs at the lowest priority.
        # Storage other than a local disk is written from a copy (``write_part``), and the
        # slots are reused two snapshots later: that copy is made first, before this thread
        # yields to training — at nice 5 on cores the ranks keep busy it came too late for a
        # job stepping every 0.1 s (a flush to S3 failed with SlotReused in CI).
        step, start = event.step, time.monotonic()
        config = PersistConfig.from_msg(event.persist)
        assert config is not None
        pace = _Pace(config.rate)
        try:
            pieces = self._share(event)
            if self._copy_first or not is_local_url(config.url):
                pieces = copied(pieces)
            _lower_priority(19 if self._copy_first else 5)
            DurableStore(config.url, mode=config.mode).write_part(step, self.node, pieces, pace)
        except Exception as exc:  # reported: the coordinator decides, training goes on
            if isinstance(exc, (SlotReused, HeldBytesChanged)) and not self._copy_first:
                self._copy_first = True
                log.warning(
                    "node %d: a slot was rewritten while step %d was written from it (the flush "
                    "is slower than two snapshots); later flushes copy their share out first",
                    self.node,
                    step,
                )
            else:
                log.warning("flush of step %d on node %d failed: %s", step, self.node, exc)
            self._report(Flushed(self.node, step, ok=False, error=f"{type(exc).__name__}: {exc}"))
            return
        seconds = time.monotonic() - start
        log.info(
            "wrote %d bytes of step %d in %.2f s (%.0f MB/s)",
            pace.nbytes,
            step,
            seconds,
            pace.nbytes / max(seconds, 1e-9) / 1e6,
        )
        self._report(Flushed(self.node, step, ok=True, nbytes=pace.nbytes, seconds=seconds))

    def _share(self, event: Flush) -> list[Piece]:
        """This node's share of the step: each chunk in the slot that holds it."""
        step, gen = event.step, event.gen
        out: list[Piece] = []
        held: dict[int, _HeldSlot] = {}
        for rank, msg in event.chunks:
            want = ChunkRecord.from_msg(msg)
            if rank not in held:
                slot = self.store.find(gen, rank, step)
                manifest = slot.manifest if slot is not None else None
                if slot is None or manifest is None or manifest.step != step:
                    raise CheckpointError(
                        f"node {self.node} no longer holds rank {rank}'s step {step}: the slot "
                        "was reused for a newer snapshot before the flush reached it"
                    )
                held[rank] = _HeldSlot(slot, manifest, self.node)
            source = held[rank]
            record = source.by_place.get((want.key, want.scope, want.offsets, want.lengths))
            if record is None:
                raise CheckpointError(
                    f"rank {rank}'s snapshot of step {step} has no chunk {want.key!r} at "
                    f"{want.offsets}"
                )
            out.append((rank, record, source))
        return out


class SlotReused(CheckpointError):
    """A slot was rewritten while the flush was reading it."""


class _HeldSlot:
    """A slot holding the flushed step, held (its lock) only while a piece is read."""

    def __init__(self, slot: Slot, manifest: SnapshotManifest, node: int) -> None:
        self.slot, self.manifest, self.node = slot, manifest, node
        self.by_place = {(c.key, c.scope, c.offsets, c.lengths): c for c in manifest.chunks}

    @contextlib.contextmanager
    def hold(self) -> Iterator[memoryview]:
        with self.slot.lock:
            if self.slot.manifest is not self.manifest:
                raise SlotReused(
                    f"rank {self.slot.rank}'s slot on node {self.node} was reused for a newer "
                    f"snapshot while step {self.manifest.step} was being flushed"
                )
            yield self.slot.segment.view


class _Pace:
    """Counts the bytes written and, given a rate (bytes per second), sleeps to keep to it."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.nbytes, self.began = rate, 0, time.monotonic()

    def __call__(self, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.rate:
            ahead = self.nbytes / self.rate - (time.monotonic() - self.began)
            if ahead > 0:
                time.sleep(ahead)
