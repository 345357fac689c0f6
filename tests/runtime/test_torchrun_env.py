"""A torchrun worker's bootstrap (``runtime/torchrun.py``): what it reads and what it refuses.

Whole jobs under torchrun are in ``tests/test_torchrun.py``; these check the parts a user
gets wrong, each with an error that names the fix, and the pidfd watch the agent relies on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.launch.torchrun import min_nodes_of
from peerckpt.pidwatch import ProcessWatch
from peerckpt.runtime.torchrun import job_name, join_host, runtime_base, under_torchrun
from peerckpt.secret import secret_from_env

TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "exp",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "RANK": "0",
    "WORLD_SIZE": "4",
}


def test_a_worker_without_the_secret_is_told_both_ways_to_give_it(tmp_path: Path) -> None:
    env = dict(TORCHRUN_ENV, PEERCKPT_RUNTIME_DIR=str(tmp_path / "rt"))
    assert under_torchrun(env)
    with pytest.raises(ConfigurationError, match=r"PEERCKPT_SECRET.*PEERCKPT_SECRET_FILE"):
        join_host(env)


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match="chmod 600"):
        secret_from_env({"PEERCKPT_SECRET_FILE": str(path)})
    path.chmod(0o600)
    assert secret_from_env({"PEERCKPT_SECRET_FILE": str(path)}) == bytes.fromhex("ab" * 32)


def test_every_host_derives_the_same_job_name_and_two_stores_differ() -> None:
    name = job_name(dict(TORCHRUN_ENV))
    assert name == job_name(dict(TORCHRUN_ENV)) and name.startswith("tr")
    assert name != job_name(dict(TORCHRUN_ENV, MASTER_PORT="29501"))
    assert job_name(dict(TORCHRUN_ENV, PEERCKPT_JOB="mine")) == "mine"
    with pytest.raises(ConfigurationError, match="a-z, 0-9"):
        job_name(dict(TORCHRUN_ENV, PEERCKPT_JOB="My-Job"))


def test_a_runtime_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ConfigurationError, match="chmod 700"):
        runtime_base({"PEERCKPT_RUNTIME_DIR": str(shared)})
    private = tmp_path / "private"
    assert runtime_base({"PEERCKPT_RUNTIME_DIR": str(private)}) == str(private)
    assert os.stat(private).st_mode & 0o777 == 0o700


def test_a_killed_process_is_seen_gone_before_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with ProcessWatch(child.pid) as watch:
            assert not watch.exited(wait_s=0.1)
            os.kill(child.pid, signal.SIGKILL)
            assert watch.exited(wait_s=5.0)  # a zombie still: nobody has waited for it
            assert child.returncode is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["torchrun", "--nnodes=1:2", "--nproc-per-node=2", "train.py", "--nnodes", "5"], 1),
        (["python", "-m", "torch.distributed.run", "--nnodes", "2:4", "train.py"], 2),
        (["torchrun", "--nnodes=2", "train.py"], None),
    ],
)
def test_the_shrink_floor_is_read_from_torchruns_own_command_line(
    tmp_path: Path, argv: list[str], expected: int | None
) -> None:
    """``--nnodes=MIN:MAX`` of the torchrun that started the job (the script's own flags
    after it are not torchrun's)."""
    script = "import sys, time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script, *argv])
    try:
        cmdline = Path(f"/proc/{child.pid}/cmdline")
        deadline = time.monotonic() + 10.0
        while b"-c" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd (its cmdline was empty here once)
        assert min_nodes_of(child.pid) == expected
    finally:
        child.kill()
        child.wait()
