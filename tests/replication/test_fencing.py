"""Fencing: a local process that falls silent is declared lost and never heard again."""

from __future__ import annotations

import os
import time

from peerckpt.errors import StaleEpoch
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.messages import decode, encode
from peerckpt.messages.local import (
    Abort,
    AllocSlot,
    Fenced,
    Granted,
    ProcHello,
    Reply,
    Restarting,
    SnapshotTaken,
)
from peerckpt.replication.control import ControlServer, ProcLink
from peerckpt.runtime.channel import AgentChannel
from peerckpt.states import ProcRole
from peerckpt.wire import connect_unix


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_process_that_stops_beating_is_fenced_and_its_requests_refused(tmp_path) -> None:
    seen: list[type] = []
    lost: list[ProcLink] = []
    server = ControlServer(
        str(tmp_path / "a.sock"),
        b"s" * 32,
        "job",
        lambda link, msg: seen.append(type(msg)) or Granted(),
        lost.append,
        lambda link: None,
    )
    server.start()
    events: list = []
    hello = ProcHello(ProcRole.RANK, os.getpid(), 3)
    channel = AgentChannel(str(tmp_path / "a.sock"), b"s" * 32, "job", hello, events.append)
    silent = connect_unix(
        str(tmp_path / "a.sock"), b"s" * 32, "job", hello=encode(ProcHello(ProcRole.RANK, -7, 1))
    )
    try:
        assert _wait(lambda: server.link_of(-7) is not None)
        time.sleep(0.6)
        # The beating channel is never silent for 0.5 s; the bare connection is.
        assert [link.pid for link in server.silent(0.5)] == [-7]
        link = server.link_of(-7)
        assert link is not None
        server.fence(link, "declared lost: no heartbeat")
        assert server.link_of(-7) is None and server.silent(0.5) == []
        assert silent.recv_msg(Fenced) == Fenced("declared lost: no heartbeat")
        # Whatever it sends after waking is dropped; a request gets an error, not an answer.
        manifest = SnapshotManifest(
            1, 0, 0, (ChunkRecord("w", "uint8", (4,), (0,), (4,), 0, 4),), 4
        )
        silent.send_msg(SnapshotTaken(0, 1, 0, 0, manifest))
        header, payload = {**encode(AllocSlot(0, 1, 0, 64)), "req": 1}, None
        silent.send(header, payload)
        reply = silent.recv_msg(Reply)
        assert reply.req == 1 and reply.error == StaleEpoch.__name__
        assert reply.message.startswith("fenced")
        assert SnapshotTaken not in seen and AllocSlot not in seen
        server.broadcast(Abort(1))
        assert _wait(lambda: Abort(1) in events)
        # The live process is still served.
        assert channel.request(Restarting("test"), Granted, timeout=5.0) == Granted()
        assert Restarting in seen
    finally:
        silent.close()
        channel.close()
        server.stop()
    assert decode(encode(reply), Reply) == reply
