"""Recovery pulls through the Transport seam, the device (NCCL) path on a fake fabric: pieces
over socket pairs instead of GPUs, so that the pipelining, the checksums and every fallback
run on CPU. ``tests/gpu/test_nccl_pull.py`` runs the CuPy fabric itself on a GPU."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.replication import devicepull, transport
from peerckpt.replication.devicepull import DevicePulls
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.replication.transport import (
    DeviceLinkError,
    DeviceTransport,
    TcpTransport,
    TransportMode,
    choose,
    parse_mode,
    pieces,
)
from peerckpt.states import SlotKind
from peerckpt.wire import Connection, connect_tcp

from .conftest import write_snapshot


# -- a fake fabric ----------------------------------------------------------------------------
@dataclass
class Faults:
    """What a fake link does wrong: fail to open, flip a byte of a piece, hang in a send."""

    fail_open: bool = False
    hang_open: threading.Event | None = None  # open blocks until it is set
    corrupt_piece: int | None = None
    hang_piece: int | None = None
    opened: list[int] = field(default_factory=list)  # ranks that opened a link


class FakeLink:
    """A device link whose 'device buffers' are bytearrays and whose wire a socket pair."""

    depth = 2

    def __init__(self, sock: socket.socket, rank: int, piece_bytes: int, faults: Faults) -> None:
        self.sock, self.rank, self.piece_bytes, self.faults = sock, rank, piece_bytes, faults
        self.bufs = [bytearray(piece_bytes) for _ in range(self.depth)]
        self.sent = 0
        self.aborted = threading.Event()
        self.calls: list[tuple[str, int]] = []

    def put(self, buf: int, piece: memoryview) -> None:
        self.calls.append(("put", buf))
        self.bufs[buf][: len(piece)] = piece

    def send(self, buf: int, nbytes: int) -> None:
        self.calls.append(("send", buf))
        if self.sent == self.faults.hang_piece:
            self.aborted.wait()
            raise DeviceLinkError("aborted while hung")
        data = bytearray(self.bufs[buf][:nbytes])
        if self.sent == self.faults.corrupt_piece:
            data[nbytes // 2] ^= 0x40  # in transit: the holder's slot stays intact
        self.sent += 1
        self.sock.sendall(data)

    def recv(self, buf: int, nbytes: int) -> None:
        self.calls.append(("recv", buf))
        view, got = memoryview(self.bufs[buf]), 0
        while got < nbytes:
            n = self.sock.recv_into(view[got:nbytes])
            if n == 0:
                raise DeviceLinkError("the fake link closed")
            got += n

    def take(self, buf: int, dst: memoryview) -> None:
        self.calls.append(("take", buf))
        dst[:] = self.bufs[buf][: len(dst)]

    def finish(self) -> None:
        if self.aborted.is_set():
            raise DeviceLinkError("aborted")

    def abort(self) -> None:
        self.aborted.set()
        self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


class FakeFabric:
    """Links by rendezvous id: the first end to open one makes its socket pair."""

    name = "nccl"

    def __init__(self, piece_bytes: int = 4096, faults: Faults | None = None) -> None:
        self.piece_bytes = piece_bytes
        self.faults = faults or Faults()
        self._pairs: dict[bytes, tuple[socket.socket, socket.socket]] = {}
        self._lock = threading.Lock()
        self._count = 0
        self.links: list[FakeLink] = []

    def unique_id(self) -> bytes:
        with self._lock:
            self._count += 1
            return self._count.to_bytes(8, "little")

    def open(self, uid: bytes, rank: int, device: int, nbytes: int) -> FakeLink:
        self.faults.opened.append(rank)
        if self.faults.fail_open:
            raise DeviceLinkError("ncclCommInitRank failed (injected)")
        if self.faults.hang_open is not None and rank == 0:
            self.faults.hang_open.wait()
        with self._lock:
            pair = self._pairs.setdefault(uid, socket.socketpair())
        link = FakeLink(pair[rank], rank, self.piece_bytes, self.faults)
        self.links.append(link)
        return link


def device_pulls(
    fabric: FakeFabric | None, mode: TransportMode = TransportMode.AUTO
) -> DevicePulls:
    why = "no CUDA device (fake)" if fabric is None else "fake"
    return DevicePulls(mode, lambda: (fabric, why))


# -- snapshots of several dtypes ----------------------------------------------------------------
DTYPES = [("float32", 4), ("bfloat16", 2), ("int64", 8), ("uint8", 1), ("float16", 2)]


def write_mixed(store: SlotStore, rank: int, step: int, seed: int = 0) -> Slot:
    """A snapshot of chunks of several dtypes and odd sizes (none a multiple of a piece),
    64-byte aligned with gaps between them, random bytes, checksummed."""
    rng = np.random.default_rng(seed)
    chunks, off = [], 0
    for i, (dtype, width) in enumerate(DTYPES * 3):
        count = int(rng.integers(1, 9000))
        nbytes = count * width
        chunks.append(ChunkRecord(f"t{i}", dtype, (count,), (0,), (count,), off, nbytes))
        off = (off + nbytes + 63) // 64 * 64
    chunks.append(ChunkRecord("__meta__", "uint8", (77,), (0,), (77,), off, 77))
    used = off + 77
    slot = store.ensure(SlotKind.OWN, 0, rank, 0, used)
    slot.segment.view[:used] = rng.integers(0, 256, used, dtype=np.uint8).tobytes()
    slot.manifest = SnapshotManifest(rank, step, 0, tuple(chunks), used).with_checksums(
        slot.segment.view
    )
    return slot


def _connect(peer: Any, job: tuple[str, bytes]) -> Any:
    name, secret = job
    return lambda: connect_tcp(peer.server.address, secret, name)


def _pull(
    puller: Any, holder: Any, job: tuple[str, bytes], pulls: DevicePulls, rank: int, step: int
):
    """Pull ``rank``'s copy from ``holder`` into an own slot of ``puller``, as obtain does."""
    got: list[Slot] = []

    def allocate(manifest: SnapshotManifest) -> memoryview:
        if not got:
            got.append(puller.store.ensure(SlotKind.OWN, 0, rank, 1, manifest.used_bytes))
        got[0].invalidate()
        return got[0].segment.view

    manifest, how = pulls.pull(_connect(holder, job), 1, 0, rank, step, allocate)
    return got[0], manifest, how


def _same_bytes(a: Slot, b: Slot) -> bool:
    assert a.manifest is not None
    used = a.manifest.used_bytes
    return bytes(a.segment.view[:used]) == bytes(b.segment.view[:used])


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


@pytest.fixture
def nccl_peers(peers, fabric):
    """The three data planes, each serving device pulls on the same fake fabric."""
    for peer in peers:
        peer.epoch = 1
        peer.server.device = device_pulls(fabric)
    return peers


# -- the choice -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "here", "there", "expected"),
    [
        (TransportMode.AUTO, True, True, "nccl"),
        (TransportMode.AUTO, True, False, "tcp"),
        (TransportMode.AUTO, False, True, "tcp"),
        (TransportMode.NCCL, True, True, "nccl"),
        (TransportMode.NCCL, False, True, "tcp"),  # never refused for want of the fast path
        (TransportMode.TCP, True, True, "tcp"),
    ],
)
def test_nccl_is_chosen_only_when_both_ends_have_cuda_and_nccl(mode, here, there, expected):
    assert choose(mode, here, there) == expected


def test_a_transport_mode_outside_the_three_is_refused_naming_them() -> None:
    assert parse_mode("auto") is TransportMode.AUTO
    with pytest.raises(ConfigurationError, match="tcp, nccl or auto"):
        parse_mode("rdma")


def test_pieces_cover_every_span_in_order_and_never_cross_one() -> None:
    spans = [(0, 10), (16, 40), (64, 65)]
    cut = pieces(spans, 8)
    assert cut == [(0, 8), (8, 10), (16, 24), (24, 32), (32, 40), (64, 65)]


# -- bit-exact pulls --------------------------------------------------------------------------
def test_a_pull_over_the_device_link_is_bit_exact_for_every_dtype(nccl_peers, job, fabric) -> None:
    original = write_mixed(nccl_peers[0].store, rank=4, step=9)
    slot, manifest, how = _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 4, 9)
    assert how == "nccl"
    assert manifest == original.manifest
    assert _same_bytes(original, slot)
    assert fabric.faults.opened == [0, 1] or fabric.faults.opened == [1, 0]


def test_the_pipeline_queues_the_next_receive_before_taking_a_piece(nccl_peers, job, fabric):
    write_mixed(nccl_peers[0].store, rank=4, step=9)
    _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 4, 9)
    puller = next(link for link in fabric.links if link.rank == 1)
    holder = next(link for link in fabric.links if link.rank == 0)
    assert puller.calls[:4] == [("recv", 0), ("recv", 1), ("take", 0), ("recv", 0)]
    assert holder.calls[:4] == [("put", 0), ("send", 0), ("put", 1), ("send", 1)]


def test_a_partial_copy_travels_only_its_spans(nccl_peers, job, fabric) -> None:
    full = write_mixed(nccl_peers[0].store, rank=3, step=5)
    assert full.manifest is not None
    partial = full.manifest.without((1, 4))  # a copy lacking two chunks (their twins have them)
    full.manifest = partial
    assert len(partial.byte_ranges()) == 3
    slot, manifest, how = _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 3, 5)
    assert how == "nccl" and manifest.absent == partial.absent
    for a, b in partial.byte_ranges():
        assert bytes(slot.segment.view[a:b]) == bytes(full.segment.view[a:b])


def test_tcp_transport_wraps_the_data_frames_bit_exact(peers, job) -> None:
    original = write_snapshot(peers[0].store, rank=1, step=2, size=100_000)
    a, b = socket.socketpair()
    left, right = Connection(a, "left"), Connection(b, "right")
    spans = [(0, 40_000), (40_064, 100_000)]
    dst = bytearray(100_000)
    seen: list[int] = []
    sender = threading.Thread(target=TcpTransport(left).send, args=(original.segment.view, spans))
    sender.start()
    TcpTransport(right).recv_into(memoryview(dst), spans, seen.append)
    sender.join()
    for x, y in spans:
        assert dst[x:y] == bytes(original.segment.view[x:y])
    assert seen[-1] == 100_000
    left.close()
    right.close()


# -- what goes wrong --------------------------------------------------------------------------
def test_a_chunk_damaged_over_the_device_link_is_detected_and_pulled_again_over_tcp(
    nccl_peers, job, caplog
) -> None:
    fabric = FakeFabric(faults=Faults(corrupt_piece=3))
    for peer in nccl_peers:
        peer.server.device = device_pulls(fabric)
    original = write_mixed(nccl_peers[0].store, rank=2, step=7)
    with caplog.at_level(logging.INFO, logger="peerckpt.transfer"):
        slot, _, how = _pull(nccl_peers[1], nccl_peers[0], job, device_pulls(fabric), 2, 7)
    assert how == "tcp"
    assert "arrived damaged over nccl (crc32c)" in caplog.text
    assert "pulling it again over TCP" in caplog.text
    assert _same_bytes(original, slot)
    assert original.manifest is not None
    assert not original.manifest.bad_chunks(original.segment.view)  # the holder's copy is intact


def test_a_link_that_fails_to_open_falls_back_to_tcp_with_a_warning(nccl_peers, job, caplog):
    fabric = FakeFabric(faults=Faults(fail_open=True))
    for peer in nccl_peers:
        peer.server.device = device_pulls(fabric)
    original = write_mixed(nccl_peers[0].store, rank=6, step=3)
    with caplog.at_level(logging.WARNING, logger="peerckpt.transfer"):
        slot, _, how = _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 6, 3)
    assert how == "tcp" and _same_bytes(original, slot)
    assert "over nccl failed (DeviceLinkError: ncclCommInitRank failed" in caplog.text


def test_a_hung_link_is_aborted_and_the_copy_comes_over_tcp(
    nccl_peers, job, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(transport, "BASE_DEADLINE_S", 0.5)
    monkeypatch.setattr(transport, "GRACE_S", 0.2)
    fabric = FakeFabric(faults=Faults(hang_piece=2))
    for peer in nccl_peers:
        peer.server.device = device_pulls(fabric)
    original = write_mixed(nccl_peers[0].store, rank=5, step=4)
    with caplog.at_level(logging.WARNING, logger="peerckpt.transfer"):
        slot, _, how = _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 5, 4)
    assert how == "tcp" and _same_bytes(original, slot)
    # whichever end's watchdog fired first aborted its link; the other saw it end
    assert "the device link was aborted" in caplog.text
    assert any(link.aborted.is_set() for link in fabric.links)
    assert original.lock.acquire(timeout=2.0)
    original.lock.release()


def test_a_link_whose_other_end_never_joins_is_given_up_for_tcp(
    nccl_peers, job, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(devicepull, "OPEN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(transport, "GRACE_S", 0.2)
    release = threading.Event()
    fabric = FakeFabric(faults=Faults(hang_open=release))
    for peer in nccl_peers:
        peer.server.device = device_pulls(fabric)
    original = write_mixed(nccl_peers[0].store, rank=5, step=4)
    with caplog.at_level(logging.WARNING, logger="peerckpt.transfer"):
        slot, _, how = _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 5, 4)
    release.set()
    assert how == "tcp" and _same_bytes(original, slot)
    assert "did not join the link within" in caplog.text


def test_a_holder_without_cuda_declines_and_the_pull_is_tcp(nccl_peers, job, fabric) -> None:
    nccl_peers[0].server.device = device_pulls(None)
    original = write_mixed(nccl_peers[0].store, rank=1, step=1)
    slot, _, how = _pull(nccl_peers[2], nccl_peers[0], job, device_pulls(fabric), 1, 1)
    assert how == "tcp" and _same_bytes(original, slot)
    assert fabric.faults.opened == []


def test_transport_tcp_never_opens_a_link(nccl_peers, job, fabric) -> None:
    original = write_mixed(nccl_peers[0].store, rank=1, step=1)
    pulls = device_pulls(fabric, TransportMode.TCP)
    slot, _, how = _pull(nccl_peers[2], nccl_peers[0], job, pulls, 1, 1)
    assert how == "tcp" and _same_bytes(original, slot)
    assert fabric.faults.opened == []


def test_a_device_transport_needs_two_buffers_to_pipeline() -> None:
    link = FakeLink(socket.socketpair()[0], 0, 16, Faults())
    link.depth = 1
    with pytest.raises(ValueError, match="two staging buffers"):
        DeviceTransport(None, link, 1.0)  # type: ignore[arg-type, unused-ignore]


def test_transport_nccl_is_refused_before_start_where_cupy_or_cuda_is_missing(monkeypatch):
    from peerckpt.replication import nccl

    monkeypatch.setattr(nccl, "unavailable", lambda: "no CUDA device")
    with pytest.raises(ConfigurationError, match=r"pip install 'peerckpt\[gpu\]'"):
        nccl.check_transport("nccl")
    assert nccl.check_transport("auto") is TransportMode.AUTO  # TCP wherever NCCL is missing
    assert nccl.check_transport("tcp") is TransportMode.TCP


def test_without_cupy_an_agent_has_no_fabric_and_says_why() -> None:
    from peerckpt.replication import nccl

    if nccl.unavailable() is None:
        pytest.skip("this machine can open NCCL links")
    fabric, why = nccl.probe()
    assert fabric is None and "pip install 'peerckpt[gpu]'" in why


def test_a_recovery_obtains_a_peer_copy_over_the_device_link(nccl_peers, job, fabric) -> None:
    from peerckpt.replication.obtain import obtain_committed

    name, secret = job
    original = write_mixed(nccl_peers[0].store, rank=7, step=3)
    got = obtain_committed(
        nccl_peers[2].store,
        2,
        1,
        0,
        rank=7,
        step=3,
        sources=[0],
        connect=lambda n: connect_tcp(nccl_peers[n].server.address, secret, name),
        device=device_pulls(fabric),
    )
    assert got.source == 0 and _same_bytes(original, got.slot)
    assert sorted(fabric.faults.opened) == [0, 1]
    assert got.slot.lock.acquire(timeout=1.0)  # released once the copy is in
    got.slot.lock.release()
