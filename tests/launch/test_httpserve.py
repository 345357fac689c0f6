"""The metrics and status server under abuse (``launch/httpserve.py``): held
half-sent requests cost a bounded number of connections and never keep a scraper out; a
request that never ends is cut at its deadline; on loopback a foreign ``Host`` is refused."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from peerckpt.launch.httpserve import HttpLimits
from peerckpt.launch.monitor import JobMonitor, MonitorServer
from tests.launch.observed import status


@pytest.fixture
def server() -> Iterator[MonitorServer]:
    monitor = JobMonitor()
    monitor.observe(status(), [], [])
    served = MonitorServer(monitor, "127.0.0.1", 0)
    served.start()
    yield served
    served.stop()


def _get(
    address: str, path: str, host: str | None = None, timeout: float = 2.0
) -> tuple[int, bytes]:
    name, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(name, int(port), timeout=timeout)
    try:
        headers = {"Host": host} if host is not None else {}
        conn.request("GET", path, headers=headers)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _half_sent(address: str, count: int) -> list[socket.socket]:
    name, _, port = address.rpartition(":")
    held = []
    for _ in range(count):
        sock = socket.create_connection((name, int(port)))
        sock.sendall(b"GET /metr")  # and never the rest
        held.append(sock)
    return held


def test_a_scraper_is_answered_while_200_half_sent_requests_are_held(server) -> None:
    held = _half_sent(server.address, 200)
    try:
        for _ in range(5):  # the client waits at most 2 s for each answer
            code, body = _get(server.address, "/metrics")
            assert code == 200 and b"peerckpt_" in body
            # the held ones cost a bounded number of connections (and threads), not 200
            assert server._server.open_connections() <= HttpLimits().max_conns
        # and every one of them is closed by the server, none waits for its sender
        closed = 0
        for sock in held:
            sock.settimeout(10.0)
            try:
                closed += sock.recv(1) in (b"", b"H")  # cut, or answered as bad
            except OSError:
                closed += 1
        assert closed == len(held)
    finally:
        for sock in held:
            sock.close()


def test_a_request_that_never_ends_is_cut_at_its_deadline() -> None:
    monitor = JobMonitor()
    served = MonitorServer(monitor, "127.0.0.1", 0, HttpLimits(read_s=5.0, request_s=1.0))
    served.start()
    try:
        [sock] = _half_sent(served.address, 1)
        sock.settimeout(0.5)
        closed = False
        for _ in range(20):  # a byte every 0.5 s: never idle for read_s
            try:
                sock.sendall(b"x")
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        sock.close()
        assert closed and served._server.cut >= 1
    finally:
        served.stop()


def test_on_loopback_a_foreign_host_name_is_refused(server) -> None:
    assert _get(server.address, "/metrics", host="evil.example:80")[0] == 421
    assert (
        _get(server.address, "/metrics", host=f"localhost:{server.address.rpartition(':')[2]}")[0]
        == 200
    )
    assert _get(server.address, "/status.json", host="127.0.0.1")[0] == 200


def test_the_servers_threads_end_with_it() -> None:
    monitor = JobMonitor()
    served = MonitorServer(monitor, "127.0.0.1", 0)
    served.start()
    held = _half_sent(served.address, 5)
    served.stop()
    for sock in held:
        sock.close()
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name == "peerckpt-metrics"]
