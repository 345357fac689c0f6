"""``peerckpt run --ray ADDRESS``: a job on a Ray cluster, one failure domain per Ray node.

Ray places, peerckpt runs. The driver (this module, in ``peerckpt run --ray`` or
:func:`run`) lists the alive Ray nodes and pins one small actor to each node it uses
(``NodeAffinitySchedulingStrategy``, hard); each actor starts that node's host launcher
(``launch/rayhost.py``, the same :class:`HostLauncher` as ``peerckpt run --nnodes``)::

    driver ── RayHost actor on Ray node k ── python -m peerckpt.launch.rayhost (host k)
                                               ├─ coordinator            (host 0 only)
                                               ├─ agent, bound to the node's address
                                               └─ ranks, spares or joiners

Hosts 0 … ``--nodes``-1 hold the ranks, the next ``--spares`` Ray nodes are spare hosts
(``--nproc-per-node`` hot spares each); a Ray node that joins later becomes a spare host
while fewer than ``--spares`` are in reserve (``docs/ray.md`` says why replenish, not grow).

What Ray is used for: the list of alive nodes and their addresses, placing one actor per
node, carrying the small orders (the spec, the secret and the environment, sealed to a key
the actor made: ``rayseal.py``, since Ray's RPC is not encrypted) and host 0's report back,
noticing a node that joins, and, for ``kill node`` chaos, the failure itself (the node's
raylet killed). What it is not used for: rank processes (they are the host
launcher's children, so numerics and the data plane are those of any peerckpt job),
snapshots (bulk state moves agent to agent over the job's authenticated transport, never
through Ray's object store), failure detection (the coordinator's heartbeats), restarts.

The actor is ``rayactor.RayHost``; the host launcher it starts is ``rayhost.py``; the rules
that need no cluster (host order, where each fault goes) are ``rayplan.py``.

A lost Ray node takes its actor with it, and with the actor its host launcher and every
process under it (``rayhost.py``); the survivors recover in process as from any lost host.
Everything this driver started is ended when it returns, whatever happened.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from peerckpt.chaos import FiredAction
from peerckpt.errors import ConfigurationError, PeerckptError
from peerckpt.launch.base import JobOutcome, JobResult, JobSpec, Launcher, stopped_by
from peerckpt.launch.checks import check_ray_address
from peerckpt.launch.local import TAIL_NOTICE_S
from peerckpt.launch.rayactor import RayHost
from peerckpt.launch.rayenv import forwarded
from peerckpt.launch.rayhost import spec_to_json
from peerckpt.launch.rayplan import host_order, split_chaos
from peerckpt.launch.rayseal import context, seal
from peerckpt.messages.control import JobStatus, Status
from peerckpt.names import check_job_name
from peerckpt.rpc import RpcClient
from peerckpt.states import ExitCode, JobState

log = logging.getLogger("peerckpt.launcher")
POLL_S = 0.2  # how often the driver asks host 0's actor whether the job ended
NODES_POLL_S = 1.0  # how often it lists Ray's nodes (a node joining, a spare used up)
END_WAIT_S = 60.0  # how long hosts get to stop on their own once the job ended


class HostRole(enum.Enum):
    """What a host of a Ray job brings: the ranks of the first epoch, spares, or growth."""

    RANKS = "ranks"  # hosts 0 … --nodes-1
    SPARE = "spare"  # a spare host: --nproc-per-node hot spares
    JOINER = "joiner"  # a node that grows the job (chaos ``add node``)


@dataclass
class _Host:
    """One host of the job: its Ray node, its node rank, its actor."""

    rank: int
    node_id: str
    addr: str
    role: HostRole
    actor: Any
    done: dict[str, Any] | None = None
    lost: bool = False


class RayLauncher(Launcher):
    """Runs one ``JobSpec`` on the Ray cluster at ``address`` ("auto": ``RAY_ADDRESS`` or the
    cluster started on this machine). ``spec.nodes`` Ray nodes hold ranks; ``spec.spares``
    counts spare *nodes* (each with ``nproc_per_node`` spares). ``run`` always cleans up."""

    def __init__(self, spec: JobSpec, address: str = "auto", secret: bytes | None = None) -> None:
        spec.check()  # before anything starts: a bad setting is refused with its fix
        check_ray_address(address)
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                "a job on Ray needs the ray package: pip install 'peerckpt[ray]'"
            ) from None
        self.address = address
        self.job = check_job_name(spec.job) if spec.job is not None else secrets.token_hex(4)
        self.run_id = ""  # every host has its own (its shared-memory names)
        self.spec = replace(spec, script=os.path.abspath(spec.script), job=self.job)
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._driver_chaos, self._host_chaos = split_chaos(spec.chaos, spec.nproc_per_node)
        if spec.chaos:
            from peerckpt.chaos import Chaos

            Chaos(spec.chaos).check(spec.nodes, spec.nproc_per_node, spec.spares)
        self.hosts: dict[int, _Host] = {}
        self.endpoint = ""
        self.rpc: RpcClient | None = None
        self._next_rank = 0
        self._used: set[str] = set()  # Ray nodes this job placed a host on, ever
        self._interrupted = threading.Event()
        self._connected = False
        self._lock = threading.Lock()
        self._actor_cls: Any = None
        self.chaos = None
        self._fault_dir = None
        self._host0: dict[str, Any] | None = None  # host 0's end: its exit status and result

    # -- starting -------------------------------------------------------------------------
    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            # Ray's own log lines stay quiet; the host launchers' output still reaches here.
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=True)
            self._connected = True
        self._actor_cls = ray.remote(num_cpus=0, max_restarts=0)(RayHost)

    def alive_nodes(self) -> list[dict[str, Any]]:
        """Ray's alive nodes, in host order (``rayplan.host_order``)."""
        import ray

        return host_order(ray.nodes())

    def _free_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.alive_nodes() if n["NodeID"] not in self._used]

    def _place(self, node: dict[str, Any], role: HostRole) -> _Host:
        """Pin an actor to ``node`` and take the next node rank for it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self._actor_cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote()
        with self._lock:
            rank = self._next_rank
            self._next_rank += 1
            self._used.add(node["NodeID"])
            host = _Host(rank, node["NodeID"], node["NodeManagerAddress"], role, actor)
            self.hosts[rank] = host
        return host

    def _launch(self, host: _Host) -> None:
        """Start ``host``'s launcher on its node: its orders, the secret and our environment,
        sealed to the key its actor made (nothing of them in clear on Ray's RPC)."""
        import ray

        spec = replace(
            self.spec,
            chaos=self._host_chaos.get(host.rank, ""),
            report=None,
            spares=0,
            keep_spares=False,  # the driver keeps spare nodes in reserve (``_replenish``)
            metrics_port=self.spec.metrics_port if host.rank == 0 else None,
        )
        orders = {
            "spec": spec_to_json(spec),
            "host": {
                "nnodes": self.spec.nodes,
                "node_rank": host.rank,
                "rdzv_endpoint": self.endpoint,
                "node_addr": host.addr,
                "spare_host": host.role is HostRole.SPARE,
            },
        }
        env = forwarded(os.environ)  # the launching shell's, as srun does (``rayenv.py``)
        env["PEERCKPT_JOB"] = self.job  # every process of the job carries its name
        env["PEERCKPT_RAY_CWD"] = os.getcwd()
        public = ray.get(host.actor.public_key.remote(), timeout=120)
        payload = {"orders": orders, "secret": self._secret.hex(), "env": env}
        sealed = seal(payload, public, context(self.job, host.rank))
        ray.get(host.actor.start.remote(sealed, self.job, host.rank), timeout=120)
        log.info(
            "host %d (%s, %s) on Ray node %s",
            host.rank,
            host.role.value,
            host.addr,
            host.node_id[:12],
        )

    def start(self) -> None:
        import ray

        self._connect()
        nodes = self.alive_nodes()
        spec = self.spec
        if len(nodes) < spec.nodes:
            raise ConfigurationError(
                f"the Ray cluster has {len(nodes)} alive node(s); the job needs --nodes "
                f"{spec.nodes} (one per node): add nodes or lower --nodes"
            )
        if len(nodes) < spec.nodes + spec.spares:
            log.warning(
                "%d spare node(s) asked, %d Ray node(s) free: nodes that join later become spares",
                spec.spares,
                len(nodes) - spec.nodes,
            )
        first = self._place(nodes[0], HostRole.RANKS)
        self.endpoint = ray.get(first.actor.endpoint.remote(first.addr), timeout=120)
        placed = [first]
        for node in nodes[1 : spec.nodes]:
            placed.append(self._place(node, HostRole.RANKS))
        for node in nodes[spec.nodes : spec.nodes + spec.spares]:
            placed.append(self._place(node, HostRole.SPARE))
        for host in placed:  # host 0 first: the others wait for its coordinator
            self._launch(host)
        self.rpc = RpcClient(self.endpoint, self._secret, self.job)
        if self._driver_chaos:  # the faults only the driver can cause; ``run`` starts them
            from peerckpt.chaos import Chaos

            self.chaos = Chaos(self._driver_chaos)
        log.info(
            "job %s on Ray: %d node(s) × %d rank(s), %d spare node(s); coordinator %s",
            self.job,
            spec.nodes,
            spec.nproc_per_node,
            len(placed) - spec.nodes,
            self.endpoint,
        )

    # -- machine-level faults and growth (``Launcher``) ------------------------------------
    def kill_node(self, node: int) -> None:
        """Remove host ``node``'s Ray node: its job processes and its raylet, killed."""
        import ray

        host = self.hosts[node]
        try:
            what = ray.get(host.actor.kill_machine.remote(), timeout=30)
            log.warning("removed Ray node %s (host %d): %s", host.node_id[:12], node, what)
        except ray.exceptions.RayActorError:
            pass  # the actor died with its raylet before answering: the usual case
        host.lost = True

    def kill_agent(self, node: int) -> None:
        raise ConfigurationError(
            "under --ray, `kill agent` runs on the host of that node: it is sent there"
        )

    def kill_coordinator(self) -> None:
        raise ConfigurationError("under --ray, `kill coordinator` runs on host 0: it is sent there")

    def add_node(self) -> int:
        """Start a host that grows the job on a Ray node this job does not use yet."""
        free = self._free_nodes()
        if not free:
            raise PeerckptError("add node: every alive Ray node already holds a host of the job")
        host = self._place(free[0], HostRole.JOINER)
        self._launch(host)
        return host.rank

    # -- running (the steps of ``Launcher.run``) -------------------------------------------
    def _watch(self) -> tuple[JobOutcome, str]:
        """Until host 0's launcher ends (its result, in ``_host0``), a host that brings ranks
        fails the start, or a signal: spare nodes kept in reserve meanwhile."""
        import ray

        host0 = self.hosts[0]
        next_nodes = time.monotonic() + NODES_POLL_S
        while not self._interrupted.wait(POLL_S):
            try:
                done = ray.get(host0.actor.poll.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                return JobOutcome.FAILED, "the Ray node of host 0 (the coordinator) died"
            if done is not None:
                self._host0 = done
                if int(done["code"]) == ExitCode.OK:
                    self._await_tails()
                ended = int(done["code"]) == ExitCode.INTERRUPTED
                return JobOutcome.INTERRUPTED if ended else JobOutcome.FAILED, ""
            if time.monotonic() >= next_nodes:
                next_nodes = time.monotonic() + NODES_POLL_S
                self._check_hosts()
                problem = self._start_problem()
                if problem:
                    return JobOutcome.FAILED, problem
                self._replenish()
        return JobOutcome.INTERRUPTED, stopped_by(self._signal)[1]

    def _await_tails(self) -> None:
        """Training succeeded and host 0's ranks finished the script: each other host's
        launcher waits for its ranks to run the script's code after the decorated function
        (saving the model, an evaluation) as long as it takes, as torchrun does; so does the
        driver, for every host still running, until they end or a signal (``stop`` then
        interrupts them). What they end with is judged in ``_result``."""
        waited, said = time.monotonic(), False
        while not self._interrupted.wait(POLL_S):
            running = [
                h for h in self.hosts.values() if h.rank != 0 and not h.lost and h.done is None
            ]
            for host in running:
                self._poll_or_lose(host)
            running = [h for h in running if h.done is None and not h.lost]
            if not running:
                return
            if not said and time.monotonic() - waited > TAIL_NOTICE_S:
                said = True
                log.info(
                    "training ended; waiting for host(s) %s to finish the script after the "
                    "decorated function (Ctrl-C stops them)",
                    ", ".join(str(h.rank) for h in running),
                )

    def _failed_tail(self) -> str:
        """Why the first host other than host 0 failed after training succeeded, or ""."""
        for host in sorted(self.hosts.values(), key=lambda h: h.rank):
            done = host.done or {}
            if host.rank == 0 or host.lost or int(done.get("code", ExitCode.OK)) == ExitCode.OK:
                continue
            reason = (done.get("result") or {}).get("reason") or (
                f"its launcher exited with status {done.get('code')}"
            )
            return f"host {host.rank}: {reason}"
        return ""

    def _check_hosts(self) -> None:
        """Note hosts whose Ray node (and so actor) is gone: lost hosts, for the coordinator
        to recover from; nothing is restarted in their place but spares."""

        for host in list(self.hosts.values()):
            if host.rank != 0 and not host.lost and host.done is None:
                self._poll_host(host)

    def _poll_host(self, host: _Host) -> None:
        """Ask ``host``'s actor whether its launcher ended (``host.done``); an actor that died
        with its Ray node, or reports that node's raylet dead, marks the host lost."""
        import ray

        try:
            host.done = ray.get(host.actor.poll.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            self._lost(host)
            return
        # A removed node's actor can outlive its raylet by seconds, long enough to report
        # that its launcher (which watches the raylet) ended without a result.
        if host.done and host.done.get("node_lost"):
            self._lost(host)

    def _poll_or_lose(self, host: _Host) -> None:
        """``_poll_host``; a host whose actor cannot be reached (not its death: Ray's other
        errors) is lost as well."""
        import ray

        try:
            self._poll_host(host)
        except ray.exceptions.RayError as exc:
            self._lost(host, type(exc).__name__)

    def _lost(self, host: _Host, cause: str = "") -> None:
        host.lost = True
        log.warning(
            "host %d is lost with its Ray node %s%s",
            host.rank,
            host.node_id[:12],
            f" ({cause})" if cause else "",
        )

    def _start_problem(self) -> str:
        """Why the job cannot start, if a host that brings ranks ended before it did (the
        script missing on its node, say): host 0 would wait for its ranks until
        ``start_timeout``."""
        ended = [
            h
            for h in self.hosts.values()
            if h.role is HostRole.RANKS and h.done is not None and h.done["code"] != 0
        ]
        if not ended:
            return ""
        status = self._status()
        if status is None or status.state is not JobState.STARTING:
            return ""
        host = ended[0]
        code = host.done["code"] if host.done is not None else "?"
        return (
            f"host {host.rank} (Ray node {host.addr}) ended with exit status {code} before "
            "the job started; its log is above"
        )

    def _status(self) -> JobStatus | None:
        if self.rpc is None:
            return None
        try:
            return self.rpc.call(Status(), timeout=5.0)
        except PeerckptError:
            return None

    def _replenish(self) -> None:
        """Keep ``--spares`` spare nodes in reserve: a Ray node free for the job (one that
        joined the cluster, or was left over) becomes a spare host for every spare node that
        took ranks or was lost."""
        if not self.spec.spares:
            return
        status = self._status()
        if status is None or status.state is not JobState.RUNNING:
            return
        holding = {node for node, _ in status.ranks.values()}
        reserve = [
            h
            for h in self.hosts.values()
            if h.role is HostRole.SPARE and not h.lost and h.done is None and h.rank not in holding
        ]
        if len(reserve) >= self.spec.spares:
            return
        free = self._free_nodes()
        if not free:
            return
        host = self._place(free[0], HostRole.SPARE)
        log.info("Ray node %s (%s) joins as spare host %d", host.node_id[:12], host.addr, host.rank)
        self._launch(host)

    def stop(self) -> None:
        """Let every host end (they stop when the job ends), interrupt those that do not,
        kill every actor (their launchers take their processes down), disconnect."""
        import ray

        if not ray.is_initialized():
            return
        if self.rpc is not None:
            self.rpc.close()
            self.rpc = None
        hosts = [h for h in self.hosts.values() if not h.lost]
        if self._interrupted.is_set():
            for host in hosts:
                with contextlib.suppress(ray.exceptions.RayError):
                    host.actor.interrupt.remote()
        deadline = time.monotonic() + END_WAIT_S
        for host in hosts:
            # A host whose Ray node died after the driver's last look is found lost here, so
            # that every lost host is named even when the job ended within a second of it.
            while host.done is None and not host.lost and time.monotonic() < deadline:
                self._poll_or_lose(host)
                if host.done is None and not host.lost:
                    time.sleep(POLL_S)
            if host.done is None and not host.lost:
                with contextlib.suppress(ray.exceptions.RayError):
                    host.actor.interrupt.remote()
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                ray.kill(host.actor)
        if self._connected:
            ray.shutdown()
            self._connected = False

    def _result(self, outcome: JobOutcome, reason: str, wall_s: float) -> JobResult:
        """Host 0's result, with the faults every host fired; else how the driver saw it end."""
        fired = list(self.chaos.fired) if self.chaos is not None else []
        # The faults every host fired are in its own result (host 0's in ``report``).
        for host in self.hosts.values():
            if host.rank != 0:
                records = ((host.done or {}).get("result") or {}).get("chaos", [])
                fired += [FiredAction.from_json(c) for c in records]
        report = self._host0["result"] if self._host0 is not None else None
        if report is not None:
            result = JobResult.from_json(report)
            fired += result.chaos
            failed = self._failed_tail() if result.state is JobOutcome.SUCCEEDED else ""
            if failed:  # host 0's ranks finished the script; another host's did not
                result.state, result.exit_code, result.reason = (
                    JobOutcome.FAILED,
                    int(ExitCode.FAILED),
                    failed,
                )
        else:
            code = int(self._host0["code"]) if self._host0 is not None else outcome.exit_code
            if self._host0 is None and outcome is JobOutcome.INTERRUPTED:
                code = stopped_by(self._signal)[0]  # SIGTERM: 143
            result = JobResult(self.job, code, outcome, reason, [], [], wall_s)
        result.chaos = sorted(fired, key=lambda c: c.fired_at or float("inf"))
        return result

    def _unfired(self) -> list[str]:
        """Every host fails its own run when one of its actions never fired; the job's result
        is host 0's, so the others' (and the driver's) are carried over."""
        unfired = super()._unfired()
        for host in self.hosts.values():
            if host.rank != 0:
                unfired += ((host.done or {}).get("result") or {}).get("unfired", [])
        return unfired


def run(
    script: str,
    args: list[str] | None = None,
    *,
    address: str = "auto",
    nodes: int = 1,
    nproc_per_node: int = 1,
    spares: int = 0,
    **spec: Any,
) -> JobResult:
    """Run ``script`` (a path present on every Ray node) as a peerckpt job on the Ray cluster
    at ``address``: ``nodes`` Ray nodes of ``nproc_per_node`` ranks, ``spares`` spare nodes.
    Other keywords are :class:`JobSpec` fields (``replicas``, ``min_nodes``, ``chaos``,
    ``persist``, ``report``, ``job``, …). Returns host 0's :class:`JobResult`."""
    job = JobSpec(
        script=script,
        args=list(args or []),
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        spares=spares,
        **spec,
    )
    return RayLauncher(job, address).run()
