"""The agent: one process per node, owning the node's shared-memory arena and data links.

It serves its local rank processes over a Unix socket (slot allocation, snapshot notices,
restore instructions), checksums every snapshot and pushes it to the rank's buddies, keeps
replicas for other nodes, serves fetches during recoveries, and reports everything to the
coordinator. It never decides membership; it carries out the coordinator's epochs.

Order on an epoch change (a ``membership`` event from the coordinator):
1. fence: the agent's epoch becomes the new one, older pushes are refused;
2. tell local processes to ``abort`` (ranks drop their process group at once);
3. cancel replication in flight; wait for slot locks;
4. for each local rank of the new epoch, obtain its committed snapshot (own slot, local
   replica, or a fetch from the plan's sources, checksums verified) and send it ``epoch``.
That part lives in ``replication/recovering.py``, mixed in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from peerckpt import faults as fault_hooks
from peerckpt.errors import PeerckptError, PeerUnavailable, StaleEpoch
from peerckpt.faults import NO_FAULTS, FaultHooks
from peerckpt.manifest import META_KEY, ChunkRecord, SnapshotManifest
from peerckpt.membership import Membership
from peerckpt.replication.arena import Arena
from peerckpt.replication.control import ControlServer, ProcLink
from peerckpt.replication.recovering import RankRecovery
from peerckpt.replication.replicator import BuddySender, ReplicationJob
from peerckpt.replication.stats import NodeCounters, node_stats
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import Cancelled, DataServer
from peerckpt.replication.writer import Flusher
from peerckpt.rpc import RpcClient, is_stream_closed
from peerckpt.service import service_process, stop_on_signals

log = logging.getLogger("peerckpt.agent")
COORDINATOR_GRACE_S = 30.0  # how long an agent waits for a restarted coordinator


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class Agent(RankRecovery):
    """A node's agent. ``start`` it, then ``wait``; ``close`` always (it removes the arena)."""

    def __init__(
        self,
        job: str,
        node: int,
        secret: bytes,
        coordinator: str,
        socket_path: str,
        spare_node: bool = False,
        host: str = "127.0.0.1",
        joining: int = 0,
        faults: FaultHooks = NO_FAULTS,
    ) -> None:
        self.joining = joining
        self.faults = faults
        self.net = faults.net  # network fault hooks of this node's TCP links, if any
        self.job, self.node, self._secret = job, node, secret
        self.spare_node = spare_node
        self.arena = Arena(job, node)
        self.store = SlotStore(self.arena)
        self.rpc = RpcClient(coordinator, secret, job)
        self.epoch: int = -1
        self.gen = 0  # the layout generation of this epoch's snapshots
        self._reported_layouts: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.data = DataServer(
            self.store,
            secret,
            job,
            lambda: self.epoch,
            lambda: self.committed_step,
            host,
            net=self.net,
        )
        self.control = ControlServer(socket_path, secret, job, self._on_message, self._on_lost)
        self.membership: Membership | None = None
        self.committed_step: int | None = None
        self.stopping = threading.Event()
        self._ending = threading.Event()  # the job ended: process exits are expected now
        self._lock = threading.RLock()
        self._senders: dict[int, BuddySender] = {}
        self._restore_info: dict[tuple[int, int], Any] = {}
        self._wanted: dict[tuple[int, int, int], list[ChunkRecord]] = {}
        self._watch_call: Any = None
        self._exit_reason = "agent exit"  # what local processes are told when it closes
        # The last report of each kind per local rank, sent again to a restarted coordinator.
        self._resend: dict[tuple[str, int], tuple[str, dict[str, Any]]] = {}
        self._restarting: set[int] = set()  # pids that announced a restart in place
        self._threads: list[threading.Thread] = []
        self.flusher = Flusher(self.store, node, self._report)
        self.counters = NodeCounters()  # sent with every heartbeat (replication/stats.py)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.data.start()
        self.control.start()
        config = self.rpc.call(
            "RegisterAgent",
            node=self.node,
            data_addr=self.data.address,
            spare_node=self.spare_node,
            joining=self.joining,
        )
        self.heartbeat_timeout = float(config["heartbeat_timeout"])
        self.heartbeat_interval = max(0.05, min(0.5, self.heartbeat_timeout / 5))
        for target, name in ((self._watch, "watch"), (self._heartbeat, "heartbeat")):
            thread = threading.Thread(target=target, name=f"peerckpt-agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait(self) -> None:
        parent = os.getppid()
        while not self.stopping.wait(0.2):
            if os.getppid() != parent:
                log.warning("launcher is gone; agent of node %d stops", self.node)
                self.stopping.set()

    def close(self) -> None:
        """Stop everything this agent started and remove its arena, whatever state it is in."""
        self.stopping.set()
        self._ending.set()
        try:
            if self._watch_call is not None:
                self._watch_call.cancel()
            self.control.shutdown_links(
                {"type": "shutdown", "state": "stopped", "reason": self._exit_reason}
            )
            for sender in list(self._senders.values()):
                sender.stop()
            self.control.stop()
            self.data.stop()
            self.flusher.join(timeout=2.0)
            for thread in self._threads:
                thread.join(timeout=2.0)
            self.rpc.close()
            self.faults.close()
        finally:
            self.arena.destroy()

    # -- coordinator ----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.stopping.is_set() and self._follow():
            # The coordinator went away: it is restarted by the launcher, and rebuilds its
            # state from what every agent tells it when it registers again.
            if not self._rejoin(COORDINATOR_GRACE_S):
                break
        self.stopping.set()

    def _follow(self) -> bool:
        """Carry out the coordinator's events; True if its stream broke (it went away)."""
        try:
            self._watch_call = self.rpc.stream("Watch", node=self.node)
            for event in self._watch_call:
                if self.net is not None:  # a partition delays what the coordinator says
                    self.net.wait_healed(self.stopping)
                kind = event["type"]
                if kind == "membership":
                    self._on_membership(Membership.from_msg(event))
                elif kind == "commit":
                    self._on_commit(event["epoch"], event["step"])
                elif kind == "reads":
                    self._on_reads(event)
                elif kind == "flush":
                    self.flusher.start(event)
                elif kind == "shutdown":
                    self._on_shutdown(event)
                    return False
            if self.net is not None:  # the stream's end, too, arrives after the partition
                self.net.wait_healed(self.stopping)
            if not self.stopping.is_set():
                log.warning("the coordinator ended this node's event stream: declared lost")
                self._exit_reason = f"node {self.node} was declared lost by the coordinator"
        except Exception as exc:
            if self.stopping.is_set():
                return False
            if is_stream_closed(exc):
                log.warning("lost the coordinator's event stream: %s", _first_line(exc))
                self._exit_reason = f"node {self.node}'s agent lost the coordinator"
                return True
            log.exception("the coordinator's event stream failed")
            self._exit_reason = f"node {self.node}'s agent failed: {exc}"
        return False

    def _rejoin(self, grace_s: float) -> bool:
        """Register again with a restarted coordinator, telling it what this node knows."""
        log.warning("waiting up to %.0f s for the coordinator to come back", grace_s)
        deadline = time.monotonic() + grace_s
        while not self.stopping.wait(0.2):
            if time.monotonic() > deadline:
                log.error("the coordinator did not come back within %.0f s", grace_s)
                return False
            try:
                reply = self.rpc.call(
                    "RegisterAgent",
                    timeout=2.0,
                    node=self.node,
                    data_addr=self.data.address,
                    spare_node=self.spare_node,
                    rejoin=self._rejoin_state(),
                )
            except PeerckptError as exc:
                log.debug("coordinator not back yet: %s", exc)
                continue
            if reply.get("lost"):
                self._exit_reason = f"node {self.node} was declared lost by the coordinator"
                log.warning("the restarted coordinator counts this node as lost")
                return False
            log.warning("registered again with the restarted coordinator")
            self._reported_layouts.clear()  # the new coordinator needs every rank's layout
            for method, args in list(self._resend.values()):
                self._report(method, **args)
            return True
        return False

    def _rejoin_state(self) -> dict[str, Any]:
        """What a restarted coordinator rebuilds its state from: this node's view of the
        epoch, its live processes, and every complete snapshot copy it holds."""
        with self._lock:
            members, committed = self.membership, self.committed_step
        held = []
        layouts = {}
        for slot in self.store.all():
            manifest = slot.manifest
            if slot.kind == "staging" or manifest is None:
                continue
            held.append([slot.rank, manifest.step, slot.gen, manifest.used_bytes])
            if manifest.step == committed:
                layouts[slot.rank] = [c.to_msg() for c in manifest.chunks]
        procs = [
            [link.pid, link.role, link.rank, link.replicas, link.persist]
            for link in self.control.links()
        ]
        return {
            "membership": members.to_msg() if members is not None else None,
            "committed_step": committed,
            "held": held,
            "layouts": layouts,
            "procs": procs,
        }

    def _heartbeat(self) -> None:
        while not self.stopping.wait(self.heartbeat_interval):
            self._fence_silent()
            if self.net is not None and self.net.partitioned():
                continue  # cut off: the coordinator hears nothing from this node
            try:
                members = self.membership
                ranks = members.local_ranks(self.node) if members is not None else []
                stats = node_stats(self.store, self.counters, ranks)
                self.rpc.call(
                    "Heartbeat", timeout=2.0, node=self.node, epoch=self.epoch, stats=stats
                )
            except PeerckptError as exc:
                log.debug("heartbeat failed: %s", exc)

    def _fence_silent(self) -> None:
        """Declare lost, and fence, every local process silent for a heartbeat timeout."""
        if self._ending.is_set():
            return
        for link in self.control.silent(self.heartbeat_timeout):
            silent_s = time.monotonic() - link.last_seen
            reason = (
                f"{link.role} pid {link.pid} sent no heartbeat for {silent_s:.1f} s "
                f"(timeout {self.heartbeat_timeout:g} s): hung or stopped; it is fenced"
            )
            log.warning("%s", reason)
            self.control.fence(link, f"declared lost by node {self.node}'s agent: {reason}")
            self._report("ProcLost", pid=link.pid, reason=reason)

    def _report(self, method: str, **args: Any) -> None:
        if self.net is not None:
            self.net.wait_healed(self.stopping)
        try:
            self.rpc.call(method, node=self.node, **args)
        except PeerckptError as exc:
            log.warning("coordinator refused %s: %s", method, exc)
        except ValueError as exc:  # grpc: the channel was closed because the agent is exiting
            log.debug("could not report %s: %s", method, exc)

    def _on_shutdown(self, event: dict[str, Any]) -> None:
        log.info("job ends (%s); stopping local processes", event["state"])
        self._ending.set()
        self.control.shutdown_links(event, wait_s=10.0)
        self.stopping.set()

    # -- rank processes -------------------------------------------------------------------
    def _on_lost(self, link: ProcLink) -> None:
        if link.fenced is not None:
            log.info("fenced %r exited", link)
        elif not self.stopping.is_set() and not self._ending.is_set():
            how = "restarted in place" if link.pid in self._restarting else "exited"
            log.warning("%s pid %d on node %d %s", link.role, link.pid, self.node, how)
            self._report("ProcLost", pid=link.pid, reason=f"process {link.pid} {how}")

    def _on_message(self, link: ProcLink, msg: dict[str, Any]) -> dict[str, Any] | None:
        kind = msg["type"]
        if kind == "hello":
            self._report(
                "ProcJoined",
                pid=link.pid,
                role=link.role,
                rank=link.rank,
                replicas=link.replicas,
                persist=link.persist,
            )
            return None
        if kind == "alloc":
            return self._alloc(msg)
        if kind == "restarting":
            # Stuck in an aborted epoch: it exits and the launcher starts a fresh process on
            # this node. Counted as a starting spare first, so that the recovery its exit
            # causes waits for that process instead of shrinking the world.
            log.warning("%s pid %d restarts in place: %s", link.role, link.pid, msg["reason"])
            self._restarting.add(link.pid)
            self._report("SparesStarting", count=1)
            return {}
        if kind == "snapshot":
            self._replicate(msg)
            return None
        if kind == "resumed":
            info = self._restore_info.pop((msg["epoch"], msg["rank"]), None)
            self._report("Resumed", epoch=msg["epoch"], rank=msg["rank"], restore=info)
            return None
        if kind == "done":
            self._resend[("Done", msg["rank"])] = (
                "Done",
                {"epoch": msg["epoch"], "rank": msg["rank"]},
            )
            self._report("Done", epoch=msg["epoch"], rank=msg["rank"])
            return None
        if kind == "error":
            self._report("Error", epoch=msg["epoch"], rank=msg["rank"], message=msg["message"])
            return None
        if kind == "wants":
            self._wanted[(msg["epoch"], msg["rank"], msg["round"])] = [
                ChunkRecord.from_msg(c) for c in msg["body"]
            ]
            self._report(
                "Wants",
                epoch=msg["epoch"],
                round=msg["round"],
                rank=msg["rank"],
                chunks=msg["body"],
            )
            return None
        if kind == "release":
            self.store.release_where(
                lambda s: s.kind == "staging" and s.rank == msg["rank"] and s.index == msg["round"]
            )
            return None
        raise PeerckptError(f"unknown request {kind!r} from pid {link.pid}")

    def _alloc(self, msg: dict[str, Any]) -> dict[str, Any]:
        rank, index = msg["rank"], msg["slot"]
        slot = self.store.get("own", self.gen, rank, index)
        if slot is not None and slot.step is not None and slot.step == self.committed_step:
            raise PeerckptError(
                f"rank {rank} asked to rewrite slot {index}, which holds committed step "
                f"{slot.step}; a snapshot must go to the other slot"
            )
        slot = self.store.ensure("own", self.gen, rank, index, msg["nbytes"])
        with slot.lock:  # a flush reading the slot finishes its chunk, then sees it changed
            slot.invalidate()
        return {"path": slot.segment.path, "size": slot.segment.size}

    def _replicate(self, msg: dict[str, Any]) -> None:
        epoch, rank = msg["epoch"], msg["rank"]
        with self._lock:
            members = self.membership
            if members is None or epoch != self.epoch:
                return  # a snapshot of an ended epoch: never replicated, never committed
        slot = self.store.get("own", members.gen, rank, msg["slot"])
        if slot is None:
            return
        manifest = SnapshotManifest.from_msg(msg["body"])
        manifest.validate_bounds(slot.segment.size)
        self.counters.snapshot(epoch, rank, manifest.step, manifest.used_bytes)
        buddies = members.placement.get(rank, [])
        with slot.lock:
            job = ReplicationJob.start(epoch, slot, manifest, buddies)
        with self._lock:
            if epoch != self.epoch:
                return  # the epoch ended meanwhile; its snapshot must not count
        if not buddies:
            self._replicated(job)
            return
        for buddy in buddies:
            self._sender(buddy).submit(job)

    def _sender(self, node: int) -> BuddySender:
        with self._lock:
            sender = self._senders.get(node)
            addr = self.membership.node_addrs[node] if self.membership else ""
            if sender is None or sender.address != addr:
                if sender is not None:
                    sender.stop()
                sender = BuddySender(
                    node,
                    addr,
                    self._secret,
                    self.job,
                    lambda: self.epoch,
                    lambda: self.committed_step,
                    self._sent,
                    retry_s=2 * self.heartbeat_timeout,
                    local_node=self.node,
                    faults=self.faults,
                )
                self._senders[node] = sender
            return sender

    def _sent(self, job: ReplicationJob, node: int, error: BaseException | None) -> None:
        with job.lock:
            if job.failed:
                return
            if error is not None:
                job.failed = True
        if error is not None:
            if not isinstance(error, (Cancelled, StaleEpoch)) and job.epoch == self.epoch:
                # The coordinator decides: a lost buddy opens a new epoch anyway; a live
                # buddy that refuses (memory, checksums) fails the job with its reason.
                self._report(
                    "ReplicationFailed",
                    epoch=job.epoch,
                    rank=job.slot.rank,
                    step=job.manifest.step,
                    buddy=node,
                    message=f"{type(error).__name__}: {error}",
                    fatal=not isinstance(error, (PeerUnavailable, OSError)),
                )
            return
        self.counters.replicated(job.manifest.used_bytes)
        with job.lock:
            job.acked.append(node)
            if len(job.acked) < len(job.buddies):
                return
        self._replicated(job)

    def _replicated(self, job: ReplicationJob) -> None:
        # The tensor layout travels on an epoch's first report and when it changes (the
        # coordinator needs it to plan a resharding); the blob's size, which changes almost
        # every step, travels as a number.
        manifest = job.checksummed()
        tensors = [c for c in manifest.chunks if c.key != META_KEY]
        signature = tuple((c.key, c.global_shape, c.offsets, c.lengths) for c in tensors)
        key = (job.epoch, job.slot.rank)
        layout = None
        if self._reported_layouts.get(key) != signature:
            layout = [c.to_msg() for c in manifest.chunks]
        report = {
            "epoch": job.epoch,
            "rank": job.slot.rank,
            "step": manifest.step,
            "holders": [self.node, *job.acked],
            "nbytes": manifest.used_bytes,
            "meta_nbytes": manifest.meta().nbytes,
            "digest": manifest.state_digest(),
        }
        # Sent again, layout and all, to a restarted coordinator (it may have missed it).
        self._resend[("Replicated", job.slot.rank)] = (
            "Replicated",
            {**report, "layout": [c.to_msg() for c in manifest.chunks]},
        )
        self._report("Replicated", **report, layout=layout)
        self._reported_layouts[key] = signature

    def _on_commit(self, epoch: int, step: int) -> None:
        if epoch != self.epoch or self.membership is None:
            return
        self.committed_step = step
        members = self.membership
        for rank in members.local_ranks(self.node):
            link = self.control.link_of(members.ranks[rank].pid)
            if link is not None:
                link.send({"type": "commit", "epoch": epoch, "step": step})
        self._collect_garbage(members)

    def _collect_garbage(self, members: Membership) -> None:
        """Free slots this node no longer needs once a step of the current epoch committed."""
        local = set(members.local_ranks(self.node))
        mirrored = {r for r, buddies in members.placement.items() if self.node in buddies}
        freed = self.store.release_where(
            lambda s: (
                s.gen != members.gen  # a step of this layout is committed now
                or s.kind == "staging"  # restores of this epoch are long done
                or (s.kind == "own" and s.rank not in local)
                or (s.kind == "replica" and s.rank not in mirrored)
            )
        )
        if freed:
            log.info("freed %d slot(s) no longer in this node's placement", len(freed))


def main(argv: list[str] | None = None) -> int:
    """Run one node's agent; print one READY line with its data address on stdout."""
    parser = argparse.ArgumentParser(prog="python -m peerckpt.replication.agent")
    parser.add_argument("--job", required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--spare-node", action="store_true")
    parser.add_argument(
        "--joining", type=int, default=0, help="ranks this node adds to a running job"
    )
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    secret = service_process(f"agent node={args.node}")
    # Before any connection exists: network faults apply to every TCP link of the node.
    faults = fault_hooks.load(args.node, network=True)
    agent = Agent(
        args.job,
        args.node,
        secret,
        args.coordinator,
        args.socket,
        args.spare_node,
        args.host,
        joining=args.joining,
        faults=faults,
    )
    stop_on_signals(agent.stopping.set)
    try:
        agent.start()
        print("READY " + json.dumps({"data_addr": agent.data.address}), flush=True)
        agent.wait()
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
