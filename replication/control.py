"""The agent's control socket: one authenticated Unix-socket link per local rank process.

A rank (or spare) connects once, proves the job secret and says who it is (``ProcHello``).
Then it sends typed messages (``peerckpt/messages/local.py``): requests that carry a ``req``
id get a ``Reply`` with the same id; everything else is a notice. The agent pushes events
(``Abort``, ``EpochStart``, ``Commit``, ``Shutdown``) down the same link. A link that closes
means its process is gone. The agent does not wait for that alone: the socket stays open while
children of the process (DataLoader workers) still hold it, so the process itself is watched
too (``replication/exits.py``) and its exit cuts the link at once.

A process also sends ``Beat`` frames a few times a second. One that falls silent for longer
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

from peerckpt.errors import PeerckptError, PeerUnavailable, ProtocolError
from peerckpt.messages import Message, decode, encode, from_frame, type_name
from peerckpt.messages.control import Shutdown
from peerckpt.messages.local import Beat, Fenced, ProcHello, Reply, ToAgent
from peerckpt.replication.exits import ExitWatcher
from peerckpt.serving import Listener
from peerckpt.states import ProcRole
from peerckpt.wire import Connection, server_handshake

log = logging.getLogger("peerckpt.control")


class ProcLink:
    """The agent's end of one rank process's control connection."""

    def __init__(self, conn: Connection, hello: ProcHello) -> None:
        self.conn = conn
        self.hello = hello
        self.pid = hello.pid
        self.role: ProcRole = hello.role
        self.rank = hello.rank
        self.last_seen = time.monotonic()
        self.fenced: str | None = None  # why the agent stopped listening to this process
        self.beat = Beat()  # its last heartbeat: the step its loop runs, if any

    def __repr__(self) -> str:
        return f"{self.role.value} pid {self.pid}"

    def send(self, msg: Message) -> bool:
        """Send an event; False if the process is gone."""
        try:
            self.conn.send_msg(msg)
            return True
        except PeerUnavailable:
            return False


# A notice or request from a process; a request's handler returns its answer.
OnMessage = Callable[[ProcLink, ToAgent], "Message | None"]
_HELLO = object()  # the first item of a link's inbox: it said who it is


class ControlServer:
    """Accepts rank processes on a Unix socket and dispatches their messages."""

    def __init__(
        self,
        path: str,
        secret: bytes,
        job: str,
        on_message: OnMessage,
        on_lost: Callable[[ProcLink], None],
        on_hello: Callable[[ProcLink], None],
    ) -> None:
        self.path = path
        self._secret = secret
        self._job = job
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_hello = on_hello
        self._links: dict[int, ProcLink] = {}
        self._cond = threading.Condition()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(64)
        self._exits = ExitWatcher()
        self._listener = Listener(
            sock, self._handshake, self._serve, "peerckpt-control", peer="local process"
        )

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._cond:
            self._cond.notify_all()
        self._exits.stop()

    def link_of(self, pid: int) -> ProcLink | None:
        with self._cond:
            link = self._links.get(pid)
            return link if link is not None and link.fenced is None else None

    def wait_link(self, pid: int, timeout: float) -> ProcLink | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._links and not self._listener.stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._links.get(pid)

    def broadcast(self, msg: Message) -> None:
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
        link.send(Fenced(reason))

    def shutdown_links(self, msg: Shutdown, wait_s: float = 0.0) -> None:
        """Tell every process to exit and wait (bounded) for their links to close."""
        self.broadcast(msg)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._links and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def _handshake(self, conn: Connection) -> dict[str, Any]:
        return server_handshake(conn, self._secret, self._job)

    def _serve(self, conn: Connection, auth: dict[str, Any]) -> None:
        link = None
        try:
            link = ProcLink(conn, decode(auth.get("hello"), ProcHello, where=conn.peer))
            conn.peer = repr(link)
            with self._cond:
                self._links[link.pid] = link
                self._cond.notify_all()
            self._exits.watch(link.pid, functools.partial(_cut, conn))
            # Frames are handled in order on a thread of their own, so that a handler that
            # waits (a report held back by a partition) never stops this thread from reading
            # heartbeats: the process would look hung to its agent.
            inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
            handler = threading.Thread(
                target=self._handle, args=(link, inbox), name="peerckpt-control-handler"
            )
            handler.daemon = True
            handler.start()
            inbox.put(_HELLO)
            try:
                while not self._listener.stopping:
                    header, payload = conn.recv_message()
                    link.last_seen = time.monotonic()
                    msg = from_frame(header, payload, ToAgent, where=conn.peer)
                    if isinstance(msg, Beat):
                        link.beat = msg
                        continue
                    inbox.put((header.get("req"), msg))
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

    def _handle(self, link: ProcLink, inbox: queue.SimpleQueue[Any]) -> None:
        while (item := inbox.get()) is not None:
            name = "hello" if item is _HELLO else type_name(type(item[1]))
            try:
                if item is _HELLO:
                    self._on_hello(link)
                elif link.fenced is not None:
                    self._refuse_fenced(link, *item)
                else:
                    self._dispatch(link, *item)
            except Exception:  # a bug, not the peer's fault: drop the link, as a crash would
                log.exception("handling %r from %s failed", name, link.conn.peer)
                link.conn.close()
                return

    def _refuse_fenced(self, link: ProcLink, req: int | None, msg: ToAgent) -> None:
        log.warning("dropped %r from fenced %r (%s)", type_name(type(msg)), link, link.fenced)
        if req is not None:
            link.send(Reply(req, error="StaleEpoch", message=f"fenced: {link.fenced}"))

    def _dispatch(self, link: ProcLink, req: int | None, msg: ToAgent) -> None:
        if req is not None and not isinstance(req, int):
            raise ProtocolError(f"{link!r} sent a request id {req!r}")
        try:
            reply = self._on_message(link, msg)
        except PeerckptError as exc:
            if req is None:
                log.warning("notice %s from %r refused: %s", type_name(type(msg)), link, exc)
                return
            link.send(Reply(req, error=type(exc).__name__, message=str(exc)))
            return
        if req is not None:
            link.send(Reply(req, answer=encode(reply) if reply is not None else None))


def _cut(conn: Connection) -> None:
    """The process at the other end exited: end the link's reads now (its children may still
    hold the socket open). Only shut down here; the link's own thread closes it."""
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)
