"""A script adapted from a public tutorial the way users adapt one recovers bit for bit: it
keeps ``init_process_group``/``destroy_process_group``, is seeded once at program start and
draws a random dataset in its setup (``tests/jobs/tutorial_job.py``). A script shaped like
nanoGPT's ``train.py`` does all that at its top level, reading its rank from the environment
there (``tests/jobs/nanogpt_job.py``): a spare or a process restarted in place runs that top
level with the rank it takes (``runtime/standby.py``), and the batch it prefetches in each
step for the next is put back when a restored loop resumes (``runtime/carried.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerckpt.runtime.audit import PREFIX

from .conftest import (
    JOBS,
    JobRun,
    assert_same_digests,
    job_name,
    read_jsonl,
    run_job,
    run_with_reference,
)
from .torchrun_hosts import TorchrunJob, runtime_dirs

ARGS = ["--steps", "30"]


def _recovers_a_rank_then_a_node(tmp_path: Path, script: str, args: list[str] = ARGS) -> JobRun:
    """``script`` under ``kill rank=1 at=10; kill node=1 at=20`` with 3 spares: both losses
    recovered, every step bit-exact against its fault-free run."""
    reference, run = run_with_reference(
        tmp_path, args, script=script, spares=3, chaos="kill rank=1 at=10; kill node=1 at=20"
    )
    assert run.returncode == 0, run.log[-4000:]
    rank_loss, node_loss = run.report["events"]
    assert rank_loss["ranks"] == [1] and node_loss["ranks"] == [2, 3]
    assert_same_digests(run, reference)
    return run


@pytest.mark.slow  # make test: the same script's setup in the dist tutorial's loop, below
def test_a_tutorial_script_recovers_bit_exact_from_a_rank_then_a_node(tmp_path) -> None:
    # Every entry drew its dataset from the RNG as the first did (a survivor's global RNG was
    # where the last epoch left it: 28 of 40 steps of the tutorial's trainer differed).
    run = _recovers_a_rank_then_a_node(tmp_path, "tutorial_job.py")
    assert "dist.init_process_group() in the script: peerckpt already formed" in run.log
    assert "dist.destroy_process_group() in the script" in run.log


def test_the_dist_tutorials_loop_makes_its_iterator_again_where_a_restore_resumes(
    tmp_path,
) -> None:
    """The iterator the loop makes at each data epoch's first step (12 steps here) is made
    again when a restore resumes mid-epoch: it raised UnboundLocalError; then, made with
    torch's generator moving as it drew the shuffle's seed, dropout differed from step 7."""
    run = _recovers_a_rank_then_a_node(tmp_path, "tutorial_job.py", [*ARGS, "--epoch-steps", "12"])
    assert "`batches` put back as the loop carried it into step" in run.log, run.log[-4000:]
    assert PREFIX not in run.log
    # its setup is the DDP tutorial's: its own init/destroy_process_group, a dataset drawn
    # from the RNG seeded once at program start (the same on every entry)
    assert "dist.init_process_group() in the script: peerckpt already formed" in run.log
    assert "dist.destroy_process_group() in the script" in run.log


def _assert_top_level_read_the_rank_trained(run: JobRun) -> None:
    """Every process's top level read the RANK it then trained as (a spare's, a restarted
    process's: the rank it took, not none)."""
    seen = 0
    for path in run.out.glob("rank*.jsonl"):
        rank = int(path.stem[4:])
        for entry in read_jsonl(path):
            assert entry["top_rank"] == rank, (path.name, entry)
            seen += 1
    assert seen, "no step was recorded"


def test_a_nanogpt_shaped_script_recovers_bit_exact_through_spares(tmp_path) -> None:
    run = _recovers_a_rank_then_a_node(tmp_path, "nanogpt_job.py")
    _assert_top_level_read_the_rank_trained(run)
    assert "spare takes rank 1 of 4 (epoch 1)" in run.log, run.log[-4000:]
    # the batch it prefetches in the step is saved with each snapshot and put back
    assert "`X`, `Y` put back as the loop carried them into step" in run.log
    assert PREFIX not in run.log
    # its top-level init_process_group ran before any function: it did nothing, and said so
    assert "Traceback" not in run.log, run.log[run.log.index("Traceback") :][:3000]


@pytest.mark.slow
def test_a_nanogpt_shaped_script_recovers_bit_exact_through_restarts_in_place(tmp_path) -> None:
    reference, run = run_with_reference(
        tmp_path, ARGS, script="nanogpt_job.py", chaos="kill rank=1 at=10; kill rank=2 at=20"
    )
    assert run.returncode == 0, run.log[-4000:]
    assert [e["ranks"] for e in run.report["events"]] == [[1], [2]]
    assert_same_digests(run, reference)
    _assert_top_level_read_the_rank_trained(run)
    assert "restart in place" in run.log


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
