"""The agent's own guards, driven directly (no coordinator is contacted), and its first
registration with a coordinator that is away."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from peerckpt.errors import PeerckptError, PeerUnavailable
from peerckpt.messages.control import RegisterAgent
from peerckpt.messages.local import AllocSlot, SlotGranted, SnapshotTaken
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.replication.agent import Agent
from peerckpt.rpc import RpcClient, RpcServer

from .conftest import write_snapshot


@pytest.fixture
def agent(tmp_path, job):
    name, secret = job
    a = Agent(
        name, node=0, secret=secret, coordinator="127.0.0.1:1", socket_path=str(tmp_path / "a.sock")
    )
    yield a
    a.close()


def test_a_rank_cannot_reallocate_the_slot_holding_the_committed_step(agent) -> None:
    write_snapshot(agent.store, rank=1, step=5, index=0)
    agent.committed_step = 5
    with pytest.raises(PeerckptError, match="holds committed step 5"):
        agent._requests.handle(AllocSlot(0, 1, 0, 1 << 20), None)
    reply = agent._requests.handle(AllocSlot(0, 1, 1, 1 << 20), None)
    assert isinstance(reply, SlotGranted) and reply.size >= 1 << 20
    assert agent.store.find(0, 1, 5) is not None  # the committed copy is untouched


def test_a_snapshot_notice_of_an_ended_epoch_is_never_replicated(agent) -> None:
    slot = write_snapshot(agent.store, rank=1, step=6, index=1)
    manifest, slot.manifest = slot.manifest, None
    agent.epoch = 3  # no membership for epoch 2 any more
    agent._requests.handle(SnapshotTaken(2, 1, 6, 1, manifest), None)
    assert slot.manifest is None and not agent.mirroring._senders


class Refusals:
    """The agent's coordinator client, passed through; ``refused`` is set once a call found
    nobody listening."""

    def __init__(self, rpc: RpcClient) -> None:
        self.rpc = rpc
        self.calls: list[Any] = []
        self.refused = threading.Event()

    def call(self, msg: Any, timeout: float = 10.0) -> Any:
        self.calls.append(msg)
        try:
            return self.rpc.call(msg, timeout=timeout)
        except PeerUnavailable:
            self.refused.set()
            raise

    def stream(self, msg: Any) -> Any:
        return self.rpc.stream(msg)

    def call_stream(self) -> Any:
        return self.rpc.call_stream()

    def close(self) -> None:
        self.rpc.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_an_agent_started_while_the_coordinator_is_away_waits_for_it_and_registers(
    tmp_path, job
) -> None:
    """A spare node the launcher started just before the coordinator died: its agent is
    refused, waits, and registers with the restarted coordinator instead of failing (which
    failed the launcher's job, and with it the coordinator's restart)."""
    name, secret = job
    port = _free_port()
    agent = Agent(
        name, node=3, secret=secret, coordinator=f"127.0.0.1:{port}",
        socket_path=str(tmp_path / "a.sock"), spare_node=True,
    )  # fmt: skip
    calls = Refusals(agent.coordinator.rpc)
    agent.coordinator.rpc = calls  # type: ignore[assignment]
    errors: list[BaseException] = []

    def start() -> None:
        try:
            agent.start()
        except BaseException as exc:
            errors.append(exc)

    starting = threading.Thread(target=start, name="test-agent-start")
    coordinator = Coordinator(name, world_size=2, replicas=1, store_addr="127.0.0.1:1")
    unary, streams = coordinator.handlers()
    server = RpcServer(secret, name, unary, streams, port=port, inline=Coordinator.INLINE)
    try:
        starting.start()
        assert calls.refused.wait(30.0), "the agent never called the coordinator"
        server.start()  # the restarted coordinator, where the last one listened
        starting.join(60.0)
        assert not starting.is_alive()
        assert errors == []
        registered = coordinator.registry.agents[3]
        assert registered.spare_node and registered.alive
        assert [type(m) for m in calls.calls[-1:]] == [RegisterAgent]
        assert len(calls.calls) >= 2  # refused, then registered
    finally:
        agent.close()
        starting.join(10.0)
        server.stop()
        coordinator.close()


def test_a_spares_settings_replace_the_defaults_it_said_hello_with() -> None:
    # A spare says hello at `import peerckpt`, before its decorator runs; once it has taken a
    # rank it sends the decorator's settings, and its agent's report (to a restarted
    # coordinator) says them.
    import types

    from peerckpt.messages.local import ProcHello, ProcSettings
    from peerckpt.replication.agent import _proc_report
    from peerckpt.states import ProcRole

    link = types.SimpleNamespace(
        pid=7, role=ProcRole.SPARE, rank=None, hello=ProcHello(ProcRole.SPARE, 7)
    )
    assert _proc_report(link).replicas is None  # type: ignore[arg-type]
    Agent._on_settings(None, ProcSettings(2, None, "3+1"), link)  # type: ignore[arg-type]
    report = _proc_report(link)  # type: ignore[arg-type]
    assert (report.replicas, report.persist, report.erasure) == (2, None, "3+1")
