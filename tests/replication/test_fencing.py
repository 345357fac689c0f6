"""Fencing: a local process that falls silent is declared lost and never heard again."""

from __future__ import annotations

import time

from peerckpt.errors import StaleEpoch
from peerckpt.replication.control import ControlServer, ProcLink
from peerckpt.runtime.channel import AgentChannel
from peerckpt.wire import connect_unix


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_process_that_stops_beating_is_fenced_and_its_requests_refused(tmp_path) -> None:
    seen: list[str] = []
    lost: list[ProcLink] = []
    server = ControlServer(
        str(tmp_path / "a.sock"),
        b"s" * 32,
        "job",
        lambda link, msg: seen.append(msg["type"]) or {},
        lost.append,
    )
    server.start()
    events: list[dict] = []
    channel = AgentChannel(str(tmp_path / "a.sock"), b"s" * 32, "job", "rank", 3, events.append)
    silent = connect_unix(str(tmp_path / "a.sock"), b"s" * 32, "job", role="rank", pid=-7)
    try:
        assert _wait(lambda: server.link_of(-7) is not None)
        time.sleep(0.6)
        # The beating channel is never silent for 0.5 s; the bare connection is.
        assert [link.pid for link in server.silent(0.5)] == [-7]
        link = server.link_of(-7)
        assert link is not None
        server.fence(link, "declared lost: no heartbeat")
        assert server.link_of(-7) is None and server.silent(0.5) == []
        header, _ = silent.recv_message()
        assert header == {"type": "fenced", "reason": "declared lost: no heartbeat", "len": 0}
        # Whatever it sends after waking is dropped; a request gets an error, not an answer.
        silent.send({"type": "snapshot", "epoch": 0})
        silent.send({"type": "alloc", "req": 1, "rank": 3})
        reply, _ = silent.recv_message()
        assert reply["req"] == 1 and reply["error"].startswith("StaleEpoch: fenced")
        assert "snapshot" not in seen and "alloc" not in seen
        server.broadcast({"type": "abort", "epoch": 1})
        assert _wait(lambda: any(e["type"] == "abort" for e in events))
        channel.request("ping", timeout=5.0)  # the live process is still served
        assert "ping" in seen
    finally:
        silent.close()
        channel.close()
        server.stop()
    assert StaleEpoch.__name__ in reply["error"]
