"""The data plane over TLS between two simulated hosts (127.0.0.2 and 127.0.0.3): push and
fetch bit for bit, and a peer holding another job's CA refused with a clear line."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator

import pytest

from peerckpt.errors import AuthenticationError
from peerckpt.replication.arena import Arena
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import DataServer, fetch, push
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp

from ..conftest import job_name
from .conftest import Peer, write_snapshot


@pytest.fixture
def tls_peers(monkeypatch) -> Iterator[tuple[str, bytes, list[Peer]]]:
    monkeypatch.setenv("PEERCKPT_TLS", "on")  # loopback, so TLS must be forced
    name, secret = job_name(), secrets.token_bytes(32)
    made = []
    for node, host in enumerate(("127.0.0.2", "127.0.0.3")):
        arena = Arena(name, node)
        store = SlotStore(arena)
        peer = Peer(node, arena, store, None)  # type: ignore[arg-type]
        peer.server = DataServer(
            store, secret, name, lambda p=peer: p.epoch, lambda p=peer: p.committed, host=host
        )
        peer.server.start()
        made.append(peer)
    yield name, secret, made
    for peer in made:
        peer.server.stop()
        peer.arena.destroy()


def test_push_and_fetch_over_tls_are_bit_exact(tls_peers) -> None:
    name, secret, (a, b) = tls_peers
    slot = write_snapshot(a.store, rank=0, step=5)
    conn = connect_tcp(b.server.address, secret, name, io_timeout=10.0)
    assert conn.sock.version() in ("TLSv1.3", "TLSv1.2")  # encrypted, not plain TCP
    push(conn, 0, 0, 0, None, slot.manifest, slot.segment.view)
    conn.close()
    replica = b.store.find(0, 0, 5)
    assert replica is not None and replica.kind is SlotKind.REPLICA
    used = slot.manifest.used_bytes
    assert bytes(replica.segment.view[:used]) == bytes(slot.segment.view[:used])
    # and back: a recovery pulls it from the buddy into a fresh slot
    a.store.release_where(lambda s: True)
    back = connect_tcp(b.server.address, secret, name, io_timeout=10.0)
    target = a.store.ensure(SlotKind.OWN, 0, 0, 1, used)
    manifest = fetch(back, 0, 0, 0, 5, lambda m: target.segment.view)
    back.close()
    assert manifest.step == 5
    assert bytes(target.segment.view[:used]) == bytes(replica.segment.view[:used])


def test_a_peer_with_another_ca_is_refused_with_a_clear_line(tls_peers, caplog) -> None:
    name, _, (_a, b) = tls_peers
    other = secrets.token_bytes(32)  # another job's secret: another derived CA
    with caplog.at_level(logging.WARNING, logger="peerckpt.serving"):
        with pytest.raises(AuthenticationError, match="not signed by this job's CA"):
            connect_tcp(b.server.address, other, name)
        deadline = time.monotonic() + 2.0
        while "TLS handshake failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    [line] = [r for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert "not signed by this job's CA" in line.getMessage() and line.exc_info is None
