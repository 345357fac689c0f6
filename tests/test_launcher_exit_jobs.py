"""How a launcher that is stopped from outside ends its job.

- SIGTERM (SLURM's and Kubernetes' stop): the job stops as after Ctrl-C, and the launcher
  exits with 143 = 128 + 15, saying ``stopped by SIGTERM``, as shells and torchrun do (Ctrl-C
  stays 130, ``tests/test_jobs.py``).
- SIGKILL: nothing of the launcher runs, so the agents end the job: each sees its parent go
  (a pidfd), SIGKILLs its node's processes and removes its memory; the coordinator and the
  prefork server see it too and exit. What only the launcher would have removed (its run
  directory, its job file) is swept by the next ``peerckpt run`` (``sweep_stale_runs``).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import time

import psutil

from peerckpt.launch.local import sweep_stale_runs

from .conftest import launch, read_jsonl

# Generous bounds for a loaded 2-core machine; each is logged as measured. Idle, the ranks
# and agents are gone within 0.5 s, everything within about 1 s.
RANKS_GONE_S = 4.0
ALL_GONE_S = 20.0


def _job_of(proc: psutil.Popen | object) -> str:
    argv = list(proc.args)  # type: ignore[attr-defined]
    return str(argv[argv.index("--job") + 1])


def _processes(job: str) -> list[tuple[psutil.Process, str]]:
    """Live processes of ``job`` (their PEERCKPT_JOB), each with its kind."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("PEERCKPT_JOB") != job or p.status() == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        kind = (
            "agent"
            if "replication.agent" in line
            else "coordinator"
            if "recovery.server" in line
            else "prefork"
            if "launch.prefork" in line
            else "rank"
        )
        found.append((p, kind))
    return found


def _started(tmp_path, proc, lines: int = 3) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(read_jsonl(tmp_path / "rank0.jsonl")) >= lines:
            return
        time.sleep(0.1)
    raise AssertionError(f"the job did not start: {proc.communicate(timeout=60)[0][-3000:]}")


def test_sigterm_stops_the_job_and_the_launcher_exits_143_naming_it(tmp_path) -> None:
    proc = launch(tmp_path, script_args=["--steps", "100000", "--sleep", "0.05"])
    _started(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=90)
    assert proc.returncode == 143, log[-3000:]
    assert "stopped by SIGTERM" in log and "Ctrl-C" not in log.split("job ")[-1]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["state"] == "interrupted" and report["exit_code"] == 143
    assert report["reason"] == "stopped by SIGTERM"


def test_a_launcher_killed_with_sigkill_takes_its_job_down_promptly(tmp_path) -> None:
    proc = launch(tmp_path, script_args=["--steps", "100000", "--sleep", "0.05"], spares=1)
    job = _job_of(proc)
    _started(tmp_path, proc)
    rundirs = glob.glob(os.path.join(tempfile.gettempdir(), f"peerckpt-{job}-*"))
    assert len(rundirs) == 1
    kinds = {kind for _, kind in _processes(job)}
    assert kinds == {"agent", "coordinator", "prefork", "rank"}, kinds
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    killed = time.monotonic()
    ranks_gone = all_gone = None
    while time.monotonic() - killed < ALL_GONE_S:
        left = _processes(job)
        if ranks_gone is None and not any(k in ("rank", "agent") for _, k in left):
            ranks_gone = time.monotonic() - killed
        if not left:
            all_gone = time.monotonic() - killed
            break
        time.sleep(0.05)
    log, _ = proc.communicate(timeout=30)
    print(f"ranks and agents gone after {ranks_gone} s, every process after {all_gone} s")
    assert all_gone is not None, f"still running: {[(p.pid, k) for p, k in _processes(job)]}"
    assert ranks_gone is not None and ranks_gone < RANKS_GONE_S, (ranks_gone, log[-3000:])
    assert "killed: its launcher is gone" in log
    assert glob.glob(f"/dev/shm/peerckpt-{job}-*") == []
    # What the launcher would have removed: its run directory and job file, swept by the next
    # launcher (this one, or any other started meanwhile on this machine).
    claims = os.path.join(tempfile.gettempdir(), f"peerckpt-{os.getuid()}", f"{job}.*")
    sweep_stale_runs()
    assert not os.path.exists(rundirs[0]) and glob.glob(claims) == []
