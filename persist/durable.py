"""Durable checkpoints: a committed step written to storage, found and read back, verified.

Layout under the root URL (any fsspec URL; a plain path means local files)::

    <root>/step-000000000100/data-n0.bin        the chunks node 0's agent wrote, in order
    <root>/step-000000000100/part-n0.msgpack    that writer's index: which chunk is where
    <root>/step-000000000100/manifest.msgpack   the whole step, merged from the parts
    <root>/step-000000000100/COMMITTED          the commit marker: the manifest's crc32c
    <root>/latest                               the number of the latest committed step

Each unique chunk of a step (a box of a shared tensor, or one rank's private state) is
written once, by one writer, even when several ranks hold it (data-parallel replicas). A
writer writes its data file first and its part last. The committer merges the parts into
the manifest only when every chunk of every rank is found in them with the checksum the
snapshot recorded, then writes the marker, then ``latest``. A reader trusts a step only if
its marker names the manifest it reads, so a checkpoint that was not completely written is
never visible as committed; every chunk is checked against its crc32c when read.

Retention (``keep``) deletes older committed steps only after a newer one is committed, and
steps that were never committed only once a later step is.

Formats are msgpack and raw bytes; nothing read from storage is unpickled. What is read back
is input from whoever can write to the root, checked as such: records by ``format.py``, local
files by ``localfs.py`` (regular files only, no link followed, sizes before allocating).
Local files are written with ``mode`` (0600), never through a link, each rename made durable
by an fsync of its directory. Reading a committed step: ``checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import crc32c
import fsspec
import fsspec.utils
from fsspec.implementations.local import LocalFileSystem

from peerckpt.codec import pack
from peerckpt.errors import CheckpointError, CorruptCheckpoint, MalformedManifest, NoCheckpoint
from peerckpt.manifest import FORMAT_VERSION, ChunkRecord, chunk_name
from peerckpt.persist import localfs
from peerckpt.persist.checkpoint import DurableCheckpoint
from peerckpt.persist.direct import DirectFile as _DirectFile
from peerckpt.persist.direct import HeldBytes
from peerckpt.persist.format import (
    MANIFEST_MAX,
    SMALL_MAX,
    DurableManifest,
    StoredChunk,
    data_file,
    decode_document,
    decode_part,
    part_file,
)
from peerckpt.persist.localfs import DEFAULT_MODE
from peerckpt.persist.location import check_scheme

__all__ = [  # what the rest of peerckpt imports from here (the records live in format.py)
    "DEFAULT_MODE",
    "DurableCheckpoint",
    "DurableManifest",
    "DurableStore",
    "HeldBytes",
    "HeldBytesChanged",
    "Piece",
    "StoredChunk",
    "assign_writers",
    "copied",
    "step_dir_name",
    "unique_key",
]
log = logging.getLogger("peerckpt.durable")

_STEP_DIR = re.compile(r"step-(\d{12})$")
MARKER = "COMMITTED"
MANIFEST = "manifest.msgpack"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def unique_key(rank: int, record: ChunkRecord) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """What makes a chunk the same chunk on several ranks: its name and its box."""
    return chunk_name(record.key, record.scope, rank), record.offsets, record.lengths


def assign_writers(
    layouts: dict[int, list[ChunkRecord]], holders: dict[int, Iterable[int]]
) -> dict[int, list[tuple[int, ChunkRecord]]]:
    """Which node writes which chunk: each unique chunk exactly once, bytes balanced.

    ``layouts``: rank → the chunks of its committed snapshot; ``holders``: rank → the nodes
    with a verified copy of it. A chunk may be written by any node holding a rank that has
    it; the biggest chunks are placed first, each on the candidate with the fewest bytes so
    far (then the lowest node). Returns node → [(rank whose copy it reads, chunk)].
    """
    # unique chunk → (its record, node → the first rank whose copy of it that node holds)
    candidates: dict[tuple[Any, ...], tuple[ChunkRecord, dict[int, int]]] = {}
    for rank in sorted(layouts):
        nodes = set(holders.get(rank, ()))
        for record in layouts[rank]:
            key = unique_key(rank, record)
            readers = candidates.setdefault(key, (record, {}))[1]
            for node in nodes:
                readers.setdefault(node, rank)
    load: dict[int, int] = {}
    plan: dict[int, list[tuple[int, ChunkRecord]]] = {}
    order = sorted(candidates.items(), key=lambda kv: (-kv[1][0].nbytes, kv[0]))
    for key, (record, readers) in order:
        if not readers:
            raise CheckpointError(
                f"chunk {key[0]!r} has no holder to write it from; its memory copies are gone"
            )
        node = min(readers, key=lambda n: (load.get(n, 0), n))
        load[node] = load.get(node, 0) + record.nbytes
        plan.setdefault(node, []).append((readers[node], record))
    return plan


def _sync(f: Any) -> None:
    """fsync a local file before it is closed; object stores are durable once written."""
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass


def is_local_url(url: str) -> bool:
    """Whether ``url`` names the local file system (``DurableStore(url).local``), from its
    protocol alone: no file system is made, nothing imported."""
    return fsspec.utils.get_protocol(url) in LocalFileSystem.protocol


class HeldBytesChanged(CorruptCheckpoint):
    """A chunk written straight from its buffer did not match its checksum afterwards."""


Piece = tuple[int, ChunkRecord, "bytes | memoryview | HeldBytes"]


def copied(pieces: Iterable[Piece]) -> list[Piece]:
    """The pieces with every held chunk copied out of its buffer (memory speed), for writes
    slower than the buffer's reuse: an object store, or a disk slower than the steps."""
    out: list[Piece] = []
    for rank, record, data in pieces:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            with data.hold() as view:
                data = bytes(view[record.byte_offset : record.byte_offset + record.nbytes])
        out.append((rank, record, data))
    return out


def _verify(rank: int, record: ChunkRecord, data: bytes | bytearray | memoryview) -> None:
    if len(data) != record.nbytes or crc32c.crc32c(data) != record.crc:
        raise CorruptCheckpoint(
            f"chunk {record.key!r} of rank {rank} fails its checksum in memory; it is not written"
        )


def _unpack(raw: bytes, what: str) -> Any:
    """A document read from the root, decoded with bounds (``format.decode_document``)."""
    return decode_document(raw, what)


class DurableStore:
    """A root URL holding durable checkpoints.

    ``mode``: the permission bits of the files written (local storage; 0600 by default,
    directories the matching 0700). What is read from the root is checked as input
    (``format.py`` for the records, ``localfs.py`` for local files).
    """

    def __init__(self, url: str, mode: int = DEFAULT_MODE, **storage_options: Any) -> None:
        self.url = url
        self.mode = localfs.check_mode(mode)
        check_scheme(url)  # StorageUnusable naming the URL and the fix, not fsspec's error
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = self.root.rstrip("/")
        self.local = is_local_url(url)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_path(self, step: int, name: str = "") -> str:
        return self._path(step_dir_name(step), name) if name else self._path(step_dir_name(step))

    def _put(self, path: str, data: bytes) -> None:
        """Write a small file so that readers see all of it or none of it."""
        tmp = f"{path}.tmp"
        if not self.local:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
            return
        with os.fdopen(localfs.open_for_write(tmp, self.mode), "wb") as f:
            f.write(data)
            _sync(f)
        localfs.replace(tmp, path)

    def _read(self, path: str, limit: int) -> bytes:
        """A whole metadata file (marker, manifest, part, ``latest``) of at most ``limit``
        bytes, refused (CorruptCheckpoint) before more is read: on local storage a regular
        file only, not sparse, inside a step directory that is not a link; on other storage
        at most ``limit`` + 1 bytes are fetched, whatever the object's size."""
        if not self.local:
            data: bytes = self.fs.cat_file(path, start=0, end=limit + 1)
            localfs.check_small(path, len(data), limit)
            return data
        directory, name = path.rsplit("/", 1)
        return localfs.read_whole(directory, name, limit, follow_dir=directory == self.root)

    def _make_step_dir(self, step: int) -> None:
        if not self.local:
            self.fs.makedirs(self.step_path(step), exist_ok=True)
            return
        localfs.make_dirs(self.root, self.mode, leaf_may_be_link=True)
        localfs.make_dirs(self.step_path(step), self.mode, leaf_may_be_link=False)

    # -- writing ----------------------------------------------------------------------------
    def write_part(
        self,
        step: int,
        node: int,
        pieces: Iterable[Piece],
        pace: Callable[[int], None] | None = None,
    ) -> list[StoredChunk]:
        """Write one writer's chunks: the data file, then its index.

        A chunk is given as bytes, or as ``HeldBytes``: local files are then written straight
        from the held buffer, other storage gets a copy taken first (writes to it are slower
        than the buffer's reuse). Every chunk is checked against its recorded checksum:
        bytes before they are written, a held chunk right after (HeldBytesChanged); the part
        index, which makes the chunks count, is written only when all of them passed.
        ``pace(nbytes)`` is called after each chunk (a throttle).
        """
        self._make_step_dir(step)
        # Rewriting a step (a job restarted from an older one) uncommits it first, so that no
        # reader ever pairs the old manifest with new data.
        for stale in (MARKER, MANIFEST):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.step_path(step, stale))
        name = data_file(node)
        path = self.step_path(step, name)
        direct = _DirectFile.open(path, self.mode) if self.local else None
        if direct is None:
            pieces = copied(pieces)
        stored: list[tuple[int, StoredChunk]] = []
        offset = 0
        with direct if direct is not None else self._open_data(path) as f:
            for rank, record, data in pieces:
                if isinstance(data, (bytes, bytearray, memoryview)):
                    _verify(rank, record, data)
                    if direct is not None:
                        at = direct.write(data)
                    else:
                        at = offset
                        f.write(data)
                        offset += record.nbytes
                else:
                    assert direct is not None  # held bytes were copied for other storage
                    start, end = record.byte_offset, record.byte_offset + record.nbytes
                    at = direct.write_held(data, start, record.nbytes)
                    # Checked after the write: the owner of the buffer may rewrite it without
                    # asking (a rank reuses its slot two commits later). Unchanged bytes now
                    # mean the bytes written were those (a rewrite never restores old bytes).
                    with data.hold() as view:
                        if crc32c.crc32c(view[start:end]) != record.crc:
                            raise HeldBytesChanged(
                                f"chunk {record.key!r} of rank {rank} no longer matches its "
                                "checksum in memory after it was written (rewritten meanwhile, "
                                "or damaged); this part is not committed"
                            )
                stored.append((rank, StoredChunk(name, replace(record, byte_offset=at))))
                if pace is not None:
                    pace(record.nbytes)
            _sync(f)  # the data is on disk before the part (and later the marker) says so
        part = {
            "format": FORMAT_VERSION,
            "node": node,
            "chunks": [[rank, c.to_msg()] for rank, c in stored],
        }
        self._put(self.step_path(step, part_file(node)), pack(part))
        return [c for _, c in stored]

    def _open_data(self, path: str) -> Any:
        """A data file opened for buffered writing (storage that refuses O_DIRECT, remote)."""
        if self.local:
            return os.fdopen(localfs.open_for_write(path, self.mode), "wb")
        return self.fs.open(path, "wb")

    def commit(
        self,
        step: int,
        epoch: int,
        layouts: dict[int, list[ChunkRecord]],
        keep: int | None = None,
    ) -> DurableManifest:
        """Merge the parts of ``step`` into its manifest and commit it.

        ``layouts`` are the committed snapshot's chunks per rank; where a record has a checksum,
        the stored chunk must have the same. Raises CheckpointError, naming what is missing, if
        some chunk is in no part.
        """
        where: dict[tuple[Any, ...], StoredChunk] = {}
        self.fs.invalidate_cache(self.step_path(step))  # object stores cache listings
        for path in self.fs.glob(self.step_path(step, "part-n*.msgpack")):
            for rank, c in decode_part(_unpack(self._read(path, MANIFEST_MAX), path), path):
                where[unique_key(rank, c.record)] = c
        ranks: dict[int, list[StoredChunk]] = {}
        missing = []
        for rank, records in sorted(layouts.items()):
            ranks[rank] = []
            for record in records:
                found = where.get(unique_key(rank, record))
                if found is None or (record.crc is not None and found.record.crc != record.crc):
                    missing.append(f"{chunk_name(record.key, record.scope, rank)}{record.offsets}")
                    continue
                ranks[rank].append(found)
        if missing:
            raise CheckpointError(
                f"step {step} cannot be committed: {len(missing)} chunk(s) were not written, "
                f"e.g. {missing[:3]}"
            )
        manifest = DurableManifest(step, epoch, len(layouts), ranks)
        raw = pack(manifest.to_msg())
        if len(raw) > MANIFEST_MAX:  # readers refuse it: never commit what cannot be read
            raise CheckpointError(
                f"step {step} cannot be committed: its manifest is {len(raw)} bytes, more than "
                f"the {MANIFEST_MAX} a reader accepts (too many chunks in one step)"
            )
        self._put(self.step_path(step, MANIFEST), raw)
        self._put(self.step_path(step, MARKER), pack({"step": step, "crc": crc32c.crc32c(raw)}))
        self._put(self._path(LATEST), str(step).encode())
        if keep is not None:
            self.retain(keep)
        return manifest

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed steps, and uncommitted steps older
        than the newest committed one. Returns the steps deleted."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        committed = self.committed_steps()
        if not committed:
            return []
        newest = committed[-1]
        doomed = list(committed[:-keep])
        doomed += [s for s in self.all_steps() if s not in committed and s < newest]
        for step in sorted(doomed):
            self.fs.rm(self.step_path(step), recursive=True)
        return sorted(doomed)

    # -- finding ----------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Every step with a directory, committed or not."""
        self.fs.invalidate_cache(self.root)
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            m = _STEP_DIR.search(name.rstrip("/"))
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _manifest_if_committed(self, step: int) -> bytes | None:
        try:
            marker = _unpack(self._read(self.step_path(step, MARKER), SMALL_MAX), "commit marker")
            raw = self._read(self.step_path(step, MANIFEST), MANIFEST_MAX)
        except FileNotFoundError:
            return None
        except CorruptCheckpoint as exc:  # a link or a FIFO where a file belongs
            log.warning("step %d in %s is not readable as committed: %s", step, self.url, exc)
            return None
        if not isinstance(marker, dict) or marker.get("crc") != crc32c.crc32c(raw):
            return None
        return raw

    def committed_steps(self) -> list[int]:
        return [s for s in self.all_steps() if self._manifest_if_committed(s) is not None]

    def _latest(self) -> tuple[int, bytes] | None:
        """The latest committed step and its manifest: what ``latest`` names, unless a newer
        step was committed after it (the pointer is written last, so it can lag)."""
        found = None
        with contextlib.suppress(FileNotFoundError, ValueError, CorruptCheckpoint):
            step = int(self._read(self._path(LATEST), SMALL_MAX).decode().strip())
            raw = self._manifest_if_committed(step)
            if raw is not None:
                found = (step, raw)
        floor = found[0] if found else -1
        for step in reversed(self.all_steps()):
            if step <= floor:
                break
            raw = self._manifest_if_committed(step)
            if raw is not None:
                return step, raw
        return found

    def latest_step(self) -> int | None:
        """The latest committed step, or None."""
        latest = self._latest()
        return latest[0] if latest else None

    def open(self, step: int | None = None) -> DurableCheckpoint:
        """The committed checkpoint of ``step`` (default: the latest)."""
        if step is None:
            latest = self._latest()
            if latest is None:
                raise NoCheckpoint(f"no committed checkpoint in {self.url}")
            step, raw = latest
        else:
            found = self._manifest_if_committed(step)
            if found is None:
                raise NoCheckpoint(
                    f"step {step} in {self.url} is not committed (no valid {MARKER} marker); "
                    f"committed steps: {self.committed_steps()}"
                )
            raw = found
        where = self.step_path(step, MANIFEST)
        manifest = DurableManifest.from_msg(_unpack(raw, where), where)
        if manifest.step != step:
            raise MalformedManifest(f"{where}: step is {manifest.step}, not {step}")
        return DurableCheckpoint(self, manifest)
