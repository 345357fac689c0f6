"""One socket server for every listener of peerckpt: accept, authenticate under limits, serve
each connection on its own thread, close them all on ``stop``.

The agent's ``ControlServer`` (rank links, a Unix socket) and ``DataServer`` (peer agents,
TCP) are both one of these with their own ``handshake(conn)`` and ``serve(conn, hello)``.

Until a peer has proved the job's secret it is a stranger, and a stranger gets little:

- an overall deadline for the whole handshake (TLS included), not a timeout per receive:
  a peer that trickles a byte every few seconds is cut when the deadline passes (5 s);
- at most ``per_source`` connections not yet authenticated from one address (TCP), and
  ``max_pending`` in all: when that is full, a new connection takes the place of the oldest
  pending one — the job's members' addresses (``trusted``) are never the one dropped, and
  are held to no per-source cap, so strangers cannot lock them out (64 silent connections
  used to fill every slot, and a member holding the secret was then refused at accept 94
  times in 114); at most ``max_conns`` in all, authenticated or not;
- small frame headers (``wire.PREAUTH_HEADER_BYTES``), allocated only as their bytes arrive;
- one log line per refused peer, not a traceback, and at most ``log_burst`` lines per
  ``log_every_s``: the rest are counted and summed up in one line.

The accept loop survives any error (a failed accept, a thread that cannot start, a bug in
a handshake): it logs it and goes on accepting, so abuse never locks the legitimate peers out.

Call order: ``Listener(sock, …)`` on a bound, listening socket; ``start()``; ``stop()``
(idempotent), which closes the socket and every connection, pending or served, and joins
the accept thread. This module never decides what a request means.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peerckpt import tls
from peerckpt.faults import NetHooks
from peerckpt.wire import Connection

log = logging.getLogger("peerckpt.serving")

Handshake = Callable[[Connection], dict[str, Any]]


@dataclass(frozen=True)
class Limits:
    """What a listener grants peers that have not authenticated yet."""

    handshake_s: float = 5.0  # the whole handshake, TLS included
    max_pending: int = 64  # connections accepted and not yet authenticated
    per_source: int = 16  # of those, from one address not trusted (TCP only)
    max_conns: int = 1024  # connections in all, authenticated or not
    log_burst: int = 5  # refusal lines per window; the rest are counted
    log_every_s: float = 10.0


class RefusalLog:
    """One warning line per refused peer, at most ``burst`` per ``every_s`` seconds."""

    def __init__(self, name: str, burst: int, every_s: float) -> None:
        self._name, self._burst, self._every = name, burst, every_s
        self._lock = threading.Lock()
        self._window = time.monotonic()
        self._lines = 0
        self.suppressed = 0
        self.refused = 0  # every refusal since the start

    def refused_peer(self, peer: str, why: str) -> None:
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._window >= self._every:
                if self.suppressed:
                    log.warning(
                        "%s: %d more peer(s) refused in the last %.0f s (not logged one by one)",
                        self._name,
                        self.suppressed,
                        now - self._window,
                    )
                self._window, self._lines, self.suppressed = now, 0, 0
            if self._lines >= self._burst:
                self.suppressed += 1
                return
            self._lines += 1
        log.warning("%s: refused %s: %s", self._name, peer, why)


@dataclass(eq=False)
class _Pending:
    """A connection accepted and not yet authenticated."""

    fd: int
    peer: str
    deadline: float
    host: str = ""
    trusted: bool = False
    expired: bool = False  # cut: past its deadline, or its place taken by a newer one
    dropped: bool = False  # its place was taken (logged then)


class Listener:
    """Accepts connections on ``sock``; on a thread per connection authenticates it with
    ``handshake`` (after the TLS handshake when ``tls`` is given) and runs ``serve(conn,
    hello)``.

    ``serve`` owns the connection while it runs; the listener closes it afterwards and on
    ``stop``. ``name`` names the threads; ``tcp``: set TCP_NODELAY on accepted sockets.
    """

    def __init__(
        self,
        sock: socket.socket,
        handshake: Handshake,
        serve: Callable[[Connection, dict[str, Any]], None],
        name: str,
        peer: str = "",
        tcp: bool = False,
        net: NetHooks | None = None,
        limits: Limits = Limits(),
        tls: ssl.SSLContext | None = None,
        trusted: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        """``trusted``: the addresses (hosts, no port) of the job's members now, admitted
        first (``Limits``)."""
        self._sock = sock
        self._handshake = handshake
        self._serve = serve
        self._name = name
        self._peer = peer
        self._tcp = tcp
        self._net = net
        self._tls = tls
        self._trusted = trusted
        self.limits = limits
        self.refusals = RefusalLog(name, limits.log_burst, limits.log_every_s)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: set[_Pending] = set()
        self._conns: set[Connection] = set()
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        # Wake up a few times a second even with nobody connecting, to cut expired handshakes.
        self._sock.settimeout(min(0.25, limits.handshake_s / 4))

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def counts(self) -> tuple[int, int]:
        """(connections pending authentication, connections served)."""
        with self._lock:
            return len(self._pending), len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
            for entry in self._pending:
                _shutdown_fd(entry.fd)
        for conn in conns:
            conn.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self._reap()
                self._accept_one()
            except Exception as exc:  # whatever it was, keep listening
                if self._stop.is_set():
                    return
                log.warning(
                    "%s: accept failed (%s: %s); still listening",
                    self._name,
                    type(exc).__name__,
                    exc,
                )
                self._stop.wait(0.05)

    def _accept_one(self) -> None:
        try:
            sock, addr = self._sock.accept()
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            if self._stop.is_set():
                return
            raise
        peer = self._peer or _addr_name(addr)
        host = _host_of(addr) if self._tcp else ""
        trusted = bool(host) and self._trusted is not None and host in self._trusted()
        with self._lock:
            why = self._admit(host, trusted)
            entry = None
            if why is None:
                deadline = time.monotonic() + self.limits.handshake_s
                entry = _Pending(sock.fileno(), peer, deadline, host, trusted)
                self._pending.add(entry)
        if entry is None:
            sock.close()
            self.refusals.refused_peer(peer, why or "refused")
            return
        try:
            threading.Thread(
                target=self._run, args=(sock, entry), name=f"{self._name}-conn", daemon=True
            ).start()
        except Exception as exc:  # no thread could be started: drop this one only
            self._forget(entry)
            sock.close()
            self.refusals.refused_peer(peer, f"could not serve it: {exc}")

    def _admit(self, host: str, trusted: bool) -> str | None:
        """Why a new connection from ``host`` is refused, or None (making room for it by
        cutting the oldest pending stranger when every slot is taken). Under the lock."""
        live = [e for e in self._pending if not e.expired]
        if len(live) + len(self._conns) >= self.limits.max_conns:
            return "too many connections (listener limit reached)"
        if host and not trusted:
            mine = sum(1 for e in live if e.host == host)
            if mine >= self.limits.per_source:
                return f"too many unauthenticated connections from {host} ({mine})"
        if len(live) < self.limits.max_pending:
            return None
        strangers = [e for e in live if not e.trusted]
        if not strangers:
            return "too many connections awaiting authentication (listener limit reached)"
        oldest = min(strangers, key=lambda e: e.deadline)
        oldest.expired = oldest.dropped = True  # its handshake fails; its thread forgets it
        _shutdown_fd(oldest.fd)
        self.refusals.refused_peer(oldest.peer, "dropped unauthenticated for a newer connection")
        return None

    def _reap(self) -> None:
        """Cut every connection whose handshake outlived its deadline."""
        now = time.monotonic()
        with self._lock:
            for entry in self._pending:
                if not entry.expired and now > entry.deadline:
                    entry.expired = True
                    _shutdown_fd(entry.fd)  # wakes the handshake's blocked receive

    def _forget(self, entry: _Pending) -> None:
        with self._lock:
            self._pending.discard(entry)

    def _run(self, sock: socket.socket, entry: _Pending) -> None:
        conn = None
        try:
            sock.settimeout(self.limits.handshake_s)
            if self._tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            conn = Connection(sock, self._peer, net=self._net)
            hello = self._handshake(conn)
            with self._lock:
                self._pending.discard(entry)
                if entry.expired or self._stop.is_set():
                    raise TimeoutError("the handshake ended after its deadline")
                self._conns.add(conn)
        except Exception as exc:  # a stranger's bytes: one line, no traceback
            with self._lock:
                self._pending.discard(entry)
                expired = entry.expired
            if conn is not None:
                conn.close()
            else:
                sock.close()
            if expired:
                why = f"no authentication within {self.limits.handshake_s:g} s"
            elif isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
                why = tls.refusal(exc)
            else:
                why = _first_line(exc)
            if not self._stop.is_set() and not entry.dropped:
                self.refusals.refused_peer(entry.peer, why)
            return
        try:
            self._serve(conn, hello)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)


def _shutdown_fd(fd: int) -> None:
    """Shut a socket down by its descriptor (the object may be wrapped in TLS by now)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    with contextlib.suppress(OSError):
        dup.shutdown(socket.SHUT_RDWR)
    dup.close()


def _host_of(addr: Any) -> str:
    """The host of a TCP peer address ("" for a Unix socket's)."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else ""


def _addr_name(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr) or "local peer"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
