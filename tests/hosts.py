"""A multi-host job on one machine: one ``peerckpt run`` per simulated host, for tests and
benchmarks.

Every "host" is a separate launcher process tree (its own session) with its own
``--node-addr`` (127.0.0.2, 127.0.0.3, …), its own run directory and shared-memory names, so a
hard-coded 127.0.0.1 or a path shared between hosts fails. Every host gets the same
``PEERCKPT_SECRET`` through its environment, as a user would give it to every machine.
``wait`` always ends every launcher, bounded in time.
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
from typing import Any

import psutil

from peerckpt.shm import SHM_DIR, segment_prefix

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "tests" / "jobs"

DEADLINE_S = 240.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Hosts:
    """The launchers of one multi-host job, started one per simulated host."""

    def __init__(
        self,
        out: Path,
        job: str,
        nnodes: int = 2,
        nproc: int = 2,
        steps: int = 30,
        script_args: tuple[str, ...] = (),
        script: Path = JOBS / "ddp_job.py",
        env: dict[str, str] | None = None,
    ) -> None:
        self.out = out
        self.nnodes, self.nproc = nnodes, nproc
        self.script, self.script_args = script, script_args or ("--steps", str(steps))
        self.job = job
        self.endpoint = f"127.0.0.2:{_free_port('127.0.0.2')}"
        self.env = dict(os.environ, PEERCKPT_SECRET=secrets.token_hex(32), **(env or {}))
        self.procs: dict[int, subprocess.Popen[str]] = {}
        out.mkdir(parents=True, exist_ok=True)

    def start(self, node_rank: int, *flags: str) -> subprocess.Popen[str]:
        """Start host ``node_rank`` (address 127.0.0.<node_rank + 2>)."""
        argv = [
            sys.executable,
            "-m",
            "peerckpt.launch",
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
            str(self.script),
            str(self.out),
            *self.script_args,
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
        # The launcher is reaped by its Popen (psutil would take its exit status away from
        # it, which then reads 0), the rest here.
        psutil.wait_procs(tree[1:], timeout=10)
        self.procs[node_rank].wait(timeout=10)

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

    def report(self, of: int = 0) -> dict[str, Any]:
        """Host ``of``'s report of the job ({} if it wrote none)."""
        path = self.out / f"report{of}.json"
        result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        return result


def await_step(progress: Path, step: int) -> None:
    """Wait (bounded) until a rank's progress file records ``step`` steps."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if progress.exists() and len(progress.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{progress.name} never reached step {step}")
