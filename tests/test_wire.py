"""The wire protocol: authenticated handshakes and frames checked before they are read."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from peerckpt.errors import AuthenticationError, FrameTooLarge, ProtocolError
from peerckpt.wire import (
    MAGIC,
    PROTOCOL_VERSION,
    Connection,
    client_handshake,
    pack,
    server_handshake,
    unpack,
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
    with pytest.raises(AuthenticationError, match=r"refused job 'job2'.*another job.*--job"):
        client_handshake(client, b"k" * 32, "job2")
    t.join(5)
    assert isinstance(out["error"], AuthenticationError) and "job1" in str(out["error"])
    server.close(), client.close()


def _client_bytes_before_auth(job: str, **fields: object) -> tuple[bytes, dict]:
    """Play a server that never proves the secret: send a challenge, read the client's frame,
    refuse it; return every byte the client sent, and its decoded frame."""
    near, far = socket.socketpair()
    client = Connection(far, "client side")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            client_handshake(client, b"s" * 32, job, **fields)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    t = threading.Thread(target=run)
    server = Connection(near, "server side")
    server.send({"type": "challenge", "nonce": b"n" * 32, "proto": PROTOCOL_VERSION})
    t.start()
    near.settimeout(5.0)
    raw = bytearray(near.recv(8))
    (hlen,) = struct.unpack("!I", raw[4:8])
    while len(raw) < 8 + hlen:
        raw += near.recv(8 + hlen - len(raw))
    frame = unpack(bytes(raw[8:]))
    server.send_error("auth", "refused")
    t.join(5)
    while chunk := near.recv(65536):  # the client closed: read to EOF
        raw += chunk
    near.close()
    assert len(errors) == 1 and isinstance(errors[0], AuthenticationError)
    return bytes(raw), frame


def test_a_client_says_nothing_about_its_job_before_the_server_proves_the_secret() -> None:
    """A listener anyone can reach (or anyone on the path) sees only MACs and fresh nonces."""
    raw, frame = _client_bytes_before_auth(
        "project_orion", role="rank", pid=424242, hello=b"who-i-am"
    )
    for revealing in (b"project_orion", b"orion", b"rank", b"who-i-am", struct.pack("!I", 424242)):
        assert revealing not in raw, f"{revealing!r} sent before authentication"
    assert set(frame) == {"type", "len", "nonce", "mac", "job"}
    # Nothing constant per job either: the job's proof changes with every connection.
    again = _client_bytes_before_auth("project_orion")[1]
    assert len(frame["job"]) == 32 and frame["job"] != again["job"]


def test_a_server_names_no_job_to_a_client_of_another_job() -> None:
    server, client = _pair()
    out: dict = {}
    t = threading.Thread(target=_serve, args=(server, b"k" * 32, "project_vega", out))
    t.start()
    with pytest.raises(AuthenticationError) as info:
        client_handshake(client, b"k" * 32, "job2")
    t.join(5)
    assert "project_vega" not in str(info.value)
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
