"""How the coordinator changes its membership: the first epoch, spares replacing lost ranks,
shrinking when no spare is left, growing when a node joins, and the durable tier as the
holder of last resort.

``Epochs`` holds the membership, its commit tracker and the record of every change. Its
methods run under the coordinator's lock. Each change gathers a ``JobView``, asks the pure
decision (``recovery/decide.py``) and carries out the answer: open the epoch (promote the
spares, broadcast the membership), wait for spares, fail, or — no memory copy survived —
restore from storage. Only the storage paths do I/O here (reading a durable manifest).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from peerckpt.errors import CheckpointError, NoCheckpoint, StaleEpoch
from peerckpt.membership import Membership, RankAssignment
from peerckpt.messages.control import EpochOpened, Pull, RecoveryEvent
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.durable import DurableCheckpoint
from peerckpt.reads import STORAGE
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.decide import (
    Decision,
    Fail,
    JobView,
    Join,
    Loss,
    NeedStorage,
    OpenEpoch,
    Topology,
    Wait,
    decide_join,
    decide_loss,
    next_epoch,
    restarts_in_place,
)
from peerckpt.recovery.elastic import ReshardRounds
from peerckpt.recovery.erasure import open_epoch, why_unrebuildable
from peerckpt.recovery.fallback import durable_to_restore, same_chunks
from peerckpt.recovery.job import JobLife, Settings, Spares
from peerckpt.recovery.registry import Registry
from peerckpt.recovery.unreshardable import join_refusal
from peerckpt.states import EpochMode, JobState, ProcRole, RecoveryKind

log = logging.getLogger("peerckpt.coordinator")

SPARE_WAIT_S = 60.0  # how long a recovery waits for spares the launcher started to join
# Under torchrun, restarted workers come after a new rendezvous, which waits out a lost
# host's keep-alive and the last call (45 s with torchrun's defaults); its join timeout
# (600 s by default) bounds it.
RESTART_WAIT_S = 600.0


class Epochs:
    """The membership and its changes. Call every method under the coordinator's lock."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        life: JobLife,
        spares: Spares,
        persist: Callable[[], PersistConfig | None],
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.life = life
        self.spares = spares
        self._persist = persist  # the durable tier, once known
        self.membership: Membership | None = None
        self.tracker: CommitTracker | None = None
        self.events: list[RecoveryEvent] = []
        self.deferred: Loss | None = None  # a recovery waiting for spares still starting
        self.done: set[int] = set()
        self.resumed: set[int] = set()
        self.snapshot_bytes: dict[int, int] = {}
        self.rounds = ReshardRounds()
        # Nodes whose join came before rank 0 named state that cannot reshard, refused when
        # their processes connected (``recovery/unreshardable.py``): node → why.
        self.refused_joins: dict[int, str] = {}
        # Restart in place (``decide.restarts_in_place``): each rank's restarts over the job,
        # and those ordered whose process has not taken the rank yet: rank → (node, pid of
        # the process lost), which the launchers read in ``JobStatus.in_place``.
        self.restarts: dict[int, int] = {}
        self.in_place: dict[int, tuple[int, int]] = {}

    # -- the view the decisions read ---------------------------------------------------------
    def topology(self) -> Topology:
        s = self.settings
        # None: neither the launcher nor rank 0's script gave any, so the default (1), as in
        # ``open_first``; a restarted coordinator never runs that, and read None as 0 buddies.
        replicas = 1 if s.replicas is None else s.replicas
        return Topology(s.placement, replicas, self.registry.node_addrs(), s.store_addr)

    def view(self) -> JobView:
        assert self.membership is not None and self.tracker is not None
        spares = self.registry.joined_spares(self.membership)
        return JobView(
            self.membership,
            self.tracker,
            dict(self.snapshot_bytes),
            tuple((p.node, p.pid) for p in spares),
            self.spares.starting,
            self.settings.min_nodes,
            self.topology(),
            self.settings.restart_based,
            self._members_alive(),
            max_restarts=self.settings.max_restarts,
            restarts=dict(self.restarts),
            restartable_nodes=self.registry.restartable_nodes(),
        )

    def _members_alive(self) -> int:
        """Processes of the current epoch not lost yet."""
        assert self.membership is not None
        procs = self.registry.procs
        return sum(
            1
            for a in self.membership.ranks.values()
            if (p := procs.get((a.node, a.pid))) is not None and p.alive
        )

    # -- changes -------------------------------------------------------------------------------
    def open_first(self) -> None:
        """Every rank of the job has joined: open epoch 0 (or restore from storage)."""
        if len(self.registry.procs) < self.settings.world_size:
            return  # not every rank yet (and no O(ranks) look at them per join)
        ranks = {
            p.rank: p
            for p in self.registry.procs.values()
            if p.role is ProcRole.RANK and p.alive and p.rank is not None
        }
        if set(ranks) != set(range(self.settings.world_size)):
            return
        if self.settings.replicas is None:
            self.settings.replicas = 1
        assignments = {r: RankAssignment(r, p.node, p.pid) for r, p in ranks.items()}
        if not self._cold_start(assignments):
            membership, tracker = next_epoch(
                self.topology(),
                None,
                0,
                assignments,
                None,
                {},
                EpochMode.FRESH,
                gen=0,
                previous={},
                old_world=0,
            )
            self._open(membership, tracker)
        if self.life.state is JobState.STARTING:
            self.life.become(JobState.RUNNING)
        self.maybe_grow()

    def recover(self, loss: Loss) -> None:
        """Ranks were lost: replace them, shrink, wait for spares, or fail."""
        if self.life.state is not JobState.RUNNING or self.membership is None:
            return
        self._forget_restarts_on(loss.nodes)
        if loss.deadline is None and self.deferred is not None:
            # A recovery is waiting for spares: this loss joins it (one epoch change for both).
            self.deferred = self._restart_in_place(self.deferred.merged(loss))
            self.retry_deferred()
            return
        loss = self._restart_in_place(loss)
        wait_s = RESTART_WAIT_S if self.settings.restart_based else SPARE_WAIT_S
        decision = decide_loss(self.view(), loss, time.monotonic(), wait_s)
        if isinstance(decision, Wait):
            if self.deferred is None and loss.deadline is None:
                log.warning(
                    "lost rank(s) %s (%s); %d spare(s) joined, %d still starting: the "
                    "recovery waits up to %.0f s for them",
                    sorted(loss.ranks),
                    loss.reason,
                    len(self.view().spares),
                    self.spares.starting,
                    wait_s,
                )
            self.deferred = decision.loss
            return
        ongoing = self._ongoing(loss)
        if ongoing is not None:
            self._go_on(ongoing, loss, decision)
            return
        event = self._record(loss.kind, loss.ranks, loss.nodes, loss.reason)
        if loss.restarted:
            event = self._amend(event, restarted=dict.fromkeys(loss.restarted, loss.detected_at))
        if loss.deadline is not None:  # it waited for spares
            event = self._amend(
                event,
                detected_at=loss.detected_at,
                waited_for_spares_s=round(time.time() - loss.detected_at, 3),
            )
        if isinstance(decision, OpenEpoch) and loss.ordered:
            old = self.membership.ranks
            here = {r: self.restarts[r] for r in sorted(loss.ordered) if _on(decision, r, old)}
            event = self._amend(event, in_place=here)
        self._carry_out(decision, event)

    def _restart_in_place(self, loss: Loss) -> Loss:
        """Order the restarts in place that ``decide.restarts_in_place`` picks for ``loss``:
        each is counted as a spare starting now, before any launcher could start it, so the
        decision that follows waits for it (no window in which the job fails or shrinks for
        want of a spare); the launchers read the order in ``JobStatus.in_place``."""
        assert self.membership is not None
        orders = restarts_in_place(self.view(), loss)
        for rank, node in orders.items():
            self.restarts[rank] = self.restarts.get(rank, 0) + 1
            self.in_place[rank] = (node, self.membership.ranks[rank].pid)
            log.warning(
                "rank %d was lost on node %d, whose agent holds its state: restarting it in "
                "place (restart %d of at most %d, --max-restarts)",
                rank,
                node,
                self.restarts[rank],
                self.settings.max_restarts,
            )
        self.spares.started += len(orders)
        return replace(loss, ordered=loss.ordered | frozenset(orders)) if orders else loss

    def _forget_restarts_on(self, nodes: frozenset[int]) -> None:
        """Nodes lost: the restarts ordered there will never join; stop waiting for them."""
        for rank, (node, _) in list(self.in_place.items()):
            if node in nodes:
                del self.in_place[rank]
                self.spares.started -= 1

    def spare_joined(self, node: int) -> None:
        """A spare joined on ``node``: where a restart in place was ordered, it is that
        restart's process, and no launcher is to start it any more. (An order stays until
        then, also when another spare took its rank: its process, counted as starting, is
        on its way and joins as a free spare.)"""
        for rank, (n, _) in sorted(self.in_place.items()):
            if n == node:
                del self.in_place[rank]
                return

    def _ongoing(self, loss: Loss) -> int | None:
        """The recovery that ``loss`` is part of: the last one, while it has not finished, when
        every rank of ``loss`` is a survivor restarted in place because it could not leave the
        epoch that recovery aborted. None for any other loss (a failure of its own)."""
        m = self.membership
        if not loss.restarted or loss.restarted != loss.ranks or not self.events or m is None:
            return None
        last = self.events[-1]
        return len(self.events) - 1 if last.resumed_at is None and last.epoch == m.epoch else None

    def _go_on(self, index: int, loss: Loss, decision: Decision) -> None:
        """Carry ``decision`` out as the recovery ``index`` still under way, not as a new
        failure: its cost runs from its own detection to every rank stepping after the
        restart, and the report says which survivors were restarted and when."""
        old = self.events[index]
        log.warning(
            "rank(s) %s could not leave the aborted epoch and were restarted in place: part of "
            "the recovery from %s (detected %.1f s ago)",
            sorted(loss.ranks),
            old.reason,
            time.time() - old.detected_at,
        )
        waited = old.waited_for_spares_s
        if loss.deadline is not None:  # it waited for the fresh process
            waited = round((waited or 0.0) + time.time() - loss.detected_at, 3)
        self._amend(
            index,
            restarted={**old.restarted, **dict.fromkeys(loss.restarted, loss.detected_at)},
            waited_for_spares_s=waited,
            pulls=[],  # the aborted epoch's restores are done again in the next one
        )
        self._carry_out(decision, index)
        self._amend(index, replacements={**old.replacements, **self.events[index].replacements})

    def retry_deferred(self, force: bool = False) -> None:
        """A spare joined (or the wait ran out, ``force``): go on with a waiting recovery."""
        loss = self.deferred
        if loss is None:
            return
        short = len(self.registry.joined_spares(self.membership)) < len(loss.ranks)
        if not force and short and self.spares.starting > 0:
            return  # more are coming; keep waiting
        self.deferred = None
        if force:
            never = self.spares.starting
            log.warning(
                "%d spare(s) did not join within %.0f s; recovering without them",
                never,
                SPARE_WAIT_S,
            )
            self.spares.started = self.spares.joined  # they are not coming
            loss = replace(loss, never_joined=never, deadline=0.0)
        self.recover(loss)

    def maybe_grow(self) -> None:
        """Once every process of a joining node has connected, widen the world to include it."""
        if self.life.state is not JobState.RUNNING or self.membership is None:
            return
        for agent in sorted(self.registry.agents.values(), key=lambda a: a.node):
            if not agent.alive or not agent.joining:
                continue
            joiners = self.registry.joiners(agent.node)  # O(processes): joining nodes only
            if len(joiners) < agent.joining:
                continue
            agent.joining = 0
            refused = join_refusal(self.settings)
            if refused is not None:
                log.error("node %d is not added: %s", agent.node, refused)
                self.refused_joins[agent.node] = refused
                continue
            event = self._record(
                RecoveryKind.GROW, frozenset(), {agent.node}, f"node {agent.node} joined"
            )
            join = Join(agent.node, tuple((p.node, p.pid) for p in joiners))
            self._carry_out(decide_join(self.view(), join), event)

    def _carry_out(self, decision: Decision, event: int) -> None:
        if isinstance(decision, Fail):
            self.life.fail(decision.reason)
        elif isinstance(decision, NeedStorage):
            d = decision
            why = why_unrebuildable(self.tracker) or d.why  # --erasure: which group lost too many
            if not self.storage_fallback(event, d.assignments, why, d.previous):
                self.life.fail(why)
        elif isinstance(decision, OpenEpoch):
            for (node, pid), rank in decision.promoted.items():
                self.registry.procs[(node, pid)].promote(rank)
            m = decision.membership
            self._amend(
                event,
                epoch=m.epoch,
                restore_step=m.restore_step,
                mode=m.mode,
                replacements=decision.replacements,
                shrunk_to=decision.shrunk_to,
                grown_to=decision.grown_to,
            )
            self._open(m, decision.tracker)
        else:  # Wait comes only from a loss, handled by ``recover``
            raise AssertionError(f"unexpected decision {decision!r}")

    def _open(self, membership: Membership, tracker: CommitTracker) -> None:
        membership = open_epoch(self.settings.placement, self.tracker, membership, tracker)
        self.membership, self.tracker = membership, tracker
        self.settings.world_size = membership.world_size
        self.done.clear()
        self.resumed.clear()
        log.info(
            "epoch %d opened (%s, layout %d): restore step %s, ranks %s",
            membership.epoch,
            membership.mode.value,
            membership.gen,
            membership.restore_step,
            membership.rank_nodes(),
        )
        self.registry.broadcast(EpochOpened(membership))

    # -- the durable tier as a holder --------------------------------------------------------
    def _restore_from_storage(
        self,
        ckpt: DurableCheckpoint,
        url: str,
        event: int,
        epoch: int,
        gen: int,
        assignments: dict[int, RankAssignment],
        previous: dict[int, int | None] | None = None,
        with_memory: bool = False,
    ) -> None:
        """Open ``epoch`` restoring durable step ``ckpt`` into ``assignments``, resharded.

        Normally the stored step becomes the committed state, storage its only holder.
        ``with_memory`` (the stored step *is* the committed step): storage joins the memory
        holders, and the planner reads it only where no memory copy survived."""
        m = ckpt.manifest
        if with_memory:
            assert self.tracker is not None
            for holders in self.tracker.committed_holders.values():
                holders.add(STORAGE)
        else:
            layouts = {r: [c.record.to_msg() for c in cs] for r, cs in m.ranks.items()}
            self.tracker = CommitTracker(
                epoch=epoch - 1,
                ranks=frozenset(layouts),
                gen=gen - 1,
                committed_step=m.step,
                committed_gen=gen - 1,
                committed_holders={r: {STORAGE} for r in layouts},
                committed_layouts=layouts,
            )
        self._amend(
            event,
            restore_step=m.step,
            mode=EpochMode.RESHARD,
            epoch=epoch,
            url=url,
            old_world=m.world_size,
        )
        membership, tracker = next_epoch(
            self.topology(),
            self.tracker,
            epoch,
            assignments,
            m.step,
            {},
            EpochMode.RESHARD,
            gen=gen,
            previous=previous or {},
            old_world=m.world_size,
            restore_url=url,
        )
        self._open(membership, tracker)

    def storage_fallback(
        self,
        event: int,
        assignments: dict[int, RankAssignment],
        why: str,
        previous: dict[int, int | None],
        partial: bool = True,
    ) -> bool:
        """No memory copy of some state survived: storage fills the gap.

        If the latest durable step is the committed step, only what no memory copy holds is
        read from storage, the rest from the peers' memory. Otherwise the job goes on from the
        durable step, and the steps after it are trained again (deterministically, so the
        bits come out the same). False if there is no durable tier, no checkpoint, or this
        epoch already reads from storage. ``partial=False``: always the whole job from storage
        (when a surviving memory copy turned out corrupt, memory is not trusted for that step).
        """
        m, tracker, config = self.membership, self.tracker, self._persist()
        if config is None or m is None or tracker is None or m.restore_url is not None:
            return False
        try:
            ckpt = durable_to_restore(config)
        except (CheckpointError, OSError) as exc:
            log.error("no memory copy survived (%s) and storage cannot help: %s", why, exc)
            return False
        url = config.url
        if partial and ckpt.step == tracker.committed_step and same_chunks(ckpt, tracker):
            log.warning(
                "no memory copy survived (%s); step %d is also in %s: reading what was lost "
                "from there and the rest from memory",
                why,
                ckpt.step,
                url,
            )
            self._amend(
                event,
                fallback=f"{why}; read the lost chunks of step {ckpt.step} from storage",
                partial=True,
            )
            self._restore_from_storage(
                ckpt, url, event, m.epoch + 1, m.gen + 1, assignments, previous, with_memory=True
            )
            return True
        log.warning(
            "no memory copy survived (%s); falling back to durable step %d in %s",
            why,
            ckpt.step,
            url,
        )
        self._amend(event, fallback=f"{why}; restored durable step {ckpt.step}")
        self._restore_from_storage(ckpt, url, event, m.epoch + 1, m.gen + 1, assignments)
        return True

    def storage_fallback_now(self, why: str, partial: bool) -> bool:
        """The current epoch cannot restore from memory (``why``): restore it from storage
        into the same processes. False if storage cannot help."""
        m = self.membership
        if m is None or not self.events or self.events[-1].epoch != m.epoch:
            return False
        return self.storage_fallback(
            len(self.events) - 1, dict(m.ranks), why, dict(m.previous), partial=partial
        )

    def _cold_start(self, assignments: dict[int, RankAssignment]) -> bool:
        """A job starting with a durable checkpoint restores its latest committed step from
        storage, resharded into this job's topology. False if there is none to restore."""
        config = self._persist()
        if config is None:
            return False
        try:
            ckpt = durable_to_restore(config)
        except NoCheckpoint as exc:
            log.info("%s: a fresh start", exc)
            return False
        except (CheckpointError, OSError) as exc:
            self.life.fail(f"cannot read the durable checkpoints in {config.url}: {exc}")
            return True
        event = self._record(
            RecoveryKind.COLD_START,
            frozenset(),
            frozenset(),
            f"restored step {ckpt.step} from {config.url}",
        )
        log.info(
            "cold start: restoring step %d (%d ranks) from %s into %d ranks",
            ckpt.step,
            ckpt.manifest.world_size,
            config.url,
            len(assignments),
        )
        self._restore_from_storage(ckpt, config.url, event, 0, 1, assignments)
        return True

    # -- what ranks report ---------------------------------------------------------------------
    def rank_resumed(
        self, epoch: int, rank: int, pulls: list[Pull], holds_committed: bool, node: int
    ) -> None:
        """``rank`` is stepping again; its restore's pulls join the epoch's record."""
        m = self.membership
        if m is None or epoch != m.epoch:
            raise StaleEpoch(f"resume report of epoch {epoch} is stale")
        self.resumed.add(rank)
        if self.events and self.events[-1].epoch == epoch:
            event = len(self.events) - 1
            self._amend(event, pulls=[*self.events[event].pulls, *pulls])
            if self.resumed == set(m.ranks):
                now = time.time()
                self._amend(event, resumed_at=now)
                log.info(
                    "recovered: every rank stepping again %.3f s after detection",
                    now - self.events[event].detected_at,
                )
        if holds_committed and self.tracker is not None:
            self.tracker.add_holder(rank, node)

    # -- the record ----------------------------------------------------------------------------
    def _record(
        self,
        kind: RecoveryKind,
        ranks: frozenset[int] | set[int],
        nodes: frozenset[int] | set[int],
        reason: str,
    ) -> int:
        """Record a membership change (before the first epoch: a cold start, nothing lost);
        return its index in ``events``."""
        old = self.membership
        self.events.append(
            RecoveryEvent(
                kind=kind,
                ranks=sorted(ranks),
                nodes=sorted(nodes),
                reason=reason,
                lost={r: old.ranks[r].node for r in sorted(ranks)} if old else {},
                detected_at=time.time(),
                from_epoch=old.epoch if old else -1,
            )
        )
        return len(self.events) - 1

    def _amend(self, index: int, **fields: Any) -> int:
        self.events[index] = replace(self.events[index], **fields)
        return index


def _on(decision: OpenEpoch, rank: int, old: dict[int, RankAssignment]) -> bool:
    """Whether the process that takes ``rank`` in ``decision`` is on the node it was lost on."""
    where = decision.replacements.get(rank)
    return where is not None and where[0] == old[rank].node
