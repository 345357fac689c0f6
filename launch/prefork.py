"""Hot spares forked from a server that has imported torch once: the prefork server.

A spare's first seconds are imports: ``import torch`` and the modules a replacement's DDP
needs (``runtime/rank.py``'s warm-up) took 4.4 CPU-seconds on this 2-core machine, and every
spare started to replace one that took a rank pays them again. On a cluster that CPU is a
spare machine's; where spares share a host's cores with training (a host that keeps its
own spares, or one machine standing in for several) it is taken from the ranks: measured
here, every rank stepped 30 % slower for the ~10 s a replenished spare spent importing
(docs/performance.md, "Goodput under failures").

So a launcher that starts spares starts one prefork server per host, beside its agents
(``python -m peerckpt.launch.prefork --socket PATH``): it imports torch, the warm-up modules
and peerckpt's rank runtime, then listens on a Unix socket (0600) in the launcher's private
run directory. For each spare the launcher connects, both prove the job secret (the
handshake of ``peerckpt/wire.py``), and it sends the command line, environment and working
directory; the server forks, and the child becomes what ``python script.py args`` would
be: a session of its own, that environment and directory, ``sys.argv`` and ``sys.path[0]``
as Python sets them for a script, Python's and NumPy's global random generators reseeded
from the OS (a fork would share the server's), default signal handlers, and the script run
as ``__main__`` with the interpreter's exit rules (the status of ``SystemExit``, a traceback
and status 1 for an exception, non-daemon threads joined and ``atexit`` run before exit).

The server answers with the child's pid once the child has a session of its own (so that a
kill of its process group by that pid cannot miss it), and with its exit status once it has
reaped it;
``Forked`` is the launcher's handle, the part of ``subprocess.Popen`` a launcher uses. The
server is single-threaded and runs no tensor operation, so no thread of its own is lost in
the fork; it exits when its launcher does (it checks its parent), and a child outlives it
as a ``Popen``'d one outlives its launcher (it exits with its agent).

``PEERCKPT_PREFORK=0`` turns it off; a server that did not come up in time, or died, is
reported and every spare is then started as a fresh ``python script.py``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import logging
import os
import random
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, NoReturn

import setproctitle

from peerckpt.errors import PeerckptError
from peerckpt.pidwatch import ProcessWatch
from peerckpt.secret import FD_ENV as SECRET_FD_ENV
from peerckpt.secret import NAMES as SECRET_NAMES
from peerckpt.secret import secret_from_env, secret_pipe
from peerckpt.wire import Connection, client_handshake, server_handshake

log = logging.getLogger("peerckpt.launcher")
PREFORK_ENV = "PEERCKPT_PREFORK"
READY_TIMEOUT_S = 60.0  # the server's imports, on a machine busy starting a job
_POLL_S = 0.5  # how often the server looks for its launcher


def enabled(env: dict[str, str] | None = None) -> bool:
    """Is the prefork server wanted (``PEERCKPT_PREFORK`` not 0/false/no/off)?"""
    value = (env if env is not None else os.environ).get(PREFORK_ENV, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


# -- the server ---------------------------------------------------------------------------
def _preload() -> None:
    """Import once what every spare would import: torch, the rank runtime, the warm-up."""
    import torch  # noqa: F401

    from peerckpt.runtime.rank import WARM_MODULES

    for module in WARM_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def _listen(path: str) -> socket.socket:
    """A listening Unix socket at ``path``. The launcher takes the path's existence for "ready":
    the socket is bound under another name and renamed to ``path`` once it listens (bound at
    ``path`` itself, a launcher that looked between ``bind`` and ``listen`` was refused, and
    its spares started without the server: seen in CI under load)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    binding = path + ".binding"
    old = os.umask(0o177)  # 0600 from the start: never a moment others could connect
    try:
        listener.bind(binding)
    finally:
        os.umask(old)
    listener.listen(16)
    os.rename(binding, path)
    return listener


class _Server:
    def __init__(self, path: str, secret: bytes, job: str, parent: int) -> None:
        self.secret, self.job = secret, job
        self.parent = parent  # the launcher: the server lives only as long as it does
        self.listener = _listen(path)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_w)
        self.children: dict[int, Connection] = {}

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        selector.register(self.wake_r, selectors.EVENT_READ)
        while os.getppid() == self.parent:
            for key, _ in selector.select(timeout=_POLL_S):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    os.read(self.wake_r, 4096)
            self._reap()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        conn = Connection(sock, peer="launcher")
        try:
            server_handshake(conn, self.secret, self.job)
            request, _ = conn.recv_message(max_payload=0)
            argv, env, cwd = _request(request)
        except (PeerckptError, OSError) as exc:
            print(f"peerckpt prefork: refused a request: {exc}", file=sys.stderr, flush=True)
            sock.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            self._child(conn, argv, env, cwd, ready_w)
        os.close(ready_w)
        with contextlib.suppress(OSError):  # its own session first: the launcher kills the
            os.read(ready_r, 1)  # group by its pid (EOF if the child died before)
        os.close(ready_r)
        self.children[pid] = conn
        try:
            conn.send({"type": "forked", "pid": pid})
        except (PeerckptError, OSError):  # the launcher went away: leave nothing behind
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)

    def _child(
        self, mine: Connection, argv: list[str], env: dict[str, str], cwd: str, ready: int
    ) -> NoReturn:
        code = 1
        try:
            os.setsid()  # a session and process group of its own, as start_new_session
            os.write(ready, b"s")
            os.close(ready)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for conn in [mine, *self.children.values()]:
                conn.sock.close()
            self.listener.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            # the job's secret as the launcher hands it to every process it starts: in a
            # pipe this child alone holds, never in the environment the request carried
            env = {k: v for k, v in env.items() if k not in SECRET_NAMES}
            env[SECRET_FD_ENV] = str(secret_pipe(self.secret))
            code = become(argv, env, cwd)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(PeerckptError, OSError):
                conn.send({"type": "exited", "returncode": os.waitstatus_to_exitcode(status)})
            conn.sock.close()


def _request(frame: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    argv, env, cwd = frame.get("argv"), frame.get("env"), frame.get("cwd")
    if (
        frame.get("type") != "fork"
        or not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) for a in argv)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        or not isinstance(cwd, str)
    ):
        raise PeerckptError("a fork request needs argv (strings), env (str → str) and cwd")
    return argv, env, cwd


def become(argv: list[str], env: dict[str, str], cwd: str) -> int:
    """In a freshly forked child: become ``python argv[0] argv[1:]`` and return its exit
    status (the interpreter's rules). Never returns to the caller's loop on its own."""
    # What ps shows, as for a fresh process (cut to the room of the server's command line:
    # SPT_NOENV keeps the environment block, which tools read in /proc/PID/environ, intact)
    os.environ["SPT_NOENV"] = "1"
    setproctitle.setproctitle(" ".join([sys.executable, *argv]))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    random.seed()  # from the OS, as a fresh interpreter's
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    try:
        # What `import peerckpt` does in a fresh process, which this fork's is not: the
        # server imported peerckpt before the spare's environment was set (runtime/standby.py)
        importlib.import_module("peerckpt.runtime.standby").on_import()
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException as exc:  # the traceback from the script's frame, as Python's own
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc, tb or exc.__traceback__)
        code = 1
    main = threading.main_thread()
    for thread in threading.enumerate():  # what the interpreter does before exiting
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    return code


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--for", dest="script", help="the script its spares run (for ps)")
    parser.add_argument("--parent", type=int, required=True, help="the launcher's pid")
    args = parser.parse_args()
    parent = args.parent  # the launcher may have died already, during the imports
    secret = secret_from_env()
    job = os.environ.get("PEERCKPT_JOB", "")
    _preload()
    server = _Server(args.socket, secret, job, parent)
    try:
        server.run()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(args.socket)


# -- the launcher's side ------------------------------------------------------------------
class Forked:
    """A spare the prefork server forked: the part of ``subprocess.Popen`` a launcher uses.

    Its exit status comes from the server, which reaped it; if the server died first, a
    ``ProcessWatch`` of the process says when it exits (its status is then unknown: 255)."""

    stdout: IO[bytes] | None = None

    def __init__(self, conn: Connection, pid: int, args: list[str]) -> None:
        self.pid, self.args, self._conn = pid, args, conn
        self.returncode: int | None = None
        self._watch = ProcessWatch(pid)
        self._server_gone = False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._check(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._check(1.0 if left is None else min(left, 1.0))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _check(self, timeout: float) -> None:
        if self._server_gone:
            if self._watch.exited(timeout):
                self._finish(255)
            return
        ready, _, _ = select.select([self._conn.sock], [], [], timeout)
        if not ready:
            return
        try:
            frame, _ = self._conn.recv_message(max_payload=0)
        except (PeerckptError, OSError):
            frame = {}
        code = frame.get("returncode")
        if frame.get("type") == "exited" and isinstance(code, int):
            self._finish(code)
            return
        self._server_gone = True
        log.warning("the prefork server went away before spare pid %d exited", self.pid)
        if self._watch.exited():
            self._finish(255)

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._conn.sock.close()
        self._watch.close()


class PreforkClient:
    """The launcher's prefork server: started at once, used once it listens."""

    def __init__(self, proc: subprocess.Popen[bytes], path: str, secret: bytes, job: str):
        self.proc, self.path, self.secret, self.job = proc, path, secret, job
        self._broken = False

    def fork(self, argv: list[str], env: dict[str, str]) -> Forked | None:
        """Fork ``python argv…`` with ``env``; None if the server cannot (the caller then
        starts the process itself)."""
        if self._broken or not self._await_listening():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = Connection(sock, peer="prefork server")
        try:
            sock.settimeout(30.0)
            sock.connect(self.path)
            client_handshake(conn, self.secret, self.job)
            conn.send({"type": "fork", "argv": argv, "env": env, "cwd": os.getcwd()})
            reply, _ = conn.recv_message(max_payload=0)
            pid = reply.get("pid")
            if reply.get("type") != "forked" or not isinstance(pid, int):
                raise PeerckptError(f"the prefork server answered {reply.get('type')!r}")
            sock.settimeout(None)
        except (PeerckptError, OSError) as exc:
            sock.close()
            self._give_up(f"it failed a request ({exc})")
            return None
        return Forked(conn, pid, argv)

    def _await_listening(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(self.path):
            if self.proc.poll() is not None:
                self._give_up(f"it exited with status {self.proc.returncode}")
                return False
            if time.monotonic() > deadline:
                self._give_up(f"it did not listen within {READY_TIMEOUT_S:.0f} s")
                return False
            time.sleep(0.02)
        return True

    def _give_up(self, why: str) -> None:
        self._broken = True
        log.warning(
            "the prefork server is not used: %s; spares start as fresh processes (slower to "
            "warm up; PEERCKPT_PREFORK=0 turns the server off)",
            why,
        )


def start_server(
    spawn: Any, rundir: str, env: dict[str, str], secret: bytes, job: str, script: str
) -> PreforkClient:
    """Start this host's prefork server with ``spawn(argv, env, ready=False)``."""
    path = os.path.join(rundir, "prefork.sock")
    argv = [sys.executable, "-m", "peerckpt.launch.prefork", "--socket", path]
    argv += ["--parent", str(os.getpid()), "--for", script]
    return PreforkClient(spawn(argv, env, ready=False), path, secret, job)


if __name__ == "__main__":
    main()
