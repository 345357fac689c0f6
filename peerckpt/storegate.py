"""The rendezvous store behind an authenticated door: no rank reaches torch's TCPStore
without the job's secret once a link leaves the host.

torch's ``TCPStore`` (where every epoch's process group meets) has no authentication, and by
default listens on every interface. So the coordinator binds it to one address only (a
socket it binds itself, handed over with ``master_listen_fd``), and:

- when its address is loopback (a job on one host, TLS not forced), ranks connect to it
  there directly, as before;
- otherwise the store listens on the coordinator's loopback only, and a ``StoreGate`` on the
  coordinator's address admits a connection only after the job's HMAC handshake (inside TLS,
  ``peerckpt/tls.py``), then passes bytes both ways. On each node the agent runs a
  ``StoreRelay`` on its loopback, accepting only processes of its own user (checked with the
  kernel's socket table), which dials the gate for each rank. A rank's store address is its
  agent's relay, so the rank itself still speaks plain TCPStore.

::

    rank ──TCPStore──▶ relay (agent, 127.0.0.1) ══TLS + HMAC══▶ gate (coordinator) ──▶ store (127.0.0.1)

This module moves bytes; it never reads what the store holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import ssl
import sys
import threading
from typing import Any

from peerckpt import tls
from peerckpt.errors import AuthenticationError
from peerckpt.serving import Listener
from peerckpt.wire import Connection, connect_tcp, server_handshake

log = logging.getLogger("peerckpt.storegate")
_PIECE = 64 << 10


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` exactly (never a wildcard), for ``master_listen_fd``."""
    return socket.create_server((host, port), backlog=1024)


def tunnelled(host: str) -> bool:
    """Whether ranks reach a store on ``host`` through the gate (else directly)."""
    return tls.wanted(host)


def splice(a: socket.socket, b: socket.socket, stop: threading.Event) -> None:
    """Pass bytes both ways between ``a`` and ``b`` until either side closes (one thread;
    TLS sockets are never read and written from two threads at once)."""
    other = {a.fileno(): b, b.fileno(): a}
    a.setblocking(False)
    b.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ)
        sel.register(b, selectors.EVENT_READ)
        while not stop.is_set():
            ready = [key.fileobj for key, _ in sel.select(timeout=0.5)]
            ready += [s for s in (a, b) if isinstance(s, ssl.SSLSocket) and s.pending()]
            for src in ready:
                assert isinstance(src, socket.socket)
                try:
                    data = src.recv(_PIECE)
                except (ssl.SSLWantReadError, BlockingIOError):
                    continue
                except OSError:
                    return
                if not data:
                    return
                dst = other[src.fileno()]
                dst.settimeout(30.0)  # a peer that stops reading is cut, not waited on forever
                try:
                    dst.sendall(data)
                except OSError:
                    return
                finally:
                    dst.setblocking(False)


class StoreGate:
    """On the coordinator: admits authenticated connections to the loopback store."""

    def __init__(self, secret: bytes, job: str, host: str, port: int, store_port: int) -> None:
        self._store = ("127.0.0.1", store_port)
        self._stop = threading.Event()
        sock = bound_socket(host, port)
        self.port = sock.getsockname()[1]
        self._listener = Listener(
            sock,
            lambda conn: server_handshake(conn, secret, job),
            self._serve,
            "peerckpt-storegate",
            tcp=True,
            tls=tls.server_context(secret) if tls.wanted(host) else None,
        )

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._stop.set()
        self._listener.stop()

    def _serve(self, conn: Connection, hello: dict[str, Any]) -> None:
        with socket.create_connection(self._store, timeout=5.0) as upstream:
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            splice(conn.sock, upstream, self._stop)


class StoreRelay:
    """On an agent: the loopback address its ranks use as the store; each connection is
    carried to the coordinator's gate at ``gate``, authenticated and encrypted."""

    def __init__(self, secret: bytes, job: str, gate: str) -> None:
        self._secret, self._job, self._gate = secret, job, gate
        self._stop = threading.Event()
        sock = bound_socket("127.0.0.1", 0)
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        self._listener = Listener(
            sock, _same_user, self._serve, "peerckpt-storerelay", peer="", tcp=True
        )

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._stop.set()
        self._listener.stop()

    def _serve(self, conn: Connection, hello: dict[str, Any]) -> None:
        upstream = connect_tcp(self._gate, self._secret, self._job)
        try:
            splice(conn.sock, upstream.sock, self._stop)
        finally:
            upstream.close()


def _same_user(conn: Connection) -> dict[str, Any]:
    """Admit a loopback connection only from a socket owned by this process's user."""
    peer = conn.sock.getpeername()
    uid = _tcp_owner(peer[:2], conn.sock.getsockname()[:2])
    if uid != os.getuid():
        raise AuthenticationError(
            f"{peer[0]}:{peer[1]} belongs to uid {uid}, not to this job's user {os.getuid()}"
        )
    return {}


_ESTABLISHED = "01"


def _tcp_owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket whose own address is ``local`` and whose peer is
    ``remote`` (the relay's end of the connection), from the kernel's socket tables: that
    exact connection, established, in either table. (Matching the first row with the peer's
    port, as this did first, admitted another user's connections 131 and 184 times in 1,500
    where a row of theirs came first.)"""
    want = (_proc_addr(*local), _proc_addr(*remote))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if (
                    len(fields) > 7
                    and fields[3] == _ESTABLISHED
                    and (_normal(fields[1]), _normal(fields[2])) == want
                ):
                    return int(fields[7])
    return None


def _proc_addr(ip: str, port: int) -> str:
    """``ip:port`` as the kernel's tables write it, normalised (``_normal``)."""
    packed = socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
    if len(packed) == 16 and packed[:12] == b"\0" * 10 + b"\xff\xff":
        packed = packed[12:]  # an IPv4-mapped address is that IPv4 address
    return f"{packed.hex().upper()}:{port:04X}"


def _normal(entry: str) -> str:
    """A table's ``ADDR:PORT`` with ADDR in network byte order (the tables write each
    32-bit word in host order) and an IPv4-mapped IPv6 address as its IPv4 address."""
    addr, _, port = entry.partition(":")
    raw = bytes.fromhex(addr)
    words = b"".join(
        int.from_bytes(raw[i : i + 4], sys.byteorder).to_bytes(4, "big")
        for i in range(0, len(raw), 4)
    )
    if len(words) == 16 and words[:12] == b"\0" * 10 + b"\xff\xff":
        words = words[12:]
    return f"{words.hex().upper()}:{port.upper()}"


class Relays:
    """The agent's relays, one per gate address, started on first use."""

    def __init__(self, secret: bytes, job: str) -> None:
        self._secret, self._job = secret, job
        self._lock = threading.Lock()
        self._relays: dict[str, StoreRelay] = {}

    def address_for(self, store_addr: str) -> str:
        """The store address a local rank uses for the coordinator's ``store_addr``."""
        if not tunnelled(store_addr.rpartition(":")[0]):
            return store_addr
        with self._lock:
            relay = self._relays.get(store_addr)
            if relay is None:
                relay = self._relays[store_addr] = StoreRelay(self._secret, self._job, store_addr)
                relay.start()
                log.info("store relay on %s for the gate at %s", relay.address, store_addr)
            return relay.address

    def stop(self) -> None:
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.stop()
