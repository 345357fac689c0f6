"""Shared-memory names on a shared host: runs keep apart, planted files break nothing.

/dev/shm is one directory for every user and job of the machine, so a segment's name is
input too: another run of the same ``--job``, or another user, may already hold it.
"""

from __future__ import annotations

import logging
import os

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.replication.arena import Arena
from peerckpt.shm import SHM_DIR, sweep

from .conftest import job_name


def test_two_runs_of_one_job_name_neither_collide_nor_sweep_each_other() -> None:
    name = job_name()
    first, second = Arena(name, node=0), Arena(name, node=0)
    try:
        live = first.create("o0-0", 4096, "first run's slot")
        other = second.create("o0-0", 4096, "second run's slot")  # was a FileExistsError
        assert live.path != other.path
        second.destroy()  # its clean-up sweeps its own files only
        assert os.path.exists(live.path) and not os.path.exists(other.path)
    finally:
        first.destroy()
        second.destroy()


def test_a_file_planted_at_the_next_segment_name_does_not_break_allocation(caplog) -> None:
    arena = Arena(job_name(), node=0)
    planted = os.path.join(SHM_DIR, f"{arena.prefix}o0-0-1")
    with open(planted, "wb") as f:
        f.write(b"not yours")
    try:
        with caplog.at_level(logging.WARNING, logger="peerckpt.arena"):
            seg = arena.create("o0-0", 4096, "slot")  # was a FileExistsError
        assert seg.path != planted and seg.size == 4096
        with open(planted, "rb") as f:
            assert f.read() == b"not yours"  # neither truncated nor mapped
        assert any(planted in r.getMessage() for r in caplog.records)
    finally:
        arena.destroy()
        if os.path.exists(planted):
            os.unlink(planted)


def test_clean_up_goes_on_past_a_file_it_cannot_remove_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena(job_name(), node=0)
    stuck, gone = arena.create("o0-0", 4096, "slot"), arena.create("o1-0", 4096, "slot")
    real_unlink = os.unlink

    def unlink(path: str, *a: object, **k: object) -> None:
        if os.path.basename(str(path)) == stuck.name:
            raise PermissionError(1, "Operation not permitted", path)
        real_unlink(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level(logging.WARNING):
        arena.destroy()  # was a PermissionError, and nothing after the stuck file was removed
    assert not os.path.exists(gone.path) and os.path.exists(stuck.path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not remove 1" in warnings[0] and stuck.name in warnings[0]
    monkeypatch.undo()
    assert sweep(arena.job, arena.run, node=0) == [stuck.path]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_clean_up_leaves_another_users_file_alone(caplog: pytest.LogCaptureFixture) -> None:
    arena = Arena(job_name(), node=1)
    planted = os.path.join(SHM_DIR, f"{arena.prefix}planted")
    with open(planted, "wb") as f:
        f.write(b"x")
    os.chown(planted, 65534, 65534)
    try:
        with caplog.at_level(logging.WARNING):
            arena.destroy()  # root could remove it; it must not
        assert os.path.exists(planted)
        assert any("owned by uid 65534" in r.getMessage() for r in caplog.records)
    finally:
        os.unlink(planted)


@pytest.mark.parametrize("bad", ["*", "a*", "../x", "a-b", "", "A", "x" * 41, "a/b"])
def test_a_job_name_is_checked_before_it_reaches_a_file_name(bad: str) -> None:
    name = job_name()
    arena = Arena(name, node=0)
    seg = arena.create("o0-0", 4096, "slot")
    pattern = bad if bad != "a*" else f"{name}*"  # a glob that matches this live segment
    try:
        with pytest.raises(ConfigurationError, match=r"job name .* 1-40 characters"):
            Arena(pattern, node=0)
        with pytest.raises(ConfigurationError, match=r"job name .* 1-40 characters"):
            sweep(pattern, arena.run)
        assert os.path.exists(seg.path)
    finally:
        arena.destroy()
