"""Moving snapshot bytes between agents: the data server, ``push`` and ``fetch``.

Protocol on an authenticated connection (see ``wire``):

* push — replicate a snapshot to a buddy::

      → {type: push, epoch, gen, rank, committed, manifest}   ← {type: ready} | error
      → {type: data, off} + bytes … → {type: end, crcs}    ← {type: ack} | error(checksum)

  The buddy picks which of the rank's two replica slots to overwrite (never the one holding
  the committed step: the newer of its own and the sender's ``committed``), allocates it from
  the manifest's size before answering ``ready``, receives every data frame straight into the
  slot after checking it fits, and acknowledges only once every chunk's crc32c matches and
  the push's epoch is still current. The sender checksums the chunks while their bytes
  travel, so their crc32c come last, in ``end``; the buddy checksums each chunk as its last
  byte arrives (``checksums.RunningChecksums``) and compares.

* fetch — pull a snapshot during a recovery::

      → {type: fetch, epoch, gen, rank, step}   ← {type: manifest, manifest} + data frames + end

  The puller verifies every checksum (each chunk as soon as it has arrived) and refuses the
  copy (ChecksumMismatch) otherwise.

  ``fetch_device`` asks for the same copy over a device link (NCCL), TCP its fallback
  (``replication/devicepull.py``).

* fetch_boxes — pull pieces of chunks when resharding into a new layout::

      → {type: fetch_boxes, epoch, gen, step, items: [[rank, name, box, region], …]}
      ← {type: box, i, crc} + the region's bytes packed row-major, per item … → {type: end}

  The server verifies each source chunk's checksum before cutting pieces out of it; every
  piece travels with its own crc32c, checked by the receiver.

Every request names the layout generation (``gen``) of the snapshot it is about. Data frames
travel front to back, without gaps or overlaps; a receiver refuses any other order.

Bytes of a slot are read or written only while its lock is held. Once a request has
started, every socket operation has a timeout (``IO_TIMEOUT_S``), so a hung peer cannot hold
a slot forever.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from peerckpt import tls
from peerckpt.errors import (
    ChecksumMismatch,
    InsufficientMemory,
    PeerckptError,
    PeerUnavailable,
    ProtocolError,
)
from peerckpt.faults import NetHooks
from peerckpt.manifest import SnapshotManifest
from peerckpt.messages import Dispatch, decode
from peerckpt.messages.data import (
    Ack,
    Data,
    DataRequest,
    DeviceDeclined,
    End,
    Fetch,
    FetchBoxes,
    FetchDevice,
    FetchParity,
    FetchRanges,
    ManifestReply,
    ParityPiece,
    Push,
    Ready,
)
from peerckpt.replication.checksums import RunningChecksums
from peerckpt.replication.gather import serve_boxes
from peerckpt.replication.parity import ParityStore, serve_parity, serve_piece, serve_ranges
from peerckpt.replication.store import SlotStore
from peerckpt.serving import Listener
from peerckpt.states import SlotKind
from peerckpt.wire import Connection, raise_if_error, server_handshake

if TYPE_CHECKING:
    from peerckpt.replication.devicepull import DevicePulls

PIECE_BYTES = 16 << 20
IO_TIMEOUT_S = 30.0
log = logging.getLogger("peerckpt.transfer")


class Cancelled(PeerckptError):
    """A transfer was abandoned because its epoch ended."""


def send_bytes(
    conn: Connection,
    view: memoryview,
    used: int,
    cancel: threading.Event | None = None,
    midway: Callable[[], object] | None = None,
    crcs: Callable[[], list[int]] | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> None:
    """Send ``view[:used]`` (or only its byte ``ranges``, ascending) as data frames, front to
    back, then ``end``.

    ``midway`` runs after the first frame; ``crcs``, called once the last frame is out, gives
    the checksums the ``end`` frame carries (they were computed while the frames travelled).
    """
    first = True
    for start, stop in [(0, used)] if ranges is None else ranges:
        for off in range(start, stop, PIECE_BYTES):
            if cancel is not None and cancel.is_set():
                conn.close()
                raise Cancelled("transfer cancelled by an epoch change")
            conn.send_msg(Data(off), view[off : min(off + PIECE_BYTES, stop)])
            if first and midway is not None:
                midway()
            first = False
    conn.send_msg(End(crcs() if crcs is not None else None))


def recv_bytes(
    conn: Connection,
    view: memoryview,
    used: int,
    progress: Callable[[int], None] | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> End:
    """Receive data frames into ``view[:used]`` (or only its byte ``ranges``, ascending, as a
    partial copy holds them) until ``end``; return the ``End``.

    Frames must come front to back with no gap (but between ranges) and no overlap (every
    sender sends them so), which lets ``progress(n)`` tell a checksummer that the bytes
    received before ``n`` are final. Each frame is size-checked before a byte of it is read.
    """
    spans = [(0, used)] if ranges is None else list(ranges)
    total = sum(stop - start for start, stop in spans)
    at, got = 0, 0  # the span being filled; bytes received
    pos = spans[0][0] if spans else 0
    while True:
        header = conn.recv_header()
        raise_if_error(header, conn.peer)
        frame = decode(header, where=conn.peer)
        if isinstance(frame, End):
            if got != total:
                raise ProtocolError(f"{conn.peer} ended a transfer after {got} of {total} bytes")
            return frame
        if not isinstance(frame, Data):
            raise ProtocolError(f"{conn.peer} sent {header['type']!r} inside a snapshot transfer")
        if at >= len(spans) or frame.off != pos:
            conn.send_error("protocol", f"data frame at offset {frame.off}, expected {pos}")
            raise ProtocolError(
                f"{conn.peer} sent a data frame at offset {frame.off} of {used}; the next "
                f"one must start at {pos}"
            )
        conn.recv_payload_into(header, view[pos : spans[at][1]])
        pos += header["len"]
        got += header["len"]
        if progress is not None:
            progress(pos)
        if pos >= spans[at][1]:
            at += 1
            pos = spans[at][0] if at < len(spans) else pos


def push(
    conn: Connection,
    epoch: int,
    gen: int,
    rank: int,
    committed: int | None,
    manifest: SnapshotManifest,
    view: memoryview,
    cancel: threading.Event | None = None,
    midway: Callable[[], object] | None = None,
    crcs: Callable[[], list[int]] | None = None,
) -> None:
    """Replicate a snapshot to the buddy at the other end of ``conn``.

    ``committed`` is the last step the sender knows committed; the buddy keeps its copy.
    ``crcs`` gives the chunks' checksums once the bytes are sent (default: the manifest's
    own); the buddy computes its own while they arrive and acknowledges only if they match.
    ``midway`` runs once the first data frame is sent (the chaos harness strikes there).
    """
    conn.send_msg(Push(epoch, gen, rank, committed, manifest))
    conn.recv_msg(Ready)
    if crcs is None:
        if any(c.crc is None for c in manifest.chunks):
            raise ValueError("push of a manifest without checksums and no way to get them")
        crcs = lambda: [c.crc for c in manifest.chunks if c.crc is not None]  # noqa: E731
    ranges = manifest.byte_ranges() if manifest.absent else None  # a partial copy's bytes
    send_bytes(conn, view, manifest.used_bytes, cancel, midway, crcs, ranges)
    conn.recv_msg(Ack)


def _receive_verified(
    conn: Connection, manifest: SnapshotManifest, view: memoryview, name: str
) -> tuple[End, list[int]]:
    """Receive a snapshot's bytes into ``view`` while a thread checksums each finished chunk;
    return the ``end`` header and the checksums of what arrived."""
    partial = bool(manifest.absent)
    sums = RunningChecksums(manifest.present() if partial else manifest.chunks, view, name=name)
    try:
        ranges = manifest.byte_ranges() if partial else None
        end = recv_bytes(conn, view, manifest.used_bytes, sums.advance, ranges)
        return end, sums.wait()
    finally:
        sums.cancel()


def _mismatched(manifest: SnapshotManifest, computed: list[int]) -> list[str]:
    """Keys of the chunks a copy holds whose checksum is not the recorded one (``computed``:
    those of the chunks it holds, in order)."""
    if not manifest.absent:
        return manifest.mismatched(computed)
    held = manifest.present()
    if len(computed) != len(held):
        return [c.key for c in held]
    return [c.key for c, k in zip(held, computed, strict=True) if c.crc is None or c.crc != k]


def fetch(
    conn: Connection,
    epoch: int,
    gen: int,
    rank: int,
    step: int,
    allocate: Callable[[SnapshotManifest], memoryview],
) -> SnapshotManifest:
    """Pull ``rank``'s snapshot of ``step`` into the view ``allocate`` returns; verify it."""
    conn.send_msg(Fetch(epoch, gen, rank, step))
    manifest = conn.recv_msg(ManifestReply).manifest
    if manifest.rank != rank or manifest.step != step:
        raise ProtocolError(
            f"{conn.peer} sent rank {manifest.rank} step {manifest.step} for rank {rank} step {step}"
        )
    view = allocate(manifest)
    manifest.validate_bounds(len(view))
    _, computed = _receive_verified(conn, manifest, view, f"fetch{rank}")
    bad = _mismatched(manifest, computed)
    if bad:
        raise ChecksumMismatch(
            f"the copy of rank {rank} step {step} held by {conn.peer} fails verification (its "
            f"crc32c checksum) in {len(bad)} chunk(s), first {bad[:3]}; it is not restored from"
        )
    return manifest


class DataServer:
    """Accepts authenticated connections from peer agents and serves push and fetch."""

    def __init__(
        self,
        store: SlotStore,
        secret: bytes,
        job: str,
        current_epoch: Callable[[], int],
        committed_step: Callable[[], int | None],
        host: str = "127.0.0.1",
        net: NetHooks | None = None,
        trusted: Callable[[], frozenset[str]] | None = None,
        parity: ParityStore | None = None,
        device: DevicePulls | None = None,
    ) -> None:
        """``trusted``: the hosts of the job's agents, admitted first (``peerckpt/serving.py``);
        ``parity``: the parity pieces this agent keeps (``--erasure``); ``device``: this
        agent's pulls over a device link (``replication/devicepull.py``; None: TCP only)."""
        self.device = device
        self._net = net
        self.parity = parity if parity is not None else ParityStore(store.arena)
        self.store = store
        self._committed_step = committed_step
        self._secret = secret
        self._job = job
        self._current_epoch = current_epoch
        sock = socket.create_server((host, 0), backlog=128)
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._listener = Listener(
            sock,
            lambda conn: server_handshake(conn, secret, job),
            self._serve,
            "peerckpt-data",
            tcp=True,
            net=net,
            tls=tls.server_context(secret) if tls.wanted(host) else None,
            trusted=trusted,
        )
        self.bytes_served = 0
        self._requests = Dispatch[None](
            {
                Push: self._on_push,
                Fetch: self._on_fetch,
                FetchDevice: self._on_fetch_device,
                FetchBoxes: self._on_fetch_boxes,
                ParityPiece: lambda m, c: serve_piece(
                    c, m, self.parity, self._current_epoch(), self._committed_step()
                ),
                FetchParity: lambda m, c: serve_parity(c, m, self.parity),
                FetchRanges: lambda m, c: serve_ranges(c, m, self.store),
            },
            "a data server",
        )

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()

    def _serve(self, conn: Connection, hello: dict[str, Any]) -> None:
        try:
            while not self._listener.stopping:
                conn.sock.settimeout(None)  # idle between requests: wait as long as it takes
                try:
                    request = conn.recv_msg(DataRequest)
                except ProtocolError as exc:
                    conn.send_error("protocol", str(exc))
                    raise
                conn.sock.settimeout(IO_TIMEOUT_S)
                self._requests.handle(request, conn)
        except PeerUnavailable:
            pass  # the peer went away; nothing half-written is ever marked complete
        except PeerckptError as exc:
            log.warning("refused a request from %s: %s", conn.peer, exc)
        except Exception:
            log.exception("data connection from %s failed", conn.peer)

    def _on_push(self, msg: Push, conn: Connection) -> None:
        epoch = msg.epoch
        if epoch < self._current_epoch():
            conn.send_error(
                "stale_epoch", f"push of epoch {epoch} after epoch {self._current_epoch()} began"
            )
            return
        manifest, rank, gen = msg.manifest, msg.rank, msg.gen
        keep = [s for s in (self._committed_step(), msg.committed) if s is not None]
        index = self.store.replica_target(gen, rank, max(keep) if keep else None)
        try:
            # A partial copy's absent chunks are never written: their pages stay holes.
            only = manifest.byte_ranges() if manifest.absent else None
            slot = self.store.ensure(
                SlotKind.REPLICA, gen, rank, index, manifest.used_bytes, only=only
            )
        except InsufficientMemory as exc:
            conn.send_error("memory", str(exc))
            return
        with slot.lock:
            slot.invalidate()
            manifest.validate_bounds(slot.segment.size)
            conn.send_msg(Ready())
            end, computed = _receive_verified(conn, manifest, slot.segment.view, f"push{rank}")
            if epoch < self._current_epoch():
                conn.send_error("stale_epoch", f"epoch {epoch} ended during the push")
                return
            sent = end.crcs
            if sent is None or len(sent) != len(manifest.chunks):
                conn.send_error("protocol", "the push ended without a checksum per chunk")
                raise ProtocolError(f"{conn.peer} ended a push without a checksum per chunk")
            manifest = manifest.with_crcs(sent)
            bad = _mismatched(manifest, computed)
            if bad:
                log.error(
                    "replica of rank %d step %d from %s fails its checksum in %s; discarded",
                    manifest.rank,
                    manifest.step,
                    conn.peer,
                    bad[:3],
                )
                conn.send_error("checksum", f"replica fails verification in chunk(s) {bad[:3]}")
                return
            slot.manifest = manifest
        conn.send_msg(Ack())

    def _on_fetch(self, msg: Fetch, conn: Connection) -> None:
        if msg.epoch < self._current_epoch():
            conn.send_error(
                "stale_epoch",
                f"fetch of epoch {msg.epoch} after epoch {self._current_epoch()} began",
            )
            return
        slot = self.store.find(msg.gen, msg.rank, msg.step, partial=True)
        if slot is None:
            conn.send_error(
                "missing", f"this agent holds no copy of rank {msg.rank} step {msg.step}"
            )
            return
        with slot.lock:
            manifest = slot.manifest
            if manifest is None or manifest.step != msg.step:
                conn.send_error("missing", "the copy was replaced while the request waited")
                return
            conn.send_msg(ManifestReply(manifest))
            ranges = manifest.byte_ranges() if manifest.absent else None
            send_bytes(conn, slot.segment.view, manifest.used_bytes, ranges=ranges)
            self.bytes_served += sum(b - a for a, b in manifest.byte_ranges())

    def _on_fetch_device(self, msg: FetchDevice, conn: Connection) -> None:
        if self.device is None:
            conn.send_msg(DeviceDeclined("this agent pulls over TCP only"))
            return
        self.bytes_served += self.device.serve(msg, conn, self.store, self._current_epoch())

    def _on_fetch_boxes(self, msg: FetchBoxes, conn: Connection) -> None:
        serve_boxes(conn, self.store, msg)
