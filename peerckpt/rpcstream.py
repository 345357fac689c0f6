"""A node's calls to the coordinator on one long-lived gRPC stream instead of one call each.

Measured with the coordinator's own gRPC server (``grpc.aio``) on this project's 2-core
machine: a unary call costs the server ~195 µs of CPU before its handler runs, an item on an
open bidirectional stream ~60 µs, answer included. At 1,000 nodes reporting a step every
second those calls were 80% of the coordinator's profile (docs/performance.md, "A cluster's
size"). So an agent opens ``Calls`` once and sends its frequent calls (reports, heart-beats:
those the coordinator answers on its event loop without waiting) on it::

    agent ── Calls (opened with a call's MAC over an empty body: time, fresh nonce) ──▶
    agent ── [seq, method, body, MAC(secret, nonce, seq, method, body)] ─────────────▶
    agent ◀── [seq, status ("" or a gRPC status name), reply or error text,
               proof(secret, method, nonce, seq, reply)] ────────────────────────────── …

Items are numbered from 0 in both directions and answered in order. Every item up is bound
by its MAC to the stream's nonce and its place (``rpcauth.item_mac``): it cannot be changed,
replayed, reordered or moved to another stream; every answer proves the secret as a unary
reply does (``rpcauth.reply_proof`` with the item's number). A call made on the stream means
what it means alone: the same handler, the same reply or error class in the caller.

Invariant: a caller waits for its own answer (per-thread order is kept); a call whose answer
does not come within its timeout raises PeerUnavailable, and a stream that ends fails every
call waiting on it. The caller (``CoordinatorLink``) then opens a new stream.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import grpc

from peerckpt import errors
from peerckpt.codec import pack, unpack
from peerckpt.messages import decode, encode, type_name
from peerckpt.messages.control import Request, reply_class
from peerckpt.rpcauth import CallSigner, check_item, nonce_of

R = TypeVar("R")
CALLS = "Calls"  # the method: /peerckpt.Coordinator/Calls
SERVICE = "peerckpt.Coordinator"


def open_item(secret: bytes, job: str, nonce: str, seq: int, item: Any) -> tuple[str, bytes]:
    """The method and body of item ``seq`` of a stream opened with ``nonce``, once its MAC
    holds; ProtocolError or AuthenticationError otherwise (the server ends the stream)."""
    try:
        fields = unpack(item)
    except Exception:  # any bytes: msgpack raises many types
        raise errors.ProtocolError("a stream item that is not msgpack") from None
    if not (isinstance(fields, list) and len(fields) == 4):
        raise errors.ProtocolError("a stream item must be [seq, method, body, mac]")
    got, method, body, mac = fields
    if not (isinstance(method, str) and isinstance(body, bytes)):
        raise errors.ProtocolError("a stream item's method must be text and its body bytes")
    if got != seq:
        raise errors.AuthenticationError(f"stream item {got!r} came where {seq} belongs")
    check_item(secret, job, nonce, seq, method, body, mac)
    return method, body


def _item(signer: CallSigner, nonce: str, seq: int, msg: Any) -> tuple[str, bytes]:
    method = type_name(type(msg))
    fields = encode(msg)
    del fields["type"]
    body = pack(fields)
    return method, pack([seq, method, body, signer.item(nonce, seq, method, body)])


def _answer(item: Any, where: str) -> tuple[int, str, bytes, Any]:
    fields = unpack(item) if isinstance(item, bytes) else item
    if not (isinstance(fields, list) and len(fields) == 4):
        raise errors.ProtocolError(f"{where} sent a stream answer that is not [seq, …]")
    seq, status, payload, proof = fields
    if not (isinstance(seq, int) and isinstance(status, str) and isinstance(payload, bytes)):
        raise errors.ProtocolError(f"{where} sent a malformed stream answer")
    return seq, status, payload, proof


class _Answering:
    """What both streams do with an answer: resolve the future of the call it answers
    (threading's or asyncio's), once its proof is checked against that call."""

    _signer: Any
    _metadata: Any
    _where: str

    def _settle(self, entry: tuple[str, Any], answer: tuple[int, str, bytes, Any]) -> None:
        method, future = entry
        seq, status, payload, proof = answer
        try:
            self._signer.check_reply(method, self._metadata, seq, payload, proof, self._where)
        except errors.AuthenticationError as exc:
            future.set_exception(exc)
            return
        if not future.done():
            future.set_result((status, payload))


def _reply(msg: Any, status: str, payload: bytes, where: str) -> Any:
    """The typed reply of an answer, or the handler's error raised again as its class."""
    if not status:
        return decode(unpack(payload), reply_class(type(msg)), where=where)
    detail = payload.decode(errors="replace")
    method = type_name(type(msg))
    if status == grpc.StatusCode.FAILED_PRECONDITION.name and ": " in detail:
        cls_name, _, text = detail.partition(": ")
        cls = getattr(errors, cls_name, None)
        if isinstance(cls, type) and issubclass(cls, errors.PeerckptError):
            raise cls(text)
    raise errors.PeerckptError(f"coordinator call {method} failed: {status}: {detail}")


class CallStream(_Answering):
    """Calls on one stream, from any thread of an agent (``grpc``'s blocking channel)."""

    def __init__(self, channel: grpc.Channel, signer: CallSigner, address: str) -> None:
        self._signer = signer
        self._address = address
        self._where = f"the coordinator at {address}"
        self._metadata = signer.metadata(CALLS, b"")
        self._nonce = nonce_of(self._metadata) or ""
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._seq = 0
        self._waiting: dict[int, tuple[str, Future[tuple[str, bytes]]]] = {}
        self.broken: errors.PeerckptError | None = None  # why it ended; then open another
        self.unsupported = False  # the server has no stream of calls
        stub = channel.stream_stream(f"/{SERVICE}/{CALLS}")
        self._call = stub(self._outgoing(), metadata=self._metadata)
        self._reader = threading.Thread(target=self._read, name="peerckpt-rpc-calls", daemon=True)
        self._reader.start()

    def _outgoing(self) -> Iterator[bytes]:
        while (item := self._requests.get()) is not None:
            yield item

    def call(self, msg: Request[R], timeout: float = 10.0) -> R:
        """As ``RpcClient.call``: the typed reply, or the handler's error as its class."""
        future: Future[tuple[str, bytes]] = Future()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            seq = self._seq
            self._seq += 1
            method, item = _item(self._signer, self._nonce, seq, msg)
            self._waiting[seq] = (method, future)
            self._requests.put(item)  # under the lock: items go in their numbers' order
        try:
            status, payload = future.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._waiting.pop(seq, None)
            raise errors.PeerUnavailable(
                f"coordinator at {self._address} did not answer {method} within {timeout:g} s"
            ) from None
        return _reply(msg, status, payload, self._where)

    def _read(self) -> None:
        error: errors.PeerckptError = errors.PeerUnavailable(f"{self._where} ended the stream")
        try:
            for item in self._call:
                answer = _answer(item, self._where)
                with self._lock:
                    entry = self._waiting.pop(answer[0], None)
                if entry is not None:  # else its caller gave up waiting
                    self._settle(entry, answer)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else ""
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True  # a coordinator without streams: call it alone
            error = (
                errors.AuthenticationError(f"{self._where} refused the stream: {detail}")
                if code == grpc.StatusCode.UNAUTHENTICATED
                else errors.PeerUnavailable(f"{self._where} ended the stream of calls: {code}")
            )
        except errors.PeerckptError as exc:
            error = exc
        finally:
            with self._lock:
                self.broken = error
                waiting, self._waiting = self._waiting, {}
            for _, future in waiting.values():
                future.set_exception(error)

    def close(self) -> None:
        """End the stream: the server sees its end and answers what it got; then calls still
        waiting on it fail."""
        self._requests.put(None)
        self._reader.join(2.0)
        self._call.cancel()
        self._reader.join(5.0)


class AsyncCallStream(_Answering):
    """``CallStream`` for asyncio code (many simulated agents in one process)."""

    def __init__(self, channel: grpc.aio.Channel, signer: CallSigner, address: str) -> None:
        self._signer = signer
        self._where = f"the coordinator at {address}"
        self._metadata = signer.metadata(CALLS, b"")
        self._nonce = nonce_of(self._metadata) or ""
        self._call = channel.stream_stream(f"/{SERVICE}/{CALLS}")(metadata=self._metadata)
        self._lock = asyncio.Lock()  # items are written in their numbers' order
        self._seq = 0
        self._waiting: dict[int, tuple[str, asyncio.Future[tuple[str, bytes]]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.broken: errors.PeerckptError | None = None

    async def call(self, msg: Request[R], timeout: float = 10.0) -> R:
        if self.broken is not None:
            raise self.broken
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        future: asyncio.Future[tuple[str, bytes]] = asyncio.get_running_loop().create_future()
        async with self._lock:
            seq = self._seq
            self._seq += 1
            method, item = _item(self._signer, self._nonce, seq, msg)
            self._waiting[seq] = (method, future)
            try:
                await self._call.write(item)
            except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                self._waiting.pop(seq, None)  # the stream ended (UsageError: it is done)
                self.broken = errors.PeerUnavailable(f"{self._where} took no call: {exc!r}")
                raise self.broken from None
        try:
            status, payload = await asyncio.wait_for(future, timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self._waiting.pop(seq, None)
            raise errors.PeerUnavailable(
                f"{self._where} did not answer {method} within {timeout:g} s"
            ) from None
        return _reply(msg, status, payload, self._where)

    async def _read(self) -> None:
        error: errors.PeerckptError = errors.PeerUnavailable(f"{self._where} ended the stream")
        try:
            while (item := await self._call.read()) is not grpc.aio.EOF:
                answer = _answer(item, self._where)
                entry = self._waiting.pop(answer[0], None)
                if entry is not None:  # else its caller gave up waiting
                    self._settle(entry, answer)
        except grpc.RpcError as exc:
            error = errors.PeerUnavailable(f"{self._where} ended the stream of calls: {exc!r}")
        except errors.PeerckptError as exc:
            error = exc
        finally:
            self.broken = error
            waiting, self._waiting = self._waiting, {}
            for _, future in waiting.values():
                if not future.done():
                    future.set_exception(error)

    async def aclose(self) -> None:
        """End the stream: the server sees its end (a cancel made its handler's grpc log
        an error), then the reading stops."""
        try:
            await asyncio.wait_for(self._call.done_writing(), 2.0)
            if self._reader is not None:
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
        except (grpc.RpcError, grpc.aio.UsageError, TimeoutError, asyncio.TimeoutError):
            pass
        self.close()

    def close(self) -> None:
        """Cancel the stream at once (calls waiting on it fail)."""
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
