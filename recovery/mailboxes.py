"""The events the coordinator streams to agents (``Watch``): one shared log, one mailbox per node.

A broadcast (a new epoch, a commit, the end of the job) is appended once to the hub's log,
encoded once, whatever the number of nodes: the coordinator's work per commit is O(1), and
each node's stream reads the log at its own pace. An event for one node (a resharding
round's reads, its share of a flush) goes to that node's mailbox only. A global sequence
number orders both, so every node sees its events in the order they were published.

Publishers are the coordinator's handlers, on any thread; readers are the streams, on the
RPC server's event loop (``Mailbox.stream``), or a test draining a mailbox (``get``). The
hub's own lock guards its state; a reader waits on an asyncio future that a publisher on
another thread resolves through ``call_soon_threadsafe``. It must never block on the
network or hold the lock while waking a reader.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from peerckpt.codec import pack
from peerckpt.messages import encode

TRIM_MIN = 1024  # the log is trimmed when it is longer than this and twice what it was


@dataclass(frozen=True, slots=True)
class _Entry:
    seq: int
    event: Any  # an Event, or None: the end of the stream
    data: bytes  # the event as the stream sends it (packed once)


class EventHub:
    """The log of broadcast events and the mailboxes reading it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._log: deque[_Entry] = deque()
        self._start = 0  # the index (since the hub began) of ``_log[0]``
        self._trim_at = TRIM_MIN
        self._readers: set[Mailbox] = set()  # mailboxes that may still read the log
        self._waiting: dict[Mailbox, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def mailbox(self) -> Mailbox:
        """A mailbox that receives every broadcast from now on."""
        with self._lock:
            box = Mailbox(self, self._start + len(self._log))
            self._readers.add(box)
            return box

    def broadcast(self, event: Any) -> None:
        """Send ``event`` to every open mailbox: one entry in the log, whatever their number."""
        data = pack(encode(event))
        with self._lock:
            self._seq += 1
            self._log.append(_Entry(self._seq, event, data))
            if len(self._log) > self._trim_at:
                self._trim()
            waiters = list(self._waiting.values())
            self._waiting.clear()
        self._wake(waiters)

    def _send(self, box: Mailbox, event: Any) -> None:
        data = b"" if event is None else pack(encode(event))
        with self._lock:
            if box._closed:
                return
            self._seq += 1
            box._own.append(_Entry(self._seq, event, data))
            if event is None:  # the end: it reads nothing after this
                box._closed = True
                box._until = self._seq
                self._readers.discard(box)
            waiter = self._waiting.pop(box, None)
        if waiter is not None:
            self._wake([waiter])

    def _detach(self, box: Mailbox) -> None:
        with self._lock:
            box._until = min(box._until, self._seq)
            self._readers.discard(box)

    def _trim(self) -> None:
        """Drop the log entries every reader has read (amortized O(1) per broadcast)."""
        keep = min((box._next for box in self._readers), default=self._start + len(self._log))
        while self._start < keep and self._log:
            self._log.popleft()
            self._start += 1
        self._trim_at = max(TRIM_MIN, 2 * len(self._log))

    def _take(self, box: Mailbox, limit: int) -> list[_Entry]:
        """Up to ``limit`` of ``box``'s next entries, in sequence order. Under the lock."""
        out: list[_Entry] = []
        box._next = max(box._next, self._start)  # a detached box may have lost trimmed ones
        while len(out) < limit:
            i = box._next - self._start
            shared = self._log[i] if i < len(self._log) else None
            if shared is not None and shared.seq > box._until:
                shared = None
            own = box._own[0] if box._own else None
            if own is not None and (shared is None or own.seq < shared.seq):
                out.append(box._own.popleft())
                if own.event is None:
                    break
            elif shared is not None:
                out.append(shared)
                box._next += 1
            else:
                break
        return out

    def _poll(
        self, box: Mailbox, loop: asyncio.AbstractEventLoop, limit: int
    ) -> tuple[list[_Entry], asyncio.Future[None] | None]:
        """``box``'s next entries; none: a future resolved when some arrive."""
        with self._lock:
            if self._loop is not loop:
                self._loop, self._loop_thread = loop, threading.get_ident()
            entries = self._take(box, limit)
            if entries:
                return entries, None
            waiter = loop.create_future()
            self._waiting[box] = waiter
            return [], waiter

    def _forget_waiter(self, box: Mailbox) -> None:
        with self._lock:
            self._waiting.pop(box, None)

    def _wake(self, waiters: list[asyncio.Future[None]]) -> None:
        """Resolve readers' futures: directly on the loop's thread, else through the loop."""
        loop = self._loop
        if not waiters or loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            _resolve(waiters)
        else:
            try:
                loop.call_soon_threadsafe(_resolve, waiters)
            except RuntimeError:  # the loop was closed: the server stopped
                pass


def _resolve(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


class Mailbox:
    """One node's events: the broadcasts since it was made, and those sent to it alone.

    ``put(None)`` ends it: its stream ends after what came before."""

    def __init__(self, hub: EventHub, next_index: int) -> None:
        self._hub = hub
        self._next = next_index  # the next log entry to read
        self._own: deque[_Entry] = deque()
        self._closed = False
        self._until = 1 << 62  # log entries published after this are not for it

    def put(self, event: Any) -> None:
        """Send ``event`` to this node alone; ``None`` ends its stream."""
        self._hub._send(self, event)

    def detach(self) -> None:
        """Receive no broadcast from now on (its node registered again with a new mailbox)."""
        self._hub._detach(self)

    def empty(self) -> bool:
        with self._hub._lock:
            if self._own:
                return False
            i = self._next - self._hub._start
            return not (0 <= i < len(self._hub._log) and self._hub._log[i].seq <= self._until)

    def get(self) -> Any:
        """The next event without waiting (None: the end); ``queue.Empty`` if there is none."""
        with self._hub._lock:
            entries = self._hub._take(self, 1)
        if not entries:
            raise queue.Empty
        return entries[0].event

    async def stream(self, limit: int = 64) -> AsyncIterator[bytes]:
        """The events as packed bytes, as they come, until the end."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                entries, waiter = self._hub._poll(self, loop, limit)
                for entry in entries:
                    if entry.event is None:
                        return
                    yield entry.data
                if waiter is not None:
                    await waiter
        finally:
            self._hub._forget_waiter(self)
