"""Plain torchrun on "hosts" that are process trees of this machine, for tests and benchmarks.

Each host is one ``torchrun`` process (its own session) with its own ``--local-addr`` and
``PEERCKPT_NODE_ADDR`` on a distinct loopback address (127.0.0.2, 127.0.0.3, …), so a
hard-coded address fails; its peerckpt processes name their shared memory after the node
index the coordinator gave them. Every host gets the same ``PEERCKPT_SECRET`` and
``PEERCKPT_JOB`` through its environment, as a user would give them to every machine; the
first host writes the job's report (``PEERCKPT_REPORT``). ``stop`` always ends every process
tree it started, whatever happened.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def host_addr(index: int) -> str:
    return f"127.0.0.{2 + index}"


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def runtime_dirs(job: str) -> list[str]:
    """The host directories of ``job`` that are still there (``runtime/torchrun.py``)."""
    base = os.environ.get("PEERCKPT_RUNTIME_DIR") or (
        os.path.join(os.environ["XDG_RUNTIME_DIR"], "peerckpt")
        if os.environ.get("XDG_RUNTIME_DIR")
        else f"/tmp/peerckpt-{os.getuid()}"
    )
    return glob.glob(os.path.join(base, f"{job}-*"))


class TorchrunJob:
    """``hosts`` torchrun processes running ``script`` with ``torchrun_args``."""

    def __init__(
        self,
        out: Path,
        job: str,
        script: Path,
        script_args: list[str],
        *,
        hosts: int = 2,
        nnodes: str = "2",
        nproc: int = 2,
        max_restarts: int = 3,
        rdzv_conf: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.job = out, job
        self.report_path = out / "report.json"
        port = free_port(host_addr(0))
        self.procs: list[subprocess.Popen[bytes]] = []
        secret = secrets.token_hex(32)
        for i in range(hosts):
            argv = [
                TORCHRUN,
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host_addr(0)}:{port}",
                f"--rdzv-id={job}",
                f"--local-addr={host_addr(i)}",
                f"--max-restarts={max_restarts}",
                *([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []),
                str(script),
                *script_args,
            ]
            host_env = dict(
                os.environ,
                **(env or {}),
                PEERCKPT_SECRET=secret,
                PEERCKPT_JOB=job,
                PEERCKPT_NODE_ADDR=host_addr(i),
                PEERCKPT_REPORT=str(self.report_path) if i == 0 else "",
            )
            with open(out / f"host{i}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        env=host_env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if i == 0:
                time.sleep(0.5)  # the first host serves the rendezvous store and is group rank 0

    def workers(self, host: int) -> list[psutil.Process]:
        """The worker processes torchrun runs on ``host`` now."""
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.procs[host].pid).children()
        return []

    def wait_for_step(self, rank_file: str, steps: int, timeout: float = 240.0) -> None:
        """Until ``rank_file`` (a rank's jsonl) has ``steps`` lines; fails after ``timeout``."""
        path = self.out / rank_file
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= steps:
                return
            if all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"every torchrun exited early:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{rank_file} did not reach {steps} steps:\n{self.log()[-4000:]}")

    def kill_worker(self, host: int) -> int:
        """SIGKILL one worker of ``host``; return its pid."""
        [victim, *_] = self.workers(host)
        victim.kill()
        return int(victim.pid)

    def kill_host(self, host: int) -> None:
        """Lose ``host`` as a machine: SIGKILL to its torchrun's process group, and to its
        workers (torchrun starts each in a session of its own). Its peerckpt processes are
        left to notice torchrun's death, as they must."""
        workers = self.workers(host)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[host].pid, signal.SIGKILL)
        for w in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()

    def wait(self, timeout: float = 300.0) -> list[int | None]:
        """Wait for every torchrun to exit; their exit statuses (None: still running)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [p.poll() for p in self.procs]

    def report(self, timeout: float = 30.0) -> dict[str, Any]:
        """The job's report, written by the first host's supervisor once its torchrun ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and runtime_dirs(self.job):
            time.sleep(0.1)  # the supervisors still cleaning up
        if not self.report_path.exists():
            raise AssertionError(f"no report was written:\n{self.log()[-4000:]}")
        result: dict[str, Any] = json.loads(self.report_path.read_text())
        return result

    def log(self) -> str:
        return "".join(
            (self.out / f"host{i}.log").read_text(errors="replace") for i in range(len(self.procs))
        )

    def stop(self) -> None:
        """Kill whatever still runs (a failed test): every torchrun and its workers."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.kill_host(i)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10.0)
