"""What a rank process reads from its launcher's environment (``runtime/env.py``)."""

from __future__ import annotations

import os

from peerckpt.runtime.env import LaunchEnv


def test_the_secret_leaves_the_environment_once_read(monkeypatch) -> None:
    """The user's script and whatever it starts (subprocesses, DataLoader workers) inherited
    the job's key (audit of 2026-11-27)."""
    secret = "ab" * 32
    monkeypatch.setenv("PEERCKPT_JOB", "j")
    monkeypatch.setenv("PEERCKPT_SECRET", secret)
    monkeypatch.setenv("PEERCKPT_AGENT", "/nonexistent.sock")
    env = LaunchEnv.from_environ()
    assert env.secret == bytes.fromhex(secret)
    assert "PEERCKPT_SECRET" not in os.environ
    # read from a mapping given (a test's, a launcher's own), nothing is taken out of it
    given = {"PEERCKPT_JOB": "j", "PEERCKPT_SECRET": secret, "PEERCKPT_AGENT": "/x.sock"}
    assert LaunchEnv.from_environ(given).secret == bytes.fromhex(secret)
    assert "PEERCKPT_SECRET" in given


def test_the_secret_from_an_inherited_descriptor_is_read_once_and_leaves_nothing(
    monkeypatch,
) -> None:
    """How a launcher hands it over (``secret_pipe``): not in the environment at all."""
    from peerckpt.secret import secret_from_env, secret_pipe

    fd = secret_pipe(b"\xcd" * 32)
    monkeypatch.delenv("PEERCKPT_SECRET", raising=False)
    monkeypatch.setenv("PEERCKPT_JOB", "j")
    monkeypatch.setenv("PEERCKPT_SECRET_FD", str(fd))
    monkeypatch.setenv("PEERCKPT_AGENT", "/nonexistent.sock")
    assert LaunchEnv.from_environ().secret == b"\xcd" * 32
    assert "PEERCKPT_SECRET_FD" not in os.environ and "PEERCKPT_SECRET" not in os.environ
    try:
        os.fstat(fd)
        closed = False
    except OSError:
        closed = True
    assert closed  # read and closed: nothing the script starts inherits it
    # a second read in the same process (another part of it) gets the same secret
    assert secret_from_env({"PEERCKPT_SECRET_FD": str(fd)}) == b"\xcd" * 32
