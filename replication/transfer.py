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
from typing import Any

from peerckpt.errors import (
    ChecksumMismatch,
    InsufficientMemory,
    PeerckptError,
    PeerUnavailable,
    ProtocolError,
)
from peerckpt.faults import NetHooks
from peerckpt.manifest import SnapshotManifest
from peerckpt.replication.checksums import RunningChecksums
from peerckpt.replication.gather import serve_boxes
from peerckpt.replication.store import SlotStore
from peerckpt.wire import Connection, raise_if_error, server_handshake

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
) -> None:
    """Send ``view[:used]`` as data frames, front to back, then ``end``.

    ``midway`` runs after the first frame; ``crcs``, called once the last frame is out, gives
    the checksums the ``end`` frame carries (they were computed while the frames travelled).
    """
    for off in range(0, used, PIECE_BYTES):
        if cancel is not None and cancel.is_set():
            conn.close()
            raise Cancelled("transfer cancelled by an epoch change")
        conn.send({"type": "data", "off": off}, view[off : min(off + PIECE_BYTES, used)])
        if off == 0 and midway is not None:
            midway()
    conn.send({"type": "end"} if crcs is None else {"type": "end", "crcs": crcs()})


def recv_bytes(
    conn: Connection,
    view: memoryview,
    used: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Receive data frames into ``view[:used]`` until ``end``; return the ``end`` header.

    Frames must come front to back with no gap and no overlap (every sender sends them so),
    which lets ``progress(n)`` tell a checksummer that the first ``n`` bytes are final. Each
    frame is size-checked before a byte of it is read.
    """
    got = 0
    while True:
        header = conn.recv_header()
        if header["type"] == "end":
            if got != used:
                raise ProtocolError(f"{conn.peer} ended a transfer after {got} of {used} bytes")
            return header
        raise_if_error(header, conn.peer)
        if header["type"] != "data" or not isinstance(header.get("off"), int):
            raise ProtocolError(f"{conn.peer} sent {header['type']!r} inside a snapshot transfer")
        if header["off"] != got:
            conn.send_error("protocol", f"data frame at offset {header['off']}, expected {got}")
            raise ProtocolError(
                f"{conn.peer} sent a data frame at offset {header['off']} of {used}; the next "
                f"one must start at {got}"
            )
        conn.recv_payload_into(header, view[got:used])
        got += header["len"]
        if progress is not None:
            progress(got)


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
    conn.request(
        {
            "type": "push",
            "epoch": epoch,
            "gen": gen,
            "rank": rank,
            "committed": committed,
            "manifest": manifest.to_msg(),
        }
    )
    if crcs is None:
        if any(c.crc is None for c in manifest.chunks):
            raise ValueError("push of a manifest without checksums and no way to get them")
        crcs = lambda: [c.crc for c in manifest.chunks if c.crc is not None]  # noqa: E731
    send_bytes(conn, view, manifest.used_bytes, cancel, midway, crcs)
    reply, _ = conn.recv_message()
    raise_if_error(reply, conn.peer)
    if reply.get("type") != "ack":
        raise ProtocolError(f"{conn.peer} answered a push with {reply.get('type')!r}")


def _receive_verified(
    conn: Connection, manifest: SnapshotManifest, view: memoryview, name: str
) -> tuple[dict[str, Any], list[int]]:
    """Receive a snapshot's bytes into ``view`` while a thread checksums each finished chunk;
    return the ``end`` header and the checksums of what arrived."""
    sums = RunningChecksums(manifest.chunks, view, name=name)
    try:
        end = recv_bytes(conn, view, manifest.used_bytes, sums.advance)
        return end, sums.wait()
    finally:
        sums.cancel()


def fetch(
    conn: Connection,
    epoch: int,
    gen: int,
    rank: int,
    step: int,
    allocate: Callable[[SnapshotManifest], memoryview],
) -> SnapshotManifest:
    """Pull ``rank``'s snapshot of ``step`` into the view ``allocate`` returns; verify it."""
    reply = conn.request({"type": "fetch", "epoch": epoch, "gen": gen, "rank": rank, "step": step})
    if reply.get("type") != "manifest":
        raise ProtocolError(f"{conn.peer} answered a fetch with {reply.get('type')!r}")
    manifest = SnapshotManifest.from_msg(reply["manifest"])
    if manifest.rank != rank or manifest.step != step:
        raise ProtocolError(
            f"{conn.peer} sent rank {manifest.rank} step {manifest.step} for rank {rank} step {step}"
        )
    view = allocate(manifest)
    manifest.validate_bounds(len(view))
    _, computed = _receive_verified(conn, manifest, view, f"fetch{rank}")
    bad = manifest.mismatched(computed)
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
    ) -> None:
        self._net = net
        self.store = store
        self._committed_step = committed_step
        self._secret = secret
        self._job = job
        self._current_epoch = current_epoch
        self._sock = socket.create_server((host, 0), backlog=128)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._accept, name="peerckpt-data-accept", daemon=True
        )
        self.bytes_served = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, net=self._net)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="peerckpt-data-conn", daemon=True
            ).start()

    def _serve(self, conn: Connection) -> None:
        try:
            server_handshake(conn, self._secret, self._job)
            while not self._stop.is_set():
                conn.sock.settimeout(None)  # idle between requests: wait as long as it takes
                header = conn.recv_header()
                conn.sock.settimeout(IO_TIMEOUT_S)
                if header["type"] == "push":
                    self._on_push(conn, header)
                elif header["type"] == "fetch":
                    self._on_fetch(conn, header)
                elif header["type"] == "fetch_boxes":
                    serve_boxes(conn, self.store, header)
                else:
                    conn.send_error("protocol", f"unknown request {header['type']!r}")
                    return
        except PeerUnavailable:
            pass  # the peer went away; nothing half-written is ever marked complete
        except PeerckptError as exc:
            log.warning("refused a request from %s: %s", conn.peer, exc)
        except Exception:
            log.exception("data connection from %s failed", conn.peer)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)

    def _on_push(self, conn: Connection, header: dict[str, Any]) -> None:
        epoch = header["epoch"]
        if epoch < self._current_epoch():
            conn.send_error(
                "stale_epoch", f"push of epoch {epoch} after epoch {self._current_epoch()} began"
            )
            return
        manifest = SnapshotManifest.from_msg(header["manifest"])
        rank, gen = header["rank"], header["gen"]
        keep = [s for s in (self._committed_step(), header.get("committed")) if s is not None]
        index = self.store.replica_target(gen, rank, max(keep) if keep else None)
        try:
            slot = self.store.ensure("replica", gen, rank, index, manifest.used_bytes)
        except InsufficientMemory as exc:
            conn.send_error("memory", str(exc))
            return
        with slot.lock:
            slot.invalidate()
            manifest.validate_bounds(slot.segment.size)
            conn.send({"type": "ready"})
            end, computed = _receive_verified(conn, manifest, slot.segment.view, f"push{rank}")
            if epoch < self._current_epoch():
                conn.send_error("stale_epoch", f"epoch {epoch} ended during the push")
                return
            sent = end.get("crcs")
            if not isinstance(sent, list) or len(sent) != len(manifest.chunks):
                conn.send_error("protocol", "the push ended without a checksum per chunk")
                raise ProtocolError(f"{conn.peer} ended a push without a checksum per chunk")
            manifest = manifest.with_crcs(sent)
            bad = manifest.mismatched(computed)
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
        conn.send({"type": "ack"})

    def _on_fetch(self, conn: Connection, header: dict[str, Any]) -> None:
        if header["epoch"] < self._current_epoch():
            conn.send_error(
                "stale_epoch",
                f"fetch of epoch {header['epoch']} after epoch {self._current_epoch()} began",
            )
            return
        slot = self.store.find(header["gen"], header["rank"], header["step"])
        if slot is None:
            conn.send_error(
                "missing",
                f"this agent holds no copy of rank {header['rank']} step {header['step']}",
            )
            return
        with slot.lock:
            manifest = slot.manifest
            if manifest is None or manifest.step != header["step"]:
                conn.send_error("missing", "the copy was replaced while the request waited")
                return
            conn.send({"type": "manifest", "manifest": manifest.to_msg()})
            send_bytes(conn, slot.segment.view, manifest.used_bytes)
            self.bytes_served += manifest.used_bytes
