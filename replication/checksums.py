"""crc32c of a snapshot's chunks, computed beside the transfer instead of before or after it.

Checksumming 1 GiB takes ~70 ms here; done before a push (sender) and after the last byte
(receiver) it adds ~26% to a replication (docs/performance.md). A ``RunningChecksums`` runs
the crc32c of each chunk on a thread of its own as soon as the chunk's bytes are there: on the
sender all of them at once, on the receiver as the data frames arrive (``advance``). crc32c
releases the GIL, so the checksums overlap the socket copies.

The owner of the bytes keeps them unchanged until ``wait`` returned (the slot's lock or the
snapshot protocol does that); this module reads the view and never writes it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import crc32c

from peerckpt.errors import PeerckptError
from peerckpt.manifest import ChunkRecord

_WAIT_S = 120.0


class RunningChecksums:
    """The crc32c of every chunk of ``view``, in the chunks' order, computed by a thread.

    ``ready`` bytes from the start of the view are there already; ``advance`` says more are.
    Chunks are checksummed in the order their last byte arrives, so frames sent front to back
    are verified while the next ones travel.
    """

    def __init__(
        self, chunks: Sequence[ChunkRecord], view: memoryview, ready: int = 0, name: str = ""
    ) -> None:
        self._view = view
        self._bounds = [(c.byte_offset, c.byte_offset + c.nbytes) for c in chunks]
        self._crcs: list[int | None] = [None] * len(self._bounds)
        # Chunks in the order they complete; the thread walks this list front to back.
        self._order = sorted(range(len(self._bounds)), key=lambda i: self._bounds[i][1])
        self._ready = ready
        self._cancelled = False
        self._done = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"peerckpt-crc{'-' + name if name else ''}", daemon=True
        )
        self._thread.start()

    def advance(self, ready: int) -> None:
        """The first ``ready`` bytes of the view are complete."""
        with self._cond:
            if ready > self._ready:
                self._ready = ready
                self._cond.notify()

    def cancel(self) -> None:
        """Stop early (the transfer failed); ``wait`` then raises."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        self._thread.join(timeout=_WAIT_S)

    def wait(self, timeout: float = _WAIT_S) -> list[int]:
        """Every chunk's crc32c, in the chunks' order, once all are computed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done or self._cancelled, timeout):
                raise PeerckptError(f"checksumming a snapshot took over {timeout:.0f} s")
            if not self._done:
                raise PeerckptError("checksumming was cancelled: the transfer failed")
        return [c for c in self._crcs if c is not None]

    def _run(self) -> None:
        for i in self._order:
            start, end = self._bounds[i]
            with self._cond:
                while self._ready < end and not self._cancelled:
                    if not self._cond.wait(timeout=_WAIT_S):
                        self._cancelled = True  # no byte for that long: the owner is gone
                        self._cond.notify_all()
                if self._cancelled:
                    return
            self._crcs[i] = crc32c.crc32c(self._view[start:end])
        with self._cond:
            self._done = True
            self._cond.notify_all()
