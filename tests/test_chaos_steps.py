"""A chaos step is a training step: ``at=S`` fires while the ranks run step S, however rarely
snapshots are taken; an action that never fired fails the run; one that cannot exist is
refused before anything starts (``chaos/monkey.py``, ``chaos/points.py``)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest

from .conftest import (
    JOBS,
    PREFIX,
    REPO,
    JobRun,
    assert_same_digests,
    job_name,
    read_jsonl,
    run_job,
)


def _steps_of_epoch(run: JobRun, epoch: int) -> list[int]:
    """Every step any rank recorded in ``epoch``."""
    return [
        entry["step"]
        for path in run.out.glob("rank*.jsonl")
        for entry in read_jsonl(path)
        if entry["epoch"] == epoch
    ]


def test_a_kill_fires_in_its_training_step_however_rarely_snapshots_are_taken(
    tmp_path, reference_run
) -> None:
    # A snapshot after step 0 and none after: nothing is committed between step 0 and the
    # end, so a kill timed by commits (as it was) would never fire and the run would pass.
    run = run_job(
        tmp_path,
        script_args=["--steps", "30", "--every", "1000"],
        spares=1,
        chaos="kill rank=1 at=15",
    )
    assert run.returncode == 0, run.log[-4000:]
    [fired] = run.report["chaos"]
    assert fired["fired_at"] is not None and fired["step"] == 15 and fired["pid"]
    [event] = run.report["events"]
    assert event["kind"] == "rank" and event["ranks"] == [1] and event["restore_step"] == 0
    assert_same_digests(run, reference_run)
    # The ranks ran step 15 and waited for the kill before step 16: none got past it first.
    assert max(_steps_of_epoch(run, 0)) <= 16


def test_an_action_past_the_scripts_loop_fails_the_run_as_soon_as_the_loop_is_known(
    tmp_path,
) -> None:
    run = run_job(
        tmp_path, script_args=["--steps", "30", "--sleep", "0.1"], chaos="kill rank=1 at=500"
    )
    assert run.returncode != 0
    assert "'kill rank=1 at=500' can never fire: the script's loop is ctx.steps(30)" in run.log
    assert run.report["state"] == "failed" and run.report["unfired"], run.report
    # Refused at the first steps, not after the whole job (30 steps of 0.1 s at least).
    assert max(_steps_of_epoch(run, 0), default=-1) < 25


def test_a_rank_the_job_does_not_have_is_refused_before_anything_starts(tmp_path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "peerckpt.launch",
            "run",
            "--nodes",
            "1",
            "--nproc-per-node",
            "2",
            "--job",
            job_name(),
            "--chaos",
            "kill rank=9 at=5",
            str(JOBS / "ddp_job.py"),
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "rank 9 does not exist; the job has ranks 0…1 (1 node(s) × 2 rank(s))" in proc.stderr
    assert time.monotonic() - started < 30  # refused at once: no process of the job started
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"peerckpt-{PREFIX}*"))


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_under_the_default_budget_a_kill_at_a_step_fires_and_ends_bit_exact(
    tmp_path, reference_run, attempt
) -> None:
    # The interval the overhead budget picks (whatever it is on this machine today) does not
    # decide whether, or when, the kill fires.
    run = run_job(
        tmp_path,
        script_args=["--steps", "30", "--overhead", "0.05"],
        spares=1,
        chaos="kill rank=1 at=15",
    )
    assert run.returncode == 0, run.log[-4000:]
    [fired] = run.report["chaos"]
    assert fired["step"] == 15
    assert_same_digests(run, reference_run)
