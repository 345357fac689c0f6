"""Finding a running job on a shared machine: ``peerckpt join`` trusts only its user's own job.

The job file holds the job's secret and names the script ``join`` runs, and the temp
directory is shared with every user of the host. These tests plant what another user could
and check that none of it is ever used, and that a job name is claimed by one launcher.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.launch.base import JobSpec
from peerckpt.launch.jobfile import JobClaim
from peerckpt.launch.join import find_job
from peerckpt.launch.local import LocalLauncher

from ..conftest import JOBS, job_name

INFO = {
    "coordinator": "127.0.0.1:1",
    "secret": "ab" * 32,
    "script": ["train.py"],
    "nproc_per_node": 2,
    "run": "0123456789abcdef",
}


@pytest.fixture
def tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp directory of this test's own, as the machine's shared one."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _plant_old_style(tmp_dir: Path, job: str) -> None:
    """What another user could put where the old ``join`` globbed for job files."""
    planted = tmp_dir / f"peerckpt-{job}-evil"
    planted.mkdir()
    (planted / "job.json").write_text(json.dumps({**INFO, "job": job, "script": ["evil.py"]}))


def test_a_job_file_planted_in_the_temp_dir_is_never_used(tmp_dir: Path) -> None:
    job = job_name()
    _plant_old_style(tmp_dir, job)
    with pytest.raises(ConfigurationError, match=f"no running job named '{job}'"):
        find_job(job)  # the old code returned the planted file, and join ran evil.py


@pytest.mark.parametrize("bad", ["*", "../x", "a/b", "", "x" * 41])
def test_a_job_name_is_checked_before_it_becomes_a_path(tmp_dir: Path, bad: str) -> None:
    _plant_old_style(tmp_dir, "victim")
    with pytest.raises(ConfigurationError, match=r"job name .* 1-40 characters"):
        find_job(bad)  # the old code globbed "*" and found any job


def test_join_finds_the_job_its_launcher_published_and_no_longer_once_it_is_gone(
    tmp_dir: Path,
) -> None:
    job = job_name()
    claim = JobClaim(job)
    try:
        claim.publish(INFO)
        info = find_job(job)
        assert {k: info[k] for k in INFO} == INFO and info["pid"] == os.getpid()
    finally:
        claim.release()
    with pytest.raises(ConfigurationError, match="no running job"):
        find_job(job)


def test_a_second_launcher_of_a_running_job_name_is_refused(tmp_dir: Path) -> None:
    name = job_name()
    spec = JobSpec(script=str(JOBS / "ddp_job.py"), job=name)
    first = LocalLauncher(spec)
    try:
        with pytest.raises(
            ConfigurationError,
            match=rf"job {name} is already running \(pid {os.getpid()}\); choose another --job",
        ):
            LocalLauncher(spec)
    finally:
        first.stop()
    LocalLauncher(spec).stop()  # free again once the first one stopped


def _claimed(job: str) -> tuple[JobClaim, Path]:
    claim = JobClaim(job)
    claim.publish(INFO)
    return claim, Path(claim.file_path)


def _chmod_file(path: Path) -> None:
    path.chmod(0o644)


def _chmod_dir(path: Path) -> None:
    path.parent.chmod(0o755)


def _link_file(path: Path) -> None:
    copy = path.with_name("elsewhere.json")
    copy.write_bytes(path.read_bytes())
    copy.chmod(0o600)
    path.unlink()
    path.symlink_to(copy)


def _give_file_away(path: Path) -> None:
    os.chown(path, 65534, 65534)


def _give_dir_away(path: Path) -> None:
    os.chown(path.parent, 65534, 65534)


def _bad_field(path: Path) -> None:
    path.write_text(json.dumps({**INFO, "script": "evil.py"}))


def _short_secret(path: Path) -> None:
    path.write_text(json.dumps({**INFO, "secret": ""}))


TAMPERED: dict[str, tuple[Any, str, bool]] = {
    "file readable by others": (_chmod_file, "mode 0644; it must be", False),
    "directory open to others": (_chmod_dir, "has mode 0755, not 0700", False),
    "file is a link": (_link_file, "is a link or not a file", False),
    "file of another user": (_give_file_away, "owner uid 65534", True),
    "directory of another user": (_give_dir_away, "is owned by uid 65534, not by you", True),
    "script not a list": (_bad_field, "not a valid job file .script", False),
    "empty secret": (_short_secret, "holds 0 byte", False),
}


@pytest.mark.parametrize("what", sorted(TAMPERED))
def test_a_job_file_that_is_not_private_and_well_formed_is_refused(
    tmp_dir: Path, what: str
) -> None:
    tamper, message, needs_root = TAMPERED[what]
    if needs_root and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    job = job_name()
    claim, path = _claimed(job)
    try:
        tamper(path)
        with pytest.raises(ConfigurationError, match=message):
            find_job(job)
    finally:
        os.chown(path.parent, os.getuid(), os.getgid())
        path.parent.chmod(0o700)
        claim.release()


def test_the_job_file_of_a_launcher_that_died_is_not_used(tmp_dir: Path) -> None:
    job = job_name()
    claim, path = _claimed(job)
    assert claim._fd is not None
    os.close(claim._fd)  # as a SIGKILL would: the lock goes, the files stay
    claim._fd = None
    try:
        with pytest.raises(ConfigurationError, match=f"job {job} is not running any more"):
            find_job(job)
        JobClaim(job).release()  # the next launcher of the name takes the stale files over
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)
        Path(claim.lock_path).unlink(missing_ok=True)
