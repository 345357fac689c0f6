"""Local data files written with O_DIRECT, straight from the buffers that hold the chunks.

``durable.py``'s writer uses :class:`DirectFile` for local storage; a chunk comes as bytes or
as :class:`HeldBytes` (a snapshot slot, written from where it lies). Files are opened through
``localfs.open_for_write``: never through a link, with the durable mode.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from typing import Protocol

from peerckpt.persist.localfs import DEFAULT_MODE, open_for_write


class HeldBytes(Protocol):
    """Chunks lying in a buffer that stays unchanged only while held: an agent's snapshot
    slot, which the rank may rewrite once a newer step committed. ``hold`` yields the whole
    buffer (each record's ``byte_offset`` is its place in it), or raises CheckpointError when
    the buffer no longer holds what it held when the flush began."""

    def hold(self) -> contextlib.AbstractContextManager[memoryview]: ...


class DirectFile:
    """A local data file written with O_DIRECT: the bytes go from memory to the disk by DMA,
    without a copy into the page cache and with little CPU (the flush thread runs at the
    lowest priority while the ranks train on every core).

    Large held chunks are written straight from their buffer (a page-aligned shared-memory
    slot): the file position is padded to a block boundary and the write starts at the block
    holding the chunk's first byte, so memory and file share the alignment O_DIRECT needs; a
    few KiB before the chunk and a zero tail pad travel with it. Everything else is gathered
    in an aligned staging buffer and written in whole blocks. The last partial block is
    written after turning O_DIRECT off. Measured here (256 MiB, one writer): straight from the
    slot 2.8 GB/s, copying the chunk out first 0.8 GB/s (faulting in fresh memory), the
    disk's own O_DIRECT bandwidth 3.4-3.7 GB/s.
    """

    ALIGN = 4096  # a multiple of every logical block size
    BLOCK = 8 << 20  # staging buffer: bytes per gathered write
    PIECE = 16 << 20  # bytes per write straight from a held buffer
    DIRECT_MIN = 1 << 20  # smaller held chunks are staged, not worth a padded write

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = mmap.mmap(-1, self.BLOCK)  # page-aligned, as O_DIRECT needs
        self.view = memoryview(self.buf)
        self.used = 0  # staged bytes
        self.written = 0  # bytes in the file

    @classmethod
    def open(cls, path: str, mode: int = DEFAULT_MODE) -> DirectFile | None:
        """None where the file system refuses O_DIRECT (tmpfs, some overlays). A link or
        anything but a regular file at ``path`` is a CheckpointError (``open_for_write``)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = open_for_write(path, mode, flag)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise
        return cls(fd)

    def tell(self) -> int:
        return self.written + self.used

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; return the file offset it starts at."""
        at = self.tell()
        src = memoryview(data).cast("B")
        while len(src):
            n = min(len(src), self.BLOCK - self.used)
            self.view[self.used : self.used + n] = src[:n]
            self.used += n
            src = src[n:]
            if self.used == self.BLOCK:
                self._drain(self.BLOCK)
        return at

    def write_held(self, held: HeldBytes, start: int, n: int) -> int:
        """Append bytes ``start:start+n`` of ``held``'s buffer; return the file offset they
        start at. Each write holds the buffer only for its own piece."""
        if n < self.DIRECT_MIN:
            with held.hold() as view:
                return self.write(view[start : start + n])
        self._pad()
        first = start - start % self.ALIGN
        at = self.written + (start - first)
        end = start + n
        whole = first + (end - first) // self.ALIGN * self.ALIGN
        for off in range(first, whole, self.PIECE):
            with held.hold() as view:
                self._write_all(view[off : min(off + self.PIECE, whole)])
        with held.hold() as view:
            self.write(view[whole:end])  # the partial last block
        return at

    def _pad(self) -> None:
        """Zero-fill the staged bytes to a block boundary and write them."""
        if self.used % self.ALIGN:
            pad = self.ALIGN - self.used % self.ALIGN
            self.view[self.used : self.used + pad] = bytes(pad)
            self.used += pad
        if self.used:
            self._drain(self.used)

    def _write_all(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.write(self.fd, data[done:])
        self.written += len(data)

    def _drain(self, n: int) -> None:
        """Write the staging buffer's first ``n`` bytes; what follows moves to its start."""
        self._write_all(self.view[:n])
        tail = bytes(self.view[n : self.used])
        self.view[: len(tail)] = tail
        self.used = len(tail)

    def flush(self) -> None:
        whole = self.used - self.used % self.ALIGN
        if whole:
            self._drain(whole)
        if self.used:  # the tail is not a whole block: write it without O_DIRECT
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self._drain(self.used)

    def fileno(self) -> int:
        return self.fd

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.view.release()
        self.buf.close()
        os.close(self.fd)
