"""``sweep_stale_runs`` (``launch/local.py``): what a launcher killed with SIGKILL left — its
run directory, its shared-memory files, its job file — is removed by the next launcher, and
nothing of a live launcher, or that is not a run directory, is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from peerckpt.launch.jobfile import JobClaim
from peerckpt.launch.local import _hold_rundir, sweep_stale_runs
from peerckpt.names import new_run_id

from ..conftest import job_name


def test_the_run_directory_and_job_file_of_a_dead_launcher_are_swept_a_live_ones_are_not() -> None:
    dead, live, other = job_name(), job_name(), job_name()
    run = new_run_id()
    dead_dir = tempfile.mkdtemp(prefix=f"peerckpt-{dead}-")
    segment = f"/dev/shm/peerckpt-{dead}-{run}-n0-slot0"
    open(segment, "wb").close()  # a segment of the dead run an agent could not remove
    # A launcher that took its run directory and its name, then died without a word.
    code = (
        "import sys; from peerckpt.launch.local import _hold_rundir; "
        "from peerckpt.launch.jobfile import JobClaim; "
        "c = JobClaim(sys.argv[3]); c.publish({}); _hold_rundir(*sys.argv[1:]); "
        "import os; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, dead_dir, dead, run], check=True)
    claim = JobClaim(live)
    live_dir = tempfile.mkdtemp(prefix=f"peerckpt-{live}-")
    fd = _hold_rundir(live_dir, live, new_run_id())
    other_dir = tempfile.mkdtemp(prefix=f"peerckpt-{other}-")  # no lock: not a run directory
    try:
        sweep_stale_runs()  # (any launcher started meanwhile on this machine may sweep too)
        assert not os.path.exists(dead_dir) and not os.path.exists(segment)
        assert not os.path.exists(claim.lock_path.replace(live, dead))
        assert not os.path.exists(claim.file_path.replace(live, dead))
        assert os.path.isdir(live_dir) and os.path.isdir(other_dir)
        assert os.path.exists(claim.lock_path)
    finally:
        os.close(fd)
        claim.release()
        for path in (live_dir, other_dir, dead_dir):
            shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(segment):
            os.unlink(segment)
