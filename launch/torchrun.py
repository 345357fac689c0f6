"""Plain torchrun: the host supervisor that keeps a host's peerckpt processes across restarts.

torchrun restarts every worker of the job after any failure, so the processes that must
survive a restart cannot be its workers. The first worker of a host to start
(``runtime/torchrun.py``) spawns this process, detached, once per host and torchrun; it

1. on the host of group rank 0 of the first rendezvous (the host whose torchrun also serves
   the workers' store at ``MASTER_ADDR:MASTER_PORT``), starts the job's coordinator in
   restart-based mode and publishes its address in that store under
   ``peerckpt/<job>/coordinator``; every other host reads it from there;
2. gets a node index from the coordinator and starts the host's agent, bound to the node's
   address, watching torchrun's pid (``--launcher-pid``);
3. writes ``agent.json`` (socket, node, whether the job was starting) for the workers;
4. waits until torchrun exits (a pidfd), then stops the agent and the coordinator, removes
   the host's shared memory and its directory, and, on the coordinator's host, writes the
   job's report to ``$PEERCKPT_REPORT`` if set.

Nothing else: it never touches the workers (torchrun owns them), and the store carries only
an address (every link is authenticated with the job's secret, which each host gets from
``PEERCKPT_SECRET`` or ``PEERCKPT_SECRET_FILE``, never through the store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from peerckpt.errors import PeerckptError
from peerckpt.launch.addr import node_address
from peerckpt.launch.checks import check_stall_timeout
from peerckpt.launch.processes import ProcessSet, coordinator_argv
from peerckpt.messages.control import AllocateNode, JobStatus, Status, Stop
from peerckpt.names import new_run_id
from peerckpt.pidwatch import ProcessWatch
from peerckpt.rpc import RpcClient
from peerckpt.rpcauth import open_address, sign_address
from peerckpt.service import service_process, stop_on_signals
from peerckpt.shm import sweep
from peerckpt.states import JobState

from .base import JobOutcome, JobResult
from .monitor import JobMonitor

log = logging.getLogger("peerckpt.torchrun")
STORE_TIMEOUT_S = 300.0  # how long a host waits for the coordinator's address


def coordinator_key(job: str) -> str:
    """Where the coordinator's address is published in torchrun's store."""
    return f"peerckpt/{job}/coordinator"


def min_nodes_of(launcher_pid: int) -> int | None:
    """``MIN`` of torchrun's ``--nnodes=MIN:MAX`` (None if MIN == MAX: the world never
    shrinks), read from torchrun's own command line with torchrun's own parser;
    ``PEERCKPT_MIN_NODES`` overrides it."""
    given = os.environ.get("PEERCKPT_MIN_NODES")
    if given:
        return int(given)
    try:
        with open(f"/proc/{launcher_pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    start = next(
        (
            i + 1
            for i, a in enumerate(argv)
            if a.endswith(("torchrun", "run.py")) or a == "torch.distributed.run"
        ),
        1,
    )
    try:
        args, _ = get_args_parser().parse_known_args(argv[start:])
        low, high = parse_min_max_nnodes(args.nnodes)
    except (SystemExit, ValueError, RuntimeError):
        return None
    return int(low) if low < high else None


class HostSupervisor:
    """One host's peerckpt processes under one torchrun. ``start``, ``wait``, ``stop``."""

    def __init__(self, args: argparse.Namespace, secret: bytes) -> None:
        self.args = args
        self.secret = secret
        self.job: str = args.job
        self.dir: str = args.dir
        self.launcher = ProcessWatch(args.launcher_pid)
        self.stopping = threading.Event()
        self.run = new_run_id()  # this host's shared-memory names (``peerckpt/names.py``)
        self.procs = ProcessSet(self.job, secret, [], self.dir, {}, self.run)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.node: int | None = None
        self.rpc: RpcClient | None = None
        self.status: JobStatus | None = None  # the coordinator's last answer (its host only)
        self.monitor = JobMonitor()  # the report's timeline and summary (its host only)
        self.started = time.monotonic()

    def start(self) -> None:
        store_host, _, store_port = self.args.store.rpartition(":")
        addr = node_address(store_host)
        from torch.distributed import TCPStore  # torchrun's store for the workers

        store = TCPStore(
            store_host,
            int(store_port),
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
        )
        key = coordinator_key(self.job)
        if self.args.coordinator:
            address = self._start_coordinator(addr)
            store.set(key, sign_address(self.secret, self.job, address))
        else:  # the store takes anyone's writes: the address must prove the secret
            where = f"torchrun's store ({self.args.store}, key {key})"
            address = open_address(self.secret, self.job, store.get(key).decode(), where)
        del store
        self.rpc = RpcClient(address, self.secret, self.job)
        self.node = self.rpc.call(AllocateNode()).node
        first = self.rpc.call(Status()).state is JobState.STARTING
        flags = ["--host", addr, "--launcher-pid", str(self.args.launcher_pid)]
        node = self.procs.start_agent(self.node, address, flags)
        self.agent = node.agent
        self.procs.await_ready(self.agent, f"agent of node {self.node}")
        self._write("agent.json", {"socket": node.socket, "node": self.node, "first": first})
        log.info("node %d (%s) of job %s is up; coordinator %s", self.node, addr, self.job, address)

    def _start_coordinator(self, addr: str) -> str:
        argv = coordinator_argv(
            self.job,
            self.args.world_size,
            host=addr,
            restart_based=True,
            # how long a silent host is given before it is declared lost
            heartbeat_timeout=os.environ.get("PEERCKPT_HEARTBEAT_TIMEOUT") or None,
            stall_timeout=_stall_timeout(os.environ.get("PEERCKPT_STALL_TIMEOUT")),
            min_nodes=min_nodes_of(self.args.launcher_pid),
        )
        self.coordinator = self.procs.spawn(argv, self.procs.env(), ready=True)
        ready = self.procs.await_ready(self.coordinator, "coordinator")
        return str(ready["address"])

    def wait(self) -> None:
        """Until torchrun exits (or this process is told to stop)."""
        ended = False
        while not self.stopping.is_set() and not self.launcher.exited(wait_s=0.5):
            self._poll_status()
            if not ended and self.agent is not None and self.agent.poll() is not None:
                ended = True  # the job ended (or the node was lost): restarts must not train
                state = self.status.state.value if self.status else "ended"
                reason = self.status.reason if self.status else "the host's agent exited"
                self._write("ended.json", {"state": state, "reason": reason})
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.dir, "agent.json"))

    def _poll_status(self) -> None:
        if self.coordinator is None or self.rpc is None or self.coordinator.poll() is not None:
            return
        try:
            self.status = self.rpc.call(Status(), timeout=5.0)
        except PeerckptError as exc:
            log.debug("coordinator status: %s", exc)
            return
        self.monitor.observe(self.status, self.status.events, [])

    def stop(self) -> None:
        """Stop the agent and the coordinator, remove the host's memory and files."""
        if self.coordinator is not None:
            self._poll_status()
            if self.rpc is not None and self.status is not None and not self.status.state.ended:
                with contextlib.suppress(PeerckptError):
                    self.rpc.call(Stop("torchrun on the coordinator's host exited"), timeout=2.0)
        for proc in (self.agent, self.coordinator):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in (self.agent, self.coordinator):
            if proc is None:
                continue
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop in time; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5.0)
            if proc.stdout is not None:
                proc.stdout.close()
        if self.rpc is not None:
            self.rpc.close()
        if self.node is not None:
            sweep(self.job, self.run, self.node)  # an agent that was killed left its arena
        self._write_report()
        self.launcher.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _write_report(self) -> None:
        """The job's report, in the form ``peerckpt run --report`` writes (``JobResult``), so
        that ``peerckpt timeline`` draws it: no chaos (torchrun injects none) and no digests."""
        path = os.environ.get("PEERCKPT_REPORT")
        if not path or self.coordinator is None or self.status is None:
            return
        s = self.status
        if s.state.ended:
            outcome, reason = JobOutcome.of(s.state), s.reason
        else:
            outcome = JobOutcome.FAILED
            reason = f"torchrun exited while the job was {s.state.value}"
        result = JobResult(
            self.job,
            outcome.exit_code,
            outcome,
            reason,
            list(s.events),
            [],
            round(time.monotonic() - self.started, 3),
            list(s.flushes),
            timeline=self.monitor.timeline(),
            summary=self.monitor.summary(),
        )
        with open(path, "w") as f:
            json.dump(result.to_json(), f, indent=2, default=str)

    def _write(self, name: str, content: dict[str, Any]) -> None:
        """Write a file the workers read, atomically (they never see half of it)."""
        tmp = os.path.join(self.dir, f".{name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(content, f)
        os.replace(tmp, os.path.join(self.dir, name))


def _stall_timeout(value: str | None) -> float | None:
    """``PEERCKPT_STALL_TIMEOUT``, checked as ``peerckpt run --stall-timeout`` is (unset or
    empty: stuck ranks are only named)."""
    return check_stall_timeout("PEERCKPT_STALL_TIMEOUT", value) if value else None


def main(argv: list[str] | None = None) -> int:
    """Run one host's supervisor (started by ``runtime/torchrun.py``, not by hand)."""
    parser = argparse.ArgumentParser(prog="python -m peerckpt.launch.torchrun")
    parser.add_argument("--job", required=True)
    parser.add_argument("--dir", required=True, help="this host's directory (0700)")
    parser.add_argument("--launcher-pid", type=int, required=True, help="torchrun's pid")
    parser.add_argument("--store", required=True, help="torchrun's MASTER_ADDR:MASTER_PORT")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--coordinator", action="store_true", help="start the coordinator")
    args = parser.parse_args(argv)
    secret = service_process(f"torchrun host job={args.job}")
    host = HostSupervisor(args, secret)
    stop_on_signals(host.stopping.set)
    try:
        host.start()
        host.wait()
    except Exception:
        log.exception("this host's peerckpt processes could not start")
        return 1
    finally:
        host.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
