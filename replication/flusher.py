"""The agent's durable writer: one node's share of a committed step, to storage.

The coordinator sends ``flush`` with the chunks this node writes (each unique chunk of the
step is written by exactly one node). The writer runs in its own thread at low CPU and I/O
priority. It first copies its share out of the slots holding it (under each slot's lock,
checking the slot still holds that step): a slot is reused for a newer snapshot two commits
later, and storage is much slower than that. Then it writes the chunks, each verified
against its checksum, to this node's data file, writes its part index, and reports
``Flushed``. It never changes the slots. ``rate`` (bytes per second) throttles the writes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from peerckpt.errors import CheckpointError
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.manifest import ChunkRecord
from peerckpt.recovery.flush import PersistConfig
from peerckpt.replication.store import SlotStore

log = logging.getLogger("peerckpt.agent")


def _lower_priority() -> None:
    """This thread yields to training: lowest CPU priority, idle I/O class where possible."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError:
        pass
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (psutil.Error, AttributeError, OSError):
        pass


class Flusher:
    """Writes this node's share of durable checkpoints, one flush at a time."""

    def __init__(self, store: SlotStore, node: int, report: Callable[..., None]) -> None:
        """``report(method, **fields)`` sends to the coordinator (the agent adds its node)."""
        self.store = store
        self.node = node
        self._report = report
        self._thread: threading.Thread | None = None

    def start(self, event: dict[str, Any]) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._report(
                "Flushed",
                step=event["step"],
                ok=False,
                error=f"node {self.node} is still writing an earlier flush",
            )
            return
        self._thread = threading.Thread(
            target=self._run, args=(event,), name="peerckpt-flush", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, event: dict[str, Any]) -> None:
        _lower_priority()
        step, start = event["step"], time.monotonic()
        config = PersistConfig.from_msg(event["persist"])
        assert config is not None
        counted = [0]
        try:
            pieces = self._copy_out(event)
            DurableStore(config.url).write_part(
                step, self.node, self._throttled(pieces, config.rate, counted)
            )
        except Exception as exc:  # reported: the coordinator decides, training goes on
            log.warning("flush of step %d on node %d failed: %s", step, self.node, exc)
            self._report(
                "Flushed",
                step=step,
                ok=False,
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        seconds = time.monotonic() - start
        log.info(
            "wrote %d bytes of step %d in %.2f s (%.0f MB/s)",
            counted[0],
            step,
            seconds,
            counted[0] / max(seconds, 1e-9) / 1e6,
        )
        self._report("Flushed", step=step, ok=True, nbytes=counted[0], seconds=seconds)

    def _copy_out(self, event: dict[str, Any]) -> list[tuple[int, ChunkRecord, bytes]]:
        """This node's share of the step, copied out of the slots at memory speed.

        A slot is reused for a newer snapshot two commits after it was committed; storage
        (an object store above all) is far slower than that, so the bytes are taken first
        and written at leisure. The copy costs one share of memory while the flush runs.
        """
        step, gen = event["step"], event["gen"]
        out = []
        for rank, msg in event["chunks"]:
            want = ChunkRecord.from_msg(msg)
            slot = self.store.find(gen, rank, step)
            if slot is None:
                raise CheckpointError(
                    f"node {self.node} no longer holds rank {rank}'s step {step}: the slot was "
                    "reused for a newer snapshot before the flush reached it"
                )
            with slot.lock:
                manifest = slot.manifest
                if manifest is None or manifest.step != step:
                    raise CheckpointError(
                        f"rank {rank}'s slot on node {self.node} was reused for a newer "
                        f"snapshot while step {step} was being flushed"
                    )
                record = next(
                    (
                        c
                        for c in manifest.chunks
                        if (c.key, c.scope, c.offsets, c.lengths)
                        == (want.key, want.scope, want.offsets, want.lengths)
                    ),
                    None,
                )
                if record is None:
                    raise CheckpointError(
                        f"rank {rank}'s snapshot of step {step} has no chunk {want.key!r} at "
                        f"{want.offsets}"
                    )
                data = bytes(
                    slot.segment.view[record.byte_offset : record.byte_offset + record.nbytes]
                )
            out.append((rank, record, data))
        return out

    def _throttled(
        self, pieces: list[tuple[int, ChunkRecord, bytes]], rate: float | None, counted: list[int]
    ) -> Iterator[tuple[int, ChunkRecord, bytes]]:
        began = time.monotonic()
        while pieces:
            piece = pieces.pop(0)  # let each piece go once written
            counted[0] += len(piece[2])
            yield piece
            if rate:
                ahead = counted[0] / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
