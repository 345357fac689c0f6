"""The overhead budget in a whole job: snapshots that cost much against the step are taken
every n > 1 steps, as the ranks measured and agreed, and a failure still recovers bit for bit.
"""

from __future__ import annotations

import re

import pytest

from .conftest import JobRun, assert_same_digests, run_job


@pytest.mark.slow
def test_overhead_budget_picks_an_interval_and_a_kill_still_recovers_exactly(
    tmp_path, reference_run: JobRun
) -> None:
    """Node 0's data links are slowed to 1 MB/s from the start, so a snapshot (277 KB per
    rank, replicated before it commits) costs a step far more than 5 % of its 0.1 s."""
    run = run_job(
        tmp_path,
        script_args=["--steps", "30", "--sleep", "0.1", "--overhead", "0.05"],
        spares=1,
        chaos="slow node=0 at=0 rate=1; kill rank=2 at=10",
    )
    assert run.returncode == 0, run.log[-4000:]
    agreed = {int(n) for n in re.findall(r"the ranks agreed on every (\d+) step", run.log)}
    assert agreed and min(agreed) > 1, "the budget did not space the snapshots out"
    [event] = run.report["events"]
    # a calibration snapshot, or that of the step the ranks agreed at (10 at the earliest)
    assert event["kind"] == "rank" and event["restore_step"] <= 10
    assert_same_digests(run, reference_run)
