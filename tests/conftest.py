"""Shared test helpers: leak checks around every test and a runner for local jobs.

Every test ends with no peerckpt process and no /dev/shm/peerckpt-* file left behind. The
autouse fixture asserts it (the test fails if something leaked) and then removes whatever is
there, so that one broken test cannot poison the next.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from peerckpt.messages.local import AllocSlot, SlotGranted, SnapshotTaken
from peerckpt.replication.arena import Arena
from peerckpt.runtime.snapshot import SnapshotEngine

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "tests" / "jobs"
# Every job and arena a test creates is named with this session's prefix, so the leak check
# sees exactly what this test session started (and not, say, a demo running beside it).
PREFIX = "pt" + secrets.token_hex(3)
SHM_GLOB = f"/dev/shm/peerckpt-{PREFIX}*"
_names = itertools.count()


def job_name() -> str:
    """A fresh job name inside this session's prefix."""
    return f"{PREFIX}_{next(_names)}"


def _job_processes() -> list[psutil.Process]:
    """Every live process of a job this session started (PEERCKPT_JOB has our prefix)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            job = proc.environ().get("PEERCKPT_JOB", "")
            if job.startswith(PREFIX) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(autouse=True)
def no_leaks() -> Any:
    """Fail a test that leaves a job process or a shared-memory file behind."""
    yield
    deadline = time.monotonic() + 5.0  # processes told to exit may take a moment
    rundirs = os.path.join(tempfile.gettempdir(), f"peerckpt-{PREFIX}*")
    # A launcher's claim on its job name and its job file (launch/jobfile.py).
    claims = os.path.join(tempfile.gettempdir(), f"peerckpt-{os.getuid()}", f"{PREFIX}*")
    procs, files, dirs = _job_processes(), glob.glob(SHM_GLOB), glob.glob(rundirs)
    while (procs or files or dirs) and time.monotonic() < deadline:
        time.sleep(0.1)
        procs, files, dirs = _job_processes(), glob.glob(SHM_GLOB), glob.glob(rundirs)
    files += glob.glob(claims)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    for path in files:
        if os.path.isdir(path):  # a torchrun host's folder (runtime/torchrun.py)
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(path)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    assert not procs, f"leaked processes: {[p.pid for p in procs]}"
    assert not dirs, f"leaked run directories (sockets): {dirs}"
    assert not files, f"leaked shared-memory or job files: {files}"


@dataclass
class JobRun:
    """A finished ``peerckpt run``: exit code, its JSON report, output dir and log."""

    returncode: int
    report: dict[str, Any]
    out: Path
    log: str

    def digests(self) -> dict[tuple[int, int], set[str]]:
        """(rank, step) → every digest any process recorded for it (re-executions included)."""
        found: dict[tuple[int, int], set[str]] = {}
        for path in sorted(self.out.glob("rank*.jsonl")):
            rank = int(path.stem[4:])
            for entry in read_jsonl(path):
                found.setdefault((rank, entry["step"]), set()).add(entry["digest"])
        return found

    def final(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.out / "final.json").read_text())
        return result


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records a job script appended to ``path`` (none if it never wrote it)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launch(
    out: Path,
    script: str = "ddp_job.py",
    script_args: list[str] | None = None,
    *,
    nodes: int = 2,
    nproc: int = 2,
    spares: int = 0,
    chaos: str = "",
    extra: list[str] | None = None,
) -> subprocess.Popen[str]:
    """Start ``peerckpt run`` on a job script in ``tests/jobs``; the caller waits for it."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "peerckpt.launch",
        "run",
        "--nodes",
        str(nodes),
        "--nproc-per-node",
        str(nproc),
        "--spares",
        str(spares),
        "--report",
        str(out / "report.json"),
        "--job",
        job_name(),
        *(extra or []),
    ]
    if chaos:
        argv += ["--chaos", chaos]
    argv += [str(JOBS / script), str(out), *(script_args or [])]
    env = dict(os.environ, PEERCKPT_LOG_LEVEL=os.environ.get("PEERCKPT_LOG_LEVEL", "INFO"))
    return subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_job(out: Path, *args: Any, timeout: float = 240.0, **kwargs: Any) -> JobRun:
    """Run a job to completion (bounded by ``timeout``) and collect what it left."""
    proc = launch(out, *args, **kwargs)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the launcher cleans up on Ctrl-C
        log, _ = proc.communicate(timeout=60)
        pytest.fail(f"job did not finish in {timeout} s; log tail:\n{log[-4000:]}")
    (out / "launcher.log").write_text(log)  # kept for a failure's post-mortem (--basetemp)
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return JobRun(proc.returncode, report, out, log)


def run_with_reference(out: Path, script_args: list[str], **kwargs: Any) -> tuple[JobRun, JobRun]:
    """A fault-free run of the job (``script``) in the same topology (``nodes``, ``nproc``),
    then the run with ``kwargs`` (chaos, spares, extra flags). Returns (reference, run)."""
    topology = {k: kwargs[k] for k in ("script", "nodes", "nproc") if k in kwargs}
    reference = run_job(out / "reference", script_args=script_args, **topology)
    assert reference.returncode == 0, reference.log[-4000:]
    return reference, run_job(out / "chaos", script_args=script_args, **kwargs)


def assert_same_digests(run: JobRun, reference: JobRun) -> None:
    """Every digest any rank recorded (steps trained again included) and the final one equal
    the fault-free run's."""
    expected = reference.digests()
    for key, digests in run.digests().items():
        assert digests == expected[key], f"rank {key[0]} step {key[1]} differs"
    assert run.final() == reference.final()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """One fault-free run of the DDP job, shared by every chaos test that compares bits."""
    run = run_job(tmp_path_factory.mktemp("reference"), script_args=["--steps", "30"])
    assert run.returncode == 0, run.log[-4000:]
    return run


class FakeAgent:
    """Stands in for the agent link: allocates real segments, records snapshot notices."""

    def __init__(self) -> None:
        self.arena = Arena(job_name(), node=0)
        self.notices: list[SnapshotTaken] = []

    def request(self, msg: AllocSlot, answer: type, timeout: float = 60.0) -> SlotGranted:
        assert isinstance(msg, AllocSlot) and answer is SlotGranted
        seg = self.arena.create(f"o{msg.rank}-{msg.slot}", msg.nbytes, "test slot")
        return SlotGranted(seg.path, seg.size)

    def notify(self, msg: SnapshotTaken) -> None:
        self.notices.append(msg)

    def wait_notices(self, n: int, timeout: float = 10.0) -> list[SnapshotTaken]:
        deadline = time.monotonic() + timeout
        while len(self.notices) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.notices


@pytest.fixture
def agent_engine() -> Iterator[tuple[FakeAgent, SnapshotEngine]]:
    agent = FakeAgent()
    engine = SnapshotEngine(agent, commit_timeout_s=30.0)  # type: ignore[arg-type]
    engine.begin_epoch(0, rank=0, committed_index=None, committed_step=None, committed_path=None)
    yield agent, engine
    engine.close()
    agent.arena.destroy()
