"""The chaos harness's hooks inside job processes: network faults and phase points."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from peerckpt import faults
from peerckpt.chaos.points import ChaosHooks, NetFaults, StepGates
from peerckpt.errors import MembershipChanged, PeerUnavailable
from peerckpt.faults import NetHooks
from peerckpt.wire import Connection


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _tcp_pair(net: NetHooks | None) -> tuple[Connection, Connection, socket.socket]:
    listener = socket.create_server(("127.0.0.2", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return Connection(client, "peer", net), Connection(accepted, "server", net), listener


@pytest.fixture
def net_faults(tmp_path):
    # The way an agent gets them: the launcher's fault directory in its environment, the
    # chaos package's factory found through the ``peerckpt.faults`` entry point.
    hooks = faults.load(node=4, network=True, environ={faults.ENV: str(tmp_path)})
    assert isinstance(hooks, ChaosHooks) and isinstance(hooks.net, NetFaults)
    yield hooks.net, tmp_path / "net-4.json"
    hooks.close()


def test_without_a_fault_directory_a_process_gets_no_hooks() -> None:
    hooks = faults.load(node=0, network=True, environ={})
    assert hooks is faults.NO_FAULTS and not hooks.active and hooks.net is None
    assert hooks.strike("snapshot", rank=0) is False


def _write(path, fault: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(fault))
    os.replace(path.with_suffix(".tmp"), path)


def test_a_partition_cuts_open_links_refuses_new_traffic_and_heals(net_faults) -> None:
    net, path = net_faults
    a, b, listener = _tcp_pair(net)
    try:
        a.send({"type": "x"})
        assert b.recv_header()["type"] == "x"
        blocked: list[BaseException] = []
        reader = threading.Thread(target=lambda: blocked.append(_recv_error(b)))
        reader.start()
        _write(path, {"partition_until": time.time() + 0.5})
        assert _wait(net.partitioned)
        reader.join(5.0)
        assert isinstance(blocked[0], PeerUnavailable)  # a blocked receive is cut at once
        c, d, listener2 = _tcp_pair(net)
        with pytest.raises(PeerUnavailable, match=r"cut \(chaos: partition\)"):
            c.send({"type": "y"})
        started = time.monotonic()
        net.wait_healed()
        assert not net.partitioned() and time.monotonic() - started < 2.0
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
    net, path = net_faults
    _write(path, {"rate": 4e6, "slow_until": 0.0})
    assert _wait(lambda: net.rate == 4e6)
    a, b, listener = _tcp_pair(net)
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


def test_a_phase_point_holds_the_process_that_strikes_it_until_released(tmp_path) -> None:
    hooks = faults.load(node=1, environ={faults.ENV: str(tmp_path)})
    assert hooks.active and hooks.net is None  # a rank: phase points, no network faults
    (tmp_path / "armed-3.json").write_text(json.dumps({"phase": "snapshot", "match": {"rank": 2}}))
    assert not hooks.strike("snapshot", rank=1, node=0, step=5)  # not the armed rank
    assert not hooks.strike("replication", rank=2, node=1, step=5)  # not the phase
    struck: list[bool] = []
    holder = threading.Thread(
        target=lambda: struck.append(hooks.strike("snapshot", rank=2, node=1, step=7))
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
    assert not hooks.strike("snapshot", rank=2, node=1, step=8)  # it fires once


def _gates(directory, steps: list[int]) -> None:
    (directory / "gates.json").write_text(json.dumps(steps))


def test_a_step_point_announces_its_step_and_holds_the_next_boundary_until_released(
    tmp_path,
) -> None:
    _gates(tmp_path, [3])
    hooks = faults.load(node=0, environ={faults.ENV: str(tmp_path)})
    where = {"rank": 1, "node": 0, "epoch": 0, "total": 10}
    for step in range(3):  # steps no action waits for pass freely, and announce nothing
        hooks.reach(step, **where)
    assert not (tmp_path / "reached-3").exists()
    assert json.loads((tmp_path / "loop.json").read_text()) == {"total": 10}
    hooks.reach(3, **where)  # step 3 runs at once: the fault lands while it runs
    reached = json.loads((tmp_path / "reached-3").read_text())
    assert reached == {**where, "step": 3, "pid": os.getpid()}
    holder = threading.Thread(target=hooks.reach, args=(4,), kwargs=where)
    holder.start()
    time.sleep(0.2)
    assert holder.is_alive()  # step 4 waits until the monkey has fired step 3's faults
    (tmp_path / "released-3").write_text("")
    holder.join(5.0)
    assert not holder.is_alive()
    hooks.reach(3, **where)  # re-run after a restore: released, nothing announced or held
    hooks.reach(10, **where)  # the loop's end
    assert json.loads((tmp_path / "ended.json").read_text()) == {"step": 9}


def test_the_last_step_holds_the_loop_end_and_a_hold_is_bounded(tmp_path) -> None:
    _gates(tmp_path, [4])
    gates = StepGates(str(tmp_path), hold_s=0.3)
    where = {"rank": 0, "node": 0, "epoch": 0, "total": 5}
    gates.reach(4, **where)
    started = time.monotonic()
    gates.reach(5, **where)  # the end of the loop waits too, but never longer than hold_s
    assert 0.3 <= time.monotonic() - started < 5.0
    assert not (tmp_path / "released-4").exists()


def test_a_hold_ends_when_the_epoch_does_and_the_step_stays_owed(tmp_path) -> None:
    # A node added at step 4 joins while the ranks hold after it: the new epoch's abort must
    # reach them there, and the re-entered loop holds again until the monkey saw the join.
    _gates(tmp_path, [4])
    gates = StepGates(str(tmp_path), hold_s=30.0)
    where = {"rank": 0, "node": 0, "epoch": 0, "total": 10}
    gates.reach(4, **where)
    ended = threading.Event()

    def check() -> None:
        if ended.is_set():
            raise MembershipChanged("epoch 0 ended")

    threading.Timer(0.2, ended.set).start()
    started = time.monotonic()
    with pytest.raises(MembershipChanged):
        gates.reach(5, check, **where)
    assert time.monotonic() - started < 5.0
    holder = threading.Thread(target=gates.reach, args=(3,), kwargs=where)  # re-entered
    holder.start()
    time.sleep(0.2)
    assert holder.is_alive()
    (tmp_path / "released-4").write_text("")
    holder.join(5.0)
    assert not holder.is_alive()
