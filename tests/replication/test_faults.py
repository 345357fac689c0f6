"""The inside half of the chaos harness: fencing a silent process, network faults, phase points."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from peerckpt.chaos import points
from peerckpt.errors import PeerUnavailable, StaleEpoch
from peerckpt.replication.control import ControlServer, ProcLink
from peerckpt.replication.wire import Connection, connect_unix
from peerckpt.runtime.channel import AgentChannel


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


def _tcp_pair() -> tuple[Connection, Connection, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return Connection(client, "peer"), Connection(accepted, "server"), listener


@pytest.fixture
def net_faults(tmp_path, monkeypatch):
    monkeypatch.setenv(points.ENV, str(tmp_path))
    # Recorded first, so that the teardown puts back None, not the faults installed here
    # (every later test's connections would be paced by them).
    monkeypatch.setattr(points, "FAULTS", None)
    faults = points.install_net_faults(node=4)
    assert faults is not None
    yield faults, tmp_path / "net-4.json"
    faults.stop()


def _write(path, fault: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(fault))
    os.replace(path.with_suffix(".tmp"), path)


def test_a_partition_cuts_open_links_refuses_new_traffic_and_heals(net_faults) -> None:
    faults, path = net_faults
    a, b, listener = _tcp_pair()
    try:
        a.send({"type": "x"})
        assert b.recv_header()["type"] == "x"
        blocked: list[BaseException] = []
        reader = threading.Thread(target=lambda: blocked.append(_recv_error(b)))
        reader.start()
        _write(path, {"partition_until": time.time() + 0.5})
        assert _wait(faults.partitioned)
        reader.join(5.0)
        assert isinstance(blocked[0], PeerUnavailable)  # a blocked receive is cut at once
        c, d, listener2 = _tcp_pair()
        with pytest.raises(PeerUnavailable, match=r"cut \(chaos: partition\)"):
            c.send({"type": "y"})
        started = time.monotonic()
        faults.wait_healed()
        assert not faults.partitioned() and time.monotonic() - started < 2.0
        c.send({"type": "z"})  # healed: a new send goes through
        assert d.recv_header()["type"] == "z"
        c.close(), d.close(), listener2.close()
    finally:
        a.close(), b.close(), listener.close()


def _recv_error(conn: Connection) -> BaseException | None:
    try:
        conn.recv_header()
    except BaseException as exc:
        return exc
    return None


def test_a_slow_link_paces_what_it_sends(net_faults) -> None:
    faults, path = net_faults
    _write(path, {"rate": 4e6, "slow_until": 0.0})
    assert _wait(lambda: faults.rate == 4e6)
    a, b, listener = _tcp_pair()
    try:
        payload = bytes(1 << 20)
        got = bytearray(1 << 20)
        receiver = threading.Thread(
            target=lambda: b.recv_payload_into(b.recv_header(), memoryview(got))
        )
        receiver.start()
        started = time.monotonic()
        a.send({"type": "data"}, payload)
        elapsed = time.monotonic() - started
        receiver.join(5.0)
        # 1 MiB at 4 MB/s takes at least a quarter of a second (pacing is never early).
        assert elapsed >= 0.25 and bytes(got) == payload
    finally:
        a.close(), b.close(), listener.close()


def test_a_phase_point_holds_the_process_that_strikes_it_until_released(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(points.ENV, str(tmp_path))
    (tmp_path / "armed-3.json").write_text(json.dumps({"phase": "snapshot", "match": {"rank": 2}}))
    assert not points.strike_point("snapshot", rank=1, node=0, step=5)  # not the armed rank
    assert not points.strike_point("replication", rank=2, node=1, step=5)  # not the phase
    struck: list[bool] = []
    holder = threading.Thread(
        target=lambda: struck.append(points.strike_point("snapshot", rank=2, node=1, step=7))
    )
    holder.start()
    assert _wait(lambda: (tmp_path / "hit-3.json").exists())
    time.sleep(0.1)
    assert holder.is_alive()  # held still inside the phase
    where = json.loads((tmp_path / "hit-3.json.where").read_text())
    assert where == {"rank": 2, "node": 1, "step": 7, "pid": os.getpid()}
    (tmp_path / "done-3").write_text("")
    holder.join(5.0)
    assert struck == [True]
    assert not points.strike_point("snapshot", rank=2, node=1, step=8)  # it fires once
