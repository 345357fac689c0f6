"""The coordinator: membership and its epoch, failure decisions, commits, recovery plans.

One per job. Agents register, stream events from ``Watch`` (a new epoch, a commit, a
resharding round's reads, a flush, the end) and report what happens on their node in typed
messages (``peerckpt/messages/control.py``): a process joined or was lost, a snapshot was
replicated, a rank resumed, finished or failed. The coordinator owns every decision that
must be the same everywhere; agents and ranks only carry them out.

It is built from parts, each owning one concern, and this class routes messages to them
through one dispatch table (``handlers``), holding ``_lock`` while a part decides:

- ``Registry`` (``registry.py``): agents and processes;
- ``Settings``, ``JobLife``, ``Spares`` (``job.py``): the job's settings and state;
- ``Epochs`` (``epochs.py``): the membership and its changes, decided by the pure functions
  of ``decide.py``, with the durable tier as the holder of last resort (``fallback.py``);
- ``CommitTracker`` (``commits.py``, held by ``Epochs``): commits;
- ``FlushScheduler`` (``flushes.py``): durable flushes;
- ``Clocks`` (``liveness.py``): heartbeats and every other deadline;
- ``rebuild.adopt``: a restarted coordinator's state, from what the agents tell it.

This module is the one place every message of the coordinator arrives (one short handler
each, ~480 lines): split further, a reader would lose the table of what it answers.

Failure detection here: an agent's ``Watch`` stream closing (its process is gone) or its
heartbeats stopping (a hang or partition) loses the node; a rank process exiting is reported
at once by its agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from peerckpt.errors import (
    CheckpointError,
    ConfigurationError,
    NotReshardable,
    RecoveryFailed,
    StaleEpoch,
    StorageUnusable,
)
from peerckpt.messages import Dispatch
from peerckpt.messages.control import (
    AgentConfig,
    AllocateNode,
    Commit,
    Done,
    Flushed,
    Heartbeat,
    HeartbeatReply,
    Inexact,
    JobStatus,
    NodeAllocated,
    Ok,
    ProcJoined,
    ProcLost,
    RankFailed,
    Reads,
    RegisterAgent,
    Replicated,
    ReplicatedMany,
    ReplicatedReply,
    ReplicationFailed,
    Resumed,
    Shutdown,
    SparesStarting,
    Status,
    Stop,
    Unreshardable,
    Wants,
    Watch,
)
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.location import check_scheme, check_writable
from peerckpt.reads import STORAGE
from peerckpt.recovery import rebuild, unreshardable
from peerckpt.recovery.decide import Loss
from peerckpt.recovery.dedupwatch import DedupWatch
from peerckpt.recovery.epochs import Epochs
from peerckpt.recovery.erasure import script_erasure
from peerckpt.recovery.flushes import FlushScheduler
from peerckpt.recovery.job import JobLife, Settings, Spares
from peerckpt.recovery.liveness import Clocks
from peerckpt.recovery.observed import observed
from peerckpt.recovery.placement import Placement, RingPlacement
from peerckpt.recovery.registry import AgentInfo, Registry
from peerckpt.states import EpochMode, JobState, ProcRole, RecoveryKind

log = logging.getLogger("peerckpt.coordinator")
MAX_INEXACT = 32  # audit findings kept for the report (each line once; a job has a few)


class Coordinator:
    """The job's single source of truth. All handlers hold ``_lock`` while they decide."""

    # Handlers that run on the RPC server's event loop: all but those that may plan a
    # recovery, read storage or build the whole job's status (those run on a thread).
    # Handing the frequent ones to threads cost more than it saved: every handler takes
    # ``_lock``, and a thread holding it made the loop wait for the lock and the GIL in turn
    # (with 1,000 nodes joining at once, calls ran past their deadlines). A process joining
    # is cheap but for the last rank's, which opens epoch 0 once (a plan; with a durable
    # tier, a read of its latest manifest): the loop waits for it, as every handler would.
    INLINE = frozenset(
        {
            RegisterAgent,
            Heartbeat,
            AllocateNode,
            SparesStarting,
            ProcJoined,
            Replicated,
            ReplicatedMany,
            Resumed,
            Done,
            Flushed,
        }
    )

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
        restart_based: bool = False,
        moved_from: str | None = None,
        max_restarts: int = 0,
        stall_timeout: float | None = None,
    ) -> None:
        """``max_restarts``: how many times a rank lost on a live node may be restarted in
        place over the job (``peerckpt run --max-restarts``); 0, the default here, for a
        launcher that does not carry restarts out (``JobStatus.in_place``)."""
        self._lock = threading.RLock()
        self.settings = Settings(
            job,
            world_size,
            replicas,
            heartbeat_timeout,
            store_addr,
            min_nodes,
            placement or RingPlacement(),
            restart_based,
            max_restarts,
            stall_timeout,
        )
        self.registry = Registry()
        self.life = JobLife(self.registry)
        self.spares = Spares(started=spares)  # each joins once it has warmed up
        # Durable checkpoints: from `peerckpt run --persist`, else from the script's decorator.
        self.flusher = self._durable_tier(persist, probe=False)
        self._ending = (JobState.SUCCEEDED, "")  # how the job ends once its last flush settles
        self.epochs = Epochs(
            self.settings,
            self.registry,
            self.life,
            self.spares,
            lambda: self.flusher.config if self.flusher is not None else None,
        )
        self.clocks = Clocks(heartbeat_timeout)
        self._twins = DedupWatch(self.registry.send)  # redundancy-aware replication's follow-up
        self.rebuilt_epoch: int | None = None  # restarted: the epoch rebuilt from the agents
        self.rebuild_lost: set[int] = set()  # ranks found gone while rebuilding
        self.rebuild_digests: dict[int, str] = {}  # rank → twin digest of its committed copies
        # Moved here because the coordinator's host died (``peerckpt/succession.py``): the
        # nodes on that host are not waited for, the rebuild ends once all others are back.
        self.moved_from = moved_from
        self.rebuild_back: set[int] = set()  # nodes that registered again since the restart
        self.stopped = threading.Event()
        # Every distinct tensor digest of every rank's snapshot of every step, appended as
        # JSON lines {rank, step, digest, tensors: {key: digest}} (the chaos campaign
        # compares them with a fault-free run, and names the first tensor that differs).
        # A file, not memory: a restarted coordinator appends to what the last one wrote.
        self._digests_file = (
            open(digests_file, "a", buffering=1)  # noqa: SIM115 (open as long as we run)
            if digests_file
            else None
        )
        self._digests_seen: set[tuple[int, int, str]] = set()
        self.commits = 0  # steps committed since this coordinator started (``Status``)
        self.inexact_found: list[str] = []  # the ranks' audit findings (``Inexact``)

    # -- registration ---------------------------------------------------------------------
    def register_agent(self, msg: RegisterAgent) -> AgentConfig:
        with self._lock:
            s = self.settings
            known = self.registry.agents.get(msg.node)
            if msg.rejoin is not None and known is not None and not known.alive:
                return AgentConfig(s.replicas, s.heartbeat_timeout, lost=True)
            self.registry.add_agent(
                AgentInfo(
                    msg.node, msg.data_addr, msg.spare_node, msg.joining, grew=msg.joining > 0
                )
            )
            log.info("agent of node %d registered (data %s)", msg.node, msg.data_addr)
            if msg.rejoin is not None:
                self.rebuild_back.add(msg.node)
                rebuild.adopt(self, msg.node, msg.rejoin)
            return AgentConfig(
                s.replicas,
                s.heartbeat_timeout,
                record_digests=self._digests_file is not None,
                stall_timeout=s.stall_timeout,
            )

    async def watch(self, msg: Watch, context: Any) -> AsyncIterator[bytes]:
        """Node ``msg.node``'s events, packed, as they come (the RPC server's event loop)."""
        with self._lock:
            agent = self.registry.agents.get(msg.node)
            if agent is None:
                raise ConfigurationError(f"node {msg.node} watched before registering")
            events = agent.events
            for event in rebuild.catch_up(self):
                events.put(event)
        try:
            async for data in events.stream():
                yield data
        finally:  # it ended, or its agent went away: decide off the loop (a recovery may plan)
            try:
                closed = asyncio.get_running_loop().run_in_executor(
                    None, self._watch_closed, msg.node, agent
                )
                closed.add_done_callback(_log_failure)
            except RuntimeError:  # the server is stopping: its thread pool is shut down
                self._watch_closed(msg.node, agent)

    def _watch_closed(self, node: int, agent: AgentInfo) -> None:
        agent.events.put(None)
        with self._lock:
            if self.registry.agents.get(node) is not agent or not agent.alive:
                return
            if self.life.state in (JobState.RUNNING, JobState.STARTING, JobState.FINISHING):
                self.lose_node(node, "its agent's connection to the coordinator closed")

    def allocate_node(self, msg: AllocateNode) -> NodeAllocated:
        with self._lock:
            # A node of spares only keeps the world's size: never refused. Should it register
            # with ranks to add after all, ``maybe_grow`` still refuses them.
            refused = None if msg.spares_only else unreshardable.join_refusal(self.settings)
            if refused is not None:
                raise NotReshardable(refused)
            return NodeAllocated(self.registry.allocate_node())

    def cannot_reshard(self, msg: Unreshardable) -> Ok:
        """Rank 0 tracks state that cannot reshard: the world may no longer change size."""
        with self._lock:
            refused = unreshardable.record(self.settings, msg.objects)
            if refused is not None:
                self.life.fail(refused)
            return Ok()

    def inexact(self, msg: Inexact) -> Ok:
        """A rank's audit found what a restore cannot reproduce: kept, each line once, for
        the job's report (``JobStatus.inexact``)."""
        with self._lock:
            for line in msg.findings:
                if line not in self.inexact_found and len(self.inexact_found) < MAX_INEXACT:
                    self.inexact_found.append(line)
            return Ok()

    def spares_starting(self, msg: SparesStarting) -> Ok:
        with self._lock:
            self.spares.started += msg.count
            return Ok()

    def heartbeat(self, msg: Heartbeat) -> HeartbeatReply:
        # Recorded before taking the lock: a heartbeat counts when it arrives, also while the
        # lock is held by a long step (a cold start reading a slow object store), which would
        # otherwise make every node look silent to the liveness check that runs after it.
        self._heard_from(msg.node)
        agent = self.registry.agents.get(msg.node)
        if agent is not None and agent.alive and msg.stats is not None:
            agent.stats = msg.stats
        with self._lock:
            m = self.epochs.membership
            return HeartbeatReply(m.epoch if m else -1)

    def _heard_from(self, node: int) -> None:
        """Node ``node``'s agent is alive: a heart-beat, or a report that stands for one.
        Needs no lock (one attribute written), so a heartbeat counts while the lock is held."""
        agent = self.registry.agents.get(node)
        if agent is not None and agent.alive:
            agent.last_heartbeat = time.monotonic()

    def proc_joined(self, msg: ProcJoined) -> Ok:
        with self._lock:
            p = msg.proc
            self.registry.add_proc(msg.node, p.pid, p.role, p.rank)
            if p.rank == 0:
                self.config_from_script(p.replicas, p.persist)
                script_erasure(self.settings, p.erasure)  # @resilient(erasure=…)
            log.info("%s pid %d joined on node %d", p.role.value, p.pid, msg.node)
            if p.role is ProcRole.SPARE:
                self.spares.joined += 1
            if self.life.state is JobState.STARTING:
                self.epochs.open_first()
            self.epochs.maybe_grow()
            if p.role is ProcRole.SPARE:
                self.epochs.spare_joined(msg.node)
                self.epochs.retry_deferred()
            return Ok()

    def config_from_script(self, replicas: int | None, persist: dict[str, Any] | None) -> None:
        """Rank 0's @resilient(replicas=…, persist=…), unless the launcher set them."""
        if self.settings.replicas is None and replicas is not None:
            self.settings.replicas = int(replicas)
        if self.flusher is None:
            self.flusher = self._durable_tier(PersistConfig.from_msg(persist), probe=True)

    def _durable_tier(self, config: PersistConfig | None, probe: bool) -> FlushScheduler | None:
        """The flush scheduler of ``config``, if its location can work; else the job fails
        now, naming the URL and the fix (it hung at the first epoch's cold-start read, or
        failed every flush). ``probe``: write a probe file too; a launcher probed its own
        ``--persist`` before it started anything, a script's URL is first seen here."""
        if config is None:
            return None
        try:
            if probe:
                check_writable(config.url, config.mode)
            else:
                check_scheme(config.url)
        except StorageUnusable as exc:
            self.life.fail(str(exc))
            return None
        return FlushScheduler(config)

    # -- failures -------------------------------------------------------------------------
    def proc_lost(self, msg: ProcLost) -> Ok:
        with self._lock:
            proc = self.registry.procs.get((msg.node, msg.pid))
            if proc is None or not proc.alive:
                return Ok()
            proc.alive = False
            member = self.registry.member_rank(proc, self.epochs.membership)
            if member is None:
                log.info("%s pid %d on node %d is gone", proc.role.value, proc.pid, proc.node)
                return Ok()
            restarted = frozenset({member}) if msg.in_place else frozenset()
            self.epochs.recover(
                Loss(
                    RecoveryKind.RANK,
                    frozenset({member}),
                    frozenset(),
                    msg.reason,
                    time.time(),
                    restarted=restarted,
                )
            )
            return Ok()

    def lose_node(self, node: int, reason: str) -> None:
        """Declare node ``node`` lost, with every process on it."""
        lost = self.registry.lose_node(node, self.epochs.membership)
        if node in self.epochs.refused_joins:  # never a member: nothing to recover
            log.info("node %d, refused as it joined, is gone", node)
            return
        if self.epochs.tracker is not None:
            self.epochs.tracker.forget_node(node)
        if self.flusher is not None:
            self.flusher.node_lost(node)
        log.warning("node %d lost: %s", node, reason)
        if self.life.state is JobState.STARTING:
            self.life.fail(f"node {node} was lost before the job started: {reason}")
            return
        self.epochs.recover(
            Loss(RecoveryKind.NODE, frozenset(lost), frozenset({node}), reason, time.time())
        )

    def replication_failed(self, msg: ReplicationFailed) -> Ok:
        """A snapshot could not be mirrored to a buddy; the step cannot commit without it.

        If the buddy refused it (out of memory, checksums), the job fails now with that
        reason. If the buddy could not be reached, its node is probably gone and will be
        declared lost; should it still look alive after one heartbeat timeout while the step
        is still uncommitted, the job fails rather than wait forever.
        """
        with self._lock:
            m = self.epochs.membership
            if m is None or msg.epoch != m.epoch:
                return Ok()
            message = (
                f"replicating rank {msg.rank}'s snapshot of step {msg.step} to node "
                f"{msg.buddy} failed: {msg.message}"
            )
            log.warning("%s", message)
            buddy = self.registry.agents.get(msg.buddy)
            if buddy is not None and not buddy.alive:
                return Ok()  # already declared lost: its recovery (perhaps waiting) handles it
            if msg.fatal:
                self.life.fail(message)
            else:
                self.clocks.replication_stuck(
                    time.monotonic(), msg.epoch, msg.step, msg.buddy, message
                )
            return Ok()

    def check_heartbeats(self) -> None:
        """Act on every deadline that passed (the server loop calls it a few times a second)."""
        with self._lock:
            d = self.epochs.deferred
            expired = self.clocks.expired(
                time.monotonic(),
                self.life.state,
                self.registry,
                self.epochs.membership,
                self.epochs.tracker,
                d.deadline if d is not None else None,
            )
            if expired.finish:
                log.warning("the last flush did not finish in time; ending anyway")
                self._finish()
            if expired.rebuild:
                self._end_rebuild()
            if expired.spare_wait:
                self.epochs.retry_deferred(force=True)
            for reason in expired.failures:
                self.life.fail(reason)
            for node, silent_s in expired.silent.items():
                if self.registry.agents[node].alive:
                    self.lose_node(
                        node,
                        f"no heartbeat for {silent_s:.1f} s "
                        f"(timeout {self.settings.heartbeat_timeout} s)",
                    )
            if expired.rebuild:  # after the losses: an epoch they opened forms its own group
                rebuild.regroup_unformed(self)

    def _end_rebuild(self) -> None:
        """The agents had their time to come back: recover what was lost while we were away."""
        lost, self.rebuild_lost = self.rebuild_lost, set()
        m = self.epochs.membership
        if self.moved_from is not None and m is not None:
            for node in sorted(rebuild.on_host(m.node_addrs, self.moved_from) - self.rebuild_back):
                if self.registry.agents[node].alive:
                    self.lose_node(
                        node, f"its host {self.moved_from} died with the job's coordinator"
                    )
        if lost:
            reason = "its process exited while the coordinator was down"
            self.epochs.recover(
                Loss(RecoveryKind.RANK, frozenset(lost), frozenset(), reason, time.time())
            )

    # -- progress -------------------------------------------------------------------------
    def replicated(self, msg: Replicated) -> ReplicatedReply:
        with self._lock:
            tracker = self.epochs.tracker
            if tracker is None:
                raise StaleEpoch("no epoch is open yet")
            self._heard_from(msg.node)  # the agent skips heart-beats while it reports
            self.epochs.snapshot_bytes[msg.rank] = msg.nbytes
            committed = tracker.record(
                msg.epoch,
                msg.rank,
                msg.step,
                msg.holders,
                msg.layout if msg.columns is None else msg.columns,
                msg.meta_nbytes,
                twins=msg.twins,
                partial=msg.partial,
                absent=msg.absent,
            )
            if tracker.layouts_owed:
                log.warning(
                    "step %d is replicated by every rank but not committed: rank(s) %s owe "
                    "their chunk layout (a report was lost; it comes with their next one)",
                    msg.step,
                    tracker.layouts_owed,
                )
            self._twins.reported(msg, tracker, committed)
            key = (msg.rank, msg.step, msg.digest)
            if self._digests_file is not None and msg.digest and key not in self._digests_seen:
                self._digests_seen.add(key)
                record = {"rank": msg.rank, "step": msg.step, "digest": msg.digest}
                self._digests_file.write(json.dumps({**record, "tensors": msg.tensors}) + "\n")
            if committed is not None:
                self.commits += 1
                largest = max(self.epochs.snapshot_bytes.values(), default=0)
                self.registry.broadcast(Commit(msg.epoch, committed, largest))
                self._maybe_flush(committed)
            return ReplicatedReply(tracker.committed_step)

    def replicated_many(self, msg: ReplicatedMany) -> ReplicatedReply:
        """Reports that were ready together on one node, each as ``replicated``; a stale one
        is refused (after the others count), as it would have been alone."""
        refused: StaleEpoch | None = None
        reply = ReplicatedReply(None)
        with self._lock:
            for report in msg.reports:
                try:
                    reply = self.replicated(report)
                except StaleEpoch as exc:
                    refused = refused or exc
        if refused is not None:
            raise refused
        return reply

    def _maybe_flush(self, step: int) -> None:
        if self.flusher is not None and self.epochs.tracker is not None and self.flusher.due(step):
            self._start_flush(step)

    def _start_flush(self, step: int) -> bool:
        """Send committed ``step``'s writers their shares; False if it cannot be flushed."""
        tracker = self.epochs.tracker
        if self.flusher is None or tracker is None:
            return False
        try:
            events = self.flusher.start(
                step,
                tracker.epoch,
                tracker.committed_gen,
                tracker.committed_layouts,
                {r: h - {STORAGE} for r, h in tracker.committed_holders.items()},
            )
        except CheckpointError as exc:
            log.warning("step %d cannot be flushed: %s", step, exc)
            return False
        for node, event in events.items():
            self.registry.send(node, event)
        return True

    def flushed(self, msg: Flushed) -> Ok:
        """A writer finished its share of a flush (or failed)."""
        with self._lock:
            if self.flusher is not None:
                self.flusher.written(msg)
            return Ok()

    def wants(self, msg: Wants) -> Ok:
        """A resharding rank's boxes for one round; the last one in triggers the plan."""
        with self._lock:
            epochs = self.epochs
            m, tracker = epochs.membership, epochs.tracker
            if (
                m is None
                or tracker is None
                or msg.epoch != m.epoch
                or m.mode is not EpochMode.RESHARD
            ):
                raise StaleEpoch(f"wants of epoch {msg.epoch} are stale")
            try:
                wants = msg.chunks if msg.columns is None else msg.columns
                by_node = epochs.rounds.add(m, tracker, msg.round, msg.rank, wants)
            except RecoveryFailed as exc:
                if not epochs.storage_fallback_now(str(exc), partial=True):
                    self.life.fail(str(exc))
                return Ok()
            for node, reads in (by_node or {}).items():
                self.registry.send(node, Reads(m.epoch, msg.round, reads))
            return Ok()

    def resumed_rank(self, msg: Resumed) -> Ok:
        with self._lock:
            self.epochs.rank_resumed(msg.epoch, msg.rank, msg.pulls, msg.holds_committed, msg.node)
            return Ok()

    def rank_done(self, msg: Done) -> Ok:
        with self._lock:
            m = self.epochs.membership
            if m is None or msg.epoch != m.epoch:
                return Ok()
            self.epochs.done.add(msg.rank)
            if self.epochs.done == set(m.ranks) and self.life.state is JobState.RUNNING:
                self._end_after_flush(JobState.SUCCEEDED, "")
            return Ok()

    def _end_after_flush(self, state: JobState, reason: str) -> None:
        """End the job as ``state`` once its last committed step is durable (with a durable
        tier; at most ``FINISH_FLUSH_S``): the flush in progress first, then that step's."""
        self._ending = (state, reason)
        if self.flusher is None:
            self._finish()
            return
        self.life.become(JobState.FINISHING)
        self.clocks.finishing_since = time.monotonic()
        self.flusher.on_settled = self._flush_last
        self._flush_last()

    def _flush_last(self) -> None:
        """The job is ending: flush its last committed step unless that was done or tried,
        once no flush is running; then end it."""
        with self._lock:
            flusher, tracker = self.flusher, self.epochs.tracker
            if self.life.state is not JobState.FINISHING or flusher is None:
                return
            if flusher.busy() or flusher.draining():
                assert flusher.current is not None
                log.info(
                    "the job is ending; waiting for the flush of step %d", flusher.current.step
                )
                return
            step = tracker.committed_step if tracker is not None else None
            # A step read from storage (a cold start that trained nothing after it) is there.
            stored = tracker is not None and any(
                STORAGE in h for h in tracker.committed_holders.values()
            )
            if step is not None and not stored and flusher.owed(step) and self._start_flush(step):
                log.info("the job is ending; flushing its last committed step, %d", step)
                return
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            m = self.epochs.membership
            if self.life.state not in (JobState.RUNNING, JobState.FINISHING) or m is None:
                return
            state, reason = self._ending
            failure = self.flusher.failure() if self.flusher is not None else ""
            if failure and state is JobState.SUCCEEDED:
                self.life.fail(failure)  # a run that protected nothing durably did not succeed
                return
            if failure:
                log.warning("%s", failure)
            if state is JobState.SUCCEEDED:
                log.info("job succeeded in epoch %d", m.epoch)
            self.life.end(state, reason)

    def rank_failed(self, msg: RankFailed) -> Ok:
        with self._lock:
            m = self.epochs.membership
            if m is not None and msg.epoch < m.epoch:
                log.info("ignoring an error of ended epoch %d: %s", msg.epoch, msg.message)
                return Ok()
            # Every memory copy of a rank failed its checksum: storage may hold one.
            if msg.error == RecoveryFailed.__name__ and self.epochs.storage_fallback_now(
                msg.message, partial=False
            ):
                return Ok()
            failure = f"rank {msg.rank} raised: {msg.error}: {msg.message}"
            if msg.unreachable and m is not None and msg.epoch == m.epoch:
                log.warning(
                    "%s; failing the job unless a loss supersedes epoch %d", failure, m.epoch
                )
                self.clocks.hold_failure(time.monotonic(), msg.epoch, failure)
                return Ok()
            self.life.fail(failure)
            return Ok()

    def stop(self, msg: Stop) -> Ok:
        with self._lock:
            if msg.flush and self.life.state is JobState.RUNNING and self.flusher is not None:
                log.info("stopping (%s) once the last committed step is durable", msg.reason)
                self._end_after_flush(JobState.STOPPED, msg.reason)
            elif msg.flush and self.life.state is JobState.FINISHING:
                pass  # the last flush is under way, and ends the job
            elif not self.life.state.ended:
                self.life.end(JobState.STOPPED, msg.reason)
            else:  # tell agents that may have missed it
                self.registry.broadcast(Shutdown(self.life.state, self.life.reason))
            return Ok()

    def status(self, msg: Status) -> JobStatus:
        with self._lock:
            m, tracker = self.epochs.membership, self.epochs.tracker
            return JobStatus(
                job=self.settings.job,
                state=self.life.state,
                reason=self.life.reason,
                epoch=m.epoch if m else -1,
                world_size=self.settings.world_size,
                min_nodes=self.settings.min_nodes,
                committed_step=tracker.committed_step if tracker else None,
                last_replicated=dict(tracker.last_replicated) if tracker else {},
                ranks={r: [a.node, a.pid] for r, a in m.ranks.items()} if m else {},
                spares=[
                    [p.node, p.pid]
                    for p in self.registry.procs.values()
                    if p.role is ProcRole.SPARE and p.alive
                ],
                nodes={n: a.alive for n, a in self.registry.agents.items()},
                events=list(self.epochs.events),
                flushes=self.flusher.records() if self.flusher else [],
                flush_skipped=list(self.flusher.skipped) if self.flusher else [],
                in_place={r: [n, pid] for r, (n, pid) in self.epochs.in_place.items()},
                **observed(self),
            )

    def close(self) -> None:
        """End every agent's event stream (the process is stopping)."""
        with self._lock:
            for agent in self.registry.agents.values():
                agent.events.put(None)
        if self.flusher is not None:
            self.flusher.join()
        if self._digests_file is not None:
            self._digests_file.close()

    def handlers(self) -> tuple[Dispatch[Any], dict[type[Any], Any]]:
        """The dispatch table of unary calls, and the server streams."""
        unary = Dispatch[Any](
            {
                RegisterAgent: self.register_agent,
                Heartbeat: self.heartbeat,
                SparesStarting: self.spares_starting,
                ProcJoined: self.proc_joined,
                ProcLost: self.proc_lost,
                Replicated: self.replicated,
                ReplicatedMany: self.replicated_many,
                Resumed: self.resumed_rank,
                Done: self.rank_done,
                Unreshardable: self.cannot_reshard,
                Inexact: self.inexact,
                RankFailed: self.rank_failed,
                ReplicationFailed: self.replication_failed,
                Wants: self.wants,
                AllocateNode: self.allocate_node,
                Flushed: self.flushed,
                Stop: self.stop,
                Status: self.status,
            },
            "the coordinator",
        )
        return unary, {Watch: self.watch}


def _log_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("handling a closed event stream failed", exc_info=done.exception())
