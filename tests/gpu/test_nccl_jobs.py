"""NCCL on one GPU: four NCCL ranks (2 simulated nodes × 2) share the device, each process an
NCCL host of its own (``launch/gpus.py``: ``NCCL_HOSTID``, shared memory and P2P off,
set by the launcher when ranks outnumber GPUs). A killed rank and a killed node: the survivors,
blocked in NCCL all-reduces, are released by aborting their communicators
(``runtime/pg.py``), the next epoch's groups form, CUDA state is restored on the device, and
every step equals the fault-free run's. Skipped without CUDA (CI has none); ``make test-gpu``
runs them on a GPU machine."""

from __future__ import annotations

import re

import pytest
import torch

from ..conftest import JobRun, run_job
from .digests import assert_bit_exact_but_the_step_in_flight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NCCL_JOB = [
    "--steps",
    "30",
    "--device",
    "cuda",
    "--backend",
    "cpu:gloo,cuda:nccl",
    "--sleep",
    "0.05",
]
RELEASE_S = 2.0  # the bound: survivors released and stepping within this


@pytest.fixture(scope="module")
def nccl_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    run = run_job(tmp_path_factory.mktemp("nccl-reference"), script_args=NCCL_JOB)
    assert run.returncode == 0, run.log[-4000:]
    assert "each is an NCCL host of its own" in run.log, run.log[-4000:]
    return run


def _stepping_within(run: JobRun) -> float:
    """Seconds from the chaos action to every rank stepping again."""
    [fired] = run.report["chaos"]
    [event] = run.report["events"]
    assert event["resumed_at"] is not None, event
    return float(event["resumed_at"]) - float(fired["fired_at"])


def test_a_killed_nccl_rank_is_replaced_bit_exact(tmp_path, nccl_reference) -> None:
    run = run_job(tmp_path, script_args=NCCL_JOB, spares=1, chaos="kill rank=2 at=10")
    assert run.returncode == 0, run.log[-4000:]
    assert re.search(r"[1-9]\d* NCCL communicator group\(s\) aborted", run.log), run.log[-4000:]
    assert_bit_exact_but_the_step_in_flight(run, nccl_reference, at=10)
    assert _stepping_within(run) < RELEASE_S


def test_a_killed_nccl_node_is_rebuilt_bit_exact(tmp_path, nccl_reference) -> None:
    run = run_job(tmp_path, script_args=NCCL_JOB, spares=2, chaos="kill node=1 at=12")
    assert run.returncode == 0, run.log[-4000:]
    assert_bit_exact_but_the_step_in_flight(run, nccl_reference, at=12)
    assert _stepping_within(run) < RELEASE_S
