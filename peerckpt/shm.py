"""Shared-memory names and mappings: where a job's segments live and how a process maps one.

Every segment is a file ``/dev/shm/peerckpt-<job>-n<node>-…``. The node's agent creates,
touches and unlinks them (``replication/arena.py``); a rank maps its own slots with
:func:`map_segment`; a launcher removes whatever a killed agent could not (:func:`sweep`).
The node is part of every name, so that two simulated nodes on one machine never share a file.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os

SHM_DIR = "/dev/shm"
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def segment_prefix(job: str, node: int | None = None) -> str:
    """File-name prefix of a job's segments (of one node when ``node`` is given)."""
    base = f"peerckpt-{job}-"
    return base if node is None else f"{base}n{node}-"


def map_segment(path: str) -> mmap.mmap:
    """Map an existing segment read-write, pre-faulting its pages (used by ranks)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        flags = mmap.MAP_SHARED | POPULATE
        return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def sweep(job: str, node: int | None = None) -> list[str]:
    """Remove every segment file of ``job`` (of one node if given); return what was removed."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, segment_prefix(job, node) + "*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
