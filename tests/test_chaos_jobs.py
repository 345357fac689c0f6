"""Every chaos fault on a whole local job, ending bit-exact against a fault-free run.

The job is ``tests/jobs/ddp_job.py`` (2 nodes × 2 ranks unless said). Each test compares every
digest any rank recorded — steps trained again after a restore included — and the final state
with a fault-free run of the same job; the leak check of ``conftest.py`` then asserts that no
process, socket or shared-memory file is left. Four of them run in ``make test``; the rest
(marked slow) in ``make test-all``.
"""

from __future__ import annotations

import pytest

from .conftest import JobRun, assert_same_digests, run_job, run_with_reference


def _one_recovery(run: JobRun, kind: str) -> dict:
    assert run.returncode == 0, run.log[-4000:]
    [event] = run.report["events"]
    assert event["kind"] == kind and event["resumed_at"] is not None, event
    return event


@pytest.mark.slow  # make test: fencing in tests/replication/test_fencing.py
def test_a_hung_rank_is_declared_lost_replaced_and_fenced_when_it_wakes(tmp_path) -> None:
    # SIGSTOP rank 2 for 6 s; its agent declares it lost after 1.5 s without a heartbeat, a
    # spare replaces it, and the job is still training when it wakes up.
    args = ["--steps", "60", "--sleep", "0.08"]
    reference, run = run_with_reference(
        tmp_path,
        args,
        spares=1,
        chaos="hang rank=2 at=10 for=6",
        extra=["--heartbeat-timeout", "1.5"],
    )
    event = _one_recovery(run, "rank")
    assert event["ranks"] == [2] and "hung or stopped" in event["reason"]
    assert_same_digests(run, reference)
    # It woke while the job ran, was told it is fenced, and left without acting.
    fenced = run.log.index("this process exits without touching the job")
    assert fenced < run.log.index("job succeeded in epoch"), run.log[-4000:]
    [hang] = run.report["chaos"]
    woke_line = run.log[fenced - 300 : fenced]
    assert f"pid {hang['pid']}" in woke_line
    assert f"fenced rank pid {hang['pid']} exited" in run.log


def test_a_rank_computing_is_left_alone_and_one_stuck_outside_collectives_is_fenced(
    tmp_path, reference_run
) -> None:
    # Rank 1 computes in one C call that never lets its heartbeat thread run (json.loads of a
    # large annotation file, in a detection script) for longer than the heartbeat timeout.
    # It was declared hung and fenced (every rank of a job parsing a 208 MB file at start:
    # the job failed); it computes, so it is named and left to finish, also past
    # --stall-timeout. Later rank 2 stops in its step 10, in no collective and using no CPU
    # (as behind a DataLoader that never delivers); its heartbeats go on, so nothing found it
    # and the job waited for the process group's timeout (30 min). Its agent now names it
    # with its stack and fences it; the ranks waiting for it in the all-reduce are left alone.
    run = run_job(
        tmp_path,
        script_args=[
            *["--steps", "30", "--busy-rank", "1", "--busy-at", "5", "--busy-s", "4"],
            *["--stuck-rank", "2", "--stuck-at", "10"],
        ],
        extra=["--heartbeat-timeout", "1.5", "--stall-timeout", "4"],
    )
    assert "not declared hung while it computes" in run.log
    assert "hung or stopped" not in run.log
    event = _one_recovery(run, "rank")
    assert event["ranks"] == [2], event
    assert event["in_place"] == {"2": 1}, event  # no spare: restarted from its node's memory
    assert event["replacements"]["2"][0] == 1, event
    assert "stuck past --stall-timeout 4 s" in event["reason"], event
    assert "in no collective and uses no CPU" in event["reason"], event
    named = run.log.index("no step for a while on node 1")
    assert "in run_steps" in run.log[named:]  # rank 2's Python stack, from its faulthandler
    assert_same_digests(run, reference_run)


@pytest.mark.slow  # make test: tests/launch/test_processes.py (a live process killed first)
def test_a_hung_rank_with_no_spare_is_killed_and_restarted_in_place(tmp_path) -> None:
    """No spare: rank 2, stopped, is declared lost while alive. Its launcher SIGKILLs it
    before a fresh process on node 1 maps the same slots and takes rank 2 from them."""
    args = ["--steps", "60", "--sleep", "0.08"]
    reference, run = run_with_reference(
        tmp_path, args, chaos="hang rank=2 at=10 for=6", extra=["--heartbeat-timeout", "1.5"]
    )
    event = _one_recovery(run, "rank")
    assert event["ranks"] == [2] and "hung or stopped" in event["reason"]
    assert event["in_place"] == {"2": 1} and event["replacements"]["2"][0] == 1
    [hang] = run.report["chaos"]
    assert f"pid {hang['pid']} on node 1 was declared lost alive: killing it" in run.log
    assert "this process exits without touching the job" not in run.log  # it never woke
    assert_same_digests(run, reference)


def test_a_killed_agent_loses_its_node_and_its_ranks_are_replaced(tmp_path, reference_run) -> None:
    run = run_job(
        tmp_path, script_args=["--steps", "30"], spares=2, chaos="kill agent node=1 at=12"
    )
    event = _one_recovery(run, "node")
    assert event["ranks"] == [2, 3]
    assert_same_digests(run, reference_run)
    # The node's ranks, alive but without their agent, left on their own.
    assert run.log.count("the node agent is gone (node lost); this rank process exits") == 2


@pytest.mark.slow  # make test: node losses in test_jobs, the campaign
def test_a_long_partition_loses_the_node_and_the_job_goes_on_without_it(
    tmp_path, reference_run
) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "30"],
        spares=2,
        chaos="partition node=1 at=12 for=4",
        extra=["--heartbeat-timeout", "1.5"],
    )
    event = _one_recovery(run, "node")
    assert event["ranks"] == [2, 3] and "no heartbeat" in event["reason"]
    assert_same_digests(run, reference_run)


@pytest.mark.slow
def test_a_short_partition_heals_without_a_recovery(tmp_path, reference_run) -> None:
    # Shorter than the heartbeat timeout: pushes to and from node 1 fail, are retried, and go
    # through once it heals; nobody is declared lost.
    run = run_job(
        tmp_path,
        script_args=["--steps", "30"],
        chaos="partition node=1 at=12 for=1",
        extra=["--heartbeat-timeout", "4"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert run.report["events"] == []
    # The fault took effect: node 1 cut its open links (a push caught in the one second
    # fails with "cut (chaos: partition)" as well, when one is in flight then).
    assert "partitioned for" in run.log and "cutting every connection" in run.log
    assert_same_digests(run, reference_run)


@pytest.mark.slow
def test_a_slow_node_slows_the_job_but_changes_nothing(tmp_path, reference_run) -> None:
    run = run_job(tmp_path, script_args=["--steps", "30"], chaos="slow node=1 at=5 rate=2 for=3")
    assert run.returncode == 0, run.log[-4000:]
    assert run.report["events"] == []
    assert "data links slowed to 2.0 MB/s" in run.log
    assert_same_digests(run, reference_run)


def test_a_rank_killed_in_the_middle_of_its_snapshot_copy(tmp_path, reference_run) -> None:
    run = run_job(
        tmp_path, script_args=["--steps", "30"], spares=1, chaos="kill rank=2 at=10 during=snapshot"
    )
    event = _one_recovery(run, "rank")
    [kill] = run.report["chaos"]
    assert kill["during"] == "snapshot" and kill["struck"]["rank"] == 2
    assert kill["struck"]["pid"] == kill["pid"]  # the kill landed on the struck process
    # The half-written snapshot was never committed: the restore is an earlier step.
    assert event["restore_step"] < kill["struck"]["step"]
    assert_same_digests(run, reference_run)


@pytest.mark.slow
def test_a_node_killed_while_it_pushes_a_snapshot_to_its_buddy(tmp_path, reference_run) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "30"],
        spares=2,
        chaos="kill node=1 at=10 during=replication",
    )
    event = _one_recovery(run, "node")
    [kill] = run.report["chaos"]
    assert kill["during"] == "replication" and kill["struck"]["node"] == 1
    assert event["restore_step"] < kill["struck"]["step"]
    assert_same_digests(run, reference_run)


@pytest.mark.slow
def test_a_second_rank_killed_while_the_first_is_being_repaired(tmp_path, reference_run) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "30"],
        spares=2,
        chaos="kill rank=1 at=10; kill rank=3 at=10 during=recovery",
    )
    assert run.returncode == 0, run.log[-4000:]
    _first, second = run.report["chaos"]
    assert second["during"] == "recovery"
    lost = sorted(r for e in run.report["events"] for r in e["ranks"])
    assert lost == [1, 3]
    assert_same_digests(run, reference_run)


@pytest.mark.slow  # make test: the coordinator killed just after an agent (next), and test_rebuild
def test_a_killed_coordinator_is_restarted_and_the_job_goes_on(tmp_path, reference_run) -> None:
    run = run_job(tmp_path, script_args=["--steps", "30"], chaos="kill coordinator at=10")
    assert run.returncode == 0, run.log[-4000:]
    assert run.report["events"] == []  # nothing was lost: no recovery, no step trained again
    assert "rebuilding from the agents: epoch 0, 4 ranks" in run.log
    assert run.log.count("registered again with the restarted coordinator") == 2
    assert_same_digests(run, reference_run)


def test_a_coordinator_killed_just_after_an_agent_comes_back_and_the_job_goes_on(
    tmp_path, reference_run
) -> None:
    # Node 1's agent dies: its ranks go to the two spares, and the launcher (--keep-spares, as
    # in a chaos campaign) starts a fresh spare node for the reserve. Two steps later the
    # coordinator dies too: while that node's agent registers (it waits for the restarted
    # coordinator instead of failing the job), or while the new epoch's group forms on the
    # rendezvous store that died with it (the restarted one re-forms it), or after both.
    run = run_job(
        tmp_path,
        script_args=["--steps", "30"],
        spares=2,
        chaos="kill agent node=1 at=8; kill coordinator at=10",
        extra=["--keep-spares"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert all(c.get("fired_at") for c in run.report["chaos"]), run.report["chaos"]
    assert "rebuilding from the agents" in run.log
    assert "did not come back" not in run.log and "could not register" not in run.log
    assert_same_digests(run, reference_run)


@pytest.mark.slow  # make test: tests/launch/test_monitor.py (events kept across a restart)
def test_the_report_keeps_a_recovery_seen_only_by_a_coordinator_killed_since(
    tmp_path, reference_run
) -> None:
    # The acceptance campaign's case: rank 1 dies and its spare takes it, so the launcher
    # (--keep-spares) starts a fresh spare node and waits for its agent; the coordinator is
    # killed three steps into the new epoch, before the launcher's watch loop polled the
    # recovery again. The restarted coordinator knows nothing of it, and the report lost it.
    # Then rank 2 dies: the report has both, each paired with its kill.
    run = run_job(
        tmp_path,
        script_args=["--steps", "30", "--sleep", "0.05"],
        spares=1,
        chaos="kill rank=1 at=8; kill coordinator at=11; kill rank=2 at=18",
        extra=["--keep-spares"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "restarting it (restart 1)" in run.log
    events = run.report["events"]
    assert [e["ranks"] for e in events] == [[1], [2]], events
    assert all(e["kind"] == "rank" and e["resumed_at"] is not None for e in events), events
    assert run.report["summary"]["faults"] == 2
    chaos = {c["action"]: c["fired_at"] for c in run.report["chaos"]}
    assert events[0]["resumed_at"] < chaos["kill coordinator at=11"] < events[1]["detected_at"]
    assert_same_digests(run, reference_run)


@pytest.mark.slow
def test_a_rank_lost_while_the_coordinator_is_down_is_recovered_by_the_restarted_one(
    tmp_path, reference_run
) -> None:
    # Rank 2 dies in the same instant as the coordinator: nobody hears of it until the new
    # coordinator rebuilds its state, sees rank 2's process missing from node 1's report, and
    # recovers it from the copies the agents said they hold.
    run = run_job(
        tmp_path,
        script_args=["--steps", "30"],
        spares=1,
        chaos="kill coordinator at=10; kill rank=2 at=10",
    )
    event = _one_recovery(run, "rank")
    assert event["ranks"] == [2] and "while the coordinator was down" in event["reason"]
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert pulls[2]["source"] == 0 and pulls[2]["bytes"] > 0  # from its buddy's memory
    assert_same_digests(run, reference_run)
