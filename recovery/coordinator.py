"""The coordinator: membership and its epoch, failure decisions, commits, recovery plans.

One per job. Agents register, stream events from ``Watch`` (membership, commit, shutdown),
send heartbeats and report what happens on their node: a process joined or was lost, a
snapshot was replicated, a rank resumed, finished or failed. The coordinator owns every
decision that must be the same everywhere; agents and ranks only carry them out.

Failure detection here: an agent's ``Watch`` stream closing (its process is gone) or its
heartbeats stopping (a hang or partition) loses the node; a rank process exiting is reported
at once by its agent. Either opens a new epoch in which spares replace the lost ranks and
everyone restores the last committed step.

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

from peerckpt.errors import ConfigurationError, RecoveryFailed, StaleEpoch
from peerckpt.recovery.membership import CommitTracker, Membership, RankAssignment
from peerckpt.recovery.plan import plan_sources
from peerckpt.replication.placement import RingPlacement

log = logging.getLogger("peerckpt.coordinator")


@dataclass
class AgentInfo:
    node: int
    data_addr: str
    spare_node: bool
    events: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    alive: bool = True
    last_heartbeat: float = field(default_factory=time.monotonic)


@dataclass
class ProcInfo:
    node: int
    pid: int
    role: str  # "rank" or "spare"
    rank: int | None
    alive: bool = True


class Coordinator:
    """The job's single source of truth. All handlers hold ``_lock`` while they decide."""

    def __init__(
        self,
        job: str,
        world_size: int,
        replicas: int | None,
        heartbeat_timeout: float = 5.0,
        store_addr: str = "",
    ) -> None:
        self.job = job
        self.world_size = world_size
        self.replicas = replicas
        self.heartbeat_timeout = heartbeat_timeout
        self.store_addr = store_addr
        self.placement = RingPlacement()
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
        # Replication failures to a buddy that looked alive: (deadline, epoch, step, message).
        self._stuck: list[tuple[float, int, int, str]] = []
        self.stopped = threading.Event()

    # -- registration ---------------------------------------------------------------------
    def register_agent(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            node = req["node"]
            self.agents[node] = AgentInfo(node, req["data_addr"], bool(req.get("spare_node")))
            log.info("agent of node %d registered (data %s)", node, req["data_addr"])
            return {"replicas": self.replicas, "heartbeat_timeout": self.heartbeat_timeout}

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
            if self.state in ("running", "starting"):
                self._lose_node(node, "its agent's connection to the coordinator closed")

    def heartbeat(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            agent = self.agents.get(req["node"])
            if agent is not None and agent.alive:
                agent.last_heartbeat = time.monotonic()
            return {"epoch": self.membership.epoch if self.membership else -1}

    def proc_joined(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            key = (req["node"], req["pid"])
            self.procs[key] = ProcInfo(req["node"], req["pid"], req["role"], req.get("rank"))
            if self.replicas is None and req.get("rank") == 0 and req.get("replicas") is not None:
                self.replicas = int(req["replicas"])  # the script's @resilient(replicas=…)
            log.info("%s pid %d joined on node %d", req["role"], req["pid"], req["node"])
            if self.state == "starting":
                self._maybe_open_first_epoch()
            return {}

    def _maybe_open_first_epoch(self) -> None:
        ranks = {
            p.rank: p
            for p in self.procs.values()
            if p.role == "rank" and p.alive and p.rank is not None
        }
        if set(ranks) != set(range(self.world_size)):
            return
        if self.replicas is None:
            self.replicas = 1
        assignments = {r: RankAssignment(r, p.node, p.pid) for r, p in ranks.items()}
        self._open_epoch(0, assignments, restore_step=None, sources={})
        self.state = "running"

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
        log.warning("node %d lost: %s", node, reason)
        if self.state == "starting":
            self._fail(f"node {node} was lost before the job started: {reason}")
            return
        self._recover(kind="node", ranks=lost, nodes={node}, reason=reason)

    def _recover(self, kind: str, ranks: set[int], nodes: set[int], reason: str) -> None:
        if self.state != "running" or self.membership is None or self.tracker is None:
            return
        now = time.time()
        old = self.membership
        event: dict[str, Any] = {
            "kind": kind,
            "ranks": sorted(ranks),
            "nodes": sorted(nodes),
            "reason": reason,
            "lost": {r: old.ranks[r].node for r in sorted(ranks)},
            "detected_at": now,
            "from_epoch": old.epoch,
            "pulls": [],
            "resumed_at": None,
        }
        self.events.append(event)
        spares = sorted(
            (
                p
                for p in self.procs.values()
                if p.role == "spare"
                and p.alive
                and self._member_rank(p) is None
                and self.agents[p.node].alive
            ),
            key=lambda p: (not self.agents[p.node].spare_node, p.node, p.pid),
        )
        if len(spares) < len(ranks):
            self._fail(
                f"lost rank(s) {sorted(ranks)} ({reason}) and only {len(spares)} spare(s) are "
                f"left; start the job with more --spares (shrinking the world needs elastic "
                "membership, which this job did not ask for)"
            )
            return
        assignments = dict(old.ranks)
        replacements = {}
        for rank, spare in zip(sorted(ranks), spares, strict=False):
            assignments[rank] = RankAssignment(rank, spare.node, spare.pid)
            spare.role, spare.rank = "rank", rank
            replacements[rank] = [spare.node, spare.pid]
        event["replacements"] = replacements
        restore = self.tracker.committed_step
        sources: dict[int, list[int]] = {}
        if restore is not None:
            holders = {r: set(h) for r, h in self.tracker.committed_holders.items()}
            try:
                sources = plan_sources(
                    {r: a.node for r, a in assignments.items()},
                    holders,
                    self.snapshot_bytes,
                    {r: a.node for r, a in old.ranks.items()},
                )
            except RecoveryFailed as exc:
                self._fail(str(exc))
                return
        event["restore_step"] = restore
        self._open_epoch(old.epoch + 1, assignments, restore, sources)
        event["epoch"] = old.epoch + 1

    def _open_epoch(
        self,
        epoch: int,
        assignments: dict[int, RankAssignment],
        restore_step: int | None,
        sources: dict[int, list[int]],
    ) -> None:
        rank_nodes = {r: a.node for r, a in assignments.items()}
        holders = self.tracker.committed_holders if self.tracker else {}
        self.membership = Membership(
            epoch=epoch,
            world_size=self.world_size,
            ranks=assignments,
            placement=self.placement.buddies(rank_nodes, self.replicas or 0),
            restore_step=restore_step,
            sources=sources,
            node_addrs={n: a.data_addr for n, a in self.agents.items() if a.alive},
            store_addr=self.store_addr,
        )
        self.tracker = CommitTracker(
            epoch=epoch,
            ranks=frozenset(assignments),
            committed_step=restore_step,
            committed_holders={r: set(h) for r, h in holders.items()},
        )
        self.done.clear()
        self.resumed.clear()
        log.info("epoch %d opened: restore step %s, ranks %s", epoch, restore_step, rank_nodes)
        self._broadcast(self.membership.to_msg())

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
            committed = self.tracker.record(req["epoch"], req["rank"], req["step"], req["holders"])
            if committed is not None:
                self._broadcast({"type": "commit", "epoch": req["epoch"], "step": committed})
            return {"committed": self.tracker.committed_step}

    def resumed_rank(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.membership is None or req["epoch"] != self.membership.epoch:
                raise StaleEpoch(f"resume report of epoch {req['epoch']} is stale")
            self.resumed.add(req["rank"])
            restore = req.get("restore")
            event = self.events[-1] if self.events else None
            if event is not None and event.get("epoch") == req["epoch"]:
                if restore:
                    event["pulls"].append({"rank": req["rank"], **restore})
                if self.resumed == set(self.membership.ranks):
                    event["resumed_at"] = time.time()
                    log.info(
                        "recovered: every rank stepping again %.3f s after detection",
                        event["resumed_at"] - event["detected_at"],
                    )
            if restore and restore.get("node") is not None and self.tracker is not None:
                self.tracker.add_holder(req["rank"], restore["node"])
            return {}

    def rank_done(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.membership is None or req["epoch"] != self.membership.epoch:
                return {}
            self.done.add(req["rank"])
            if self.done == set(self.membership.ranks) and self.state == "running":
                self.state = "succeeded"
                log.info("job succeeded in epoch %d", self.membership.epoch)
                self._broadcast({"type": "shutdown", "state": "succeeded", "reason": ""})
            return {}

    def rank_error(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.membership is not None and req["epoch"] < self.membership.epoch:
                log.info("ignoring an error of ended epoch %d: %s", req["epoch"], req["message"])
                return {}
            self._fail(f"rank {req['rank']} raised: {req['message']}")
            return {}

    def replication_failed(self, req: dict[str, Any]) -> dict[str, Any]:
        """A snapshot could not be mirrored to a buddy; the step cannot commit without it.

        If the buddy refused it (out of memory, checksums), the job fails now with that
        reason. If the buddy could not be reached, its node is probably gone and will be
        declared lost; should it still look alive after one heartbeat timeout while the step
        is still uncommitted, the job fails rather than wait forever.
        """
        with self._lock:
            if self.membership is None or req["epoch"] != self.membership.epoch:
                return {}
            message = (
                f"replicating rank {req['rank']}'s snapshot of step {req['step']} to node "
                f"{req['buddy']} failed: {req['message']}"
            )
            log.warning("%s", message)
            if req.get("fatal"):
                self._fail(message)
            else:
                deadline = time.monotonic() + self.heartbeat_timeout
                self._stuck.append((deadline, req["epoch"], req["step"], message))
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
                "committed_step": self.tracker.committed_step if self.tracker else None,
                "last_replicated": dict(self.tracker.last_replicated) if self.tracker else {},
                "ranks": {r: [a.node, a.pid] for r, a in m.ranks.items()} if m else {},
                "spares": [
                    [p.node, p.pid] for p in self.procs.values() if p.role == "spare" and p.alive
                ],
                "nodes": {n: a.alive for n, a in self.agents.items()},
                "events": self.events,
            }

    # -- liveness -------------------------------------------------------------------------
    def check_heartbeats(self) -> None:
        with self._lock:
            now = time.monotonic()
            for deadline, epoch, step, message in list(self._stuck):
                if (
                    self.membership is None
                    or epoch != self.membership.epoch
                    or (self.tracker is not None and (self.tracker.committed_step or -1) >= step)
                ):
                    self._stuck.remove((deadline, epoch, step, message))
                elif now > deadline:
                    self._fail(
                        f"{message}; the buddy still looks alive, so the step can never commit"
                    )
            for node, agent in list(self.agents.items()):
                if agent.alive and now - agent.last_heartbeat > self.heartbeat_timeout:
                    self._lose_node(
                        node,
                        f"no heartbeat for {now - agent.last_heartbeat:.1f} s "
                        f"(timeout {self.heartbeat_timeout} s)",
                    )

    def close(self) -> None:
        """End every agent's event stream (the process is stopping)."""
        with self._lock:
            for agent in self.agents.values():
                agent.events.put(None)

    def handlers(self) -> tuple[dict[str, Any], dict[str, Any]]:
        unary = {
            "RegisterAgent": self.register_agent,
            "Heartbeat": self.heartbeat,
            "ProcJoined": self.proc_joined,
            "ProcLost": self.proc_lost,
            "Replicated": self.replicated,
            "Resumed": self.resumed_rank,
            "Done": self.rank_done,
            "Error": self.rank_error,
            "ReplicationFailed": self.replication_failed,
            "Stop": self.stop,
            "Status": self.status,
        }
        return unary, {"Watch": self.watch}
