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


def _env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name in ("PEERCKPT_ROLE", "PEERCKPT_AGENT", "PEERCKPT_JOB", "PEERCKPT_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PEERCKPT_SECRET_FD", raising=False)
    monkeypatch.delenv("PEERCKPT_SECRET_FILE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_a_rank_of_the_first_epoch_does_not_wait(monkeypatch, agent_socket) -> None:
    _env(
        monkeypatch,
        PEERCKPT_ROLE="rank",
        PEERCKPT_AGENT=agent_socket,
        PEERCKPT_JOB="j",
        PEERCKPT_SECRET="00" * 32,
    )
    standby.on_import()
    assert standby.take(None) is None  # type: ignore[arg-type]


def test_a_spare_whose_agent_is_gone_leaves_it_to_the_decorator(monkeypatch, tmp_path) -> None:
    _env(
        monkeypatch,
        PEERCKPT_ROLE="spare",
        PEERCKPT_AGENT=str(tmp_path / "gone.sock"),
        PEERCKPT_JOB="j",
        PEERCKPT_SECRET="00" * 32,
    )
    standby.on_import()
    assert standby.take(None) is None  # type: ignore[arg-type]


def test_a_subprocess_with_a_spares_environment_but_no_secret_goes_on(
    monkeypatch, agent_socket
) -> None:
    """A script's own subprocess inherits PEERCKPT_ROLE and the agent's socket, not the
    secret (read once, then out of the environment): importing peerckpt must not fail."""
    _env(monkeypatch, PEERCKPT_ROLE="spare", PEERCKPT_AGENT=agent_socket, PEERCKPT_JOB="j")
    standby.on_import()
    assert standby.take(None) is None  # type: ignore[arg-type]


def test_a_multiprocessing_child_never_waits(monkeypatch, agent_socket) -> None:
    _env(
        monkeypatch,
        PEERCKPT_ROLE="spare",
        PEERCKPT_AGENT=agent_socket,
        PEERCKPT_JOB="j",
        PEERCKPT_SECRET="00" * 32,
    )
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    standby.on_import()
    assert standby.take(None) is None  # type: ignore[arg-type]
