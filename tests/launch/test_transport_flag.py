"""``peerckpt run --transport``: nccl is refused before anything starts where it cannot work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from peerckpt.replication import nccl

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(nccl.unavailable() is None, reason="this machine can open NCCL links")
def test_transport_nccl_without_cupy_or_cuda_is_refused_naming_the_extra(tmp_path) -> None:
    script = REPO / "tests" / "jobs" / "ddp_job.py"
    argv = [sys.executable, "-m", "peerckpt.launch", "run", "--transport", "nccl", str(script)]
    proc = subprocess.run(
        [*argv, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "--transport nccl" in proc.stderr and "pip install 'peerckpt[gpu]'" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
