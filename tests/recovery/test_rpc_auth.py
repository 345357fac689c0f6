"""Replay-proof gRPC authentication (``peerckpt/rpcauth.py``): a call seen on the network
cannot be sent again, nor its body changed, nor sent once its time window has passed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from peerckpt.codec import pack, unpack
from peerckpt.errors import AuthenticationError
from peerckpt.messages import encode
from peerckpt.messages.control import Heartbeat, Status, Watch
from peerckpt.rpc import SERVICE, RpcClient, RpcServer
from peerckpt.rpcauth import CallSigner, CallVerifier

from .test_coordinator import _job

SECRET = b"right" * 8


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RpcServer, Any]]:
    # In the clear, so the test can see and resend calls as an eavesdropper would (TLS hides
    # them on a link that leaves the host; the MACs must hold on their own all the same).
    monkeypatch.setenv("PEERCKPT_TLS", "off")
    c = _job()
    unary, streams = c.handlers()
    server = RpcServer(SECRET, "j", unary, streams)
    server.start()
    yield server, c
    server.stop()


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bytes, Any]]:
    """Every call the client signs, as an eavesdropper on the link would see it."""
    seen: list[tuple[str, bytes, Any]] = []
    sign = CallSigner.metadata

    def spy(self: CallSigner, method: str, body: bytes) -> Any:
        metadata = sign(self, method, body)
        seen.append((method, body, metadata))
        return metadata

    monkeypatch.setattr(CallSigner, "metadata", spy)
    return seen


def _send_raw(address: str, method: str, body: bytes, metadata: Any) -> Any:
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(f"/{SERVICE}/{method}", response_deserializer=unpack)
        return stub(body, metadata=metadata, timeout=5.0)


def test_a_captured_call_replayed_is_refused(server, monkeypatch) -> None:
    rpc, _ = server
    seen = _captured(monkeypatch)
    client = RpcClient(rpc.address, SECRET, "j")
    try:
        assert client.call(Heartbeat(0, 0)).epoch == 0
    finally:
        client.close()
    method, body, metadata = seen[-1]
    with pytest.raises(grpc.RpcError) as replay:
        _send_raw(rpc.address, method, body, metadata)
    assert replay.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "replayed" in replay.value.details()


def test_a_call_with_a_tampered_body_is_refused(server, monkeypatch) -> None:
    rpc, coordinator = server
    seen = _captured(monkeypatch)
    client = RpcClient(rpc.address, SECRET, "j")
    try:
        client.call(Heartbeat(0, 0))
    finally:
        client.close()
    method, body, metadata = seen[-1]
    assert unpack(body) == {"node": 0, "epoch": 0, "stats": None}
    before = coordinator.registry.agents[1].last_heartbeat
    with pytest.raises(grpc.RpcError) as tampered:
        _send_raw(rpc.address, method, pack({"node": 1, "epoch": 0, "stats": None}), metadata)
    assert tampered.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "body changed in transit" in tampered.value.details()
    assert coordinator.registry.agents[1].last_heartbeat == before  # nothing was done


def test_a_call_signed_for_another_method_is_refused(server, monkeypatch) -> None:
    rpc, _ = server
    seen = _captured(monkeypatch)
    client = RpcClient(rpc.address, SECRET, "j")
    try:
        client.call(Status())
    finally:
        client.close()
    _, body, metadata = seen[-1]
    with pytest.raises(grpc.RpcError) as moved:
        _send_raw(rpc.address, "Heartbeat", body, metadata)
    assert moved.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_outside_the_time_window_is_refused_naming_the_clocks(monkeypatch) -> None:
    signer, verifier = CallSigner(SECRET, "j"), CallVerifier(SECRET, "j", window_s=30.0)
    metadata = signer.metadata("Heartbeat", b"x")
    now = __import__("time").time
    monkeypatch.setattr("peerckpt.rpcauth.time.time", lambda: now() + 31.0)
    with pytest.raises(AuthenticationError, match=r"clocks disagree; synchronise them \(NTP\)"):
        verifier.verify("Heartbeat", metadata, b"x")


def test_the_replay_cache_forgets_calls_once_their_window_passed(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("peerckpt.rpcauth.time.time", lambda: clock[0])
    signer, verifier = CallSigner(SECRET, "j"), CallVerifier(SECRET, "j", window_s=1.0)
    for _ in range(100):
        verifier.verify("Heartbeat", signer.metadata("Heartbeat", b"x"), b"x")
    assert len(verifier._seen) == 100
    clock[0] += 2.5
    verifier.verify("Heartbeat", signer.metadata("Heartbeat", b"x"), b"x")
    assert len(verifier._seen) == 1  # bounded: the old nonces are forgotten


def test_a_static_token_of_the_old_scheme_is_refused(server) -> None:
    rpc, _ = server
    import hashlib
    import hmac

    token = hmac.new(SECRET, b"j:Status", hashlib.sha256).hexdigest()
    with pytest.raises(grpc.RpcError) as old:
        _send_raw(rpc.address, "Status", pack({}), (("peerckpt-auth", token),))
    assert old.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no peerckpt v2 authentication" in old.value.details()


def _impostor(reply: Any) -> tuple[grpc.Server, str]:
    """A gRPC server on the coordinator's service that does not hold the secret: it answers
    every call with ``reply`` (and every stream with it, as an event)."""
    from concurrent import futures

    def unary(body: bytes, context: Any) -> bytes:
        return pack(reply)

    def stream(body: bytes, context: Any) -> Any:
        yield pack([pack(reply), "0" * 64])

    handlers = {
        "Status": grpc.unary_unary_rpc_method_handler(unary),
        "Watch": grpc.unary_stream_rpc_method_handler(stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_an_answer_that_does_not_prove_the_secret_is_refused(server, monkeypatch) -> None:
    """The audit's impersonation: a local user bound the restarted coordinator's ports and
    received the job's calls; whatever it answers now is refused, naming why."""
    rpc, _ = server
    real = RpcClient(rpc.address, SECRET, "j")
    genuine = real.call(Status())  # what a real answer says
    real.close()
    impostor, address = _impostor(encode(genuine))
    client = RpcClient(address, SECRET, "j")
    try:
        with pytest.raises(AuthenticationError, match="did not prove the job's secret"):
            client.call(Status())
        with pytest.raises(AuthenticationError, match="did not prove the job's secret"):
            next(iter(client.stream(Watch(node=0))))
    finally:
        client.close()
        impostor.stop(0)


def test_a_call_to_a_coordinator_replayed_to_its_successor_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("PEERCKPT_TLS", "off")
    seen = _captured(monkeypatch)
    first = RpcServer(SECRET, "j", *_job().handlers())
    first.start()
    client = RpcClient(first.address, SECRET, "j")
    try:
        client.call(Heartbeat(node=0, epoch=0))
    finally:
        client.close()
        first.stop()
    __import__("time").sleep(0.6)  # past the successor's slack for calls just before it
    second = RpcServer(SECRET, "j", *_job().handlers())
    second.start()
    try:
        _, body, metadata = seen[-1]
        with pytest.raises(grpc.RpcError) as replayed:
            _send_raw(second.address, "Heartbeat", body, metadata)
        assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "before this coordinator started" in (replayed.value.details() or "")
    finally:
        second.stop()


def test_a_coordinator_address_in_torchruns_store_must_prove_the_secret() -> None:
    from peerckpt.rpcauth import open_address, sign_address

    published = sign_address(SECRET, "j", "10.0.0.1:29500")
    assert open_address(SECRET, "j", published, "the store") == "10.0.0.1:29500"
    for forged in (
        "10.6.6.6:29500",  # unsigned, as the store takes from anyone
        published.replace("10.0.0.1", "10.6.6.6"),  # another address under a real MAC
        sign_address(b"other" * 8, "j", "10.6.6.6:29500"),  # signed by another job's secret
    ):
        with pytest.raises(AuthenticationError, match="not signed with this job's secret"):
            open_address(SECRET, "j", forged, "the store")
