"""The agent: one process per node, owning the node's shared-memory arena and data links.

It serves its local rank processes over a Unix socket (slot allocation, snapshot notices,
restore instructions), checksums every snapshot and pushes it to the rank's buddies, keeps
replicas for other nodes, serves fetches during recoveries, and reports everything to the
coordinator. It never decides membership; it carries out the coordinator's epochs.

Order on an epoch change (an ``EpochOpened`` event from the coordinator):
1. fence: the agent's epoch becomes the new one, older pushes are refused;
2. tell local processes to ``Abort`` (ranks drop their process group at once);
3. cancel replication in flight;
4. for each local rank of the new epoch, obtain its committed snapshot (own slot, local
   replica, or a fetch from the plan's sources, checksums verified) and send it
   ``EpochStart`` (``replication/recovering.py``).

Its parts: ``ControlServer`` (rank links), ``DataServer`` (peer agents), a ``BuddySender``
per buddy node (replication), ``Preparer`` (epoch changes), ``Flusher`` (durable writes),
``CoordinatorLink`` (reports, and their replay to a restarted coordinator). Messages from
the coordinator and from ranks go through one dispatch table each.

Its length (~470 lines) is the two dispatch tables and one short handler per message; each
handler only forwards to the part that owns the work, so splitting it would scatter the
table of what an agent answers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from peerckpt import faults as fault_hooks
from peerckpt.columns import ChunkColumns
from peerckpt.errors import PeerckptError
from peerckpt.faults import NO_FAULTS, FaultHooks
from peerckpt.manifest import ChunkRecord
from peerckpt.membership import Membership
from peerckpt.messages import Dispatch, Message
from peerckpt.messages.control import (
    Commit,
    Done,
    EpochOpened,
    Flush,
    Heartbeat,
    HeldCopy,
    Inexact,
    ProcJoined,
    ProcLost,
    ProcReport,
    RankFailed,
    Reads,
    RegisterAgent,
    RejoinState,
    ReplicateWhole,
    Resumed,
    Shutdown,
    SparesStarting,
    Unreshardable,
    Wants,
)
from peerckpt.messages.local import (
    STACK_SIGNAL,
    Abort,
    AllocSlot,
    Granted,
    InexactState,
    ProcSettings,
    RankDone,
    RankError,
    RankResumed,
    ReleaseStaging,
    Restarting,
    SlotGranted,
    SnapshotTaken,
    ToAgent,
    UnreshardableState,
    WantChunks,
)
from peerckpt.names import RUN_ENV
from peerckpt.pidwatch import ProcessWatch
from peerckpt.replication import nccl
from peerckpt.replication.arena import Arena
from peerckpt.replication.busy import BusyWatch, cpu_seconds
from peerckpt.replication.control import ControlServer, ProcLink
from peerckpt.replication.coordlink import CoordinatorLink
from peerckpt.replication.dedup import twin_digest
from peerckpt.replication.devicepull import DevicePulls
from peerckpt.replication.mirroring import Mirroring
from peerckpt.replication.recovering import Preparer
from peerckpt.replication.spares import SpareSlots
from peerckpt.replication.stall import StallWatch
from peerckpt.replication.stats import node_stats
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import DataServer
from peerckpt.replication.transport import ENV as TRANSPORT_ENV
from peerckpt.replication.transport import TransportMode
from peerckpt.replication.writer import Flusher
from peerckpt.rpc import is_stream_closed
from peerckpt.service import service_process, stop_on_signals
from peerckpt.shm import sweep
from peerckpt.states import JobState, ProcRole, SlotKind
from peerckpt.storegate import Relays
from peerckpt.succession import succession
from peerckpt.wire import peer_pid

log = logging.getLogger("peerckpt.agent")
COORDINATOR_GRACE_S = 30.0  # how long an agent waits for a restarted coordinator


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class Agent:
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
        run: str | None = None,
        launcher_pid: int | None = None,
        transport: TransportMode = TransportMode.AUTO,
    ) -> None:
        self.joining = joining
        # torchrun (``launch/torchrun.py``): it restarts this node's processes after they
        # exit, and the node is gone when it is.
        self.launcher = ProcessWatch(launcher_pid) if launcher_pid is not None else None
        self.faults = faults
        self.net = faults.net  # network fault hooks of this node's TCP links, if any
        self.job, self.node, self._secret = job, node, secret
        self.spare_node = spare_node
        self.arena = Arena(job, node, run)  # run: the run id in the segments' names
        self.run = run
        # The launcher died (SIGKILL): nobody else will stop this node's processes or remove
        # its files, so ``close`` does (``_end_orphans``).
        self.launcher_gone = False
        self.store = SlotStore(self.arena)
        self.stopping = threading.Event()
        self._ending = threading.Event()  # the job ended: process exits are expected now
        self.coordinator = CoordinatorLink(
            coordinator, secret, job, node, self.stopping, self.net, self._succession
        )
        self.epoch: int = -1
        self.gen = 0  # the layout generation of this epoch's snapshots
        self.membership: Membership | None = None
        self.committed_step: int | None = None
        # Recovery pulls over NCCL where this node and the holder both can (``--transport``).
        self.device = DevicePulls(transport, nccl.probe, node)
        self.data = DataServer(
            self.store,
            secret,
            job,
            lambda: self.epoch,
            lambda: self.committed_step,
            host,
            net=self.net,
            trusted=self._member_hosts,
            device=self.device,
        )
        self.control = ControlServer(
            socket_path, secret, job, self._on_message, self._on_lost, self._on_hello
        )
        self.preparer = Preparer(
            node,
            job,
            secret,
            self.store,
            self.control,
            self.coordinator.report,
            lambda: self.epoch,
            faults,
            self.net,
        )
        self.relays = Relays(secret, job)  # the rendezvous store, reached through the gate
        self.preparer.store_addr = self.relays.address_for
        self.preparer.device = self.device
        self._lock = threading.RLock()
        self.mirroring = Mirroring(
            node,
            job,
            secret,
            self.store,
            self.coordinator,
            lambda: self.epoch,
            lambda: self.committed_step,
            faults,
        )
        self._watch_call: Any = None
        self._exit_reason = "agent exit"  # what local processes are told when it closes
        self._restarting: set[int] = set()  # pids that announced a restart in place
        self._threads: list[threading.Thread] = []
        self.flusher = Flusher(self.store, node, self.coordinator.report)
        # a spare's first slot, touched before it is needed
        self.spare_slots = SpareSlots(self.arena, self._idle_spares)
        self._events = Dispatch[None](
            {
                EpochOpened: lambda e: self._on_membership(e.membership),
                Commit: self._on_commit_event,
                Reads: self._on_reads,
                ReplicateWhole: self._on_replicate_whole,
                Flush: self.flusher.start,
                Shutdown: self._on_shutdown,
            },
            f"the agent of node {node}",
        )
        self._requests = Dispatch[Message | None](
            {
                AllocSlot: self._alloc,
                Restarting: self._on_restarting,
                SnapshotTaken: self._replicate,
                RankResumed: self._on_resumed,
                RankDone: self._on_done,
                RankError: self._on_rank_error,
                UnreshardableState: self._on_unreshardable,
                InexactState: self._on_inexact,
                ProcSettings: self._on_settings,
                WantChunks: self._on_wants,
                ReleaseStaging: self._on_release,
            },
            f"the agent of node {node}",
        )

    # -- lifecycle ------------------------------------------------------------------------
    def _registration(self, rejoin: RejoinState | None = None) -> RegisterAgent:
        return RegisterAgent(self.node, self.data.address, self.spare_node, self.joining, rejoin)

    def start(self) -> None:
        self.device.start()
        self.data.start()
        self.control.start()
        # A spare node or joiner may start while the coordinator is away (the launcher
        # restarts a dead one): it waits for it as long as a registered agent would.
        config = self.coordinator.register(self._registration(), COORDINATOR_GRACE_S)
        self.heartbeat_timeout = config.heartbeat_timeout
        self.mirroring.retry_s = 2 * self.heartbeat_timeout
        self.mirroring.record_digests = config.record_digests
        self.heartbeat_interval = max(0.05, min(0.5, self.heartbeat_timeout / 5))
        self._busy = BusyWatch()  # silent processes that compute are not hung
        self._stalls = StallWatch(cpu_seconds, fence_after_s=config.stall_timeout)
        for target, name in ((self._watch, "watch"), (self._heartbeat, "heartbeat")):
            thread = threading.Thread(target=target, name=f"peerckpt-agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait(self) -> None:
        """Until the agent stops, or its launcher (its parent; or torchrun) is gone: a pidfd
        of the parent says so at once, ``getppid`` where there are none."""
        parent = os.getppid()
        with ProcessWatch(parent) as launcher:
            while not self.stopping.is_set():
                gone = launcher.exited(wait_s=0.2) or os.getppid() != parent
                if gone or (self.launcher is not None and self.launcher.exited()):
                    log.warning("launcher is gone; agent of node %d stops", self.node)
                    self.launcher_gone = True
                    self.stopping.set()

    def close(self) -> None:
        """Stop everything this agent started and remove its arena, whatever state it is in."""
        self.stopping.set()
        self._ending.set()
        if self.launcher_gone:
            self._end_orphans()
        try:
            if self._watch_call is not None:
                self._watch_call.cancel()
            self.control.shutdown_links(Shutdown(JobState.STOPPED, self._exit_reason))
            self.mirroring.stop()
            self.spare_slots.stop()
            self.control.stop()
            self.data.stop()
            self.relays.stop()
            self.flusher.join(timeout=2.0)
            for thread in self._threads:
                thread.join(timeout=2.0)
            self.coordinator.close()
            self.faults.close()
            if self.launcher is not None:
                self.launcher.close()
        finally:
            self.arena.destroy()
            if self.launcher_gone and self.run is not None:
                sweep(self.job, self.run, self.node)  # whatever a killed rank left of this node

    def _end_orphans(self) -> None:
        """The launcher is gone: SIGKILL this node's rank and spare processes (with their
        process groups: their DataLoader workers) instead of telling them to stop, which
        would take seconds of interpreter shutdown while they still train and hold memory.
        Nothing of the job is theirs to clean up: the memory is this agent's."""
        for link in self.control.links():
            _kill_group(link)

    def _member_hosts(self) -> frozenset[str]:
        """The hosts of the job's agents now: their connections are admitted first."""
        members = self.membership
        addrs = members.node_addrs.values() if members is not None else ()
        return frozenset(addr.rpartition(":")[0].strip("[]") for addr in addrs)

    # -- coordinator ----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.stopping.is_set() and self._follow():
            # The coordinator went away: it is restarted by the launcher, and rebuilds its
            # state from what every agent tells it when it registers again.
            config = self.coordinator.rejoin(
                COORDINATOR_GRACE_S, self._registration, self._rejoin_state
            )
            if config is None or config.lost:
                if config is not None:
                    self._exit_reason = f"node {self.node} was declared lost by the coordinator"
                break
            self.mirroring.forget_reported_layouts()  # the new coordinator needs every layout
        self.stopping.set()

    def _follow(self) -> bool:
        """Carry out the coordinator's events; True if its stream broke (it went away)."""
        try:
            self._watch_call = self.coordinator.watch()
            for event in self._watch_call:
                if self.net is not None:  # a partition delays what the coordinator says
                    self.net.wait_healed(self.stopping)
                self._events.handle(event)
                if isinstance(event, Shutdown):
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

    def _succession(self, current: str) -> list[str]:
        """Where the coordinator may answer if the one at ``current`` is gone: the job's hosts
        as this node last saw them (``peerckpt/succession.py``)."""
        with self._lock:
            members = self.membership
        return succession(current, members.node_addrs if members is not None else {})

    def _rejoin_state(self) -> RejoinState:
        """What a restarted coordinator rebuilds its state from: this node's view of the
        epoch, its live processes, and every snapshot copy it holds, complete or partial
        (with the chunks it lacks and its twin digest: ``replication/dedup.py``)."""
        with self._lock:
            members, committed = self.membership, self.committed_step
        held = []
        layouts = {}
        for slot in self.store.all():
            manifest = slot.manifest
            if slot.kind is SlotKind.STAGING or manifest is None:
                continue
            held.append(
                HeldCopy(
                    slot.rank,
                    manifest.step,
                    slot.gen,
                    manifest.used_bytes,
                    manifest.absent,
                    twin_digest(manifest),
                )
            )
            if manifest.step == committed:
                layouts[slot.rank] = [c.to_msg() for c in manifest.chunks]
        procs = [_proc_report(link) for link in self.control.links()]
        return RejoinState(members, committed, held, layouts, procs)

    def _heartbeat(self) -> None:
        last_beat = 0.0
        while not self.stopping.wait(self.heartbeat_interval):
            self._fence_silent()
            self._watch_stalls()
            if self.net is not None and self.net.partitioned():
                continue  # cut off: the coordinator hears nothing from this node
            now = time.monotonic()
            if (
                now - self.coordinator.reported_at < self.heartbeat_timeout / 5
                and now - last_beat < self.heartbeat_timeout / 2
            ):
                continue  # a report has just told the coordinator that this node is alive
            last_beat = now  # (still one every timeout/2: it carries the node's stats)
            members = self.membership
            ranks = members.local_ranks(self.node) if members is not None else []
            beats = [link.beat for link in self.control.links()]
            stats = node_stats(self.store, self.mirroring.counters, ranks, beats)
            try:
                self.coordinator.call(Heartbeat(self.node, self.epoch, stats), timeout=2.0)
            except PeerckptError as exc:
                log.debug("heartbeat failed: %s", exc)

    def _fence_silent(self) -> None:
        """Declare lost, and fence, every local process silent for a heartbeat timeout that
        does not compute (``replication/busy.py``)."""
        if self._ending.is_set():
            return
        self._busy.note(link.pid for link in self.control.silent(self.heartbeat_timeout / 3))
        for link in self.control.silent(self.heartbeat_timeout):
            silent_s = time.monotonic() - link.last_seen
            share = self._busy.busy(link.pid, self.heartbeat_timeout / 2)
            if share is not None:
                if self._busy.first(link.pid, silent_s):
                    log.warning(
                        "%r sent no heartbeat for %.1f s but runs on a CPU (%.0f%% of a core): "
                        "a call that holds the GIL (json.loads of a large file, a C extension) "
                        "or an overloaded machine; not declared hung while it computes",
                        link,
                        silent_s,
                        share * 100,
                    )
                continue
            reason = (
                f"{link!r} sent no heartbeat for {silent_s:.1f} s "
                f"(timeout {self.heartbeat_timeout:g} s): hung or stopped; it is fenced"
            )
            self._declare_lost(link, reason)

    def _declare_lost(self, link: ProcLink, reason: str) -> None:
        """Fence a live process (it exits when it reads why) and report it lost."""
        log.warning("%s", reason)
        self.control.fence(link, f"declared lost by node {self.node}'s agent: {reason}")
        self.coordinator.report(ProcLost(self.node, link.pid, reason))

    def _watch_stalls(self) -> None:
        """Name each local rank whose step has not moved for long, with its stacks; fence
        those stuck past ``--stall-timeout`` (``replication/stall.py``)."""
        if self._ending.is_set():
            return
        now = time.monotonic()
        links = {link.pid: link for link in self.control.links() if link.fenced is None}
        beats = {pid: link.beat for pid, link in links.items()}  # one read: a beat replaces it
        self._stalls.observe(now, ((pid, b.rank, b.step) for pid, b in beats.items()))
        found = self._stalls.due(now, lambda pid: beats[pid].waiting)
        if not found:
            return
        log.warning(
            "no step for a while on node %d: %s. Each one's Python stacks follow in its output",
            self.node,
            "; ".join(stalled.line() for stalled in found),
        )
        for stalled in found:
            if links[stalled.pid].hello.stacks:  # else the signal's default would end it
                with contextlib.suppress(OSError):
                    os.kill(stalled.pid, STACK_SIGNAL)  # its faulthandler writes its stacks
        for stalled in found:
            if not stalled.fence:
                continue
            reason = (
                f"{stalled.line()}; stuck past --stall-timeout "
                f"{self._stalls.fence_after_s:g} s: it is fenced"
            )
            self._declare_lost(links[stalled.pid], reason)

    def _on_shutdown(self, event: Shutdown) -> None:
        log.info("job ends (%s); stopping local processes", event.state.value)
        self._ending.set()
        self.control.shutdown_links(event, wait_s=10.0)
        self.stopping.set()

    # -- rank processes -------------------------------------------------------------------
    def _on_hello(self, link: ProcLink) -> None:
        self.coordinator.report(ProcJoined(self.node, _proc_report(link)))

    def _on_lost(self, link: ProcLink) -> None:
        if link.fenced is not None:
            log.info("fenced %r exited", link)
        elif self.launcher is not None and not self._ending.is_set():
            self._lost_under_launcher(link)
        elif not self.stopping.is_set() and not self._ending.is_set():
            how = "restarted in place" if link.pid in self._restarting else "exited"
            log.warning("%r on node %d %s", link, self.node, how)
            self.coordinator.report(
                ProcLost(
                    self.node, link.pid, f"process {link.pid} {how}", link.pid in self._restarting
                )
            )

    def _lost_under_launcher(self, link: ProcLink) -> None:
        """A process exited under torchrun: torchrun restarts it (and every other worker),
        unless torchrun itself is dying, which is this host dying. A SIGKILL to the host's
        process tree may reach the worker first, so torchrun gets a moment to be seen gone;
        then this agent stops and its node is lost as one, nothing reported rank by rank."""
        assert self.launcher is not None
        if self.launcher.exited(wait_s=0.5):
            log.warning("%r exited with torchrun: node %d is going away", link, self.node)
            self.stopping.set()
            return
        if self.stopping.is_set():
            return
        log.warning("%r on node %d exited; torchrun restarts it", link, self.node)
        if link.pid not in self._restarting:  # else counted when it announced its restart
            self.coordinator.report(SparesStarting(1, self.node))  # before the loss: it waits
        self.coordinator.report(ProcLost(self.node, link.pid, f"process {link.pid} exited"))

    def _on_message(self, link: ProcLink, msg: ToAgent) -> Message | None:
        return self._requests.handle(msg, link)

    def _on_restarting(self, msg: Restarting, link: ProcLink) -> Granted:
        # Stuck in an aborted epoch: it exits and the launcher starts a fresh process on this
        # node. Counted as a starting spare first, so that the recovery its exit causes waits
        # for that process instead of shrinking the world.
        log.warning("%r restarts in place: %s", link, msg.reason)
        self._restarting.add(link.pid)
        self.coordinator.report(SparesStarting(1, self.node))
        return Granted()

    def _on_resumed(self, msg: RankResumed, link: ProcLink) -> None:
        pulls, holds = self.preparer.take_pulls(msg.epoch, msg.rank)
        resumed = Resumed(self.node, msg.epoch, msg.rank, pulls, holds)
        # Replayed to a restarted coordinator: it tells it the epoch's group formed here.
        self.coordinator.remember(("Resumed", msg.rank), resumed)
        self.coordinator.report(resumed)

    def _on_done(self, msg: RankDone, link: ProcLink) -> None:
        done = Done(self.node, msg.epoch, msg.rank)
        self.coordinator.remember(("Done", msg.rank), done)
        self.coordinator.report(done)

    def _on_unreshardable(self, msg: UnreshardableState, link: ProcLink) -> None:
        report = Unreshardable(self.node, msg.epoch, msg.rank, msg.objects)
        # Replayed to a restarted coordinator, which would otherwise let the world change.
        self.coordinator.remember(("Unreshardable", msg.rank), report)
        self.coordinator.report(report)

    def _on_inexact(self, msg: InexactState, link: ProcLink) -> None:
        report = Inexact(self.node, msg.epoch, msg.rank, msg.findings)
        # Replayed to a restarted coordinator: the job's report still says it.
        self.coordinator.remember(("Inexact", msg.rank), report)
        self.coordinator.report(report)

    def _on_settings(self, msg: ProcSettings, link: ProcLink) -> None:
        """A spare's decorator settings: its report to a restarted coordinator says them."""
        link.hello = replace(
            link.hello, replicas=msg.replicas, persist=msg.persist, erasure=msg.erasure
        )

    def _on_rank_error(self, msg: RankError, link: ProcLink) -> None:
        self.coordinator.report(RankFailed(self.node, msg.epoch, msg.rank, msg.error, msg.message))

    def _on_wants(self, msg: WantChunks, link: ProcLink) -> None:
        chunks = [ChunkRecord.from_msg(c) for c in msg.chunks]
        self.preparer.want(msg.epoch, msg.rank, msg.round, chunks)
        # As columns: at 10,000 ranks a record per chunk cost the coordinator seconds.
        columns = ChunkColumns.from_records(chunks, places=False)
        self.coordinator.report(Wants(self.node, msg.epoch, msg.round, msg.rank, [], columns))

    def _on_release(self, msg: ReleaseStaging, link: ProcLink) -> None:
        self.store.release_where(
            lambda s: s.kind is SlotKind.STAGING and s.rank == msg.rank and s.index == msg.round
        )

    def _alloc(self, msg: AllocSlot, link: ProcLink) -> SlotGranted:
        slot = self.store.get(SlotKind.OWN, self.gen, msg.rank, msg.slot)
        if slot is not None and slot.step is not None and slot.step == self.committed_step:
            raise PeerckptError(
                f"rank {msg.rank} asked to rewrite slot {msg.slot}, which holds committed step "
                f"{slot.step}; a snapshot must go to the other slot"
            )
        slot = self.store.ensure(SlotKind.OWN, self.gen, msg.rank, msg.slot, msg.nbytes)
        with slot.lock:  # a flush reading the slot finishes its chunk, then sees it changed
            slot.invalidate()
        return SlotGranted(slot.segment.path, slot.segment.size)

    # -- replication ----------------------------------------------------------------------
    def _replicate(self, msg: SnapshotTaken, link: ProcLink) -> None:
        with self._lock:
            members = self.membership
            if members is None or msg.epoch != self.epoch:
                return  # a snapshot of an ended epoch: never replicated, never committed
        self.mirroring.replicate(members, msg)

    # -- coordinator events ---------------------------------------------------------------
    def _on_membership(self, members: Membership) -> None:
        with self._lock:
            if members.epoch <= self.epoch:
                return
            self.epoch, self.membership = members.epoch, members
            self.gen = members.gen
            self.committed_step = members.restore_step
        self.control.broadcast(Abort(members.epoch))
        self.mirroring.cancel_inflight()
        self.preparer.prepare(members)

    def _on_reads(self, event: Reads) -> None:
        members = self.membership
        if members is not None and event.epoch == self.epoch:
            self.preparer.on_reads(members, event)

    def _on_replicate_whole(self, event: ReplicateWhole) -> None:
        members = self.membership
        if members is not None and event.epoch == self.epoch:
            self.mirroring.replicate_whole(members, event.rank, event.step)

    def _on_commit_event(self, event: Commit) -> None:
        self._on_commit(event.epoch, event.step)
        if self.spare_node:
            self.spare_slots.ready(event.largest_snapshot)

    def _idle_spares(self) -> int:
        members = self.membership
        taken = {m.pid for m in members.ranks.values()} if members is not None else set()
        return sum(
            link.role is ProcRole.SPARE and link.pid not in taken for link in self.control.links()
        )

    def _on_commit(self, epoch: int, step: int) -> None:
        if epoch != self.epoch or self.membership is None:
            return
        self.committed_step = step
        members = self.membership
        for rank in members.local_ranks(self.node):
            link = self.control.link_of(members.ranks[rank].pid)
            if link is not None:
                link.send(Commit(epoch, step))
        self._collect_garbage(members)

    def _collect_garbage(self, members: Membership) -> None:
        """Free slots this node no longer needs once a step of the current epoch committed."""
        local = set(members.local_ranks(self.node))
        mirrored = {r for r, buddies in members.placement.items() if self.node in buddies}
        freed = self.store.release_where(
            lambda s: (
                s.gen != members.gen  # a step of this layout is committed now
                or s.kind is SlotKind.STAGING  # restores of this epoch are long done
                or (s.kind is SlotKind.OWN and s.rank not in local)
                or (s.kind is SlotKind.REPLICA and s.rank not in mirrored)
            )
        )
        if members.erasure is not None:  # parity of other groups, or of an older layout
            keep = {tuple(r for r, _ in g) for g in members.erasure["groups"]}
            freed += [None] * self.data.parity.release_where(
                lambda key: key[0] != members.gen or key[1] not in keep
            )
        if freed:
            log.info("freed %d slot(s) no longer in this node's placement", len(freed))


def _proc_report(link: ProcLink) -> ProcReport:
    h = link.hello
    return ProcReport(link.pid, link.role, link.rank, h.replicas, h.persist, h.erasure)


def _kill_group(link: ProcLink) -> None:
    """SIGKILL the process at the other end of ``link`` (its Unix socket's peer credentials
    must name the pid it said hello with), and its process group where it leads one (a process
    the launcher started in a session of its own)."""
    if peer_pid(link.conn.sock) != link.pid:
        return
    try:
        if os.getpgid(link.pid) == link.pid:
            os.killpg(link.pid, signal.SIGKILL)
        else:
            os.kill(link.pid, signal.SIGKILL)
    except OSError:  # gone already
        return
    log.warning("%r killed: its launcher is gone", link)


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
    parser.add_argument(
        "--transport",
        choices=[m.value for m in TransportMode],
        default=os.environ.get(TRANSPORT_ENV, "auto"),
        help="how recovery pulls travel: NCCL where both agents have CUDA and NCCL (auto); "
        f"default: ${TRANSPORT_ENV} (peerckpt run --transport sets it), else auto",
    )
    parser.add_argument(
        "--launcher-pid",
        type=int,
        default=None,
        help="torchrun's pid: it restarts this node's processes; the node dies with it",
    )
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
        run=os.environ.get(RUN_ENV),
        launcher_pid=args.launcher_pid,
        transport=TransportMode(args.transport),
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
