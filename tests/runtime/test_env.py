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
