"""The agent's control socket: one authenticated Unix-socket link per local rank process.

A rank (or spare) connects once, proves the job secret and says who it is (role, pid, rank).
Requests that carry ``req`` get a ``reply`` with the same id; everything else is a notice.
The agent pushes events (``abort``, ``epoch``, ``commit``, ``shutdown``) down the same link.
A link that closes means its process is gone. The agent does not wait for that alone: the
socket stays open while children of the process (DataLoader workers) still hold it, so the
process itself is watched too (``replication/exits.py``) and its exit cuts the link at once.

A process also sends ``hb`` frames a few times a second. One that falls silent for longer
than the agent's heartbeat timeout (stopped, frozen) is *fenced*: it is told ``fenced`` (it
reads that when it wakes up, and exits), every frame it sends afterwards is dropped (requests
get an error), and no event reaches it again — so a process declared dead and replaced can
never act in the job again, whatever it was doing when it stopped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from peerckpt.codec import pack, unpack
from peerckpt.errors import PeerckptError, PeerUnavailable
from peerckpt.replication.exits import ExitWatcher
from peerckpt.wire import Connection, server_handshake

log = logging.getLogger("peerckpt.control")


class ProcLink:
    """The agent's end of one rank process's control connection."""

    def __init__(self, conn: Connection, hello: dict[str, Any]) -> None:
        self.conn = conn
        self.pid: int = hello["pid"]
        self.role: str = hello["role"]
        self.rank: int | None = hello.get("rank")
        self.replicas: int | None = hello.get("replicas")
        self.persist: dict[str, Any] | None = hello.get("persist")
        self.last_seen = time.monotonic()
        self.fenced: str | None = None  # why the agent stopped listening to this process

    def __repr__(self) -> str:
        return f"{self.role} pid {self.pid}"

    def send(self, msg: dict[str, Any], body: Any = None) -> bool:
        """Send an event (``body`` travels msgpack-encoded as payload); False if gone."""
        try:
            self.conn.send(msg, pack(body) if body is not None else None)
            return True
        except PeerUnavailable:
            return False


OnMessage = Callable[[ProcLink, dict[str, Any]], "dict[str, Any] | None"]


class ControlServer:
    """Accepts rank processes on a Unix socket and dispatches their messages."""

    def __init__(
        self,
        path: str,
        secret: bytes,
        job: str,
        on_message: OnMessage,
        on_lost: Callable[[ProcLink], None],
    ) -> None:
        self.path = path
        self._secret = secret
        self._job = job
        self._on_message = on_message
        self._on_lost = on_lost
        self._links: dict[int, ProcLink] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._exits = ExitWatcher()
        self._thread = threading.Thread(target=self._accept, name="peerckpt-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._cond:
            links = list(self._links.values())
        for link in links:
            link.conn.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self._exits.stop()

    def link_of(self, pid: int) -> ProcLink | None:
        with self._cond:
            link = self._links.get(pid)
            return link if link is not None and link.fenced is None else None

    def wait_link(self, pid: int, timeout: float) -> ProcLink | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._links and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._links.get(pid)

    def broadcast(self, msg: dict[str, Any]) -> None:
        with self._cond:
            links = [link for link in self._links.values() if link.fenced is None]
        for link in links:
            link.send(msg)

    def links(self) -> list[ProcLink]:
        """Every connected process that is not fenced."""
        with self._cond:
            return [link for link in self._links.values() if link.fenced is None]

    def silent(self, timeout: float) -> list[ProcLink]:
        """Links not fenced yet whose process sent nothing for more than ``timeout`` s."""
        now = time.monotonic()
        with self._cond:
            return [
                link
                for link in self._links.values()
                if link.fenced is None and now - link.last_seen > timeout
            ]

    def fence(self, link: ProcLink, reason: str) -> None:
        """Stop listening to ``link`` for good; tell it why (it reads that when it wakes)."""
        with self._cond:
            if link.fenced is not None:
                return
            link.fenced = reason
        link.send({"type": "fenced", "reason": reason})

    def shutdown_links(self, msg: dict[str, Any], wait_s: float = 0.0) -> None:
        """Tell every process to exit and wait (bounded) for their links to close."""
        self.broadcast({"type": "shutdown", "state": msg.get("state"), "reason": msg.get("reason")})
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._links and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve,
                args=(Connection(sock, "local process"),),
                name="peerckpt-control-link",
                daemon=True,
            ).start()

    def _serve(self, conn: Connection) -> None:
        link = None
        try:
            hello = server_handshake(conn, self._secret, self._job)
            link = ProcLink(conn, hello)
            conn.peer = f"{link.role} pid {link.pid}"
            with self._cond:
                self._links[link.pid] = link
                self._cond.notify_all()
            self._exits.watch(link.pid, functools.partial(_cut, conn))
            # Frames are handled in order on a thread of their own, so that a handler that
            # waits (a report held back by a partition) never stops this thread from reading
            # heartbeats: the process would look hung to its agent.
            inbox: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
            handler = threading.Thread(
                target=self._handle, args=(link, inbox), name="peerckpt-control-handler"
            )
            handler.daemon = True
            handler.start()
            inbox.put({"type": "hello"})
            try:
                while not self._stop.is_set():
                    header, payload = conn.recv_message()
                    link.last_seen = time.monotonic()
                    if header["type"] == "hb":
                        continue
                    if payload:
                        header["body"] = unpack(payload)
                    inbox.put(header)
            finally:
                inbox.put(None)
                handler.join(timeout=5.0)
        except PeerUnavailable:
            pass
        except PeerckptError as exc:
            log.warning("control link %s closed: %s", conn.peer, exc)
        except Exception:
            log.exception("control link %s failed", conn.peer)
        finally:
            conn.close()
            if link is not None:
                self._exits.unwatch(link.pid)
                with self._cond:
                    if self._links.get(link.pid) is link:
                        del self._links[link.pid]
                    self._cond.notify_all()
                self._on_lost(link)

    def _handle(self, link: ProcLink, inbox: queue.SimpleQueue[dict[str, Any] | None]) -> None:
        while (msg := inbox.get()) is not None:
            try:
                if msg["type"] == "hello":
                    self._on_message(link, msg)
                elif link.fenced is not None:
                    self._refuse_fenced(link, msg)
                else:
                    self._dispatch(link, msg)
            except Exception:  # a bug, not the peer's fault: drop the link, as a crash would
                log.exception("handling %r from %s failed", msg.get("type"), link.conn.peer)
                link.conn.close()
                return

    def _refuse_fenced(self, link: ProcLink, msg: dict[str, Any]) -> None:
        log.warning("dropped %r from fenced %r (%s)", msg["type"], link, link.fenced)
        if msg.get("req") is not None:
            link.send(
                {"type": "reply", "req": msg["req"], "error": f"StaleEpoch: fenced: {link.fenced}"}
            )

    def _dispatch(self, link: ProcLink, msg: dict[str, Any]) -> None:
        req = msg.get("req")
        try:
            reply = self._on_message(link, msg)
        except PeerckptError as exc:
            if req is None:
                log.warning("notice %s from %s refused: %s", msg["type"], link.conn.peer, exc)
                return
            link.send({"type": "reply", "req": req, "error": f"{type(exc).__name__}: {exc}"})
            return
        if req is not None:
            link.send({"type": "reply", "req": req, **(reply or {})})


def _cut(conn: Connection) -> None:
    """The process at the other end exited: end the link's reads now (its children may still
    hold the socket open). Only shut down here; the link's own thread closes it."""
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)
