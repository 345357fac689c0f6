"""One socket server for every listener of peerckpt: accept, serve each connection on its own
thread, close them all on ``stop``.

The agent's ``ControlServer`` (rank links, a Unix socket) and ``DataServer`` (peer agents,
TCP) are both one of these with their own ``serve(conn)``. The accept loop survives any
error of a single connection (a refused handshake, a failed thread start): it logs one line
and goes on accepting, so one bad peer never locks the legitimate ones out.

Call order: ``Listener(sock, …)`` on a bound, listening socket; ``start()``; ``stop()``
(idempotent), which closes the socket and every connection still served, and joins the
accept thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from peerckpt.faults import NetHooks
from peerckpt.wire import Connection

log = logging.getLogger("peerckpt.serving")


class Listener:
    """Accepts connections on ``sock`` and runs ``serve(conn)`` for each on its own thread.

    ``serve`` owns the connection while it runs; the listener closes it afterwards and on
    ``stop``. ``name`` names the threads; ``tcp``: set TCP_NODELAY on accepted sockets.
    """

    def __init__(
        self,
        sock: socket.socket,
        serve: Callable[[Connection], None],
        name: str,
        peer: str = "",
        tcp: bool = False,
        net: NetHooks | None = None,
    ) -> None:
        self._sock = sock
        self._serve = serve
        self._name = name
        self._peer = peer
        self._tcp = tcp
        self._net = net
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                log.warning("%s: accept failed; still listening", self._name, exc_info=True)
                self._stop.wait(0.05)
                continue
            conn = None
            try:
                if self._tcp:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = Connection(sock, self._peer, net=self._net)
                with self._lock:
                    self._conns.add(conn)
                threading.Thread(
                    target=self._run, args=(conn,), name=f"{self._name}-conn", daemon=True
                ).start()
            except Exception as exc:  # e.g. no thread could be started: drop this one only
                log.warning("%s: could not serve a connection: %s", self._name, exc)
                if conn is not None:
                    with self._lock:
                        self._conns.discard(conn)
                with contextlib.suppress(OSError):
                    sock.close()

    def _run(self, conn: Connection) -> None:
        try:
            self._serve(conn)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
