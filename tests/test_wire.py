"""The wire protocol: authenticated handshakes and frames checked before they are read."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from peerckpt.errors import AuthenticationError, FrameTooLarge, ProtocolError
from peerckpt.wire import (
    MAGIC,
    Connection,
    client_handshake,
    pack,
    server_handshake,
)


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a, "server side"), Connection(b, "client side")


def _serve(conn: Connection, secret: bytes, job: str, out: dict) -> None:
    try:
        out["hello"] = server_handshake(conn, secret, job)
    except AuthenticationError as exc:
        out["error"] = exc


def test_handshake_with_the_right_secret_passes_the_client_fields() -> None:
    server, client = _pair()
    out: dict = {}
    t = threading.Thread(target=_serve, args=(server, b"s" * 32, "job1", out))
    t.start()
    client_handshake(client, b"s" * 32, "job1", role="rank", pid=42)
    t.join(5)
    assert out["hello"]["role"] == "rank" and out["hello"]["pid"] == 42
    server.close(), client.close()


def test_wrong_secret_is_refused_on_both_sides_with_a_clear_error() -> None:
    server, client = _pair()
    out: dict = {}
    t = threading.Thread(target=_serve, args=(server, b"right" * 8, "job1", out))
    t.start()
    with pytest.raises(AuthenticationError, match=r"job secret does not match.*PEERCKPT_SECRET"):
        client_handshake(client, b"wrong" * 8, "job1")
    t.join(5)
    assert isinstance(out["error"], AuthenticationError)
    assert "hello" not in out
    server.close(), client.close()


def test_another_jobs_client_is_refused() -> None:
    server, client = _pair()
    out: dict = {}
    t = threading.Thread(target=_serve, args=(server, b"k" * 32, "job1", out))
    t.start()
    with pytest.raises(AuthenticationError, match=r"another job|job 'job1'"):
        client_handshake(client, b"k" * 32, "job2")
    t.join(5)
    server.close(), client.close()


def test_bytes_that_are_not_a_frame_are_a_protocol_error() -> None:
    server, client = _pair()
    client.sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ProtocolError, match="not a peerckpt process"):
        server.recv_header()
    server.close(), client.close()


def test_oversized_header_is_rejected_before_reading_it() -> None:
    server, client = _pair()
    client.sock.sendall(struct.pack("!4sI", MAGIC, 1 << 30))
    with pytest.raises(FrameTooLarge):
        server.recv_header()
    server.close(), client.close()


def test_an_unauthenticated_client_cannot_make_the_server_allocate() -> None:
    """The auth frame may carry no payload; a declared one is refused before allocating it."""
    server, client = _pair()
    header = pack({"type": "auth", "len": 1 << 40})  # a terabyte, if it were allocated
    client.sock.sendall(struct.pack("!4sI", MAGIC, len(header)) + header)
    with pytest.raises(FrameTooLarge):
        server.recv_message(max_payload=0)
    server.close(), client.close()
