"""A small HTTP server that strangers cannot starve: what ``--metrics-port`` runs on.

``http.server.ThreadingHTTPServer`` gives every connection a thread and waits on it
forever. Held half-sent requests (the audit of 2026-11-27) used up the launcher's file
descriptors — it could no longer start a process — and 79 % of a core. This one bounds what
a peer gets before its request is read:

- a read timeout per receive (``read_s``) and a deadline for the whole request line and
  headers (``request_s``), enforced by the accept loop, which cuts a connection past it;
- at most ``max_conns`` connections: a new one takes the place of the oldest still sending
  its request (a scraper's whole request arrives at once, so it is never that one), or is
  closed at once if every connection is answering;
- HTTP/1.0 only: one request per connection, no idle keep-alive;
- on a loopback address, a ``Host`` header that names loopback (a page elsewhere cannot
  point a browser at it under another name: DNS rebinding).

Its threads are daemon threads of their own, never the launcher's watch loop's.

Call order: ``BoundedHTTPServer((addr, port), Handler, limits)``, ``serve_forever`` on a
thread, ``shutdown`` and ``server_close``. A handler calls ``request_read(self)`` when it
has read the whole request (``do_GET``'s first line), and may call ``host_allowed(self)``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class HttpLimits:
    read_s: float = 2.0  # one receive
    request_s: float = 5.0  # the request line and headers, whole
    max_conns: int = 32


DEFAULT_LIMITS = HttpLimits()


@dataclass(eq=False)
class _Open:
    sock: socket.socket
    since: float
    reading: bool = True


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with the bounds of the module docstring."""

    daemon_threads = True
    # socketserver's default backlog is 5: a flood of connects then waits in SYN retries,
    # and a scraper behind them with it
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}  # id(socket) → its state
        self.cut = 0  # connections cut: past their deadline, or for a newer one
        super().__init__(address, handler)
        self.loopback = _is_loopback(address[0])

    # -- admission --------------------------------------------------------------------
    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._open) >= self.limits.max_conns:
                reading = [o for o in self._open.values() if o.reading]
                if not reading:
                    self.cut += 1
                    self.shutdown_request(request)
                    return
                oldest = min(reading, key=lambda o: o.since)
                # cut once, and no longer counted: its thread ends on the shut socket
                del self._open[id(oldest.sock)]
                self.cut += 1
                _shut(oldest.sock)
            self._open[id(request)] = _Open(request, time.monotonic())
        request.settimeout(self.limits.read_s)
        try:
            super().process_request(request, client_address)
        except Exception:  # no thread could start: this one only is dropped
            self._forget(request)
            self.shutdown_request(request)

    def request_read(self, request: Any) -> None:
        """The request is in: it is answered, never cut for a newcomer."""
        with self._lock:
            entry = self._open.get(id(request))
            if entry is not None:
                entry.reading = False

    def close_request(self, request: Any) -> None:
        self._forget(request)
        super().close_request(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._open.pop(id(request), None)

    def service_actions(self) -> None:
        """Called by ``serve_forever`` between polls: cut requests past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [
                o
                for o in self._open.values()
                if o.reading and now - o.since > self.limits.request_s
            ]
            for entry in late:
                del self._open[id(entry.sock)]
                self.cut += 1
        for entry in late:
            _shut(entry.sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that went away (or was cut) mid-answer is not an error worth a traceback
        on the launcher's terminal; anything else is logged by ``socketserver``."""
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)


def host_allowed(handler: BaseHTTPRequestHandler) -> bool:
    """Whether the request's ``Host`` names this server acceptably: any, unless the server
    listens on loopback, where only a loopback name or address is."""
    server = handler.server
    if not getattr(server, "loopback", False):
        return True
    host = (handler.headers.get("Host") or "").strip()
    if host.startswith("["):  # [::1]:port
        name = host[1 : host.find("]")] if "]" in host else host
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return name == "localhost" or _is_loopback(name)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
