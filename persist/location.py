"""Whether a durable storage URL can work, asked before a job depends on it.

A persist URL that cannot work used to pass silently: an unknown scheme (``bogus://``) or one
whose fsspec backend is not installed (``gs://`` without gcsfs) raised inside the
coordinator when the first epoch looked for a checkpoint to restore, and the job hung until
killed; a location nobody can write (``/proc/x``, a read-only mount) failed every flush while
the job reported success. So the launcher calls ``check_writable`` before it starts any
process, and the coordinator when a script's ``@resilient(persist=…)`` announces the URL:
both fail the job at once with ``StorageUnusable``, naming the URL and the fix.

- ``check_scheme``: the scheme is one fsspec knows and its backend package imports. No
  storage is touched; ``DurableStore`` calls it, so every reader (``inspect``, ``export``, a
  cold start) names a bad scheme the same way.
- ``check_writable``: the scheme, then the root made as a flush makes it and a probe file
  written there and removed. It never removes anything but its own probe.
- ``check_shared``: not a store that lives inside one process (``memory://``): the probe
  passes there, then every flush failed ("6 chunk(s) were not written"), since each agent
  wrote into its own process's memory. ``PersistConfig`` calls it, so ``--persist`` and
  ``resilient(persist=…)`` refuse it before anything starts; readers (``inspect``, tests)
  may still open one.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import fsspec
import fsspec.utils
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import known_implementations, registry

from peerckpt.errors import StorageUnusable
from peerckpt.persist import localfs
from peerckpt.persist.localfs import DEFAULT_MODE

_PROBE = ".peerckpt-write-check-"  # the probe's name, then a random suffix
_EXAMPLES = "a local path, file://…, s3://… (pip install s3fs) or another fsspec protocol"


def check_scheme(url: str) -> None:
    """StorageUnusable if ``url``'s scheme (each one of a chained ``a::b://`` URL) is not
    known to fsspec, or the package that serves it is not installed."""
    for part in url.split("::"):
        protocol = fsspec.utils.get_protocol(part)
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise StorageUnusable(
                f"storage URL {url!r} has an unknown scheme {protocol!r}: use {_EXAMPLES}"
            ) from None
        except ImportError as exc:
            raise StorageUnusable(
                f"storage URL {url!r} needs the fsspec backend of {protocol}://, which is not "
                f"installed: {_install_hint(protocol)} ({exc})"
            ) from None


def check_shared(url: str) -> None:
    """StorageUnusable if ``url`` (any link of a chained URL) is fsspec's in-memory
    filesystem, or one built on it: it lives inside one process, so the agents that write a
    checkpoint's shares, and a later run that would restore it, never see each other's."""
    for part in url.split("::"):
        protocol = fsspec.utils.get_protocol(part)
        loaded = registry.get(protocol)  # a class registered or imported already; none imported
        if protocol in MemoryFileSystem.protocol or (
            isinstance(loaded, type) and issubclass(loaded, MemoryFileSystem)
        ):
            raise StorageUnusable(
                f"storage URL {url!r} is fsspec's in-memory filesystem ({protocol}://), which "
                "lives inside one process: every node's agent would write its share of a "
                "checkpoint into its own memory, so no checkpoint would be complete and no "
                "later run could read one; give --persist (or persist=) a path or file://… on "
                "storage every node can reach, or a shared store such as s3://…"
            )


def _install_hint(protocol: str) -> str:
    """``pip install PACKAGE`` for the backend fsspec names for ``protocol``."""
    known = known_implementations.get(protocol)
    if known is None:
        return f"install the package that registers {protocol}:// with fsspec"
    return f"pip install {known['class'].split('.')[0]}"


def check_writable(url: str, mode: int = DEFAULT_MODE, **storage_options: Any) -> None:
    """StorageUnusable, naming ``url``, the cause and the fix, unless its scheme works, its
    root can be made (with ``mode``'s directory bits, as a flush makes it) and a file can be
    written there, by every node's agent (``check_shared``). Leaves the root made, and
    nothing else."""
    check_scheme(url)
    check_shared(url)
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except Exception as exc:  # a backend rejects its options or the URL in its own way
        raise StorageUnusable(f"storage URL {url!r} cannot be opened: {_cause(exc)}") from None
    root = root.rstrip("/") or "/"
    probe = f"{root.rstrip('/')}/{_PROBE}{secrets.token_hex(4)}"
    try:
        if fsspec.utils.get_protocol(url) in LocalFileSystem.protocol:
            _probe_local(root, probe, mode)
        else:
            fs.makedirs(root, exist_ok=True)
            fs.pipe_file(probe, b"peerckpt")
            fs.rm_file(probe)
    # OSError, CheckpointError (a root that is a file), and whatever an object store raises
    # for a refused credential or a missing bucket: each means no flush would succeed.
    except Exception as exc:
        raise StorageUnusable(_unwritable(url, exc)) from None


def _probe_local(root: str, probe: str, mode: int) -> None:
    localfs.make_dirs(root, mode, leaf_may_be_link=True)
    fd = localfs.open_for_write(probe, mode)
    try:
        os.write(fd, b"peerckpt")
    finally:
        os.close(fd)
        os.unlink(probe)


def _cause(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _unwritable(url: str, exc: BaseException) -> str:
    return (
        f"storage URL {url!r} is not writable: {_cause(exc)}; give --persist (or persist=) a "
        "location where this user can create directories and files: every node's agent "
        "writes its share of each checkpoint there"
    )
