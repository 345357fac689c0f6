"""The wire protocol between peerckpt processes: frames and the authenticated handshake.

A frame is ``MAGIC | u32 header length | msgpack header | payload``. The header is a msgpack
map that always has ``type`` and ``len`` (the payload's size in bytes). Bulk bytes are never
msgpack-encoded: the receiver reads the header, checks ``len`` against the destination it
will write to, and only then receives the payload straight into that destination.

Every connection, TCP between agents or a Unix socket between a rank and its agent, starts
with a mutual challenge-response handshake on the job's secret (HMAC-SHA256), so a process
of another job, or one started with the wrong secret, is refused before any request is read.

This module owns the byte format only; it never decides what a request means and never
unpickles anything.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import struct
import threading
from typing import Any, TypeVar

from peerckpt import tls
from peerckpt.codec import pack, unpack
from peerckpt.errors import (
    AuthenticationError,
    ChecksumMismatch,
    FrameTooLarge,
    InsufficientMemory,
    PeerUnavailable,
    ProtocolError,
    StaleEpoch,
)
from peerckpt.faults import NetHooks
from peerckpt.messages import from_frame, to_frame

M = TypeVar("M")

MAGIC = b"PCK1"
PROTOCOL_VERSION = 3  # 2: a push's checksums travel in its end frame; 3: no job name before auth
_PREFIX = struct.Struct("!4sI")
MAX_HEADER_BYTES = 1 << 20
# Before a peer has proved the secret its frames are small (challenge, auth, welcome): a
# stranger may not make a listener allocate more than this per connection.
PREAUTH_HEADER_BYTES = 16 << 10
# Control messages (everything that is not bulk slot bytes) are bounded too.
MAX_CONTROL_PAYLOAD = 64 << 20
_HANDSHAKE_TIMEOUT_S = 10.0
_PIECE = 64 << 10  # a header is read (and its buffer grown) this much at a time


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Receive exactly ``n`` bytes, allocating only as they arrive (a peer that declares a
    large header and sends nothing costs one piece, not ``n`` bytes)."""
    buf = bytearray()
    while len(buf) < n:
        piece = bytearray(min(_PIECE, n - len(buf)))
        recv_into(sock, memoryview(piece), len(piece))
        buf += piece
    return bytes(buf)


def recv_into(sock: socket.socket, dest: memoryview, n: int) -> None:
    """Receive exactly ``n`` bytes into ``dest[:n]``; raises PeerUnavailable on EOF."""
    view = dest[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerUnavailable(f"connection closed by peer after {got} of {n} bytes")
        got += k


class Connection:
    """A socket speaking frames. Sends are serialised by a lock; receives are single-reader.

    ``net``: the fault hooks of the agent's network links (``peerckpt/faults.py``), if any.
    """

    def __init__(self, sock: socket.socket, peer: str = "", net: NetHooks | None = None) -> None:
        self.sock = sock
        self.peer = peer or _peer_name(sock)
        self._send_lock = threading.Lock()
        self.closed = False
        # The largest frame header accepted; the handshake lowers it until the peer is known.
        self.max_header = MAX_HEADER_BYTES
        self._faults = net
        if net is not None:
            net.track(self)

    # -- sending ----------------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes | memoryview | None = None) -> None:
        """Send one frame. ``header['len']`` is set from the payload."""
        header = dict(header)
        header["len"] = 0 if payload is None else len(payload)
        encoded = pack(header)
        prefix = _PREFIX.pack(MAGIC, len(encoded))
        if self._faults is not None:
            self._faults.check(self.peer)
            if payload is not None and self._faults.slowed():
                self._send_slowly(prefix + encoded, payload)
                return
        with self._send_lock:
            try:
                if payload is None or len(payload) < 65536:
                    self.sock.sendall(prefix + encoded + (bytes(payload) if payload else b""))
                else:
                    self.sock.sendall(prefix + encoded)
                    self.sock.sendall(payload)
            except OSError as exc:
                raise PeerUnavailable(f"sending to {self.peer} failed: {exc}") from exc

    def _send_slowly(self, head: bytes, payload: bytes | memoryview) -> None:
        """Send in 256 KiB pieces, each paced by the chaos ``slow`` fault."""
        assert self._faults is not None
        view = memoryview(payload).cast("B")
        with self._send_lock:
            try:
                self.sock.sendall(head)
                for start in range(0, len(view), 1 << 18):
                    piece = view[start : start + (1 << 18)]
                    self._faults.pace(len(piece))
                    self._faults.check(self.peer)
                    self.sock.sendall(piece)
            except OSError as exc:
                raise PeerUnavailable(f"sending to {self.peer} failed: {exc}") from exc

    def send_msg(self, msg: Any, payload: bytes | memoryview | None = None) -> None:
        """Send a typed message; its ``PAYLOAD`` field, if any, as the frame's payload, else
        ``payload`` (raw bytes: a data frame's)."""
        header, packed = to_frame(msg)
        self.send(header, packed if packed is not None else payload)

    def recv_msg(self, expect: type[M], max_payload: int = MAX_CONTROL_PAYLOAD) -> M:
        """Receive a typed control message (an ``error`` frame raises its exception)."""
        header, payload = self.recv_message(max_payload)
        raise_if_error(header, self.peer)
        return from_frame(header, payload, expect, where=self.peer)

    def send_error(self, code: str, message: str) -> None:
        """Tell the peer why its request is refused; best effort (the peer may be gone)."""
        try:
            self.send({"type": "error", "code": code, "message": message})
        except PeerUnavailable:
            pass

    # -- receiving --------------------------------------------------------------------------
    def recv_header(self) -> dict[str, Any]:
        """Read one frame header. The payload, if any, must be consumed by the caller."""
        try:
            magic, hlen = _PREFIX.unpack(_recv_exactly(self.sock, _PREFIX.size))
        except OSError as exc:
            raise PeerUnavailable(f"receiving from {self.peer} failed: {exc}") from exc
        if magic != MAGIC:
            raise ProtocolError(
                f"{self.peer} sent {magic!r} where a peerckpt frame starts; it is not a peerckpt "
                "process of this version (or the stream lost sync)"
            )
        if hlen > self.max_header:
            raise FrameTooLarge(
                f"{self.peer} declared a {hlen}-byte frame header (limit {self.max_header})"
            )
        try:
            raw = _recv_exactly(self.sock, hlen)
        except OSError as exc:
            raise PeerUnavailable(f"receiving from {self.peer} failed: {exc}") from exc
        try:
            header = unpack(raw)
        except Exception as exc:  # msgpack raises a zoo of types; they all mean garbage
            raise ProtocolError(
                f"{self.peer} sent a frame header that is not msgpack ({type(exc).__name__})"
            ) from None
        if self._faults is not None:
            self._faults.check(self.peer)
        if not isinstance(header, dict) or "type" not in header or "len" not in header:
            raise ProtocolError(f"{self.peer} sent a frame header without 'type' and 'len'")
        if not isinstance(header["len"], int) or header["len"] < 0:
            raise ProtocolError(f"{self.peer} sent a frame with a bad length {header['len']!r}")
        return header

    def recv_payload_into(self, header: dict[str, Any], dest: memoryview) -> None:
        """Receive the frame's payload into ``dest``, after checking that it fits.

        The check happens before a single payload byte is read, so an oversized frame cannot
        write past its destination; the connection is then closed, since the stream cannot be
        resynchronised without reading the bytes.
        """
        n = header["len"]
        if n > len(dest):
            self.send_error(
                "frame_too_large",
                f"frame declares {n} bytes but its destination holds {len(dest)}",
            )
            self.close()
            raise FrameTooLarge(
                f"{self.peer} sent a {header['type']!r} frame of {n} bytes for a destination of "
                f"{len(dest)} bytes; refused before reading it. The sender's snapshot layout "
                "does not match the slot it targets (stale epoch or a bug in the sender)."
            )
        try:
            recv_into(self.sock, dest, n)
        except OSError as exc:
            raise PeerUnavailable(f"receiving from {self.peer} failed: {exc}") from exc

    def recv_message(self, max_payload: int = MAX_CONTROL_PAYLOAD) -> tuple[dict[str, Any], bytes]:
        """Receive a control frame and its (bounded) payload as bytes."""
        header = self.recv_header()
        if header["len"] > max_payload:  # checked before a byte is allocated or read
            self.recv_payload_into(header, memoryview(b""))  # raises FrameTooLarge
        try:  # grown as the bytes arrive: a declared size alone allocates nothing
            payload = _recv_exactly(self.sock, header["len"])
        except OSError as exc:
            raise PeerUnavailable(f"receiving from {self.peer} failed: {exc}") from exc
        return header, payload

    def request(self, header: dict[str, Any], payload: bytes | None = None) -> dict[str, Any]:
        """Send a frame and wait for the reply frame's header; raise on an error reply."""
        self.send(header, payload)
        reply, _ = self.recv_message()
        raise_if_error(reply, self.peer)
        return reply

    def close(self) -> None:
        """Close the socket; further use raises PeerUnavailable."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def raise_if_error(header: dict[str, Any], peer: str) -> None:
    """Turn an ``error`` frame from ``peer`` into the matching exception."""
    if header.get("type") != "error":
        return
    code, message = header.get("code", ""), header.get("message", "")
    if code in ("auth", "other_job"):
        raise AuthenticationError(f"{peer} refused the connection: {message}")
    if code == "frame_too_large":
        raise FrameTooLarge(f"{peer} refused a frame: {message}")
    if code == "checksum":
        raise ChecksumMismatch(f"{peer}: {message}")
    if code == "memory":
        raise InsufficientMemory(f"{peer}: {message}")
    if code == "stale_epoch":
        raise StaleEpoch(f"{peer}: {message}")
    raise ProtocolError(f"{peer} answered with error {code!r}: {message}")


def _peer_name(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "peer"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) or "local peer"


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


_WRONG_SECRET = (
    "the job secret does not match. Every process of one job must be started with the same "
    "PEERCKPT_SECRET (peerckpt run sets it for the processes it starts); a process of another "
    "job, or one started by hand without it, cannot connect"
)
# Sent only to a client that proved the secret: it names no job (the client adds its own).
_OTHER_JOB = (
    "this process serves another job with the same secret; check --job (each peerckpt run "
    "makes its own secret, so two jobs share one only when it was set by hand)"
)


def _bytes_field(frame: dict[str, Any], key: str, size: int) -> bytes:
    value = frame.get(key)
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError(f"the handshake's {frame.get('type')!r} frame has no {size}-byte {key}")
    return value


def server_handshake(conn: Connection, secret: bytes, job: str) -> dict[str, Any]:
    """Authenticate a freshly accepted connection; return the client's ``hello`` header (the
    fields it passed to ``client_handshake``).

    Raises AuthenticationError (after telling the client why) if the client does not prove
    the secret and the job, ProtocolError or PeerUnavailable for anything that is not a
    handshake (never another exception, whatever the bytes). The client must prove it first,
    so a wrong client learns nothing. Until it has, frame headers are limited to
    ``PREAUTH_HEADER_BYTES``; the overall deadline is the listener's (``serving.Listener``).
    """
    conn.sock.settimeout(_HANDSHAKE_TIMEOUT_S)
    conn.max_header = PREAUTH_HEADER_BYTES
    nonce = os.urandom(32)
    conn.send({"type": "challenge", "nonce": nonce, "proto": PROTOCOL_VERSION})
    auth, _ = conn.recv_message(max_payload=0)
    if auth.get("type") != "auth" or not isinstance(auth.get("nonce"), bytes):
        conn.send_error("auth", "expected an auth frame first")
        raise AuthenticationError(f"{conn.peer} did not start with an auth frame")
    cnonce = _bytes_field(auth, "nonce", 32)
    mac, job_mac = _bytes_field(auth, "mac", 32), _bytes_field(auth, "job", 32)
    if not hmac.compare_digest(_mac(secret, b"client", nonce, cnonce), mac):
        conn.send_error("auth", _WRONG_SECRET)
        raise AuthenticationError(f"{conn.peer} failed the handshake: {_WRONG_SECRET}")
    if not hmac.compare_digest(_mac(secret, b"job", nonce, cnonce, job.encode()), job_mac):
        conn.send_error("other_job", _OTHER_JOB)
        raise AuthenticationError(f"{conn.peer} is from another job than {job!r}")
    conn.send({"type": "welcome", "mac": _mac(secret, b"server", cnonce, nonce, job.encode())})
    conn.max_header = MAX_HEADER_BYTES
    hello, _ = conn.recv_message(max_payload=0)
    if hello.get("type") != "hello":
        raise ProtocolError(f"{conn.peer} sent {hello.get('type')!r} where its hello belongs")
    conn.sock.settimeout(None)
    return hello


def client_handshake(conn: Connection, secret: bytes, job: str, **fields: Any) -> None:
    """Prove the job secret and the job to the server, check that the server knows both, and
    only then tell it ``fields`` (who this process is).

    Nothing sent before the server has proved itself says anything about the job: the job
    travels only inside a MAC keyed by the secret and bound to both fresh nonces.
    """
    conn.sock.settimeout(_HANDSHAKE_TIMEOUT_S)
    conn.max_header = PREAUTH_HEADER_BYTES
    challenge, _ = conn.recv_message(max_payload=0)
    raise_if_error(challenge, conn.peer)
    if challenge.get("type") != "challenge" or challenge.get("proto") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{conn.peer} speaks protocol {challenge.get('proto')!r}, this process speaks "
            f"{PROTOCOL_VERSION}; run every process of the job from the same peerckpt version"
        )
    snonce = _bytes_field(challenge, "nonce", 32)
    cnonce = os.urandom(32)
    mac = _mac(secret, b"client", snonce, cnonce)
    job_mac = _mac(secret, b"job", snonce, cnonce, job.encode())
    conn.send({"type": "auth", "nonce": cnonce, "mac": mac, "job": job_mac})
    reply, _ = conn.recv_message(max_payload=0)
    if reply.get("type") == "error" and reply.get("code") == "other_job":
        raise AuthenticationError(f"{conn.peer} refused job {job!r}: {reply.get('message')}")
    raise_if_error(reply, conn.peer)
    expected = _mac(secret, b"server", cnonce, snonce, job.encode())
    proof = reply.get("mac")
    if (
        reply.get("type") != "welcome"
        or not isinstance(proof, bytes)
        or not hmac.compare_digest(expected, proof)
    ):
        raise AuthenticationError(f"{conn.peer} could not prove the job secret; refusing to talk")
    conn.max_header = MAX_HEADER_BYTES
    conn.send({"type": "hello", **fields})
    conn.sock.settimeout(None)


def connect_tcp(
    addr: str,
    secret: bytes,
    job: str,
    timeout: float = 5.0,
    io_timeout: float | None = None,
    net: NetHooks | None = None,
    **fields: Any,
) -> Connection:
    """Open an authenticated TCP connection to ``host:port``.

    ``io_timeout`` bounds every later send and receive (None: no bound); ``net``: the
    connecting agent's network fault hooks.
    """
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as exc:
        raise PeerUnavailable(f"cannot connect to peer agent at {addr}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls.wanted(host):
        sock = _wrap_tls(sock, addr, secret, host)
    conn = Connection(sock, addr, net)
    try:
        client_handshake(conn, secret, job, **fields)
    except BaseException:
        conn.close()
        raise
    sock.settimeout(io_timeout)
    return conn


def _wrap_tls(sock: socket.socket, addr: str, secret: bytes, host: str) -> socket.socket:
    """The TLS handshake of a connecting side (within the socket's connect timeout)."""
    try:
        return tls.client_context(secret).wrap_socket(
            sock, server_hostname=tls.server_name(secret, host)
        )
    except (ssl.SSLError, ssl.CertificateError) as exc:
        sock.close()
        raise AuthenticationError(f"{addr}: {tls.refusal(exc)}") from None
    except OSError as exc:
        sock.close()
        raise PeerUnavailable(f"TLS handshake with {addr} failed: {exc}") from exc


def peer_pid(sock: socket.socket) -> int | None:
    """The process at the other end of a Unix socket (its peer credentials, as the kernel
    recorded them at connect); None if it cannot be read."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid: int = struct.unpack("3i", creds)[0]
    return pid or None


def connect_unix(path: str, secret: bytes, job: str, **fields: Any) -> Connection:
    """Open an authenticated connection to a local agent's Unix socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise PeerUnavailable(f"cannot reach the node agent at {path}: {exc}") from exc
    conn = Connection(sock, f"agent@{path}")
    try:
        client_handshake(conn, secret, job, **fields)
    except BaseException:
        conn.close()
        raise
    return conn
