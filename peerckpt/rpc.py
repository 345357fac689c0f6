"""msgpack over gRPC: the control plane between agents, the launcher and the coordinator.

gRPC carries small control messages only (bulk bytes go over the agents' TCP data links).
Messages are msgpack maps through gRPC's generic handlers, so there is no generated code and
nothing is ever unpickled. Every call carries an HMAC of the job's secret, the job and the
method name in its metadata; a call without the right one is refused as UNAUTHENTICATED.

Errors raised on purpose by a handler (subclasses of PeerckptError) travel back as their
class name and message and are raised again, as the same class, in the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from peerckpt import errors
from peerckpt.codec import pack, unpack

SERVICE = "peerckpt.Coordinator"
_AUTH_KEY = "peerckpt-auth"
log = logging.getLogger("peerckpt.rpc")

Unary = Callable[[dict[str, Any]], dict[str, Any]]
Stream = Callable[[dict[str, Any], grpc.ServicerContext], Iterator[dict[str, Any]]]


def _token(secret: bytes, job: str, method: str) -> str:
    return hmac.new(secret, f"{job}:{method}".encode(), hashlib.sha256).hexdigest()


class RpcServer:
    """A gRPC server exposing msgpack handlers under ``/peerckpt.Coordinator/<name>``."""

    def __init__(
        self,
        secret: bytes,
        job: str,
        unary: dict[str, Unary],
        streams: dict[str, Stream],
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 64,
    ) -> None:
        self._secret = secret
        self._job = job
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name, fn in unary.items():
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(name, fn), request_deserializer=unpack, response_serializer=pack
            )
        for name, gen in streams.items():
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(name, gen), request_deserializer=unpack, response_serializer=pack
            )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="peerckpt-rpc"),
            handlers=(grpc.method_handlers_generic_handler(SERVICE, handlers),),
            options=[("grpc.so_reuseport", 0)],
        )
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise errors.ConfigurationError(f"cannot listen on {host}:{port} for the coordinator")
        self.address = f"{host}:{self.port}"

    def _authenticate(self, name: str, context: grpc.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata())
        expected = _token(self._secret, self._job, name)
        if not hmac.compare_digest(str(metadata.get(_AUTH_KEY, "")), expected):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"AuthenticationError: call to {name} refused: wrong job secret or another job's "
                "coordinator. Start every process of a job with the same PEERCKPT_SECRET.",
            )

    def _wrap_unary(self, name: str, fn: Unary) -> Callable[[Any, grpc.ServicerContext], Any]:
        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            self._authenticate(name, context)
            try:
                return fn(request or {})
            except errors.PeerckptError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("handler %s failed", name)
                context.abort(grpc.StatusCode.INTERNAL, f"coordinator error in {name}; see its log")

        return handler

    def _wrap_stream(self, name: str, gen: Stream) -> Callable[[Any, grpc.ServicerContext], Any]:
        def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._authenticate(name, context)
            yield from gen(request or {}, context)

        return handler

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float = 0.5) -> None:
        self._server.stop(grace).wait(grace + 1.0)


class RpcClient:
    """Calls the coordinator. One channel, reused; safe to share between threads."""

    def __init__(self, address: str, secret: bytes, job: str) -> None:
        self.address = address
        self._secret = secret
        self._job = job
        # Reconnect within a fraction of a second once a restarted coordinator listens again
        # (gRPC's default backoff grows to minutes; agents must rejoin within seconds).
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500),
            ],
        )

    def _metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        return ((_AUTH_KEY, _token(self._secret, self._job, method)),)

    def call(self, method: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        """Call a unary method; re-raise the handler's PeerckptError as the same class."""
        stub = self._channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=pack, response_deserializer=unpack
        )
        try:
            result: dict[str, Any] = stub(args, timeout=timeout, metadata=self._metadata(method))
        except grpc.RpcError as exc:
            raise _translate(exc, self.address, method) from None
        return result

    def stream(self, method: str, **args: Any) -> Any:
        """Open a server stream; iterate the result, ``.cancel()`` it to stop."""
        stub = self._channel.unary_stream(
            f"/{SERVICE}/{method}", request_serializer=pack, response_deserializer=unpack
        )
        return stub(args, metadata=self._metadata(method))

    def close(self) -> None:
        self._channel.close()


def _translate(exc: grpc.RpcError, address: str, method: str) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.AuthenticationError(f"coordinator at {address}: {detail}")
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
