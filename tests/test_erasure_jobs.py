"""Jobs with erasure-coded redundancy (``--erasure K+M``): lost nodes rebuilt from parity.

The fast case runs in ``make test``: 4 nodes × 1 rank with 3+1, node 1 killed, its rank
rebuilt on the spare node from the three survivors' pieces and parity (the DDP job codes
only what its data-parallel twins do not hold, so its twin chunks come from a twin); every
step trained again after the restore has the digest it had the first time. Slow: the DDP
job with twins against the same job coded whole (bit-exact, less parity), and a rank whose
twins differ coded anew, whole. The FSDP2 cases (slow) compare
every step with a fault-free run, one node lost with 3+1 and two at once with 3+2; two lost
at once with 3+1, one more than M, fall back to durable storage, saying why.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import threading
from pathlib import Path

import pytest

from peerckpt.reads import ERASURE
from tests.conftest import (
    SHM_GLOB,
    JobRun,
    assert_same_digests,
    read_jsonl,
    run_job,
    run_with_reference,
)


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


_PARITY_FILE = re.compile(r"-n\d+-p\d+-\d+-g\d+-\d+$")  # a parity buffer (replication/parity.py)


class _ParityPeak:
    """The peak bytes that this session's jobs hold in parity buffers in /dev/shm (every node
    together), sampled on a thread while a job runs: one job at a time runs here."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="parity-peak", daemon=True)

    def __enter__(self) -> _ParityPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            for path in glob.glob(SHM_GLOB):
                if _PARITY_FILE.search(path):
                    with contextlib.suppress(FileNotFoundError):
                        total += os.stat(path).st_blocks * 512
            self.peak = max(self.peak, total)


@pytest.mark.slow  # two DDP jobs of 4 nodes, ~15 s each
def test_ddp_twins_compose_with_erasure_3_1_bit_exact_for_less_parity(tmp_path: Path) -> None:
    """The DDP job declares its parameters and AdamW state data-parallel: with --erasure 3+1
    every rank codes only the rest (its loader and RNG state), since its twins on the other
    nodes hold them on more nodes than the parity survives losing. Node 1 killed: its rank is
    decoded from its group and its twin chunks read from a surviving twin; every step equals
    the fault-free run's (coded whole with --no-dedup), whose parity is the larger."""
    args = ["--steps", "24"]
    flags = ["--erasure", "3+1", "--max-restarts", "0"]
    with _ParityPeak() as whole:
        reference = run_job(tmp_path / "whole", script_args=[*args, "--no-dedup"], nodes=4,
                            nproc=1, extra=flags)  # fmt: skip
    assert reference.returncode == 0, reference.log[-4000:]
    with _ParityPeak() as deduplicated:
        run = run_job(tmp_path / "twins", script_args=args, nodes=4, nproc=1, spares=1,
                      chaos="kill node=1 at=12", extra=flags)  # fmt: skip
    assert run.returncode == 0, run.log[-4000:]
    assert_same_digests(run, reference)
    assert "not held by enough twins" not in run.log  # every rank's twins verified
    assert set(_rebuilt(run)) == {1}
    coded = re.findall(r"not coded into parity \((\d+) of (\d+) bytes", run.log)
    assert len(coded) == 2, run.log[-4000:]  # epoch 0 and the epoch after the recovery
    left_out, total = coded[0]
    assert int(left_out) > 0.8 * int(total)  # parameters and AdamW state: twins hold them
    assert re.search(
        r"rebuilt rank 1 step \d+ from \d+ piece\(s\) of its group and \d+ chunk", run.log
    )
    print(f"parity peak in /dev/shm: {whole.peak} B coded whole, {deduplicated.peak} B with twins")
    assert 0 < deduplicated.peak < 0.2 * whole.peak, (deduplicated.peak, whole.peak)


@pytest.mark.slow  # two DDP jobs of 4 nodes, ~15 s each
def test_a_rank_whose_twins_differ_is_coded_whole_and_rebuilt_bit_exact(tmp_path: Path) -> None:
    """Rank 1 nudges its parameters after every step: its declared chunks match no twin's, so
    the coordinator refuses the step it coded without them and has it coded whole from then
    on; node 1 killed, rank 1 is decoded whole from its group, bit for bit."""
    args = ["--steps", "24", "--skew-rank", "1"]
    reference, run = run_with_reference(
        tmp_path, args, nodes=4, nproc=1, spares=1, chaos="kill node=1 at=12",
        extra=["--erasure", "3+1", "--max-restarts", "0"],
    )  # fmt: skip
    assert run.returncode == 0, run.log[-4000:]
    assert_same_digests(run, reference)
    warned = re.findall(r"rank (\d+)'s data-parallel state at step \d+ is not held", run.log)
    assert warned == ["1", "1"], run.log[-4000:]  # once per epoch, rank 1 only
    assert set(_rebuilt(run)) == {1}
    assert re.search(r"rebuilt rank 1 step \d+ from \d+ piece\(s\) of its group\n", run.log)
