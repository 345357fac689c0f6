"""``runtime/standby.py``: which processes wait for their rank at ``import peerckpt``. Only a
spare (or a restarted or joining process) that a launcher started, in its main process, with
its agent's socket there and the job's secret in hand; anything else goes on at once and
leaves it to the decorated function (the job tests run the waiting itself:
tests/test_script_habits.py)."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest

from peerckpt.runtime import standby, userpg


@pytest.fixture(autouse=True)
def _no_rebinding(monkeypatch: pytest.MonkeyPatch) -> None:
    # on_import would put peerckpt's init_process_group into this test process's torch
    monkeypatch.setattr(userpg, "install_early", lambda: None)
    monkeypatch.setattr(standby, "_waiting", None)
    monkeypatch.setattr(
        standby, "RankRuntime", lambda *a: pytest.fail("no runtime should be made here")
    )


@pytest.fixture
def agent_socket(tmp_path: Path):
    path = tmp_path / "agent.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    yield str(path)
    sock.close()


def _goes_on(monkeypatch: pytest.MonkeyPatch, role: str, agent: str, secret: bool = True) -> None:
    """``on_import`` in a process of ``role`` whose agent socket is ``agent`` (with the job's
    secret unless not ``secret``) returns at once, leaving nothing for the decorator to take
    (the fixture fails the test if a runtime is made)."""
    for name in ("PEERCKPT_SECRET", "PEERCKPT_SECRET_FD", "PEERCKPT_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PEERCKPT_ROLE", role)
    monkeypatch.setenv("PEERCKPT_AGENT", agent)
    monkeypatch.setenv("PEERCKPT_JOB", "j")
    if secret:
        monkeypatch.setenv("PEERCKPT_SECRET", "00" * 32)
    standby.on_import()
    assert standby.take(None) is None  # type: ignore[arg-type]


def test_a_rank_of_the_first_epoch_does_not_wait(monkeypatch, agent_socket) -> None:
    _goes_on(monkeypatch, "rank", agent_socket)


def test_a_spare_whose_agent_is_gone_leaves_it_to_the_decorator(monkeypatch, tmp_path) -> None:
    _goes_on(monkeypatch, "spare", str(tmp_path / "gone.sock"))


def test_a_subprocess_with_a_spares_environment_but_no_secret_goes_on(
    monkeypatch, agent_socket
) -> None:
    """A script's own subprocess inherits PEERCKPT_ROLE and the agent's socket, not the
    secret (read once, then out of the environment): importing peerckpt must not fail."""
    _goes_on(monkeypatch, "spare", agent_socket, secret=False)


def test_a_multiprocessing_child_never_waits(monkeypatch, agent_socket) -> None:
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    _goes_on(monkeypatch, "spare", agent_socket)
