"""A node's calls on one stream (``peerckpt/rpcstream.py``): each answered as it would be
alone, in order; an item whose MAC does not bind it to its stream and place is refused and
ends the stream before any handler runs; an answer that proves no secret is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from peerckpt.codec import pack, unpack
from peerckpt.errors import AuthenticationError, ProtocolError, StaleEpoch
from peerckpt.messages import encode
from peerckpt.messages.control import Heartbeat, HeartbeatReply, Replicated, Status
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.rpc import RpcClient, RpcServer
from peerckpt.rpcauth import CallSigner, nonce_of
from peerckpt.rpcstream import CALLS, SERVICE

from .test_coordinator import _job

SECRET = b"right" * 8


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RpcServer, Any]]:
    monkeypatch.setenv("PEERCKPT_TLS", "off")  # in the clear: the MACs must hold on their own
    c = _job()
    unary, streams = c.handlers()
    server = RpcServer(SECRET, "j", unary, streams, inline=Coordinator.INLINE)
    server.start()
    yield server, c
    server.stop()


def _item(signer: CallSigner, nonce: str, seq: int, msg: Any) -> bytes:
    method = msg.TYPE
    fields = encode(msg)
    del fields["type"]
    body = pack(fields)
    return pack([seq, method, body, signer.item(nonce, seq, method, body)])


def _raw(address: str, items: list[bytes], metadata: Any) -> list[Any]:
    """Send ``items`` on a stream of calls as they are; the answers, then the error if any."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/{SERVICE}/{CALLS}")(iter(items), metadata=metadata)
        out: list[Any] = []
        try:
            out.extend(unpack(answer) for answer in call)
        except grpc.RpcError as exc:
            out.append(exc.code())
        return out


def test_calls_on_a_stream_are_answered_as_they_would_be_alone(server) -> None:
    rpc, _c = server
    client = RpcClient(rpc.address, SECRET, "j")
    stream = client.call_stream()
    try:
        for _ in range(3):
            assert stream.call(Heartbeat(0, 0)) == client.call(Heartbeat(0, 0))
        assert isinstance(stream.call(Heartbeat(0, 0)), HeartbeatReply)
        with pytest.raises(StaleEpoch):  # the handler's error, as its class
            stream.call(Replicated(0, 99, 0, 1, [0], 1, 1))  # of an epoch not open
        with pytest.raises(ProtocolError, match="not taken on a stream"):
            stream.call(Status())  # not answered on the event loop: call it alone
        assert isinstance(stream.call(Heartbeat(0, 0)), HeartbeatReply)  # still open
    finally:
        stream.close()
        client.close()


def test_an_item_changed_replayed_or_moved_is_refused_and_ends_the_stream(server) -> None:
    rpc, _c = server
    signer = CallSigner(SECRET, "j")
    metadata = signer.metadata(CALLS, b"")
    nonce = nonce_of(metadata) or ""
    good = _item(signer, nonce, 0, Heartbeat(0, 0))
    assert [a[0] for a in _raw(rpc.address, [good], metadata)] == [0]
    # The same opening again: its nonce was seen (a replayed stream).
    assert _raw(rpc.address, [good], metadata) == [grpc.StatusCode.UNAUTHENTICATED]
    metadata = signer.metadata(CALLS, b"")
    nonce = nonce_of(metadata) or ""
    first = _item(signer, nonce, 0, Heartbeat(0, 0))
    seq, method, _body, mac = unpack(_item(signer, nonce, 1, Heartbeat(0, 0)))
    changed = pack([seq, method, pack({"node": 1, "epoch": 0}), mac])
    answers = _raw(rpc.address, [first, changed], metadata)
    assert [a[0] for a in answers[:-1]] == [0] and answers[-1] == grpc.StatusCode.UNAUTHENTICATED
    metadata = signer.metadata(CALLS, b"")
    nonce = nonce_of(metadata) or ""
    first = _item(signer, nonce, 0, Heartbeat(0, 0))
    answers = _raw(rpc.address, [first, first], metadata)  # the same item at place 1
    assert answers[-1] == grpc.StatusCode.UNAUTHENTICATED
    other = signer.metadata(CALLS, b"")  # an item of another stream
    answers = _raw(rpc.address, [_item(signer, nonce, 0, Heartbeat(0, 0))], other)
    assert answers == [grpc.StatusCode.UNAUTHENTICATED]


def test_a_server_without_the_secret_cannot_answer_a_stream(monkeypatch) -> None:
    monkeypatch.setenv("PEERCKPT_TLS", "off")
    c = _job()
    unary, streams = c.handlers()
    impostor = RpcServer(b"wrong" * 8, "j", unary, streams, inline=Coordinator.INLINE)
    impostor.start()
    client = RpcClient(impostor.address, SECRET, "j")
    stream = client.call_stream()
    try:
        with pytest.raises(AuthenticationError):
            stream.call(Heartbeat(0, 0), timeout=10.0)
    finally:
        stream.close()
        client.close()
        impostor.stop()
