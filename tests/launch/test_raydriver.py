"""What the Ray driver hands its actors travels sealed (issue 27, item 7): without a Ray
cluster, the actor a stand-in that records every argument Ray would carry over its RPC."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from peerckpt.launch.base import JobSpec
from peerckpt.launch.ray import HostRole, RayLauncher, _Host
from peerckpt.launch.rayactor import RayHost
from peerckpt.launch.rayseal import context

SECRET = bytes(range(32))
CREDENTIAL = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


class _Method:
    def __init__(self, call: Any, sent: list[Any]) -> None:
        self.call, self.sent = call, sent

    def remote(self, *args: Any) -> Any:
        self.sent.append(args)  # what Ray would serialise onto its RPC, in clear
        return self.call(*args)


class _Actor:
    """A RayHost behind the interface the driver uses, ``start`` left unrun (it would start a
    host launcher): it records what was sealed to it."""

    def __init__(self) -> None:
        self.host = RayHost()
        self.sent: list[Any] = []
        self.sealed: list[Any] = []
        self.public_key = _Method(self.host.public_key, self.sent)
        self.start = _Method(lambda *a: self.sealed.append(a) or 4242, self.sent)


def test_the_secret_the_environment_and_the_persist_url_never_travel_in_clear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIAL)  # forwarded to every host
    url = f"s3://AKIDEXAMPLE:{CREDENTIAL}@bucket/ckpt"
    launcher = RayLauncher.__new__(RayLauncher)
    launcher.spec = JobSpec(script="/x/train.py", persist={"url": url}, job="j")
    launcher.job, launcher._secret, launcher._host_chaos = "j", SECRET, {}
    launcher.endpoint = "127.0.0.1:29400"
    actor = _Actor()
    host = _Host(1, "node-1", "127.0.0.2", HostRole.RANKS, actor)
    launcher._launch(host)

    carried = pickle.dumps(actor.sent)
    for secret in (SECRET, SECRET.hex().encode(), CREDENTIAL.encode(), url.encode()):
        assert secret not in carried
    [(sealed, job, rank)] = actor.sealed
    assert (job, rank) == ("j", 1)
    payload = actor.host._opener.open(sealed, context("j", 1))
    assert payload["secret"] == SECRET.hex()
    assert payload["orders"]["spec"]["persist"]["url"] == url
    assert payload["env"]["AWS_SECRET_ACCESS_KEY"] == CREDENTIAL
