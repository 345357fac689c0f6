"""Recovery pulls over NCCL (CuPy) on one GPU (issue 29). Skipped without CUDA or without CuPy
with NCCL (CI has neither; ``make test-gpu`` runs them on a GPU machine).

* The 2 × 2 NCCL test job with ``--transport nccl``: a killed rank's spare pulls its state
  from a holder agent over NCCL, and every step equals the fault-free run's.
* Two agents' data planes in two processes (``tests/jobs/pull_holder.py``): a pull over NCCL
  bit for bit; a piece damaged on its way over NCCL is detected by its chunk's crc32c and the
  copy pulled again over TCP, bit for bit.

The same exchange runs on CPU against a fake device link in
``tests/replication/test_transport.py``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from peerckpt.replication import nccl
from peerckpt.replication.transport import TransportMode

from ..conftest import JobRun, job_name, run_job
from .digests import assert_bit_exact_but_the_step_in_flight

JOBS = Path(__file__).resolve().parent.parent / "jobs"
sys.path.insert(0, str(JOBS))
import pull_holder  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(nccl.probe()[0] is None, reason="needs CuPy with NCCL: peerckpt[gpu]"),
]

NCCL_JOB = ["--steps", "30", "--device", "cuda", "--backend", "cpu:gloo,cuda:nccl"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    run = run_job(tmp_path_factory.mktemp("nccl-pull-reference"), script_args=NCCL_JOB)
    assert run.returncode == 0, run.log[-4000:]
    return run


def test_a_spare_pulls_its_state_over_nccl_and_the_job_ends_bit_exact(tmp_path, reference):
    run = run_job(
        tmp_path,
        script_args=NCCL_JOB,
        spares=1,
        chaos="kill rank=2 at=10",
        extra=["--transport", "nccl"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "pulled rank 2 step" in run.log and "over nccl" in run.log, run.log[-4000:]
    assert "pulling it over TCP" not in run.log, run.log[-4000:]
    assert_bit_exact_but_the_step_in_flight(run, reference, at=10)


@contextmanager
def _holder(job: str, secret: bytes, *extra: str) -> Iterator[str]:
    """The holder's process, serving; its data address."""
    proc = subprocess.Popen(
        [sys.executable, str(JOBS / "pull_holder.py"), "--job", job, "--mib", "64", *extra],
        env=dict(os.environ, PEERCKPT_SECRET=secret.hex()),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY "), line
        yield line.split()[1]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_pull_over_nccl_between_two_agents_is_bit_exact() -> None:
    job, secret = job_name(), secrets.token_bytes(32)
    with _holder(job, secret) as address:
        how, _, same = pull_holder.pull(job, secret, address, TransportMode.NCCL, 64)
        assert how == "nccl" and same


def test_a_piece_damaged_over_nccl_is_detected_and_pulled_again_over_tcp(caplog) -> None:
    job, secret = job_name(), secrets.token_bytes(32)
    with _holder(job, secret, "--corrupt-piece", "1") as address:
        how, _, same = pull_holder.pull(job, secret, address, TransportMode.NCCL, 64)
        assert how == "tcp" and same
    assert "arrived damaged over nccl (crc32c)" in caplog.text
