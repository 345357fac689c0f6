"""The agent's reports of replicated snapshots: those ready while one is on its way go together."""

from __future__ import annotations

import threading
import time
from typing import Any

from peerckpt.errors import StaleEpoch
from peerckpt.messages.control import Replicated, ReplicatedMany, ReplicatedReply
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
