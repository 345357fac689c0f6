"""A script adapted from a public tutorial the way users adapt one recovers bit for bit: it
keeps ``init_process_group``/``destroy_process_group``, is seeded once at program start and
draws a random dataset in its setup (``tests/jobs/tutorial_job.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import JOBS, JobRun, assert_same_digests, job_name, run_job, run_with_reference
from .torchrun_hosts import TorchrunJob, runtime_dirs

ARGS = ["--steps", "30"]


def test_a_tutorial_script_recovers_bit_exact_from_a_rank_then_a_node(tmp_path) -> None:
    reference, run = run_with_reference(
        tmp_path,
        ARGS,
        script="tutorial_job.py",
        spares=3,
        chaos="kill rank=1 at=10; kill node=1 at=20",
    )
    assert run.returncode == 0, run.log[-4000:]
    rank_loss, node_loss = run.report["events"]
    assert rank_loss["ranks"] == [1] and node_loss["ranks"] == [2, 3]
    # Every entry drew its dataset from the RNG as the first did (a survivor's global RNG was
    # where the last epoch left it: 28 of 40 steps of the tutorial's trainer differed).
    assert_same_digests(run, reference)
    assert "dist.init_process_group() in the script: peerckpt already formed" in run.log
    assert "dist.destroy_process_group() in the script" in run.log


@pytest.mark.slow
def test_the_same_script_under_plain_torchrun(tmp_path: Path) -> None:
    reference = run_job(tmp_path / "reference", script="tutorial_job.py", script_args=ARGS)
    assert reference.returncode == 0, reference.log[-4000:]
    out = tmp_path / "torchrun"
    out.mkdir()
    job = TorchrunJob(
        out, job_name(), JOBS / "tutorial_job.py", [str(out), *ARGS, "--sleep", "0.1"]
    )
    job.wait_for_step("rank2.jsonl", 10)
    job.kill_worker(1)
    try:
        codes = job.wait(300.0)
    finally:
        job.stop()
    report = job.report()
    assert not runtime_dirs(job.job)
    assert codes == [0, 0], job.log()[-6000:]
    assert_same_digests(JobRun(0, report, out, job.log()), reference)
