"""One committed durable step, read chunk by chunk and verified: ``DurableCheckpoint``.

``DurableStore.open`` (``durable.py``) finds the step and decodes its manifest; this reads
its chunks — each verified against its crc32c, and, before any buffer is allocated for it,
checked to lie inside its data file (a manifest that passes its checksum cannot make a
reader allocate more than the step holds). Local files are read through ``localfs.py``
(regular files only, no link followed), remote ones through fsspec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import crc32c

from peerckpt.errors import CorruptCheckpoint
from peerckpt.manifest import META_KEY, ChunkRecord, align
from peerckpt.persist import localfs
from peerckpt.persist.format import DurableManifest, StoredChunk

if TYPE_CHECKING:
    from peerckpt.persist.durable import DurableStore


class DurableCheckpoint:
    """One committed step, read chunk by chunk and verified."""

    def __init__(self, store: DurableStore, manifest: DurableManifest) -> None:
        self.store = store
        self.manifest = manifest
        self.step = manifest.step
        self._sizes: dict[str, int] = {}  # data file → its size (checked once per file)

    def _size(self, file: str) -> int:
        size = self._sizes.get(file)
        if size is None:
            directory = self.store.step_path(self.step)
            try:
                if self.store.local:
                    size = localfs.file_size(directory, file)
                else:
                    size = int(self.store.fs.size(f"{directory}/{file}"))
            except FileNotFoundError:
                raise CorruptCheckpoint(
                    f"step {self.step} keeps chunks in {directory}/{file}, which is missing"
                ) from None
            self._sizes[file] = size
        return size

    def check_extents(self, chunks: Iterable[StoredChunk]) -> None:
        """CorruptCheckpoint unless every chunk's bytes lie inside its file: called before
        a buffer for them is allocated, so that a manifest cannot ask for more memory than
        the checkpoint holds."""
        for c in chunks:
            localfs.check_extent(
                self.store.step_path(self.step, c.file),
                self._size(c.file),
                c.record.byte_offset,
                c.record.nbytes,
                f"{c.record.key!r} of step {self.step}",
            )

    def read(self, chunk: StoredChunk) -> bytes:
        """The chunk's bytes, verified against its checksum."""
        path = self.store.step_path(self.step, chunk.file)
        start, what = chunk.record.byte_offset, f"{chunk.record.key!r} of step {self.step}"
        try:
            if self.store.local:
                data = localfs.read_range(
                    self.store.step_path(self.step), chunk.file, start, chunk.record.nbytes, what
                )
            else:
                self.check_extents([chunk])
                data = self.store.fs.cat_file(path, start=start, end=start + chunk.record.nbytes)
        except FileNotFoundError:
            raise CorruptCheckpoint(
                f"{chunk.record.key!r} of step {self.step} is in {path}, which is missing"
            ) from None
        if len(data) != chunk.record.nbytes or crc32c.crc32c(data) != chunk.record.crc:
            raise CorruptCheckpoint(
                f"{chunk.record.key!r} of step {self.step} fails verification in {path} "
                f"(bytes {start}–{start + chunk.record.nbytes}); the checkpoint is damaged"
            )
        return data

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Read every stored chunk once; return a line per one that fails. ``progress`` is
        told (chunks done, chunks in all) after each."""
        problems = []
        chunks = list(self.manifest.unique_chunks().values())
        for done, chunk in enumerate(chunks, 1):
            try:
                self.read(chunk)
            except CorruptCheckpoint as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(done, len(chunks))
        return problems

    def chunks(self, rank: int) -> Iterator[StoredChunk]:
        yield from self.manifest.ranks.get(rank, [])

    def slot_image(self, rank: int) -> tuple[bytearray, list[ChunkRecord]]:
        """Rank ``rank``'s snapshot as it was in its slot: every chunk verified and packed
        (aligned) into one buffer, with records giving each chunk's place in it."""
        self.check_extents(self.chunks(rank))
        records, offset = [], 0
        for chunk in self.chunks(rank):
            records.append(replace(chunk.record, byte_offset=offset))
            offset = align(offset + chunk.record.nbytes)
        image = bytearray(offset)
        for chunk, record in zip(self.chunks(rank), records, strict=True):
            image[record.byte_offset : record.byte_offset + record.nbytes] = self.read(chunk)
        return image, records

    def meta(self, rank: int) -> bytes:
        """Rank ``rank``'s msgpack blob (step, RNG states, loader positions)."""
        for chunk in self.chunks(rank):
            if chunk.record.key == META_KEY:
                return self.read(chunk)
        raise CorruptCheckpoint(f"step {self.step} has no state blob for rank {rank}")
