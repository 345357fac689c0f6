"""One host of a multi-host job: ``peerckpt run --nnodes N --node-rank I --rdzv-endpoint H:P``.

Every host runs the same command, as with torchrun (``srun peerckpt run …``, one pod per
host). Host ``--node-rank 0`` runs the job's coordinator, listening at the rendezvous endpoint
(``HOST:PORT`` must be an address of that host); every host runs its own agent, bound to its
``--node-addr``, and its ``--nproc-per-node`` processes:

- node ranks ``0 … N-1`` hold the job's ranks (rank = node rank × P + local rank);
- a host with ``--spare-host`` and a node rank ``≥ N`` holds P hot spares for the job;
- a host with a node rank ``≥ N`` and no ``--spare-host`` grows the job by P ranks, as
  ``peerckpt join`` does on one machine.

Nothing is shared between hosts but the network: each host has its own run directory, its
own shared-memory names (a run id of its own) and its own sockets. The job's secret reaches
every host from ``PEERCKPT_SECRET`` or a 0600 ``--secret-file``, never from a command line.

Every host's launcher watches the job through the coordinator and stops its own processes
when the job ends; each writes the job's report. If the coordinator's host dies, the next
host of the job's succession (``peerckpt/succession.py``) starts a coordinator at its own
address and the same port, which rebuilds the job from the agents' reports; the dead host's
nodes are then lost nodes, recovered as any others.

Chaos: each host causes its own faults. ``kill node=I`` given to host I's launcher fails that
host whole (every process of it, the launcher too, SIGKILL); ``add node`` starts one more
node on the host that runs the action; ``kill rank=R`` works on the host that holds rank R;
``kill coordinator`` on host 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, replace

import psutil

from peerckpt.chaos import ActionKind
from peerckpt.errors import ConfigurationError, PeerckptError
from peerckpt.launch.base import JobSpec
from peerckpt.launch.checks import check_host
from peerckpt.launch.gpus import visible_gpus
from peerckpt.launch.local import LocalLauncher
from peerckpt.messages.control import JobStatus, SparesStarting, Status
from peerckpt.rpc import RpcClient
from peerckpt.shm import sweep
from peerckpt.states import JobState, ProcRole
from peerckpt.succession import STEP_DOWN_WINDOW_S, join, split, succession, takeover_after

log = logging.getLogger("peerckpt.launcher")
COORDINATOR_LOST_S = 30.0  # how long a host waits for a silent coordinator before it gives up
PROBE_EVERY_S = 0.5  # how often a host asks the succession's endpoints while it is silent


@dataclass(frozen=True)
class HostSpec:
    """Where this host stands in a multi-host job."""

    nnodes: int
    node_rank: int
    rdzv_endpoint: str  # HOST:PORT, the coordinator's address (on node rank 0)
    node_addr: str  # the address this host's agent binds and announces
    spare_host: bool = False

    def __post_init__(self) -> None:
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(
                f"--rdzv-endpoint {self.rdzv_endpoint!r} must be HOST:PORT, an address of the "
                "host started with --node-rank 0 and a free port there"
            )
        if self.nnodes < 1 or self.node_rank < 0:
            raise ConfigurationError("--nnodes must be ≥ 1 and --node-rank ≥ 0")
        if self.spare_host and self.node_rank < self.nnodes:
            raise ConfigurationError(
                f"a --spare-host needs a node rank of its own beyond the job's nodes: "
                f"--node-rank {self.nnodes} or more (got {self.node_rank})"
            )

    @property
    def runs_coordinator(self) -> bool:
        return self.node_rank == 0

    @property
    def grows(self) -> bool:
        """A host beyond the job's nodes that brings ranks (not spares)."""
        return self.node_rank >= self.nnodes and not self.spare_host


class HostLauncher(LocalLauncher):
    """Runs this host's share of a multi-host job. ``run`` always cleans up this host."""

    # LocalLauncher's, restated: the type checker sees ``peerckpt.launch.local`` only as a
    # name it cannot follow (pyproject.toml maps the folders into the package).
    coordinator: subprocess.Popen[bytes] | None
    rpc: RpcClient | None

    def __init__(self, spec: JobSpec, host: HostSpec, secret: bytes) -> None:
        if spec.job is None:
            raise ConfigurationError(
                "a multi-host job needs --job NAME, the same on every host (it names the job "
                "in every message and authenticates with its secret)"
            )
        check_host(spec, host)
        super().__init__(
            replace(spec, nodes=host.nnodes),  # spares come from --spare-host hosts
            secret=secret,
            claim=host.runs_coordinator,
        )
        self.host = host
        # this host runs its own ranks only: they share its GPUs if they outnumber them
        gpus = visible_gpus({**os.environ, **spec.env})
        self.procs.share_gpus = 0 < gpus < spec.nproc_per_node
        if self.procs.share_gpus:
            log.info(
                "%d rank process(es) share %d GPU(s): each is an NCCL host of its own "
                "(NCCL_HOSTID; shared memory and P2P off: NCCL's socket transport)",
                spec.nproc_per_node,
                gpus,
            )
        try:
            self._check_chaos()
        except ConfigurationError:
            self.stop()  # nothing started yet: removes the run directory, frees the name
            raise
        self._silent_since: float | None = None
        self._next_probe = 0.0
        self._last_status: JobStatus | None = None
        # After taking the coordinator over: the endpoints before this host's in the
        # succession, and until when to look for one of them answering (then step down).
        self._earlier: list[str] = []
        self._step_down_until = 0.0

    def start(self) -> None:
        spec, procs, host = self.spec, self.procs, self.host
        if host.spare_host:
            procs.start_prefork()  # imports once for this host's spares
        if host.runs_coordinator:
            self._start_coordinator_at(host.rdzv_endpoint)
        else:
            self.address = host.rdzv_endpoint
            self.rpc = RpcClient(self.address, self._secret, self.job)
            self._await_coordinator()
        assert self.rpc is not None
        n = host.node_rank
        flags = self._agent_flags()
        if host.spare_host:
            flags.append("--spare-node")
        elif host.grows:
            flags += ["--joining", str(spec.nproc_per_node)]
        if host.spare_host:
            self.rpc.call(SparesStarting(spec.nproc_per_node, n))
        node = procs.start_agent(n, self.address, flags)
        procs.await_ready(node.agent, f"agent of node {n}")
        world = spec.world
        for local in range(spec.nproc_per_node):
            if host.spare_host:
                self._spares.append(procs.start_proc(n, ProcRole.SPARE, WORLD_SIZE=str(world)))
            elif host.grows:
                procs.start_proc(n, ProcRole.JOINER)
            else:
                rank = n * spec.nproc_per_node + local
                self._ranks[rank] = procs.start_proc(
                    n, ProcRole.RANK, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world)
                )
        self._spare_node = n if host.spare_host else -1
        self._write_job_file()
        role = "spares" if host.spare_host else "joining ranks" if host.grows else "ranks"
        log.info(
            "job %s: host %d (%s) holds %d %s; coordinator %s",
            self.job,
            n,
            host.node_addr,
            spec.nproc_per_node,
            role,
            self.address,
        )

    def _agent_flags(self) -> list[str]:
        return ["--host", self.host.node_addr]

    def _shape(self) -> tuple[int, int, int] | None:
        return None  # checked by ``_check_chaos``, which knows this host's node rank

    def _check_chaos(self) -> None:
        """A host's launcher causes only its own host's machine-level faults: say so before
        anything starts, not when the action comes due."""
        me = self.host.node_rank
        if self.chaos is None:
            return
        for action in self.chaos.actions:
            mine = action.of_rank is not None or action.target == me
            if action.kind in (ActionKind.KILL_NODE, ActionKind.KILL_AGENT) and not mine:
                raise ConfigurationError(
                    f"--chaos '{action.text}': this is host {me}; give it to the "
                    f"peerckpt run of host {action.target} (each host causes its own faults)"
                )
            if action.kind is ActionKind.KILL_COORDINATOR and not self.host.runs_coordinator:
                raise ConfigurationError(
                    f"--chaos '{action.text}': the coordinator runs on host 0; give it there"
                )
        # ranks and nodes the job cannot have (spare and growing hosts: by node rank only)
        self.chaos.check(max(self.spec.nodes, me + 1), self.spec.nproc_per_node, 0)

    # -- machine-level faults of this host (``Launcher``) ----------------------------------
    def kill_node(self, node: int) -> None:
        """``kill node=N`` on host N: the host fails whole, as a machine does. Every process
        this launcher started (the coordinator too, if it runs here) and the launcher itself
        are SIGKILLed; its shared memory and run directory go first, as they would with the
        machine. The other hosts recover the job."""
        if node != self.host.node_rank:
            log.error("chaos: node %d is not on this host; action skipped", node)
            return
        log.warning("chaos: host %d (%s) fails whole: SIGKILL", node, self.host.node_addr)
        tree = psutil.Process().children(recursive=True)
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(tree, timeout=10.0)
        sweep(self.job, self.run_id)
        shutil.rmtree(self.rundir, ignore_errors=True)
        if self._claim is not None:
            self._claim.release()
        os.kill(os.getpid(), signal.SIGKILL)

    def _await_coordinator(self) -> None:
        """Wait (up to the start timeout) until the coordinator on host 0 answers."""
        assert self.rpc is not None
        deadline = time.monotonic() + self.spec.start_timeout
        while True:
            try:
                self.rpc.call(Status(), timeout=2.0)
                return
            except PeerckptError as exc:
                if time.monotonic() > deadline or self._interrupted.is_set():
                    raise ConfigurationError(
                        f"no coordinator answered at --rdzv-endpoint {self.address} within "
                        f"{self.spec.start_timeout:.0f} s ({exc}); start the host with "
                        "--node-rank 0 there, with the same --job and secret"
                    ) from None
            time.sleep(0.2)

    def _coordinator_gone(self, state: JobState) -> bool:
        """Follow the coordinator where it moves, or move it here (``peerckpt/succession.py``);
        give up only when no host of the succession took the role."""
        if self.coordinator is not None:
            return False  # it runs here: a crashed one is restarted in place
        now = time.monotonic()
        if self._silent_since is None:
            self._silent_since = now
        silent = now - self._silent_since
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_EVERY_S
        last = self._last_status
        order = succession(self.address, last.node_addrs if last is not None else {})
        mine = join(self.host.node_addr, split(self.host.rdzv_endpoint)[1])
        position = order.index(mine) if mine in order else len(order)
        earlier = self._first_answering(order[1:position])
        if earlier is not None:
            self._follow(earlier)
            return False
        # A host whose agent is gone (the job ended, or the host is failing) holds no part
        # of the job to rebuild from: it takes nothing over.
        agent = self.procs.nodes[self.host.node_rank].agent
        if position < len(order) and agent.poll() is None and silent > takeover_after(position):
            self._take_over(mine, order[1:position])
            return False
        return silent > COORDINATOR_LOST_S + takeover_after(len(order))

    def _first_answering(self, addresses: list[str]) -> str | None:
        """The first of ``addresses`` where a coordinator of this job answers."""
        for address in addresses:
            rpc = RpcClient(address, self._secret, self.job)
            try:
                rpc.call(Status(), timeout=1.0)
                return address
            except PeerckptError:
                continue
            finally:
                rpc.close()
        return None

    def _follow(self, address: str) -> None:
        log.warning("the job's coordinator moved to %s", address)
        assert self.rpc is not None
        self.rpc.close()
        self.address = address
        self.rpc = RpcClient(address, self._secret, self.job)
        self._silent_since = None

    def _take_over(self, endpoint: str, earlier: list[str]) -> None:
        """Start the job's coordinator here: the agents register with it (it is next in the
        succession) and it rebuilds the job from what they report."""
        host, port = split(endpoint)
        log.warning(
            "the job's coordinator at %s has been silent for %.1f s: starting one at %s",
            self.address,
            time.monotonic() - (self._silent_since or time.monotonic()),
            endpoint,
        )
        if self._last_status is not None:
            self._earlier_events = self._all_events(self._last_status.events)
        self._restarts += 1
        assert self.rpc is not None
        self.rpc.close()
        self.rpc = None
        where = ["--host", host, "--port", str(port), "--store-port", str(port + 1)]
        self._start_coordinator([*where, "--moved-from", split(self.address)[0]], restart=True)
        self._silent_since = None
        self._earlier, self._step_down_until = earlier, time.monotonic() + STEP_DOWN_WINDOW_S

    def _step_down_if_earlier(self) -> None:
        """Two hosts took the coordinator over (the earlier one was slow to answer): the
        agents register with the earlier, so the later one stops its own and follows."""
        now = time.monotonic()
        if not self._earlier or now > self._step_down_until or now < self._next_probe:
            return
        self._next_probe = now + PROBE_EVERY_S
        earlier = self._first_answering(self._earlier)
        if earlier is None or self.coordinator is None:
            return
        log.warning("an earlier host of the succession runs the coordinator: stopping ours")
        self.coordinator.terminate()  # still among the processes that stop() reaps
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.coordinator.wait(timeout=5.0)
        self.coordinator, self._earlier = None, []
        self._restarts -= 1
        self._follow(earlier)

    def _observe(self, status: JobStatus) -> None:
        self._silent_since = None
        self._last_status = status
        super()._observe(status)
        self._step_down_if_earlier()

    def _replenish(self, status: JobStatus) -> None:
        """Spares are replenished by starting spare hosts, not by this host."""
