"""The agent's link to the coordinator: reports of replicated snapshots (those ready while one
is on its way go together), and a first registration while the coordinator is away."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from peerckpt.errors import AuthenticationError, PeerckptError, PeerUnavailable, StaleEpoch
from peerckpt.messages.control import (
    AgentConfig,
    RegisterAgent,
    Replicated,
    ReplicatedMany,
    ReplicatedReply,
)
from peerckpt.replication.coordlink import CoordinatorLink


class SlowRpc:
    """Records the calls; the first waits until the test lets it go."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.first_in = threading.Event()
        self.release = threading.Event()

    def call(self, msg: Any, timeout: float = 10.0) -> ReplicatedReply:
        self.calls.append(msg)
        if len(self.calls) == 1:
            self.first_in.set()
            assert self.release.wait(10.0)
        return ReplicatedReply(None)

    def close(self) -> None:
        pass

    def call_stream(self) -> Any:
        """The node's stream of calls: here, the fake's own calls."""
        return _Stream(self)


class _Stream:
    broken = None
    unsupported = False

    def __init__(self, rpc: SlowRpc) -> None:
        self.call = rpc.call

    def close(self) -> None:
        pass


def _report(rank: int) -> Replicated:
    return Replicated(0, 0, rank, 5, [0, 1], 10, 4)


def test_reports_ready_while_one_is_on_its_way_go_in_one_call_in_order() -> None:
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 0, threading.Event())
    link.rpc.close()
    rpc = SlowRpc()
    link.rpc = rpc  # type: ignore[assignment]
    first = threading.Thread(target=link.report_replicated, args=(_report(0),))
    first.start()
    assert rpc.first_in.wait(10.0)
    for rank in (1, 2, 3):  # the first is on its way: these return at once, queued
        link.report_replicated(_report(rank))
    assert len(rpc.calls) == 1
    rpc.release.set()
    first.join(10.0)
    assert not first.is_alive()
    assert rpc.calls == [_report(0), ReplicatedMany(0, [_report(1), _report(2), _report(3)])]
    link.report_replicated(_report(4))  # nothing on its way: sent alone, at once
    assert rpc.calls[-1] == _report(4)


class RefusingRpc(SlowRpc):
    def call(self, msg: Any, timeout: float = 10.0) -> ReplicatedReply:
        self.calls.append(msg)
        raise StaleEpoch("epoch 3 is over")


def test_only_a_report_the_coordinator_took_stands_for_a_heartbeat() -> None:
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 0, threading.Event())
    link.rpc.close()
    link.rpc = RefusingRpc()  # type: ignore[assignment]
    link.report_replicated(_report(0))
    assert link.reported_at == float("-inf")  # refused: the agent still heart-beats
    link.rpc = SlowRpc()  # type: ignore[assignment]
    link.rpc.release.set()
    before = time.monotonic()
    link.report_replicated(_report(1))
    assert link.reported_at >= before


class FlakyRpc(SlowRpc):
    """Refuses (as a timed-out call) the calls whose number is in ``fail``; takes the rest."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail = fail

    def call(self, msg: Any, timeout: float = 10.0) -> ReplicatedReply:
        self.calls.append(msg)
        if len(self.calls) in self.fail:
            raise PeerckptError("deadline exceeded")
        return ReplicatedReply(None)


def test_a_layout_the_coordinator_did_not_take_travels_on_the_next_report() -> None:
    """The layout goes once per epoch; lost, the coordinator could commit nothing more."""
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 0, threading.Event())
    link.rpc.close()
    rpc = FlakyRpc(fail={1})
    link.rpc = rpc  # type: ignore[assignment]
    layout = [["w", "float32", [4], [0], [4], 0, 16]]
    link.report_replicated(replace(_report(0), layout=layout))  # refused
    link.report_replicated(replace(_report(0), step=6))
    link.report_replicated(replace(_report(0), step=7))
    assert [c.layout for c in rpc.calls] == [layout, layout, None]  # taken once: not again
    assert rpc.calls[1].step == 6


def test_an_owed_layout_is_dropped_with_its_epoch_and_a_new_layout_supersedes_it() -> None:
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 0, threading.Event())
    link.rpc.close()
    rpc = FlakyRpc(fail={1, 2})
    link.rpc = rpc  # type: ignore[assignment]
    old, new = [["a", "float32", [4], [0], [4], 0, 16]], [["b", "float32", [8], [0], [8], 0, 32]]
    link.report_replicated(replace(_report(0), layout=old))  # epoch 0, refused
    link.report_replicated(replace(_report(1), layout=old))  # rank 1, refused
    link.report_replicated(replace(_report(1), step=6, layout=new))  # its own layout wins
    link.report_replicated(replace(_report(0), epoch=1, step=9))  # epoch 0 is over
    assert [c.layout for c in rpc.calls] == [old, old, new, None]


class AwayRpc(SlowRpc):
    """A coordinator that does not answer the first ``away`` calls, then registers."""

    def __init__(self, away: int, error: PeerckptError | None = None) -> None:
        super().__init__()
        self.away = away
        self.error = error

    def call(self, msg: Any, timeout: float = 10.0) -> Any:
        self.calls.append(msg)
        if self.error is not None:
            raise self.error
        if len(self.calls) <= self.away:
            raise PeerUnavailable("coordinator at 127.0.0.1:1 did not answer RegisterAgent")
        return AgentConfig(1, 5.0)


def test_a_first_registration_waits_while_the_coordinator_does_not_answer() -> None:
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 4, threading.Event())
    link.rpc.close()
    link.rpc = AwayRpc(away=3)  # type: ignore[assignment]
    assert link.register(RegisterAgent(4, "127.0.0.1:9", True), grace_s=30.0) == AgentConfig(1, 5.0)
    assert len(link.rpc.calls) == 4


def test_a_coordinator_that_answers_with_a_refusal_is_not_waited_for() -> None:
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 4, threading.Event())
    link.rpc.close()
    link.rpc = AwayRpc(away=0, error=AuthenticationError("wrong job secret"))  # type: ignore[assignment]
    with pytest.raises(AuthenticationError, match="wrong job secret"):
        link.register(RegisterAgent(4, "127.0.0.1:9"), grace_s=30.0)
    assert len(link.rpc.calls) == 1


def test_a_coordinator_silent_for_the_whole_grace_period_fails_the_agent_naming_the_fix() -> None:
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 4, threading.Event())
    link.rpc.close()
    link.rpc = AwayRpc(away=1 << 30)  # type: ignore[assignment]
    with pytest.raises(PeerUnavailable, match=r"node 4's agent could not register.*--coordinator"):
        link.register(RegisterAgent(4, "127.0.0.1:9"), grace_s=0.5)


def test_an_agent_told_to_stop_while_it_waits_for_the_coordinator_stops_waiting() -> None:
    stopping = threading.Event()
    link = CoordinatorLink("127.0.0.1:1", b"s" * 32, "j", 4, stopping)
    link.rpc.close()
    link.rpc = AwayRpc(away=1 << 30)  # type: ignore[assignment]
    stopping.set()
    with pytest.raises(PeerckptError, match="stopped while it waited"):
        link.register(RegisterAgent(4, "127.0.0.1:9"), grace_s=30.0)
    assert len(link.rpc.calls) == 1
