"""The rendezvous store's door (``peerckpt/storegate.py``): the relay admits only sockets of
the job's user, matched by the exact connection, and carries bytes through the gate."""

from __future__ import annotations

import os
import socket
import threading

from peerckpt.storegate import StoreGate, StoreRelay, _tcp_owner

SECRET = b"g" * 32
JOB = "gate"


def _pair(family: int, host: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.create_server((host, 0), family=family)
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    return server, client, accepted


def test_the_owner_is_read_from_the_exact_connection() -> None:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        server, client, accepted = _pair(family, host)
        try:
            peer, mine = accepted.getpeername()[:2], accepted.getsockname()[:2]
            assert _tcp_owner(peer, mine) == os.getuid()
            # the same client port, another remote end: not this connection (matching the
            # first row with the client's port admitted other users' connections)
            assert _tcp_owner(peer, (mine[0], (mine[1] % 60000) + 1)) is None
        finally:
            for sock in (client, accepted, server):
                sock.close()


def test_a_rank_reaches_the_store_through_its_relay_and_the_gate() -> None:
    store = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def echo() -> None:
        conn, _ = store.accept()
        with conn:
            while not stop.is_set() and (data := conn.recv(4096)):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    gate = StoreGate(SECRET, JOB, "127.0.0.1", 0, store.getsockname()[1])
    gate.start()
    relay = StoreRelay(SECRET, JOB, f"127.0.0.1:{gate.port}")
    relay.start()
    try:
        host, _, port = relay.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10.0) as rank:
            rank.sendall(b"set key value")
            got = b""
            while len(got) < 13:
                got += rank.recv(4096)
            assert got == b"set key value"
    finally:
        stop.set()
        relay.stop()
        gate.stop()
        store.close()
        thread.join(timeout=5.0)
