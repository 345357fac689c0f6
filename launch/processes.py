"""Starting and stopping a job's processes on this machine: node agents and training processes.

Shared by ``peerckpt run`` (a whole job) and ``peerckpt join`` (one more node for a running
job). Every process starts in a session of its own, so a Ctrl-C in the terminal reaches only
the launcher, which then stops them in order; whatever does not stop in time is killed.

A training process's session is its own process group, which its children (DataLoader
workers) join: when the process exits, or its node is killed, the whole group goes with it
(``end_groups``, ``kill_node``), so no worker outlives its rank holding its descriptors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from peerckpt.errors import PeerckptError
from peerckpt.launch import prefork
from peerckpt.launch.gpus import sharing_env
from peerckpt.names import RUN_ENV
from peerckpt.secret import FD_ENV as SECRET_FD_ENV
from peerckpt.secret import NAMES as SECRET_NAMES
from peerckpt.secret import secret_pipe
from peerckpt.states import MAX_RESTARTS, ExitCode, ProcRole

log = logging.getLogger("peerckpt.launcher")
READY_TIMEOUT_S = 60.0
MEANWHILE_S = 0.1  # how often ``await_ready`` lets its caller act while it waits


class Proc(Protocol):
    """A training process: a ``subprocess.Popen``, or a spare the prefork server forked."""

    pid: int
    returncode: int | Any
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


@dataclass
class Node:
    """One simulated node: its agent and the training processes started on it."""

    index: int
    agent: subprocess.Popen[bytes]
    socket: str
    procs: list[Proc] = field(default_factory=list)
    alive: bool = True
    restarted: set[int] = field(default_factory=set)  # pids already replaced in place


class ProcessSet:
    """The processes one launcher started for a job, and how to start and stop them.

    ``run``: the run id every process gets in ``PEERCKPT_RUN`` (the agents name their
    shared-memory segments with it)."""

    def __init__(
        self,
        job: str,
        secret: bytes,
        script: list[str],
        rundir: str,
        env: dict[str, str],
        run: str | None = None,
    ) -> None:
        self.job = job
        self.run = run
        self.secret = secret
        self.script = script
        self.rundir = rundir
        self.extra_env = env
        self.nodes: dict[int, Node] = {}
        self.others: list[subprocess.Popen[bytes]] = []  # e.g. the coordinator
        self._restarts: dict[int, int] = {}  # pid -> in-place restarts its line has had
        self._ended: set[int] = set()  # training processes whose group was ended
        self.lock = threading.Lock()
        self.prefork: prefork.PreforkClient | None = None
        # Ranks outnumber this machine's GPUs: each training process is an NCCL host of its
        # own (``launch/gpus.py``); the launcher sets it.
        self.share_gpus = False
        self._started = 0

    def start_prefork(self) -> None:
        """Start this host's prefork server (``prefork.py``): the spares started from now on
        are forked from it, their imports already done. ``PEERCKPT_PREFORK=0`` declines."""
        env = self.env()
        if self.prefork is None and self.script and prefork.enabled(env):
            self.prefork = prefork.start_server(
                self.spawn, self.rundir, env, self.secret, self.job, self.script[0]
            )
            self.others.append(self.prefork.proc)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank unless told
        # One string hash for every process of the job, replacements included: a script that
        # iterates a set of strings (a vocabulary built without sorting) or splits data by
        # hash() (minGPT's demo datasets) saw other orders in a replacement, and its restore
        # was not bit for bit. Unless the user set one.
        env.setdefault("PYTHONHASHSEED", "0")
        for name in SECRET_NAMES:  # the secret travels in a descriptor (``spawn``)
            env.pop(name, None)
        env.update(PEERCKPT_JOB=self.job, **extra)
        if self.run is not None:
            env[RUN_ENV] = self.run
        return env

    def spawn(self, argv: list[str], env: dict[str, str], ready: bool) -> subprocess.Popen[bytes]:
        """Start a process of the job; it reads the job's secret from an inherited pipe
        (``peerckpt/secret.py``), never from its environment."""
        fd = secret_pipe(self.secret)
        try:
            return subprocess.Popen(
                argv,
                env={**env, SECRET_FD_ENV: str(fd)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if ready else None,
                start_new_session=True,
                pass_fds=(fd,),
            )
        finally:
            os.close(fd)

    def await_ready(
        self,
        proc: subprocess.Popen[bytes],
        what: str,
        meanwhile: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Wait for a service's ``READY {json}`` line; return what it said. ``meanwhile`` is
        called every ``MEANWHILE_S`` while waiting (what must go on: an agent becomes ready
        only once the coordinator, which the caller restarts, answers it)."""
        assert proc.stdout is not None
        result: dict[str, Any] = {}

        def read(stream: IO[bytes]) -> None:
            line = stream.readline().decode()
            if line.startswith("READY "):
                result.update(json.loads(line[6:]))

        reader = threading.Thread(
            target=read, args=(proc.stdout,), name=f"peerckpt-ready-{proc.pid}", daemon=True
        )
        reader.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while reader.is_alive() and time.monotonic() < deadline:
            reader.join(MEANWHILE_S if meanwhile is not None else READY_TIMEOUT_S)
            if meanwhile is not None and reader.is_alive():
                meanwhile()
        if not result:
            raise PeerckptError(
                f"the {what} did not start (exit status {proc.poll()}); see its log above"
            )
        return result

    def start_agent(self, n: int, coordinator: str, flags: list[str]) -> Node:
        sock = os.path.join(self.rundir, f"node{n}.sock")
        argv = [
            sys.executable,
            "-m",
            "peerckpt.replication.agent",
            "--job",
            self.job,
            "--node",
            str(n),
            "--coordinator",
            coordinator,
            "--socket",
            sock,
            *flags,
        ]
        node = Node(n, self.spawn(argv, self.env(), ready=True), sock)
        with self.lock:
            self.nodes[n] = node
        return node

    def start_proc(self, n: int, role: ProcRole, **env: str) -> Proc:
        """Start a training process of ``role`` on node ``n``: a spare is forked from the
        prefork server where there is one, anything else is a fresh ``python script``."""
        node = self.nodes[n]
        if self.share_gpus:  # more ranks than GPUs: each its own NCCL host (launch/gpus.py)
            self._started += 1
            env = {**sharing_env(self.job, n, self._started), **env}
        full = self.env(
            PEERCKPT_AGENT=node.socket, PEERCKPT_NODE=str(n), PEERCKPT_ROLE=role.value, **env
        )
        proc: Proc | None = None
        if role is ProcRole.SPARE and self.prefork is not None:
            proc = self.prefork.fork(list(self.script), full)
            if proc is not None:
                log.info("spare pid %d on node %d forked by the prefork server", proc.pid, n)
        if proc is None:
            proc = self.spawn([sys.executable, *self.script], full, ready=False)
        node.procs.append(proc)
        return proc

    def restart_stuck(self, **env: str) -> list[tuple[int, int, int]]:
        """Start a fresh spare on the node of every process that exited with ``ExitCode.RESTART``.

        Such a process was blocked in a collective that aborting its epoch did not release,
        on a healthy node. Before exiting it told the coordinator that a spare is starting,
        so the recovery waits for this one (it joins once warmed up, a few seconds) instead
        of shrinking the world. Returns (node, old pid, new pid) for each restart.
        """
        started = []
        with self.lock:
            nodes = [n for n in self.nodes.values() if n.alive]
        for node in nodes:
            for proc in list(node.procs):
                if proc.poll() != ExitCode.RESTART or proc.pid in node.restarted:
                    continue
                node.restarted.add(proc.pid)
                count = self._restarts.get(proc.pid, 0) + 1
                new = self.start_proc(
                    node.index, ProcRole.SPARE, PEERCKPT_RESTARTS=str(count), **env
                )
                self._restarts[new.pid] = count
                log.warning(
                    "pid %d on node %d was stuck in an aborted epoch; pid %d takes its place "
                    "(restart %d of at most %d)",
                    proc.pid,
                    node.index,
                    new.pid,
                    count,
                    MAX_RESTARTS,
                )
                started.append((node.index, proc.pid, new.pid))
        return started

    def restart_in_place(
        self, orders: Mapping[int, Sequence[int]], **env: str
    ) -> list[tuple[int, int, int]]:
        """Carry out the coordinator's restarts in place (``JobStatus.in_place``: rank →
        [node, pid of the process lost]): a fresh spare on that node, once per lost process,
        and only for a process this launcher started (another host's node is its launcher's).
        The coordinator counted it as a spare starting when it ordered it, so the recovery
        waits for it; it joins, takes the rank, and restores from its node's memory.

        A process declared lost while alive (hung: its heartbeats stopped) is SIGKILLed
        first: its successor maps the same snapshot slots of the rank on this node, which a
        woken process could still be copying into. Returns (node, old pid, new pid) for each
        restart."""
        started = []
        for rank, (n, pid) in sorted(orders.items()):
            with self.lock:
                node = self.nodes.get(n)
            if node is None or not node.alive or pid in node.restarted:
                continue
            old = next((p for p in node.procs if p.pid == pid), None)
            if old is None:
                continue
            node.restarted.add(pid)
            if old.poll() is None:
                log.warning("pid %d on node %d was declared lost alive: killing it", pid, n)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                wait_all([old], 10.0)
            new = self.start_proc(n, ProcRole.SPARE, **env)
            log.warning(
                "rank %d (pid %d) died on node %d, whose agent holds its state: pid %d takes "
                "its place (restart in place)",
                rank,
                pid,
                n,
                new.pid,
            )
            started.append((n, pid, new.pid))
        return started

    def end_groups(self) -> None:
        """SIGKILL what is left of the process group of every training process that exited:
        the children it forked (DataLoader workers), which would otherwise keep its sockets
        and mappings until they notice. The group outlives its leader while it has members,
        so its id cannot be reused meanwhile."""
        with self.lock:
            procs = [p for node in self.nodes.values() for p in node.procs]
        for proc in procs:
            if proc.pid in self._ended or proc.poll() is None:
                continue
            self._ended.add(proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def training(self) -> list[tuple[int, Proc]]:
        """(node, process) of every training process started so far (ranks, spares,
        restarts), in any state."""
        with self.lock:
            return [(n, p) for n, node in self.nodes.items() for p in node.procs]

    def pause(self) -> None:
        """SIGSTOP every live training process (``resume`` continues them): nothing they
        hold in their agents' slots changes meanwhile."""
        self._signal_training(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_training(signal.SIGCONT)

    def _signal_training(self, sig: int) -> None:
        with self.lock:
            procs = [p for node in self.nodes.values() for p in node.procs]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, sig)

    def kill_node(self, n: int) -> None:
        """SIGKILL a node's agent and processes (their children too) and wait for them."""
        with self.lock:
            target = self.nodes[n]
            target.alive = False
            for proc in [target.agent, *target.procs]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for proc in [target.agent, *target.procs]:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)

    def stop(self) -> None:
        """Wait for every process to exit (after the job told them to), kill what does not."""
        procs = [p for node in self.nodes.values() for p in node.procs]
        agents = [node.agent for node in self.nodes.values()]
        wait_all(procs, 20.0)
        wait_all(agents, 10.0)
        for proc in self.others:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        wait_all(self.others, 5.0)
        everything: list[Proc] = [*procs, *agents, *self.others]
        for one in everything:
            if one.poll() is None:
                log.warning("pid %d did not stop in time; killing it", one.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(one.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    one.wait(timeout=5.0)
            if one.stdout is not None:
                one.stdout.close()


def wait_all(procs: Sequence[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))


def coordinator_argv(job: str, world_size: int, **flags: object) -> list[str]:
    """The coordinator's command line (``recovery/server.py``): ``flags`` as ``--name value``
    (underscores become dashes; None is left out, True is a bare flag)."""
    argv = [sys.executable, "-m", "peerckpt.recovery.server", "--job", job]
    argv += ["--world-size", str(world_size)]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv
