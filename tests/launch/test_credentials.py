"""Credentials never on a command line (issue 27, item 7): every user of a host reads every
process's command line (``ps``, /proc/PID/cmdline), only its owner its environment."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from peerckpt.launch.base import JobSpec
from peerckpt.launch.local import LocalLauncher
from peerckpt.persist.config import ENV

from ..conftest import JOBS, job_name


def test_the_persist_url_reaches_the_coordinator_in_its_environment_not_its_argv(
    tmp_path: Path,
) -> None:
    # A URL with credentials in it, as s3://KEY:SECRET@bucket/ckpt would be; a local path
    # here, so that the launcher's probe of the location passes without a server.
    url = f"file://{tmp_path}/AKIDEXAMPLE:wJalrXUtnFEMIK7MDENG@bucket/ckpt"
    persist = {"url": url, "every": 5}
    spec = JobSpec(script=str(JOBS / "ddp_job.py"), job=job_name(), persist=persist)
    launcher = LocalLauncher(spec, claim=False)
    try:
        launcher._start_coordinator([])
        assert launcher.coordinator is not None
        proc = psutil.Process(launcher.coordinator.pid)
        argv = " ".join(proc.cmdline())
        assert "peerckpt.recovery.server" in argv
        assert "wJalrXUtnFEMIK7MDENG" not in argv and "--persist" not in argv
        assert json.loads(proc.environ()[ENV])["url"] == url
    finally:
        launcher.stop()


def test_the_jobs_secret_is_in_no_processs_environment(tmp_path: Path) -> None:
    """A process's initial environment stays readable in /proc/PID/environ for its whole
    life, whatever it takes out of ``os.environ``: the secret comes in an inherited pipe."""
    spec = JobSpec(script=str(JOBS / "ddp_job.py"), job=job_name())
    launcher = LocalLauncher(spec, claim=False)
    try:
        launcher._start_coordinator([])
        assert launcher.coordinator is not None and launcher.rpc is not None  # it proved it
        environ = psutil.Process(launcher.coordinator.pid).environ()
        assert "PEERCKPT_SECRET" not in environ and "PEERCKPT_SECRET_FD" in environ
        assert not [k for k, v in environ.items() if launcher.procs.secret.hex() in v]
    finally:
        launcher.stop()
