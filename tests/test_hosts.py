"""A job over several hosts: one ``peerckpt run`` per host, each on its own loopback address.

Every "host" is a separate launcher process tree with its own ``--node-addr`` (127.0.0.2,
127.0.0.3, …), its own run directory and shared-memory names, so a hard-coded 127.0.0.1 or a
path shared between hosts fails here. Results are compared bit for bit with the local
launcher's fault-free run of the same job (same ranks, same steps).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from peerckpt.shm import SHM_DIR, segment_prefix

from .conftest import JOBS, REPO, JobRun, job_name

DEADLINE_S = 240.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Hosts:
    """The launchers of one multi-host job, started one per simulated host."""

    def __init__(self, out: Path, nnodes: int = 2, nproc: int = 2, steps: int = 30) -> None:
        self.out = out
        self.nnodes, self.nproc, self.steps = nnodes, nproc, steps
        self.job = job_name()
        self.endpoint = f"127.0.0.2:{_free_port('127.0.0.2')}"
        self.env = dict(os.environ, PEERCKPT_SECRET=secrets.token_hex(32))
        self.procs: dict[int, subprocess.Popen[str]] = {}
        out.mkdir(parents=True, exist_ok=True)

    def start(self, node_rank: int, *flags: str) -> subprocess.Popen[str]:
        """Start host ``node_rank`` (address 127.0.0.<node_rank + 2>)."""
        argv = [
            sys.executable,
            "-m",
            "peerckpt",
            "run",
            "--nnodes",
            str(self.nnodes),
            "--node-rank",
            str(node_rank),
            "--rdzv-endpoint",
            self.endpoint,
            "--node-addr",
            f"127.0.0.{node_rank + 2}",
            "--nproc-per-node",
            str(self.nproc),
            "--job",
            self.job,
            "--report",
            str(self.out / f"report{node_rank}.json"),
            *flags,
            str(JOBS / "ddp_job.py"),
            str(self.out),
            "--steps",
            str(self.steps),
        ]
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs[node_rank] = proc
        return proc

    def kill_host(self, node_rank: int) -> None:
        """SIGKILL the host's launcher and everything it started, as a machine failure does."""
        root = psutil.Process(self.procs[node_rank].pid)
        tree = [root, *root.children(recursive=True)]
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(tree, timeout=10)

    def forget_dead_machine(self) -> None:
        """Remove what a killed host left on its own disk and memory (its run directory and
        shared-memory files), once the survivors have ended: on real machines they went with
        the machine; here they share this one's /tmp and /dev/shm."""
        for path in glob.glob(os.path.join(tempfile.gettempdir(), f"peerckpt-{self.job}-*")):
            shutil.rmtree(path, ignore_errors=True)
        for path in glob.glob(os.path.join(SHM_DIR, segment_prefix(self.job) + "*")):
            os.unlink(path)
        claims = os.path.join(tempfile.gettempdir(), f"peerckpt-{os.getuid()}", self.job + ".*")
        for path in glob.glob(claims):  # host 0's claim on the job name (launch/jobfile.py)
            os.unlink(path)

    def wait(self) -> dict[int, tuple[int, str]]:
        """Every host's exit status and log, bounded in time (a straggler is interrupted)."""
        deadline = time.monotonic() + DEADLINE_S
        done = {}
        for rank, proc in self.procs.items():
            try:
                log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)
                log, _ = proc.communicate(timeout=60)
            done[rank] = (proc.returncode, log)
            (self.out / f"host{rank}.log").write_text(log)
        return done

    def run(self, report_of: int = 0) -> JobRun:
        path = self.out / f"report{report_of}.json"
        report = json.loads(path.read_text()) if path.exists() else {}
        return JobRun(self.procs[report_of].returncode, report, self.out, "")


def _await_step(progress: Path, step: int) -> None:
    """Wait (bounded) until a rank's progress file records ``step`` steps."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if progress.exists() and len(progress.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{progress.name} never reached step {step}")


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
    hosts = Hosts(tmp_path)
    hosts.start(0)
    hosts.start(2, "--spare-host")
    hosts.start(1, "--chaos", "kill rank=2 at=10")
    done = hosts.wait()
    for rank, (code, log) in done.items():
        assert code == 0, f"host {rank} failed:\n{log[-4000:]}"
    run = hosts.run()
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
def test_a_host_killed_whole_is_replaced_by_a_spare_host(tmp_path, reference_run) -> None:
    """SIGKILL to host 1's launcher and every process under it (agent, ranks) at step 12:
    host 2's spares take ranks 2 and 3 from their buddies' memory on host 0."""
    hosts = Hosts(tmp_path, steps=30)
    hosts.start(0)
    hosts.start(2, "--spare-host")
    hosts.start(1)
    _await_step(tmp_path / "rank2.jsonl", 12)
    hosts.kill_host(1)
    done = hosts.wait()
    hosts.forget_dead_machine()
    assert done[0][0] == 0, done[0][1][-4000:]
    run = hosts.run()
    _assert_bit_exact(run, reference_run)
    kinds = [e["kind"] for e in run.report["events"]]
    assert "node" in kinds


@pytest.mark.slow
def test_the_coordinators_host_killed_moves_the_coordinator(tmp_path, reference_run) -> None:
    """SIGKILL to host 0 — the rendezvous host, running the coordinator, an agent and ranks 0
    and 1 — at step 12: host 1, next in the succession, starts a coordinator at its own
    address, which rebuilds the job from the agents on hosts 1 and 2; host 0's node is then
    lost and host 2's spares take ranks 0 and 1 from their buddies' memory on host 1."""
    hosts = Hosts(tmp_path, steps=30)
    hosts.start(0)
    hosts.start(2, "--spare-host")
    hosts.start(1)
    _await_step(tmp_path / "rank0.jsonl", 12)
    hosts.kill_host(0)
    done = hosts.wait()
    hosts.forget_dead_machine()
    for rank in (1, 2):
        assert done[rank][0] == 0, f"host {rank} failed:\n{done[rank][1][-4000:]}"
    assert f"starting one at 127.0.0.3:{hosts.endpoint.rpartition(':')[2]}" in done[1][1]
    assert "the job's coordinator moved to 127.0.0.3" in done[2][1]
    run = hosts.run(report_of=1)
    _assert_bit_exact(run, reference_run)
    lost = [e for e in run.report["events"] if e["kind"] == "node"]
    assert lost and set(lost[-1]["ranks"]) == {0, 1}
