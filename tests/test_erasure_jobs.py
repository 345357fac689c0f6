"""Jobs with erasure-coded redundancy (``--erasure K+M``): lost nodes rebuilt from parity.

The fast case runs in ``make test``: 4 nodes × 1 rank with 3+1, node 1 killed, its rank
rebuilt on the spare node from the three survivors' pieces and parity; every step trained
again after the restore has the digest it had the first time. The FSDP2 cases (slow) compare
every step with a fault-free run, one node lost with 3+1 and two at once with 3+2; two lost
at once with 3+1, one more than M, fall back to durable storage, saying why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from peerckpt.reads import ERASURE
from tests.conftest import JobRun, read_jsonl, run_job, run_with_reference


def _assert_retrained_alike(run: JobRun, ranks: int, steps: int) -> None:
    """Every step of every rank has one digest, however often it ran (a wrong restore makes
    the steps trained again differ), and every step is there."""
    got = run.digests()
    assert set(got) == {(r, s) for r in range(ranks) for s in range(steps)}, "a step is missing"
    for (rank, step), digests in got.items():
        assert len(digests) == 1, f"rank {rank} step {step} differs after the restore"


def _rebuilt(run: JobRun) -> dict[int, dict[str, int]]:
    [event] = run.report["events"]
    return {p["rank"]: p for p in event["pulls"] if p["source"] == ERASURE}


def test_a_node_lost_under_erasure_3_1_is_rebuilt_bit_for_bit(tmp_path: Path) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "24"],
        nodes=4,
        nproc=1,
        spares=1,
        chaos="kill node=1 at=12",
        extra=["--erasure", "3+1", "--max-restarts", "0"],
    )
    assert run.returncode == 0, run.log[-4000:]
    _assert_retrained_alike(run, ranks=4, steps=24)
    rebuilt = _rebuilt(run)
    assert set(rebuilt) == {1} and rebuilt[1]["bytes"] > 0, run.report["events"]
    assert "rebuilt rank 1 step" in run.log
    assert "rebuilt from its group's pieces and parity" in run.log  # the report says so


def _full_digests(out: Path) -> dict[int, str]:
    return {f["step"]: f["digest"] for f in read_jsonl(out / "full.jsonl")}


@pytest.mark.slow  # two FSDP2 jobs of 4 nodes, ~30 s each
def test_fsdp2_on_4_nodes_with_erasure_3_1_survives_a_node_kill(tmp_path: Path) -> None:
    args = ["--kind", "fsdp", "--steps", "16"]
    reference, run = run_with_reference(
        tmp_path,
        args,
        script="reshard_job.py",
        nodes=4,
        nproc=1,
        spares=1,
        chaos="kill node=2 at=8",
        extra=["--erasure", "3+1", "--max-restarts", "0"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert _full_digests(run.out) == _full_digests(reference.out)
    assert set(_rebuilt(run)) == {2}


@pytest.mark.slow  # two FSDP2 jobs of 5 nodes, ~40 s each
def test_fsdp2_on_5_nodes_with_erasure_3_2_survives_two_nodes_lost_at_once(
    tmp_path: Path,
) -> None:
    args = ["--kind", "fsdp", "--steps", "16"]
    reference, run = run_with_reference(
        tmp_path,
        args,
        script="reshard_job.py",
        nodes=5,
        nproc=1,
        spares=2,
        chaos="kill node=1 at=8; kill node=3 at=8",
        extra=["--erasure", "3+2", "--max-restarts", "0"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert _full_digests(run.out) == _full_digests(reference.out)
    events = run.report["events"]
    rebuilt = {p["rank"] for e in events for p in e["pulls"] if p["source"] == ERASURE}
    assert rebuilt == {1, 3}, events


@pytest.mark.slow  # one job of 4 nodes, ~30 s
def test_more_losses_than_m_fall_back_to_storage_and_say_why(tmp_path: Path) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "24"],
        nodes=4,
        nproc=1,
        spares=2,
        chaos="kill node=1 at=12; kill node=2 at=12",
        extra=[
            "--erasure",
            "3+1",
            "--max-restarts",
            "0",
            "--persist",
            f"file://{tmp_path / 'ckpt'}",
            "--persist-every",
            "4",
        ],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert (
        "no memory copy survived (erasure 3+1: rank(s) [1, 2] cannot be rebuilt from memory: "
        "their group (nodes [0, 1, 2, 3]) lost nodes [1, 2] together, more than the 1 its "
        "parity survives" in run.log
    ), run.log[-4000:]
    assert "falling back to durable step" in run.log
    _assert_retrained_alike(run, ranks=4, steps=24)


@pytest.mark.slow  # one FSDP2 job of 4 nodes, ~25 s
def test_fsdp2_reshards_into_a_shrunk_world_from_a_rebuilt_rank(tmp_path: Path) -> None:
    """No spare: node 1's loss shrinks 4 ranks to 3, and old rank 1, which no node holds,
    is rebuilt from its group where the plan reads it; the restored full state is the
    committed step's."""
    run = run_job(
        tmp_path,
        "reshard_job.py",
        ["--kind", "fsdp", "--steps", "15"],
        nodes=4,
        nproc=1,
        chaos="kill node=1 at=6",
        extra=["--erasure", "3+1", "--min-nodes", "1", "--max-restarts", "0"],
    )
    assert run.returncode == 0, run.log[-4000:]
    [restored] = read_jsonl(tmp_path / "restored.jsonl")
    assert restored["world"] == 3
    committed = [
        f
        for f in read_jsonl(tmp_path / "full.jsonl")
        if f["step"] == restored["restored"] and f["epoch"] < restored["epoch"]
    ]
    assert committed and restored["digest"] == committed[-1]["digest"]
    assert "rebuilt rank 1 step" in run.log


@pytest.mark.slow  # one job of 4 nodes, ~15 s
def test_the_scripts_erasure_protects_the_job(tmp_path: Path) -> None:
    """@resilient(erasure="3+1") with no --replicas or --erasure from the launcher."""
    run = run_job(
        tmp_path,
        script_args=["--steps", "24", "--erasure", "3+1"],
        nodes=4,
        nproc=1,
        spares=1,
        chaos="kill node=2 at=12",
        extra=["--max-restarts", "0"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "erasure 3+1 from the script" in run.log
    _assert_retrained_alike(run, ranks=4, steps=24)
    assert set(_rebuilt(run)) == {2}
