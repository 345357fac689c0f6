"""Pre-authentication limits of every listener (``peerckpt/serving.py``): a stranger that
trickles bytes, hoards connections, declares huge headers or sends garbage costs little, is
logged in a line and never locks a legitimate peer out."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from peerckpt.serving import Limits, Listener
from peerckpt.wire import MAGIC, Connection, client_handshake, connect_tcp, server_handshake

SECRET = b"s" * 32
JOB = "limits"


class _Echo:
    """What an authenticated peer gets: one frame echoed back."""

    def __init__(self) -> None:
        self.served = 0

    def __call__(self, conn: Connection, hello: dict[str, Any]) -> None:
        header, payload = conn.recv_message()
        self.served += 1
        conn.send({"type": "echo", "n": header["n"]}, payload)


@pytest.fixture
def make_listener() -> Iterator[Any]:
    made: list[Listener] = []

    def make(limits: Limits, sock: Any = None, trusted: Any = None) -> tuple[Listener, str]:
        raw = sock if sock is not None else socket.create_server(("127.0.0.1", 0))
        listener = Listener(
            raw,
            lambda conn: server_handshake(conn, SECRET, JOB),
            _Echo(),
            "test-listener",
            tcp=True,
            limits=limits,
            trusted=trusted,
        )
        listener.start()
        made.append(listener)
        port = raw.getsockname()[1]
        return listener, f"127.0.0.1:{port}"

    yield make
    for listener in made:
        listener.stop()


def _legit_round_trip(addr: str) -> None:
    conn = connect_tcp(addr, SECRET, JOB, io_timeout=5.0)
    try:
        conn.send({"type": "ping", "n": 7}, b"hello")
        header, payload = conn.recv_message()
        assert header["n"] == 7 and payload == b"hello"
    finally:
        conn.close()


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """True if the server closes ``sock`` within ``within`` seconds (reading what it sent)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def _wait_for(condition: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_slow_loris_is_cut_at_the_handshake_deadline(make_listener, caplog) -> None:
    """A byte every 1.5 s kept a connection open forever under a 10 s timeout per receive;
    the deadline covers the whole handshake."""
    listener, addr = make_listener(Limits(handshake_s=3.0))
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    start = time.monotonic()
    sock.recv(4096)  # the challenge
    cut_at = None
    header = b"\x80" * 64  # never a whole frame: the peer just trickles
    frame = struct.pack("!4sI", MAGIC, len(header)) + header
    with caplog.at_level(logging.WARNING, logger="peerckpt.serving"):
        for byte in frame[:8]:  # at most 8 × 1.5 s: bounded
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut_at = time.monotonic() - start
                break
            if _closed_by_server(sock, 1.5):
                cut_at = time.monotonic() - start
                break
        _wait_for(lambda: listener.refusals.refused >= 1)
    sock.close()
    assert cut_at is not None and cut_at < 3.0 + 1.6, f"still open after {cut_at} s"
    assert "no authentication within 3 s" in caplog.text
    _legit_round_trip(addr)


def _silent(host: str, port: int, count: int, source: str) -> list[socket.socket]:
    """``count`` connections from ``source`` that never say a word."""
    return [
        socket.create_connection((host, port), source_address=(source, 0)) for _ in range(count)
    ]


def test_idle_connections_are_capped_per_source_and_never_keep_a_peer_out(make_listener) -> None:
    listener, addr = make_listener(Limits(handshake_s=2.0, max_pending=8, per_source=4))
    host, _, port = addr.rpartition(":")
    idle = _silent(host, int(port), 30, "127.0.0.3")
    try:
        time.sleep(0.5)
        pending, served = listener.counts()
        assert pending <= 4 and served == 0  # one source holds at most its share
        refused = sum(_closed_by_server(s, 0.05) for s in idle[4:])
        assert refused == len(idle) - 4 or listener.refusals.refused >= 26
        _legit_round_trip(addr)  # while they are held: their slots are not the last
        time.sleep(2.5)  # the deadline frees the held slots
        assert listener.counts() == (0, 0)
    finally:
        for s in idle:
            s.close()


def test_strangers_from_many_addresses_cannot_lock_the_members_out(make_listener) -> None:
    """The audit's lock-out: connections that never authenticate filled every pending slot
    and a member holding the secret was refused at accept 94 times in 114. Now a full
    listener drops its oldest stranger for a newcomer, and never a member's connection."""
    listener, addr = make_listener(
        Limits(handshake_s=5.0), trusted=lambda: frozenset({"127.0.0.2"})
    )
    port = int(addr.rpartition(":")[2])
    held: list[socket.socket] = []
    try:
        for i in range(10):  # 200 silent connections from 10 addresses (16 each at most)
            held += _silent("127.0.0.1", port, 20, f"127.0.0.{10 + i}")
        time.sleep(0.3)
        assert listener.counts()[0] <= Limits().max_pending
        for _ in range(20):  # a member gets in every time while they are held
            conn = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
            try:
                wire = Connection(conn, "member")
                client_handshake(wire, SECRET, JOB)
                wire.send({"type": "ping", "n": 1}, b"x")
                assert wire.recv_message()[0]["n"] == 1
            finally:
                conn.close()
        _legit_round_trip(addr)  # a newcomer too: the oldest stranger goes
    finally:
        for s in held:
            s.close()


def test_no_large_allocation_before_authentication(make_listener) -> None:
    """Each stranger declared a 1 MiB header and sent nothing: 200 of them cost 190 MiB."""
    _listener, addr = make_listener(Limits(handshake_s=5.0, max_pending=256))
    host, _, port = addr.rpartition(":")
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        socks = []
        for _ in range(50):
            s = socket.create_connection((host, int(port)))
            s.sendall(struct.pack("!4sI", MAGIC, 1 << 20))
            socks.append(s)
        time.sleep(1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
    assert peak - base < 8 << 20, f"{(peak - base) >> 20} MiB allocated for 50 strangers"
    _legit_round_trip(addr)


class _FailingOnce:
    """A listening socket whose first ``accept`` raises an error that is not an OSError."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.failed = False

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected accept failure")
        return self._sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_the_accept_loop_survives_an_injected_error(make_listener, monkeypatch) -> None:
    raw = socket.create_server(("127.0.0.1", 0))
    failing = _FailingOnce(raw)
    _listener, addr = make_listener(Limits(), sock=failing)
    time.sleep(0.3)
    assert failing.failed
    _legit_round_trip(addr)
    # A thread that cannot start drops that connection only.
    real_start = threading.Thread.start
    calls = {"n": 0}

    def start_once_failing(self: threading.Thread) -> None:
        if self.name == "test-listener-conn" and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    host, _, port = addr.rpartition(":")
    dropped = socket.create_connection((host, int(port)))
    assert _closed_by_server(dropped, 2.0)
    dropped.close()
    monkeypatch.undo()
    _legit_round_trip(addr)


def test_garbage_gets_one_line_per_peer_rate_limited_and_no_traceback(
    make_listener, caplog
) -> None:
    listener, addr = make_listener(Limits(log_burst=3, log_every_s=60.0))
    host, _, port = addr.rpartition(":")
    with caplog.at_level(logging.WARNING, logger="peerckpt.serving"):
        for payload in [
            b"GET / HTTP/1.1\r\n\r\n",
            struct.pack("!4sI", MAGIC, 3) + b"\xc1\xc1\xc1",
        ] * 6:
            s = socket.create_connection((host, int(port)))
            s.sendall(payload)
            _closed_by_server(s, 2.0)
            s.close()
        _wait_for(lambda: listener.refusals.refused >= 12)
    lines = [r for r in caplog.records if r.name == "peerckpt.serving"]
    assert listener.refusals.refused == 12
    assert len(lines) == 3 and listener.refusals.suppressed == 9
    assert all(r.exc_info is None for r in lines)
    assert all("refused 127.0.0.1:" in r.getMessage() for r in lines)
    _legit_round_trip(addr)
