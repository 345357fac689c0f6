"""``peerckpt run --env KEY=VALUE`` on this machine: every rank sees it, over the launching
shell's value (the Ray case is in tests/test_ray.py)."""

from __future__ import annotations

import json

from .conftest import run_job


def test_env_reaches_every_rank_over_the_shells_value(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setenv("TEST_ENV_FROM_SHELL", "shell value")
    monkeypatch.setenv("TEST_ENV_OVERRIDE", "from the shell")
    flags = ["--env", "TEST_ENV_OVERRIDE=from --env", "--env", "TEST_ENV_ADDED=a=b"]
    run = run_job(
        tmp_path,
        script="env_job.py",
        script_args=[
            "TEST_ENV_FROM_SHELL",
            "TEST_ENV_OVERRIDE",
            "TEST_ENV_ADDED",
            "PYTHONHASHSEED",
        ],
        nodes=2,
        nproc=1,
        extra=flags,
    )
    assert run.returncode == 0, run.log[-4000:]
    hashes = set()
    for rank in (0, 1):
        record = json.loads((tmp_path / f"env{rank}.json").read_text())
        assert record["values"] == {
            "TEST_ENV_FROM_SHELL": "shell value",
            "TEST_ENV_OVERRIDE": "from --env",
            "TEST_ENV_ADDED": "a=b",
            # one string hash for the job (a replacement's too), unless the user set one
            "PYTHONHASHSEED": "0",
        }, record
        hashes.add(record["hash"])
    assert len(hashes) == 1
