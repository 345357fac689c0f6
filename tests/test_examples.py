"""The SLURM and Kubernetes examples start `peerckpt run` with flags that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

EXAMPLES = ["slurm.sbatch", "k8s-indexed-job.yaml"]


def _run_flags() -> set[str]:
    help_text = subprocess.run(
        [sys.executable, "-m", "peerckpt", "run", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return set(re.findall(r"(--[a-z][a-z-]+)", help_text))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_flag_of_peerckpt_run_in_the_example_exists(name: str) -> None:
    text = (Path(REPO) / "examples" / name).read_text()
    command = text[text.index("peerckpt run \\") :]
    command = command[: command.index("train.py") if "train.py" in command else None]
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", command))
    assert {"--nnodes", "--node-rank", "--rdzv-endpoint", "--nproc-per-node"} <= used
    assert used - _run_flags() == set(), f"{name} uses flags `peerckpt run` does not have"
