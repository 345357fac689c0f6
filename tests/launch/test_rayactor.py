"""The Ray actor without a Ray cluster: its report of its host launcher's end (the launcher
and the raylet are stand-in processes the test kills), where that end is written, and the
orders it opens."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerckpt.errors import AuthenticationError
from peerckpt.launch import rayhost
from peerckpt.launch.rayactor import RayHost
from peerckpt.launch.rayseal import context, seal
from peerckpt.pidwatch import ProcessWatch


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


def _actor(sleepers: list[subprocess.Popen], tmp_path: Path) -> tuple[RayHost, list]:
    launcher, raylet = (
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    )
    sleepers += [launcher, raylet]
    host = RayHost()
    host.pid = launcher.pid
    host.watch = ProcessWatch(launcher.pid)
    host.raylet = ProcessWatch(raylet.pid)
    host.result_path = str(tmp_path / "result")
    return host, [launcher, raylet]


def test_a_launcher_gone_with_its_raylet_is_a_lost_node(sleepers, tmp_path) -> None:
    """A removed Ray node's actor can outlive the raylet by seconds: a launcher that ended
    with no result while the raylet is dead is reported as the node's loss, not as an end."""
    host, (launcher, raylet) = _actor(sleepers, tmp_path)
    assert host.poll() is None
    raylet.kill()
    raylet.wait(timeout=10)
    launcher.kill()
    launcher.wait(timeout=10)
    done = host.poll()
    assert done is not None and done["node_lost"] is True
    assert done["result"] is None


def test_a_launcher_that_ended_with_a_result_on_a_live_node_is_not_lost(sleepers, tmp_path) -> None:
    host, (launcher, _) = _actor(sleepers, tmp_path)
    Path(host.result_path).write_text(json.dumps({"code": 0, "result": {"exit_code": 0}}))
    launcher.kill()
    launcher.wait(timeout=10)
    done = host.poll()
    assert done == {"code": 0, "result": {"exit_code": 0}, "node_lost": False}
    assert not Path(host.result_path).exists()


def test_a_launcher_that_died_on_a_live_node_is_an_end_not_a_lost_node(sleepers, tmp_path) -> None:
    host, (launcher, _) = _actor(sleepers, tmp_path)
    launcher.kill()
    launcher.wait(timeout=10)
    done = host.poll()
    assert done is not None and done["node_lost"] is False and done["code"] != 0


# -- the result file (issue 27, item 5) and the sealed orders (item 7) -------------------------
class _Started:
    """A stand-in for the host launcher's starter: answers with a live pid, records stdin."""

    orders: dict = {}
    env: dict = {}
    secret = b""  # what the inherited descriptor held

    def __init__(self, argv, stdin, stdout, env, cwd, pass_fds) -> None:
        _Started.env = env
        assert pass_fds == (int(env["PEERCKPT_SECRET_FD"]),)
        _Started.secret = os.read(pass_fds[0], 4096)
        self.returncode = 0

    def communicate(self, data: bytes, timeout: float) -> tuple[bytes, None]:
        _Started.orders = json.loads(data)
        return str(os.getpid()).encode(), None


def test_the_result_file_is_in_a_fresh_private_directory(monkeypatch, tmp_path) -> None:
    """It was a name in /tmp (mkstemp, unlinked), then written as NAME.tmp by the host:
    observable, predictable, and written through a link another user planted there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(subprocess, "Popen", _Started)
    host = RayHost()
    payload = {"orders": {"spec": {}}, "secret": "ab" * 32, "env": {"FROM_DRIVER": "1"}}
    host.start(seal(payload, host.public_key(), context("job", 1)), "job", 1)
    path = Path(_Started.orders["result"])
    assert path == Path(host.result_path) and path.name == "result.json"
    folder = path.parent
    st = folder.lstat()
    assert folder.parent == tmp_path and folder.name.startswith("peerckpt-ray-")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()
    # the secret in a pipe the host launcher inherits, not in its environment
    assert _Started.secret == b"ab" * 32 and _Started.env["FROM_DRIVER"] == "1"
    assert "PEERCKPT_SECRET" not in _Started.env
    rayhost._write(host.result_path, 0, {"exit_code": 0})
    host.watch = _Exited()  # type: ignore[assignment]
    assert host.poll() == {"code": 0, "result": {"exit_code": 0}, "node_lost": False}
    assert not folder.exists()  # nothing of it is left


class _Exited:
    def exited(self, wait_s: float = 0.0) -> bool:
        return True


def test_the_result_is_never_written_through_a_planted_link(tmp_path) -> None:
    victim = tmp_path / "bashrc"
    victim.write_text("the victim's file\n")
    result = tmp_path / "result.json"
    for planted in (Path(f"{result}.tmp"), result):
        planted.symlink_to(victim)
    rayhost._write(str(result), 0, {"exit_code": 0})
    assert victim.read_text() == "the victim's file\n"
    assert not result.is_symlink() and stat.S_IMODE(result.stat().st_mode) == 0o600
    assert rayhost.read_result(str(result)) == {"code": 0, "result": {"exit_code": 0}}
    result.unlink()
    Path(f"{result}.tmp").unlink()
    result.symlink_to(victim)  # and a link is never read as the result
    with pytest.raises(OSError):
        rayhost.read_result(str(result))


def test_sealed_orders_open_only_for_their_actor_and_host() -> None:
    host, other = RayHost(), RayHost()
    payload = {"orders": {"host": {"node_rank": 1}}, "secret": "cd" * 32, "env": {}}
    sealed = seal(payload, host.public_key(), context("job", 1))
    assert host._opener.open(sealed, context("job", 1)) == payload
    for opener, ctx in ((other._opener, context("job", 1)), (host._opener, context("job", 2))):
        with pytest.raises(AuthenticationError, match="do not open"):
            opener.open(sealed, ctx)
    changed = dict(sealed, body=bytes([sealed["body"][0] ^ 1]) + sealed["body"][1:])
    with pytest.raises(AuthenticationError, match="changed on the way"):
        host._opener.open(changed, context("job", 1))


def test_an_actor_polled_before_its_launcher_started_answers_not_ended() -> None:
    """The driver places a host (an ``add node``) and polls every host from its watch loop
    while that host's ``start`` still runs: the poll raised, and the job failed."""
    assert RayHost().poll() is None
