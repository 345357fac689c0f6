"""Training loops written the way users write them recover bit for bit (the matrix of README's
"Use" section).

The job is ``tests/jobs/user_loop.py``: a plain script with a decorated train function, whose
flags pick the habits of ordinary training scripts — the model tracked before it is wrapped in
DDP, torchdata's StatefulDataLoader with worker processes (augmentation and masking drawn in
them), GradScaler, two optimizers, an LR schedule, gradient accumulation under ``no_sync``,
BatchNorm, user state. Each case kills a
rank and later a whole node under ``peerckpt run --nodes 2 --nproc-per-node 2`` and compares
every digest any rank recorded (steps trained again included) and the final state with a
fault-free run. With loader workers it also checks that the killed rank was acted on at once
(its workers hold its socket) and that no worker outlived its rank. ``make test`` runs every
pattern at once in one job; ``make test-all`` also runs one job per pattern.
"""

from __future__ import annotations

import re

import pytest

from peerckpt.chaos import FiredAction
from peerckpt.launch.report import failure_rows
from peerckpt.messages.control import RecoveryEvent
from peerckpt.runtime.audit import PREFIX

from .conftest import JobRun, assert_same_digests, read_jsonl, run_job, run_with_reference
from .jobs.user_loop import EXACT

STEPS = 24
CHAOS = "kill rank=1 at=8; kill node=1 at=16"


def _recover_bit_exact(tmp_path, patterns: str) -> tuple[JobRun, JobRun]:
    """Kill rank 1, later node 1; every step bit-exact. With loader workers (``all``,
    ``stateful-loader``), also: the rank's death is acted on at once although its workers hold
    its socket, and no worker outlives its rank (the killed rank's, nor the lost node's)."""
    workers = patterns in ("all", "stateful-loader", "worker-random")
    reference, run = run_with_reference(
        tmp_path,
        ["--steps", str(STEPS), "--patterns", patterns] + (["--record-workers"] if workers else []),
        script="user_loop.py",
        spares=3,
        chaos=CHAOS,
    )
    assert run.returncode == 0, run.log[-4000:]
    rank_loss, node_loss = run.report["events"]
    assert rank_loss["kind"] == "rank" and rank_loss["ranks"] == [1]
    assert node_loss["kind"] == "node" and node_loss["ranks"] == [2, 3]
    assert node_loss["resumed_at"] is not None
    steps = {(r, s) for r in range(4) for s in range(STEPS)}
    assert set(run.digests()) == steps, "a step is missing"
    assert_same_digests(run, reference)
    for job in (reference, run):  # a script that tracks everything it uses gets no warning
        assert PREFIX not in job.log, job.log[job.log.index(PREFIX) - 200 :][:2000]
    if workers:
        _assert_workers_died_with_their_rank(run)
    return reference, run


def _assert_workers_died_with_their_rank(run: JobRun) -> None:
    events = [RecoveryEvent.from_json(e) for e in run.report["events"]]
    fired = [FiredAction.from_json(c) for c in run.report["chaos"]]
    rank_row = failure_rows(events, fired)[0]
    assert rank_row.detected_s is not None and rank_row.detected_s < 0.5, rank_row
    kill = run.report["chaos"][0]
    assert len(list((run.out / "workers").glob(f"{kill['pid']}-*"))) >= 2, "no loader workers"
    restored = read_jsonl(run.out / "orphans.jsonl")
    assert sorted(r["rank"] for r in restored) == [0, 0, 1, 1, 2, 2, 3, 3]  # two restores
    assert all(r["orphans"] == [] for r in restored), restored


def test_every_pattern_at_once_recovers_bit_exact_from_a_rank_and_a_node_loss(tmp_path) -> None:
    _recover_bit_exact(tmp_path, "all")


@pytest.mark.slow  # make test: an AppState job over FSDP2 (test_reshard_jobs), DDP's in tests/runtime
def test_a_dcp_app_state_holding_ddp_and_two_optimizers_recovers_bit_exact(tmp_path) -> None:
    """The DCP tutorial's AppState (get/set_state_dict) holds the model, wrapped in DDP after
    the track, and two optimizers; a scheduler and accumulation under no_sync beside it. The
    DDP's bucket layout is kept under the AppState's path, and nothing is named untracked."""
    _recover_bit_exact(tmp_path, "inner-tracked,app-state,two-optimizers,lambdalr,accumulation")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", EXACT)
def test_each_pattern_recovers_bit_exact_from_a_rank_and_a_node_loss(tmp_path, pattern) -> None:
    _recover_bit_exact(tmp_path, pattern)


def test_what_a_script_uses_but_does_not_track_is_named_once_at_the_first_snapshot(
    tmp_path,
) -> None:
    """The script forgets to track its LR scheduler and its StatefulDataLoader: every rank says
    so once, at its first snapshot (step 0), naming each and the fix; the job's summary says
    it again at the end, and its report lists both."""
    run = run_job(
        tmp_path,
        script="user_loop.py",
        script_args=["--steps", "6", "--patterns", "all", "--leave-out", "sched,data"],
    )
    assert run.returncode == 0, run.log[-4000:]
    for named in ("LR scheduler LambdaLR of optimizer AdamW", "a StatefulDataLoader over a Augm"):
        lines = [line for line in run.log.splitlines() if PREFIX + named in line]
        ranks = sorted(re.search(r"rank=(\d) epoch=0 step=0\]", line)[1] for line in lines)
        assert ranks == ["0", "1", "2", "3"], lines
        assert all("ctx.track(..., " in line for line in lines)
    assert run.log.count(PREFIX) == 8  # nothing else
    inexact = run.report["summary"]["inexact"]
    assert len(inexact) == 2 and any("LR scheduler LambdaLR" in line for line in inexact)
    assert "NOT EXACT: a restore would be not bit for bit: the loop uses 2 thing(s)" in run.log
