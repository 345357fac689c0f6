"""A job over several hosts: one ``peerckpt run`` per host, each on its own loopback address.

Every "host" is a separate launcher process tree with its own ``--node-addr`` (127.0.0.2,
127.0.0.3, …), its own run directory and shared-memory names, so a hard-coded 127.0.0.1 or a
path shared between hosts fails here. Results are compared bit for bit with the local
launcher's fault-free run of the same job (same ranks, same steps).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from .conftest import JobRun, job_name
from .hosts import Hosts, await_step
from .test_reshard_jobs import _assert_ddp_restores_match


def _hosts(out: Path, **kwargs: Any) -> Hosts:
    return Hosts(out, job_name(), **kwargs)


def _run(hosts: Hosts, report_of: int = 0) -> JobRun:
    return JobRun(hosts.procs[report_of].returncode, hosts.report(report_of), hosts.out, "")


def _assert_bit_exact(run: JobRun, reference: JobRun, ranks: int = 4, steps: int = 30) -> None:
    expected, got = reference.digests(), run.digests()
    assert set(got) == {(r, s) for r in range(ranks) for s in range(steps)}, "a step is missing"
    for key, digests in got.items():
        assert digests == expected[key], f"rank {key[0]} step {key[1]} differs"
    assert run.final() == reference.final()


def test_a_rank_killed_on_one_host_is_replaced_from_a_spare_host(tmp_path, reference_run) -> None:
    """Hosts 0 and 1 hold 2 ranks each, host 2 (--spare-host) 2 spares. Rank 2, on host 1,
    is killed at step 10: a spare on host 2 takes it, pulling its state from its buddy on
    another host; hosts 0 and 1 restore from their own memory."""
    hosts = _hosts(tmp_path)
    hosts.start(0)
    hosts.start(2, "--spare-host")
    hosts.start(1, "--chaos", "kill rank=2 at=10")
    done = hosts.wait()
    for rank, (code, log) in done.items():
        assert code == 0, f"host {rank} failed:\n{log[-4000:]}"
    run = _run(hosts)
    _assert_bit_exact(run, reference_run)
    events = run.report["events"]
    assert len(events) == 1, json.dumps(events, indent=1)[:4000]
    (event,) = events
    assert event["ranks"] == [2] and event["resumed_at"] is not None
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert pulls[2]["node"] == 2 and pulls[2]["source"] not in (1, 2) and pulls[2]["bytes"] > 0
    for rank in (0, 1, 3):  # survivors: their own node's memory, nothing over the network
        assert pulls[rank]["source"] == pulls[rank]["node"] and pulls[rank]["bytes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["from outside", "by chaos"])
def test_a_host_killed_whole_is_replaced_by_a_spare_host(tmp_path, reference_run, how) -> None:
    """SIGKILL to host 1's launcher and every process under it (agent, ranks) at step 12 —
    from outside, as a machine failure, or by ``--chaos 'kill node=1'`` given to host 1:
    host 2's spares take ranks 2 and 3 from their buddies' memory on host 0."""
    hosts = _hosts(tmp_path, steps=30)
    hosts.start(0)
    hosts.start(2, "--spare-host")
    if how == "by chaos":
        hosts.start(1, "--chaos", "kill node=1 at=12")
    else:
        hosts.start(1)
        await_step(tmp_path / "rank2.jsonl", 12)
        hosts.kill_host(1)
    done = hosts.wait()
    hosts.forget_dead_machine()
    assert done[0][0] == 0, done[0][1][-4000:]
    assert done[1][0] == -signal.SIGKILL
    run = _run(hosts)
    _assert_bit_exact(run, reference_run)
    kinds = [e["kind"] for e in run.report["events"]]
    assert "node" in kinds


@pytest.mark.slow
def test_the_coordinators_host_killed_moves_the_coordinator(tmp_path, reference_run) -> None:
    """SIGKILL to host 0 — the rendezvous host, running the coordinator, an agent and ranks 0
    and 1 — at step 12: host 1, next in the succession, starts a coordinator at its own
    address, which rebuilds the job from the agents on hosts 1 and 2; host 0's node is then
    lost and host 2's spares take ranks 0 and 1 from their buddies' memory on host 1."""
    hosts = _hosts(tmp_path, steps=30)
    hosts.start(0)
    hosts.start(2, "--spare-host")
    hosts.start(1)
    await_step(tmp_path / "rank0.jsonl", 12)
    hosts.kill_host(0)
    done = hosts.wait()
    hosts.forget_dead_machine()
    for rank in (1, 2):
        assert done[rank][0] == 0, f"host {rank} failed:\n{done[rank][1][-4000:]}"
    assert f"starting one at 127.0.0.3:{hosts.endpoint.rpartition(':')[2]}" in done[1][1]
    assert "the job's coordinator moved to 127.0.0.3" in done[2][1]
    run = _run(hosts, 1)
    _assert_bit_exact(run, reference_run)
    lost = [e for e in run.report["events"] if e["kind"] == "node"]
    assert lost and set(lost[-1]["ranks"]) == {0, 1}


@pytest.mark.slow
def test_a_host_killed_without_a_spare_shrinks_the_job(tmp_path) -> None:
    """Two hosts of 2 ranks, --min-nodes 1, no spare host: host 1 SIGKILLed at step 6. The
    job reshards its 4 ranks' committed state into 2 ranks on host 0, from host 0's own copies
    of host 1's ranks, and every rank of the new world restores the committed step exactly."""
    hosts = _hosts(tmp_path, steps=20)
    hosts.start(0, "--min-nodes", "1")
    hosts.start(1, "--min-nodes", "1")
    await_step(tmp_path / "rank2.jsonl", 6)
    hosts.kill_host(1)
    done = hosts.wait()
    hosts.forget_dead_machine()
    assert done[0][0] == 0, done[0][1][-4000:]
    _assert_ddp_restores_match(tmp_path, world=2, log=done[0][1])
    run = _run(hosts)
    [event] = run.report["events"]
    assert event["kind"] == "node" and event["mode"] == "reshard" and event["shrunk_to"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("how", ["a host started", "chaos add node"])
def test_a_host_started_later_grows_the_job(tmp_path, how) -> None:
    """A one-host job of 2 ranks grows to 4: a second host started with --node-rank 1 (beyond
    --nnodes 1, no --spare-host) joins with 2 ranks, or ``--chaos 'add node'`` on host 0
    starts one more node there; the newcomers pull their share of the committed state from
    node 0."""
    hosts = _hosts(
        tmp_path,
        nnodes=1,
        script_args=("--steps", "2000", "--sleep", "0.02", "--until-world", "4"),
    )
    if how == "a host started":
        hosts.start(0)
        await_step(tmp_path / "rank0.jsonl", 5)
        hosts.start(1)
    else:
        hosts.start(0, "--chaos", "add node at=5")
    done = hosts.wait()
    for rank, (code, log) in done.items():
        assert code == 0, f"host {rank} failed:\n{log[-4000:]}"
    _assert_ddp_restores_match(tmp_path, world=4, log=done[0][1])
    [event] = _run(hosts).report["events"]
    assert event["kind"] == "grow" and event["grown_to"] == 4
    newcomers = [p for p in event["pulls"] if p["rank"] >= 2]
    assert newcomers and all(p["source"] == 0 and p["bytes"] > 0 for p in newcomers)
