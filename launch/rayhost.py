"""One Ray node's share of a ``peerckpt run --ray`` job: the host launcher a Ray actor starts.

``python -m peerckpt.launch.rayhost`` is started by the job's actor on that node
(``launch/ray.py``). It reads its orders as one JSON object on stdin — ``spec`` (the
``JobSpec`` fields), ``host`` (the ``HostSpec`` fields), ``result`` (where to write the
result) —, the job's secret from ``PEERCKPT_SECRET``, and runs :class:`HostLauncher` for this
node: node rank 0 also runs the coordinator. The agent, the ranks and the spares are its
child processes, exactly as under ``peerckpt run --nnodes``: Ray never sees them.

Its life is bound to the actor's, so that a lost Ray node leaves nothing running and
nothing on the machine:

- it detaches first (it forks, the first process prints the second's pid and exits), so it is
  no child of the Ray worker: Ray kills a dying worker's children (and its process group) by
  SIGKILL, which would leave no one to take this host's processes down and remove its files;
- it watches the actor's pid and its node's raylet's (pidfds: woken the moment either
  exits). A removed Ray node (its raylet and workers killed), a killed driver (Ray then
  kills the actors it owned) or ``ray.kill`` all end there, as does a SIGTERM to this
  process;
- it then takes this host down as a machine failure would: SIGKILL to every process it
  started (their process groups: DataLoader workers too), then it removes this host's
  shared memory, run directory and result file, since the machine itself may live on. It
  tells the coordinator nothing: the survivors learn it as they learn of any lost machine;
- on SIGINT (the driver stopping the job) the launcher stops the job's processes in order;
- when the job ends it writes ``{"code", "result"}`` to the result file, then exits. That
  file is in a directory the actor made for it, the user's only (0700), and is written whole
  to a fresh private file there (``O_EXCL``, 0600) renamed onto it, and read back without
  following a link (``read_result``): no other user can predict, plant or read it.

It must never talk to Ray (it runs outside Ray, so that the ranks do not inherit a Ray
worker's state) and never carries training state: that moves agent to agent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
from dataclasses import fields
from typing import Any

from peerckpt import logs
from peerckpt.errors import PeerckptError
from peerckpt.launch.base import JobResult, JobSpec
from peerckpt.launch.host import HostLauncher, HostSpec
from peerckpt.outfiles import write_private
from peerckpt.pidwatch import ProcessWatch
from peerckpt.secret import secret_from_env
from peerckpt.shm import sweep
from peerckpt.states import ExitCode

log = logging.getLogger("peerckpt.launcher")
ACTOR_ENV = "PEERCKPT_RAY_ACTOR_PID"  # the actor's pid: this host lives as long as it does
RAYLET_ENV = "PEERCKPT_RAY_RAYLET_PID"  # and its node's raylet: the node itself
RESULT_DIR_PREFIX = "peerckpt-ray-"  # the actor's 0700 directory for the result, in $TMPDIR
RESULT_FILE = "result.json"


def spec_to_json(spec: JobSpec) -> dict[str, Any]:
    """``spec`` as JSON (racks' node keys become strings; ``spec_from_json`` undoes it)."""
    out = {f.name: getattr(spec, f.name) for f in fields(spec)}
    if spec.racks is not None:
        out["racks"] = {str(k): v for k, v in spec.racks.items()}
    return out


def spec_from_json(data: dict[str, Any]) -> JobSpec:
    spec = JobSpec(**data)
    if spec.racks is not None:
        spec.racks = {int(k): v for k, v in spec.racks.items()}
    return spec


def lose_host(launcher: HostLauncher, result_path: str) -> None:
    """Take this host down as a machine failure would: SIGKILL every process of the job on
    it, then remove what they left on this machine (shared memory, run directory, the
    result file the actor made)."""
    procs = launcher.procs
    with procs.lock:
        every = [p for node in procs.nodes.values() for p in (node.agent, *node.procs)]
        every += procs.others
    for proc in every:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in every:
        with contextlib.suppress(Exception):
            proc.wait(timeout=5.0)
    sweep(launcher.job, launcher.run_id)
    shutil.rmtree(launcher.rundir, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(result_path)
    folder = os.path.dirname(result_path)
    if os.path.basename(folder).startswith(RESULT_DIR_PREFIX):  # the actor's, made for it
        shutil.rmtree(folder, ignore_errors=True)
    claim = getattr(launcher, "_claim", None)  # host 0 holds the job's name on this machine
    if claim is not None:
        claim.release()


def main() -> int:
    orders = json.load(sys.stdin)
    if os.fork():
        os._exit(0)  # the actor reads the detached process's pid from our stdout
    os.setsid()
    print(os.getpid(), flush=True)
    os.dup2(2, 1)  # the job's output goes to the actor's log, as its stderr does
    logs.configure("launcher", "%(asctime)s peerckpt[ray-host] %(levelname)s %(message)s")
    actor = ProcessWatch(int(os.environ[ACTOR_ENV]))
    # The node's raylet too: a worker can take seconds to notice its raylet died (measured:
    # a removed node's actor outlived it long enough for the job to finish without it).
    raylet = ProcessWatch(int(os.environ.get(RAYLET_ENV) or os.environ[ACTOR_ENV]))
    lost = threading.Event()
    signal.signal(signal.SIGTERM, lambda s, f: lost.set())
    try:
        launcher = HostLauncher(
            spec_from_json(orders["spec"]), HostSpec(**orders["host"]), secret_from_env()
        )
    except PeerckptError as exc:
        log.error("%s", exc)
        _write(orders["result"], int(ExitCode.FAILED), None)
        return int(ExitCode.FAILED)
    signal.signal(signal.SIGINT, lambda s, f: launcher._interrupted.set())
    results: list[JobResult] = []
    runner = threading.Thread(
        target=lambda: results.append(launcher.run()), name="peerckpt-ray-host", daemon=True
    )
    runner.start()
    while runner.is_alive():
        if actor.exited(0.1) or raylet.exited() or lost.is_set():
            log.warning(
                "the Ray actor of host %d is gone: this host is lost", launcher.host.node_rank
            )
            lose_host(launcher, orders["result"])
            os._exit(ExitCode.LAUNCHER_GONE)
    result = results[0] if results else None
    code = result.exit_code if result is not None else int(ExitCode.FAILED)
    _write(orders["result"], code, result.to_json() if result is not None else None)
    return code


def _write(path: str, code: int, result: dict[str, Any] | None) -> None:
    """The host's end, for its actor: written whole to a fresh 0600 file beside ``path``
    (``O_EXCL``: never through a link planted there), then renamed onto it."""
    write_private(path, json.dumps({"code": code, "result": result}, default=str))


def read_result(path: str) -> dict[str, Any]:
    """What ``_write`` wrote at ``path``, read without following a link (OSError, ValueError
    if it is missing, a link or not a result)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        done = json.load(f)
    if not isinstance(done, dict):
        raise ValueError(f"{path} holds no result")
    return done


if __name__ == "__main__":
    sys.exit(main())
