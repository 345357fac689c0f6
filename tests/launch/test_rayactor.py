"""The Ray actor's report of its host launcher's end, without a Ray cluster: the launcher
and the raylet are stand-in processes the test kills."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerckpt.launch.rayactor import RayHost
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
