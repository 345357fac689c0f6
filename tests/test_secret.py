"""The job's secret from the environment: an empty or short one is refused, naming the fix."""

from __future__ import annotations

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.runtime.env import LaunchEnv
from peerckpt.secret import secret_from_env

BASE = {"PEERCKPT_JOB": "j", "PEERCKPT_AGENT": "/tmp/agent.sock"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", r"PEERCKPT_SECRET holds 0 byte\(s\); .* at least 16 random bytes"),
        ("ab" * 15, r"PEERCKPT_SECRET holds 15 byte\(s\)"),
        ("not hex", r"PEERCKPT_SECRET must hold the job's secret in hex"),
    ],
)
def test_a_rank_refuses_an_empty_short_or_garbled_secret(value: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        LaunchEnv.from_environ({**BASE, "PEERCKPT_SECRET": value})  # "" used to be accepted
    assert "secrets.token_hex(32)" in str(info.value)  # the fix, spelled out


def test_a_secret_of_16_bytes_or_more_is_taken() -> None:
    assert LaunchEnv.from_environ({**BASE, "PEERCKPT_SECRET": "0f" * 16}).secret == b"\x0f" * 16
    assert secret_from_env({"PEERCKPT_SECRET": "ab" * 32}) == b"\xab" * 32


def test_a_missing_secret_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="PEERCKPT_SECRET is not set"):
        secret_from_env({})


def test_a_descriptor_that_holds_no_secret_is_refused_naming_it() -> None:
    import os

    read, write = os.pipe()
    os.write(write, b"not hex")
    os.close(write)
    with pytest.raises(ConfigurationError, match=r"descriptor \d+ \(PEERCKPT_SECRET_FD\).*hex"):
        secret_from_env({"PEERCKPT_SECRET_FD": str(read)})
    with pytest.raises(ConfigurationError, match=r"cannot read the job's secret from descriptor"):
        secret_from_env({"PEERCKPT_SECRET_FD": "987"})  # not open here
