"""``peerckpt run``: a whole job on this machine — coordinator, agents, ranks, spares.

Each simulated node is a failure domain: one agent process and its rank processes. Spares
live on an extra *spare node* with its own agent, as hot-spare machines do on a cluster, so a
lost node's ranks are replaced on a machine that survived. The launcher starts everything,
lets the coordinator run the job, injects chaos if asked, and on the way out — success,
failure, Ctrl-C — stops every process it started and removes every shared-memory file and
socket of the job. Its exit status is the job's.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from peerckpt import exitnote
from peerckpt.errors import ConfigurationError, PeerckptError, PeerUnavailable
from peerckpt.faults import ENV as FAULTS_ENV
from peerckpt.launch.base import JobOutcome, JobResult, JobSpec, Launcher, stopped_by
from peerckpt.launch.crashes import Crashes
from peerckpt.launch.gpus import visible_gpus
from peerckpt.launch.jobfile import JobClaim, user_dir
from peerckpt.launch.monitor import JobMonitor, MonitorServer
from peerckpt.launch.processes import Proc, ProcessSet, coordinator_argv
from peerckpt.launch.progress import RecoveryProgress
from peerckpt.launch.view import JobView
from peerckpt.messages.control import (
    AllocateNode,
    FlushRecord,
    JobStatus,
    RecoveryEvent,
    SparesStarting,
    Status,
    Stop,
)
from peerckpt.names import check_job_name, new_run_id
from peerckpt.persist.config import to_env as persist_env
from peerckpt.rpc import RpcClient
from peerckpt.shm import sweep
from peerckpt.states import JobState, ProcRole

if TYPE_CHECKING:
    from peerckpt.chaos import Chaos

log = logging.getLogger("peerckpt.launcher")
MAX_COORDINATOR_RESTARTS = 10
# How long a signalled launcher waits for the last committed step to become durable before
# it stops everything: below the grace period of SLURM's and Kubernetes' SIGTERM (30 s).
STOP_FLUSH_S = 25.0
TAIL_NOTICE_S = 10.0  # a script still running after its training is said to be waited for
TAIL_GRACE_S = 10.0  # after one rank failed there, the others' time before they are stopped


class LocalLauncher(Launcher):
    """Runs one job of ``JobSpec`` on this machine. ``run`` always cleans up."""

    def __init__(self, spec: JobSpec, secret: bytes | None = None, claim: bool = True) -> None:
        """``secret``: the job's (a multi-host job shares one; default: a new random one).
        ``claim``: hold the job's name on this machine, and publish it for ``peerckpt join``."""
        spec.check()  # before anything starts: a bad setting is refused with its fix
        self.spec = spec
        self.chaos = _chaos(spec.chaos)  # parsed now: a bad spec fails before anything starts
        shape = self._shape()
        if self.chaos is not None and shape is not None:
            self.chaos.check(*shape)
        self.job = check_job_name(spec.job) if spec.job is not None else secrets.token_hex(4)
        # Held until stop(): a second launcher of this name is refused while this one runs.
        self._claim = JobClaim(self.job) if claim else None
        self.run_id = new_run_id()
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        sweep_stale_runs()  # what launchers killed with SIGKILL left behind
        self.rundir = tempfile.mkdtemp(prefix=f"peerckpt-{self.job}-")
        self._rundir_lock: int | None = _hold_rundir(self.rundir, self.job, self.run_id)
        self.procs = ProcessSet(
            self.job, self._secret, [spec.script, *spec.args], self.rundir, spec.env, self.run_id
        )
        # this machine's ranks (and spares) outnumber its GPUs: NCCL ranks share them
        gpus = visible_gpus({**os.environ, **spec.env})
        self.procs.share_gpus = 0 < gpus < spec.world + spec.spares
        if self.procs.share_gpus:
            log.info(
                "%d rank process(es) share %d GPU(s): each is an NCCL host of its own "
                "(NCCL_HOSTID; shared memory and P2P off: NCCL's socket transport)",
                spec.world + spec.spares,
                gpus,
            )
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.address = ""
        self._ranks: dict[int, Proc] = {}  # the first epoch's rank processes
        self.crashes = Crashes()  # rank processes that died of their own signal
        self._interrupted = threading.Event()
        self._hurry = threading.Event()  # a second signal: stop without waiting for a flush
        self.rpc: RpcClient | None = None
        self._flushes: list[FlushRecord] = []
        self._restarts = 0  # coordinator restarts
        self._earlier_events: list[RecoveryEvent] = []  # failures seen by the coordinators before
        self._coordinator_where: list[str] = []  # where the coordinator listens (its flags)
        self._store_port = 0
        self._spares: list[Proc] = []  # every spare process started
        self._spare_node = -1
        self._spares_announced = 0  # spares the coordinator was told are starting, not started
        self._fault_dir: str | None = None
        # What the result holds, collected as the job runs and before ``stop`` removes it
        self._events: list[RecoveryEvent] = []
        self._digests: dict[str, list[str]] = {}
        self._tensor_digests: dict[str, dict[str, str]] = {}
        # Observers: metrics and the status page (--metrics-port), the timeline samples, and
        # whatever else wants every status the launcher polls (progress, a campaign's bar).
        self.monitor = JobMonitor()
        self._server: MonitorServer | None = None
        self._recovery_progress = RecoveryProgress()
        self.watchers: list[Callable[[JobStatus, JobView], None]] = [self._recovery_progress]
        if self.chaos is not None and self.chaos.needs_fault_dir:
            self._fault_dir = os.path.join(self.rundir, "faults")
            os.mkdir(self._fault_dir, 0o700)
            self.chaos.prepare(self._fault_dir)
            self.procs.extra_env = {**self.procs.extra_env, FAULTS_ENV: self._fault_dir}

    def _shape(self) -> tuple[int, int, int] | None:
        """(nodes, ranks per node, spare nodes) that chaos actions may name."""
        spec = self.spec
        return spec.nodes, spec.nproc_per_node, 1 if spec.spares else 0

    # -- starting -------------------------------------------------------------------------
    def start(self) -> None:
        spec, procs = self.spec, self.procs
        world = spec.world
        if spec.spares:
            procs.start_prefork()  # imports once for every spare, while the rest starts
        self._start_coordinator([])
        for n in range(spec.nodes + (1 if spec.spares else 0)):
            procs.start_agent(n, self.address, ["--spare-node"] if n >= spec.nodes else [])
        for node in procs.nodes.values():
            procs.await_ready(node.agent, f"agent of node {node.index}")
        for n in range(spec.nodes):
            for local in range(spec.nproc_per_node):
                rank = n * spec.nproc_per_node + local
                self._ranks[rank] = procs.start_proc(
                    n, ProcRole.RANK, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world)
                )
        for _ in range(spec.spares):
            self._spares.append(procs.start_proc(spec.nodes, ProcRole.SPARE, WORLD_SIZE=str(world)))
        self._spare_node = spec.nodes
        self._write_job_file()
        log.info(
            "job %s: %d node(s) × %d rank(s), %d spare(s); coordinator %s",
            self.job,
            spec.nodes,
            spec.nproc_per_node,
            spec.spares,
            self.address,
        )

    def _start_coordinator(self, where: list[str], restart: bool = False) -> None:
        """Start the job's coordinator (``where``: its --host/--port flags, if any);
        ``restart``: a coordinator that rebuilds a running job from its agents' reports."""
        spec = self.spec
        argv = coordinator_argv(
            self.job,
            spec.world,
            heartbeat_timeout=spec.heartbeat_timeout,
            stall_timeout=spec.stall_timeout,
            replicas=spec.replicas,
            min_nodes=spec.min_nodes,
            max_restarts=spec.max_restarts,
            # a restarted one counts the spares the agents report
            spares=spec.spares if spec.spares and not restart else None,
            placement=spec.placement,
            racks=json.dumps(spec.racks) if spec.racks else None,
            erasure=spec.erasure,
            digests_file=os.path.join(self.rundir, "digests.txt") if spec.record_digests else None,
        )
        self._coordinator_where = where
        # --persist in the environment, not on the command line: a URL may hold credentials
        env = self.procs.env(**persist_env(spec.persist))
        self.coordinator = self.procs.spawn([*argv, *where], env, ready=True)
        self.procs.others.append(self.coordinator)
        what = "restarted coordinator" if restart else "coordinator"
        ready = self.procs.await_ready(self.coordinator, what)
        self.address = ready["address"]
        self._store_port = int(ready["store_port"])
        if self.rpc is None:
            self.rpc = RpcClient(self.address, self._secret, self.job)

    def _start_coordinator_at(self, endpoint: str) -> None:
        """Start the coordinator listening at ``endpoint`` (HOST:PORT), its process groups'
        store on PORT + 1 (two fixed ports to open in a firewall)."""
        host, _, port = endpoint.rpartition(":")
        self._start_coordinator(
            ["--host", host, "--port", port, "--store-port", str(int(port) + 1)]
        )

    def _write_job_file(self) -> None:
        """What ``peerckpt join`` needs to find and join this job (``launch/jobfile.py``)."""
        if self._claim is None:
            return
        self._claim.publish(
            {
                "coordinator": self.address,
                "secret": self._secret.hex(),
                "script": [self.spec.script, *self.spec.args],
                "nproc_per_node": self.spec.nproc_per_node,
                "env": self.spec.env,  # --env: the joiners' too
                "run": self.run_id,
                "metrics": self._server.address if self._server is not None else None,
            }
        )

    # -- machine-level faults and growth (``Launcher``) ------------------------------------
    def kill_node(self, node: int) -> None:
        self.procs.kill_node(node)
        sweep(self.job, self.run_id, node)  # the node's memory is gone with it

    def kill_agent(self, node: int) -> None:
        """SIGKILL node ``node``'s agent only. Its ranks see their link close and exit; the
        node's memory was the agent's, so it is gone with it."""
        agent = self.procs.nodes[node].agent
        with contextlib.suppress(ProcessLookupError):
            agent.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=5.0)
        sweep(self.job, self.run_id, node)

    def add_node(self) -> int:
        """Start one more node (agent and --nproc-per-node processes) that joins the job."""
        assert self.rpc is not None
        n = self.rpc.call(AllocateNode()).node
        count = self.spec.nproc_per_node
        node = self.procs.start_agent(
            n, self.address, [*self._agent_flags(), "--joining", str(count)]
        )
        self.procs.await_ready(node.agent, f"agent of node {n}")
        for _ in range(count):
            self.procs.start_proc(n, ProcRole.JOINER)
        log.info("node %d is joining the job with %d rank(s)", n, count)
        return n

    def _agent_flags(self) -> list[str]:
        """Flags every agent this launcher starts gets (where it binds, on several hosts)."""
        return []

    # -- running (the steps of ``Launcher.run``) -------------------------------------------
    def _prepare(self) -> None:
        if self.spec.metrics_port is not None:
            self._server = MonitorServer(
                self.monitor, self.spec.metrics_addr, self.spec.metrics_port
            )
            self._server.start()

    def _watch(self) -> tuple[JobOutcome, str]:
        outcome, reason, self._events = self._poll()
        if self._interrupted.is_set():
            self._flush_before_stop()
        return outcome, reason

    def _wind_down(self) -> None:
        self._digests, self._tensor_digests = self._read_digests()  # stop removes them
        self._recovery_progress.close()

    def _result(self, outcome: JobOutcome, reason: str, wall_s: float) -> JobResult:
        code = outcome.exit_code
        if self._interrupted.is_set():
            outcome = JobOutcome.INTERRUPTED
            code, reason = stopped_by(self._signal)  # SIGTERM: 143, "stopped by SIGTERM"
        return JobResult(
            self.job,
            code,
            outcome,
            reason,
            self._events,
            self.chaos.fired if self.chaos is not None else [],
            wall_s,
            self._flushes,
            self._digests,
            self.monitor.timeline(),
            [],
            self._tensor_digests,
            self.monitor.summary(),
        )

    def _poll(self) -> tuple[JobOutcome, str, list[RecoveryEvent]]:
        """Poll the coordinator until the job ends: how, why, and the failures of the job."""
        assert self.rpc is not None
        state, events = JobState.STARTING, list[RecoveryEvent]()
        started = time.monotonic()
        while not self._interrupted.wait(0.05):
            if self.coordinator is not None and self.coordinator.poll() is not None:
                if state is not JobState.RUNNING or self._restarts >= MAX_COORDINATOR_RESTARTS:
                    return (
                        JobOutcome.FAILED,
                        "the coordinator exited unexpectedly",
                        self._all_events(events),
                    )
                self._earlier_events = self._all_events(events)
                state, events = JobState.RESTARTING, []
                self._restart_coordinator()
                continue
            try:
                status = self.rpc.call(Status(), timeout=5.0)
            except PeerckptError as exc:
                log.warning("coordinator status: %s", exc)
                if self._coordinator_gone(state):
                    return (
                        JobOutcome.FAILED,
                        f"the job's coordinator is gone: {exc}",
                        self._all_events(events),
                    )
                continue
            state, events = status.state, status.events
            self._flushes = list(status.flushes)
            self._observe(status)
            self.crashes.observe(status.ranks, self.procs.training())
            if state.ended:
                outcome, reason = JobOutcome.of(state), status.reason
                if outcome is JobOutcome.SUCCEEDED:
                    outcome, reason = self._after_training(status, reason)
                elif outcome is JobOutcome.FAILED and (recurring := self.crashes.recurring()):
                    reason = f"{reason} — {recurring}"
                return outcome, reason, self._all_events(events)
            refusal = self.chaos.refusal if self.chaos is not None else None
            if refusal is not None:
                return JobOutcome.FAILED, refusal, self._all_events(events)
            self.procs.end_groups()  # a rank that died takes its DataLoader workers along
            if state is JobState.RUNNING:
                self.procs.restart_stuck(WORLD_SIZE=str(self.spec.world))
                self.procs.restart_in_place(status.in_place, WORLD_SIZE=str(self.spec.world))
            if self.spec.keep_spares and state is JobState.RUNNING:
                self._replenish(status)
            if state is JobState.STARTING and not self._restarts:
                problem = self._start_problem(time.monotonic() - started)
                if problem:
                    return JobOutcome.FAILED, problem, []
        return JobOutcome.INTERRUPTED, "stopped by a signal", self._all_events(events)

    def _after_training(self, status: JobStatus, reason: str) -> tuple[JobOutcome, str]:
        """The decorated function returned on every rank: wait for the rank processes to
        run the rest of the script (evaluation, saving the model; as long as it takes, as
        torchrun does, or until a signal) and fail the job if one of them fails there (the
        others are then given 10 s, then stopped: they may wait for it in a collective)."""
        ranks = {(node, pid): rank for rank, (node, pid) in status.ranks.items()}
        rank_of = {
            p.pid: ranks[(n, p.pid)] for n, p in self.procs.training() if (n, p.pid) in ranks
        }
        running = [p for n, p in self.procs.training() if p.poll() is None and p.pid in rank_of]
        said, failed_at = False, None
        order: list[Proc] = []  # the processes that failed, in the order they were seen to
        waited = time.monotonic()
        while not self._interrupted.wait(0.05):
            order += [p for p in running if p.poll() not in (None, 0) and p not in order]
            if failed_at is None and order:
                failed_at = time.monotonic()  # the others may wait for it in a collective
            if all(p.poll() is not None for p in running):
                break
            if failed_at is not None and time.monotonic() - failed_at > TAIL_GRACE_S:
                break  # ``stop`` ends them
            if not said and time.monotonic() - waited > TAIL_NOTICE_S:
                said = True
                log.info(
                    "training ended; waiting for %d rank process(es) to finish the script "
                    "after the decorated function (Ctrl-C stops them)",
                    sum(p.poll() is None for p in running),
                )
        order += [p for p in running if p.poll() not in (None, 0) and p not in order]
        if not order:
            return JobOutcome.SUCCEEDED, reason
        first, *then = order
        after = (
            f" (then {', '.join(f'rank {rank_of[p.pid]}' for p in then)}, which may have waited "
            "for it in a collective)"
            if then
            else ""
        )
        return JobOutcome.FAILED, (
            f"training succeeded, but the script failed after the decorated function returned: "
            f"rank {rank_of[first.pid]} (pid {first.pid}) exited with status {first.returncode} "
            f"first{after}; see its traceback above"
        )

    def _on_signal(self, signum: int) -> None:
        """Ctrl-C or SIGTERM: stop the job; a second one while the last flush runs: at once."""
        if self._interrupted.is_set():
            self._hurry.set()
        super()._on_signal(signum)

    def _flush_before_stop(self) -> None:
        """Told to stop by a signal: make the last committed step durable before anything
        stops, waiting at most ``STOP_FLUSH_S`` (logged). The training processes are frozen
        first (SIGSTOP), so that no newer step commits meanwhile and no rank rewrites the
        slots the writers read; the coordinator ends the job once the flush settled."""
        assert self.rpc is not None
        self.procs.pause()
        try:
            self.rpc.call(Stop(stopped_by(self._signal)[1], flush=True), timeout=5.0)
            deadline, told = time.monotonic() + STOP_FLUSH_S, False
            while not self._hurry.wait(0.1):
                status = self.rpc.call(Status(), timeout=5.0)
                self._flushes = list(status.flushes)
                if status.state.ended:
                    return
                if not told:
                    told = True
                    log.warning(
                        "stopping: flushing the last committed step (%s) first, for up to "
                        "%.0f s (a second Ctrl-C stops at once)",
                        status.committed_step,
                        STOP_FLUSH_S,
                    )
                if time.monotonic() > deadline:
                    log.warning(
                        "the last committed step was not made durable within %.0f s; "
                        "stopping without it",
                        STOP_FLUSH_S,
                    )
                    return
            log.warning("a second signal: stopping without waiting for the last flush")
        except PeerckptError as exc:
            log.warning("the last committed step could not be flushed before stopping: %s", exc)
        finally:
            self.procs.resume()

    def _coordinator_gone(self, state: JobState) -> bool:
        """Whether to give up on a coordinator that does not answer (never, when this
        launcher runs it: it restarts it instead)."""
        return False

    def _observe(self, status: JobStatus) -> None:
        """Hand a status to the monitor (metrics, status page, timeline) and the watchers."""
        chaos = list(self.chaos.fired) if self.chaos is not None else []
        view = self.monitor.observe(status, self._all_events(status.events), chaos)
        for watcher in self.watchers:
            watcher(status, view)

    def _read_digests(self) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
        """The digests the coordinators recorded: "rank/step" → the distinct ones seen, and
        "rank/step/digest" → that snapshot's tensor digests by key."""
        found: dict[str, list[str]] = {}
        tensors: dict[str, dict[str, str]] = {}
        path = os.path.join(self.rundir, "digests.txt")
        if not self.spec.record_digests or not os.path.exists(path):
            return found, tensors
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                    rank, step, digest = record["rank"], record["step"], record["digest"]
                except (ValueError, KeyError, TypeError):
                    continue  # the last line of a coordinator killed while writing it
                seen = found.setdefault(f"{rank}/{step}", [])
                if digest not in seen:
                    seen.append(digest)
                tensors[f"{rank}/{step}/{digest}"] = dict(record.get("tensors") or {})
        return found, tensors

    def _all_events(self, events: list[RecoveryEvent]) -> list[RecoveryEvent]:
        """The failures of the whole job: a restarted coordinator knows only its own, and the
        monitor keeps every one any status showed (``JobMonitor.remember``)."""
        return self.monitor.remember([*self._earlier_events, *events])

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator; the launcher restarts it (``_restart_coordinator``)."""
        assert self.coordinator is not None and self.rpc is not None
        # What it knows dies with it: keep its failures first (the watch loop polls only
        # every 50 ms, and not while it waits for a new spare node's agent).
        with contextlib.suppress(PeerckptError):
            self._all_events(self.rpc.call(Status(), timeout=2.0).events)
        with contextlib.suppress(ProcessLookupError):
            self.coordinator.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.coordinator.wait(timeout=5.0)

    def _restart_coordinator(self) -> None:
        """Start a new coordinator where the last one listened. The agents, which kept their
        epoch, their ranks and their copies, register again and it rebuilds its state from
        what they report; the ranks go on training meanwhile."""
        self._restarts += 1
        self._spares_announced = 0  # told the last coordinator only
        port = self.address.rpartition(":")[2]
        log.warning("the coordinator exited; restarting it (restart %d)", self._restarts)
        self._start_coordinator(
            [*self._coordinator_where, "--port", port, "--store-port", str(self._store_port)],
            restart=True,
        )

    def _restart_if_exited(self, events: list[RecoveryEvent]) -> None:
        """Restart the coordinator if it exited while the launcher waits on something else
        (``events``: the failures it had reported, kept for the report). While it runs, its
        status is observed as the watch loop would: a failure meanwhile is kept even if the
        coordinator dies before the watch loop polls again."""
        if self.coordinator is None:
            return
        if self.coordinator.poll() is None:
            if self.rpc is not None:
                with contextlib.suppress(PeerckptError):
                    self._observe(self.rpc.call(Status(), timeout=1.0))
            return
        if self._restarts >= MAX_COORDINATOR_RESTARTS:
            raise PeerckptError("the coordinator exited unexpectedly")
        self._earlier_events = self._all_events(events)
        self._restart_coordinator()

    def _replenish(self, status: JobStatus) -> None:
        """Keep ``--spares`` spares in reserve, as a cluster's pool of hot spares does: one
        for every spare that took a rank or died. The coordinator hears that they are starting
        before anything starts, so that a loss meanwhile waits for them.

        The coordinator may die on the way: a call it does not answer is tried again at the
        next status, and while a new spare node's agent waits for it (``CoordinatorLink.
        register``) this restarts it, as ``_poll`` would; neither fails the job."""
        assigned = {pid for _, pid in status.ranks.values()}
        waiting = [p for p in self._spares if p.poll() is None and p.pid not in assigned]
        missing = self.spec.spares - len(waiting)
        if missing <= 0:
            return
        assert self.rpc is not None
        hosts_ranks = any(node == self._spare_node for node, _ in status.ranks.values())
        try:
            # First: a loss while they start (a new spare node takes a second) waits for them
            # instead of failing the job for want of spares.
            self._announce_spares(missing)
            if hosts_ranks or not status.nodes.get(self._spare_node, False):
                # A spare node that now runs ranks is a failure domain of the job: new spares
                # go to a fresh one, so that losing it does not take the reserve with it.
                # spares only: never refused, also by a job that cannot reshard (its world
                # keeps its size)
                node = self.rpc.call(AllocateNode(spares_only=True)).node
                agent = self.procs.start_agent(node, self.address, ["--spare-node"])
                self.procs.await_ready(
                    agent.agent,
                    f"agent of node {node}",
                    lambda: self._restart_if_exited(status.events),
                )
                self._spare_node = node
                log.info("node %d is the new spare node", node)
            self._announce_spares(missing)  # again if the coordinator restarted meanwhile
        except PeerUnavailable as exc:
            log.warning("spares not replenished yet (tried again at the next status): %s", exc)
            return
        for _ in range(missing):
            self._spares.append(
                self.procs.start_proc(
                    self._spare_node, ProcRole.SPARE, WORLD_SIZE=str(self.spec.world)
                )
            )
        self._spares_announced = 0
        log.info("started %d spare(s) on node %d to replace those used", missing, self._spare_node)

    def _announce_spares(self, count: int) -> None:
        """Tell the coordinator that ``count`` spares are starting, once per coordinator (a
        restarted one knows only the spares its agents report: ``_restart_coordinator``)."""
        assert self.rpc is not None
        if self._spares_announced < count:
            self.rpc.call(SparesStarting(count - self._spares_announced))
            self._spares_announced = count

    def _start_problem(self, waited: float) -> str:
        """Why the first epoch cannot open, if it cannot (a rank died or never connected)."""
        dead = {r: p for r, p in self._ranks.items() if p.poll() is not None}
        if dead:
            ranks = ", ".join(
                f"rank {r} (exit status {p.returncode})" for r, p in sorted(dead.items())
            )
            said = {exitnote.read(self.rundir, p.pid) for p in dead.values()}
            if len(said) == 1 and None not in said:  # each said the same error: say it once
                return f"{ranks} exited before the job started: {said.pop()}"
            return f"{ranks} exited before the job started; see the script's output above"
        if waited > self.spec.start_timeout:
            return (
                f"the rank processes did not all connect to their agents within "
                f"{self.spec.start_timeout:.0f} s; is the script calling a @peerckpt.resilient "
                "function?"
            )
        return ""

    def stop(self) -> None:
        """Stop every process of the job and remove its files. Idempotent."""
        if self.rpc is not None:
            with contextlib.suppress(PeerckptError):
                self.rpc.call(Stop("the launcher is stopping the job"), timeout=2.0)
        self.procs.stop()
        if self.rpc is not None:
            self.rpc.close()
            self.rpc = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        removed = sweep(self.job, self.run_id)
        if removed:
            log.info("removed %d shared-memory file(s) left by killed processes", len(removed))
        shutil.rmtree(self.rundir, ignore_errors=True)
        if self._rundir_lock is not None:
            os.close(self._rundir_lock)  # after the removal: no sweep takes it for stale
            self._rundir_lock = None
        if self._claim is not None:
            self._claim.release()


# In a run directory: flock-ed by its launcher while it runs; "<job> <run id>".
RUNDIR_LOCK = "launcher.lock"


def _hold_rundir(rundir: str, job: str, run_id: str) -> int:
    """Lock ``rundir`` as this launcher's for as long as it runs (the descriptor is closed
    when the process dies, however it dies). The lock file gets its name once locked, so
    that a sweep never sees it unlocked in a live run directory."""
    tmp = os.path.join(rundir, f".{RUNDIR_LOCK}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{job} {run_id}\n".encode())
    os.rename(tmp, os.path.join(rundir, RUNDIR_LOCK))
    return fd


def sweep_stale_runs() -> list[str]:
    """Remove what launchers of this user killed with SIGKILL left: their run directories
    (``$TMPDIR/peerckpt-<job>-*`` whose lock no live launcher holds), the shared-memory files
    of those runs, and job files whose claim no launcher holds (``launch/jobfile.py``: a
    stale one is taken over by the next launcher of its name; here by any). The agents of such
    a run stop its processes and remove their own memory (``replication/agent.py``). Returns
    the run directories removed."""
    removed = []
    uid = os.getuid()
    for rundir in glob.glob(os.path.join(tempfile.gettempdir(), "peerckpt-*-*")):
        path = os.path.join(rundir, RUNDIR_LOCK)
        try:
            st = os.lstat(rundir)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # not a run directory of this version, or removed meanwhile
        try:
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or os.fstat(fd).st_uid != uid:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its launcher runs
            job, _, run = os.read(fd, 256).decode(errors="replace").strip().partition(" ")
            with contextlib.suppress(PeerckptError, ValueError):
                sweep(job, run)
            shutil.rmtree(rundir, ignore_errors=True)
            removed.append(rundir)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d run director(ies) left by killed launchers", len(removed))
    _sweep_stale_claims()
    return removed


def _sweep_stale_claims() -> None:
    """Job files (and claims) whose launcher is gone: taken, then released, as the next
    launcher of that name would."""
    try:
        directory = user_dir()
    except (FileNotFoundError, ConfigurationError):
        return
    for lock in glob.glob(os.path.join(directory, "*.lock")):
        name = os.path.basename(lock)[: -len(".lock")]
        try:
            claim = JobClaim(name)
        except (ConfigurationError, OSError):
            continue  # running, or not a name of ours
        claim.release()


def _chaos(spec: str) -> Chaos | None:
    if not spec:
        return None
    from peerckpt.chaos import Chaos  # the chaos package's public surface, loaded on use

    return Chaos(spec)
