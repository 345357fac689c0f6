"""Moving snapshot bytes between agents: the data server, ``push`` and ``fetch``.

Protocol on an authenticated connection (see ``wire``):

* push — replicate a snapshot to a buddy::

      → {type: push, epoch, gen, rank, committed, manifest}   ← {type: ready} | error
      → {type: data, off} + bytes … → {type: end}    ← {type: ack} | error(checksum)

  The buddy picks which of the rank's two replica slots to overwrite (never the one holding
  the committed step: the newer of its own and the sender's ``committed``), allocates it from
  the manifest's size before answering ``ready``, receives every data frame straight into the
  slot after checking it fits, and acknowledges only once every chunk's crc32c matches and
  the push's epoch is still current.

* fetch — pull a snapshot during a recovery::

      → {type: fetch, epoch, gen, rank, step}   ← {type: manifest, manifest} + data frames + end

  The puller verifies every checksum and refuses the copy (ChecksumMismatch) otherwise.

* fetch_boxes — pull pieces of chunks when resharding into a new layout::

      → {type: fetch_boxes, epoch, gen, step, items: [[rank, name, box, region], …]}
      ← {type: box, i, crc} + the region's bytes packed row-major, per item … → {type: end}

  The server verifies each source chunk's checksum before cutting pieces out of it; every
  piece travels with its own crc32c, checked by the receiver.

Every request names the layout generation (``gen``) of the snapshot it is about.

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
from peerckpt.persist.manifest import SnapshotManifest
from peerckpt.replication.reshard import serve_boxes
from peerckpt.replication.store import SlotStore
from peerckpt.replication.wire import Connection, raise_if_error, server_handshake

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
) -> None:
    """Send ``view[:used]`` as data frames, then ``end``; ``midway`` runs after the first."""
    for off in range(0, used, PIECE_BYTES):
        if cancel is not None and cancel.is_set():
            conn.close()
            raise Cancelled("transfer cancelled by an epoch change")
        conn.send({"type": "data", "off": off}, view[off : min(off + PIECE_BYTES, used)])
        if off == 0 and midway is not None:
            midway()
    conn.send({"type": "end"})


def recv_bytes(conn: Connection, view: memoryview, used: int) -> None:
    """Receive data frames into ``view[:used]`` until ``end``; each is size-checked first."""
    while True:
        header = conn.recv_header()
        if header["type"] == "end":
            return
        raise_if_error(header, conn.peer)
        if header["type"] != "data" or not isinstance(header.get("off"), int):
            raise ProtocolError(f"{conn.peer} sent {header['type']!r} inside a snapshot transfer")
        off = header["off"]
        if not 0 <= off <= used:
            conn.send_error("frame_too_large", f"offset {off} is outside the {used}-byte snapshot")
            raise ProtocolError(f"{conn.peer} sent a data frame at offset {off} of {used}")
        conn.recv_payload_into(header, view[off:used])


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
) -> None:
    """Replicate a checksummed snapshot to the buddy at the other end of ``conn``.

    ``committed`` is the last step the sender knows committed; the buddy keeps its copy.
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
    send_bytes(conn, view, manifest.used_bytes, cancel, midway)
    reply, _ = conn.recv_message()
    raise_if_error(reply, conn.peer)
    if reply.get("type") != "ack":
        raise ProtocolError(f"{conn.peer} answered a push with {reply.get('type')!r}")


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
    recv_bytes(conn, view, manifest.used_bytes)
    bad = manifest.bad_chunks(view)
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
    ) -> None:
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
            conn = Connection(sock)
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
            recv_bytes(conn, slot.segment.view, manifest.used_bytes)
            if epoch < self._current_epoch():
                conn.send_error("stale_epoch", f"epoch {epoch} ended during the push")
                return
            bad = manifest.bad_chunks(slot.segment.view)
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
