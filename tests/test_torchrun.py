"""The same decorated script under plain torchrun, on two "hosts" of this machine.

Each host is a torchrun process tree with its own loopback address (``tests/torchrun_hosts.py``).
torchrun restarts every worker after any failure; the restarted workers must restore from
their own host's memory (no byte over the network) and come out bit for bit as the fault-free
run of the same job (the session's ``peerckpt run`` reference: same script, same 2 × 2 world).
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from peerckpt.launch.timeline import load_report, timeline_data

from .conftest import JOBS, JobRun, assert_same_digests, job_name, read_jsonl
from .torchrun_hosts import TorchrunJob, runtime_dirs

SCRIPT = JOBS / "ddp_job.py"


def _finish(job: TorchrunJob, timeout: float = 300.0) -> tuple[list[int | None], dict]:
    try:
        codes = job.wait(timeout)
    finally:
        job.stop()
    report = job.report()
    assert not runtime_dirs(job.job), "a host left its runtime directory behind"
    return codes, report


def test_a_killed_worker_is_restarted_by_torchrun_and_restores_from_its_hosts_memory(
    tmp_path: Path, reference_run: JobRun
) -> None:
    job = TorchrunJob(
        tmp_path, job_name(), SCRIPT, [str(tmp_path), "--steps", "30", "--sleep", "0.1"]
    )
    job.wait_for_step("rank2.jsonl", 10)
    job.kill_worker(1)
    codes, report = _finish(job)
    log = job.log()
    assert codes == [0, 0], log[-6000:]
    assert report["state"] == "succeeded", report
    [event] = report["events"]
    # torchrun restarted every worker on both hosts; each rank went back to its own host.
    assert event["kind"] == "rank" and event["ranks"] == [0, 1, 2, 3], event
    for rank, (node, _pid) in event["replacements"].items():
        assert node == event["lost"][rank], f"rank {rank} moved to node {node}"
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert set(pulls) == {0, 1, 2, 3}
    for pull in pulls.values():  # restored from its own host's memory: no network
        assert pull["source"] == pull["node"] and pull["bytes"] == 0, pull
    assert event["resumed_at"] is not None
    run = JobRun(0, report, tmp_path, log)
    assert_same_digests(run, reference_run)
    # the report is a job report like `peerckpt run --report`'s: `peerckpt timeline` draws it
    result = load_report(str(job.report_path))
    assert result.summary["faults_survived"] == 1 and result.summary["protected"], result.summary
    drawn = timeline_data(result)
    assert [f["kind"] for f in drawn["faults"]] == ["rank"], drawn["faults"]
    assert drawn["ranks"], "no step was sampled for the timeline"


@pytest.mark.slow
def test_a_lost_host_shrinks_an_elastic_torchrun_job_from_peer_memory(
    tmp_path: Path, reference_run: JobRun
) -> None:
    """``--nnodes=1:2``: host 1 dies (SIGKILL to its torchrun's process group); torchrun
    restarts host 0's workers in a world of one host, and they reshard the committed step of
    all four ranks from host 0's memory (its own snapshots and its replicas of host 1's)."""
    job = TorchrunJob(
        tmp_path,
        job_name(),
        SCRIPT,
        [str(tmp_path), "--steps", "30", "--sleep", "0.1"],
        nnodes="1:2",
        rdzv_conf="last_call_timeout=1",
    )
    job.wait_for_step("rank2.jsonl", 10)
    job.kill_host(1)
    codes, report = _finish(job, timeout=400.0)
    log = job.log()
    assert codes[0] == 0, log[-6000:]
    assert report["state"] == "succeeded", report
    [event] = report["events"]
    assert event["kind"] == "node" and event["shrunk_to"] == 2 and event["mode"] == "reshard"
    assert event["resumed_at"] is not None
    # Before the loss: the fault-free run's bits.
    expected = reference_run.digests()
    steps: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
    for rank in range(4):
        for entry in read_jsonl(tmp_path / f"rank{rank}.jsonl"):
            steps[(entry["epoch"], entry["step"])].add(entry["digest"])
            if entry["epoch"] == 0:
                assert {entry["digest"]} == expected[(rank, entry["step"])]
    # After it: both ranks of the one-host world restored the committed step, bit for bit.
    restored = read_jsonl(tmp_path / "restored.jsonl")
    assert sorted(r["rank"] for r in restored) == [0, 1] and {r["world"] for r in restored} == {2}
    for r in restored:
        assert r["step"] == event["restore_step"]
        assert {r["digest"]} == expected[(0, r["step"])], "restored other bits"
    assert max(s for (e, s) in steps if e == event["epoch"]) == 29  # trained to the end
