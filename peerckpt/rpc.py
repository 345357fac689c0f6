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

import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from peerckpt import errors, tls
from peerckpt.codec import pack, unpack
from peerckpt.messages import Dispatch, decode, encode, type_name
from peerckpt.messages.control import Event, Request, reply_class
from peerckpt.rpcauth import CallSigner, CallVerifier

R = TypeVar("R")  # the reply class of a request (``Request[R]``)

SERVICE = "peerckpt.Coordinator"
log = logging.getLogger("peerckpt.rpc")

Stream = Callable[[Any, grpc.ServicerContext], Iterator[Event]]


class RpcServer:
    """A gRPC server exposing msgpack handlers under ``/peerckpt.Coordinator/<name>``."""

    def __init__(
        self,
        secret: bytes,
        job: str,
        unary: Dispatch[Any],
        streams: dict[type[Any], Stream],
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 64,
    ) -> None:
        self.verifier = CallVerifier(secret, job)
        # Requests arrive as bytes: the MAC covers them, and they are decoded only once it holds.
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for cls in unary.table:
            handlers[type_name(cls)] = grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(cls, unary), response_serializer=pack
            )
        for cls, gen in streams.items():
            handlers[type_name(cls)] = grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(cls, gen), response_serializer=pack
            )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="peerckpt-rpc"),
            handlers=(grpc.method_handlers_generic_handler(SERVICE, handlers),),
            options=[("grpc.so_reuseport", 0)],
        )
        if tls.wanted(host):
            creds = tls.credentials(secret)
            server_creds = grpc.ssl_server_credentials(
                [(creds.key, creds.cert)], root_certificates=creds.ca, require_client_auth=True
            )
            self.port = self._server.add_secure_port(f"{host}:{port}", server_creds)
        else:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise errors.ConfigurationError(f"cannot listen on {host}:{port} for the coordinator")
        self.address = f"{host}:{self.port}"

    def _authenticate(self, name: str, body: bytes, context: grpc.ServicerContext) -> Any:
        """Check the call's MAC, time and nonce; return its decoded body."""
        try:
            self.verifier.verify(name, context.invocation_metadata(), body)
        except errors.AuthenticationError as exc:
            log.warning("%s from %s", exc, context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"AuthenticationError: {exc}")
        try:
            return unpack(body) or {}
        except Exception:  # any bytes: msgpack raises many types
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "ProtocolError: body not msgpack")

    def _wrap_unary(
        self, cls: type[Any], table: Dispatch[Any]
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        name = type_name(cls)

        def handler(body: bytes, context: grpc.ServicerContext) -> Any:
            request = self._authenticate(name, body, context)
            try:
                msg = decode({**_fields(request), "type": name}, cls, where=_caller(context))
                return encode(table.handle(msg))
            except errors.PeerckptError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("handler %s failed", name)
                context.abort(grpc.StatusCode.INTERNAL, f"coordinator error in {name}; see its log")

        return handler

    def _wrap_stream(
        self, cls: type[Any], gen: Stream
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        name = type_name(cls)

        def handler(body: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            request = self._authenticate(name, body, context)
            try:
                msg = decode({**_fields(request), "type": name}, cls, where=_caller(context))
            except errors.ProtocolError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ProtocolError: {exc}")
            for event in gen(msg, context):
                yield encode(event)

        return handler

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float = 0.5) -> None:
        self._server.stop(grace).wait(grace + 1.0)


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
        PeerckptError as the same class."""
        method = type_name(type(msg))
        stub = self._channel.unary_unary(f"/{SERVICE}/{method}", response_deserializer=unpack)
        body = pack(_body(msg))
        try:
            raw = stub(body, timeout=timeout, metadata=self._signer.metadata(method, body))
        except grpc.RpcError as exc:
            raise _translate(exc, self.address, method) from None
        return decode(raw, reply_class(type(msg)), where=f"the coordinator at {self.address}")

    def stream(self, msg: Request[Event]) -> EventStream:
        """Open a server stream of events; iterate it, ``.cancel()`` it to stop."""
        method = type_name(type(msg))
        stub = self._channel.unary_stream(f"/{SERVICE}/{method}", response_deserializer=unpack)
        body = pack(_body(msg))
        return EventStream(stub(body, metadata=self._signer.metadata(method, body)), self.address)

    def close(self) -> None:
        self._channel.close()


class EventStream:
    """A server stream's events, decoded as they arrive."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._where = f"the coordinator at {address}"

    def __iter__(self) -> Iterator[Event]:
        for raw in self._call:
            yield decode(raw, Event, where=self._where)

    def cancel(self) -> None:
        self._call.cancel()


def _body(msg: Any) -> dict[str, Any]:
    """A request's fields (its type is the method's name)."""
    out = encode(msg)
    del out["type"]
    return out


def _fields(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise errors.ProtocolError(f"a request body must be a map, not {type(request).__name__}")
    return request


def _caller(context: grpc.ServicerContext) -> str:
    return f"caller {context.peer()}"


def _translate(exc: grpc.RpcError, address: str, method: str) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
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
