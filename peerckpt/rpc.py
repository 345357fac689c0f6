"""Typed messages over gRPC: the control plane between agents, launchers and the coordinator.

gRPC carries small control messages only (bulk bytes go over the agents' TCP data links).
Each call is one ``Request`` of ``peerckpt/messages/control.py``: its class name is the
method, its reply class the answer; both travel as msgpack maps through gRPC's generic
handlers, decoded and type-checked at the edge (``messages.decode``), so there is no
generated code, nothing is ever unpickled and no handler ever sees a dict. Every call
carries a MAC of its method, its body's bytes, its time and a fresh nonce under the job's
secret (``peerckpt/rpcauth.py``), checked before the body is decoded; a call without the
right one, or one seen before, is refused as UNAUTHENTICATED.

Errors raised on purpose by a handler (subclasses of PeerckptError) travel back as their
class name and message and are raised again, as the same class, in the caller.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from peerckpt import errors, tls
from peerckpt.codec import pack, unpack
from peerckpt.messages import Dispatch, decode, encode, type_name
from peerckpt.messages.control import Event, Request, reply_class
from peerckpt.rpcauth import PROOF_KEY, CallSigner, CallVerifier, nonce_of, reply_proof
from peerckpt.rpcstream import CALLS, SERVICE, AsyncCallStream, CallStream, open_item
from peerckpt.serving import RefusalLog

R = TypeVar("R")  # the reply class of a request (``Request[R]``)

log = logging.getLogger("peerckpt.rpc")

# A server stream: an async generator of events, or of events already packed (``bytes``).
Stream = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Event | bytes]]


class RpcServer:
    """A gRPC server exposing msgpack handlers under ``/peerckpt.Coordinator/<name>``.

    It is an asyncio server (``grpc.aio``) on its own event-loop thread, so that a server
    stream costs a coroutine, not a thread: one coordinator holds the event streams of
    thousands of agents. Unary handlers are plain functions: those in ``inline`` (fast, no
    I/O) run on the loop, the others on a small thread pool so that a slow one (a recovery
    plan, a storage read) does not stall the streams. Stream handlers are async generators
    of events or of already packed bytes (an event packed once for many streams).
    """

    def __init__(
        self,
        secret: bytes,
        job: str,
        unary: Dispatch[Any],
        streams: dict[type[Any], Stream],
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 4,
        inline: Collection[type[Any]] = (),
    ) -> None:
        self._secret, self._job = secret, job
        self.verifier = CallVerifier(secret, job)
        self._refusals = RefusalLog("peerckpt-rpc", 5, 10.0)  # a line per refused caller, bounded
        self._inline = frozenset(inline)
        # Requests arrive as bytes: the MAC covers them, and they are decoded only once it holds.
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for cls in unary.table:
            handlers[type_name(cls)] = grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(cls, unary)
            )
        for cls, gen in streams.items():
            handlers[type_name(cls)] = grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(cls, gen)
            )
        if self._inline:  # a node's stream of calls (``peerckpt/rpcstream.py``)
            handlers[CALLS] = grpc.stream_stream_rpc_method_handler(self._wrap_calls(unary))
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="peerckpt-rpc")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="peerckpt-rpc-loop", daemon=True
        )
        self._thread.start()
        try:
            self._server, self.port = self._run(self._create(handlers, host, port))
        except Exception as exc:
            self._close_loop()
            raise errors.ConfigurationError(
                f"cannot listen on {host}:{port} for the coordinator: {exc}"
            ) from exc
        self.address = f"{host}:{self.port}"

    async def _create(
        self, handlers: dict[str, grpc.RpcMethodHandler], host: str, port: int
    ) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(
            handlers=(grpc.method_handlers_generic_handler(SERVICE, handlers),),
            options=[("grpc.so_reuseport", 0)],
        )
        if tls.wanted(host):
            creds = tls.credentials(self._secret)
            server_creds = grpc.ssl_server_credentials(
                [(creds.key, creds.cert)], root_certificates=creds.ca, require_client_auth=True
            )
            port = server.add_secure_port(f"{host}:{port}", server_creds)
        else:
            port = server.add_insecure_port(f"{host}:{port}")
        if port == 0:
            raise OSError("the port is taken")
        return server, port

    def _run(self, coro: Coroutine[Any, Any, R], timeout: float | None = 10.0) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _proof(self, name: str, context: grpc.aio.ServicerContext, seq: int, body: bytes) -> str:
        """This server's proof of the secret for a reply (``rpcauth.reply_proof``)."""
        nonce = nonce_of(context.invocation_metadata() or ()) or ""
        return reply_proof(self._secret, self._job, name, nonce, seq, body)

    async def _abort(
        self, name: str, context: grpc.aio.ServicerContext, code: grpc.StatusCode, detail: str
    ) -> None:
        """End the call with an error whose text carries this server's proof."""
        proof = self._proof(name, context, -1, detail.encode())
        await context.abort(code, detail, trailing_metadata=((PROOF_KEY, proof),))

    async def _verify(self, name: str, body: bytes, context: grpc.aio.ServicerContext) -> None:
        """Check the call's MAC, time and nonce; end the call if they do not hold."""
        try:
            self.verifier.verify(name, context.invocation_metadata(), body)
        except errors.AuthenticationError as exc:
            self._refusals.refused_peer(context.peer(), str(exc))
            await self._abort(
                name, context, grpc.StatusCode.UNAUTHENTICATED, f"AuthenticationError: {exc}"
            )

    async def _authenticate(self, name: str, body: bytes, context: grpc.aio.ServicerContext) -> Any:
        """Check the call's MAC, time and nonce; return its decoded body."""
        await self._verify(name, body, context)
        try:
            return unpack(body) or {}
        except Exception:  # any bytes: msgpack raises many types
            await self._abort(
                name,
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "ProtocolError: body not msgpack",
            )

    def _wrap_unary(
        self, cls: type[Any], table: Dispatch[Any]
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        name = type_name(cls)

        def call(request: Any, where: str) -> tuple[grpc.StatusCode | None, Any]:
            return _handle(cls, table, request, where)

        async def handler(body: bytes, context: grpc.aio.ServicerContext) -> Any:
            request = await self._authenticate(name, body, context)
            if cls in self._inline:
                code, out = call(request, _caller(context))
            else:
                loop = asyncio.get_running_loop()
                code, out = await loop.run_in_executor(self._pool, call, request, _caller(context))
            if code is not None:
                await self._abort(name, context, code, out)
            reply = pack(out)
            context.set_trailing_metadata(((PROOF_KEY, self._proof(name, context, -1, reply)),))
            return reply

        return handler

    def _wrap_stream(
        self, cls: type[Any], gen: Stream
    ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        name = type_name(cls)

        async def handler(body: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            request = await self._authenticate(name, body, context)
            try:
                msg = decode({**_fields(request), "type": name}, cls, where=_caller(context))
            except errors.ProtocolError as exc:
                await self._abort(
                    name, context, grpc.StatusCode.FAILED_PRECONDITION, f"ProtocolError: {exc}"
                )
            nonce = nonce_of(context.invocation_metadata() or ()) or ""  # once per stream
            try:
                seq = 0
                async for event in gen(msg, context):
                    packed = event if isinstance(event, bytes) else pack(encode(event))
                    proof = reply_proof(self._secret, self._job, name, nonce, seq, packed)
                    yield pack([packed, proof])
                    seq += 1
            except errors.PeerckptError as exc:
                detail = f"{type(exc).__name__}: {exc}"
                await self._abort(name, context, grpc.StatusCode.FAILED_PRECONDITION, detail)

        return handler

    def _wrap_calls(
        self, table: Dispatch[Any]
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        """A node's calls on one stream, each answered in order on the event loop, as the
        same call made alone would be (the ``inline`` classes only: they never wait)."""
        classes = {type_name(cls): cls for cls in table.table if cls in self._inline}

        async def handler(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            await self._verify(CALLS, b"", context)  # the opening: a call with no body
            nonce = nonce_of(context.invocation_metadata() or ()) or ""
            where = _caller(context)
            seq = 0
            async for item in requests:
                try:
                    method, body = open_item(self._secret, self._job, nonce, seq, item)
                except errors.PeerckptError as exc:
                    self._refusals.refused_peer(context.peer(), str(exc))
                    await self._abort(
                        CALLS,
                        context,
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"{type(exc).__name__}: {exc}",
                    )
                cls = classes.get(method)
                if cls is None:
                    code: grpc.StatusCode | None = grpc.StatusCode.FAILED_PRECONDITION
                    out: Any = f"ProtocolError: {method} is not taken on a stream; call it alone"
                else:
                    try:
                        request = unpack(body) or {}
                    except Exception:  # any bytes: msgpack raises many types
                        request = None
                    code, out = _handle(cls, table, request, where)
                payload = pack(out) if code is None else str(out).encode()
                proof = reply_proof(self._secret, self._job, method, nonce, seq, payload)
                yield pack([seq, "" if code is None else code.name, payload, proof])
                seq += 1

        return handler

    def start(self) -> None:
        self._run(self._server.start())

    def stop(self, grace: float = 0.5) -> None:
        """Stop serving (streams still open are cancelled after ``grace``), end the loop."""
        try:
            self._run(self._server.stop(grace), timeout=grace + 2.0)
        except (TimeoutError, futures.TimeoutError, RuntimeError) as exc:
            log.warning("the RPC server did not stop within %.1f s: %s", grace + 2.0, exc)
        self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class RpcClient:
    """Calls the coordinator. One channel, reused; safe to share between threads."""

    def __init__(self, address: str, secret: bytes, job: str) -> None:
        self.address = address
        self._signer = CallSigner(secret, job)
        # Reconnect within a fraction of a second once a restarted coordinator listens again
        # (gRPC's default backoff grows to minutes; agents must rejoin within seconds).
        options: list[tuple[str, Any]] = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        host = address.rpartition(":")[0]
        if tls.wanted(host):
            creds = tls.credentials(secret)
            if creds.derived:  # every derived certificate is named ``peerckpt``
                options.append(("grpc.ssl_target_name_override", tls.DERIVED_NAME))
            channel_creds = grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)
            self._channel = grpc.secure_channel(address, channel_creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)

    def call(self, msg: Request[R], timeout: float = 10.0) -> R:
        """Call the coordinator; return its typed reply, or re-raise the handler's
        PeerckptError as the same class. A reply (or error) that does not prove the job's
        secret raises AuthenticationError (``rpcauth``)."""
        method = type_name(type(msg))
        stub = self._channel.unary_unary(f"/{SERVICE}/{method}")
        body = pack(_body(msg))
        metadata = self._signer.metadata(method, body)
        try:
            raw, call = stub.with_call(body, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise _translate(exc, self.address, method, self._signer, metadata) from None
        where = f"the coordinator at {self.address}"
        proof = _proof_in(call.trailing_metadata())
        self._signer.check_reply(method, metadata, -1, raw, proof, where)
        return decode(unpack(raw), reply_class(type(msg)), where=where)

    def stream(self, msg: Request[Event]) -> EventStream:
        """Open a server stream of events; iterate it, ``.cancel()`` it to stop."""
        method = type_name(type(msg))
        stub = self._channel.unary_stream(f"/{SERVICE}/{method}", response_deserializer=unpack)
        body = pack(_body(msg))
        metadata = self._signer.metadata(method, body)
        proven = _Proven(self._signer, method, metadata, f"the coordinator at {self.address}")
        return EventStream(stub(body, metadata=metadata), self.address, proven)

    def call_stream(self) -> CallStream:
        """A stream of calls on this client's channel (``peerckpt/rpcstream.py``)."""
        return CallStream(self._channel, self._signer, self.address)

    def close(self) -> None:
        self._channel.close()


class AsyncRpcClient:
    """``RpcClient`` for asyncio code: the same messages, metadata and errors on a
    ``grpc.aio`` channel (many simulated agents in one process: ``bench/coordinator.py``)."""

    def __init__(self, address: str, secret: bytes, job: str) -> None:
        self.address = address
        self._signer = CallSigner(secret, job)  # the agents' client's own authentication
        # Its own connection, as an agent on its own host has (channels of one process to
        # one address would otherwise share one).
        options: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]
        host = address.rpartition(":")[0]
        if tls.wanted(host):
            creds = tls.credentials(secret)
            if creds.derived:
                options.append(("grpc.ssl_target_name_override", tls.DERIVED_NAME))
            channel_creds = grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)
            self._channel = grpc.aio.secure_channel(address, channel_creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)

    async def call(self, msg: Request[R], timeout: float = 10.0) -> R:
        """Call the coordinator; its typed reply, or the handler's PeerckptError raised again."""
        method = type_name(type(msg))
        stub = self._channel.unary_unary(f"/{SERVICE}/{method}")
        body = pack(_body(msg))
        metadata = self._signer.metadata(method, body)
        call = stub(body, timeout=timeout, metadata=metadata)
        try:
            raw = await call
        except grpc.RpcError as exc:
            raise _translate(exc, self.address, method, self._signer, metadata) from None
        where = f"the coordinator at {self.address}"
        proof = _proof_in(await call.trailing_metadata())
        self._signer.check_reply(method, metadata, -1, raw, proof, where)
        return decode(unpack(raw), reply_class(type(msg)), where=where)

    async def stream(
        self, msg: Request[Event], decoder: Callable[[bytes], Event] | None = None
    ) -> AsyncIterator[Event]:
        """A server stream's events, decoded as they arrive (cancel the task to stop).

        ``decoder`` replaces ``decode``, given each event's bytes once proven (many
        simulated agents in one process decode the same large membership once, not once
        each: at 1,000 nodes unpacking it was 9 s of the simulator's CPU)."""
        method = type_name(type(msg))
        stub = self._channel.unary_stream(f"/{SERVICE}/{method}", response_deserializer=unpack)
        where = f"the coordinator at {self.address}"
        body = pack(_body(msg))
        metadata = self._signer.metadata(method, body)
        proven = _Proven(self._signer, method, metadata, where)
        async for item in stub(body, metadata=metadata):
            packed = proven.packed(item)
            if decoder is not None:
                yield decoder(packed)
            else:
                yield decode(unpack(packed), Event, where=where)

    def call_stream(self) -> AsyncCallStream:
        """A stream of calls on this client's channel (``peerckpt/rpcstream.py``)."""
        return AsyncCallStream(self._channel, self._signer, self.address)

    async def close(self) -> None:
        await self._channel.close()


class _Proven:
    """A stream's events, each checked for the coordinator's proof, in order."""

    def __init__(self, signer: CallSigner, method: str, metadata: Any, where: str) -> None:
        self._signer, self._method, self._metadata, self._where = signer, method, metadata, where
        self._seq = 0

    def event(self, item: Any) -> Any:
        """The unpacked event of one stream item ``[event bytes, proof]``, once proven."""
        return unpack(self.packed(item))

    def packed(self, item: Any) -> bytes:
        """The event bytes of one stream item ``[event bytes, proof]``, once proven."""
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)):
            raise errors.ProtocolError(f"{self._where} sent an event without its proof")
        packed, proof = item
        self._signer.check_reply(
            self._method, self._metadata, self._seq, packed, proof, self._where
        )
        self._seq += 1
        return packed


class EventStream:
    """A server stream's events, decoded as they arrive (each proven: ``_Proven``)."""

    def __init__(self, call: Any, address: str, proven: _Proven) -> None:
        self._call = call
        self._where = f"the coordinator at {address}"
        self._proven = proven

    def __iter__(self) -> Iterator[Event]:
        for item in self._call:
            yield decode(self._proven.event(item), Event, where=self._where)

    def cancel(self) -> None:
        self._call.cancel()


def _handle(
    cls: type[Any], table: Dispatch[Any], request: Any, where: str
) -> tuple[grpc.StatusCode | None, Any]:
    """A call's reply (its map), or the status and text of its error."""
    name = type_name(cls)
    try:
        msg = decode({**_fields(request), "type": name}, cls, where=where)
        return None, encode(table.handle(msg))
    except errors.PeerckptError as exc:
        return grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}"
    except Exception:
        log.exception("handler %s failed", name)
        return grpc.StatusCode.INTERNAL, f"coordinator error in {name}; see its log"


def _body(msg: Any) -> dict[str, Any]:
    """A request's fields (its type is the method's name)."""
    out = encode(msg)
    del out["type"]
    return out


def _fields(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise errors.ProtocolError(f"a request body must be a map, not {type(request).__name__}")
    return request


def _caller(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str:
    return f"caller {context.peer()}"


def _proof_in(metadata: Any) -> Any:
    return next((v for k, v in metadata or () if k == PROOF_KEY), None)


# Answers a server gives (its handler's errors, its refusals): they must carry its proof.
# The others are the client library's own (nobody answered, the deadline passed).
_FROM_SERVER = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INTERNAL,
    }
)


def _translate(
    exc: grpc.RpcError, address: str, method: str, signer: CallSigner, metadata: Any
) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code in _FROM_SERVER:
        trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        try:
            where = f"the coordinator at {address}"
            signer.check_reply(
                method, metadata, -1, (detail or "").encode(), _proof_in(trailing), where
            )
        except errors.AuthenticationError as unproven:
            if code != grpc.StatusCode.UNAUTHENTICATED:
                return unproven
            # Refused, by a process whose proof this one cannot check: the same secret is
            # not on both sides — this process's may be the wrong one.
            return errors.AuthenticationError(
                f"coordinator at {address} refused the call and its answer proves no secret "
                f"this process shares ({detail}); if this process has the wrong "
                "PEERCKPT_SECRET, start it with the job's; otherwise another process answers "
                "at that address"
            )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.AuthenticationError(f"coordinator at {address}: {detail}")
    if code == grpc.StatusCode.UNAVAILABLE and "handshake failed" in (detail or "").lower():
        return errors.AuthenticationError(
            f"coordinator at {address}: TLS handshake failed: the coordinator's certificate is "
            "not signed by this job's CA (wrong job secret, another job's coordinator, or a "
            f"different {tls.CA_ENV}). Start every process of a job with the same "
            f"PEERCKPT_SECRET. ({detail})"
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.PeerUnavailable(f"coordinator at {address} did not answer {method}: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION and detail and ": " in detail:
        cls_name, _, message = detail.partition(": ")
        cls = getattr(errors, cls_name, None)
        if isinstance(cls, type) and issubclass(cls, errors.PeerckptError):
            return cls(message)
    return errors.PeerckptError(f"coordinator call {method} failed: {code}: {detail}")


def is_stream_closed(exc: BaseException) -> bool:
    """True when a streaming call ended because either side went away or cancelled it."""
    return isinstance(exc, grpc.RpcError)
