"""A worker under plain torchrun: find this host's peerckpt processes, or start them.

torchrun starts the training script with its own environment (``TORCHELASTIC_RUN_ID``,
``GROUP_RANK``, ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``) and restarts every worker after any failure. What peerckpt
needs to outlive those restarts — the host's agent, which holds the snapshots in memory, and
on the first host the job's coordinator — is kept by one *host supervisor* per host
(``python -m peerckpt.launch.torchrun``), which the first worker of a host to get here starts,
detached, and which dies with that host's torchrun::

    worker (any local rank)            host directory (0700, per user, per torchrun)
      lock ─────────────────────────▶  lock, supervisor.pid
      no live supervisor? spawn it ──▶ supervisor: coordinator (group rank 0, first round),
                                        agent (--launcher-pid = torchrun), agent.json
      wait for agent.json ◀──────────  {"socket", "node", "first"}
      PEERCKPT_* in os.environ ───────▶ LaunchEnv reads them as under ``peerckpt run``

The directory is keyed by the job and by torchrun's pid, under a per-user runtime directory
of this host (``$PEERCKPT_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/peerckpt``, else
``/tmp/peerckpt-<uid>``); nothing in it is shared between hosts. The first
``LOCAL_WORLD_SIZE`` workers of a host that started with the job are ranks (torchrun's
``RANK``); every later one (a restart, a host that came later) is a spare, which the
coordinator makes a rank — on the node that holds its state when it can — so torchrun's rank
numbers after a new rendezvous do not matter. (torchrun keeps ``TORCHELASTIC_RESTART_COUNT``
unchanged on a host whose workers it restarts because another host failed, so the count
cannot tell a restarted worker from a first one.)

Runs in the rank process: stdlib and ground modules only. The supervisor belongs to the
launchers (``launch/torchrun.py``), above this package: it is started by the module that
the installed package declares for it (the entry point ``torchrun-supervisor`` of group
``peerckpt.processes``, in ``pyproject.toml``), so that the rank's package neither imports
nor names anything above it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import MutableMapping
from importlib.metadata import entry_points

from peerckpt.errors import ConfigurationError, JobEnded, PeerUnavailable
from peerckpt.pidwatch import alive
from peerckpt.secret import FD_ENV as SECRET_FD_ENV
from peerckpt.secret import NAMES as SECRET_NAMES
from peerckpt.secret import secret_from_env, secret_pipe

log = logging.getLogger("peerckpt.torchrun")
START_TIMEOUT_S = 300.0  # the supervisor imports torch and, off the first host, waits for
# the coordinator's address in torchrun's store
RESTART_BASED = "torchrun"  # PEERCKPT_RESTART_BASED: who restarts this process after a failure
_JOB = re.compile(r"[a-z0-9][a-z0-9_]{0,39}")
SUPERVISOR_GROUP = "peerckpt.processes"  # the entry point that names the supervisor's module
SUPERVISOR_NAME = "torchrun-supervisor"


def under_torchrun(environ: MutableMapping[str, str] | None = None) -> bool:
    """Started by torchrun, and not (yet) told where its peerckpt agent is."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env and "PEERCKPT_AGENT" not in env


def job_name(environ: MutableMapping[str, str]) -> str:
    """``PEERCKPT_JOB`` if set, else a name every host derives alike from torchrun's run id
    and the workers' store (two jobs with torchrun's default run id "none" differ in it)."""
    given = environ.get("PEERCKPT_JOB")
    if given is not None:
        if not _JOB.fullmatch(given):
            raise ConfigurationError(
                f"PEERCKPT_JOB={given!r} must be 1-40 characters of a-z, 0-9 and '_'"
            )
        return given
    seed = "|".join(
        environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    )
    return "tr" + hashlib.sha256(seed.encode()).hexdigest()[:12]


def runtime_base(environ: MutableMapping[str, str]) -> str:
    """This user's runtime directory on this host, created 0700 and checked to be ours."""
    base = environ.get("PEERCKPT_RUNTIME_DIR")
    if not base:
        xdg = environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "peerckpt") if xdg else f"/tmp/peerckpt-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(base):
        raise ConfigurationError(
            f"{base} must be a directory of yours that only you can use (it holds the agent's "
            f"socket); run `chmod 700 {base}` or set PEERCKPT_RUNTIME_DIR to another one"
        )
    return base


def host_dir(environ: MutableMapping[str, str], job: str, launcher: int) -> str:
    """This host's directory for ``job`` under the torchrun whose pid is ``launcher``."""
    path = os.path.join(runtime_base(environ), f"{job}-{launcher}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return path


def join_host(environ: MutableMapping[str, str] | None = None) -> None:
    """Make this torchrun worker a peerckpt process: start its host's supervisor if no live
    one is there, wait for the host's agent, and set the ``PEERCKPT_*`` variables that
    ``LaunchEnv`` reads. ConfigurationError names what is missing; PeerUnavailable says why
    the host's processes did not come up."""
    env = os.environ if environ is None else environ
    secret = secret_from_env(env)
    job = job_name(env)
    launcher = os.getppid()  # torchrun's agent: the workers' parent
    path = host_dir(env, job, launcher)
    first_round = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    with open(os.path.join(path, "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        supervisor = _supervisor_pid(path)
        if supervisor is None and not os.path.exists(os.path.join(path, "agent.json")):
            supervisor = _spawn_supervisor(env, job, path, launcher, secret, first_round)
    info = _await_agent(path, supervisor)
    role = "spare"
    if info["first"] and first_round:
        with open(os.path.join(path, "lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            role = _claim_first_rank(path, int(env.get("LOCAL_WORLD_SIZE", "1")))
    env.update(
        PEERCKPT_JOB=job,
        PEERCKPT_SECRET=secret.hex(),
        PEERCKPT_AGENT=str(info["socket"]),
        PEERCKPT_NODE=str(info["node"]),
        PEERCKPT_ROLE=role,
        PEERCKPT_RESTART_BASED=RESTART_BASED,
    )
    log.debug("torchrun worker joins node %s as %s", info["node"], role)


def _claim_first_rank(path: str, local_world: int) -> str:
    """ "rank" for the first ``local_world`` workers of this host (the job's first epoch),
    "spare" for any later one: torchrun restarts a host's workers with the restart count
    unchanged when another host failed, so the count alone cannot tell a restart. Call it
    under the host's lock."""
    claims = os.path.join(path, "first-round")
    with open(claims, "a+") as f:
        f.seek(0)
        if len(f.read().split()) >= local_world:
            return "spare"
        f.write(f"{os.getpid()}\n")
    return "rank"


def _supervisor_pid(path: str) -> int | None:
    try:
        with open(os.path.join(path, "supervisor.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def supervisor_module() -> str:
    """The module of the host supervisor, as the installed package declares it."""
    for point in entry_points(group=SUPERVISOR_GROUP, name=SUPERVISOR_NAME):
        return point.module
    raise ConfigurationError(
        f"no host supervisor is installed (entry point {SUPERVISOR_NAME!r} of group "
        f"{SUPERVISOR_GROUP!r}): install peerckpt (pip install peerckpt, or pip install -e . "
        "from a checkout) rather than running it from a source tree"
    )


def _spawn_supervisor(
    env: MutableMapping[str, str],
    job: str,
    path: str,
    launcher: int,
    secret: bytes,
    first_round: bool,
) -> int:
    argv = [
        sys.executable,
        "-m",
        supervisor_module(),
        "--job",
        job,
        "--dir",
        path,
        "--launcher-pid",
        str(launcher),
        "--store",
        f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}",
        "--world-size",
        env.get("WORLD_SIZE", "1"),
    ]
    if first_round and env.get("GROUP_RANK", "0") == "0":
        argv.append("--coordinator")
    child_env = {k: v for k, v in env.items() if k not in SECRET_NAMES}
    fd = secret_pipe(secret)  # the secret in an inherited pipe, not in its environment
    child_env.update(PEERCKPT_JOB=job, **{SECRET_FD_ENV: str(fd)})
    # Its own session: torchrun ends a worker's whole process group when it restarts it,
    # and this process must outlive those restarts (it watches torchrun itself).
    try:
        proc = subprocess.Popen(
            argv,
            env=child_env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    with open(os.path.join(path, "supervisor.pid"), "w") as f:
        f.write(str(proc.pid))
    return proc.pid


def _await_agent(path: str, supervisor: int | None) -> dict[str, object]:
    info_path = os.path.join(path, "agent.json")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ended = _read_json(os.path.join(path, "ended.json"))
        if ended is not None:
            raise JobEnded(
                f"the peerckpt job on this host has ended ({ended.get('state')}: "
                f"{ended.get('reason') or '-'}); start it again to train again"
            )
        info = _read_json(info_path)
        if info is not None:
            return info
        if supervisor is not None and not alive(supervisor):
            break
        time.sleep(0.05)
    raise PeerUnavailable(
        f"this host's peerckpt agent did not start within {START_TIMEOUT_S:.0f} s (its "
        f"supervisor, pid {supervisor}, logged why to torchrun's output); check that every "
        "host has the same PEERCKPT_SECRET and reaches MASTER_ADDR"
    )


def _read_json(path: str) -> dict[str, object] | None:
    """A JSON file the supervisor wrote (atomically, by rename), or None if it is not there."""
    try:
        with open(path) as f:
            found: dict[str, object] = json.load(f)
    except FileNotFoundError:
        return None
    return found
