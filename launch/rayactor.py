"""The actor ``peerckpt run --ray`` pins to each Ray node it uses: ``RayHost``.

It lives in the Ray worker Ray starts for it, one per node of the job, and does little: it
picks the coordinator's ports (host 0), starts the node's host launcher
(``launch/rayhost.py``) and tells the driver when it ended, and for ``kill node`` chaos it
kills the job's processes on its node and the node's raylet. It holds no state of the job
and never touches training state; the host launcher is detached from it (see
``rayhost.py``), and watches it.

What it gets from the driver travels sealed to a key pair it makes itself (``rayseal.py``):
Ray's RPC carries no secret in clear. The host launcher's result file lives in a directory of
the user's only (0700), made for it: its name is not predictable, and nobody else can plant a
link where it is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

from peerckpt.errors import ConfigurationError, PeerckptError
from peerckpt.launch.rayhost import (
    ACTOR_ENV,
    RAYLET_ENV,
    RESULT_DIR_PREFIX,
    RESULT_FILE,
    read_result,
)
from peerckpt.launch.rayseal import Opener, context
from peerckpt.outfiles import private_dir
from peerckpt.pidwatch import ProcessWatch
from peerckpt.secret import FD_ENV as SECRET_FD_ENV
from peerckpt.secret import NAMES as SECRET_NAMES
from peerckpt.secret import check_secret, secret_pipe
from peerckpt.states import ExitCode


class RayHost:
    """The actor on one Ray node: starts, watches and stops that node's host launcher.

    Call order: ``public_key`` (what the driver seals the orders to), ``endpoint`` (host 0
    only: a free port pair for the coordinator), ``start``, then ``poll`` until it returns
    the launcher's exit; ``interrupt`` stops the job's processes in order, ``kill_machine``
    loses the node as a machine failure would."""

    def __init__(self) -> None:
        self.pid = 0  # the host launcher's (detached: not this actor's child)
        self.watch: ProcessWatch | None = None
        self.raylet: ProcessWatch | None = None  # this node's raylet, where it is our parent
        self.result_path = ""  # where the host launcher writes how it ended
        self._result_dir = ""  # the 0700 directory that holds it, made by ``start``
        self._opener = Opener()

    def public_key(self) -> bytes:
        """The X25519 public key the driver seals this host's orders to (``rayseal.py``)."""
        return self._opener.public

    def endpoint(self, addr: str) -> str:
        """``addr:PORT`` with PORT and PORT + 1 free on this node (the coordinator's gRPC
        and the process groups' store)."""
        for _ in range(50):
            with socket.socket() as s:
                s.bind((addr, 0))
                port = int(s.getsockname()[1])
            if port < 65535 and _free(addr, port + 1):
                return f"{addr}:{port}"
        raise ConfigurationError(f"no two consecutive free ports on {addr}")

    def start(self, sealed: dict[str, bytes], job: str, host: int) -> int:
        """Start ``python -m peerckpt.launch.rayhost`` for host ``host`` of ``job``; return its
        pid. ``sealed`` (``rayseal.seal``) holds its ``orders``, the job's ``secret`` and the
        driver's environment ``env`` (``rayenv.forwarded``), laid over this node's."""
        payload = self._opener.open(sealed, context(job, host))
        orders, env = payload["orders"], payload["env"]
        # Written by the host launcher when it ends: a fresh 0700 directory, so that the name
        # is neither predictable nor reachable by another user (it was a name in /tmp, made
        # by mkstemp and unlinked, then written as NAME.tmp through whatever link was there).
        self._result_dir = private_dir(tempfile.gettempdir(), RESULT_DIR_PREFIX)
        self.result_path = os.path.join(self._result_dir, RESULT_FILE)
        full = dict(os.environ)
        full.update(env)
        for name in SECRET_NAMES:
            full.pop(name, None)
        # the secret in a pipe the host launcher alone inherits, not in its environment
        secret_fd = secret_pipe(_secret(payload.get("secret")))
        full.update({SECRET_FD_ENV: str(secret_fd), ACTOR_ENV: str(os.getpid())})
        if "raylet" in _name(os.getppid()):
            full[RAYLET_ENV] = str(os.getppid())
            self.raylet = ProcessWatch(os.getppid())
        cwd = env.get("PEERCKPT_RAY_CWD", "")
        try:
            starter = subprocess.Popen(
                [sys.executable, "-m", "peerckpt.launch.rayhost"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=full,
                cwd=cwd if os.path.isdir(cwd) else None,
                pass_fds=(secret_fd,),
            )
        finally:
            os.close(secret_fd)
        out, _ = starter.communicate(
            json.dumps({**orders, "result": self.result_path}).encode(), timeout=60
        )
        if not out.strip().isdigit():
            shutil.rmtree(self._result_dir, ignore_errors=True)  # nobody will write there
            raise PeerckptError(
                f"the host launcher did not start (exit status {starter.returncode})"
            )
        self.pid = int(out)
        self.watch = ProcessWatch(self.pid)
        return self.pid

    def poll(self) -> dict[str, Any] | None:
        """None while the host launcher runs; then ``{"code", "result", "node_lost"}`` (its
        exit status and its ``JobResult`` fields, None where it wrote none; ``node_lost``:
        the launcher ended without a result because this node's raylet died, so the node is
        being removed and this actor outlives it only until its worker notices)."""
        if self.watch is None:  # not started yet: the driver placed it and is starting it
            return None
        if not self.watch.exited():
            return None
        done: dict[str, Any] = {"code": int(ExitCode.FAILED), "result": None}
        with contextlib.suppress(OSError, ValueError):
            done = read_result(self.result_path)
        done["node_lost"] = (
            done.get("result") is None and self.raylet is not None and self.raylet.exited()
        )
        with contextlib.suppress(OSError):
            os.unlink(self.result_path)
        if self._result_dir:
            shutil.rmtree(self._result_dir, ignore_errors=True)
        return done

    def interrupt(self) -> None:
        """Stop the job's processes on this node in order (the launcher's Ctrl-C)."""
        if self.watch is not None and not self.watch.exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGINT)

    def kill_machine(self) -> str:
        """Lose this Ray node: SIGKILL every process of the job on it, then the raylet (this
        actor's parent), which takes this actor along. The host launcher is spared to see
        its actor die and remove the job's files, as on a node's removal."""
        import psutil

        raylet = psutil.Process().parent()
        if raylet is None or "raylet" not in raylet.name():
            raise ConfigurationError(
                f"this actor's parent is {raylet.name() if raylet else 'gone'!r}, not a raylet; "
                "cannot remove the node"
            )
        tree = []
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = psutil.Process(self.pid).children(recursive=True)
        for proc in [*tree, raylet]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return f"{len(tree)} job process(es) and raylet pid {raylet.pid}"


def _name(pid: int) -> str:
    """Process ``pid``'s name ("" if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _free(addr: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def _secret(text: Any) -> bytes:
    """The job's secret from the driver's sealed orders (hex), checked."""
    try:
        return check_secret(bytes.fromhex(text))
    except (TypeError, ValueError):
        raise ConfigurationError("the driver's orders hold no job secret in hex") from None
