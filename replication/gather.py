"""Assembling a rank's state in a new layout from pieces of the old layout's snapshots.

After a topology change every new rank wants certain boxes of certain tensors; the
coordinator's plan (``recovery/planning/reshard.py``) says, per rank, which *region* of which held
chunk of which old rank to read from which node. ``assemble`` carries that out for one rank:
it lays the wanted chunks out in a *staging* slot, copies the regions held on this node with
one strided copy each, and pulls the others from their nodes with ``fetch_boxes``, in
parallel per source node. Source chunks are verified against their checksums before pieces
are cut out of them, and every piece travels with its own crc32c.

Regions are numpy strided views (``peerckpt/boxes.py``), so pieces move at memory speed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import crc32c

from peerckpt.boxes import Box, contiguous_range, copy_box, extract_box, place_box
from peerckpt.dtypes import itemsize
from peerckpt.errors import (
    ChecksumMismatch,
    CorruptCheckpoint,
    PeerUnavailable,
    ProtocolError,
    RecoveryFailed,
    no_answer,
)
from peerckpt.manifest import ChunkRecord, SnapshotManifest, align, chunk_name
from peerckpt.messages import decode
from peerckpt.messages.data import Box as BoxFrame
from peerckpt.messages.data import End, FetchBoxes
from peerckpt.persist.durable import DurableStore
from peerckpt.reads import STORAGE, Read
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.states import SlotKind
from peerckpt.wire import Connection, raise_if_error

log = logging.getLogger("peerckpt.reshard")


def _box(msg: list[list[int]]) -> Box:
    return Box(tuple(msg[0]), tuple(msg[1]))


def box_msg(box: Box) -> list[list[int]]:
    return [list(box.offsets), list(box.lengths)]


def _record_box(record: ChunkRecord) -> Box:
    return Box(tuple(record.offsets), tuple(record.lengths))


class _Held:
    """The chunks of one old rank's snapshot on this node, by (name, box); checked once."""

    def __init__(self, slot: Slot, rank: int) -> None:
        assert slot.manifest is not None
        self.slot = slot
        self.manifest = slot.manifest
        # A partial copy (replication/dedup.py) serves the chunks it holds; the planner reads
        # the others from a data-parallel twin (recovery/twins.py).
        self.chunks = {
            (chunk_name(c.key, c.scope, rank), _record_box(c)): c for c in slot.manifest.present()
        }
        self._verified: set[str] = set()

    def chunk(self, name: str, box: Box) -> tuple[memoryview, ChunkRecord]:
        record = self.chunks.get((name, box))
        if record is None:
            lacks = " (a partial copy: its twins hold that chunk)" if self.manifest.absent else ""
            raise ProtocolError(f"the snapshot has no chunk {name!r} at {box}{lacks}")
        view = self.slot.segment.view[record.byte_offset : record.byte_offset + record.nbytes]
        if record.key not in self._verified:
            if crc32c.crc32c(view) != record.crc:
                raise ChecksumMismatch(
                    f"chunk {name!r} of rank {self.manifest.rank} step {self.manifest.step} "
                    "fails its checksum here; it is not read from"
                )
            self._verified.add(record.key)
        return view, record


def _held(store: SlotStore, gen: int, rank: int, step: int) -> _Held:
    slot = store.find(gen, rank, step, partial=True)
    if slot is None or slot.manifest is None:
        raise PeerUnavailable(f"this node holds no copy of rank {rank} step {step} (layout {gen})")
    return _Held(slot, rank)


def serve_boxes(conn: Connection, store: SlotStore, request: FetchBoxes) -> None:
    """Answer a ``fetch_boxes`` request: each item's region, packed, with its crc32c."""
    gen, step = request.gen, request.step
    held: dict[int, _Held] = {}
    for i, (rank, name, box, region) in enumerate(request.items):
        if rank not in held:
            try:
                held[rank] = _held(store, gen, rank, step)
            except PeerUnavailable as exc:
                conn.send_error("missing", str(exc))
                return
        source = held[rank]
        with source.slot.lock:
            if source.slot.manifest is not source.manifest:
                conn.send_error("missing", f"the copy of rank {rank} step {step} was replaced")
                return
            try:
                view, record = source.chunk(name, _box(box))
            except ChecksumMismatch as exc:
                conn.send_error("checksum", str(exc))
                return
            size = itemsize(record.dtype)
            run = contiguous_range(_box(box), _box(region), size)
            if run is not None:  # sent straight from the slot, no packed copy
                data: Any = view[run[0] : run[0] + run[1]]
            else:
                data = extract_box(view, _box(box), _box(region), size)
            conn.send_msg(BoxFrame(i, crc32c.crc32c(data)), data)
    conn.send_msg(End())


@dataclass(frozen=True)
class _Piece:
    """Where one read lands in the staging slot."""

    read: Read
    dst: memoryview
    dst_box: Box
    region: Box
    itemsize: int


def _receive_boxes(conn: Connection, pieces: list[_Piece]) -> int:
    """Receive the answer to a fetch_boxes request into the staging slot; return bytes."""
    received = 0
    while True:
        header = conn.recv_header()
        raise_if_error(header, conn.peer)
        frame = decode(header, where=conn.peer)
        if isinstance(frame, End):
            return received
        if not isinstance(frame, BoxFrame) or not 0 <= frame.i < len(pieces):
            raise ProtocolError(f"{conn.peer} sent {header['type']!r} in answer to fetch_boxes")
        piece = pieces[frame.i]
        run = contiguous_range(piece.dst_box, piece.region, piece.itemsize)
        if run is not None:  # one run of the wanted chunk: straight into place
            dst = piece.dst[run[0] : run[0] + run[1]]
            conn.recv_payload_into(header, dst)
            data: Any = dst[: header["len"]]
        else:
            buf = bytearray(piece.region.numel() * piece.itemsize)
            conn.recv_payload_into(header, memoryview(buf))
            data = buf
        if crc32c.crc32c(data) != frame.crc or len(data) != piece.region.numel() * piece.itemsize:
            raise ChecksumMismatch(
                f"a piece of {piece.read.key!r} from {conn.peer} arrived damaged"
            )
        if run is None:
            place_box(piece.dst, piece.dst_box, piece.region, piece.itemsize, data)
        received += len(data)


def _read_storage(url: str, step: int, items: list[Read], piece: Callable[[Read], _Piece]) -> int:
    """Carry out the plan's reads from the durable checkpoint of ``step``; return bytes read.

    Each stored chunk is read whole, once, and verified against its checksum before pieces
    are cut out of it.
    """
    ckpt = DurableStore(url).open(step)
    index = {
        (
            rank,
            chunk_name(c.record.key, c.record.scope, rank),
            c.record.offsets,
            c.record.lengths,
        ): c
        for rank, chunks in ckpt.manifest.ranks.items()
        for c in chunks
    }
    cache: dict[tuple[str, int], bytes] = {}
    total = 0
    for read in items:
        src = read.src_box
        chunk = index.get((read.source_rank, read.key, src.offsets, src.lengths))
        if chunk is None:
            raise RecoveryFailed(
                f"step {step} in {url} has no chunk {read.key!r} at {src} of rank "
                f"{read.source_rank}"
            )
        where = (chunk.file, chunk.record.byte_offset)
        data = cache.get(where)
        if data is None:
            try:
                data = cache[where] = ckpt.read(chunk)
            except CorruptCheckpoint as exc:
                raise RecoveryFailed(
                    f"{exc}; start the job with --allow-older (persist_allow_older=True) to "
                    "fall back to the newest intact committed step"
                ) from None
        p = piece(read)
        copy_box(data, src, p.dst, p.dst_box, p.region, p.itemsize)
        total += read.nbytes
    return total


def staging_layout(wanted: list[ChunkRecord]) -> tuple[list[ChunkRecord], int]:
    """Byte offsets for the wanted chunks, packed and aligned as in a snapshot slot."""
    placed, offset = [], 0
    for want in wanted:
        nbytes = Box(tuple(want.offsets), tuple(want.lengths)).numel() * itemsize(want.dtype)
        placed.append(replace(want, byte_offset=offset, nbytes=nbytes))
        offset = align(offset + nbytes)
    return placed, offset


@dataclass(frozen=True)
class GatherJob:
    """One rank's share of a resharding round: what to gather, and where it comes from.

    ``rank`` of the new layout (generation ``gen``) on this ``node`` wants the boxes
    ``wanted`` for ``round``; ``reads`` (the coordinator's plan) say which region of which
    chunk of which old rank to read from which node (or ``STORAGE``: the durable step at
    ``storage_url``); the old snapshots are step ``step`` of layout ``old_gen``.
    """

    node: int
    epoch: int
    gen: int
    rank: int
    round: int
    old_gen: int
    step: int
    wanted: list[ChunkRecord]
    reads: list[Read]
    storage_url: str | None = None


@dataclass
class Assembled:
    slot: Slot
    manifest: SnapshotManifest
    local_bytes: int
    pulled: dict[int, int]  # source node → bytes pulled from it
    seconds: float


def assemble(store: SlotStore, job: GatherJob, connect: Callable[[int], Connection]) -> Assembled:
    """Build ``job.rank``'s staging slot for its round from ``job.reads``; ``connect(node)``
    opens an authenticated data link to a source node."""
    start = time.monotonic()
    node, epoch, rank, step, old_gen = job.node, job.epoch, job.rank, job.step, job.old_gen
    reads, storage_url = job.reads, job.storage_url
    layout, used = staging_layout(job.wanted)
    # Not touched first: the local copy and the pulls fault its pages in parallel.
    slot = store.ensure(SlotKind.STAGING, job.gen, rank, job.round, used, touch=False)
    by_box = {(c.key, _record_box(c)): c for c in layout}

    def piece(read: Read) -> _Piece:
        record = by_box.get((read.key, read.dst_box))
        if record is None:
            raise ProtocolError(f"the plan reads {read.key!r}, which this rank did not ask for")
        view = slot.segment.view[record.byte_offset : record.byte_offset + record.nbytes]
        return _Piece(read, view, read.dst_box, read.region, itemsize(record.dtype))

    local = [r for r in reads if r.source_node == node]
    stored = [r for r in reads if r.source_node == STORAGE]
    remote: dict[int, list[Read]] = {}
    for r in reads:
        if r.source_node not in (node, STORAGE):
            remote.setdefault(r.source_node, []).append(r)
    pulled: dict[int, int] = {}
    errors: list[str] = []
    unreachable: list[int] = []  # source nodes that did not answer (they may be dying)

    def pull(source: int, items: list[Read]) -> None:
        try:
            conn = connect(source)
            try:
                conn.send_msg(
                    FetchBoxes(
                        epoch,
                        old_gen,
                        step,
                        [
                            (r.source_rank, r.key, box_msg(r.src_box), box_msg(r.region))
                            for r in items
                        ],
                    )
                )
                pulled[source] = _receive_boxes(conn, [piece(r) for r in items])
            finally:
                conn.close()
        except Exception as exc:  # reported below, naming the source
            errors.append(f"node {source}: {type(exc).__name__}: {exc}")
            if no_answer(exc):
                unreachable.append(source)

    def read_storage(items: list[Read]) -> None:
        try:
            if storage_url is None:
                raise RecoveryFailed("the plan reads durable storage, but no URL was given")
            pulled[STORAGE] = _read_storage(storage_url, step, items, piece)
        except Exception as exc:  # reported below, naming the source
            errors.append(f"storage {storage_url}: {type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=pull, args=(n, items), name=f"peerckpt-reshard-n{n}", daemon=True)
        for n, items in sorted(remote.items())
    ]
    if stored:
        threads.append(
            threading.Thread(
                target=read_storage, args=(stored,), name="peerckpt-reshard-storage", daemon=True
            )
        )
    for t in threads:
        t.start()
    local_bytes = 0
    try:
        held: dict[int, _Held] = {}
        for read in local:
            source_rank = read.source_rank
            if source_rank not in held:
                held[source_rank] = _held(store, old_gen, source_rank, step)
            src = held[source_rank]
            p = piece(read)
            with src.slot.lock:
                view, _ = src.chunk(read.key, read.src_box)
                copy_box(view, read.src_box, p.dst, p.dst_box, p.region, p.itemsize)
            local_bytes += read.nbytes
    except Exception as exc:
        errors.append(f"node {node} (local): {type(exc).__name__}: {exc}")
    for t in threads:
        t.join()
    if errors:
        store.release_where(lambda s: s is slot)
        raise RecoveryFailed(
            f"rank {rank} could not gather its state for the new layout: " + "; ".join(errors),
            unreachable=bool(unreachable),
        )
    manifest = SnapshotManifest(rank, step, epoch, tuple(layout), used)
    slot.manifest = manifest
    return Assembled(slot, manifest, local_bytes, pulled, time.monotonic() - start)
