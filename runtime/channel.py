"""The rank's link to its node agent: requests with replies, notices, and pushed events.

One authenticated Unix-socket connection per rank process. A reader thread routes ``reply``
frames to the waiting request and every other frame (``abort``, ``epoch``, ``commit``,
``shutdown``) to the runtime's event handler. If the link closes, the handler gets
``{"type": "agent_lost"}``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from peerckpt import errors
from peerckpt.codec import pack, unpack
from peerckpt.errors import PeerckptError, PeerUnavailable
from peerckpt.wire import connect_unix

log = logging.getLogger("peerckpt.channel")
HEARTBEAT_S = 0.25  # how often a rank process tells its agent it is alive


class AgentChannel:
    """Client end of a rank's control link."""

    def __init__(
        self,
        socket_path: str,
        secret: bytes,
        job: str,
        role: str,
        rank: int | None,
        on_event: Callable[[dict[str, Any]], None],
        replicas: int | None = None,
        persist: dict[str, Any] | None = None,
    ) -> None:
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._closing = False
        self.conn = connect_unix(
            socket_path,
            secret,
            job,
            role=role,
            pid=os.getpid(),
            rank=rank,
            replicas=replicas,
            persist=persist,
        )
        self._reader = threading.Thread(target=self._read, name="peerckpt-agent-link", daemon=True)
        self._reader.start()
        self._beater = threading.Thread(target=self._beat, name="peerckpt-heartbeat", daemon=True)
        self._beater.start()

    def request(self, kind: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for its reply; raise the agent's error if it refused."""
        req = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            self._pending[req] = future
        try:
            self.conn.send({"type": kind, "req": req, **fields})
            reply = future.result(timeout=timeout)
        finally:
            with self._lock:
                self._pending.pop(req, None)
        if "error" in reply:
            cls_name, _, message = reply["error"].partition(": ")
            cls = getattr(errors, cls_name, PeerckptError)
            raise cls(message)
        return reply

    def notify(self, kind: str, body: Any = None, **fields: Any) -> None:
        """Send a notice (no reply). ``body`` travels msgpack-encoded as the payload."""
        payload = pack(body) if body is not None else None
        self.conn.send({"type": kind, **fields}, payload)

    def expect_close(self) -> None:
        """The agent is about to close the link (the job ended); that is not a failure."""
        self._closing = True

    def close(self) -> None:
        self._closing = True
        self.conn.close()
        self._reader.join(timeout=2.0)
        self._beater.join(timeout=2.0)

    def _beat(self) -> None:
        while not self._closing and not self.conn.closed:
            try:
                self.conn.send({"type": "hb"})
            except PeerckptError:
                return  # the reader sees the link close and reports it
            time.sleep(HEARTBEAT_S)

    def _read(self) -> None:
        try:
            while True:
                header, payload = self.conn.recv_message()
                if payload:
                    header["body"] = unpack(payload)
                if header["type"] == "reply":
                    with self._lock:
                        future = self._pending.get(header["req"])
                    if future is not None:
                        future.set_result(header)
                else:
                    self._on_event(header)
        except PeerckptError as exc:
            if not self._closing:
                log.warning("link to the node agent closed: %s", exc)
        except OSError as exc:
            if not self._closing:
                log.warning("link to the node agent failed: %s", exc)
        except Exception:  # a bad frame: the link is unusable, which is what agent_lost says
            if not self._closing:
                log.exception("link to the node agent broke on an unexpected message")
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            if not future.done():
                future.set_exception(PeerUnavailable("the node agent went away"))
        if not self._closing:
            self._on_event({"type": "agent_lost"})
