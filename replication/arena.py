"""The shared-memory arena: named segments in /dev/shm that hold snapshot slots and replicas.

An agent owns its node's arena. Every segment is a file named as ``peerckpt/shm.py`` says,
created, touched once (so the first snapshot copy does not pay page faults) and, on exit,
unlinked by the agent — also on error. The launcher removes whatever a killed agent could not
(``shm.sweep``). Ranks map their own slots; they never create or unlink.

/dev/shm is shared with every user of the host: a file already at a segment's name (planted,
or left by anything else) is never opened; the segment takes another name, and the agent
tells the ranks the name it got.

Nothing here imports torch: the agent stays a small process.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import shutil
import threading

import psutil

from peerckpt.errors import InsufficientMemory
from peerckpt.names import new_run_id
from peerckpt.shm import POPULATE, SHM_DIR, segment_prefix, sweep
from peerckpt.units import human

_TOUCH_BLOCK = 1 << 20
_NAME_TRIES = 8  # names tried for one segment before giving up (each taken by a stranger)
log = logging.getLogger("peerckpt.arena")


def check_memory(nbytes: int, what: str) -> None:
    """Raise InsufficientMemory unless ``nbytes`` fit in /dev/shm and in available RAM."""
    shm_free = shutil.disk_usage(SHM_DIR).free
    ram_free = psutil.virtual_memory().available
    limit = min(shm_free, ram_free)
    if nbytes > limit:
        raise InsufficientMemory(
            f"{what} needs {human(nbytes)} of shared memory, but only {human(shm_free)} is free "
            f"in {SHM_DIR} and {human(ram_free)} of RAM is available (short by "
            f"{human(nbytes - limit)}). Free host memory, lower --replicas, snapshot less state, "
            f"or enlarge {SHM_DIR} (mount -o remount,size=… {SHM_DIR})."
        )


class Segment:
    """One mapped shared-memory file. ``view`` is a writable memoryview of all of it."""

    def __init__(self, path: str, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.size = size
        self._mm = mm
        self.view = memoryview(mm)
        # Some pages are not reserved (a partial copy's absent chunks: replication/dedup.py);
        # whatever is written there later is reserved first (``reserve``).
        self.sparse = False

    def reserve(self, ranges: list[tuple[int, int]], what: str) -> None:
        """Reserve the pages of the byte ``ranges`` (start, end) before they are written: on
        a full tmpfs this raises InsufficientMemory where the write would die of SIGBUS."""
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _fallocate(fd, ranges)
        except OSError as exc:
            raise InsufficientMemory(
                f"{what}: {SHM_DIR} could not hold the rest of {self.name} ({exc.strerror}); "
                f"free memory there or enlarge it (mount -o remount,size=… {SHM_DIR})"
            ) from None
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap (the file stays until ``unlink``)."""
        self.view.release()
        with contextlib.suppress(BufferError):
            self._mm.close()

    def unlink(self) -> None:
        """Remove the file; mappings elsewhere stay valid until unmapped."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Arena:
    """The segments one agent created. Thread-safe; ``destroy`` removes all of them.

    ``run``: the run id of the job's run (``PEERCKPT_RUN``; a fresh one when not given, for
    an arena of its own)."""

    def __init__(self, job: str, node: int, run: str | None = None) -> None:
        self.job = job
        self.node = node
        self.run = run or new_run_id()
        segment_prefix(job, self.run, node)  # a bad job name or run id fails here, not later
        self._segments: dict[str, Segment] = {}
        self._pooled: list[Segment] = []  # touched, unused: for a spare's first slot
        self._lock = threading.Lock()
        self._counter = 0

    @property
    def prefix(self) -> str:
        return segment_prefix(self.job, self.run, self.node)

    def create(
        self,
        tag: str,
        size: int,
        what: str,
        touch: bool = True,
        kept: bool = True,
        only: list[tuple[int, int]] | None = None,
    ) -> Segment:
        """Create, map and touch a new segment of ``size`` bytes named after ``tag`` — or hand
        out a segment kept ready for a spare that fits (``kept``; ``pool``).

        ``touch=False`` leaves the page faults to the first writes (the pages are reserved
        all the same), for a segment filled at once by several threads. ``only``: reserve
        just these byte ranges (start, end), untouched; the rest of the file stays a hole
        that costs no memory (a partial copy, ``replication/dedup.py``).
        """
        size = max(size, 1)
        ready = self._take_pooled(size) if touch and kept and only is None else None
        if ready is not None:
            log.debug("%s takes the kept segment %s", what, ready.name)
            return ready
        if only is not None:
            touch = False
        check_memory(size if only is None else sum(e - s for s, e in only), what)
        with self._lock:
            self._counter += 1
            name = f"{self.prefix}{tag}-{self._counter}"
        path, fd = self._create_file(name)
        name = os.path.basename(path)
        try:
            # Reserve the pages now: on a full tmpfs this fails with ENOSPC, where touching
            # a sparse mapping would kill the process with SIGBUS.
            try:
                if only is None:
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
                    _fallocate(fd, only)
            except OSError as exc:
                raise InsufficientMemory(
                    f"{what}: {SHM_DIR} could not hold {human(size)} more ({exc.strerror}); "
                    f"free memory there or enlarge it (mount -o remount,size=… {SHM_DIR})"
                ) from None
            # MAPPOPULATE maps every page now, without the zero-filled buffer a touch
            # from Python needs (64 MiB of transient private memory in each agent).
            flags = mmap.MAP_SHARED | (POPULATE if touch else 0)
            mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        segment = Segment(path, size, mm)
        segment.sparse = only is not None
        with self._lock:
            self._segments[name] = segment
        try:
            if touch and not POPULATE:
                _touch(segment.view)
        except BaseException:
            self.release(segment)
            raise
        log.debug("created %s (%s) for %s", name, human(size), what)
        return segment

    def _create_file(self, name: str) -> tuple[str, int]:
        """Create a new file for a segment: at ``name``, or, if something is already there,
        at ``name`` with a random suffix (O_EXCL: an existing file or link is never opened)."""
        path = os.path.join(SHM_DIR, name)
        for _ in range(_NAME_TRIES):
            try:
                return path, os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                try:
                    owner = f"uid {os.lstat(path).st_uid}"
                except OSError:
                    owner = "someone"
                log.warning(
                    "%s already exists (owned by %s), not made by this agent; it is left alone "
                    "and the segment takes another name",
                    path,
                    owner,
                )
                path = os.path.join(SHM_DIR, f"{name}-{secrets.token_hex(4)}")
        raise InsufficientMemory(
            f"no free name for a segment in {SHM_DIR}: {_NAME_TRIES} names starting with {name} "
            f"were taken; remove the files there that no job of yours owns"
        )

    def pool(self, size: int) -> Segment:
        """Create and touch a segment of ``size`` bytes kept for a later ``create``
        (``replication/spares.py``)."""
        segment = self.create("pool", size, "a slot kept ready for a spare", kept=False)
        with self._lock:
            self._pooled.append(segment)
        return segment

    def pooled_at_least(self, size: int) -> int:
        """How many kept segments hold ``size`` bytes or more."""
        with self._lock:
            return sum(1 for s in self._pooled if s.size >= size)

    def _take_pooled(self, size: int) -> Segment | None:
        # At most twice as large: a small rank's slot does not take a large one's memory.
        with self._lock:
            fits = [s for s in self._pooled if size <= s.size <= 2 * size]
            if not fits:
                return None
            segment = min(fits, key=lambda s: s.size)
            self._pooled.remove(segment)
            return segment

    def release(self, segment: Segment) -> None:
        """Unmap and unlink one segment."""
        with self._lock:
            self._segments.pop(segment.name, None)
            if segment in self._pooled:
                self._pooled.remove(segment)
        segment.close()
        segment.unlink()

    def destroy(self) -> None:
        """Unmap and unlink every segment of this arena, and any stray file with its prefix
        (a file it cannot remove is left, and named in one warning line)."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._pooled.clear()
        for segment in segments:
            segment.close()
        sweep(self.job, self.run, self.node)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._segments.values())


def _fallocate(fd: int, ranges: list[tuple[int, int]]) -> None:
    """Reserve the pages of the byte ``ranges`` (start, end) of file ``fd``; the rest stays
    a hole. Raises OSError (ENOSPC on a full tmpfs)."""
    for start, end in ranges:
        if end > start:
            os.posix_fallocate(fd, start, end - start)


def _touch(view: memoryview) -> None:
    zeros = bytes(min(_TOUCH_BLOCK, len(view)))
    for start in range(0, len(view), _TOUCH_BLOCK):
        end = min(start + _TOUCH_BLOCK, len(view))
        view[start:end] = zeros[: end - start]
