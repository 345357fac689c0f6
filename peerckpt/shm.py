"""Shared-memory names and mappings: where a job's segments live and how a process maps one.

Every segment is a file ``/dev/shm/peerckpt-<job>-<run>-n<node>-…``: the job's name, the
run's random id (``peerckpt/names.py``: two runs of one job name never share a file), the
node (two simulated nodes on one machine never share one either). The node's agent creates,
touches and unlinks them (``replication/arena.py``); a rank maps its own slots with
:func:`map_segment`; a launcher removes whatever a killed agent could not (:func:`sweep`).

/dev/shm is shared by every user of the host. So names are matched as plain prefixes, never
as patterns; a sweep removes only files this user owns, and goes on past any it cannot
remove (one warning line says which).

Nothing here imports torch.
"""

from __future__ import annotations

import logging
import mmap
import os

from peerckpt.names import check_job_name, check_run_id

SHM_DIR = "/dev/shm"
POPULATE = getattr(mmap, "MAP_POPULATE", 0)
log = logging.getLogger("peerckpt.shm")


def segment_prefix(job: str, run: str | None = None, node: int | None = None) -> str:
    """File-name prefix of a job's segments: of every run (no ``run``, for leak checks), of
    one run, or of one node of one run. ConfigurationError for a bad job name or run id."""
    base = f"peerckpt-{check_job_name(job)}-"
    if run is None:
        if node is not None:
            raise ValueError("a node's segment prefix needs the run id")
        return base
    base += f"{check_run_id(run)}-"
    return base if node is None else f"{base}n{node}-"


def map_segment(path: str) -> mmap.mmap:
    """Map an existing segment read-write, pre-faulting its pages (used by ranks)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        flags = mmap.MAP_SHARED | POPULATE
        return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def sweep(job: str, run: str, node: int | None = None) -> list[str]:
    """Remove every segment file of run ``run`` of ``job`` (of one node if given) that this
    user owns; return the paths removed. Files it cannot remove (another user's, or refused)
    stay, and one warning line names them: clean-up never stops half-way."""
    prefix = segment_prefix(job, run, node)
    uid = os.geteuid()
    removed, left = [], []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(prefix):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            owner = os.lstat(path).st_uid
            if owner != uid:
                left.append(f"{name} (owned by uid {owner})")
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue  # removed meanwhile (its agent was still exiting)
        except OSError as exc:
            left.append(f"{name} ({exc.strerror})")
            continue
        removed.append(path)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        log.warning(
            "could not remove %d shared-memory file(s) of job %s in %s: %s%s; remove them as "
            "their owner (or root) once no process maps them",
            len(left),
            job,
            SHM_DIR,
            ", ".join(left[:3]),
            more,
        )
    return removed
