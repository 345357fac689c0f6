"""What a finished ``peerckpt run`` says about the protection it gave (``launch/report.py``'s
summary, printed last and in the JSON report): its figures for an ordinary job, NOT
PROTECTED for a loop that never snapshotted, and the warning, at the first snapshot, about a
batch the code before the loop took from a tracked loader (nanoGPT's prefetch, from a
StatefulDataLoader's iterator).

The job is ``tests/jobs/user_loop.py`` on one node of two ranks."""

from __future__ import annotations

import pytest

from peerckpt.runtime.audit import PREFIX

from .conftest import run_job

LOOP = ["--patterns", "inner-tracked"]


@pytest.mark.parametrize(
    ("how", "args"),
    [
        ("range", ["--loop", "range"]),  # the script's own loop: ctx.steps never runs
        ("untracked", ["--leave-out", "model,optim"]),  # ctx.steps, nothing tracked
    ],
)
def test_a_job_that_takes_no_snapshot_ends_not_protected(tmp_path, how, args) -> None:
    run = run_job(
        tmp_path, script="user_loop.py", script_args=[*LOOP, "--steps", "6", *args], nodes=1
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "NOT PROTECTED: no snapshot was taken (loop over ctx.steps)" in run.log
    summary = run.report["summary"]
    assert summary["protected"] is False and summary["snapshots_committed"] == 0
    assert summary["rank_snapshots"] == 0 and summary["committed_step"] is None
    said = "ctx.steps runs with nothing tracked: no snapshot is taken"
    assert (said in run.log) == (how == "untracked")


def test_the_summary_counts_what_protected_a_job_and_a_batch_taken_early_is_named(
    tmp_path,
) -> None:
    """12 steps, a snapshot every step (the script's ``every=1``), flushed every 5 steps and
    at the end; the batch for the next step is taken from the tracked loader at the end of
    each step, the first one before the loop."""
    run = run_job(
        tmp_path,
        script="user_loop.py",
        script_args=["--patterns", "inner-tracked,prefetch,stateful-loader", "--steps", "12"],
        nodes=1,
        extra=["--persist", str(tmp_path / "ckpt"), "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    summary = run.report["summary"]
    assert summary["snapshots_committed"] == 12 and summary["committed_step"] == 11
    assert summary["durable_step"] == 11 and summary["persisted"] is True
    assert summary["faults"] == summary["faults_survived"] == 0
    line = (
        "protection: 12 snapshots committed, last committed step 11, last durable step 11, "
        "0 faults survived"
    )
    *_, protection, inexact = run.log.rstrip().splitlines()
    assert protection == line, run.log[-2000:]
    # the batch taken early, named at the first snapshot, is said again at the end
    assert inexact.startswith("NOT EXACT: a restore would be not bit for bit: the loop uses 1 ")
    [found] = summary["inexact"]
    said = "the code before the loop took 1 batch from data (a StatefulDataLoader over a"
    assert found.startswith(said) and found in inexact
    warnings = [x for x in run.log.splitlines() if PREFIX in x]
    assert len(warnings) == 2, warnings  # one per rank, at its first snapshot, nothing else
    for warning in warnings:
        assert "step=0]" in warning and PREFIX + said in warning
        assert "take batches inside the loop only" in warning
