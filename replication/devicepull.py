"""A recovery pull over a device link (NCCL), with TCP as its fallback: both ends' side.

Exchange on the agents' authenticated data link; the puller offers, the holder decides::

    → {type: fetch_device, epoch, gen, rank, step, uid}
    ← {type: device_declined, why}       the holder cannot, or runs --transport tcp:
      → {type: fetch, …}                 the TCP pull of ``transfer.py``, on the same link
    ← {type: manifest, manifest}         accepted: both open the device link ``uid``
                                         (holder rank 0, puller rank 1)
      … the copy's pieces over the link (``transport.DeviceTransport``) …
    ← {type: end}                        the holder's last piece is out

The rendezvous id travels only on the data link, which is authenticated (and TLS between
hosts) like every other exchange of the job, so only the job's agents can join the link.
The puller checksums every chunk (crc32c) as its piece lands on the host, as over TCP. Then:

* the link fails (opening it, a piece, or its watchdog's abort): a warning, and the copy is
  pulled again over TCP on a fresh connection to the same holder;
* a chunk fails its crc32c: an error naming the chunks, and the copy is pulled again over TCP
  from the same holder; a TCP copy that fails as well is refused as ever, and
  ``replication/obtain.py`` tries the plan's next source.

The endpoints are the agents (pinned host → GPU → NCCL → GPU → the replacement's slot), not
the rank processes: docs/decisions.md, 22, says why and what receiving straight
into the replacement's CUDA tensors would need.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from peerckpt.errors import PeerUnavailable, ProtocolError
from peerckpt.manifest import SnapshotManifest
from peerckpt.messages import from_frame
from peerckpt.messages.data import DeviceDeclined, FetchDevice, ManifestReply
from peerckpt.replication.checksums import RunningChecksums
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import _mismatched, fetch
from peerckpt.replication.transport import (
    DeviceFabric,
    DeviceLink,
    DeviceLinkError,
    DeviceTransport,
    Transport,
    TransportMode,
    choose,
    deadline_s,
    opened,
)
from peerckpt.wire import Connection, raise_if_error

log = logging.getLogger("peerckpt.transfer")
OPEN_TIMEOUT_S = 30.0  # NCCL's set-up cannot be aborted: a link not open by then is given up

Allocate = Callable[[SnapshotManifest], memoryview]


class DevicePulls:
    """An agent's device pulls: its ``--transport`` mode and its fabric, probed once (in the
    background from ``start``, so that a recovery does not wait for CuPy's import).

    ``probe`` returns the fabric, or None with why not (``replication/nccl.py``'s
    ``probe``; tests inject a fake)."""

    def __init__(
        self,
        mode: TransportMode,
        probe: Callable[[], tuple[DeviceFabric | None, str]],
        node: int = -1,
    ) -> None:
        self.mode, self.node = mode, node
        self._probe = probe
        self._lock = threading.Lock()
        self._probed: tuple[DeviceFabric | None, str] | None = None

    def start(self) -> None:
        """Probe the fabric in the background (nothing to probe with ``--transport tcp``)."""
        if self.mode is not TransportMode.TCP:
            threading.Thread(target=self.fabric, name="peerckpt-probe-nccl", daemon=True).start()

    def fabric(self) -> DeviceFabric | None:
        """This agent's fabric, or None: ``--transport tcp``, or no CUDA or NCCL here."""
        if self.mode is TransportMode.TCP:
            return None
        with self._lock:
            if self._probed is None:
                self._probed = self._probe()
                fabric, why = self._probed
                if fabric is None:
                    # auto on a machine without a GPU is the common case: no news
                    level = logging.WARNING if self.mode is TransportMode.NCCL else logging.DEBUG
                    log.log(level, "node %d pulls over TCP: %s", self.node, why)
            return self._probed[0]

    # -- the puller -------------------------------------------------------------------------
    def pull(
        self,
        connect: Callable[[], Connection],
        epoch: int,
        gen: int,
        rank: int,
        step: int,
        allocate: Allocate,
    ) -> tuple[SnapshotManifest, str]:
        """Pull ``rank``'s snapshot of ``step`` into the view ``allocate`` returns (it may be
        called twice, for a TCP pull after a failed device one), verified; the manifest and
        the transport that carried it."""
        fabric = self.fabric()
        conn = connect()
        try:
            if fabric is None or choose(self.mode, True, True) == "tcp":
                return fetch(conn, epoch, gen, rank, step, allocate), "tcp"
            uid = fabric.unique_id()
            conn.send_msg(FetchDevice(epoch, gen, rank, step, uid))
            reply = _reply(conn)
            if isinstance(reply, DeviceDeclined):
                log.info("%s declined a device pull of rank %d: %s", conn.peer, rank, reply.why)
                return fetch(conn, epoch, gen, rank, step, allocate), "tcp"
            manifest = _expected(reply.manifest, rank, step, conn.peer)
            view = allocate(manifest)
            manifest.validate_bounds(len(view))
            start = time.monotonic()
            try:
                with opened(open_within(fabric, uid, 1, rank, manifest.used_bytes)) as link:
                    transport = DeviceTransport(conn, link, deadline_s(manifest.used_bytes))
                    computed = receive_verified(transport, manifest, view, f"pull{rank}")
            except Exception as exc:  # NCCL, CUDA, the watchdog, the holder: TCP takes over
                log.warning(
                    "the pull of rank %d step %d from %s over %s failed (%s: %s); pulling it "
                    "over TCP",
                    rank,
                    step,
                    conn.peer,
                    fabric.name,
                    type(exc).__name__,
                    exc,
                )
                return self._over_tcp(conn, connect, epoch, gen, rank, step, allocate)
            bad = _mismatched(manifest, computed)
            if bad:
                log.error(
                    "the copy of rank %d step %d from %s arrived damaged over %s (crc32c) in "
                    "%d chunk(s), first %s; pulling it again over TCP",
                    rank,
                    step,
                    conn.peer,
                    fabric.name,
                    len(bad),
                    bad[:3],
                )
                return self._over_tcp(conn, connect, epoch, gen, rank, step, allocate)
            took = time.monotonic() - start
            log.info(
                "pulled rank %d step %d from %s over %s: %d bytes in %.3f s (%.2f GB/s)",
                rank,
                step,
                conn.peer,
                fabric.name,
                manifest.used_bytes,
                took,
                manifest.used_bytes / max(took, 1e-9) / 1e9,
            )
            return manifest, fabric.name
        finally:
            conn.close()

    @staticmethod
    def _over_tcp(
        old: Connection,
        connect: Callable[[], Connection],
        epoch: int,
        gen: int,
        rank: int,
        step: int,
        allocate: Allocate,
    ) -> tuple[SnapshotManifest, str]:
        old.close()  # its stream is wherever the device exchange left it
        conn = connect()
        try:
            return fetch(conn, epoch, gen, rank, step, allocate), "tcp"
        finally:
            conn.close()

    # -- the holder -------------------------------------------------------------------------
    def serve(
        self, msg: FetchDevice, conn: Connection, store: SlotStore, current_epoch: int
    ) -> int:
        """Answer a ``fetch_device``; the bytes sent over the device link (0: declined)."""
        if msg.epoch < current_epoch:
            conn.send_error(
                "stale_epoch", f"fetch of epoch {msg.epoch} after epoch {current_epoch} began"
            )
            return 0
        fabric = self.fabric()
        if fabric is None:
            why = "it runs --transport tcp" if self.mode is TransportMode.TCP else "no CUDA/NCCL"
            conn.send_msg(DeviceDeclined(f"node {self.node}: {why}"))
            return 0
        slot = store.find(msg.gen, msg.rank, msg.step, partial=True)
        if slot is None:
            conn.send_error(
                "missing", f"this agent holds no copy of rank {msg.rank} step {msg.step}"
            )
            return 0
        with slot.lock:
            manifest = slot.manifest
            if manifest is None or manifest.step != msg.step:
                conn.send_error("missing", "the copy was replaced while the request waited")
                return 0
            conn.send_msg(ManifestReply(manifest))
            spans = manifest.byte_ranges()
            try:
                link = open_within(fabric, msg.uid, 0, msg.rank, manifest.used_bytes)
                with opened(link):
                    transport = DeviceTransport(conn, link, deadline_s(manifest.used_bytes))
                    transport.send(slot.segment.view, spans)
            except Exception as exc:
                log.warning(
                    "sending rank %d step %d to %s over %s failed (%s: %s); it pulls over TCP",
                    msg.rank,
                    msg.step,
                    conn.peer,
                    fabric.name,
                    type(exc).__name__,
                    exc,
                )
                conn.close()  # the puller sees the link closed and falls back
                raise PeerUnavailable(f"device link to {conn.peer} failed") from exc
        return sum(b - a for a, b in spans)


def open_within(
    fabric: DeviceFabric, uid: bytes, rank: int, device: int, nbytes: int
) -> DeviceLink:
    """``fabric.open`` on a thread of its own, given up after ``OPEN_TIMEOUT_S`` (its other end
    never came: NCCL's set-up waits for it and cannot be aborted); a link that opens after
    that is closed at once. Raises ``DeviceLinkError`` naming why."""
    done = threading.Event()
    result: list[Any] = []
    abandoned = threading.Event()

    def run() -> None:
        try:
            link = fabric.open(uid, rank, device, nbytes)
        except Exception as exc:
            result.append(exc)
        else:
            result.append(link)
            if abandoned.is_set():
                link.close()
        done.set()

    threading.Thread(target=run, name="peerckpt-link-open", daemon=True).start()
    if not done.wait(OPEN_TIMEOUT_S):
        abandoned.set()
        if done.is_set() and not isinstance(result[0], Exception):
            result[0].close()  # it opened just now; close it all the same
        raise DeviceLinkError(f"the other end did not join the link within {OPEN_TIMEOUT_S} s")
    if isinstance(result[0], Exception):
        raise result[0]
    link: DeviceLink = result[0]
    return link


def receive_verified(
    transport: Transport, manifest: SnapshotManifest, view: memoryview, name: str
) -> list[int]:
    """Receive a copy's bytes into ``view`` through ``transport`` while a thread checksums
    each chunk as it completes; the checksums of the chunks the copy holds, in order."""
    partial = bool(manifest.absent)
    sums = RunningChecksums(manifest.present() if partial else manifest.chunks, view, name=name)
    try:
        transport.recv_into(view, manifest.byte_ranges(), sums.advance)
        return sums.wait()
    finally:
        sums.cancel()


def _reply(conn: Connection) -> ManifestReply | DeviceDeclined:
    header, payload = conn.recv_message()
    raise_if_error(header, conn.peer)
    reply: Any = from_frame(header, payload, where=conn.peer)
    if not isinstance(reply, ManifestReply | DeviceDeclined):
        raise ProtocolError(f"{conn.peer} answered a fetch_device with {header['type']!r}")
    return reply


def _expected(manifest: SnapshotManifest, rank: int, step: int, peer: str) -> SnapshotManifest:
    if manifest.rank != rank or manifest.step != step:
        raise ProtocolError(
            f"{peer} sent rank {manifest.rank} step {manifest.step} for rank {rank} step {step}"
        )
    return manifest
