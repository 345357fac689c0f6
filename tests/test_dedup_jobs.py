"""Redundancy-aware replication in real jobs: a 2 nodes x 2 ranks DDP job mirrors only what
its data-parallel twins do not already hold, and a whole node's loss still recovers bit for
bit from the survivors' own slots and partial copies (docs/architecture.md)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import JobRun, assert_same_digests, run_job, run_with_reference
from tests.test_reshard_jobs import _assert_ddp_restores_match

_SAVED = re.compile(r"per snapshot step not mirrored \((\d+) of (\d+) bytes")


def _saved(run: JobRun) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in _SAVED.findall(run.log)]


def test_a_lost_node_recovers_bit_exact_from_twins(tmp_path, reference_run) -> None:
    run = run_job(tmp_path, script_args=["--steps", "30"], spares=2, chaos="kill node=1 at=12")
    assert run.returncode == 0, run.log[-4000:]
    assert_same_digests(run, reference_run)
    # every epoch left most of each snapshot to the twins: parameters and AdamW state
    saved = _saved(run)
    assert len(saved) == 2, run.log[-4000:]  # epoch 0 and the epoch after the recovery
    for left_out, total in saved:
        assert left_out > 0.8 * total, (left_out, total)
    assert "not held by enough twins" not in run.log  # every twin verified equal
    [event] = run.report["events"]
    assert event["kind"] == "node" and event["ranks"] == [2, 3]
    pulls = {p["rank"]: p for p in event["pulls"]}
    for rank in (2, 3):  # node 0 gave the partial copy and a twin's chunks: a whole snapshot
        assert pulls[rank]["source"] == 0
        assert pulls[rank]["bytes"] >= total // 4 - 4096


@pytest.mark.slow
def test_dedup_false_mirrors_everything_and_trains_the_same(tmp_path, reference_run) -> None:
    run = run_job(tmp_path, script_args=["--steps", "30", "--no-dedup"])
    assert run.returncode == 0, run.log[-4000:]
    assert _saved(run) == []
    assert_same_digests(run, reference_run)


@pytest.mark.slow
def test_a_deduplicated_job_grows_by_a_node_restoring_bit_exact(tmp_path) -> None:
    """2 nodes x 2 ranks (buddies hold partial copies) → 3 nodes: every rank restores the
    committed state through a plan that reads partial copies only in what they hold."""
    run = run_job(
        tmp_path,
        script_args=["--steps", "2000", "--sleep", "0.02", "--until-world", "6"],
        chaos="add node at=5",
    )
    assert run.returncode == 0, run.log[-4000:]
    assert _saved(run), run.log[-4000:]  # epoch 0 deduplicated
    _assert_ddp_restores_match(tmp_path, world=6, log=run.log)
    [event] = run.report["events"]
    assert event["kind"] == "grow" and event["grown_to"] == 6


@pytest.mark.slow
def test_a_rank_whose_twins_differ_is_pushed_whole_and_recovers_bit_exact(tmp_path) -> None:
    """Rank 1 nudges its parameters after every step, so its declared data-parallel chunks
    differ from ranks 0, 2 and 3's: the coordinator warns, has it pushed whole, and a kill of
    its node restores it from that whole copy (and rank 0 from its partial copy and twins)."""
    args = ["--steps", "24", "--skew-rank", "1"]
    reference, run = run_with_reference(tmp_path, args, spares=2, chaos="kill node=0 at=10")
    assert run.returncode == 0, run.log[-4000:]
    assert_same_digests(run, reference)
    warned = re.findall(r"rank (\d+)'s data-parallel state at step \d+ is not held", run.log)
    assert warned == ["1", "1"], run.log[-4000:]  # once per epoch, rank 1 only
    # ranks 0, 2 and 3 still left their parameters and AdamW state to their twins
    assert all(left_out > 0.6 * total for left_out, total in _saved(run)), _saved(run)
    [event] = run.report["events"]
    assert event["kind"] == "node" and event["ranks"] == [0, 1]
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert pulls[1]["source"] == 1 and pulls[0]["source"] == 1
