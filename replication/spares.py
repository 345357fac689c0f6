"""Slots made ready on a spare node before any failure, so that a recovery writes into
memory already touched.

A replacement's state arrives in one of its own slots on the spare node. Created at that
moment, the slot costs the recovery its allocation and a page fault per 4 KiB while the bytes
arrive (measured here: 0.25–0.8 s for 256 MiB under load, longer than the transfer itself).
So the spare node's agent keeps, per spare process it hosts, one segment as large as the
largest rank's snapshot (the coordinator's ``Commit`` carries that size), created and touched
in the background while training runs; ``Arena.create`` hands one out when a slot of at most
that size is asked for (``Arena.adopt_pooled``).

This module decides how many and how large; it never reads or writes a slot's bytes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from peerckpt.errors import InsufficientMemory
from peerckpt.replication.arena import Arena

log = logging.getLogger("peerckpt.agent")


def slot_capacity(nbytes: int) -> int:
    """What a rank asks for a snapshot of ``nbytes`` (``SnapshotEngine._ensure_slot``)."""
    return nbytes + (64 << 10) + nbytes // 64


class SpareSlots:
    """Keeps ``spares()`` touched segments of the largest snapshot's size in ``arena``."""

    def __init__(self, arena: Arena, spares: Callable[[], int]) -> None:
        self.arena = arena
        self._spares = spares
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def ready(self, largest_snapshot: int) -> None:
        """Make sure one segment of ``largest_snapshot`` bytes per spare is (being) made."""
        if largest_snapshot <= 0:
            return
        size = slot_capacity(largest_snapshot)
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            missing = self._spares() - self.arena.pooled_at_least(size)
            if missing <= 0:
                return
            self._thread = threading.Thread(
                target=self._make,
                args=(size, missing),
                name="peerckpt-spare-slots",
                daemon=True,
            )
            self._thread.start()

    def _make(self, size: int, count: int) -> None:
        os.nice(5)  # thread-level on Linux: below training, as the flush writer is
        for _ in range(count):
            if self._stop.is_set():
                return
            try:
                self.arena.pool(size)
            except InsufficientMemory as exc:
                log.warning("no slot made ready for a spare: %s", exc)
                return
        log.info("%d slot(s) of %d bytes ready for spares", count, size)

    def wait(self, timeout: float = 30.0) -> None:
        """Wait until the slots being made are made."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout)

    def stop(self) -> None:
        """Make no more (the agent exits)."""
        self._stop.set()
        self.wait()
