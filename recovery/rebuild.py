"""A restarted coordinator rebuilds its state from what every agent tells it.

The launcher restarts a coordinator that died on the same ports; each agent registers again
with a ``RejoinState``: the epoch it is in, its live processes and every complete snapshot
copy it holds. ``adopt`` folds one such report into the coordinator. The first agent to come
back brings the membership; every agent adds its processes and copies (a buddy's partial
copy of a data-parallel rank too, with the chunks it lacks: the ranks whose copies carry the
same twin digest are its twins, which hold the rest). Nodes of the
membership whose agent has not come back yet count as alive until their heartbeats say
otherwise; ranks whose process is gone are recovered together once every agent had
``REBUILD_WAIT_FACTOR`` heartbeat timeouts to come back (``Coordinator._end_rebuild``).

An agent lost just before the coordinator: if the coordinator died before it opened the epoch
that replaces the lost node, that node is in the rebuilt membership, never comes back, and is
declared lost by its silence once the wait ends. If it had opened it, the ranks may have been
forming its process group on the rendezvous store, which lives in the coordinator's process
and died with it: a rank connected to it fails, or waits for peers that failed, and nobody
says so. Every agent replays its ranks' last ``Resumed`` report; the ranks of the rebuilt
epoch that never reported stepping in it when the wait ends form its group again in a new
epoch (``regroup_unformed``). An agent that comes back after a step committed without it
hears that commit first on its event stream (``catch_up``): its ranks wait for it before
they snapshot again.

A coordinator that moved to another host because its own died (``peerckpt/succession.py``,
``--moved-from HOST``) waits for no node of that host: they are silent from the start, and
the wait ends as soon as every other node of the membership is back, and the dead host's nodes
that did not come back are then declared lost (``Coordinator._end_rebuild``), all within the
ranks' suspect window.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from peerckpt.coding import Coding
from peerckpt.membership import Membership
from peerckpt.messages.control import Commit, EpochOpened, RejoinState
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.decide import Loss
from peerckpt.recovery.erasure import script_erasure
from peerckpt.recovery.registry import AgentInfo
from peerckpt.recovery.twins import domains_of, twins_by_digest
from peerckpt.states import JobState, ProcRole, RecoveryKind

if TYPE_CHECKING:
    from peerckpt.recovery.coordinator import Coordinator

log = logging.getLogger("peerckpt.coordinator")


def adopt(c: Coordinator, node: int, state: RejoinState) -> None:
    """Fold node ``node``'s report into coordinator ``c`` (under its lock)."""
    epochs, registry = c.epochs, c.registry
    m = state.membership
    if m is not None and (epochs.membership is None or m.epoch > epochs.membership.epoch):
        log.warning("rebuilding from the agents: epoch %d, %d ranks", m.epoch, len(m.ranks))
        epochs.membership = m
        c.settings.world_size = m.world_size
        epochs.tracker = CommitTracker(m.epoch, frozenset(m.ranks), gen=m.gen)
        epochs.tracker.domains = domains_of(m)
        # --erasure: the epoch's groups, as ``open_epoch`` gave them to the first tracker.
        # Without them every step committed after the restart had no groups, and a node
        # lost then left its ranks no holder although their parity rebuilds them.
        epochs.tracker.coding = Coding.from_msg(m.erasure) if m.erasure else None
        for n, addr in m.node_addrs.items():
            if n not in registry.agents:  # not back yet: alive until its heartbeats say not
                registry.add_agent(AgentInfo(n, addr, spare_node=False))
        for rank, a in m.ranks.items():
            if (a.node, a.pid) not in registry.procs:
                registry.add_proc(a.node, a.pid, ProcRole.RANK, rank)
        if c.life.state is JobState.STARTING:
            c.life.become(JobState.RUNNING)
        c.rebuilt_epoch = m.epoch
        epochs.resumed.clear()  # ranks report stepping in this epoch (replayed ``Resumed``)
    tracker = epochs.tracker
    committed = state.committed_step
    log.info(
        "node %d is back: committed step %s, copies of %s",
        node,
        committed,
        sorted({(h.rank, h.step) for h in state.held}),
    )
    if tracker is not None and committed is not None:
        if tracker.committed_step is None or committed > tracker.committed_step:
            tracker.committed_step = committed
            tracker.committed_holders = {}
            tracker.committed_partial, tracker.committed_absent = {}, {}
            c.rebuild_digests = {}
            tracker.committed_coding = committed_coding(epochs.membership, tracker, committed)
        if committed == tracker.committed_step:
            for held in state.held:
                if held.step != committed:
                    continue
                tracker.committed_gen = held.gen
                if held.digest:
                    c.rebuild_digests[held.rank] = held.digest
                if held.absent:  # a buddy's partial copy: its twins hold the rest
                    tracker.committed_partial.setdefault(held.rank, set()).add(node)
                    tracker.committed_absent[held.rank] = held.absent
                    continue
                tracker.committed_holders.setdefault(held.rank, set()).add(node)
                epochs.snapshot_bytes[held.rank] = held.used_bytes
            tracker.committed_twins = twins_by_digest(c.rebuild_digests, tracker.committed_partial)
            if tracker.committed_partial:
                log.info(
                    "partial copies of rank(s) %s; their twins: %s",
                    sorted(tracker.committed_partial),
                    tracker.committed_twins,
                )
            for rank, layout in state.layouts.items():
                tracker.committed_layouts[rank] = layout
                tracker.set_layout(rank, layout)
    alive = set()
    for proc in state.procs:
        alive.add(proc.pid)
        if (node, proc.pid) not in registry.procs:
            registry.add_proc(node, proc.pid, proc.role, proc.rank)
            if proc.role is ProcRole.SPARE:
                c.spares.joined += 1
                c.spares.started = max(c.spares.started, c.spares.joined)
        settings = (proc.replicas, proc.persist, proc.erasure) != (None, None, None)
        if proc.role is ProcRole.RANK or settings:
            # As when rank 0 first joined; every rank runs the same decorator, and rank 0's
            # node may be the one that does not come back (its settings were then lost: the
            # epochs after kept one buddy where the script asked for two). A spare that took
            # a rank is reported as the spare it said hello as, with the settings its
            # decorator gave since (ProcSettings); one that took none has none.
            c.config_from_script(proc.replicas, proc.persist)
            script_erasure(c.settings, proc.erasure)
    if c.life.state is JobState.STARTING:
        epochs.open_first()  # it went away before the first epoch opened
    if epochs.membership is not None:
        for rank, a in epochs.membership.ranks.items():
            if a.node == node and a.pid not in alive:
                registry.procs[(a.node, a.pid)].alive = False
                c.rebuild_lost.add(rank)
    # Agents come back one by one; the spares' node may be the last. Nobody is declared lost
    # by heartbeat meanwhile, and losses found are recovered together once the others had
    # their time to return.
    c.clocks.start_rebuild(time.monotonic())
    members = epochs.membership
    if c.moved_from is not None and members is not None:
        expected = set(members.node_addrs) - on_host(members.node_addrs, c.moved_from)
        if expected <= c.rebuild_back:  # every node that can come back did: end the wait
            c.clocks.rebuild_deadline = time.monotonic()


def committed_coding(m: Membership | None, tracker: CommitTracker, step: int) -> Coding | None:
    """The groups step ``step`` was coded with (``--erasure``; None without): the epoch's if
    it committed in it, else the groups its membership restored it with."""
    if m is None:
        return None
    if step == m.restore_step:
        restore = m.erasure_restore.get("coding")
        return Coding.from_msg(restore) if restore else None
    return tracker.coding


def catch_up(c: Coordinator) -> list[EpochOpened | Commit]:
    """What an agent's event stream hears first: the current epoch, and the step committed in
    it since it opened. An agent back after a coordinator restart missed the commits broadcast
    before it registered, and its ranks wait for that one before they overwrite their older
    snapshot slot: without it the job stalls until the commit timeout. Both are idempotent
    for an agent that already knows them."""
    m, tracker = c.epochs.membership, c.epochs.tracker
    if m is None:
        return []
    step = tracker.committed_step if tracker is not None and tracker.epoch == m.epoch else None
    if step is None or step == m.restore_step:
        return [EpochOpened(m)]
    largest = max(c.epochs.snapshot_bytes.values(), default=0)
    return [EpochOpened(m), Commit(m.epoch, step, largest)]


def regroup_unformed(c: Coordinator) -> None:
    """The agents had their time to come back: ranks of the rebuilt epoch that never formed
    its process group (``unformed``) form it again, the same ranks, in a new epoch."""
    m = c.epochs.membership
    ranks = unformed(c)
    if m is None or not ranks:
        return
    reason = (
        f"rank(s) {sorted(ranks)} never reported stepping in epoch {m.epoch}: its process "
        "group was forming on the rendezvous store of the coordinator that died; the same "
        "ranks form it again"
    )
    log.warning("%s", reason)
    c.epochs.recover(Loss(RecoveryKind.RENDEZVOUS, frozenset(), frozenset(), reason, time.time()))


def unformed(c: Coordinator) -> set[int]:
    """Once the agents had their time to come back: the live ranks of the rebuilt epoch that
    never reported stepping in it (each agent replays its ranks' last ``Resumed``). They were
    forming the epoch's process group on the rendezvous store of the coordinator that died
    (its loss resets their store connection: ``init_process_group`` fails, or waits for peers
    that failed), so they never will. Empty if a newer epoch opened since (it forms its own
    group), under torchrun (whose workers restart on such an error) and if every rank steps.

    A rank still restoring a large state then counts as unformed too: the new epoch costs it
    a restore, never a wrong bit (it restores the same committed step)."""
    m = c.epochs.membership
    if m is None or m.epoch != c.rebuilt_epoch or c.settings.restart_based:
        return set()
    procs = c.registry.procs
    return {
        rank
        for rank, a in m.ranks.items()
        if rank not in c.epochs.resumed
        and (p := procs.get((a.node, a.pid))) is not None
        and p.alive
    }


def on_host(node_addrs: dict[int, str], host: str) -> set[int]:
    """The nodes whose agent is on ``host``."""
    return {n for n, addr in node_addrs.items() if addr.rpartition(":")[0].strip("[]") == host}
