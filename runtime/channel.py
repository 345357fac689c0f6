"""The rank's link to its node agent: requests with replies, notices, and pushed events.

One authenticated Unix-socket connection per rank process, speaking the typed messages of
``peerckpt/messages/local.py``. A reader thread routes each ``Reply`` to the waiting request
and every event (``Abort``, ``EpochStart``, ``Commit``, ``Staging``, ``Shutdown``,
``Fenced``) to the runtime's handler. If the link closes, the handler gets ``AgentLost``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from peerckpt import errors
from peerckpt.errors import PeerckptError, PeerUnavailable, ProtocolError
from peerckpt.messages import Message, decode, encode, from_frame, to_frame
from peerckpt.messages.local import AgentLost, Beat, ProcHello, Reply, ToAgent
from peerckpt.runtime import waits
from peerckpt.wire import connect_unix, peer_pid

M = TypeVar("M")

log = logging.getLogger("peerckpt.channel")
HEARTBEAT_S = 0.25  # how often a rank process tells its agent it is alive


class AgentChannel:
    """Client end of a rank's control link."""

    def __init__(
        self,
        socket_path: str,
        secret: bytes,
        job: str,
        hello: ProcHello,
        on_event: Callable[[Message], None],
        beat: Callable[[], Beat] = Beat,
    ) -> None:
        """``beat`` makes each heartbeat (the rank's live step in it)."""
        self._on_event = on_event
        self._make_beat = beat
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Reply]] = {}
        self._lock = threading.Lock()
        self._closing = False
        assert hello.pid == os.getpid()
        self.conn = connect_unix(socket_path, secret, job, hello=encode(hello))
        self._reader = threading.Thread(target=self._read, name="peerckpt-agent-link", daemon=True)
        self._reader.start()
        self._beater = threading.Thread(target=self._beat, name="peerckpt-heartbeat", daemon=True)
        self._beater.start()

    @property
    def agent_pid(self) -> int | None:
        """The agent process at the other end (its Unix socket's peer credentials)."""
        return peer_pid(self.conn.sock)

    def request(self, msg: ToAgent, answer: type[M], timeout: float = 60.0) -> M:
        """Send a request and wait for its ``answer``; raise the agent's error if it refused."""
        req = next(self._ids)
        future: Future[Reply] = Future()
        with self._lock:
            self._pending[req] = future
        try:
            header, payload = to_frame(msg)
            self.conn.send({**header, "req": req}, payload)
            with waits.waiting():
                reply = future.result(timeout=timeout)
        finally:
            with self._lock:
                self._pending.pop(req, None)
        if reply.error:
            cls = getattr(errors, reply.error, None)
            if not (isinstance(cls, type) and issubclass(cls, PeerckptError)):
                cls = PeerckptError
            raise cls(reply.message)
        return decode(reply.answer, answer, where="the node agent")

    def notify(self, msg: ToAgent) -> None:
        """Send a notice (no reply)."""
        self.conn.send_msg(msg)

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
                self.conn.send_msg(self._make_beat())
            except PeerckptError:
                return  # the reader sees the link close and reports it
            time.sleep(HEARTBEAT_S)

    def _read(self) -> None:
        try:
            while True:
                header, payload = self.conn.recv_message()
                msg = from_frame(header, payload, where="the node agent")
                if isinstance(msg, Reply):
                    with self._lock:
                        future = self._pending.get(msg.req)
                    if future is not None:
                        future.set_result(msg)
                elif isinstance(msg, ToAgent):
                    raise ProtocolError(f"the node agent sent {type(msg).__name__}")
                else:
                    self._on_event(msg)
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
            self._on_event(AgentLost())
