"""How a recovery pull's bytes travel from a holder agent to the puller: the ``Transport``
seam, its TCP and device (NCCL) implementations, and the choice between them.

A pull is one exchange on the agents' authenticated data link (``replication/devicepull.py``
draws it); a transport moves only the bulk bytes of the copy, the byte spans of a slot that
its manifest names, front to back::

    holder:  transport.send(view, spans)
    puller:  transport.recv_into(view, spans, progress)   # progress(n): bytes before n are final

* ``TcpTransport``: data frames on the data link itself (``send_bytes``/``recv_bytes`` of
  ``replication/transfer.py``, unchanged).
* ``DeviceTransport``: the spans cut into pieces of ``link.piece_bytes`` that travel over a
  ``DeviceLink`` (NCCL through CuPy, ``replication/nccl.py``; a fake in tests) through
  ``link.depth`` staging buffers on each end, so that staging piece i+1 overlaps sending piece
  i and the puller's copy out of piece i overlaps receiving piece i+1. The data link carries
  only the ``end`` frame, once the holder's last piece is out. Nothing on the device is
  trusted: the puller checksums every chunk on the host (crc32c, as over TCP) before the copy
  is accepted.

A device link can hang where a socket would time out (a peer that died inside NCCL), so a
``_Watchdog`` aborts it past its deadline, or a grace period after the data link became
readable while pieces were still due (during the pieces the peer writes to the data link only
to end or to leave).

Choosing (``choose``): ``tcp`` is always TCP; ``nccl`` and ``auto`` use a device link when both
ends can open one (CuPy importable with NCCL, a CUDA device), TCP otherwise: a recovery is never
refused for want of its fast path (``peerckpt run --transport nccl`` checks the launcher's host
before anything starts: ``nccl.check_transport``, called by ``launch/cli.py``).
"""

from __future__ import annotations

import enum
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from peerckpt.errors import ConfigurationError, PeerckptError
from peerckpt.messages.data import End
from peerckpt.replication.transfer import recv_bytes, send_bytes
from peerckpt.wire import Connection

ENV = "PEERCKPT_TRANSPORT"  # ``peerckpt run --transport``, inherited by every agent it starts
GRACE_S = 5.0  # how long pieces may still be due once the peer spoke on the data link
MIN_RATE = 50e6  # bytes/s no device link falls below: a pull's deadline grows with its size
BASE_DEADLINE_S = 30.0  # the link's set-up and first piece

Spans = list[tuple[int, int]]


class TransportMode(enum.Enum):
    """``peerckpt run --transport``: how recovery pulls travel."""

    TCP = "tcp"
    NCCL = "nccl"
    AUTO = "auto"


class DeviceLinkError(PeerckptError):
    """A device link failed or was aborted; the pull falls back to TCP."""


class Transport(Protocol):
    """Moves a copy's bytes, the ``spans`` of a slot's ``view``, from holder to puller.

    The holder calls ``send`` once; the puller ``recv_into`` once, on a view of the same size;
    both then close the exchange on the data link as its protocol says."""

    name: str

    def send(self, view: memoryview, spans: Spans) -> None:
        """Send ``view``'s bytes in ``spans`` (ascending), front to back."""
        ...

    def recv_into(self, view: memoryview, spans: Spans, progress: Callable[[int], None]) -> None:
        """Receive them into ``view``; ``progress(n)`` once the bytes before ``n`` are final."""
        ...


class DeviceLink(Protocol):
    """One end of a point-to-point device link with ``depth`` (≥ 2) staging buffers of
    ``piece_bytes`` each; buffer ``b`` of piece i is ``i % depth``.

    Call order, holder (rank 0 of the link): per piece ``put(b, piece)`` then ``send(b, n)``;
    then ``finish()``. Puller (rank 1): ``recv(0, n0)``; per piece i, ``recv`` of piece i+1
    (if any) then ``take(b, dst)``; then ``finish()``. Both ``close()`` always. ``put`` returns
    once ``piece`` may change; ``take`` once ``dst`` holds the bytes. ``abort`` may come from
    another thread: every blocked or later call then raises ``DeviceLinkError``."""

    depth: int
    piece_bytes: int

    def put(self, buf: int, piece: memoryview) -> None: ...

    def send(self, buf: int, nbytes: int) -> None: ...

    def recv(self, buf: int, nbytes: int) -> None: ...

    def take(self, buf: int, dst: memoryview) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class DeviceFabric(Protocol):
    """How an agent opens device links: ``unique_id`` on the puller, which sends it to the
    holder on the authenticated data link; then both ``open`` it (it returns once both
    have)."""

    name: str

    def unique_id(self) -> bytes: ...

    def open(self, uid: bytes, rank: int, device: int, nbytes: int) -> DeviceLink: ...


def choose(mode: TransportMode, here: bool, there: bool) -> str:
    """The transport of one pull: ``"nccl"`` where the mode allows it and both ends can open
    a device link (``here``: this agent, ``there``: the other end), else ``"tcp"``."""
    return "nccl" if mode is not TransportMode.TCP and here and there else "tcp"


def parse_mode(text: str) -> TransportMode:
    try:
        return TransportMode(text)
    except ValueError:
        raise ConfigurationError(
            f"--transport {text!r}: choose tcp, nccl or auto (the default)"
        ) from None


def pieces(spans: Spans, piece_bytes: int) -> Spans:
    """``spans`` cut into pieces of at most ``piece_bytes``, in order."""
    return [
        (off, min(off + piece_bytes, stop))
        for start, stop in spans
        for off in range(start, stop, piece_bytes)
    ]


def deadline_s(nbytes: int) -> float:
    """How long a device pull of ``nbytes`` may take before its link is aborted."""
    return BASE_DEADLINE_S + nbytes / MIN_RATE


class TcpTransport:
    """The bytes as data frames on the data link (the transfer protocol's own)."""

    name = "tcp"

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, view: memoryview, spans: Spans) -> None:
        used = spans[-1][1] if spans else 0
        send_bytes(self.conn, view, used, ranges=spans)

    def recv_into(self, view: memoryview, spans: Spans, progress: Callable[[int], None]) -> None:
        used = spans[-1][1] if spans else 0
        recv_bytes(self.conn, view, used, progress, ranges=spans)


class DeviceTransport:
    """The bytes over a device link, pipelined through its staging buffers; ``end`` on the
    data link once the holder's last piece is out."""

    name = "nccl"

    def __init__(self, conn: Connection, link: DeviceLink, deadline: float) -> None:
        if link.depth < 2:
            raise ValueError("a device link needs at least two staging buffers to pipeline")
        self.conn, self.link, self.deadline = conn, link, deadline

    def send(self, view: memoryview, spans: Spans) -> None:
        link = self.link
        with _Watchdog(link, self.conn, self.deadline):
            for i, (start, stop) in enumerate(pieces(spans, link.piece_bytes)):
                link.put(i % link.depth, view[start:stop])
                link.send(i % link.depth, stop - start)
            link.finish()
        self.conn.send_msg(End())

    def recv_into(self, view: memoryview, spans: Spans, progress: Callable[[int], None]) -> None:
        link = self.link
        cut = pieces(spans, link.piece_bytes)
        with _Watchdog(link, self.conn, self.deadline):
            if cut:
                link.recv(0, cut[0][1] - cut[0][0])
            for i, (start, stop) in enumerate(cut):
                if i + 1 < len(cut):  # the next piece travels while this one is copied out
                    link.recv((i + 1) % link.depth, cut[i + 1][1] - cut[i + 1][0])
                link.take(i % link.depth, view[start:stop])
                progress(stop)
            link.finish()
        self.conn.recv_msg(End)


class _Watchdog:
    """Aborts ``link`` past ``deadline`` seconds, or ``GRACE_S`` after ``conn`` became
    readable (the peer ended or left) while this end is still inside the link. Raises
    ``DeviceLinkError`` naming why when the guarded block failed after an abort."""

    def __init__(self, link: DeviceLink, conn: Connection, deadline: float) -> None:
        self._link, self._conn, self._deadline = link, conn, deadline
        self._done = threading.Event()
        self.fired: str | None = None
        self._thread = threading.Thread(target=self._run, name="peerckpt-link-watch", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._done.set()
        self._thread.join(timeout=2.0)
        if exc is not None and self.fired is not None:
            raise DeviceLinkError(f"the device link was aborted: {self.fired}") from exc

    def _run(self) -> None:
        end = time.monotonic() + self._deadline
        spoke: float | None = None
        while not self._done.is_set():
            now = time.monotonic()
            if now > end:
                self._abort(f"no end after {self._deadline:.0f} s")
                return
            if spoke is not None and now - spoke > GRACE_S:
                self._abort(f"the peer ended or left the data link {GRACE_S:.0f} s ago")
                return
            if spoke is None and _readable(self._conn, 0.05):
                spoke = now
            elif spoke is not None:
                self._done.wait(0.05)

    def _abort(self, why: str) -> None:
        self.fired = why
        self._link.abort()


def _readable(conn: Connection, timeout: float) -> bool:
    try:
        ready, _, _ = select.select([conn.sock], [], [], timeout)
    except (OSError, ValueError):  # closed under us: the peer left
        return True
    return bool(ready)


@contextmanager
def opened(link: DeviceLink) -> Iterator[DeviceLink]:
    """``link``, closed whatever happens."""
    try:
        yield link
    finally:
        link.close()
