"""In-process agents' data planes (slot store + data server) for transfer tests."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.replication.arena import Arena
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.replication.transfer import DataServer
from peerckpt.states import SlotKind

from ..conftest import job_name


@dataclass
class Peer:
    node: int
    arena: Arena
    store: SlotStore
    server: DataServer
    epoch: int = 0
    committed: int | None = None


@pytest.fixture
def job() -> tuple[str, bytes]:
    return job_name(), secrets.token_bytes(32)


@pytest.fixture
def peers(job: tuple[str, bytes]) -> Iterator[list[Peer]]:
    """Three nodes' data planes on loopback; all of their segments removed afterwards."""
    name, secret = job
    made = []
    for node in range(3):
        arena = Arena(name, node)
        store = SlotStore(arena)
        peer = Peer(node, arena, store, None)  # type: ignore[arg-type]
        peer.server = DataServer(
            store, secret, name, lambda p=peer: p.epoch, lambda p=peer: p.committed
        )
        peer.server.start()
        made.append(peer)
    yield made
    for peer in made:
        peer.server.stop()
        peer.arena.destroy()


def write_snapshot(
    store: SlotStore, rank: int, step: int, index: int = 0, size: int = 3 << 20
) -> Slot:
    """Fill own slot ``index`` of ``rank`` with recognisable bytes and a checksummed manifest."""
    payload = bytes((i * 7 + step) % 251 for i in range(size))
    chunks = (
        ChunkRecord("w", "uint8", (size - 100,), (0,), (size - 100,), 0, size - 100),
        ChunkRecord("__meta__", "uint8", (100,), (0,), (100,), size - 100, 100),
    )
    slot = store.ensure(SlotKind.OWN, 0, rank, index, size)
    slot.segment.view[:size] = payload
    slot.manifest = SnapshotManifest(rank, step, 0, chunks, size).with_checksums(slot.segment.view)
    return slot
