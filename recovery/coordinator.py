"""The coordinator: membership and its epoch, failure decisions, commits, recovery plans.

One per job. Agents register, stream events from ``Watch`` (membership, commit, shutdown),
send heartbeats and report what happens on their node: a process joined or was lost, a
snapshot was replicated, a rank resumed, finished or failed. The coordinator owns every
decision that must be the same everywhere; agents and ranks only carry them out.

Failure detection here: an agent's ``Watch`` stream closing (its process is gone) or its
heartbeats stopping (a hang or partition) loses the node; a rank process exiting is reported
at once by its agent. Either opens a new epoch in which spares replace the lost ranks (or,
with none left, the world shrinks) and everyone restores the last committed step.

How an epoch is opened — replacement, shrink, grow — is in ``recovery/epochs.py``, mixed in.

It also hosts the job's torch.distributed TCPStore; every epoch's process group uses its own
prefix in it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from peerckpt.errors import CheckpointError, ConfigurationError, RecoveryFailed, StaleEpoch
from peerckpt.membership import Membership
from peerckpt.persist.config import PersistConfig
from peerckpt.reads import STORAGE
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.elastic import ReshardRounds
from peerckpt.recovery.epochs import DeferredRecovery, EpochChanges
from peerckpt.recovery.flushes import FlushScheduler
from peerckpt.recovery.liveness import Liveness
from peerckpt.recovery.observed import observed
from peerckpt.recovery.placement import Placement, RingPlacement

log = logging.getLogger("peerckpt.coordinator")
REBUILD_WAIT_FACTOR = 2.0  # a restarted coordinator waits this many heartbeat timeouts for agents


@dataclass
class AgentInfo:
    node: int
    data_addr: str
    spare_node: bool
    joining: int = 0  # ranks this node brings to a running job (``peerckpt join``)
    events: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    alive: bool = True
    last_heartbeat: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)  # its last heartbeat's, for observers


@dataclass
class ProcInfo:
    node: int
    pid: int
    role: str  # "rank" or "spare"
    rank: int | None
    alive: bool = True


class Coordinator(EpochChanges, Liveness):
    """The job's single source of truth. All handlers hold ``_lock`` while they decide."""

    def __init__(
        self,
        job: str,
        world_size: int,
        replicas: int | None,
        heartbeat_timeout: float = 5.0,
        store_addr: str = "",
        min_nodes: int | None = None,
        persist: PersistConfig | None = None,
        spares: int = 0,
        placement: Placement | None = None,
        digests_file: str | None = None,
    ) -> None:
        # Every distinct tensor digest of every rank's snapshot of every step, appended as
        # "rank step digest" lines (the chaos campaign compares them with a fault-free run).
        # A file, not memory: a restarted coordinator appends to what the last one wrote.
        self._digests_file = (
            open(digests_file, "a", buffering=1)  # noqa: SIM115 (open as long as we run)
            if digests_file
            else None
        )
        self._digests_seen: set[tuple[int, int, str]] = set()
        self.min_nodes = min_nodes  # None: the world never shrinks
        self.spares_started = spares  # started by the launcher; each joins once it has warmed up
        self.spares_joined = 0
        self._deferred: DeferredRecovery | None = None
        # Durable checkpoints: from `peerckpt run --persist`, else from the script's decorator.
        self.flusher = FlushScheduler(persist) if persist is not None else None
        self._finishing_since = 0.0
        self.job = job
        self.world_size = world_size
        self.replicas = replicas
        self.heartbeat_timeout = heartbeat_timeout
        self.store_addr = store_addr
        self.placement: Placement = placement or RingPlacement()
        self._lock = threading.RLock()
        self.agents: dict[int, AgentInfo] = {}
        self.procs: dict[tuple[int, int], ProcInfo] = {}
        self.membership: Membership | None = None
        self.tracker: CommitTracker | None = None
        self.state = "starting"
        self.reason = ""
        self.events: list[dict[str, Any]] = []
        self.done: set[int] = set()
        self.resumed: set[int] = set()
        self.snapshot_bytes: dict[int, int] = {}
        self.rounds = ReshardRounds()
        self._reserved: set[int] = set()  # node indexes handed out to joining nodes
        # Replication failures to a buddy that looked alive: (deadline, epoch, step, message).
        self._stuck: list[tuple[float, int, int, int, str]] = []
        self.stopped = threading.Event()
        self.rebuilt = False  # restarted: state rebuilt from the agents' reports
        self._rebuild_deadline: float | None = None  # until then, agents may still come back
        self._rebuild_lost: set[int] = set()  # ranks found gone while rebuilding

    # -- registration ---------------------------------------------------------------------
    def register_agent(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            node = req["node"]
            config = {"replicas": self.replicas, "heartbeat_timeout": self.heartbeat_timeout}
            known = self.agents.get(node)
            if req.get("rejoin") is not None and known is not None and not known.alive:
                return {**config, "lost": True}  # declared lost while we were away
            self.agents[node] = AgentInfo(
                node, req["data_addr"], bool(req.get("spare_node")), int(req.get("joining", 0))
            )
            log.info("agent of node %d registered (data %s)", node, req["data_addr"])
            if req.get("rejoin") is not None:
                self._adopt(node, req["rejoin"])
            return config

    def _adopt(self, node: int, state: dict[str, Any]) -> None:
        """Rebuild this (restarted) coordinator's state from what node ``node``'s agent knows:
        the epoch it is in, its live processes and the snapshot copies it holds. The first
        agent to come back brings the membership; every agent adds its processes and copies.
        Nodes of the membership whose agent has not come back yet are kept as alive until a
        heartbeat timeout says otherwise; ranks whose process is gone are recovered at once."""
        msg = state.get("membership")
        if msg is not None and (self.membership is None or msg["epoch"] > self.membership.epoch):
            m = Membership.from_msg(msg)
            log.warning("rebuilding from the agents: epoch %d, %d ranks", m.epoch, len(m.ranks))
            self.membership, self.world_size = m, m.world_size
            self.tracker = CommitTracker(m.epoch, frozenset(m.ranks), gen=m.gen)
            for n, addr in m.node_addrs.items():
                if n not in self.agents:  # not back yet: alive until its heartbeats say not
                    self.agents[n] = AgentInfo(n, addr, spare_node=False)
            for rank, a in m.ranks.items():
                self.procs.setdefault((a.node, a.pid), ProcInfo(a.node, a.pid, "rank", rank))
            self.state = "running"
            self.rebuilt = True
        committed = state.get("committed_step")
        tracker = self.tracker
        if tracker is not None and committed is not None:
            if tracker.committed_step is None or committed > tracker.committed_step:
                tracker.committed_step = committed
                tracker.committed_holders = {}
            if committed == tracker.committed_step:
                for rank, step, gen, used in state.get("held", []):
                    if step == committed:
                        tracker.committed_gen = gen
                        tracker.committed_holders.setdefault(rank, set()).add(node)
                        self.snapshot_bytes[rank] = used
                for rank, layout in state.get("layouts", {}).items():
                    tracker.committed_layouts[int(rank)] = layout
                    tracker.set_layout(int(rank), layout)
        alive = set()
        for pid, role, rank, replicas, persist in state.get("procs", []):
            alive.add(pid)
            if (node, pid) not in self.procs:
                self.procs[(node, pid)] = ProcInfo(node, pid, role, rank)
                if role == "spare":
                    self.spares_joined += 1
                    self.spares_started = max(self.spares_started, self.spares_joined)
            if rank == 0 and role == "rank":
                self._config_from_script(replicas, persist)
        if self.state == "starting":
            self._maybe_open_first_epoch()  # it went away before the first epoch opened
        if self.membership is not None:
            for rank, a in self.membership.ranks.items():
                if a.node == node and a.pid not in alive:
                    self.procs[(a.node, a.pid)].alive = False
                    self._rebuild_lost.add(rank)
        if self._rebuild_deadline is None:
            # Agents come back one by one; the spares' node may be the last. Nobody is
            # declared lost by heartbeat meanwhile, and losses found are recovered together
            # once the others had their time to return.
            self._rebuild_deadline = time.monotonic() + REBUILD_WAIT_FACTOR * self.heartbeat_timeout

    def _end_rebuild(self) -> None:
        """The agents had their time to come back: recover what was lost while we were away."""
        self._rebuild_deadline = None
        lost, self._rebuild_lost = self._rebuild_lost, set()
        if lost:
            self._recover(
                kind="rank",
                ranks=lost,
                nodes=set(),
                reason="its process exited while the coordinator was down",
            )

    def watch(self, req: dict[str, Any], context: grpc.ServicerContext) -> Any:
        node = req["node"]
        with self._lock:
            agent = self.agents.get(node)
            if agent is None:
                raise ConfigurationError(f"node {node} watched before registering")
            events = agent.events
            if self.membership is not None:
                events.put(self.membership.to_msg())
        context.add_callback(lambda: self._watch_closed(node, events))
        while True:
            event = events.get()
            if event is None:
                return
            yield event

    def _watch_closed(self, node: int, events: queue.Queue[dict[str, Any] | None]) -> None:
        events.put(None)
        with self._lock:
            agent = self.agents.get(node)
            if agent is None or agent.events is not events or not agent.alive:
                return
            if self.state in ("running", "starting", "finishing"):
                self._lose_node(node, "its agent's connection to the coordinator closed")

    def allocate_node(self, req: dict[str, Any]) -> dict[str, Any]:
        """A free node index for a node about to join (``peerckpt join``, chaos ``add node``)."""
        with self._lock:
            node = max([*self.agents, *self._reserved, -1]) + 1
            self._reserved.add(node)
            return {"node": node}

    def spares_starting(self, req: dict[str, Any]) -> dict[str, Any]:
        """The launcher started ``count`` more spares (they join once warmed up)."""
        with self._lock:
            self.spares_started += int(req["count"])
            return {}

    def heartbeat(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            agent = self.agents.get(req["node"])
            if agent is not None and agent.alive:
                agent.last_heartbeat = time.monotonic()
                agent.stats = req.get("stats") or agent.stats
            return {"epoch": self.membership.epoch if self.membership else -1}

    def proc_joined(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            key = (req["node"], req["pid"])
            self.procs[key] = ProcInfo(req["node"], req["pid"], req["role"], req.get("rank"))
            if req.get("rank") == 0:
                self._config_from_script(req.get("replicas"), req.get("persist"))
            log.info("%s pid %d joined on node %d", req["role"], req["pid"], req["node"])
            if req["role"] == "spare":
                self.spares_joined += 1
            if self.state == "starting":
                self._maybe_open_first_epoch()
            self._maybe_grow()
            if req["role"] == "spare":
                self._retry_deferred()
            return {}

    def _config_from_script(self, replicas: int | None, persist: Any) -> None:
        """Rank 0's @resilient(replicas=…, persist=…), unless the launcher set them."""
        if self.replicas is None and replicas is not None:
            self.replicas = int(replicas)
        if self.flusher is None:
            config = PersistConfig.from_msg(persist)
            self.flusher = FlushScheduler(config) if config is not None else None

    # -- failures -------------------------------------------------------------------------
    def proc_lost(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            proc = self.procs.get((req["node"], req["pid"]))
            if proc is None or not proc.alive:
                return {}
            proc.alive = False
            member = self._member_rank(proc)
            if member is None:
                log.info("spare pid %d on node %d is gone", proc.pid, proc.node)
                return {}
            self._recover(
                kind="rank", ranks={member}, nodes=set(), reason=req.get("reason", "exited")
            )
            return {}

    def _member_rank(self, proc: ProcInfo) -> int | None:
        if self.membership is None:
            return proc.rank if proc.role == "rank" else None
        for rank, a in self.membership.ranks.items():
            if (a.node, a.pid) == (proc.node, proc.pid):
                return rank
        return None

    def _lose_node(self, node: int, reason: str) -> None:
        agent = self.agents[node]
        agent.alive = False
        agent.events.put(None)
        lost = set()
        for proc in self.procs.values():
            if proc.node == node and proc.alive:
                proc.alive = False
                rank = self._member_rank(proc)
                if rank is not None:
                    lost.add(rank)
        if self.tracker is not None:
            self.tracker.forget_node(node)
        if self.flusher is not None:
            self.flusher.node_lost(node)
        log.warning("node %d lost: %s", node, reason)
        if self.state == "starting":
            self._fail(f"node {node} was lost before the job started: {reason}")
            return
        self._recover(kind="node", ranks=lost, nodes={node}, reason=reason)

    def _broadcast(self, event: dict[str, Any]) -> None:
        for agent in self.agents.values():
            if agent.alive:
                agent.events.put(event)

    def _fail(self, reason: str) -> None:
        if self.state in ("failed", "succeeded", "stopped"):
            return
        log.error("job failed: %s", reason)
        self.state, self.reason = "failed", reason
        self._broadcast({"type": "shutdown", "state": "failed", "reason": reason})

    # -- progress -------------------------------------------------------------------------
    def replicated(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.tracker is None:
                raise StaleEpoch("no epoch is open yet")
            self.snapshot_bytes[req["rank"]] = req["nbytes"]
            committed = self.tracker.record(
                req["epoch"],
                req["rank"],
                req["step"],
                req["holders"],
                req.get("layout"),
                req.get("meta_nbytes"),
            )
            key = (req["rank"], req["step"], req.get("digest", ""))
            if self._digests_file is not None and key[2] and key not in self._digests_seen:
                self._digests_seen.add(key)
                self._digests_file.write(f"{key[0]} {key[1]} {key[2]}\n")
            if committed is not None:
                self._broadcast({"type": "commit", "epoch": req["epoch"], "step": committed})
                self._maybe_flush(committed)
            return {"committed": self.tracker.committed_step}

    def _maybe_flush(self, step: int) -> None:
        if self.flusher is None or self.tracker is None or not self.flusher.due(step):
            return
        try:
            events = self.flusher.start(
                step,
                self.tracker.epoch,
                self.tracker.committed_gen,
                self.tracker.committed_layouts,
                {r: h - {STORAGE} for r, h in self.tracker.committed_holders.items()},
            )
        except CheckpointError as exc:
            log.warning("step %d cannot be flushed: %s", step, exc)
            return
        for node, event in events.items():
            self.agents[node].events.put(event)

    def flushed(self, req: dict[str, Any]) -> dict[str, Any]:
        """A writer finished its share of a flush (or failed)."""
        with self._lock:
            if self.flusher is not None:
                self.flusher.written(req)
            return {}

    def wants(self, req: dict[str, Any]) -> dict[str, Any]:
        """A resharding rank's boxes for one round; the last one in triggers the plan."""
        with self._lock:
            m, tracker = self.membership, self.tracker
            if m is None or tracker is None or req["epoch"] != m.epoch or m.mode != "reshard":
                raise StaleEpoch(f"wants of epoch {req['epoch']} are stale")
            try:
                by_node = self.rounds.add(m, tracker, req["round"], req["rank"], req["chunks"])
            except RecoveryFailed as exc:
                event = self.events[-1] if self.events else {}
                if event.get("epoch") != m.epoch or not self._storage_fallback(
                    event, dict(m.ranks), str(exc), dict(m.previous)
                ):
                    self._fail(str(exc))
                return {}
            if by_node is not None:
                for node, reads in by_node.items():
                    agent = self.agents.get(node)
                    if agent is not None and agent.alive:
                        agent.events.put(
                            {
                                "type": "reads",
                                "epoch": m.epoch,
                                "round": req["round"],
                                "reads": reads,
                            }
                        )
            return {}

    def resumed_rank(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.membership is None or req["epoch"] != self.membership.epoch:
                raise StaleEpoch(f"resume report of epoch {req['epoch']} is stale")
            self.resumed.add(req["rank"])
            restore = req.get("restore")
            event = self.events[-1] if self.events else None
            if event is not None and event.get("epoch") == req["epoch"]:
                for pull in restore if isinstance(restore, list) else [restore] if restore else []:
                    event["pulls"].append({"rank": req["rank"], **pull})
                if self.resumed == set(self.membership.ranks):
                    event["resumed_at"] = time.time()
                    log.info(
                        "recovered: every rank stepping again %.3f s after detection",
                        event["resumed_at"] - event["detected_at"],
                    )
            if isinstance(restore, dict) and restore.get("node") is not None and self.tracker:
                self.tracker.add_holder(req["rank"], restore["node"])
            return {}

    def rank_done(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.membership is None or req["epoch"] != self.membership.epoch:
                return {}
            self.done.add(req["rank"])
            if self.done == set(self.membership.ranks) and self.state == "running":
                if self.flusher is not None and self.flusher.busy():
                    # Let the flush in progress finish: it is the newest durable checkpoint.
                    self.state, self._finishing_since = "finishing", time.monotonic()
                    log.info("every rank is done; waiting for the flush in progress")
                    self.flusher.on_settled = self._finish
                    return {}
                self._finish()
            return {}

    def _finish(self) -> None:
        with self._lock:
            if self.state not in ("running", "finishing") or self.membership is None:
                return
            self.state = "succeeded"
            log.info("job succeeded in epoch %d", self.membership.epoch)
            self._broadcast({"type": "shutdown", "state": "succeeded", "reason": ""})

    def rank_error(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            m = self.membership
            if m is not None and req["epoch"] < m.epoch:
                log.info("ignoring an error of ended epoch %d: %s", req["epoch"], req["message"])
                return {}
            event = self.events[-1] if self.events else {}
            if (
                m is not None
                and req["message"].startswith("RecoveryFailed")
                and event.get("epoch") == m.epoch
                and self._storage_fallback(
                    event, dict(m.ranks), req["message"], dict(m.previous), partial=False
                )
            ):
                return {}  # every memory copy of a rank failed its checksum: storage has one
            self._fail(f"rank {req['rank']} raised: {req['message']}")
            return {}

    def stop(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.state in ("starting", "running"):
                self.state, self.reason = "stopped", req.get("reason", "stopped by the launcher")
            self._broadcast({"type": "shutdown", "state": self.state, "reason": self.reason})
            return {}

    def status(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            m = self.membership
            return {
                "job": self.job,
                "state": self.state,
                "reason": self.reason,
                "epoch": m.epoch if m else -1,
                "world_size": self.world_size,
                "min_nodes": self.min_nodes,
                "committed_step": self.tracker.committed_step if self.tracker else None,
                "last_replicated": dict(self.tracker.last_replicated) if self.tracker else {},
                "ranks": {r: [a.node, a.pid] for r, a in m.ranks.items()} if m else {},
                "spares": [
                    [p.node, p.pid] for p in self.procs.values() if p.role == "spare" and p.alive
                ],
                "nodes": {n: a.alive for n, a in self.agents.items()},
                "events": self.events,
                "flushes": self.flusher.records() if self.flusher else [],
                "flush_skipped": list(self.flusher.skipped) if self.flusher else [],
                **observed(self),
            }

    def close(self) -> None:
        """End every agent's event stream (the process is stopping)."""
        with self._lock:
            for agent in self.agents.values():
                agent.events.put(None)
        if self.flusher is not None:
            self.flusher.join()
        if self._digests_file is not None:
            self._digests_file.close()

    def handlers(self) -> tuple[dict[str, Any], dict[str, Any]]:
        unary = {
            "RegisterAgent": self.register_agent,
            "Heartbeat": self.heartbeat,
            "SparesStarting": self.spares_starting,
            "ProcJoined": self.proc_joined,
            "ProcLost": self.proc_lost,
            "Replicated": self.replicated,
            "Resumed": self.resumed_rank,
            "Done": self.rank_done,
            "Error": self.rank_error,
            "ReplicationFailed": self.replication_failed,
            "Wants": self.wants,
            "AllocateNode": self.allocate_node,
            "Flushed": self.flushed,
            "Stop": self.stop,
            "Status": self.status,
        }
        return unary, {"Watch": self.watch}
