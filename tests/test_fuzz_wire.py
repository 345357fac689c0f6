"""Property-based fuzzing of the wire: the frame decoder and both sides of the handshake.

Whatever bytes a peer sends, the result is a header or the project's own error
(``PeerckptError``): never another exception, never a hang (every read ends at EOF or a
timeout), never an allocation much larger than the bytes that arrived. A short budget runs
in ``make test``; ``@pytest.mark.slow`` runs a long one (``make test-all``).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
import tracemalloc
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerckpt.codec import pack
from peerckpt.errors import PeerckptError
from peerckpt.wire import MAGIC, Connection, client_handshake, server_handshake

SECRET, JOB = b"f" * 32, "fuzz"
SHORT = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.binary(max_size=64),
    st.text(max_size=16),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
)
# Headers that are valid msgpack maps with the fields the handshake looks at, so the fuzzer
# reaches past the decoder into the handshake's own checks.
_headers = st.dictionaries(
    st.sampled_from(["type", "len", "nonce", "mac", "job", "proto", "code", "message", "x"]),
    st.one_of(
        _values,
        st.sampled_from(["auth", "challenge", "welcome", "hello", "error", "other_job", JOB]),
    ),
    max_size=8,
)


def _frame(header: dict[str, Any]) -> bytes:
    encoded = pack(header)
    return struct.pack("!4sI", MAGIC, len(encoded)) + encoded


_streams = st.one_of(
    st.binary(max_size=4096),
    st.lists(_headers, min_size=1, max_size=3).map(lambda hs: b"".join(map(_frame, hs))),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=256)).map(
        lambda t: struct.pack("!4sI", MAGIC, t[0]) + t[1]
    ),
)


def _feed(data: bytes, reader: Callable[[Connection], Any]) -> tuple[Any, int]:
    """Send ``data`` then EOF to ``reader``; return what it returned or raised, and the peak
    bytes it allocated."""
    near, far = socket.socketpair()
    near.settimeout(5.0)  # a bound on every read: a hang fails the test
    drain = threading.Thread(target=lambda: _drain(far), daemon=True)
    try:
        far.sendall(data)
        far.shutdown(socket.SHUT_WR)
        drain.start()
        tracemalloc.start()
        try:
            outcome: Any = reader(Connection(near, "fuzzer"))
        except Exception as exc:
            outcome = exc
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return outcome, peak
    finally:
        near.close()
        far.close()
        drain.join(timeout=5.0)


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def _check(data: bytes, reader: Callable[[Connection], Any]) -> None:
    outcome, peak = _feed(data, reader)
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, PeerckptError), f"{type(outcome).__name__}: {outcome}"
        assert not isinstance(outcome, TimeoutError)
    # msgpack's packer takes a 256 KiB buffer for any message (the challenge): a constant.
    assert peak < 2 * len(data) + (512 << 10), f"{peak} bytes allocated for {len(data)} in"


def _decode(conn: Connection) -> Any:
    return conn.recv_message()


def _server(conn: Connection) -> Any:
    return server_handshake(conn, SECRET, JOB)


def _client(conn: Connection) -> Any:
    client_handshake(conn, SECRET, JOB)


@SHORT
@given(_streams)
def test_frame_decoder_any_bytes(data: bytes) -> None:
    _check(data, _decode)


@SHORT
@given(_streams)
def test_server_handshake_any_bytes(data: bytes) -> None:
    _check(data, _server)


@SHORT
@given(_streams)
def test_client_handshake_any_bytes(data: bytes) -> None:
    _check(data, _client)


def _authenticated(data: bytes) -> bytes:
    """A client's valid ``auth`` frame (for the challenge nonce ``_NONCE``), then ``data``:
    the fuzzer reaches the hello a server reads once the client proved the secret."""
    cnonce = b"c" * 32

    def mac(*parts: bytes) -> bytes:
        return hmac.new(SECRET, b"|".join(parts), hashlib.sha256).digest()

    auth = {
        "type": "auth",
        "len": 0,
        "nonce": cnonce,
        "mac": mac(b"client", _NONCE, cnonce),
        "job": mac(b"job", _NONCE, cnonce, JOB.encode()),
    }
    return _frame(auth) + data


_NONCE = b"n" * 32


@SHORT
@given(_streams)
def test_server_handshake_after_auth_any_bytes(data: bytes) -> None:
    with mock.patch("peerckpt.wire.os.urandom", return_value=_NONCE):
        outcome, _ = _feed(_authenticated(data), _server)
    # Authenticated, the hello may be anything the client says, but never another error.
    assert isinstance(outcome, dict | PeerckptError), f"{type(outcome).__name__}: {outcome}"


def test_the_fuzzers_auth_frame_is_accepted() -> None:
    """The frame above is right: with a hello after it, the handshake passes."""
    with mock.patch("peerckpt.wire.os.urandom", return_value=_NONCE):
        outcome, _ = _feed(
            _authenticated(_frame({"type": "hello", "len": 0, "role": "x"})), _server
        )
    assert isinstance(outcome, dict) and outcome["role"] == "x"


@pytest.mark.slow
@LONG
@given(_streams)
def test_wire_long_fuzz(data: bytes) -> None:
    for reader in (_decode, _server, _client):
        _check(data, reader)
    with mock.patch("peerckpt.wire.os.urandom", return_value=_NONCE):
        outcome, _ = _feed(_authenticated(data), _server)
    assert isinstance(outcome, dict | PeerckptError), f"{type(outcome).__name__}: {outcome}"
