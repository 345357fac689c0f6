"""One coordinator holds the event streams of more agents than its RPC server has threads.

The agents are real ``CoordinatorLink``s (the agent's client of the coordinator) talking to a
real ``RpcServer``: each registers, opens its ``Watch`` stream, reports its rank, and must
see epoch 0 open and step 0 commit. A server that gives each stream a thread of a 64-thread
pool serves 64 of them and leaves the rest (and every later call) waiting.
"""

from __future__ import annotations

import threading
import time

from peerckpt.manifest import ChunkRecord
from peerckpt.messages.control import (
    Commit,
    EpochOpened,
    Event,
    ProcJoined,
    ProcReport,
    RegisterAgent,
    Replicated,
)
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.replication.coordlink import CoordinatorLink
from peerckpt.rpc import RpcServer
from peerckpt.states import ProcRole

SECRET = b"s" * 32
NODES = 100  # more than the 64 threads the server used to hold one each
DEADLINE_S = 60.0
LAYOUT = [ChunkRecord("w", "float32", (4,), (0,), (4,), 0, 16).to_msg()]


class Follower:
    """One node's event stream, read on its own thread until step 0 commits."""

    def __init__(self, link: CoordinatorLink) -> None:
        self.link = link
        self.events: list[Event] = []
        self.committed = threading.Event()
        self.stream = link.watch()
        self.thread = threading.Thread(target=self._read, name=f"follow-{link.node}")
        self.thread.start()

    def _read(self) -> None:
        try:
            for event in self.stream:
                self.events.append(event)
                if isinstance(event, Commit):
                    self.committed.set()
                    return
        except Exception:  # cancelled at the end of the test
            return


def _wait(flags: list[threading.Event], deadline: float) -> int:
    """How many of ``flags`` were set before ``deadline``."""
    for flag in flags:
        flag.wait(max(0.0, deadline - time.monotonic()))
    return sum(flag.is_set() for flag in flags)


def test_a_hundred_agents_hold_their_streams_and_all_see_the_epoch_and_the_commit() -> None:
    c = Coordinator("j", world_size=NODES, replicas=1, store_addr="127.0.0.1:1")
    unary, streams = c.handlers()
    server = RpcServer(SECRET, "j", unary, streams, inline=Coordinator.INLINE)
    server.start()
    stopping = threading.Event()
    links = [CoordinatorLink(server.address, SECRET, "j", n, stopping) for n in range(NODES)]
    followers: list[Follower] = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        for n, link in enumerate(links):
            link.call(RegisterAgent(n, f"127.0.0.1:{2000 + n}"), timeout=DEADLINE_S)
            followers.append(Follower(link))
        for n, link in enumerate(links):  # every stream is open before the last rank joins
            link.call(ProcJoined(n, ProcReport(1000 + n, ProcRole.RANK, n)), timeout=DEADLINE_S)
        epoch = c.epochs.membership
        assert epoch is not None and epoch.world_size == NODES
        placement = epoch.placement
        for n, link in enumerate(links):
            holders = [n, *placement[n]]
            report = Replicated(n, 0, n, 0, holders, 16, 4, layout=LAYOUT)
            link.call(report, timeout=max(1.0, deadline - time.monotonic()))
        got = _wait([f.committed for f in followers], deadline)
        assert got == NODES, f"only {got} of {NODES} agents saw step 0 commit"
        for f in followers:
            assert isinstance(f.events[0], EpochOpened) and f.events[0].membership == epoch
            assert f.events[-1] == Commit(0, 0, largest_snapshot=16)
    finally:
        stopping.set()
        for f in followers:
            f.stream.cancel()
        for f in followers:
            f.thread.join(5.0)
        for link in links:
            link.close()
        server.stop()
        c.close()
    assert not any(f.thread.is_alive() for f in followers)
